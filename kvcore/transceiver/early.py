"""A context rank's early requests: receivers' messages for requests its engine has not started yet.

A generation rank may ask for a request (``RequestData``, or ``PullDone`` after a pull read) before the context's
engine called ``start_send`` for it. The context keeps such messages until the request starts, its receiver takes
them back, or they expire, within four caps: messages in total and per generation rank, bytes in total and per
generation rank (so one peer, a stranger's flood among them, cannot fill the store for the others). Every operation
costs the same with 4096 messages kept as with one: admission reads counters, expiry pops a heap.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.params import InternalId
from kvcore.transceiver.sessions import TimerHeap

__all__ = ["EarlyMessage", "EarlyEntry", "EarlyRequests", "early_size"]

EarlyMessage = wire.RequestData | wire.PullDone | wire.ExposeRequest
#: ``(expiry, message, source)``: kept until ``time.monotonic()`` passes ``expiry``.
EarlyEntry = tuple[float, EarlyMessage, Source]
_Key = tuple[str, int]


def early_size(msg: EarlyMessage) -> int:
    """Bytes an early message is charged against the byte cap (its block lists; a PullDone or ExposeRequest a
    fixed 256)."""
    if isinstance(msg, wire.RequestData):
        return len(msg.block_ids) + sum(len(v) for v in msg.group_block_ids.values())
    return 256


def _sender(msg: EarlyMessage) -> _Key:
    return (msg.gen_instance, msg.gen_rank)


class EarlyRequests:
    """Early messages by request id, in arrival order per request, with their caps and their expiry."""

    def __init__(
        self, max_messages: int, max_per_peer: int, max_bytes: int, max_bytes_per_peer: int | None = None
    ) -> None:
        """``max_bytes_per_peer``: one generation rank's share of ``max_bytes`` (None: all of it)."""
        self.max_messages, self.max_per_peer, self.max_bytes = max_messages, max_per_peer, max_bytes
        self.max_bytes_per_peer = max_bytes if max_bytes_per_peer is None else min(max_bytes, max_bytes_per_peer)
        self._by_rid: dict[InternalId, list[EarlyEntry]] = {}
        self._per_peer: Counter[_Key] = Counter()
        self._bytes_per_peer: Counter[_Key] = Counter()
        self._count = 0
        self.bytes = 0
        self._expiry = TimerHeap()  # request ids under the earliest expiry of their messages

    def __len__(self) -> int:
        """Messages kept."""
        return self._count

    def __contains__(self, rid: object) -> bool:
        return rid in self._by_rid

    def holds(self, key: _Key) -> bool:
        """Whether a message of generation rank ``key`` is kept."""
        return self._per_peer.get(key, 0) > 0

    def refusal(self, msg: EarlyMessage) -> str | None:
        """Why ``msg`` may not be kept (a cap is reached), or None."""
        key, size = _sender(msg), early_size(msg)
        if self._count >= self.max_messages or self.bytes + size > self.max_bytes:
            return f"{self._count} requests ({self.bytes} bytes) already wait for start_send here"
        if self._per_peer[key] >= self.max_per_peer or self._bytes_per_peer[key] + size > self.max_bytes_per_peer:
            return (
                f"generation rank {key} has {self._per_peer[key]} requests ({self._bytes_per_peer[key]} bytes) "
                f"waiting for start_send here already; its share is {self.max_per_peer} requests and "
                f"{self.max_bytes_per_peer} bytes (max_early_per_peer, max_early_bytes_per_peer), this one is "
                f"{size} bytes"
            )
        return None

    def add(self, msg: EarlyMessage, source: Source, expiry: float) -> None:
        """Keep ``msg`` until ``expiry`` (the caller checked ``refusal`` first)."""
        lst = self._by_rid.setdefault(msg.request_id, [])
        lst.append((expiry, msg, source))
        self._count += 1
        key, size = _sender(msg), early_size(msg)
        self._per_peer[key] += 1
        self._bytes_per_peer[key] += size
        self.bytes += size
        self._expiry.file(msg.request_id, expiry)

    def _forget(self, entries: list[EarlyEntry]) -> None:
        for _, msg, _ in entries:
            key, size = _sender(msg), early_size(msg)
            self._count -= 1
            self.bytes -= size
            self._per_peer[key] -= 1
            self._bytes_per_peer[key] -= size
            if self._per_peer[key] <= 0:
                del self._per_peer[key]
                del self._bytes_per_peer[key]

    def pop(self, rid: InternalId) -> list[EarlyEntry]:
        """Every message kept for ``rid``, in arrival order, taken out."""
        entries = self._by_rid.pop(rid, [])
        self._forget(entries)
        return entries

    def take(self, rid: InternalId, keep: Callable[[EarlyEntry], bool]) -> list[EarlyEntry]:
        """Take out the messages of ``rid`` for which ``keep`` is False; returns them in arrival order."""
        entries = self._by_rid.get(rid)
        if not entries:
            return []
        gone = [e for e in entries if not keep(e)]
        if gone:
            rest = [e for e in entries if keep(e)]
            if rest:
                self._by_rid[rid] = rest
            else:
                del self._by_rid[rid]
            self._forget(gone)
        return gone

    def drop_peer(self, key: _Key) -> None:
        """Forget every message a generation rank sent (it is gone)."""
        if not self._per_peer.get(key):
            return
        for rid in list(self._by_rid):
            self.take(rid, lambda e: _sender(e[1]) != key)

    def expired(self, now: float) -> list[EarlyEntry]:
        """Take out and return every message whose expiry passed (``now > expiry``), oldest request first."""
        out: list[EarlyEntry] = []
        for rid in self._expiry.take(now):
            entries = self._by_rid.get(rid)
            if not entries:
                continue
            gone = self.take(rid, lambda e: not now > e[0])
            out.extend(gone)
            rest = self._by_rid.get(rid)
            if rest:
                self._expiry.file(rid, min(e[0] for e in rest))
        if len(self._expiry) > 2 * len(self._by_rid) + 1024:
            self._expiry.rebuild((min(e[0] for e in lst), rid) for rid, lst in self._by_rid.items())
        return out
