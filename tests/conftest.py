"""Fixtures shared by the test modules of this directory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Things to close at the end of a test, whatever happens (processes and in-process ranks), newest first."""
    items: list[Any] = []
    yield items
    for it in reversed(items):
        try:
            it.close()
        except Exception:
            pass
