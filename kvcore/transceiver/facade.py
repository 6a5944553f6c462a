"""The engine-facing transceiver: start sending, start receiving, poll, cancel.

One ``Transceiver`` per rank. The context side (``role="context"``) writes a
finished request's KV into the memory of every generation rank that asks for
it (:mod:`kvcore.transceiver.send`); the generation side
(``role="generation"``) asks the context ranks that hold its layers/heads and
waits until every one of them reported (:mod:`kvcore.transceiver.receive`).
Both share a :class:`~kvcore.transceiver.link.Link` (messenger, agent, worker).

Memory safety: ``poll()`` reports an outcome once every rank of the instance
agrees the request is terminal, and reports the request as *released* only
when no write into its pages can still land (every writer reported a final
result, proved it never took the request, or is fenced). Engines reuse pages
on release, never earlier.

Threads: every public method may be called from any thread. ``poll`` is
serialized: concurrent callers take turns, and each outcome and each release
is reported exactly once, to whichever call found it. Under several ranks,
``poll`` is collective: every rank of the instance calls it the same number of
times.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvcore import errors as E
from kvcore.config import TransceiverConfig
from kvcore.control import wire
from kvcore.control.collective import Collective
from kvcore.layout.mapping import RankPlacement
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.params import (
    InternalId,
    RequestId,
    RoleName,
    TransferParams,
    api_id,
    check_ticket,
    internal_id,
    is_role_name,
)
from kvcore.transceiver.counters import CACHE_GAUGES, COUNTERS, leaks
from kvcore.transceiver.link import Link
from kvcore.transceiver.receive import Receiver
from kvcore.transceiver.role import Role
from kvcore.transceiver.send import Sender
from kvcore.transceiver.sessions import RequestStatus, RxSession, SessionState
from kvcore.transport.agent import TransferAgent

__all__ = [
    "Transceiver",
    "PollResult",
    "Outcome",
    "RequestStatus",
    "CACHE_GAUGES",
    "COUNTERS",
    "leaks",
    "lower_switch_interval",
]

log = logging.getLogger("kvcore.transceiver")

_STATUS_CODE = {SessionState.DONE: 0, SessionState.CANCELLED: 1, SessionState.TIMED_OUT: 2, SessionState.FAILED: 3}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}


def _order(rid: Any) -> tuple[int, Any]:
    """A total order over mixed request ids (ints, then strs, then bytes) so reports are deterministic."""
    if isinstance(rid, int):
        return (0, rid)
    if isinstance(rid, str):
        return (1, rid)
    return (2, rid if isinstance(rid, bytes) else getattr(rid, "b", b""))


def _elsewhere(rid: object, state: SessionState) -> E.KvcoreError:
    """The error of a request that ended ``state`` on another rank of this instance (this rank has none of its own).

    Typed by the agreed state, so every rank reports the same kind of error for one request.
    """
    what = f"request {rid!r} ended {state.value} on another rank of this instance"
    if state is SessionState.CANCELLED:
        return E.RequestCancelledError(what)
    if state is SessionState.TIMED_OUT:
        return E.TransferTimeoutError(what)
    return E.TransferFailedError(what)


@dataclass(frozen=True)
class Outcome:
    """The agreed terminal outcome of one request on this instance (``aux``: the context's payload, with DONE)."""

    request_id: RequestId
    state: SessionState
    error: E.KvcoreError | None = None
    nbytes: int = 0
    aux: bytes = b""


@dataclass
class PollResult:
    """What ``poll()`` learned: outcomes agreed by every rank, and requests whose pages may now be reused."""

    done: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # FAILED and TIMED_OUT
    cancelled: list[Outcome] = field(default_factory=list)
    released: list[RequestId] = field(default_factory=list)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.done + self.failed + self.cancelled


class _Agreement(msgspec.Struct, array_like=True):
    group: int  # ranks with equal group agree on a request (the attention-DP group; 0 without attention DP)
    terminal: list[tuple[wire.RequestId, int]]
    quiescent: list[wire.RequestId]


def lower_switch_interval(seconds: float) -> float:
    """Lower the interpreter's GIL switch interval to ``seconds`` (never raise it); returns the interval now.

    Process-wide, so only on request (``TransceiverConfig.gil_switch_interval_s``): a thread waiting for the GIL
    waits up to this long for a thread that runs Python to give it up. The transceiver's I/O thread gives the GIL
    up at every ZeroMQ and transport call, so beside a busy engine thread each one-block request waits several
    intervals (docs/engine-guide.md, "A busy engine thread").
    """
    now = sys.getswitchinterval()
    if 0 < seconds < now:
        sys.setswitchinterval(seconds)
        log.info("GIL switch interval lowered from %.4f s to %.4f s (gil_switch_interval_s)", now, seconds)
    return sys.getswitchinterval()


class Transceiver:
    """Moves KV between a context instance and generation instances; one per rank."""

    def __init__(
        self,
        config: TransceiverConfig,
        *,
        role: str,
        agent: TransferAgent,
        topology: Topology,
        geometry: AttentionGeometry,
        page_table: PageTable,
        collective: Collective | None = None,
        instance_name: str | None = None,
        pm: Any = None,
        device: str = "cpu",
        mamba: MambaGeometry | None = None,
    ) -> None:
        if not is_role_name(role):
            raise E.ConfigError(f"role must be 'context' or 'generation', got {role!r}")
        if config.gil_switch_interval_s > 0:
            lower_switch_interval(config.gil_switch_interval_s)
        from kvcore.extension.plugins import get_plugin_manager

        pm = pm or get_plugin_manager()
        self.config = config
        self.role: RoleName = role
        self.agent = agent
        self.topology = topology
        self.geometry = geometry
        self.page_table = page_table
        self.mamba = mamba
        self._link = Link(
            config,
            role=role,
            agent=agent,
            topology=topology,
            geometry=geometry,
            page_table=page_table,
            mamba=mamba,
            collective=collective,
            instance_name=instance_name,
            mappers=pm.registries.layout_mappers,
            device=device,
        )
        self.collective = self._link.collective
        self._sender: Sender | None = None
        self._receiver: Receiver | None = None
        if role == "context":
            self._sender = Sender(self._link)
            self._role: Role = self._sender
        else:
            self._receiver = Receiver(self._link)
            self._role = self._receiver
        link = self._link
        link.plug(self._role.handlers(), self._role.tick, self._role.busy)
        link.on_disconnect = self._role.on_disconnect
        link.on_connect = self._role.on_connect
        link.on_bad_frame = self._role.on_bad_frame
        link.on_auth_failed = self._role.on_auth_failed
        self.metrics = link.metrics
        self.metrics.gauges = self._live_gauges
        self.metrics.events = self._event_counts
        self.metrics.cpu_seconds = self._link.messenger.cpu_seconds
        self.metrics.io_timing = self._link.messenger.io_timing
        self._poll_lock = threading.Lock()
        self._closed = False
        link.start()

    # --- identity ------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint. Rank 0's is the instance's ``disagg_info_endpoint``."""
        return self._link.messenger.endpoint

    @property
    def info_endpoint(self) -> str:
        """The endpoint generation workers contact first (context rank 0)."""
        return self._link.instance_ranks[0].endpoint

    @property
    def instance_name(self) -> str:
        return self._link.instance_name

    @property
    def incarnation(self) -> str:
        return self._link.incarnation

    @property
    def placement(self) -> RankPlacement:
        """This rank's topology, geometry and page table: what its peers plan transfers with."""
        return self._link.placement

    @property
    def rank_info(self) -> wire.RankInfo:
        """What this rank tells its peers about itself (identity, geometry, page table, agent descriptor)."""
        return self._link.rank_info

    # --- engine API ----------------------------------------------------------------------------

    def _as_sender(self) -> Sender:
        self._check_open()
        if self._sender is None:
            raise E.SessionError(f"this is a {self.role} transceiver; that call is for the context side")
        return self._sender

    def _as_receiver(self) -> Receiver:
        self._check_open()
        if self._receiver is None:
            raise E.SessionError(f"this is a {self.role} transceiver; that call is for the generation side")
        return self._receiver

    def _check_open(self) -> None:
        if self._closed:
            raise E.SessionError("transceiver is closed")

    def start_send(
        self,
        request_id: RequestId,
        block_ids: Iterable[int],
        *,
        prompt_len: int = -1,
        state_slot: int = -1,
        layers_ready: int | None = None,
        mode: str | None = None,
        ticket: bytes | str | None = None,
        aux: bytes | None = None,
        params: TransferParams | None = None,
    ) -> TransferParams:
        """Context side: the request's KV lives in ``block_ids`` (in token order); send it. Returns its parameters.

        The returned :class:`~kvcore.params.TransferParams` are what the engine
        forwards to the generation side (``start_receive(params=...)``); they
        carry the request's ticket, without which no receiver is served
        (``config.require_tickets``). Every rank of the instance returns the
        same parameters for one request, so any rank's may be forwarded. Pass
        ``ticket`` (or ``params`` made with ``TransferParams.make`` in the
        scheduler) to choose the ticket beforehand; without one, it is derived
        from the request id and a secret the instance's ranks share (never
        sent to a peer), so every rank agrees on it without the engine
        coordinating (see ``Link.request_ticket``; engines that reuse request
        ids should pass their own).

        ``mode``: "push" (this side writes into the receiver's blocks once it
        asks) or "pull" (the receiver reads these blocks at once; they must be
        the same on every context rank); default ``config.transfer_mode``.
        ``aux``: opaque bytes (at most ``config.max_aux_bytes``) delivered
        with DONE on the generation side; or call :meth:`set_aux` later.

        Block ids must be distinct integers inside this rank's pools (``LayoutError``
        otherwise). By default every layer is complete. For layer-wise sending while
        prefill still runs (push mode), pass ``layers_ready=L`` (global layers below
        ``L`` are complete) and call :meth:`layers_ready` as more layers finish; each
        slice is written as soon as a receiver asked for the request.
        """
        if params is not None:
            if api_id(internal_id(params.request_id)) != request_id:
                raise E.SessionError(f"start_send({request_id!r}) got parameters of request {params.request_id!r}")
            ticket = params.ticket_bytes if ticket is None else ticket
            mode = mode or params.mode
        out = self._as_sender().start_send(
            internal_id(request_id), block_ids, prompt_len, state_slot, layers_ready, mode=mode, ticket=ticket, aux=aux
        )
        self._wake_waiters()  # a request cancelled before it started ends CANCELLED here
        return out

    def set_aux(self, request_id: RequestId, aux: bytes) -> None:
        """Context side: the request's aux payload (first token, draft tokens...), before any receiver has its KV."""
        self._as_sender().set_aux(internal_id(request_id), aux)

    def layers_ready(self, request_id: RequestId, upto: int, event: Any = None) -> None:
        """Context side, layer-wise: global layers below ``upto`` are complete; they are written at once.

        With ``event`` (a ``torch.cuda.Event`` recorded after the layers' kernels on the
        compute stream) the layers count as complete once the event has completed: the
        call returns at once and the transceiver's worker polls ``event.query()``, so
        the engine never synchronizes its stream for kvcore. Events of one transceiver
        take effect in the order they were given.
        """
        self._as_sender().layers_ready(internal_id(request_id), upto, event)

    def start_receive(
        self,
        request_id: RequestId | None = None,
        ctx_endpoint: str | None = None,
        block_ids: Iterable[int] = (),
        *,
        params: TransferParams | Mapping[str, Any] | None = None,
        prompt_len: int = -1,
        state_slot: int = -1,
        ctx_dp_rank: int = 0,
        ticket: bytes | str | None = None,
        cached_tokens: int = 0,
    ) -> None:
        """Generation side: receive a request into ``block_ids``, usually ``start_receive(params=p, block_ids=b)``.

        ``params`` are the context's :class:`~kvcore.params.TransferParams` (or
        their ``to_dict()`` form): endpoint, request id, ticket, DP rank, mode
        and, in pull mode, the blocks to read. Without them, name the request,
        the context instance's endpoint and the ticket yourself (push mode).

        ``block_ids`` are this rank's destination blocks in token order (distinct,
        inside this rank's pools), ending with the prompt's last block. They must
        cover the whole prompt, unless ``cached_tokens`` says how many leading
        prompt tokens this side holds already (its prefix-cache hit, e.g. vLLM's
        ``num_computed_tokens``): then they must cover at least the blocks from
        ``cached_tokens // tokens_per_block`` on (pass only those, or the whole
        block table: its cached blocks are not written). A list that does not
        cover ``prompt_len - cached_tokens`` is a ``MappingError`` naming both
        numbers: here when the prompt length is known (``prompt_len`` or the
        parameters'), else the request fails with it. When both sides pass
        ``prompt_len`` they must agree (``MappingError`` naming both otherwise).
        """
        self._receive(
            request_id, ctx_endpoint, block_ids, params, prompt_len, state_slot, ctx_dp_rank, ticket, False,
            cached_tokens,
        )  # fmt: skip

    def expect(self, params: TransferParams | Mapping[str, Any]) -> None:
        """Generation side: a request will be received here later; keep the context's lease on it renewed.

        For engines whose decode side queues a request before it can allocate its
        blocks. ``start_receive(params=..., block_ids=...)`` then starts the
        transfer; ``cancel`` gives it up. If the context lets go meanwhile (its
        lease ran out), ``poll()`` reports the request failed with LeaseExpiredError.
        """
        self._receive(None, None, (), params, -1, -1, 0, None, True)

    def _receive(
        self,
        request_id: RequestId | None,
        ctx_endpoint: str | None,
        block_ids: Iterable[int],
        params: TransferParams | Mapping[str, Any] | None,
        prompt_len: int,
        state_slot: int,
        ctx_dp_rank: int,
        ticket: bytes | str | None,
        expecting: bool,
        cached_tokens: int = 0,
    ) -> None:
        rx = self._as_receiver()
        if params is not None and not isinstance(params, TransferParams):
            params = TransferParams.from_dict(params)
        if params is None:
            if request_id is None or ctx_endpoint is None:
                raise E.SessionError("start_receive needs params=, or request_id and ctx_endpoint")
            rid = internal_id(request_id)
            tk = b"" if ticket is None else check_ticket(ticket, f"request {request_id!r} ticket")
            rx.start_receive(
                rid,
                ctx_endpoint,
                block_ids,
                prompt_len,
                state_slot,
                ctx_dp_rank,
                ticket=tk,
                cached_tokens=cached_tokens,
            )
            return
        rid = internal_id(params.request_id)
        if request_id is not None and internal_id(request_id) != rid:
            raise E.SessionError(f"start_receive({request_id!r}) got parameters of request {params.request_id!r}")
        if ctx_endpoint is not None and ctx_endpoint != params.endpoint:
            raise E.SessionError(
                f"start_receive: ctx_endpoint {ctx_endpoint!r} but the parameters name {params.endpoint!r}"
            )
        if params.prompt_len >= 0 and prompt_len >= 0 and params.prompt_len != prompt_len:
            raise E.MappingError(f"request {rid!r} prompt_len: context {params.prompt_len}, generation {prompt_len}")
        rx.start_receive(
            rid,
            params.endpoint,
            block_ids,
            prompt_len if prompt_len >= 0 else params.prompt_len,
            state_slot,
            params.dp_rank,
            ticket=params.ticket_bytes,
            mode=params.mode,
            ctx_block_ids=params.group_block_ids or params.block_ids,
            ctx_state_slot=params.state_slot,
            ctx_incarnation=params.incarnation,
            expecting=expecting,
            lease_s=params.lease_ms / 1000.0,
            cached_tokens=cached_tokens,
        )

    def cancel(self, request_id: RequestId, reason: str = "cancelled by the engine") -> bool:
        """Cancel a request (logical). Its pages are released only once no write can still land.

        Returns True when the cancel will take effect: the request is in flight
        here, or (context side) not started yet and remembered, so a later
        ``start_send`` of it ends CANCELLED at once and a receiver asking for it
        is told. False when the request already ended, or is unknown on the
        generation side. True never means the pages may be reused: that is
        the release, reported by ``poll()``.
        """
        self._check_open()
        accepted = self._role.cancel(internal_id(request_id), str(reason)[:500])
        self._wake_waiters()  # a cancel may end the request at once: another thread may be in wait()
        return accepted

    def _wake_waiters(self) -> None:
        if self._link.waiters:
            self._link.notify_news()

    def status(self, request_id: RequestId) -> RequestStatus | None:
        """This rank's state of a request (None when unknown here or already released); cheap, not collective."""
        return self._role.status(internal_id(request_id))

    def poll(self) -> PollResult:
        """Outcomes every rank agrees on, and requests whose memory is now safe to reuse.

        Collective: every rank of the instance calls ``poll`` the same number of times.
        Safe from several threads: calls take turns and report each outcome once.
        """
        with self._poll_lock:
            return self._poll()

    def poll_local(self) -> PollResult:
        """This rank's own outcomes and releases, with no collective (for engines that aggregate ranks themselves).

        A request is reported by each rank when *that rank* is done with it, so
        outcomes may differ between ranks (one rank DONE, another FAILED): the
        engine combines them (worst wins), as vLLM's KVOutputAggregator does. Use
        either ``poll`` or ``poll_local`` on a transceiver, not both.
        """
        with self._poll_lock:
            terminal, quiescent = self._local_view()
            return self._report(terminal, set(quiescent))

    def _local_view(self) -> tuple[dict[InternalId, int], list[InternalId]]:
        # Only sessions that ended are looked at (``SessionTable.ended``): a poll costs the same with one request
        # in flight as with thousands, and holds the lock the I/O thread needs for no longer.
        terminal: dict[InternalId, int] = {}
        quiescent: list[InternalId] = []
        with self._link.lock:
            for rid, s in self._role.sessions.news():
                if not s.reported:
                    terminal[rid] = _STATUS_CODE[s.state]
                if not s.released and s.quiescent:
                    quiescent.append(rid)
        return terminal, quiescent

    def _poll(self) -> PollResult:
        terminal, quiescent = self._local_view()
        group = self.topology.dp_rank if self.topology.attention_dp else 0
        payload = msgspec.msgpack.encode(_Agreement(group, list(terminal.items()), quiescent))
        everyone = [msgspec.msgpack.decode(b, type=_Agreement) for b in self.collective.allgather(payload)]
        # Under attention DP a request lives on one DP group only: those ranks must agree, not the whole instance.
        gathered = [g for g in everyone if g.group == group]
        codes = [dict(g.terminal) for g in gathered]
        agreed = {rid: max(c[rid] for c in codes) for rid in terminal if all(rid in c for c in codes)}  # worst wins
        agreed_quiet = set(quiescent)
        for g in gathered:
            agreed_quiet &= set(g.quiescent)
        return self._report(agreed, agreed_quiet)

    def _report(self, agreed: dict[InternalId, int], agreed_quiet: set[InternalId]) -> PollResult:
        link = self._link
        result = PollResult()
        now = time.monotonic()
        with link.lock:
            sessions = self._role.sessions
            for rid in sorted(agreed, key=_order):
                state = _CODE_STATUS[agreed[rid]]
                s = sessions.get(rid)
                if s is None or s.reported:
                    continue
                s.reported = True
                err = s.error
                if state is not s.state and err is None:
                    err = _elsewhere(rid, state)
                done = state is SessionState.DONE
                aux = s.aux if done and isinstance(s, RxSession) else b""
                out = Outcome(api_id(rid), state, None if done else err, s.nbytes, aux)
                self.metrics.request_finished(
                    state.value, now - s.created, error=out.error, peer=self._role.peer_name(s)
                )
                if done:
                    result.done.append(out)
                elif state is SessionState.CANCELLED:
                    result.cancelled.append(out)
                else:
                    result.failed.append(out)
            for rid in sorted(agreed_quiet, key=_order):
                s = sessions.get(rid)
                if s is None or not s.reported or s.released:
                    continue
                s.released = True
                result.released.append(api_id(rid))
                self._role.release(rid)
        return result

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank has news for ``poll``: an outcome not yet reported, or a request to release.

        Returns True when there is news (call ``poll`` or ``poll_local`` now), False when ``timeout`` seconds
        (None: no bound) passed without any. Not collective and never reports anything itself: it lets an
        engine thread sleep instead of polling on a timer, and wakes it as soon as this rank's I/O thread ended
        or settled a request. Under several ranks, ``poll`` is still called by every rank alike; this rank's
        news may be agreed on only at a later ``poll``. Raises ``SessionError`` once the transceiver is closed
        (also in a thread blocked here when another thread closes it).
        """
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
        link = self._link
        with link.news:
            link.waiters += 1
            try:
                while True:
                    if self._closed:
                        raise E.SessionError("transceiver is closed")
                    if self._has_news():
                        return True
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    # Bounded sleeps: a notify lost to a race costs at most 50 ms, never a hang.
                    link.news.wait(0.05 if left is None else min(left, 0.05))
            finally:
                link.waiters -= 1

    def _has_news(self) -> bool:
        """An outcome to report or a release to make on this rank (lock held)."""
        for _, s in self._role.sessions.news():
            if not s.released and (not s.reported or s.quiescent):
                return True
        return False

    def wait_all(self, request_ids: Iterable[RequestId], timeout: float) -> dict[RequestId, Outcome]:
        """Poll until every id is reported and released (single-rank helper for tests and tools)."""
        want = set(request_ids)
        outcomes: dict[RequestId, Outcome] = {}
        released: set[RequestId] = set()
        deadline = time.monotonic() + timeout
        while not (want <= released and want <= set(outcomes)):
            r = self.poll()
            outcomes.update({o.request_id: o for o in r.outcomes})
            released.update(r.released)
            if want <= released and want <= set(outcomes):
                break
            if time.monotonic() > deadline:
                missing = sorted((want - released) | (want - set(outcomes)), key=_order)
                raise E.TransferTimeoutError(
                    f"{len(missing)} request(s) not reported and released after {timeout}s: {missing[:8]} "
                    "(wait_all sees only outcomes reported during its own polls)"
                )
            if self.topology.world_size == 1:
                self.wait(min(0.05, max(0.0, deadline - time.monotonic())))  # poll again as soon as there is news
            else:
                time.sleep(0.001)  # collective: the other ranks poll on their own clocks
        return outcomes

    def _live_gauges(self) -> dict[str, int]:
        """``stats()`` without the counters: what ``kvcore_live_objects`` exports."""
        return {k: v for k, v in self.stats().items() if k not in COUNTERS and not k.endswith("_total")}

    def _event_counts(self) -> dict[str, int]:
        """The counters of ``stats()``: what ``kvcore_control_events_total`` exports."""
        return {k: v for k, v in self.stats().items() if k in COUNTERS or k.endswith("_total")}

    def stats(self) -> dict[str, int]:
        """Live counts for leak checks (all return to zero, but peers, once every request is released) and counters.

        Keys ending in ``_total`` and the keys of ``COUNTERS`` (``fenced_*``, ``bounce_fallback_*``,
        ``forged_messages``, ``peers_lost``, ``tickets_refused``, ``early_requests_expired``) only grow; the
        metrics export those as ``kvcore_control_events_total`` and the rest as ``kvcore_live_objects``.
        """
        res = self.agent.resources()
        out = {
            **self._role.stats(),
            "agent_transfers": res.get("transfers", 0),
            "remote_agents": res.get("remote_agents", 0),
            "control_connections": self._link.messenger.peer_count,
        }
        for key in sorted(COUNTERS):
            out[key] = self._link.counters.get(key, 0)
        return out

    def leaks(self) -> dict[str, int]:
        """Per-request resources still held (``{}`` once every request is released): for leak checks."""
        return leaks(self.stats())

    def close(self, timeout: float = 5.0) -> None:
        """Stop threads, drop peers and deregister memory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._link.notify_news()  # threads blocked in wait() raise SessionError
        self.metrics.close()
        self._say_goodbye()
        self._link.close(timeout)
        self._role.close()
        self._link.deregister()

    def _say_goodbye(self) -> None:
        """Tell every peer rank this one is closing: it lets go at once instead of after ``peer_lost_timeout_s``."""
        link = self._link
        with link.lock:
            endpoints = self._role.goodbye_endpoints()
        msg = wire.Goodbye(
            v=wire.PROTOCOL_VERSION, instance=link.instance_name, rank=link.topology.rank, incarnation=link.incarnation
        )
        for endpoint in endpoints:
            link.send(endpoint, msg)  # queued; the messenger writes its outbox before its sockets close

    def __enter__(self) -> Transceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
