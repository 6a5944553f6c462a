"""Run kvcore's transfer-agent contract suite against the installed ``cma`` backend."""

import pytest

pytest.importorskip("kvcore_cma", reason="install the example first: pip install ./docs/examples/kvcore-cma")

from kvcore.testing.contract import *  # noqa: F403

KVCORE_CONTRACT_BACKEND = "cma"
