"""No pickle anywhere in kvcore/ and plugins/: no import of a pickling module, no pyobj sockets, no torch.load, no allow_pickle.

Checked on the syntax tree of every Python file (comments and docstrings cannot
hide or fake a use), so a new file is covered the day it is added.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for d in ("kvcore", "plugins") for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)
PICKLERS = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal", "jsonpickle"}
PYOBJ_CALLS = {"send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"}


def findings(tree: ast.AST) -> list[str]:
    """What in ``tree`` could unpickle (or pickle) data: one line per finding, with its line number."""
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            out.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in PYOBJ_CALLS:
                out.append(f"{node.lineno}: {name}()")
            if name == "__import__" and node.args and isinstance(node.args[0], ast.Constant):
                if str(node.args[0].value).split(".")[0] in PICKLERS:
                    out.append(f"{node.lineno}: __import__({node.args[0].value!r})")
            if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
                if str(node.args[0].value).split(".")[0] in PICKLERS:
                    out.append(f"{node.lineno}: import_module({node.args[0].value!r})")
            if isinstance(f, ast.Attribute) and f.attr == "load" and isinstance(f.value, ast.Name):
                if f.value.id == "torch":
                    out.append(f"{node.lineno}: torch.load()")
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    out.append(f"{node.lineno}: allow_pickle={ast.unparse(kw.value)}")
    return out


def test_the_checker_catches_each_pattern() -> None:
    """The checker is not vacuous: every forbidden form is found, and a harmless look-alike is not."""
    bad = """
import pickle
import cloudpickle as cp
from dill import loads
sock.recv_pyobj()
s.send_pyobj(x)
torch.load(path)
np.load(f, allow_pickle=True)
__import__("pickle")
importlib.import_module("dill")
"""
    assert len(findings(ast.parse(bad))) == 9
    assert findings(ast.parse("np.load(f, allow_pickle=False)\nimport json\nx = 'import pickle'\n")) == []


def test_sources_were_found() -> None:
    assert len(SOURCES) > 40 and any(p.name == "wire.py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle(path: Path) -> None:
    found = findings(ast.parse(path.read_text(), filename=str(path)))
    assert not found, f"{path.relative_to(ROOT)} uses pickle: " + "; ".join(found)
