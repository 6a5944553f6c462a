"""Make the core's independent test oracle (tests/kv_oracle.py) importable from the mixers' tests."""

from __future__ import annotations

import sys
from pathlib import Path

_CORE_TESTS = Path(__file__).resolve().parents[3] / "tests"
if str(_CORE_TESTS) not in sys.path:
    sys.path.insert(0, str(_CORE_TESTS))
