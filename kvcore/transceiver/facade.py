"""The engine-facing transceiver: start sending, start receiving, poll, cancel.

One ``Transceiver`` per rank. The context side (``role="context"``) writes a
finished request's KV into the memory of every generation rank that asks for
it (:mod:`kvcore.transceiver.sender`); the generation side
(``role="generation"``) asks the context ranks that hold its layers/heads and
waits until every one of them reported (:mod:`kvcore.transceiver.receiver`).
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

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvcore import errors as E
from kvcore import wire
from kvcore.agent import TransferAgent
from kvcore.collective import Collective
from kvcore.config import TransceiverConfig
from kvcore.mapping import RankLayout
from kvcore.page import PageTable
from kvcore.topology import AttentionGeometry, MambaGeometry, Topology
from kvcore.transceiver.link import Link
from kvcore.transceiver.receiver import Receiver
from kvcore.transceiver.role import Role, check_request_id
from kvcore.transceiver.sender import Sender
from kvcore.transceiver.sessions import SessionState

__all__ = ["Transceiver", "PollResult", "Outcome", "CACHE_GAUGES", "COUNTERS", "leaks"]

#: ``stats()`` keys of bounded caches (peers, loaded agents, connections, tombstones), not per-request resources.
CACHE_GAUGES = frozenset(
    {
        "ctx_instances",
        "gen_peers",
        "retired_instances",  # lost peers waiting for the timer to unload them
        "retired_peers",
        "remote_agents",
        "control_connections",
        "tombstones",
    }
)
#: ``stats()`` keys that only grow (events counted since start); every other key returns to zero when idle.
COUNTERS = frozenset(
    {
        "bounced_writes_total",
        "bounce_fallback_arena_full",
        "bounce_fallback_plan_mismatch",
        "bounce_fallback_staging_full",
        "fenced_dead",
        "fenced_grace",
        "forged_messages",
        "peers_lost",
    }
)


def leaks(stats: dict[str, int]) -> dict[str, int]:
    """The per-request resources left in a ``stats()`` snapshot (sessions, leases, transfers...): {} when clean."""
    return {k: v for k, v in stats.items() if v and k not in CACHE_GAUGES and k not in COUNTERS}


_STATUS_CODE = {SessionState.DONE: 0, SessionState.CANCELLED: 1, SessionState.TIMED_OUT: 2, SessionState.FAILED: 3}
_CODE_STATUS = {v: k for k, v in _STATUS_CODE.items()}


@dataclass(frozen=True)
class Outcome:
    """The agreed terminal outcome of one request on this instance."""

    request_id: int
    state: SessionState
    error: E.KvcoreError | None = None
    nbytes: int = 0


@dataclass
class PollResult:
    """What ``poll()`` learned: outcomes agreed by every rank, and requests whose pages may now be reused."""

    done: list[Outcome] = field(default_factory=list)
    failed: list[Outcome] = field(default_factory=list)  # FAILED and TIMED_OUT
    cancelled: list[Outcome] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def outcomes(self) -> list[Outcome]:
        return self.done + self.failed + self.cancelled


class _Agreement(msgspec.Struct, array_like=True):
    group: int  # ranks with equal group agree on a request (the attention-DP group; 0 without attention DP)
    terminal: dict[int, int]
    quiescent: list[int]


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
        if role not in ("context", "generation"):
            raise E.ConfigError(f"role must be 'context' or 'generation', got {role!r}")
        from kvcore.plugins import get_plugin_manager

        pm = pm or get_plugin_manager()
        self.config = config
        self.role = role
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
        self.metrics = link.metrics
        self.metrics.gauges = self.stats
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
    def layout(self) -> RankLayout:
        return self._link.layout

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
        request_id: int,
        block_ids: Iterable[int],
        *,
        prompt_len: int = -1,
        state_slot: int = -1,
        layers_ready: int | None = None,
    ) -> None:
        """Context side: the request's KV lives in ``block_ids`` (in token order); send it.

        Block ids must be distinct integers inside this rank's pools (``LayoutError``
        otherwise). By default every layer is complete. For layer-wise sending while
        prefill still runs, pass ``layers_ready=L`` (global layers below ``L`` are
        complete) and call :meth:`layers_ready` as more layers finish; each slice is
        written as soon as a receiver asked for the request.
        """
        self._as_sender().start_send(request_id, block_ids, prompt_len, state_slot, layers_ready)

    def layers_ready(self, request_id: int, upto: int) -> None:
        """Context side, layer-wise: global layers below ``upto`` are complete; they are written at once."""
        self._as_sender().layers_ready(request_id, upto)

    def start_receive(
        self,
        request_id: int,
        ctx_endpoint: str,
        block_ids: Iterable[int],
        *,
        prompt_len: int = -1,
        state_slot: int = -1,
        ctx_dp_rank: int = 0,
    ) -> None:
        """Generation side: fetch request ``request_id`` from the context instance at ``ctx_endpoint``.

        ``block_ids`` are this rank's destination blocks in token order (distinct,
        inside this rank's pools); when the generation side already holds a cached
        prefix, pass only the suffix blocks. ``ctx_dp_rank`` names the context
        attention-DP group that ran the prefill. When both sides pass ``prompt_len``
        they must agree (``MappingError`` naming both otherwise).
        """
        self._as_receiver().start_receive(request_id, ctx_endpoint, block_ids, prompt_len, state_slot, ctx_dp_rank)

    def cancel(self, request_id: int, reason: str = "cancelled by the engine") -> bool:
        """Cancel a request (logical). Its pages are released only once no write can still land.

        Returns False when the request is unknown here or already terminal. On the
        context side an unknown request is remembered for a while, so a later
        ``start_send`` of it ends CANCELLED at once.
        """
        self._check_open()
        return self._role.cancel(check_request_id(request_id), str(reason)[:500])

    def status(self, request_id: int) -> SessionState | None:
        """This rank's current state of a request (None when unknown or already released); cheap, not collective."""
        return self._role.status(check_request_id(request_id))

    def poll(self) -> PollResult:
        """Outcomes every rank agrees on, and requests whose memory is now safe to reuse.

        Collective: every rank of the instance calls ``poll`` the same number of times.
        Safe from several threads: calls take turns and report each outcome once.
        """
        with self._poll_lock:
            return self._poll()

    def _poll(self) -> PollResult:
        link = self._link
        with link.lock:
            sessions = self._role.sessions
            terminal = {rid: _STATUS_CODE[s.state] for rid, s in sessions.items() if s.terminal and not s.reported}
            quiescent = [rid for rid, s in sessions.items() if s.terminal and s.quiescent and not s.released]
        group = self.topology.dp_rank if self.topology.attention_dp else 0
        payload = msgspec.msgpack.encode(_Agreement(group, terminal, quiescent))
        everyone = [msgspec.msgpack.decode(b, type=_Agreement) for b in self.collective.allgather(payload)]
        # Under attention DP a request lives on one DP group only: those ranks must agree, not the whole instance.
        gathered = [g for g in everyone if g.group == group]
        result = PollResult()
        agreed_terminal = set(terminal)
        for g in gathered:
            agreed_terminal &= set(g.terminal)
        agreed_quiet = set(quiescent)
        for g in gathered:
            agreed_quiet &= set(g.quiescent)
        now = time.monotonic()
        with link.lock:
            sessions = self._role.sessions
            for rid in sorted(agreed_terminal):
                state = _CODE_STATUS[max(g.terminal[rid] for g in gathered)]  # worst outcome wins
                s = sessions.get(rid)
                if s is None or s.reported:
                    continue
                s.reported = True
                err = s.error
                if state is not s.state and err is None:
                    err = E.SessionError(f"request {rid} ended {state.value} on another rank of this instance")
                out = Outcome(rid, state, err if state is not SessionState.DONE else None, s.nbytes)
                self.metrics.request_finished(
                    state.value, now - s.created, error=out.error, peer=self._role.peer_name(s)
                )
                if state is SessionState.DONE:
                    result.done.append(out)
                elif state is SessionState.CANCELLED:
                    result.cancelled.append(out)
                else:
                    result.failed.append(out)
            for rid in sorted(agreed_quiet):
                s = sessions.get(rid)
                if s is None or not s.reported or s.released:
                    continue
                s.released = True
                result.released.append(rid)
                self._role.release(rid)
        return result

    def wait_all(self, request_ids: Iterable[int], timeout: float) -> dict[int, Outcome]:
        """Poll until every id is reported and released (single-rank helper for tests and tools)."""
        want = set(request_ids)
        outcomes: dict[int, Outcome] = {}
        released: set[int] = set()
        deadline = time.monotonic() + timeout
        while not (want <= released and want <= set(outcomes)):
            r = self.poll()
            outcomes.update({o.request_id: o for o in r.outcomes})
            released.update(r.released)
            if time.monotonic() > deadline:
                missing = sorted((want - released) | (want - set(outcomes)))
                raise E.TransferTimeoutError(
                    f"{len(missing)} request(s) not reported and released after {timeout}s: {missing[:8]} "
                    "(wait_all sees only outcomes reported during its own polls)"
                )
            time.sleep(0.001)
        return outcomes

    def stats(self) -> dict[str, int]:
        """Live counts for leak checks (all return to zero, but peers, once every request is released) and counters.

        Keys ending in ``_total`` and the ``fenced_*``, ``bounce_fallback_*``, ``forged_messages``,
        ``peers_lost`` counters only grow.
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
        self.metrics.close()
        self._link.close(timeout)
        self._role.close()
        self._link.deregister()

    def __enter__(self) -> Transceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
