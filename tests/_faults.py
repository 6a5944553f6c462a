"""Fault injection around real components: shm agents that hold or fail writes, a thread collective, rank groups.

Every agent here *is* the real shared-memory agent (a subclass): descriptors,
registrations, range checks and the bytes themselves are the shm agent's own.
The subclass only changes *when* a submitted write is performed (held until the
test opens a gate) or refuses writes to named peers, the way a slow or failing
transport would. They are registered through a plugin manager the test builds
(:func:`fault_plugin_manager`), never through the installed entry points.

:class:`ThreadCollective` is a real allgather among the threads of one process:
it lets one test run a multi-rank instance (each rank its own transceiver, its
own agent, its own sockets) and poll every rank in step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from kvcore import hookimpl
from kvcore.errors import TransferFailedError
from kvcore.extension.plugins import KVCORE_PLUGIN_API, PluginManager, make_plugin_manager
from kvcore.layout.mapping import MatchingHeadsMapper
from kvcore.transport.agent import AgentCapabilities, RemoteAgent, TransferHandle, TransferStatus
from kvcore.transport.builtin import plugin as builtin
from kvcore.transport.builtin.shm import ShmAgent

__all__ = [
    "HeldShmAgent",
    "FailingShmAgent",
    "RaisingShmAgent",
    "OtherBackendShmAgent",
    "InlineShmAgent",
    "fault_plugin_manager",
    "halves_plugin_manager",
    "ThreadCollective",
    "RankGroup",
    "layer_pattern",
]


@dataclass
class _Held:
    """A write the transport accepted but has not performed yet."""

    remote: RemoteAgent
    local: np.ndarray
    remote_addrs: np.ndarray
    sizes: np.ndarray


class HeldShmAgent(ShmAgent):
    """The shm agent with a gate: while ``gate`` is closed, submitted writes stay PENDING and move no byte.

    Opening the gate (``gate.set()``) performs every held write at its next poll,
    exactly as a slow transport whose one-sided write lands late. ``holding`` is
    set as soon as a write is held; ``landed`` counts writes performed after a hold.
    """

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, None)
        self.gate = threading.Event()
        if not (options or {}).get("closed", False):
            self.gate.set()
        self.holding = threading.Event()
        self.landed = 0

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        if self.gate.is_set():
            return super()._submit(handle, remote, local, remote_addrs, sizes)
        self.holding.set()
        return _Held(remote, local.copy(), remote_addrs.copy(), sizes.copy())

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        held = handle.native
        if isinstance(held, _Held):
            if not self.gate.is_set():
                return TransferStatus.PENDING
            handle.native = super()._submit(handle, held.remote, held.local, held.remote_addrs, held.sizes)
            self.landed += 1
        return super()._poll(handle)


class FailingShmAgent(ShmAgent):
    """The shm agent that fails every write to a peer whose name is in ``fail_remotes`` (nothing moves)."""

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, None)
        self.fail_remotes: set[str] = set((options or {}).get("fail_remotes", ()))
        self.failed_writes = 0

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        if remote.name in self.fail_remotes:
            self.failed_writes += 1
            raise TransferFailedError(f"injected: the transport refuses writes to {remote.name!r}")
        return super()._submit(handle, remote, local, remote_addrs, sizes)


class RaisingShmAgent(ShmAgent):
    """The shm agent with bugs: its first ``raise_writes`` submits and ``raise_progress`` progress calls raise.

    They raise RuntimeError straight out of the public methods (not the TransferError the contract names),
    as a transport plugin with a bug would: the transceiver's loop must survive both.
    """

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, None)
        self.raise_writes = int((options or {}).get("raise_writes", 0))
        self.raise_progress = int((options or {}).get("raise_progress", 0))
        self.raised = 0

    def submit(self, *args: Any, **kwargs: Any) -> TransferHandle:
        if self.raise_writes > 0:
            self.raise_writes -= 1
            self.raised += 1
            raise RuntimeError("injected: a bug in the transport's submit")
        return super().submit(*args, **kwargs)

    def submit_checked(self, *args: Any, **kwargs: Any) -> TransferHandle:  # the data plane's submit of a piece
        if self.raise_writes > 0:
            self.raise_writes -= 1
            self.raised += 1
            raise RuntimeError("injected: a bug in the transport's submit")
        return super().submit_checked(*args, **kwargs)

    def progress(self) -> None:
        if self.raise_progress > 0:
            self.raise_progress -= 1
            self.raised += 1
            raise RuntimeError("injected: a bug in the transport's progress")
        super().progress()


class OtherBackendShmAgent(ShmAgent):
    """The shm agent under another backend name: a peer configured with a different transport."""

    backend: ClassVar[str] = "shm-other"


class InlineShmAgent(ShmAgent):
    """The shm agent as a transport whose ``submit`` moves every byte before it returns (NIXL or UCX over CMA).

    Not ``async_submit``: the transceiver gets large plans in chunks from its worker loop. ``seconds_per_mib``
    (an option) slows each copy down, as a small box would, so traffic can arrive while a chunk copies;
    ``submitted`` records ``(bytes, first local address)`` of every submit, in order, and ``seconds`` how long
    each took.
    """

    capabilities: ClassVar[AgentCapabilities] = dataclasses.replace(ShmAgent.capabilities, async_submit=False)

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, None)
        self.seconds_per_mib = float((options or {}).get("seconds_per_mib", 0.0))
        self.submitted: list[tuple[int, int]] = []
        self.seconds: list[float] = []

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        self.submitted.append((handle.nbytes, int(local[0]) if local.size else 0))
        t0 = time.monotonic()
        xfer = super()._submit(handle, remote, local, remote_addrs, sizes)
        job = getattr(xfer, "job", None)  # a large copy went to the copy threads: wait for it, as inside submit
        deadline = time.monotonic() + 60
        while job is not None and not job.finished and time.monotonic() < deadline:
            time.sleep(0.0002)
        time.sleep(self.seconds_per_mib * handle.nbytes / (1 << 20))
        self.seconds.append(time.monotonic() - t0)
        return xfer


class PollCopyShmAgent(InlineShmAgent):
    """:class:`InlineShmAgent` whose slow part happens in the first ``poll`` of a transfer, not in ``submit`` (as the
    UCX agent copies while it progresses its worker): ``submit`` returns at once, the copy time comes after."""

    def __init__(self, name: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(name, options)
        self._delay: dict[int, float] = {}

    def _submit(
        self,
        handle: TransferHandle,
        remote: RemoteAgent,
        local: np.ndarray,
        remote_addrs: np.ndarray,
        sizes: np.ndarray,
    ) -> Any:
        delay, self.seconds_per_mib = self.seconds_per_mib, 0.0
        try:
            xfer = super()._submit(handle, remote, local, remote_addrs, sizes)
        finally:
            self.seconds_per_mib = delay
        self._delay[handle.id] = delay * handle.nbytes / (1 << 20)
        return xfer

    def _poll(self, handle: TransferHandle) -> TransferStatus:
        delay = self._delay.pop(handle.id, 0.0)
        if delay:
            time.sleep(delay)
            self.seconds[-1] += delay
        return super()._poll(handle)


class _FaultPlugin:
    KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

    @hookimpl
    def kvcore_register_transfer_agents(self, registry: Any) -> None:
        caps = ShmAgent.capabilities
        registry.add("held-shm", "_faults:HeldShmAgent", capabilities=caps, description="shm, writes held by a gate")
        registry.add("failing-shm", "_faults:FailingShmAgent", capabilities=caps, description="shm, writes refused")
        registry.add("raising-shm", "_faults:RaisingShmAgent", capabilities=caps, description="shm, submit raises")
        registry.add("other-shm", "_faults:OtherBackendShmAgent", capabilities=caps, description="shm, other name")
        registry.add(
            "inline-shm",
            "_faults:InlineShmAgent",
            capabilities=InlineShmAgent.capabilities,
            description="shm, every byte moved inside submit",
        )
        registry.add(
            "pollcopy-shm",
            "_faults:PollCopyShmAgent",
            capabilities=InlineShmAgent.capabilities,
            description="shm, the copy's time spent in the first poll",
        )


class HalvesMatchingHeadsMapper(MatchingHeadsMapper):
    """``matching_heads`` as another version of it might plan: each buffer in two fragments (same bytes)."""

    def buffer_fragments(self, src: Any, dst: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        _, _, size = super().buffer_fragments(src, dst)
        half = np.uint64(int(size[0]) // 2)
        starts = np.array([0, half], np.uint64)
        return starts, starts.copy(), np.array([half, size[0] - half], np.uint64)


class _HalvesPlugin:
    """The built-in agent and page-table builders, with the ``matching_heads`` mapper planned in halves."""

    KVCORE_PLUGIN_API = KVCORE_PLUGIN_API

    @hookimpl
    def kvcore_register_transfer_agents(self, registry: Any) -> None:
        builtin.kvcore_register_transfer_agents(registry)

    @hookimpl
    def kvcore_register_page_table_builders(self, registry: Any) -> None:
        builtin.kvcore_register_page_table_builders(registry)

    @hookimpl
    def kvcore_register_layout_mappers(self, registry: Any) -> None:
        registry.add("matching_heads", "_faults:HalvesMatchingHeadsMapper", description="matching heads, in halves")


def halves_plugin_manager() -> PluginManager:
    """A manager whose ``matching_heads`` mapper splits every buffer in two: plans differ, bytes do not."""
    pm = make_plugin_manager(builtins=False, load_entry_points=False)
    pm.register(_HalvesPlugin(), name="kvcore-test-halves")
    return pm


def fault_plugin_manager() -> PluginManager:
    """The built-ins, the installed plugins (mappers) and the fault agents (``held-shm``, ``inline-shm``...)."""
    pm = make_plugin_manager()
    pm.register(_FaultPlugin(), name="kvcore-test-faults")
    return pm


class _Hub:
    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.slots: list[bytes] = [b""] * size
        self.barrier = threading.Barrier(size, timeout=timeout)


class ThreadCollective:
    """``allgather`` among ``size`` threads of this process (each rank calls it in the same order)."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self._hub, self._rank = hub, rank

    @classmethod
    def group(cls, size: int, timeout: float = 60.0) -> list[ThreadCollective]:
        hub = _Hub(size, timeout)
        return [cls(hub, r) for r in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._hub.size

    def allgather(self, data: bytes) -> list[bytes]:
        hub = self._hub
        hub.slots[self._rank] = bytes(data)
        hub.barrier.wait()  # everyone wrote
        out = list(hub.slots)
        hub.barrier.wait()  # everyone read: the slots may be reused
        return out


@dataclass
class RankGroup:
    """The ranks of one instance in this process: their agents, caches and transceivers, polled in step."""

    role: str
    agents: list[Any]
    caches: list[Any]
    txs: list[Any]
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(8))

    @classmethod
    def build(
        cls,
        role: str,
        *,
        backend: str = "shm",
        tp: int = 1,
        pp: int = 1,
        num_blocks: int = 32,
        pm: PluginManager | None = None,
        agent_names: Iterable[str] | None = None,
        agent_options: list[dict[str, Any]] | None = None,
        timeout: float = 30.0,
        geometry: dict[str, Any] | None = None,
        allocator: Callable[..., Any] | None = None,
        **config: Any,
    ) -> RankGroup:
        """``tp*pp`` ranks of one instance, built concurrently (the constructor is collective)."""
        from kvcore.config import TransceiverConfig, create_agent
        from kvcore.control.collective import LocalCollective
        from kvcore.layout.builders import allocate_kv_cache, build_page_table
        from kvcore.layout.topology import AttentionGeometry, Topology
        from kvcore.transceiver import Transceiver

        pm = pm or fault_plugin_manager()
        world = tp * pp
        geo = AttentionGeometry(
            **{
                **dict(num_layers=4, num_kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bfloat16"),
                **(geometry or {}),
            }
        )
        colls: list[Any] = ThreadCollective.group(world) if world > 1 else [LocalCollective()]
        names = list(agent_names or [f"{role}-{r}" for r in range(world)])
        agents, caches = [], []
        topos = []
        for r in range(world):
            cfg = TransceiverConfig(
                backend=backend,
                request_timeout_s=timeout,
                agent_options=(agent_options or [{}] * world)[r],
                **config,
            )
            topo = Topology.create(tp_size=tp, pp_size=pp, rank=r, num_layers=geo.num_layers)
            agent = create_agent(cfg, names[r], pm)
            agents.append(agent)
            caches.append(allocate_kv_cache(topo, geo, num_blocks, allocator=allocator or agent.allocate_tensor))
            topos.append((topo, cfg))

        def make(r: int) -> Any:
            topo, cfg = topos[r]
            table = build_page_table("head_major_pool", caches[r], topology=topo, geometry=geo)
            return Transceiver(
                cfg,
                role=role,
                agent=agents[r],
                topology=topo,
                geometry=geo,
                page_table=table,
                collective=colls[r],
                instance_name=f"{role}-instance",
                pm=pm,
            )

        pool = ThreadPoolExecutor(max(8, world))
        txs = list(pool.map(make, range(world)))
        return cls(role, agents, caches, txs, pool)

    @property
    def info_endpoint(self) -> str:
        return str(self.txs[0].info_endpoint)

    def each(self, fn: Callable[[int, Any], Any]) -> list[Any]:
        """Run ``fn(rank, transceiver)`` on every rank concurrently (for collective calls)."""
        return list(self.pool.map(lambda r: fn(r, self.txs[r]), range(len(self.txs))))

    def poll(self) -> list[Any]:
        """One collective ``poll`` on every rank; the PollResult of each rank."""
        return self.each(lambda _r, tx: tx.poll())

    def close(self) -> None:
        for tx in self.txs:
            tx.close()
        for a in self.agents:
            a.close()
        self.pool.shutdown(wait=True)


def layer_pattern(request: int, block_index: int, layer: int, nbytes: int) -> np.ndarray:
    """Bytes of one (block, global layer) of a request, computed independently of kvcore."""
    b = np.arange(nbytes, dtype=np.int64)
    return (((request % 251) * 131 + block_index * 17 + layer * 29 + b * 7) % 251).astype(np.uint8)


def open_fds() -> set[tuple[str, str]]:
    """This process's open file descriptors as (number, target) pairs."""
    import os

    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # the listing's own descriptor, closed already
            pass
    return out


def leaked_since(fds: set[tuple[str, str]], threads: set[threading.Thread]) -> tuple[set[Any], set[str]]:
    """Descriptors and threads that exist now and did not at the baseline (must both be empty)."""
    import gc

    gc.collect()
    return open_fds() - fds, {t.name for t in set(threading.enumerate()) - threads}
