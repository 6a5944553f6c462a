"""kvcore's pytest plugin (entry point ``pytest11: kvcore``): adds ``--kvcore-backend`` and nothing else.

It imports nothing heavy and runs no test unless a test module opts in by subclassing
``kvcore.testing.contract.TransferAgentContract``; see that module for usage.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcore", "kvcore transfer-agent contract suite")
    group.addoption(
        "--kvcore-backend",
        dest="kvcore_backend",
        default=None,
        help="backend name the kvcore contract suite runs against when a TransferAgentContract subclass "
        "does not set backend",
    )
