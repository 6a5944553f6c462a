"""``kvcore demo``'s orchestrator: start the context and generation ranks, drive them, collect the summary.

Each rank is a :class:`kvcore.runtime.RankProcess` running :func:`kvcore.tools.demo.rank.rank_main` (a
forkserver child with torch preloaded where available); ``--auth`` gets fresh instance keys
(:func:`instance_keys`), ``--two-hosts`` runs in two namespaced hosts (:mod:`kvcore.tools.demo.two_hosts`).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any

from kvcore.runtime import RankExitedError, RankProcess, StartMethod, ready
from kvcore.testing.scenario import DemoSpec
from kvcore.tools.demo.rank import TEARDOWN_WATCHDOG_S

__all__ = ["instance_keys", "run_demo"]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (where ``bind(0)`` and outgoing connections pick theirs)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_port() -> int:
    """A free port for torch.distributed's rendezvous, which binds it only later, in rank 0.

    Taken below the ephemeral range: a port from ``bind(0)`` could be handed to another process's ``bind(0)``
    or outgoing connection between this check and that bind (seen in the test suite: EADDRINUSE in
    ``init_process_group``); below it only an explicit bind can take it. The ephemeral range if none is free.
    """
    import random

    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(64):
        port = pick.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_method() -> StartMethod:
    """``forkserver`` with torch preloaded where available (one torch import for all ranks), else a subprocess each."""
    if "forkserver" in mp.get_all_start_methods() and os.environ.get("KVCORE_DEMO_START", "forkserver") == "forkserver":
        return StartMethod.FORKSERVER
    return StartMethod.SUBPROCESS


#: What the forkserver imports once for every rank it starts.
_PRELOAD = ("torch", "torch.distributed", "numpy", "msgspec", "kvcore.tools.demo.rank")


def _leaks(stats: dict[str, int]) -> dict[str, int]:
    """Live per-request resources left over (sessions, leases, transfers...): all must be back at zero."""
    from kvcore.transceiver import leaks

    return leaks(stats)


class _Ranks:
    """The rank processes of one run; collects their messages, notices deaths."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, int], RankProcess] = {}
        self.stopped: dict[str, Any] | None = None

    def start(self, role: str, rank: int, spec: DemoSpec, dist_port: int) -> None:
        method = _start_method()
        self.procs[(role, rank)] = RankProcess(
            "kvcore.tools.demo.rank:rank_main",
            name=f"{role} rank {rank}",
            kwargs={"role": role, "rank": rank, "spec": asdict(spec), "dist_port": dist_port},
            start=method,
            preload=_PRELOAD if method is StartMethod.FORKSERVER else (),
        )

    def send(self, keys: list[tuple[str, int]], message: dict[str, Any]) -> None:
        for k in keys:
            self.procs[k].send(message)

    def wait(self, keys: list[tuple[str, int]], deadline: float, on_progress: Any = None) -> dict[tuple[str, int], Any]:
        """The next non-progress message of each rank in ``keys``; a rank's error or death raises at once."""
        out: dict[tuple[str, int], Any] = {}
        pending = {self.procs[k]: k for k in keys}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no message from {sorted(pending.values())} in time")
            for p in ready(list(pending), min(left, 0.5)):
                while p in pending and (m := p.try_recv()) is not None:  # a failure or death raises here
                    if m["kind"] == "progress":
                        if on_progress is not None:
                            on_progress(m["n"])
                        continue
                    out[pending.pop(p)] = m
            for p in list(pending):
                if not p.alive() and p.try_recv() is None:
                    raise RankExitedError(rank=p.name, op="report", exitcode=p.exitcode)
        return out

    def stop(self, grace: float) -> dict[str, Any]:
        """Join every rank within ``grace`` seconds in all, then kill what is left; idempotent.

        Returns the ranks that had to be killed and those that exited non-zero.
        """
        if self.stopped is not None:
            return self.stopped
        end = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, end - time.monotonic()))
        killed = [f"{role}{rank}" for (role, rank), p in self.procs.items() if p.alive()]
        for p in self.procs.values():
            if p.alive():
                p.kill()
        for p in self.procs.values():
            p.close(5.0)
        failed = {
            f"{role}{rank}": p.exitcode
            for (role, rank), p in self.procs.items()
            if p.exitcode and f"{role}{rank}" not in killed
        }
        self.stopped = {"killed": killed, "exit_codes": failed}
        return self.stopped


@contextlib.contextmanager
def instance_keys() -> Iterator[dict[str, dict[str, str]]]:
    """A fresh CURVE key pair per instance in a private temporary directory; yields each role's ``auth_*`` fields.

    The directory is mode 0700 and each secret file 0600 (``write_key_pair``);
    both public ``*.key`` files sit in it, so it is the allow-list
    (``auth_allowed_keys_dir``) of every rank of both instances. Generation
    ranks are told the context's public key (``auth_server_key``): the key its
    info endpoint must prove. The context learns each generation rank's key
    from its ``RankInfo``, which arrives over the authenticated link. The
    directory and every key in it are removed when the block ends, also after
    a failure.
    """
    from kvcore.control.auth import AuthConfig, write_key_pair

    keydir = tempfile.mkdtemp(prefix="kvcore-demo-keys-")  # mkdtemp: mode 0700, owned by this user only
    try:
        os.chmod(keydir, 0o700)
        _, ctx_secret = write_key_pair(keydir, "context")
        _, gen_secret = write_key_pair(keydir, "generation")
        ctx_public = AuthConfig.from_files(ctx_secret).public_key.decode()
        yield {
            "context": {"auth_key_file": str(ctx_secret), "auth_allowed_keys_dir": keydir},
            "generation": {
                "auth_key_file": str(gen_secret),
                "auth_allowed_keys_dir": keydir,
                "auth_server_key": ctx_public,
            },
        }
    finally:
        shutil.rmtree(keydir, ignore_errors=True)


def run_demo(spec: DemoSpec, *, progress: bool = True) -> dict[str, Any]:
    """Run the whole demo and return the summary (raises nothing for transfer failures: see ``ok``).

    ``spec.auth`` without ``spec.auth_config``: fresh instance keys for this run
    (:func:`instance_keys`). ``spec.two_hosts``: the instances run in two
    namespaced hosts (:func:`kvcore.tools.demo.two_hosts.run_two_hosts`).
    """
    spec.validate()
    if spec.two_hosts:
        from kvcore.tools.demo.two_hosts import validate_two_hosts

        validate_two_hosts(spec)  # before any key or process is made
    if spec.auth and not spec.auth_config:
        with instance_keys() as keys:
            summary = run_demo(replace(spec, auth_config=keys), progress=progress)
        summary["spec"]["auth_config"] = {}  # the paths are gone with the keys
        return summary
    if spec.two_hosts:
        from kvcore.tools.demo.two_hosts import run_two_hosts

        return run_two_hosts(spec)
    return _run_local(spec, progress=progress)


def _run_local(spec: DemoSpec, *, progress: bool) -> dict[str, Any]:
    """Both instances as child processes of this one (the default)."""
    import numpy as np

    ranks = _Ranks()
    summary: dict[str, Any] = {"spec": asdict(spec), "ok": False}
    bar = None
    try:
        for role in ("context", "generation"):
            tp, pp, _, _ = spec.side(role)
            port = _free_port()
            for rank in range(tp * pp):
                ranks.start(role, rank, spec, port)
        t_spawned = time.monotonic()
        first = ranks.wait([("context", 0)], t_spawned + spec.timeout_s)[("context", 0)]
        t_ready = time.monotonic()
        summary["backend"] = first["backend"]
        secret = os.urandom(32)  # the run's ticket secret: only this driver and its ranks know it
        go = {"kind": "go", "endpoint": first["endpoint"], "secret": secret, "incarnation": first["incarnation"]}
        ranks.send(list(ranks.procs), go)
        gen_keys = [k for k in ranks.procs if k[0] == "generation"]
        if spec.mode == "pull":
            ranks.wait([k for k in ranks.procs if k[0] == "context"], time.monotonic() + spec.timeout_s)
            ranks.send(gen_keys, {"kind": "sent"})
        shown = len([r for r in range(spec.requests) if spec.dp_group("generation", r) == 0])
        on_progress = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task(f"moving {spec.requests} requests ({summary['backend']})", total=shown)

            def on_progress(n: int) -> None:
                bar.update(task, completed=n)

        reports = ranks.wait(list(ranks.procs), time.monotonic() + 2 * spec.timeout_s + 60, on_progress)
        ranks.send(list(ranks.procs), {"kind": "exit"})
        t_done = time.monotonic()
        # Every rank must close its transceiver, agent and process group by itself, promptly.
        teardown = ranks.stop(grace=TEARDOWN_WATCHDOG_S + 2)
        summary["phases_s"] = {
            "startup": t_ready - t_spawned,
            "run": t_done - t_ready,
            "teardown": time.monotonic() - t_done,
        }
        gen = [reports[k] for k in gen_keys]
        ctx = [r for k, r in reports.items() if k[0] == "context"]
        lat = np.array([x for r in gen for x in r["outcomes"]["latency"]]) * 1000
        elapsed = max(r["seconds"] for r in gen)
        nbytes = sum(r["verified_bytes"] for r in gen)
        states = [s for r in gen + ctx for s in r["outcomes"]["states"].values()]
        expected = sum(r["expected"] for r in gen + ctx)
        all_errors = [
            (f"{r['role']} rank {r['rank']} request {k}", v)
            for r in gen + ctx
            for k, v in r["outcomes"]["errors"].items()
        ]
        errors = {"count": len(all_errors), "first": [f"{w}: {e}" for w, e in all_errors[:3]]} if all_errors else {}
        mismatches = sum(r["mismatches"] for r in gen)
        mismatches_at_done = sum(r["mismatches_at_done"] for r in gen)
        checked_at_done = sum(r["checked_at_done"] for r in gen)
        leaks = {f"{r['role']}{r['rank']}": _leaks(r["stats"]) for r in gen + ctx}
        leaks = {k: v for k, v in leaks.items() if v}
        counters: dict[str, int] = {}
        for r in gen + ctx:
            for k, v in r["stats"].items():
                if k.endswith("_total"):
                    counters[k] = counters.get(k, 0) + int(v)
        done = sum(s == "DONE" for s in states)
        done_gen = sum(s == "DONE" for r in gen for s in r["outcomes"]["states"].values())
        summary.update(
            requests=spec.requests,
            processes=len(ranks.procs),
            bytes=nbytes,
            seconds=elapsed,
            gbps=nbytes / elapsed / 1e9 if elapsed else 0.0,
            latency_ms_p50=float(np.percentile(lat, 50)) if lat.size else None,
            latency_ms_p99=float(np.percentile(lat, 99)) if lat.size else None,
            first_contact_ms=max(r["first_contact_s"] for r in gen) * 1000,
            done=done,
            not_done=expected - done,
            mismatches=mismatches,
            mismatches_at_done=mismatches_at_done,
            checked_at_done=checked_at_done,
            done_generation=done_gen,
            first_mismatch=next((r["first_bad"] for r in gen if r["first_bad"]), ""),
            errors=errors,
            leaks=leaks,
            counters=counters,
        )
        summary["teardown"] = teardown
        summary["auth_ranks"] = sum(bool(r.get("curve")) for r in gen + ctx)
        summary["ok"] = (
            mismatches == 0
            and mismatches_at_done == 0
            and checked_at_done == done_gen
            and summary["not_done"] == 0
            and not leaks
            and nbytes > 0
            and not teardown["killed"]
            and not teardown["exit_codes"]
            # Every rank authenticates: with --auth by the instance keys, on loopback by this user's local key
            # (the default); only the namespaced hosts without --auth run without (an isolated link, warned).
            and summary["auth_ranks"] == (len(gen + ctx) if spec.auth or not spec.two_hosts else 0)
        )
        return summary
    finally:
        if bar is not None:
            bar.stop()
        ranks.stop(grace=1.0)  # no-op after a clean run; kills whatever is left after a failure
