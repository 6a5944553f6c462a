"""pytest plugin for ``mutation/mutations.py``: every ``kvcore`` module a run imports must come from the mutated copy.

A module that exists in the installed (editable) tree but not in the copy would otherwise be imported from the
installed tree behind the copy's back (say, a module the copy deleted); a run that mixes trees proves nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


def _strays() -> list[str]:
    root = Path(os.environ["KVCORE_MUTATION_COPY"]).resolve()
    out = []
    for name, mod in list(sys.modules.items()):
        if name != "kvcore" and not name.startswith("kvcore."):
            continue
        file = getattr(mod, "__file__", None)
        if file and root not in Path(file).resolve().parents:
            out.append(f"{name} from {file}")
    return out


def pytest_collection_finish(session: pytest.Session) -> None:
    strays = _strays()
    if strays:
        raise pytest.UsageError(f"kvcore modules imported from outside the mutated copy: {strays}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    strays = _strays()
    if strays:
        print(f"\nkvcore modules imported from outside the mutated copy: {strays}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.USAGE_ERROR
