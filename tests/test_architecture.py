"""The package's shape: no import circle, every module importable alone, the core names no plugin.

The import graph is read from the source (AST), counting every import a module makes: module-level imports,
those under ``if TYPE_CHECKING:`` (a type-only circle is still a circle a reader has to untangle) and those inside
functions (deferred, but still a tie that points one way or the other).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcore"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _module_level_imports(path: Path) -> set[str]:
    """kvcore modules ``path`` imports at import time (``from kvcore import x`` counts as ``kvcore.x`` when x is a
    module, else as the package ``kvcore``)."""
    return _imports_in(ast.parse(path.read_text()).body, path, inside_functions=False)


def _imports(path: Path) -> set[str]:
    """kvcore modules ``path`` imports anywhere: at import time and inside functions."""
    return _imports_in(ast.parse(path.read_text()).body, path, inside_functions=True)


def _imports_in(body: list[ast.stmt], path: Path, *, inside_functions: bool) -> set[str]:
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(node.module)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if inside_functions:
                    visit(node.body)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(body)
    return {m for m in found if m in MODULES} - {_module_name(path)}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    """The check below is not vacuous: a two-module and a three-module circle are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_circle_in_kvcore() -> None:
    """No circle, counting imports inside functions: a deferred import still ties two modules both ways."""
    graph = {name: _imports(path) for name, path in MODULES.items()}
    assert graph["kvcore.extension.plugins"] >= {
        "kvcore.extension.hookspecs",
        "kvcore.extension.registry",
    }  # the graph is really read
    assert "kvcore.extension.plugins" in graph["kvcore.layout.mapping"]  # imports inside functions are edges
    assert _cycles(graph) == []


def test_function_level_imports_are_read() -> None:
    """An import inside a function (or a method, or under ``if``/``try`` inside one) is an edge of the graph."""
    code = "def f():\n    if x:\n        from kvcore.errors import E\nclass C:\n    def m(self):\n        import kvcore.config\n"
    body = ast.parse(code).body
    assert _imports_in(body, PACKAGE / "x.py", inside_functions=True) == {"kvcore.errors", "kvcore.config"}
    assert _imports_in(body, PACKAGE / "x.py", inside_functions=False) == set()


def test_extension_layer_imports_only_downwards() -> None:
    """hookspecs -> registry -> errors, and the loader on top: none of them imports the loader back."""
    assert "kvcore.extension.plugins" not in _module_level_imports(MODULES["kvcore.extension.registry"])
    assert "kvcore.extension.plugins" not in _module_level_imports(MODULES["kvcore.extension.hookspecs"])
    assert "kvcore.extension.hookspecs" not in _module_level_imports(MODULES["kvcore.extension.registry"])


@pytest.mark.parametrize("module", sorted(set(MODULES) - {"kvcore.__main__"}))  # __main__ runs the CLI
def test_module_imports_alone(module: str) -> None:
    """Each module imports in a fresh interpreter with nothing imported before it."""
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


PLUGIN_BACKENDS = {"nixl", "ucx"}  # the names the core once hard-coded; a plugin states its own


def test_core_names_no_plugin() -> None:
    """Library code imports no plugin and names none of their backends: plugins contribute, the core lists.
    kvcore-native (the core's compiled helpers, no plugin) only inside a function."""
    offences = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                # kvcore-native is no plugin but the core's compiled helpers: imported only inside the function
                # that needs it (indented), so the core runs without the package
                offences += [
                    f"{name}: imports {m}"
                    for m in mods
                    if m.startswith("kvcore_") and not (m.split(".")[0] == "kvcore_native" and node.col_offset > 0)
                ]
            elif isinstance(node, ast.Name) and any(b in node.id.lower() for b in PLUGIN_BACKENDS):
                offences.append(f"{name}: name {node.id}")
            elif isinstance(node, ast.Attribute) and any(b in node.attr.lower() for b in PLUGIN_BACKENDS):
                offences.append(f"{name}: attribute {node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in PLUGIN_BACKENDS or node.value.startswith(("nixl_", "ucx_")):
                    offences.append(f"{name}: string {node.value!r}")
    assert offences == []


def _all_imports(path: Path) -> set[str]:
    """Every kvcore module ``path`` imports anywhere (inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m in MODULES}


def test_the_library_never_imports_the_tools() -> None:
    """kvcore.tools (CLI, demo, bench) builds on the library; nothing outside it imports it, not even lazily."""
    offences = {
        name: sorted(m for m in _all_imports(path) if m == "kvcore.tools" or m.startswith("kvcore.tools."))
        for name, path in MODULES.items()
        if not (name == "kvcore.tools" or name.startswith("kvcore.tools.") or name == "kvcore.__main__")
    }
    assert {k: v for k, v in offences.items() if v} == {}


#: What the runtime for kvcore's own processes (rank processes, namespaced hosts) may import besides itself: the
#: base modules only. The tools and kvcore.testing sit above it; it knows no transport, layout or role.
RUNTIME_MAY_IMPORT = {"kvcore.errors", "kvcore.hostinfo"}


def test_the_runtime_imports_only_the_base_modules() -> None:
    """kvcore.runtime sits below the tools and kvcore.testing and above nothing role-specific, even lazily."""
    offences = {
        name: sorted(m for m in _all_imports(path) if not m.startswith("kvcore.runtime") and m != "kvcore")
        for name, path in MODULES.items()
        if name.startswith("kvcore.runtime")
    }
    offences = {k: [m for m in v if m not in RUNTIME_MAY_IMPORT] for k, v in offences.items()}
    assert {k: v for k, v in offences.items() if v} == {}
    assert "kvcore.runtime.process" in MODULES  # the check is real


def test_only_tests_and_tools_import_the_test_support() -> None:
    """The library and the plugins' shipped code (their bench targets included) never import kvcore.testing: rank
    processes and hosts are kvcore.runtime's; kvcore.testing keeps the contract suite, the oracle, the scenario and
    the test harnesses built on the runtime, which tests and the tools (the demo verifies with the oracle) use."""
    shipped = sorted((ROOT / "plugins").glob("*/src/**/*.py"))
    library = [p for n, p in MODULES.items() if not n.startswith(("kvcore.testing", "kvcore.tools"))]
    offences = [
        f"{path.relative_to(ROOT)}: imports {m}"
        for path in [*library, *shipped]
        for m in sorted(_all_imports_anywhere(path))
        if m == "kvcore.testing" or m.startswith("kvcore.testing.")
    ]
    assert offences == []
    assert len(shipped) > 10 and any(p.name == "process.py" for p in library)  # both were read


def _all_imports_anywhere(path: Path) -> set[str]:
    """Every module name ``path`` imports (kvcore's or not), inside functions too."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_the_planes_have_their_folders() -> None:
    for package in (
        "extension",
        "control",
        "transport",
        "layout",
        "transceiver",
        "adapters",
        "runtime",
        "testing",
        "tools",
    ):
        assert (PACKAGE / package / "__init__.py").is_file(), package
    flat = sorted(p.stem for p in PACKAGE.glob("*.py"))
    # Only the engine-facing API, base modules every layer shares, and settings stay at the top.
    assert flat == [
        "__init__",
        "__main__",
        "config",
        "errors",
        "hostinfo",
        "msgbounds",
        "params",
    ], flat


#: The modules allowed to change a request's session, task or writer state: the tables themselves and each role's
#: settle module (every other module calls the settle module's methods).
SETTLE_MODULES = {
    "kvcore.transceiver.sessions",
    "kvcore.transceiver.send.settle",
    "kvcore.transceiver.receive.settle",
}
_SESSION_ENUMS = {"SessionState", "TaskState", "WriterState"}


def _state_writes(tree: ast.AST) -> list[str]:
    """Direct writes of a session, task or writer state in ``tree``: ``x.transition(...)``, ``x.settle(...)``,
    ``x.move(TaskState...)``, ``x.writers[...] = ...``, ``x.writers.clear()`` / ``.pop`` / ``.update``, and
    assignments to ``x.state``."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, owner = node.func.attr, node.func.value
            enum_args = [
                a.value.id
                for a in node.args
                if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name) and a.value.id in _SESSION_ENUMS
            ]
            if attr in ("transition", "settle") or (attr == "move" and enum_args):
                found.append(f"line {node.lineno}: .{attr}(...)")
            elif (
                isinstance(owner, ast.Attribute)
                and owner.attr == "writers"
                and attr in ("clear", "pop", "update", "setdefault", "popitem")
            ):
                found.append(f"line {node.lineno}: .writers.{attr}(...)")
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and t.value.attr == "writers":
                found.append(f"line {node.lineno}: .writers[...] =")
            elif isinstance(t, ast.Attribute) and t.attr == "state":
                found.append(f"line {node.lineno}: .state =")
    return found


def test_the_state_finder_finds_each_kind_of_write() -> None:
    """The check below is not vacuous: every kind of direct write it forbids is found."""
    code = (
        "s.transition(SessionState.DONE)\ns.settle(1, WriterState.OK)\nt.move(TaskState.FAILED)\n"
        "s.writers[r] = WriterState.ASKED\ns.writers.clear()\nt.state = TaskState.DONE\n"
        "peer.move(PeerState.LOST)\n"  # a peer's state is not a session's: allowed
    )
    assert len(_state_writes(ast.parse(code))) == 6


def test_only_the_settle_modules_change_session_states() -> None:
    """Sessions, tasks and writers change state in one module per role (through the tables), never elsewhere."""
    offences = {
        name: found
        for name, path in MODULES.items()
        if name.startswith(("kvcore.transceiver", "kvcore.adapters"))  # where sessions live and are read
        and name not in SETTLE_MODULES
        and (found := _state_writes(ast.parse(path.read_text())))
    }
    assert offences == {}
    assert _state_writes(ast.parse(MODULES["kvcore.transceiver.send.settle"].read_text()))  # the check is real


def test_the_receiver_does_not_import_the_sender() -> None:
    """The roles share what lies below both (digests, planning, sessions, link); neither imports the other."""
    for a, b in (("receive", "send"), ("send", "receive")):
        for name, path in MODULES.items():
            if name.startswith(f"kvcore.transceiver.{a}."):
                bad = {m for m in _all_imports(path) if m.startswith(f"kvcore.transceiver.{b}")}
                assert not bad, f"{name} imports {sorted(bad)}"
