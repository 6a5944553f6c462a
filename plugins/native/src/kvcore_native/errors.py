"""The errors kvcore-native raises, each a ``kvcore.errors.KvcoreError``."""

from __future__ import annotations

from kvcore.errors import KvcoreError

__all__ = ["NativeLaneError", "NativeTransportError"]


class NativeTransportError(KvcoreError):
    """A native poster refused or failed: its library missing or refused, a malformed peer descriptor, a write
    outside registered memory, a dead peer, a write that did not end in time."""


class NativeLaneError(KvcoreError):
    """A native lane refused a call: a malformed argument (a key of the wrong size, a block outside its layout),
    a cap reached, an unknown connection, a closed lane."""
