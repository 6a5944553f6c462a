"""A malicious generation-side process for the flood tests (``test_security_floods.py``).

It speaks kvcore's control protocol with one raw DEALER, as an admitted same-uid peer (this user's local CURVE
key, ``_local_auth``): it fetches the context's instance info, registers as many generation ranks as asked
(each a valid ``RankInfo`` built from the context's own, under a fresh name), asks early for requests that
never start, and declines requests it never asked for. ``Flooder`` below starts and drives it in its own
process; killing it is a stranger that exits.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import msgspec
import zmq

from kvcore.control import wire
from kvcore.runtime import Channel, RankProcess, serve
from kvcore.transport.agent import TransferAgent

V = wire.PROTOCOL_VERSION


def dead_endpoints(n: int) -> list[str]:
    """``n`` loopback endpoints nobody listens on (ports that were free a moment ago)."""
    out, held = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        held.append(s)
        out.append(f"tcp://127.0.0.1:{s.getsockname()[1]}")
    for s in held:
        s.close()
    return out


class _Flooder:
    def __init__(self) -> None:
        self.zctx = zmq.Context()
        self.sock: zmq.Socket[bytes] | None = None
        self.template: wire.RankInfo | None = None
        self.agent: Any = None
        self.registered: list[tuple[str, str]] = []  # (instance name, incarnation) of each registration, in order
        self.results: list[wire.Message] = []

    def op_hello(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    def op_connect(self, endpoint: str) -> dict[str, Any]:
        """Connect to the context rank at ``endpoint`` and fetch its RankInfo (the template of our registrations)."""
        from _local_auth import local_dealer

        self.sock = local_dealer(endpoint, zctx=self.zctx)
        self._send(wire.InstanceInfoRequest(v=V, min_version=V, max_version=V, asker="flood/0"))
        info = self._until(lambda m: isinstance(m, wire.InstanceInfo))
        assert isinstance(info, wire.InstanceInfo) and info.ranks, info
        self.template = info.ranks[0]
        return {}

    def _send(self, msg: wire.Message) -> None:
        assert self.sock is not None
        self.sock.send(wire.encode(msg))

    def _drain(self, timeout_ms: int) -> None:
        assert self.sock is not None
        while self.sock.poll(timeout_ms):  # until nothing came for timeout_ms
            self.results.append(wire.decode(self.sock.recv(), 64 * 1024 * 1024))

    def _until(self, pred: Any, timeout: float = 30.0) -> wire.Message:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, m in enumerate(self.results):
                if pred(m):
                    return self.results.pop(i)
            self._drain(100)
        raise TimeoutError("the context never answered")

    def _barrier(self) -> None:
        """Every answer to what we sent so far has arrived (the context answers one connection in order)."""
        self._send(wire.InstanceInfoRequest(v=V, min_version=V, max_version=V, asker="flood/barrier"))
        self._until(lambda m: isinstance(m, wire.InstanceInfo))

    def op_register(
        self, count: int, *, descriptor: str = "real", endpoints: list[str] | None = None, settle_s: float = 0.5
    ) -> dict[str, Any]:
        """Register ``count`` generation ranks; ``descriptor``: "real" (loads), "bogus" (well formed, but of
        another backend: refused when the context loads it) or "foreign" (another process's incarnation than the
        rank claims: refused on arrival).

        ``endpoints``: the endpoint each one names (default: the context's own). Returns the registration
        answers that came back (``ok``, ``refused``) once none came for ``settle_s``.
        """
        from kvcore.transport.builtin.shm import ShmAgent

        assert self.template is not None
        if self.agent is None:
            self.agent = ShmAgent(f"flood-{os.getpid()}")
        desc = self.agent.descriptor()
        if descriptor == "bogus":
            desc = msgspec.msgpack.encode(
                msgspec.structs.replace(TransferAgent.decode_descriptor(desc), backend="no-such-backend")
            )
        # A rank's incarnation is its agent's (the context refuses another): every registration shares it.
        incarnation = TransferAgent.decode_descriptor(desc).incarnation if descriptor != "foreign" else "f" * 32
        for i in range(count):
            name = f"flood-{os.getpid()}-{len(self.registered)}"
            info = msgspec.structs.replace(
                self.template,
                instance_name=name,
                incarnation=incarnation,
                endpoint=endpoints[i] if endpoints else self.template.endpoint,
                agent_descriptor=desc,
                pid=os.getpid(),
            )
            self.registered.append((name, incarnation))
            self._send(wire.RegisterRankInfo(v=V, info=info))
        self._barrier()
        self._drain(int(settle_s * 1000))  # confirmations follow the agent loads, after the barrier's answer
        got = [m for m in self.results if isinstance(m, wire.RegisterResult)]
        self.results = [m for m in self.results if not isinstance(m, wire.RegisterResult)]
        return {"ok": sum(1 for m in got if m.ok), "refused": sum(1 for m in got if not m.ok)}

    def op_ask_early(self, count: int, blocks: int, *, who: int = 0) -> dict[str, Any]:
        """As registered rank ``who``, ask for ``count`` requests that never start, ``blocks`` ids each.

        Returns how many were refused at once (the rest are kept, waiting for a start_send that never comes).
        """
        name, incarnation = self.registered[who]
        for j in range(count):
            self._send(
                wire.RequestData(
                    v=V,
                    request_id=f"{name}-early-{j}",
                    gen_instance=name,
                    gen_rank=0,
                    gen_incarnation=incarnation,
                    block_ids=b"\0" * 8 * blocks,
                    nonce=os.urandom(16),
                    ticket=os.urandom(16),
                )
            )
        self._barrier()
        refused = [m for m in self.results if isinstance(m, wire.TransferResult) and m.status == "failed"]
        kinds = sorted({m.error_kind for m in refused})
        self.results = [m for m in self.results if m not in refused]
        return {"refused": len(refused), "kinds": kinds}

    def op_decline(self, count: int, *, who: int = 0) -> dict[str, Any]:
        """As registered rank ``who``, decline ``count`` requests it never asked for (each its own tombstone)."""
        name, _ = self.registered[who]
        for j in range(count):
            self._send(
                wire.Cancel(v=V, request_id=f"{name}-declined-{j}", instance=name, rank=0, ticket=os.urandom(16))
            )
        self._barrier()
        return {}


class Flooder(RankProcess):
    """Drives ``_Flooder`` in its own process (killed: a stranger that exits without a word)."""

    def __init__(self, endpoint: str) -> None:
        super().__init__("_flood_peer:flooder_main", name="flooder", path=[os.path.dirname(__file__)])
        try:
            self.info = self.call("hello")
            self.call("connect", endpoint=endpoint)
        except BaseException:
            self.kill()
            raise


def flooder_main(channel: Channel) -> None:
    """The flooder's rank function: serve ``_Flooder``'s commands until ``exit`` or EOF."""
    serve(channel, _Flooder())
