"""The native lane behind a transceiver (``config.native_lane``): common push requests moved in C.

A lane (kvcore-native's ``kvcore_native.lane.Lane``) is one C thread per rank that owns ZeroMQ sockets of its
own and writes through a poster (NIXL or UCX in C) with no Python on its hops. It takes the common request only:
push mode, one layer group, no state slot, no layer-wise sending, no aux payload, no cached prefix, one writer
per receiver, and the two pools laid out alike (a *lane template*: fragment ``f`` of block ``b`` at
``base[f] + b * stride[f]`` on each side, checked from the planner's own plans). Everything else, and any
request the lane declines, takes the Python path unchanged.

The lifecycle stays Python's: the roles keep their sessions, tasks, writers, leases, fencing and tombstones, and
learn a lane request's end from its completion, drained by the engine's ``poll`` and ``wait`` and by the worker's
tick. The handshake carries what the lane needs: a generation rank sends its poster's descriptor with its
registration (``RegisterRankInfo.lane``); a context rank that can serve it on the lane answers with its lane's
endpoint and a token for it (``RegisterResult.lane_endpoint``, ``lane_token``). Only a peer that presents a
token may ask the lane, and only for a request the context rank offered there: a request travels under a digest
of its request id (:func:`lane_key`) and shows a digest of its ticket (:func:`lane_proof`); one with the wrong
ticket is declined by the lane, so it asks on the Python path and is refused there, as it would have been
without the lane, while the offer waits for the rightful receiver.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcore import errors as E
from kvcore import hostinfo
from kvcore.layout.mapping import RankPlacement
from kvcore.layout.peer import peer_ranks
from kvcore.params import BytesId, InternalId
from kvcore.transceiver.planning import plan_request

if TYPE_CHECKING:
    from kvcore_native.lane import Lane, LaneCompletion

    from kvcore.transceiver.link import Link
    from kvcore.transceiver.sessions import RxSession, TxSession

__all__ = ["LaneTemplate", "NativeLane", "lane_template", "lane_key", "lane_proof", "open_native_lane"]

log = logging.getLogger("kvcore.transceiver")

#: Cap on the generation side's asks waiting for a completion (the lane's own pending cap is the same).
MAX_ASKS = 65536


def lane_key(request_id: InternalId) -> bytes:
    """The 16-byte key a request travels under on the lane (its lane "ticket"): a digest of its request id, so the
    context's lane tells a request asked with the wrong ticket from one it has no offer for yet."""
    if isinstance(request_id, BytesId):
        raw = b"b" + request_id.b
    elif isinstance(request_id, int):
        raw = b"i" + str(request_id).encode()
    else:
        raw = b"s" + request_id.encode()
    return hashlib.blake2b(raw, digest_size=16, person=b"kvcore-lane-rid").digest()


def lane_proof(ticket: bytes) -> bytes:
    """What a requester shows the context's lane: a digest of the request's ticket (a request with another
    is declined there, and refused with the Python path's own error when it asks there)."""
    return hashlib.blake2b(ticket, digest_size=16, person=b"kvcore-lane-tkt").digest()


@dataclass(frozen=True)
class LaneTemplate:
    """How blocks of a source rank map onto blocks of a destination rank, fragment by fragment, for any block
    pair: fragment ``f`` of a request's ``i``-th block pair goes from ``src_base[f] + a * src_stride[f]`` to
    ``dst_base[f] + b * dst_stride[f]`` (``sizes[f]`` bytes), ``a`` and ``b`` the two sides' block ids."""

    group: str
    src_base: np.ndarray
    src_stride: np.ndarray
    dst_base: np.ndarray
    dst_stride: np.ndarray
    sizes: np.ndarray
    src_blocks: int
    dst_blocks: int
    #: What the source side's fragments are: equal digests, equal fragments in the same order.
    digest: bytes

    @property
    def bytes_per_block(self) -> int:
        return int(self.sizes.sum())


def lane_template(src: RankPlacement, dst: RankPlacement, mappers: Any) -> LaneTemplate | None:
    """The lane template of a rank pair, or None when their requests cannot take the lane.

    Found from the planner itself: the unmerged plans of block pairs (0, 0), (1, 0), (0, 1) give the bases and
    strides; the last pair is planned too and must fall where they say. Pairs with several layer groups, state
    pools, or fragments that do not move with their block are refused.
    """
    st, dt = src.page_table, dst.page_table
    groups = list(st.groups())
    if len(groups) != 1 or list(dt.groups()) != groups or st.state_slots() or dt.state_slots():
        return None
    if src.mamba is not None or dst.mamba is not None or any(v.window is not None for v in (*st.views, *dt.views)):
        return None
    g = groups[0]
    ns, nd = st.group_slots(g), dt.group_slots(g)
    if ns < 2 or nd < 2:
        return None

    def plan(a: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = plan_request(src, dst, {g: np.array([a])}, {g: np.array([b])}, mappers=mappers, merge=False)
        return p.src.astype(np.int64), p.dst.astype(np.int64), p.sizes.astype(np.int64)

    try:
        s00, d00, z00 = plan(0, 0)
        s10, d10, z10 = plan(1, 0)
        s01, d01, z01 = plan(0, 1)
        sll, dll, zll = plan(ns - 1, nd - 1)
    except E.KvcoreError:
        return None
    n = z00.size
    if n == 0 or any(z.size != n or not np.array_equal(z, z00) for z in (z10, z01, zll)) or int(z00.min()) <= 0:
        return None
    ss, ds = s10 - s00, d01 - d00
    if not (np.array_equal(d10, d00) and np.array_equal(s01, s00)):
        return None
    if not (np.array_equal(sll, s00 + (ns - 1) * ss) and np.array_equal(dll, d00 + (nd - 1) * ds)):
        return None
    if int(ss.min()) < 0 or int(ds.min()) < 0:
        return None
    u = np.uint64
    h = hashlib.blake2b(digest_size=16)
    for part in (s00, ss, z00, np.array([ns])):
        h.update(part.astype("<i8").tobytes())
    return LaneTemplate(
        group=g,
        src_base=s00.astype(u),
        src_stride=ss.astype(u),
        dst_base=d00.astype(u),
        dst_stride=ds.astype(u),
        sizes=z00.astype(u),
        src_blocks=ns,
        dst_blocks=nd,
        digest=h.digest(),
    )


@dataclass(frozen=True)
class _Route:
    """The generation side's way to one context rank's lane."""

    conn: int
    token: bytes
    layout: int
    group: str
    bytes_per_block: int


class NativeLane:
    """A rank's lane, its poster, and what the roles need of them; every method is safe from any thread."""

    def __init__(self, link: Link) -> None:
        from kvcore_native.posters import create_poster  # kvcore-native is optional: imported only when asked for

        self.link = link
        cfg = link.config
        host = link.messenger.endpoint.rsplit(":", 1)[0]
        loopback = hostinfo.is_loopback_host(host.removeprefix("tcp://").strip("[]"))
        self.poster = create_poster(
            link.agent.backend, f"{link.agent.name}-lane", dict(cfg.agent_options), local=loopback
        )
        try:
            for addr, length in link.page_table.regions():
                self.poster.register(addr, length)
            self.lane = self._open_lane(link, host, loopback)
        except BaseException:
            self.poster.close()
            raise
        self.descriptor = self.poster.descriptor()
        self._lock = threading.Lock()
        self._layouts: dict[bytes, int] = {}  # digest + side -> layout id (each layout is registered once)
        # Context side.
        self._canonical: LaneTemplate | None = None
        self._canonical_layout = -1
        self.offers: dict[bytes, Any] = {}  # lane key -> request id offered
        #: Lane keys declined, and when: kept like tombstones (``request_timeout_s``, at most
        #: ``max_inflight_requests``), so that a late request on the lane is sent to the Python path at once.
        self.declined: dict[bytes, float] = {}
        self.slots: dict[int, tuple[str, int]] = {}  # poster peer -> generation rank key
        # Generation side.
        self._conns: dict[str, int] = {}
        self.routes: dict[tuple[str, int], _Route] = {}  # (context rank's incarnation, rank) -> route
        self.asks: dict[bytes, tuple[Any, int, int]] = {}  # nonce -> (request id, context rank, bytes)
        if link.role == "context":
            t = lane_template(link.placement, link.placement, link.mappers)
            if t is not None:
                self._canonical = t
                self._canonical_layout = self._layout(t, source=True)

    def _open_lane(self, link: Link, host: str, loopback: bool) -> Lane:
        from kvcore_native.lane import Lane

        cfg = link.config
        # Its frames carry tokens, tickets and nonces, which the control plane keeps secret: off loopback they go
        # encrypted (CurveZMQ, keys of its own) wherever the control plane authenticates. On loopback nobody but
        # root reads them, and who may ask is the token's business (given over the authenticated control plane),
        # so the lane saves CURVE's cost there.
        return Lane(
            self.poster,
            bind=f"{host}:0",
            max_jobs=cfg.max_inflight_requests,
            max_pending=cfg.max_inflight_requests,
            curve=link.auth is not None and not loopback,
        )

    @property
    def endpoint(self) -> str:
        return str(self.lane.endpoint)

    def _layout(self, t: LaneTemplate, *, source: bool) -> int:
        key = t.digest + (b"s" if source else b"d") + t.dst_base.tobytes() + t.dst_stride.tobytes()
        with self._lock:
            got = self._layouts.get(key)
            if got is None:
                if source:
                    got = self.lane.layout(t.src_base, t.src_stride, t.sizes, t.src_blocks, t.digest)
                else:
                    got = self.lane.layout(t.dst_base, t.dst_stride, t.sizes, t.dst_blocks, t.digest)
                self._layouts[key] = got
            return got

    # --- context side -------------------------------------------------------------------------------------------

    def admit(self, key: tuple[str, int], info: Any, descriptor: bytes) -> tuple[str, bytes, bytes] | None:
        """A generation rank registered with its poster's ``descriptor``: the lane's endpoint, a token for it and
        the lane's CURVE key (empty: none), or None when its requests cannot take the lane (another layout,
        several writers, a refused descriptor)."""
        canonical = self._canonical
        if canonical is None or not descriptor:
            return None
        link = self.link
        try:
            # One receiver per request here (this rank writes to that rank alone), and this rank its only writer.
            receivers = peer_ranks(link.topology, info.topology, info.topology.dp_rank)
            writers = peer_ranks(info.topology, link.topology, link.topology.dp_rank)
            if receivers != [info.rank] or writers != [link.topology.rank]:
                return None
            t = lane_template(link.placement, info.placement, link.mappers)
            if t is None or t.digest != canonical.digest:
                return None
            slot = self.poster.connect(descriptor)
            token = self.lane.admit(slot)
        except E.KvcoreError as exc:
            log.info("generation rank %s takes the Python path: its lane registration failed: %s", key, exc)
            return None
        with self._lock:
            self.slots[slot] = key
        return self.endpoint, token, self.lane.public_key or b""

    def forget(self, token: bytes) -> None:
        """A generation rank is gone: its token is refused from now on."""
        if token:
            self.lane.revoke(token)

    def _unfit(self, s: TxSession) -> str:
        """Why a send session cannot take the lane ("" when it can)."""
        t = self._canonical
        if t is None:
            return "this rank's pools have no lane template"
        if s.mode != "push":
            return "pull mode"
        if s.layers_upto is not None:
            return "layer-wise sending"
        if s.aux:
            return "an aux payload (it travels with the Python path's result)"
        if s.state_slot >= 0:
            return "a state slot"
        if list(s.block_ids) != [t.group]:
            return "several layer groups"
        return ""

    def offer(self, s: TxSession, why_not: str = "") -> str:
        """Offer a send session on the lane if it can take it (lock held): "offered"; else "declined" (a request
        for it on the lane, now or later, is declined, and its receiver asks on the Python path); "cancelled":
        its receiver asked on the lane and cancelled before this (end the session)."""
        if not s.ticket:
            return "declined"  # nobody can ask for it on the lane: requests there carry a ticket
        why = why_not or self._unfit(s)
        key = lane_key(s.request_id)
        if key in self.declined:  # an earlier session under this request id ended here: this one replaces it
            del self.declined[key]
            self.lane.withdraw(key)
        if not why:
            try:
                offered = self.lane.offer(
                    key, lane_proof(s.ticket), self._canonical_layout, next(iter(s.block_ids.values()))
                )
            except E.KvcoreError as exc:
                self.link.counters["lane_refusals"] += 1
                why = str(exc)
            else:
                if not offered:
                    return "cancelled"
                self.offers[key] = s.request_id
                return "offered"
        self.decline(s, f"request {s.request_id!r} is served on the Python path: {why}")
        return "declined"

    def withdraw(self, s: TxSession) -> bool:
        """Take a send session's offer back: True when it is gone (no write of it can start), False when the lane
        is writing it or has ended it (its completion tells)."""
        key = lane_key(s.request_id)
        if self.lane.withdraw(key):
            self.offers.pop(key, None)
            return True
        return False

    def decline(self, s: TxSession, why: str) -> None:
        """A request on the lane for this session is answered "declined": its receiver asks on the Python path."""
        key = lane_key(s.request_id)
        try:
            self.lane.decline(key, why)
        except E.KvcoreError:
            return  # offered or declined already: the caller withdrew first, or a decline stands
        self.declined[key] = time.monotonic()
        while len(self.declined) > self.link.config.max_inflight_requests:
            oldest = next(iter(self.declined))
            del self.declined[oldest]
            self.lane.withdraw(oldest)

    def end(self, s: TxSession) -> None:
        """A send session ended (lock held): its offer goes, unless the lane is writing it (its completion ends
        it), and a decline takes its place: a receiver asking on the lane now hears the end on the Python path."""
        if s.lane:
            if not self.withdraw(s):
                return
            s.lane = False
        if s.ticket:
            self.decline(s, f"request {s.request_id!r} ended {s.state.value} here: ask on the Python path")

    def expire(self, now: float) -> None:
        """Drop the declines older than ``request_timeout_s`` (the worker's tick)."""
        ttl = self.link.config.request_timeout_s
        while self.declined:
            key, at = next(iter(self.declined.items()))
            if now - at < ttl:
                break
            del self.declined[key]
            self.lane.withdraw(key)

    def take_offer(self, ticket: bytes) -> Any:
        """The request id offered under lane key ``ticket`` (None: none), forgotten."""
        return self.offers.pop(ticket, None)

    def offered_bytes(self, s: TxSession) -> int:
        """The bytes the lane writes for an offered session."""
        t = self._canonical
        return 0 if t is None else len(s.block_ids[t.group]) * t.bytes_per_block

    # --- generation side ----------------------------------------------------------------------------------------

    def learn(self, endpoint: str, r: int, ctx_info: Any, lane_endpoint: str, token: bytes, key: bytes) -> None:
        """Context rank ``r`` (``ctx_info``) of the instance at ``endpoint`` accepted us: route its requests to its
        lane, or (no lane offered) to the Python path. Routes belong to that incarnation of the rank."""
        with self._lock:
            self.routes.pop((ctx_info.incarnation, r), None)
        if not lane_endpoint or len(token) != 16:
            return
        link = self.link
        try:
            if peer_ranks(link.topology, ctx_info.topology, ctx_info.topology.dp_rank) != [r]:
                return
            t = lane_template(ctx_info.placement, link.placement, link.mappers)
            if t is None:
                return
            layout = self._layout(t, source=False)
            with self._lock:  # one hold: drop_routes cannot close the connection between its lookup and the route
                conn = self._conns.get(lane_endpoint)
                if conn is None:
                    conn = self.lane.connect(lane_endpoint, server_key=key or None)
                    self._conns[lane_endpoint] = conn
                self.routes[(ctx_info.incarnation, r)] = _Route(conn, token, layout, t.group, t.bytes_per_block)
        except E.KvcoreError as exc:
            log.info("context rank %d at %s takes the Python path: %s", r, endpoint, exc)
            return

    def ask(self, s: RxSession, r: int) -> bool:
        """Ask context rank ``r`` for receive session ``s`` on the lane if it qualifies (lock held)."""
        inst = s.instance
        route = self.routes.get((inst.ranks[r].incarnation, r)) if inst is not None else None
        if (
            route is None
            or s.mode != "push"
            or s.state_slot >= 0
            or s.cached_tokens
            or not s.ticket
            or list(s.block_ids) != [route.group]
            or len(self.asks) >= MAX_ASKS
        ):
            return False
        ids = s.block_ids[route.group]
        remaining_ms = max(1, int((s.deadline - time.monotonic()) * 1000))
        nonce = s.nonces[r]
        try:
            self.lane.request(
                route.conn,
                route.token,
                lane_key(s.request_id),
                lane_proof(s.ticket),
                nonce,
                route.layout,
                ids,
                remaining_ms,
            )
        except E.KvcoreError as exc:
            self.link.counters["lane_refusals"] += 1
            log.debug("request %r takes the Python path: %s", s.request_id, exc)
            return False
        self.asks[nonce] = (s.request_id, r, len(ids) * route.bytes_per_block)
        return True

    def cancel(self, nonce: bytes) -> None:
        """Ask the writer to drop a lane request not yet written (its completion still comes)."""
        if nonce in self.asks:
            self.lane.cancel(nonce)

    def drop_ask(self, nonce: bytes) -> None:
        """A receive session was released with this ask unanswered (its writer fenced): the lane stops waiting."""
        if self.asks.pop(nonce, None) is not None:
            self.lane.forget(nonce)

    def drop_routes(self, incarnations: set[str]) -> None:
        """A context instance is gone: its ranks' routes go (a new incarnation registers anew), and so do the
        connections to lanes no route uses any more (each closes once the asks pending there ended)."""
        with self._lock:
            for key in [k for k in self.routes if k[0] in incarnations]:
                del self.routes[key]
            used = {route.conn for route in self.routes.values()}
            idle = [(ep, conn) for ep, conn in self._conns.items() if conn not in used]
            for ep, _ in idle:
                del self._conns[ep]
        for _, conn in idle:
            self.lane.disconnect(conn)

    # --- both ---------------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The lane's part of ``Transceiver.stats()``: what it holds (back to zero once every request ended:
        offers and asks waiting, writes in flight, the roles' maps of them) and its counters (``*_total``)."""
        st = self.lane.stats()
        return {
            "lane_waiting": int(st["jobs_waiting"]),
            "lane_declines": int(st["declines"]),  # a bounded cache, like tombstones
            "lane_writes": int(st["writes_in_flight"]),
            "lane_pending": int(st["pending"]),
            "lane_offers": len(self.offers),
            "lane_asks": len(self.asks),
            "lane_connections": int(st["connections"]),  # lanes this one asks: a bounded cache
            "lane_requests_total": int(st["requests_served"]) + int(st["results_received"]),
            "lane_writes_total": int(st["posts"]),
            "lane_rejected_frames_total": int(st["rejected_frames"]),
        }

    def completions(self) -> list[LaneCompletion]:
        return list(self.lane.completions())

    def wait(self, timeout_s: float) -> bool:
        return bool(self.lane.wait(timeout_s))

    def poke(self) -> None:
        self.lane.poke()

    def close(self) -> None:
        self.lane.close()
        self.poster.close()


def open_native_lane(link: Link) -> NativeLane | None:
    """The rank's lane when ``config.native_lane`` asks for one and this backend and installation have it; else
    None, with a log line saying why (the Python path serves every request then)."""
    if not link.config.native_lane:
        return None
    backend = link.agent.backend
    try:
        from kvcore_native.posters import POSTER_BACKENDS  # kvcore-native says which backends it has posters for
    except ImportError as exc:
        log.warning("native_lane: kvcore-native is not installed (%s); the Python path serves every request", exc)
        return None
    if backend not in POSTER_BACKENDS:
        log.warning("native_lane: kvcore-native has no poster for the %r backend (it has %s); the Python path "
                    "serves every request", backend, ", ".join(POSTER_BACKENDS))  # fmt: skip
        return None
    try:
        return NativeLane(link)
    except E.KvcoreError as exc:
        log.warning("native_lane: the lane could not start (%s); the Python path serves every request", exc)
    return None
