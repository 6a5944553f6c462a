"""The engine-facing transceiver: start sending, start receiving, poll, cancel.

One ``Transceiver`` per rank. The context side (``role="context"``) writes a
finished request's KV into the memory of every generation rank that asks for
it (:mod:`kvcore.transceiver.send`); the generation side
(``role="generation"``) asks the context ranks that hold its layers/heads and
waits until every one of them reported (:mod:`kvcore.transceiver.receive`).
Both share a :class:`~kvcore.transceiver.link.Link` (messenger, agent, worker).
What the engine learns back (outcomes agreed across ranks, releases: the
memory-safety promise) is :class:`~kvcore.transceiver.reporting.Reporting`,
the half of ``Transceiver`` defined there.

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
from collections.abc import Iterable, Mapping
from typing import Any

from kvcore import errors as E
from kvcore.config import TransceiverConfig
from kvcore.control import wire
from kvcore.control.collective import Collective
from kvcore.layout.mapping import RankPlacement
from kvcore.layout.page import PageTable
from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.params import RequestId, RoleName, TransferParams, api_id, check_ticket, internal_id, is_role_name
from kvcore.transceiver.counters import CACHE_GAUGES, COUNTERS, leaks
from kvcore.transceiver.link import Link
from kvcore.transceiver.native import open_native_lane
from kvcore.transceiver.receive import Receiver
from kvcore.transceiver.reporting import Outcome, PollResult, Reporting
from kvcore.transceiver.role import Role
from kvcore.transceiver.send import Sender
from kvcore.transceiver.sessions import RequestStatus
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


class Transceiver(Reporting):
    """Moves KV between a context instance and generation instances; one per rank.

    The engine starts requests (``start_send`` on the context side, ``start_receive`` or ``expect`` then
    ``start_receive`` on the generation side), learns their outcomes and releases from ``poll`` (or
    ``poll_local``, ``wait``, ``wait_all``: :class:`~kvcore.transceiver.reporting.Reporting`), and reuses a
    request's pages only once ``poll`` released it. Every call may come from any thread.

    Args:
        config: the settings (:class:`~kvcore.config.TransceiverConfig`); every rank of an instance passes equal
            ones.
        role: ``"context"`` (sends finished requests' KV) or ``"generation"`` (receives it).
        agent: this rank's transfer agent (``kvcore.create_agent``); the transceiver registers the page table's
            pools with it and deregisters them at ``close``.
        topology: this rank's parallelism (TP/PP/CP sizes and ranks, attention DP).
        geometry: the attention KV geometry every pool of ``page_table`` holds.
        page_table: where this rank's KV lives (``kvcore.build_page_table`` and the builders).
        collective: the instance's collective over its ranks (``TorchCollective``, ...); None: one rank alone.
        instance_name: the instance's name as peers see it; rank 0's wins; None: a random ``<role>-<hex>``.
        pm: the plugin manager to take layout mappers from; None: the process-wide one.
        device: where the pools are: ``"cpu"``, ``"cuda"`` (``"cuda:0"``) or ``"cuda:N"``; checked against torch's
            CUDA allocator where it holds the pools.
        mamba: the geometry of the state pools of a hybrid (Mamba) model, if the page table holds any.

    Raises:
        ConfigError: ``role`` or ``device`` is not one of the values above, or torch's CUDA allocator holds the
            pools on another device than ``device`` names; or the control socket cannot bind
            (port taken, a non-loopback host without authentication and without ``allow_insecure_bind``, an
            ``advertise_host`` that makes no valid endpoint).
        RegistrationError: the agent refused a pool; or a context rank in pull mode whose pools the agent
            cannot offer to peers (allocate them with ``agent.allocate_tensor``).
        CollectiveError: the collective failed while the ranks agreed on the instance's name and identities.
    """

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
        self._link.native = open_native_lane(self._link)
        self._alone = self.collective.size == 1  # poll agrees with no other rank
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

    # --- identity (each a property that raises nothing) -------------------------------------------

    @property
    def endpoint(self) -> str:
        """This rank's control endpoint (``tcp://host:port``). Rank 0's is the instance's ``disagg_info_endpoint``."""
        return self._link.messenger.endpoint

    @property
    def info_endpoint(self) -> str:
        """The endpoint generation ranks contact first: context rank 0's ``endpoint``, the same on every rank."""
        return self._link.instance_ranks[0].endpoint

    @property
    def instance_name(self) -> str:
        """The instance's name as its peers see it (``instance_name=`` of rank 0), the same on every rank."""
        return self._link.instance_name

    @property
    def incarnation(self) -> str:
        """This process's incarnation: peers fence a restarted rank whose incarnation changed."""
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

        The returned parameters are what the engine forwards to the generation side
        (``start_receive(params=...)``); they carry the request's ticket, without which no
        receiver is served (``config.require_tickets``). Every rank of the instance returns
        the same parameters for one request, so any rank's may be forwarded. Without a
        ticket one is derived from the request id and a secret the instance's ranks share
        (never sent to a peer; see ``Link.request_ticket``): engines that reuse request ids
        should pass their own. By default every layer is complete; for layer-wise sending
        while prefill still runs (push mode), pass ``layers_ready=L`` and call
        :meth:`layers_ready` as more layers finish: each slice is written as soon as a
        receiver asked for the request.

        Args:
            request_id: the engine's id: an int in 0..2**64-1, a str or bytes.
            block_ids: this rank's blocks holding the request, in token order: distinct integers inside its
                pools (a mapping of layer group to ids for several groups; in pull mode the same on every
                context rank, and every group's ids).
            prompt_len: the prompt's length in tokens (-1: unknown); checked against the receiver's if both know it.
            state_slot: the request's slot in the state pools of a hybrid model (-1: none).
            layers_ready: push mode only: global layers below this are complete (None: every layer).
            mode: ``"push"`` (this side writes into the receiver's blocks once it asks) or ``"pull"`` (the
                receiver reads these blocks); None: the parameters' mode, else ``config.transfer_mode``.
            ticket: the request's ticket (bytes or hex, 16..64 bytes); None: the parameters', else derived.
            aux: opaque bytes (at most ``config.max_aux_bytes``) delivered with DONE on the generation side;
                or call :meth:`set_aux` later.
            params: parameters made beforehand with ``TransferParams.make`` (in the scheduler) for this request.

        Returns:
            The request's :class:`~kvcore.params.TransferParams`: endpoint, request id, ticket, mode, DP rank,
            prompt length, lease and, in pull mode, the instance's block ids and incarnation.

        Raises:
            SessionError: the transceiver is closed or is a generation one; ``params`` name another request; the
                request is already being sent; ``prompt_len`` is not an integer; ``mode`` is neither push nor
                pull; ``layers_ready`` in pull mode; ``aux`` is not bytes.
            LayoutError: a block id or ``state_slot`` is not an integer inside this rank's (or, in pull mode, the
                instance's) pools, or a block id repeats.
            TicketError: ``ticket`` is not 16..64 bytes (or their hex).
            PayloadTooLargeError: ``aux`` exceeds ``config.max_aux_bytes``.
            UnsupportedOperationError: pull mode with an agent that cannot READ.
            ResourceExhaustedError: ``config.max_inflight_requests`` requests are in flight on this rank.
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
        """Context side: the request's aux payload (first token, draft tokens...), before any receiver has its KV.

        Args:
            request_id: a request this rank is sending (``start_send`` was called).
            aux: opaque bytes, at most ``config.max_aux_bytes``; they replace any given before.

        Raises:
            SessionError: closed or a generation transceiver; the request is not being sent; a receiver already
                has its KV and its final answer; ``aux`` is not bytes.
            PayloadTooLargeError: ``aux`` exceeds ``config.max_aux_bytes``.
        """
        self._as_sender().set_aux(internal_id(request_id), aux)

    def layers_ready(self, request_id: RequestId, upto: int, event: Any = None) -> None:
        """Context side, layer-wise: global layers below ``upto`` are complete; they are written at once.

        With ``event`` (a ``torch.cuda.Event`` recorded after the layers' kernels on the
        compute stream) the layers count as complete once the event has completed: the
        call returns at once and the transceiver's worker polls ``event.query()``, so
        the engine never synchronizes its stream for kvcore. Events of one transceiver
        take effect in the order they were given.

        Args:
            request_id: a request started with ``start_send(..., layers_ready=L)``.
            upto: global layers below this are complete (never lowers what an earlier call said).
            event: None (complete now) or an object with ``query()``, such as a ``torch.cuda.Event``.

        Raises:
            SessionError: closed or a generation transceiver; the request is not being sent; ``event`` has no
                ``query()``.
            ResourceExhaustedError: too many events wait already (64 per ``max_inflight_requests``).
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

        The outcome comes from ``poll``; the blocks may be reused once ``poll`` released the request.

        Args:
            request_id: the request (needed without ``params``; with them, it must be theirs).
            ctx_endpoint: the context instance's ``info_endpoint`` (needed without ``params``; with them, theirs).
            block_ids: this rank's destination blocks in token order (distinct, inside this rank's pools),
                ending with the prompt's last block. They must cover the whole prompt, unless ``cached_tokens``
                says how many leading prompt tokens this side holds already (its prefix-cache hit, e.g. vLLM's
                ``num_computed_tokens``): then at least the blocks from ``cached_tokens // tokens_per_block`` on
                (pass only those, or the whole block table: its cached blocks are not written).
            params: the context's :class:`~kvcore.params.TransferParams` (or their ``to_dict()`` form):
                endpoint, request id, ticket, DP rank, mode and, in pull mode, the blocks to read. Without them,
                name the request, the endpoint and the ticket yourself (push mode).
            prompt_len: the prompt's length in tokens (-1: the parameters', or unknown).
            state_slot: this rank's state slot for a hybrid model (-1: none).
            ctx_dp_rank: the context's attention-DP rank holding the request (without ``params``).
            ticket: the request's ticket, bytes or hex (without ``params``).
            cached_tokens: leading prompt tokens this side holds already (see ``block_ids``).

        Raises:
            SessionError: closed or a context transceiver; neither ``params`` nor ``request_id`` and
                ``ctx_endpoint``; ``request_id`` or ``ctx_endpoint`` differ from the parameters'; malformed
                parameters; an integer argument that is not one; the request is already being received, or
                ``expect`` named other parameters.
            MappingError: ``block_ids`` do not cover ``prompt_len - cached_tokens`` (here when the prompt length
                is known, else the request fails with it), ``cached_tokens`` exceeds ``prompt_len``, or both
                sides' ``prompt_len`` differ; each names both numbers.
            LayoutError: a block id or ``state_slot`` is not an integer inside this rank's pools, or repeats.
            TicketError: the ticket is not 16..64 bytes (or their hex).
            ProtocolError: ``ctx_endpoint`` is not ``tcp://host:port``.
            UnsupportedOperationError: pull mode with an agent that cannot READ.
            ResourceExhaustedError: ``config.max_inflight_requests`` requests are in flight on this rank.
        """
        _receive(
            self._as_receiver(), request_id, ctx_endpoint, block_ids, params, prompt_len, state_slot, ctx_dp_rank,
            ticket, False, cached_tokens,
        )  # fmt: skip

    def expect(self, params: TransferParams | Mapping[str, Any]) -> None:
        """Generation side: a request will be received here later; keep the context's lease on it renewed.

        For engines whose decode side queues a request before it can allocate its
        blocks. ``start_receive(params=..., block_ids=...)`` then starts the
        transfer; ``cancel`` gives it up. If the context lets go meanwhile (its
        lease ran out), ``poll()`` reports the request failed with LeaseExpiredError.

        Args:
            params: the context's :class:`~kvcore.params.TransferParams` (or their ``to_dict()`` form).

        Raises:
            SessionError: closed or a context transceiver; malformed parameters; the request is already here.
            TicketError, ProtocolError, UnsupportedOperationError, ResourceExhaustedError: as ``start_receive``.
        """
        _receive(self._as_receiver(), None, None, (), params, -1, -1, 0, None, True)

    def cancel(self, request_id: RequestId, reason: str = "cancelled by the engine") -> bool:
        """Cancel a request (logical). Its pages are released only once no write can still land.

        Args:
            request_id: the request to cancel.
            reason: why, for the logs and the peers (cut to 500 characters).

        Returns:
            True when the cancel will take effect: the request is in flight here, or (context side) not started
            yet and remembered, so a later ``start_send`` of it ends CANCELLED at once and a receiver asking for
            it is told. False when the request already ended, or is unknown on the generation side. True never
            means the pages may be reused: that is the release, reported by ``poll()``.

        Raises:
            SessionError: the transceiver is closed, or ``request_id`` is not a valid request id.
        """
        self._check_open()
        accepted = self._role.cancel(internal_id(request_id), str(reason)[:500])
        self._wake_waiters()  # a cancel may end the request at once: another thread may be in wait()
        return accepted

    def _wake_waiters(self) -> None:
        if self._link.waiters:
            self._link.notify_news()

    def close(self, timeout: float = 5.0) -> None:
        """Stop threads, drop peers and deregister memory. Idempotent; raises nothing.

        Peers are told this rank is closing (they let go at once), threads blocked in ``wait`` raise
        ``SessionError``, and so does every later call that starts, changes or cancels a request, or ``wait``.

        Args:
            timeout: the most seconds to wait for the I/O thread to write what is queued and stop.
        """
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


def _receive(
    rx: Receiver,
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
    """``start_receive`` and ``expect``: check the arguments against the parameters, then hand them to ``rx``."""
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
