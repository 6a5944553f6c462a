"""What the facade needs from a role (sender or receiver), and the argument checks both roles share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvcore import errors as E
from kvcore.params import InternalId, check_request_id
from kvcore.transceiver.link import Handler, Link
from kvcore.transceiver.sessions import RequestStatus, Session, SessionTable

__all__ = ["Role", "check_request_id", "check_block_ids", "max_slot"]


def check_block_ids(block_ids: Iterable[int] | np.ndarray, num_slots: int, what: str) -> np.ndarray:
    """Block ids as int64, refusing non-integers, negatives, ids ``>= num_slots`` and duplicates (``LayoutError``).

    A duplicate destination id would let one block overwrite another and still end DONE.
    """
    raw = block_ids if isinstance(block_ids, np.ndarray) else np.asarray(list(block_ids))
    if raw.ndim != 1:
        raise E.LayoutError(f"{what}: expected a flat list of block ids, got shape {raw.shape}")
    if raw.size == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype.kind not in "iu":
        bad = next((v for v in raw.tolist() if isinstance(v, bool) or not isinstance(v, int)), raw[0])
        raise E.LayoutError(f"{what}: expected integer block ids, got {bad!r} ({raw.dtype})")
    lo, hi = int(raw.min()), int(raw.max())
    if lo < 0 or hi >= num_slots:
        raise E.LayoutError(f"{what}: block ids must be in 0..{num_slots - 1}, got {lo if lo < 0 else hi}")
    ids = raw.astype(np.int64)
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        dup = int(uniq[np.argmax(counts > 1)])
        raise E.LayoutError(f"{what}: block id {dup} appears {int(counts.max())} times; each block may appear once")
    return ids


def max_slot(link_or_table: Any, state: bool = False) -> int:
    """Slots of the token views' pools (block ids), or of the state views' pools (``state=True``)."""
    table = getattr(link_or_table, "page_table", link_or_table)
    pools = {p for v in table.views if v.is_state == state for p in v.pools}
    return min((table.pools[p].num_slots for p in pools), default=0)


class Role(ABC):
    """A transceiver role: its sessions, its handlers, its timers; the facade does agreement and release."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.config = link.config

    @property
    @abstractmethod
    def sessions(self) -> SessionTable[Session]:
        """Live sessions by request id, and those that ended (read under ``link.lock``)."""

    @abstractmethod
    def handlers(self) -> dict[type, Handler]: ...

    @abstractmethod
    def tick(self, now: float) -> None:
        """Timers (worker thread): transfers, deadlines, fencing, expiry. Nothing waits for new traffic."""

    @abstractmethod
    def busy(self) -> bool: ...

    @abstractmethod
    def cancel(self, rid: InternalId, reason: str) -> bool: ...

    def lane_drain(self) -> None:
        """Settle what the native lane (``kvcore.transceiver.native``) ended since the last call (any thread)."""
        native = self.link.native
        if native is None:
            return
        done = native.completions()
        if done:
            with self.link.lock:
                for c in done:
                    self._lane_completion(c)

    def _lane_completion(self, c: Any) -> None:
        """One of the native lane's completions (lock held): the role settles what it says."""

    @abstractmethod
    def release(self, rid: InternalId) -> None:
        """The instance agreed ``rid`` is terminal and quiescent and reported it released (lock held)."""

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def close(self) -> None:
        """Unload every peer (after the worker stopped)."""

    def peer_name(self, session: Any) -> str:
        """The peer instance a session deals with, for metric labels ("" when none is known)."""
        return ""

    def goodbye_endpoints(self) -> list[str]:
        """The peer endpoints to tell that this rank is closing (``wire.Goodbye``), lock held."""
        return []

    def on_disconnect(self, endpoint: str) -> None:
        """A DEALER of ours lost its peer (messenger I/O thread)."""

    def on_connect(self, endpoint: str) -> None:
        """A DEALER of ours (re)connected (messenger I/O thread)."""

    def on_auth_failed(self, endpoint: str, why: str) -> None:
        """Our DEALER to ``endpoint`` failed its CURVE handshake and was closed (messenger I/O thread)."""

    def on_bad_frame(self, source: Any, exc: E.KvcoreError) -> None:
        """A frame that could not be decoded arrived (messenger I/O thread); the messenger already answered it."""

    def admit(self) -> None:
        live = len(self.sessions)
        if live >= self.config.max_inflight_requests:
            raise E.ResourceExhaustedError(
                f"{live} requests in flight reach max_inflight_requests={self.config.max_inflight_requests}"
            )

    def check_state_slot(self, rid: InternalId, state_slot: int) -> None:
        if isinstance(state_slot, bool) or not isinstance(state_slot, (int, np.integer)):
            raise E.LayoutError(f"request {rid}: state_slot must be an integer (-1: none), got {state_slot!r}")
        if state_slot >= 0 and state_slot >= max_slot(self.link, state=True):
            raise E.LayoutError(
                f"request {rid}: state_slot {state_slot} is outside 0..{max_slot(self.link, state=True) - 1} "
                "(or this rank holds no state pools)"
            )

    def status(self, rid: InternalId) -> RequestStatus | None:
        """Where ``rid`` stands on this rank (None when unknown here or released): a terminal state, else the role's
        reading of its live session."""
        with self.link.lock:
            s = self.sessions.get(rid)
            if s is None:
                return None
            return RequestStatus(s.state.value) if s.terminal else self._live_status(s)

    @abstractmethod
    def _live_status(self, s: Any) -> RequestStatus:
        """The status of a live (not terminal) session of this role (lock held)."""
