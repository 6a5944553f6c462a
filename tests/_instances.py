"""One-rank context/generation instances in this process or in their own, for end-to-end tests."""

from __future__ import annotations

import os
import time
from typing import Any

from kvcore.runtime import Channel, RankProcess, ready, serve

#: The secret the tests derive every request's ticket from (both sides of a test know it, as a router would).
TEST_TICKET_SECRET = b"kvcore-tests-ticket-secret-0001"


def ticket_for(request: Any) -> bytes:
    """The ticket a test request carries on both sides (``kvcore.params.derive_ticket`` from the test secret)."""
    from kvcore.params import derive_ticket

    try:
        return derive_ticket(TEST_TICKET_SECRET, request)
    except Exception:
        return b"\0" * 16  # an invalid request id: the call under test refuses it before the ticket matters


def _pattern_id(request: Any) -> int:
    """An int for ``fill_value`` from any request id (str and bytes ids hashed, independently of kvcore)."""
    if isinstance(request, int):
        return request
    import zlib

    return zlib.crc32(request.encode() if isinstance(request, str) else request)


def fill_value(request: int, block_ids: Any, nbytes_per_block: int) -> Any:
    """Per-block byte pattern of a request (independent of kvcore): uint8 ``[blocks, bytes]``."""
    import numpy as np

    j = np.arange(len(block_ids), dtype=np.int64).reshape(-1, 1)
    b = np.arange(nbytes_per_block, dtype=np.int64).reshape(1, -1)
    return (((request % 251) * 131 + j * 17 + b * 7) % 251).astype(np.uint8)


def geometry_kwargs(**over: Any) -> dict[str, Any]:
    d = dict(num_layers=4, num_kv_heads=4, head_dim=32, tokens_per_block=8, dtype="bfloat16")
    d.update(over)
    return d


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for restart-at-the-same-endpoint tests)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_parts(
    role: str,
    name: str,
    backend: str = "shm",
    num_blocks: int = 64,
    timeout: float = 30.0,
    config: dict[str, Any] | None = None,
    instance_name: str | None = None,
    device: str = "cpu",
    **geo: Any,
) -> tuple[Any, Any, dict[str, Any]]:
    """What a one-rank instance is built from: ``(agent, head-major KV cache, Transceiver keyword arguments)``.

    ``config`` overrides TransceiverConfig fields (ports, lifecycle timeouts); ``device`` is where the pools are
    (``"cpu"`` or ``"cuda[:N]"``, allocated by the agent) and what the arguments name.
    """
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, build_page_table
    from kvcore.layout.topology import AttentionGeometry, Topology

    geometry = AttentionGeometry(**geometry_kwargs(**geo))
    topo = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=geometry.num_layers)
    cfg = TransceiverConfig(backend=backend, request_timeout_s=timeout, **(config or {}))
    agent = create_agent(cfg, name)
    try:
        cache = allocate_kv_cache(
            topo, geometry, num_blocks, allocator=lambda shape, dtype: agent.allocate_tensor(shape, dtype, device)
        )
        table = build_page_table("head_major_pool", cache, topology=topo, geometry=geometry)
    except BaseException:
        agent.close()
        raise
    kwargs = dict(config=cfg, role=role, agent=agent, topology=topo, geometry=geometry, page_table=table,
                  instance_name=instance_name, device=device)  # fmt: skip
    return agent, cache, kwargs


def make_rank(role: str, name: str, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """A one-rank instance in this process: ``(agent, head-major KV cache, Transceiver)``; the arguments are
    :func:`rank_parts`'s."""
    from kvcore.transceiver import Transceiver

    agent, cache, tx_kwargs = rank_parts(role, name, *args, **kwargs)
    try:
        return agent, cache, Transceiver(**tx_kwargs)
    except BaseException:
        agent.close()
        raise


class _Instance:
    """A one-rank instance inside a rank process: commands from the test, its outcomes reported as messages."""

    def __init__(self, channel: Channel, role: str, backend: str, geo: dict[str, Any], num_blocks: int,
                 timeout: float, opts: dict[str, Any]) -> None:  # fmt: skip
        import torch

        self.channel = channel
        self.agent, cache, self.tx = make_rank(
            role,
            opts.get("agent_name") or f"{'ctx' if role == 'context' else 'gen'}-{os.getpid()}",
            backend,
            num_blocks,
            timeout,
            opts.get("config"),
            opts.get("instance_name"),
            opts.get("device", "cpu"),
            **geo,
        )
        self.flat = cache.view(num_blocks, -1).view(torch.uint8)
        endpoint = self.tx.info_endpoint if role == "context" else self.tx.endpoint
        channel.send({"endpoint": endpoint, "pid": os.getpid()})

    def report(self) -> None:
        """One engine-loop step: poll, and report every outcome and release to the test."""
        r = self.tx.poll()
        for o in r.outcomes:
            error = f"{type(o.error).__name__}: {o.error}" if o.error else None
            self.channel.send({"outcome": o.request_id, "state": o.state.value, "error": error, "aux": o.aux})
        for rid in r.released:
            self.channel.send({"released": rid})

    def op_send(self, rid: Any, blocks: list[int], mode: str | None = None, aux: bytes | None = None) -> dict[str, Any]:
        """``start_send`` of ``rid`` after filling its blocks; a refusal is answered, not raised (the test checks it)."""
        import torch

        want = torch.from_numpy(fill_value(_pattern_id(rid), blocks, self.flat.shape[1]))
        self.flat[blocks] = want.to(self.flat.device)
        try:
            params = self.tx.start_send(rid, blocks, ticket=ticket_for(rid), mode=mode, aux=aux)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"params": params.to_dict()}

    def op_receive(
        self, rid: Any, endpoint: str, blocks: list[int], ticket: bytes | None = None, **kw: Any
    ) -> dict[str, Any]:
        """``start_receive``; ``kw``: its other keyword arguments (``cached_tokens``, ``prompt_len``...)."""
        self.tx.start_receive(rid, endpoint, blocks, ticket=ticket or ticket_for(rid), **kw)
        return {}

    def op_receive_params(self, params: dict[str, Any], blocks: list[int]) -> dict[str, Any]:
        """``start_receive`` from the context's transfer parameters (``to_dict()``), as an engine forwards them."""
        self.tx.start_receive(params=params, block_ids=blocks)
        return {}

    def op_cancel(self, rid: Any) -> dict[str, Any]:
        self.tx.cancel(rid)
        return {}

    def op_stats(self) -> dict[str, Any]:
        return {"stats": self.tx.stats()}

    def op_rank_info(self) -> dict[str, Any]:
        """This rank's own full RankInfo (agent descriptor included): what an attacker at best could know of it."""
        import msgspec

        return {"info": msgspec.msgpack.encode(self.tx.rank_info)}

    def op_memory_kinds(self) -> dict[str, Any]:
        """The memory kind of each of this rank's registrations with its agent (DRAM, VRAM)."""
        return {"kinds": [r.region.kind.value for r in self.agent.registrations]}

    def op_read(self, blocks: list[int]) -> dict[str, Any]:
        return {"bytes": self.flat[blocks].cpu().numpy().tobytes()}

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


def instance_main(
    channel: Channel,
    role: str,
    backend: str,
    geo: dict[str, Any],
    num_blocks: int,
    timeout: float,
    opts: dict[str, Any],
) -> None:
    """The rank function of ``ContextProcess``/``GenerationProcess``: serve commands, poll between them."""
    inst = _Instance(channel, role, backend, geo, num_blocks, timeout, opts)
    try:
        serve(channel, inst, idle=inst.report, idle_wait=0.002)
    finally:
        inst.close()


class ContextProcess(RankProcess):
    """Start a one-rank context instance; ``send``/``cancel``/``stats`` drive it; ``kill`` SIGKILLs it.

    ``agent_name``: its transfer agent's name (default ``ctx-<pid>``/``gen-<pid>``, unique per process).
    ``device``: where its pools are (``"cpu"``, ``"cuda[:N]"``).
    """

    #: The role the child process plays (the generation subclass plays its own).
    role = "context"
    #: The rank function the child runs (a test's own instance may serve more commands).
    target = "_instances:instance_main"

    def __init__(
        self,
        backend: str = "shm",
        num_blocks: int = 64,
        timeout: float = 30.0,
        *,
        config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        instance_name: str | None = None,
        agent_name: str | None = None,
        device: str = "cpu",
        **geo: Any,
    ) -> None:
        self.geo = geometry_kwargs(**geo)
        self.num_blocks = num_blocks
        opts = {"config": config, "instance_name": instance_name, "agent_name": agent_name, "device": device}
        super().__init__(
            self.target,
            name=f"{self.role} instance",
            kwargs={"role": self.role, "backend": backend, "geo": self.geo, "num_blocks": num_blocks,
                    "timeout": timeout, "opts": opts},
            env=env,
            path=[os.path.dirname(os.path.abspath(__file__))],
        )  # fmt: skip
        try:
            hello = self.recv(60, op="start")
        except BaseException:
            self.kill()
            raise
        self.endpoint: str = hello["endpoint"]
        self.events: list[dict[str, Any]] = []

    def _drain(self, wait: float = 0.0) -> None:
        """Read the child's pending reports (waiting up to ``wait`` s for one), so no pipe ever fills up."""
        if wait and not ready([self], wait):
            return
        while (m := self.try_recv()) is not None:
            self.events.append(m)

    def send(self, rid: Any, blocks: list[int]) -> None:  # type: ignore[override]
        self._drain()
        self.tell("send", rid=rid, blocks=blocks)

    def start_send(
        self, rid: Any, blocks: list[int], *, mode: str | None = None, aux: bytes | None = None, timeout: float = 20
    ) -> dict[str, Any]:
        """``start_send`` in the child; returns the transfer parameters' ``to_dict()`` (or raises with its error)."""
        self._drain()
        m = self.call("send", rid=rid, blocks=blocks, mode=mode, aux=aux, timeout=timeout)
        if "error" in m:
            raise RuntimeError(m["error"])
        return dict(m["params"])

    def cancel(self, rid: int) -> None:
        self._drain()
        self.tell("cancel", rid=rid)

    def stats(self, timeout: float = 10) -> dict[str, int]:
        stats: dict[str, int] = self.call("stats", timeout=timeout)["stats"]
        return stats

    def wait_released(self, rid: int, timeout: float = 20) -> dict[str, Any]:
        """This side's outcome of ``rid`` once it is released."""
        deadline = time.monotonic() + timeout
        outcome = None
        while time.monotonic() < deadline:
            for m in self.events:
                if m.get("outcome") == rid:
                    outcome = m
                if m.get("released") == rid and outcome is not None:
                    return outcome
            self._drain(0.05)
        raise TimeoutError(f"{self.role} never released request {rid}")

    def close(self, timeout: float = 10.0) -> int | None:
        """EOF to the instance (it closes its transceiver and agent and exits); killed past ``timeout``."""
        return super().close(timeout)


class GenerationProcess(ContextProcess):
    """A one-rank generation instance in its own process; ``receive`` asks a context instance for a request."""

    role = "generation"

    def receive(self, rid: Any, endpoint: str, blocks: list[int], ticket: bytes | None = None, **kw: Any) -> None:
        """Start receiving ``rid``; ``ticket`` defaults to the test ticket every side derives (``ticket_for``);
        ``kw``: ``start_receive``'s other keyword arguments."""
        self._drain()
        self.tell("receive", rid=rid, endpoint=endpoint, blocks=blocks, ticket=ticket, **kw)

    def read(self, blocks: list[int], timeout: float = 10) -> bytes:
        """The bytes of these destination blocks, as the generation process sees them."""
        return bytes(self.call("read", blocks=blocks, timeout=timeout)["bytes"])


def backend_params() -> list[Any]:
    """shm always; nixl, ucx and mooncake whenever their plugin distribution is installed (a broken install then fails)."""
    from importlib import metadata

    import pytest

    out: list[Any] = ["shm"]
    for name in ("nixl", "ucx", "mooncake"):
        dist = f"kvcore-{name}"
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            out.append(pytest.param(name, marks=pytest.mark.skip(reason=f"{dist} is not installed")))
            continue
        out.append(name)
    return out
