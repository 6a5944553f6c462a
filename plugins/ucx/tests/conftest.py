"""Shared fixtures for kvcore-ucx tests; these tests run only where kvcore-ucx is installed, so UCX must load."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ucp():  # type: ignore[no-untyped-def]
    """The loaded UCX library; a broken UCX install fails the tests (the plugin is installed: it must work)."""
    from kvcore_ucx import _ucp

    return _ucp.load()
