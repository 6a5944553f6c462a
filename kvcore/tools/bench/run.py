"""The orchestrator: one backend's pair of rank processes (:class:`BackendRun`), the case registry, the progress bar
and :func:`run_bench`, which runs every selected case on every selected backend.
"""

from __future__ import annotations

import itertools
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from kvcore.errors import KvcoreError
from kvcore.runtime import RankError, RankProcess
from kvcore.tools.bench.rank import _SECRET_ENV
from kvcore.tools.bench.spec import CASE_NAMES, BenchError, BenchSpec, Shape


class _RankProc(RankProcess):
    """The orchestrator's handle on one rank process: commands out, replies back, every wait bounded."""

    def __init__(self, role: str, backend: str, spec: BenchSpec) -> None:
        os.environ.setdefault(_SECRET_ENV, os.urandom(32).hex())  # inherited by every rank process of this run
        super().__init__(
            "kvcore.tools.bench.rank:_rank_main",
            name=f"{backend} {role} rank",
            kwargs={"role": role, "backend": backend, "spec": asdict(spec)},
        )
        self.role, self.spec = role, spec

    def ready(self) -> None:
        """Wait until the rank has set up (its agent exists)."""
        self.recv(self.spec.timeout_s, op="start")

    def call(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """``RankProcess.call`` with the run's bound (``timeout_s`` + 30 s) as the default deadline."""
        return super().call(op, timeout=timeout or self.spec.timeout_s + 30, **args)

    def close(self, timeout: float = 30.0) -> int | None:
        """Ask the rank to tear down and exit; reaped (killed past ``timeout``) in any case."""
        if self.alive():
            try:
                self.call("exit", timeout=timeout)
            except RankError:
                pass
        return super().close(10.0)


class BackendRun:
    """One backend's pair of rank processes, handed to every case function."""

    def __init__(
        self, backend: str, spec: BenchSpec, say: Callable[[str], None], tick: Callable[[int], None] | None = None
    ) -> None:
        self.backend, self.spec, self.say = backend, spec, say
        self._tick = tick
        self._rid = itertools.count(1)
        self.ctx: _RankProc | None = None
        self.gen: _RankProc | None = None
        try:
            self.ctx = _RankProc("context", backend, spec)
            self.gen = _RankProc("generation", backend, spec)
            self.ctx.ready()
            self.gen.ready()
        except BaseException:
            self.close()
            raise

    def tick(self, n: int = 1) -> None:
        """Advance the progress bar by ``n`` of the units the case declared (``register_case(units=...)``)."""
        if self._tick is not None:
            self._tick(n)

    def rids(self, n: int) -> int:
        """``n`` fresh request ids; returns the first."""
        first = next(self._rid)
        for _ in range(n - 1):
            next(self._rid)
        return first

    def open(self, shape: Shape, request_timeout_s: float | None = None, auth: bool = False) -> dict[str, Any]:
        """Set up both ranks for ``shape`` and make first contact (a one-block request, timed on its own)."""
        assert self.ctx is not None and self.gen is not None
        c = self.ctx.call("init", shape=asdict(shape), request_timeout_s=request_timeout_s, auth=auth)
        g = self.gen.call("init", shape=asdict(shape), request_timeout_s=request_timeout_s, auth=auth)
        self.ctx.call("peer", rank_info=g["rank_info"])
        self.endpoint = c["endpoint"]
        rid = self.rids(1)
        self.ctx.call("send", rid0=rid, n=1, region="first")
        r = self.gen.call("receive", endpoint=self.endpoint, rid0=rid, n=1, region="first", pipelined=False)
        ok = self.gen.call("verify", region="first")["ok"] and not r["not_done"]
        return {
            "first_contact_ms": r["latency_s"][0] * 1e3,
            "first_contact_verified": ok,
            "curve_ranks": int(c.get("curve", False)) + int(g.get("curve", False)),
        }

    def close_shape(self) -> dict[str, Any]:
        """Drain the context side, check the whole destination pool, tear both ranks' case state down."""
        assert self.ctx is not None and self.gen is not None
        drain = self.ctx.call("drain")
        full = self.gen.call("verify_all")
        g_stats = self.gen.call("teardown")["stats"]
        c_stats = self.ctx.call("teardown")["stats"]
        from kvcore.transceiver import leaks as _leaks

        leaks = {
            f"{side}.{k}": v
            for side, st in (("context", c_stats), ("generation", g_stats))
            for k, v in _leaks(st).items()
        }
        return {
            "context_outcomes": drain["outcomes"],
            "context_errors": drain["errors"],
            "pool_verified": full["ok"],
            "pool_bad_bytes": full["bad_bytes"],
            "leaks": leaks,
            # The evidence of the path the requests took: what each side's native lane served or was answered
            # (absent: no lane; config.native_lane off, or this backend has no poster).
            **(
                {
                    "lane_requests": {
                        "context": c_stats["lane_requests_total"],
                        "generation": g_stats["lane_requests_total"],
                    }
                }
                if "lane_requests_total" in c_stats and "lane_writes_total" in c_stats
                else {}
            ),
        }

    def kvcore_once(self, region: str, mode: str = "push") -> float:
        """One request through both Transceivers into zeroed memory; returns seconds and checks the bytes."""
        assert self.ctx is not None and self.gen is not None
        rid = self.rids(1)
        params = self.ctx.call("send", rid0=rid, n=1, region=region, mode=mode)["params"]
        r = self.gen.call(
            "receive", endpoint=self.endpoint, rid0=rid, n=1, region=region, pipelined=False, params=params or None
        )
        if r["not_done"]:
            raise BenchError(f"{self.backend}: kvcore request failed: {r['not_done'][0]}")
        return float(r["latency_s"][0])

    def close(self) -> None:
        for p in (self.gen, self.ctx):
            if p is not None:
                p.close()


#: A case: ``fn(run) -> result dict``. Register more with :func:`register_case` (e.g. a TP2->TP4 bounce case).
CaseFn = Callable[[BackendRun], dict[str, Any]]
CASES: dict[str, CaseFn] = {}
#: Progress units of a case for a spec; a case with units calls ``run.tick()`` that many times.
CASE_UNITS: dict[str, Callable[[BenchSpec], int]] = {}


def _one_unit(spec: BenchSpec) -> int:
    """A case without declared units counts as one unit of the progress bar."""
    return 1


def register_case(name: str, units: Callable[[BenchSpec], int] | None = None) -> Callable[[CaseFn], CaseFn]:
    """Decorator: make ``fn(run: BackendRun) -> dict`` selectable as ``kvcore bench --cases name``.

    ``units(spec)`` is how many times the case calls ``run.tick()`` (its share of the progress bar); without
    it the case counts as one unit, ticked when it returns.
    """

    def deco(fn: CaseFn) -> CaseFn:
        if name in CASES:
            raise BenchError(f"benchmark case {name!r} is registered twice")
        CASES[name] = fn
        CASE_NAMES.add(name)
        if units is not None:
            CASE_UNITS[name] = units
        return fn

    return deco


def installed_backends() -> list[str]:
    """Every transfer agent whose plugin loads here: network agents first (by auto-selection priority), then by name."""
    from kvcore.extension.plugins import get_plugin_manager

    reg = get_plugin_manager().registries.transfer_agents
    ok = []
    for name in reg.names():
        try:
            reg.get(name)
        except KvcoreError:
            continue
        ok.append(name)
    return reg.preferred_order(ok)


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


class BenchProgress:
    """A progress bar on stderr (rich): the cases' units done of the total, the current step as its label."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}", style="bold"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        )
        self._task: Any = None

    def start(self, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("kvcore bench", total=max(1, total))

    def say(self, message: str) -> None:
        if self._task is not None:
            self._bar.update(self._task, description=message)

    def advance(self, n: int = 1) -> None:
        if self._task is not None:
            self._bar.advance(self._task, n)

    def stop(self) -> None:
        self._bar.stop()


def run_bench(
    spec: BenchSpec, *, say: Callable[[str], None] | None = None, progress: BenchProgress | None = None
) -> dict[str, Any]:
    """Run every selected case on every selected backend; returns the JSON-able result (``ok`` says all verified).

    A backend that fails is reported under its name (``ok: false`` and the error) and the others still run.
    ``progress`` (a :class:`BenchProgress`) shows a bar; ``say`` gets each step's label otherwise.
    """
    spec.validate()
    if "small_auth" in spec.cases and not spec.auth_config:
        from kvcore.tools.demo import instance_keys

        with instance_keys() as keys:  # private temporary directory, removed when the run ends
            result = run_bench(replace(spec, auth_config=keys), say=say, progress=progress)
        result["spec"]["auth_config"] = {}  # the paths are gone with the keys
        return result
    backends = spec.backends or installed_backends()
    if progress is not None:
        progress.start(len(backends) * sum(CASE_UNITS.get(c, _one_unit)(spec) for c in spec.cases))
        try:
            return _run_bench(spec, backends, progress.say, progress.advance)
        finally:
            progress.stop()
    return _run_bench(spec, backends, say or (lambda _msg: None), None)


def _describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of the error it interrupted, if any (a case that failed, then failed again
    checking its shape in ``finally``, reports the first failure as well as the second)."""
    text = f"{type(exc).__name__}: {exc}"
    first = exc.__context__
    if first is not None and first is not exc.__cause__:
        text += f"\n(raised while handling an earlier error: {type(first).__name__}: {first})"
    return text


def _run_bench(
    spec: BenchSpec, backends: list[str], say: Callable[[str], None], tick: Callable[[int], None] | None
) -> dict[str, Any]:
    result: dict[str, Any] = {"version": 1, "machine": _machine(), "spec": asdict(spec), "backends": {}}
    t0 = time.perf_counter()
    for backend in backends:
        entry: dict[str, Any] = {"cases": {}}
        result["backends"][backend] = entry
        run = None
        try:
            from kvcore.config import resolve_backend

            resolve_backend(backend)  # a missing or broken backend fails here, before any process starts
            say(f"{backend}: starting rank processes")
            run = BackendRun(backend, spec, say, tick)
            for case in spec.cases:
                entry["cases"][case] = CASES[case](run)
                if case not in CASE_UNITS:
                    run.tick()
            entry["ok"] = all(c.get("verified") and not c.get("leaks") for c in entry["cases"].values())
        except (KvcoreError, OSError, EOFError) as exc:
            entry["ok"] = False
            entry["error"] = _describe(exc)
        finally:
            if run is not None:
                run.close()
    result["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["seconds"] = time.perf_counter() - t0
    result["ok"] = bool(backends) and all(b["ok"] for b in result["backends"].values())
    return result
