"""One-rank context/generation instances in this process or in their own, for end-to-end tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import msgspec

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


def make_rank(
    role: str,
    name: str,
    backend: str = "shm",
    num_blocks: int = 64,
    timeout: float = 30.0,
    config: dict[str, Any] | None = None,
    instance_name: str | None = None,
    **geo: Any,
) -> tuple[Any, Any, Any]:
    """A one-rank instance in this process: ``(agent, head-major KV cache, Transceiver)``.

    ``config`` overrides TransceiverConfig fields (ports, lifecycle timeouts).
    """
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, build_page_table
    from kvcore.layout.topology import AttentionGeometry, Topology
    from kvcore.transceiver import Transceiver

    geometry = AttentionGeometry(**geometry_kwargs(**geo))
    topo = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=geometry.num_layers)
    cfg = TransceiverConfig(backend=backend, request_timeout_s=timeout, **(config or {}))
    agent = create_agent(cfg, name)
    cache = allocate_kv_cache(topo, geometry, num_blocks, allocator=agent.allocate_tensor)
    table = build_page_table("head_major_pool", cache, topology=topo, geometry=geometry)
    tx = Transceiver(
        cfg, role=role, agent=agent, topology=topo, geometry=geometry, page_table=table, instance_name=instance_name
    )
    return agent, cache, tx


def _report(conn: Any, r: Any) -> None:
    for o in r.outcomes:
        conn.send_bytes(
            msgspec.msgpack.encode(
                {
                    "outcome": o.request_id,
                    "state": o.state.value,
                    "error": f"{type(o.error).__name__}: {o.error}" if o.error else None,
                }
            )
        )
    for rid in r.released:
        conn.send_bytes(msgspec.msgpack.encode({"released": rid}))


def _context_main(
    conn: Any, backend: str, geo: dict[str, Any], num_blocks: int, timeout: float, opts: dict[str, Any]
) -> None:
    import torch

    os.environ.update(opts.get("env") or {})
    agent, cache, tx = make_rank(
        "context",
        f"ctx-{os.getpid()}",
        backend,
        num_blocks,
        timeout,
        opts.get("config"),
        opts.get("instance_name"),
        **geo,
    )
    flat = cache.view(num_blocks, -1).view(torch.uint8)
    conn.send_bytes(msgspec.msgpack.encode({"endpoint": tx.info_endpoint, "pid": os.getpid()}))
    try:
        while True:
            if conn.poll(0.002):
                cmd = msgspec.msgpack.decode(conn.recv_bytes())
                if cmd["op"] == "exit":
                    break
                if cmd["op"] == "send":
                    blocks = cmd["blocks"]
                    flat[blocks] = torch.from_numpy(fill_value(_pattern_id(cmd["rid"]), blocks, flat.shape[1]))
                    try:
                        params = tx.start_send(
                            cmd["rid"],
                            blocks,
                            ticket=ticket_for(cmd["rid"]),
                            mode=cmd.get("mode"),
                            aux=cmd.get("aux"),
                        )
                    except Exception as exc:
                        if cmd.get("reply"):
                            conn.send_bytes(msgspec.msgpack.encode({"error": f"{type(exc).__name__}: {exc}"}))
                        continue
                    if cmd.get("reply"):
                        conn.send_bytes(msgspec.msgpack.encode({"params": params.to_dict()}))
                elif cmd["op"] == "cancel":
                    tx.cancel(cmd["rid"])
                elif cmd["op"] == "stats":
                    conn.send_bytes(msgspec.msgpack.encode({"stats": tx.stats()}))
            _report(conn, tx.poll())
    finally:
        tx.close()
        agent.close()


class ContextProcess:
    """Start a one-rank context instance; ``send``/``cancel``/``stats`` drive it; ``kill`` SIGKILLs it."""

    #: The function the child process runs (the generation subclass runs its own).
    _main: Any = None

    def __init__(
        self,
        backend: str = "shm",
        num_blocks: int = 64,
        timeout: float = 30.0,
        *,
        config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        instance_name: str | None = None,
        **geo: Any,
    ) -> None:
        self.geo = geometry_kwargs(**geo)
        self.num_blocks = num_blocks
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        opts = {"config": config, "env": env, "instance_name": instance_name}
        main = type(self)._main or _context_main
        self.proc = ctx.Process(target=main, args=(child, backend, self.geo, num_blocks, timeout, opts), daemon=True)
        self.proc.start()
        hello = self._recv(60)
        self.endpoint: str = hello["endpoint"]
        self.pid: int = hello["pid"]
        self.events: list[dict[str, Any]] = []

    def _recv(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            raise TimeoutError("context process did not answer")
        return msgspec.msgpack.decode(self.conn.recv_bytes())

    def _drain(self) -> None:
        """Read the child's pending reports, so that neither side ever blocks on a full pipe."""
        while self.conn.poll(0):
            self.events.append(msgspec.msgpack.decode(self.conn.recv_bytes()))

    def send(self, rid: Any, blocks: list[int]) -> None:
        self._drain()
        self.conn.send_bytes(msgspec.msgpack.encode({"op": "send", "rid": rid, "blocks": blocks}))

    def start_send(
        self, rid: Any, blocks: list[int], *, mode: str | None = None, aux: bytes | None = None, timeout: float = 20
    ) -> dict[str, Any]:
        """``start_send`` in the child; returns the transfer parameters' ``to_dict()`` (or raises with its error)."""
        self._drain()
        cmd = {"op": "send", "rid": rid, "blocks": blocks, "mode": mode, "aux": aux, "reply": True}
        self.conn.send_bytes(msgspec.msgpack.encode(cmd))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self._recv(timeout)
            if "params" in m:
                return dict(m["params"])
            if "error" in m and "outcome" not in m:  # outcome reports carry an "error" too
                raise RuntimeError(m["error"])
            self.events.append(m)
        raise TimeoutError("no transfer parameters")

    def cancel(self, rid: int) -> None:
        self._drain()
        self.conn.send_bytes(msgspec.msgpack.encode({"op": "cancel", "rid": rid}))

    def stats(self, timeout: float = 10) -> dict[str, int]:
        self.conn.send_bytes(msgspec.msgpack.encode({"op": "stats"}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self._recv(timeout)
            if "stats" in m:
                return m["stats"]
            self.events.append(m)
        raise TimeoutError("no stats")

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
            if self.conn.poll(0.05):
                self.events.append(msgspec.msgpack.decode(self.conn.recv_bytes()))
        raise TimeoutError(f"context never released request {rid}")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgspec.msgpack.encode({"op": "exit"}))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()


def _generation_main(
    conn: Any, backend: str, geo: dict[str, Any], num_blocks: int, timeout: float, opts: dict[str, Any]
) -> None:
    import torch

    os.environ.update(opts.get("env") or {})
    agent, cache, tx = make_rank(
        "generation",
        f"gen-{os.getpid()}",
        backend,
        num_blocks,
        timeout,
        opts.get("config"),
        opts.get("instance_name"),
        **geo,
    )
    flat = cache.view(num_blocks, -1).view(torch.uint8)
    conn.send_bytes(msgspec.msgpack.encode({"endpoint": tx.endpoint, "pid": os.getpid()}))
    try:
        while True:
            if conn.poll(0.002):
                cmd = msgspec.msgpack.decode(conn.recv_bytes())
                if cmd["op"] == "exit":
                    break
                if cmd["op"] == "receive":
                    ticket = cmd.get("ticket") or ticket_for(cmd["rid"])
                    tx.start_receive(cmd["rid"], cmd["endpoint"], cmd["blocks"], ticket=ticket)
                elif cmd["op"] == "cancel":
                    tx.cancel(cmd["rid"])
                elif cmd["op"] == "stats":
                    conn.send_bytes(msgspec.msgpack.encode({"stats": tx.stats()}))
                elif cmd["op"] == "read":
                    conn.send_bytes(msgspec.msgpack.encode({"bytes": flat[cmd["blocks"]].numpy().tobytes()}))
            _report(conn, tx.poll())
    finally:
        tx.close()
        agent.close()


class GenerationProcess(ContextProcess):
    """A one-rank generation instance in its own process; ``receive`` asks a context instance for a request."""

    _main = staticmethod(_generation_main)

    def receive(self, rid: Any, endpoint: str, blocks: list[int], ticket: bytes | None = None) -> None:
        """Start receiving ``rid``; ``ticket`` defaults to the test ticket every side derives (``ticket_for``)."""
        self._drain()
        self.conn.send_bytes(
            msgspec.msgpack.encode(
                {"op": "receive", "rid": rid, "endpoint": endpoint, "blocks": blocks, "ticket": ticket}
            )
        )

    def read(self, blocks: list[int], timeout: float = 10) -> bytes:
        """The bytes of these destination blocks, as the generation process sees them."""
        self.conn.send_bytes(msgspec.msgpack.encode({"op": "read", "blocks": blocks}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self._recv(timeout)
            if "bytes" in m:
                return bytes(m["bytes"])
            self.events.append(m)
        raise TimeoutError("no bytes")
