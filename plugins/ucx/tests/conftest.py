"""Shared fixtures for kvcore-ucx tests: skip cleanly (with the reason) when UCX cannot be loaded."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ucp():  # type: ignore[no-untyped-def]
    """The loaded UCX library, or a skip naming why it cannot be loaded."""
    from kvcore_ucx import _ucp

    try:
        return _ucp.load()
    except _ucp.UcxUnavailableError as exc:
        pytest.skip(f"UCX libraries cannot be loaded: {exc}")
