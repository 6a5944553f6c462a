"""The native per-request path of one process: a lane (a C thread with ZeroMQ sockets of its own) moving KV
through a poster (:class:`kvcore_native.ucx.UcxPoster`, :class:`kvcore_native.nixl.NixlPoster`) with no Python
on its hops.

The context side admits the generation side's poster peers (:meth:`Lane.admit` gives each a token), describes
its pool once (:meth:`Lane.layout`) and offers each request's source blocks under the request's ticket, with the
proof its requester must show (:meth:`Lane.offer`). The generation side connects to the context's lane
(:meth:`Lane.connect`) and asks for a request with the token, the ticket, the proof, a nonce of its own and its
destination blocks (:meth:`Lane.request`). The context's thread joins the request to its offer (whichever came
first waits for the other, bounded), checks the proof (a request with another one is answered "declined" and the
offer waits for its rightful requester) and that the fragments agree, posts one WRITE and answers; both sides
learn the end from :meth:`Lane.completions`.
Everything a peer sends is checked in C before use; the wire format is in ``_lane.c``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from kvcore_native import _lane
from kvcore_native.errors import NativeLaneError
from kvcore_native.floor import libzmq_path

__all__ = ["Lane", "LaneCompletion", "NativeLaneError", "Poster", "MAX_FRAGMENTS"]

#: The most fragments one lane request may hold.
MAX_FRAGMENTS: int = _lane.MAX_FRAGS

_loaded = False
_load_lock = threading.Lock()


class Poster(Protocol):
    """What a lane needs of a poster: its capsule (``kvn_poster.h``)."""

    backend: str

    def capsule(self) -> object: ...


class LaneCompletion(NamedTuple):
    """The end of one request on this lane.

    ``side`` is "context" (this lane wrote it; ``peer`` is the requester's poster peer) or "generation" (this
    lane asked for it; ``peer`` is the connection). ``status``: "ok", "failed", "cancelled", "declined"
    (generation only: the context declined the request on the lane; nothing moved, ask on the slower path) or
    "timed_out" (generation only: no answer within the request's timeout, so the write may still land).
    """

    side: str
    ticket: bytes
    nonce: bytes
    peer: int
    status: str
    error: str


def _load() -> None:
    global _loaded
    with _load_lock:
        if not _loaded:
            _lane.set_error_type(NativeLaneError)
            try:
                _lane.load(libzmq_path())
            except OSError as exc:
                raise NativeLaneError(str(exc)) from exc
            _loaded = True


def _ids(block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    ids = np.ascontiguousarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise NativeLaneError(f"block ids must be one-dimensional, not of shape {ids.shape}")
    if ids.size and int(ids.min()) < 0:
        raise NativeLaneError(f"block id {int(ids.min())} is negative")
    return ids


class Lane:
    """One process's native lane. ``bind`` is its ROUTER's endpoint (loopback by default, a free port with
    ``:0``); the caps bound what peers may make it hold: ``max_jobs`` offers and waiting requests,
    ``max_job_bytes`` of their fragment lists, ``max_pending`` requests this side asked and not yet answered.

    A write moves in pieces of about ``piece_bytes`` (a fragment is never cut), one piece in flight per request:
    the thread serves its sockets between pieces, so a request arriving beside a large one waits for one piece.

    With ``curve`` (the default) every socket speaks CurveZMQ: the lane serves with a key pair of its own
    (:attr:`public_key`, which peers pass to :meth:`connect`) and asks with another, so its traffic (tokens,
    tickets, nonces) is encrypted and a requester knows it reached the lane it was told of. Who may ask is the
    token's business (:meth:`admit`), not the key's.
    """

    def __init__(
        self,
        poster: Poster,
        *,
        bind: str = "tcp://127.0.0.1:0",
        max_jobs: int = 65536,
        max_job_bytes: int = 256 * 1024 * 1024,
        max_pending: int = 65536,
        curve: bool = True,
        piece_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        _load()
        if bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        self.poster = poster
        keys: tuple[bytes | None, bytes | None, bytes | None] = (None, None, None)
        self.public_key: bytes | None = None
        if curve:
            import zmq
            from zmq.utils import z85

            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            self.public_key = z85.decode(server_public)
            keys = (z85.decode(server_secret), z85.decode(client_public), z85.decode(client_secret))
        self._lane = _lane.Lane(
            poster, poster.capsule(), bind, max_jobs, max_job_bytes, max_pending, *keys, piece_bytes
        )

    @property
    def endpoint(self) -> str:
        """Where peers connect (``tcp://host:port``)."""
        return self._lane.endpoint

    def layout(
        self,
        bases: Sequence[int] | np.ndarray,
        strides: Sequence[int] | np.ndarray,
        sizes: Sequence[int] | np.ndarray,
        blocks: int,
        digest: bytes,
    ) -> int:
        """A pool's shape: block ``b`` is fragments ``bases[f] + b * strides[f]`` of ``sizes[f]`` bytes, for
        ``b < blocks``. Returns its id for :meth:`offer` and :meth:`request`.

        ``digest`` (16 bytes) names the source layout the fragments pair with: the context gives its offers'
        layout the digest of its own fragments; the generation gives its destination layout the digest of the
        source fragments it planned against. A request joins its offer only when the two are equal, so the i-th
        destination fragment always receives the i-th source fragment it was planned for.
        """
        u = np.uint64
        return self._lane.layout(
            np.ascontiguousarray(bases, dtype=u),
            np.ascontiguousarray(strides, dtype=u),
            np.ascontiguousarray(sizes, dtype=u),
            int(blocks),
            digest,
        )

    def admit(self, peer: int) -> bytes:
        """Context side: poster peer ``peer`` may ask this lane; it must present the returned 16-byte token."""
        return self._lane.admit(peer)

    def revoke(self, token: bytes) -> bool:
        """The token is refused from now on (a request already joined to its offer goes on)."""
        return self._lane.revoke(token)

    def offer(self, ticket: bytes, proof: bytes, layout: int, block_ids: Sequence[int] | np.ndarray) -> bool:
        """Context side: the source blocks of the request whose ticket is ``ticket`` (16 bytes), for the requester
        that presents ``proof`` (16 bytes; kvcore: the ticket names the request, the proof is a digest of its
        secret). A request with another proof is answered "declined" (its slower path refuses it) and the offer
        stays. False: its receiver asked on this lane and cancelled before the offer came; nothing is offered
        (end the request)."""
        return self._lane.offer(ticket, proof, layout, _ids(block_ids))

    def decline(self, ticket: bytes, why: str) -> None:
        """Context side: a request with this ticket (waiting now or to come) is answered "declined" with
        ``why``: nothing moves, the requester asks on its slower path. No completion follows on this side;
        :meth:`withdraw` drops a decline no request came for."""
        self._lane.decline(ticket, why)

    def withdraw(self, ticket: bytes) -> bool:
        """Context side: True, the offer (or decline) is gone (a request waiting for an offer is answered
        "cancelled"; no completion follows). False: its write is in flight, or nothing was offered; the
        completion tells the end."""
        return self._lane.withdraw(ticket)

    def connect(self, endpoint: str, server_key: bytes | None = None) -> int:
        """Generation side: a connection to the lane at ``endpoint`` (whose :attr:`public_key` is
        ``server_key``: required when this lane speaks CURVE, refused when not), for :meth:`request`."""
        return self._lane.connect(endpoint, server_key)

    def request(
        self,
        conn: int,
        token: bytes,
        ticket: bytes,
        proof: bytes,
        nonce: bytes,
        layout: int,
        block_ids: Sequence[int] | np.ndarray,
        timeout_ms: int,
    ) -> None:
        """Generation side: ask the lane behind ``conn`` to write the request with ``ticket`` into these
        destination blocks, presenting ``proof`` (what its offer wants; another is answered "declined").
        ``nonce`` (16 bytes, secret) names the request in its completion. A second request for a ticket that
        waits for its offer is answered "declined" too: each takes its slower path, which tells them apart."""
        self._lane.request(conn, token, ticket, proof, nonce, layout, _ids(block_ids), timeout_ms)

    def disconnect(self, conn: int) -> bool:
        """Generation side: ask the lane behind ``conn`` no more. Requests pending there still end (answered, or
        timed out); the socket closes once none is left. False: no such connection, or disconnected already."""
        return self._lane.disconnect(conn)

    def cancel(self, nonce: bytes) -> bool:
        """Generation side: ask the context to drop a request not yet written; its completion still comes
        ("cancelled", or the write's own end). False: no such request is pending."""
        return self._lane.cancel(nonce)

    def forget(self, nonce: bytes) -> bool:
        """Generation side: drop a pending request with no completion, once its requester settled it otherwise
        (its writer was fenced); a late answer is then dropped and counted. False: no such request is pending."""
        return self._lane.forget(nonce)

    def completions(self) -> list[LaneCompletion]:
        """The requests that ended since the last call, in order."""
        return [LaneCompletion(*c) for c in self._lane.completions()]

    def wait(self, timeout_s: float) -> bool:
        """Wait (GIL released) until a completion is queued: True, or False when ``timeout_s`` passed."""
        return self._lane.wait(timeout_s)

    def poke(self) -> None:
        """Wake a thread in :meth:`wait` (it returns True): news came from elsewhere."""
        self._lane.poke()

    def stats(self) -> dict[str, int | str]:
        """Counters and occupancy: jobs waiting, writes in flight, pending requests, frames rejected..."""
        return self._lane.stats()

    def close(self) -> None:
        """Stop the thread and close the sockets; writes in flight are handed back to the poster (its close
        drives them to their end). Again: nothing."""
        self._lane.close()
