"""A transport-test peer inside a namespaced host (:class:`HostPeer`), with the commands cross-host tests need.

:class:`HostPeer` is the harness peer (:class:`kvcore.testing.harness.PeerProcess`: one transfer agent of a
backend in a rank process) started inside a host of :class:`kvcore.runtime.hosts.TwoHosts` through its
launcher. Beyond the harness's commands it answers: where am I, load and unload a peer, timed writes, a write
loop that runs until an error, and a transceiver rank (context or generation) of an instance spread over host
processes (``rank_start``/``rank_send``/``rank_receive``/``rank_verify``/``rank_stop``: the demo's storage and
oracle, :class:`kvcore.testing.scenario.Rank`), which ``kvcore demo --two-hosts`` and ``tests/test_two_hosts.py``
drive.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from kvcore.params import derive_ticket
from kvcore.runtime.hosts import Host, children, sigkill
from kvcore.testing.harness import PeerProcess

__all__ = ["HARNESS_TICKET_SECRET", "HostPeer", "host_peer_main"]

#: The ticket secret the harness's ranks derive tickets from unless the driver passes its own (hex; test tool only).
HARNESS_TICKET_SECRET = "6b76636f72652d74776f2d686f7374732d686172726e657373"


class HostPeer(PeerProcess):
    """A harness peer (one transfer agent of ``backend``) inside ``host``, driven by msgpack commands on pipes.

    ``kill()`` kills the process inside the host, not the ``nsenter`` that started it; the host's ``close()``
    kills it too.
    """

    def __init__(
        self,
        host: Host,
        backend: str,
        options: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout: float = 120.0,
    ) -> None:
        self.host = host
        super().__init__(
            backend,
            options,
            name=name or f"{host.hostname}-{backend}",
            launcher=host.launcher(),
            target="kvcore.testing.host_peer:host_peer_main",
            env=env,
            startup_timeout=startup_timeout,
        )
        assert self.popen is not None  # a launcher runs it as a subprocess
        host.processes.append(self.popen)

    @property
    def inner_pid(self) -> int | None:
        """The peer's pid as seen from here (nsenter forks it), or None once it is gone."""
        kids = children(self.pid)
        return kids[0] if kids else None

    def kill(self) -> None:
        """SIGKILL the peer itself (a crash inside the host), then reap nsenter."""
        inner = self.inner_pid
        if inner is not None:
            sigkill(inner)
        super().kill()


def _peer_class() -> type:
    import numpy as np

    from kvcore.errors import TransferTimeoutError
    from kvcore.hostinfo import host_identity, hostname
    from kvcore.testing.harness import _Peer
    from kvcore.transport.agent import TransferOp, TransferStatus

    class _HostPeer(_Peer):
        """Harness commands plus: where am I, load a peer, write to it (timed), write until an error."""

        def op_whoami(self) -> dict[str, Any]:
            return {"hostname": hostname(), "host_identity": host_identity(), "pid": os.getpid()}

        def op_load(self, descriptor: bytes) -> dict[str, Any]:
            return {"remote": self.agent.load_remote_agent(descriptor)}

        def op_unload(self, remote: str) -> dict[str, Any]:
            self.agent.unload_remote_agent(remote)
            return {}

        def op_write(
            self,
            remote: str,
            key: str,
            offsets: bytes,
            remote_addrs: bytes,
            sizes: bytes,
            notification: bytes | None = None,
            repeat: int = 1,
            wait_s: float = 60.0,
        ) -> dict[str, Any]:
            """Write fragments of buffer ``key`` (offsets into it) ``repeat`` times; returns each write's seconds."""
            base = np.uint64(self.buffers[key].data_ptr())
            local = np.frombuffer(offsets, dtype=np.uint64) + base
            rem = np.frombuffer(remote_addrs, dtype=np.uint64)
            size = np.frombuffer(sizes, dtype=np.uint64)
            seconds = []
            for i in range(repeat):
                notif = None if notification is None else notification + f".{i}".encode()
                t0 = time.perf_counter()
                h = self.agent.submit(TransferOp.WRITE, remote, local, rem, size, notification=notif)
                try:
                    self.agent.wait(h, wait_s)
                finally:
                    if h.status is not TransferStatus.PENDING:
                        self.agent.release(h)
                seconds.append(time.perf_counter() - t0)
            return {"seconds": seconds}

        def op_write_until_error_start(
            self, remote: str, key: str, remote_address: int, nbytes: int, wait_s: float = 30.0, limit: int = 10000
        ) -> dict[str, Any]:
            """Keep writing ``nbytes`` on a thread until a write fails (or ``limit`` writes); see ``_result``."""
            self.loop_result: dict[str, Any] = {}
            local = np.array([self.buffers[key].data_ptr()], dtype=np.uint64)
            rem = np.array([remote_address], dtype=np.uint64)
            size = np.array([nbytes], dtype=np.uint64)

            def run() -> None:
                done = 0
                try:
                    while done < limit:
                        h = self.agent.submit(TransferOp.WRITE, remote, local, rem, size)
                        try:
                            self.agent.wait(h, wait_s)
                        finally:
                            if h.status is not TransferStatus.PENDING:
                                self.agent.release(h)
                        done += 1
                        self.loop_result["writes"] = done
                    self.loop_result.update(error_type="", message="no error", at=time.monotonic())
                except TransferTimeoutError as exc:
                    self.loop_result.update(error_type="HANG", message=str(exc), at=time.monotonic())
                except Exception as exc:
                    self.loop_result.update(error_type=type(exc).__name__, message=str(exc), at=time.monotonic())
                self.loop_result["writes"] = done

            self.loop_thread = threading.Thread(target=run, daemon=True)
            self.loop_thread.start()
            return {}

        def op_write_until_error_status(self) -> dict[str, Any]:
            return dict(self.loop_result)

        def op_write_until_error_result(self, timeout: float = 120.0) -> dict[str, Any]:
            self.loop_thread.join(timeout)
            if self.loop_thread.is_alive():
                raise TimeoutError(f"the write loop is still running after {timeout}s (a hang)")
            return dict(self.loop_result)

        def op_watch_for(self, key: str, expect: int, watch_s: float) -> dict[str, Any]:
            """``watch_start`` with its own bound (``call``'s ``timeout`` is the reply deadline, not this)."""
            return self.op_watch_start(key, expect, timeout=watch_s)

        def op_peer_info(self, remote: str) -> dict[str, Any]:
            """How this agent reaches a loaded peer: nixl's lane scope, ucx's endpoint error mode."""
            info: dict[str, Any] = {}
            if hasattr(self.agent, "peer_scope"):
                info["scope"] = self.agent.peer_scope(remote)
            if hasattr(self.agent, "peer_error_mode"):
                info["error_mode"] = self.agent.peer_error_mode(remote)
            return info

        def op_progress(self) -> dict[str, Any]:
            self.agent.progress()
            return {}

        # --- a transceiver rank (context or generation) of an instance spread over host processes ---------

        def op_rank_start(
            self,
            role: str,
            rank: int,
            spec: dict[str, Any],
            dist_port: int,
            bind_host: str,
            config: dict[str, Any] | None = None,
        ) -> dict[str, Any]:
            """Build one rank (the demo's storage and oracle) and its ``Transceiver``; a thread drives ``poll``.

            Every rank of an instance must be started concurrently (the process group and the
            transceiver's allgather wait for all of them).
            """
            import datetime
            import queue

            from kvcore.config import TransceiverConfig
            from kvcore.control.collective import LocalCollective, TorchCollective
            from kvcore.testing.scenario import DemoSpec, Rank
            from kvcore.transceiver import Transceiver

            demo = DemoSpec(**spec)
            tp, pp, _, _ = demo.side(role)
            self.world = tp * pp
            collective: Any
            if self.world > 1:
                import torch.distributed as dist

                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{dist_port}",  # inside this host: its own loopback
                    rank=rank,
                    world_size=self.world,
                    timeout=datetime.timedelta(seconds=demo.timeout_s + 30),
                )
                collective = TorchCollective()
            else:
                collective = LocalCollective()
            tx_config = TransceiverConfig(
                backend=self.backend,
                host=bind_host,
                request_timeout_s=demo.timeout_s,
                agent_options=self.options,
                # The test hosts' link is isolated inside namespaces this harness made (authentication is
                # tested on its own); a caller's config may still set auth_* instead.
                **{"allow_insecure_bind": True, **(config or {})},
            )
            me = Rank(role, rank, demo, self.agent)
            tx = Transceiver(
                tx_config,
                role=role,
                agent=self.agent,
                topology=me.topology,
                geometry=me.geometry,
                page_table=me.page_table,
                collective=collective,
                instance_name=f"{role}-two-hosts",
            )
            self.rank_state: dict[str, Any] = {
                "me": me, "tx": tx, "spec": demo, "collective": collective, "role": role,
                "commands": queue.Queue(), "outcomes": {}, "released": [], "error": "", "stop": False,
            }  # fmt: skip
            self.rank_thread = threading.Thread(target=self._rank_loop, daemon=True)
            self.rank_thread.start()
            return {"endpoint": tx.endpoint, "info_endpoint": tx.info_endpoint, "host_identity": host_identity()}

        def _rank_loop(self) -> None:
            st = self.rank_state
            me, tx, demo, collective = st["me"], st["tx"], st["spec"], st["collective"]
            try:
                while True:
                    while not st["commands"].empty():
                        cmd = st["commands"].get()
                        for r in me.mine(cmd["requests"]):
                            if cmd["op"] == "send":
                                me.fill(r)
                                tx.start_send(
                                    r,
                                    me.blocks[r],
                                    prompt_len=demo.tokens,
                                    state_slot=me.state_slot(r),
                                    ticket=derive_ticket(cmd["secret"], r),
                                )
                            else:
                                tx.start_receive(
                                    r,
                                    cmd["endpoint"],
                                    me.blocks[r],
                                    prompt_len=demo.tokens,
                                    state_slot=me.state_slot(r),
                                    ctx_dp_rank=demo.dp_group("context", r),
                                    ticket=derive_ticket(cmd["secret"], r),
                                )
                    result = tx.poll()  # collective: every rank of the instance polls in step
                    for o in result.outcomes:
                        error = f"{type(o.error).__name__}: {o.error}" if o.error is not None else ""
                        st["outcomes"][o.request_id] = [o.state.value, error]
                    st["released"].extend(result.released)
                    flags = collective.allgather(b"\x01" if st["stop"] else b"\x00")
                    if all(f == b"\x01" for f in flags):
                        return
                    time.sleep(0.0005)
            except Exception as exc:
                st["error"] = f"{type(exc).__name__}: {exc}"

        def op_rank_send(self, requests: list[int], secret: str = HARNESS_TICKET_SECRET) -> dict[str, Any]:
            """Context rank: fill this rank's part of ``requests`` with the oracle's values and send them.

            Tickets are derived from ``secret`` (hex), which the driver gives both instances.
            """
            self.rank_state["commands"].put({"op": "send", "requests": requests, "secret": bytes.fromhex(secret)})
            return {}

        def op_rank_receive(
            self, requests: list[int], endpoint: str, secret: str = HARNESS_TICKET_SECRET
        ) -> dict[str, Any]:
            """Generation rank: fetch ``requests`` from the context instance at ``endpoint``."""
            self.rank_state["commands"].put(
                {"op": "receive", "requests": requests, "endpoint": endpoint, "secret": bytes.fromhex(secret)}
            )
            return {}

        def op_rank_status(self) -> dict[str, Any]:
            st = self.rank_state
            return {
                "outcomes": {str(k): v for k, v in st["outcomes"].items()},
                "released": sorted(st["released"]),
                "error": st["error"],
            }

        def op_rank_verify(self, requests: list[int]) -> dict[str, Any]:
            """Generation rank: compare every byte of ``requests`` with the oracle (independent of kvcore)."""
            me = self.rank_state["me"]
            mine = set(me.mine(requests))
            bad, checked, first = 0, 0, ""
            for r in requests:
                n, nbytes, why = me.verify(r, r in mine)
                bad, checked, first = bad + n, checked + nbytes, first or why
            return {"mismatches": bad, "verified_bytes": checked, "first_bad": first}

        def op_rank_stop(self, join_s: float = 60.0) -> dict[str, Any]:
            """Stop polling (together with the instance's other ranks), close the transceiver, report leftovers."""
            st = self.rank_state
            st["stop"] = True
            self.rank_thread.join(join_s)
            if self.rank_thread.is_alive():
                raise TimeoutError(f"rank loop still polling after {join_s}s (another rank did not stop)")
            stats, leaks = st["tx"].stats(), st["tx"].leaks()
            st["tx"].close()
            if self.world > 1:
                import torch.distributed as dist

                dist.destroy_process_group()
            return {"stats": stats, "leaks": leaks, "error": st["error"]}

    return _HostPeer


def host_peer_main(channel: Any, backend: str, name: str, options: dict[str, Any]) -> None:
    """The rank function of a peer inside a host: the harness peer plus :func:`_peer_class`'s commands."""
    from kvcore.testing.harness import peer_main

    peer_main(channel, backend, name, options, peer_cls=_peer_class())
