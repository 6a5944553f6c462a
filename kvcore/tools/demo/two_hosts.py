"""``kvcore demo --two-hosts``: the demo's instances in two namespaced hosts, every byte verified.

The context instance runs in host ``a`` and the generation instance in host
``b`` of :class:`kvcore.runtime.hosts.TwoHosts` (own network, pid, UTS, IPC and
mount namespaces, joined by a veth pair). Each rank is a harness peer process
(:class:`kvcore.testing.host_peer.HostPeer`: ``rank_start``/``rank_send``/``rank_receive``/``rank_verify``/
``rank_stop``), which builds the demo's own storage and oracle
(:class:`kvcore.testing.scenario.Rank`); this module only orchestrates them and writes
the demo's summary. KV crosses the link with NIXL or UCX over TCP: the shm
agent cannot reach another host.

What the two-host run does not cover (the harness ranks do not): Mamba state,
layer-wise sending and a cached prefix; ``validate_two_hosts`` refuses them.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcore.testing.scenario import DemoSpec

__all__ = [
    "network_backends",
    "TwoHostsUnavailable",
    "resolve_two_hosts_backend",
    "run_two_hosts",
    "validate_two_hosts",
]

#: Seconds between the orchestrator's status polls of the generation ranks (bounds the timing error).
_POLL_S = 0.002


class TwoHostsUnavailable(RuntimeError):
    """Namespaced hosts cannot be made here (not root, no ``ip``/``unshare``, a container refusing namespaces)."""


def network_backends() -> list[str]:
    """The registered transfer agents that reach a peer on another host (their plugins declare ``remote=True``)."""
    from kvcore.extension.plugins import get_plugin_manager

    return get_plugin_manager().registries.transfer_agents.remote_names()


def resolve_two_hosts_backend(backend: str) -> str:
    """The network agent to use: ``backend`` itself, or for ``auto`` the first network agent whose plugin loads.

    ``ValueError`` names the choices for shm or any agent that cannot cross hosts.
    """
    from kvcore.config import resolve_backend
    from kvcore.errors import KvcoreError

    network = network_backends()
    if backend == "auto":
        for name in network:
            try:
                resolve_backend(name)
            except KvcoreError:
                continue
            return name
        raise ValueError(
            "backend: --two-hosts needs a network transport (an agent whose plugin declares remote=True), "
            f"and none loads here (registered network agents: {', '.join(network) or 'none'})"
        )
    if backend not in network:
        raise ValueError(
            f"backend: --two-hosts needs a network transport ({' or '.join(network) or 'none installed'}), "
            f"got {backend!r}" + (": the shm agent only reaches processes on its own host" if backend == "shm" else "")
        )
    return backend


def validate_two_hosts(spec: DemoSpec) -> None:
    """Raise ``ValueError`` naming the first setting a two-host run cannot honour."""
    resolve_two_hosts_backend(spec.backend)
    for name, value, ok in (
        ("mamba", spec.mamba, False),
        ("layerwise", spec.layerwise, False),
        ("cached_prefix_blocks", spec.cached_prefix_blocks, 0),
    ):
        if value != ok:
            raise ValueError(
                f"{name}: --two-hosts runs attention KV only, whole prompts; expected {ok!r}, got {value!r}"
            )


def _mine(spec: DemoSpec, role: str, rank: int, requests: list[int]) -> list[int]:
    """The requests of ``requests`` that ``rank`` of instance ``role`` reports (its attention-DP group's)."""
    tp, _, _, adp = spec.side(role)
    group = rank % tp if adp else 0
    return [r for r in requests if spec.dp_group(role, r) == group]


def _start(host: Any, backend: str, spec: DemoSpec, role: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """Every rank of one instance as a peer process in ``host``, started together (their process group waits)."""
    tp, pp, _, _ = spec.side(role)
    world = tp * pp
    config = {k: v for k, v in spec.config_overrides(role).items() if k != "request_timeout_s"}
    # With CURVE a non-loopback bind needs no opt-in; without it the link is one this run isolated itself.
    config["allow_insecure_bind"] = not spec.auth
    from kvcore.testing.host_peer import HostPeer

    peers: list[Any] = []
    with ThreadPoolExecutor(world) as pool:
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}  # gloo's "hostname cannot be retrieved" noise
        # A network agent that advertises one address of its own (kvcore-mooncake's bind_address, loopback by
        # default) reads it from KVCORE_<BACKEND>_BIND_ADDRESS: here, the test host's own address.
        env.setdefault(f"KVCORE_{backend.upper()}_BIND_ADDRESS", host.address)
        peers = list(pool.map(lambda r: HostPeer(host, backend, {}, name=f"{role[:3]}{r}", env=env), range(world)))
        infos = list(
            pool.map(
                lambda r: peers[r].call(
                    "rank_start",
                    role=role,
                    rank=r,
                    spec=asdict(spec),
                    dist_port=29500,  # the host's own loopback: each host has its own port space
                    bind_host=host.address,
                    config=config,
                    timeout=spec.timeout_s + 120,
                ),
                range(world),
            )
        )
    return peers, infos


def _wait_released(peers: list[Any], spec: DemoSpec, role: str, requests: list[int], deadline: float) -> None:
    """Poll until every rank of ``peers`` has released its share of ``requests``; a rank's error raises."""
    while True:
        done = True
        for rank, p in enumerate(peers):
            st = p.call("rank_status")
            if st["error"]:
                raise RuntimeError(f"{role} rank {rank} failed: {st['error']}")
            if not set(_mine(spec, role, rank, requests)) <= set(st["released"]):
                done = False
        if done:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{role} ranks did not release requests {requests[:8]} in time")
        time.sleep(_POLL_S)


def run_two_hosts(spec: DemoSpec) -> dict[str, Any]:
    """Run the demo across hosts a and b; returns the summary ``kvcore.tools.demo.run_demo`` returns (plus ``hosts``).

    ``TwoHostsUnavailable`` (before anything is made) where namespaces cannot be
    built. The first requests (one per DP group) make first contact and are
    timed apart; GB/s counts the rest, from the first ``rank_receive`` to the
    last release seen by the orchestrator (polled every 2 ms).
    """
    from kvcore.runtime.hosts import TwoHosts, unavailable_reason

    backend = resolve_two_hosts_backend(spec.backend)
    reason = unavailable_reason()
    if reason is not None:
        raise TwoHostsUnavailable(f"--two-hosts cannot build namespaced hosts here: {reason}")
    requests = list(range(spec.requests))
    n_warm = max(spec.dp_size("context"), spec.dp_size("generation"))
    warm, timed = (requests[:n_warm], requests[n_warm:]) if spec.requests > n_warm else ([], requests)
    summary: dict[str, Any] = {"spec": asdict(spec), "ok": False, "backend": backend}
    ctx: list[Any] = []
    gen: list[Any] = []
    t_spawned = time.monotonic()
    with TwoHosts() as hosts:
        try:
            hosts.wait_link()
            ctx, ctx_info = _start(hosts.a, backend, spec, "context")
            gen, _ = _start(hosts.b, backend, spec, "generation")
            endpoint = ctx_info[0]["info_endpoint"]
            summary["hosts"] = (
                f"context in {hosts.a.hostname} ({hosts.a.address}), generation in {hosts.b.hostname} "
                f"({hosts.b.address}), veth link; context info endpoint {endpoint}"
            )
            t_ready = time.monotonic()
            deadline = t_ready + 2 * spec.timeout_s + 60
            for p in ctx:
                p.call("rank_send", requests=requests)  # fills every request, then starts sending
            t0 = time.perf_counter()
            if warm:
                for p in gen:
                    p.call("rank_receive", requests=warm, endpoint=endpoint)
                _wait_released(gen, spec, "generation", warm, deadline)
            first_contact = time.perf_counter() - t0
            t0 = time.perf_counter()
            for p in gen:
                p.call("rank_receive", requests=timed, endpoint=endpoint)
            _wait_released(gen, spec, "generation", timed, deadline)
            elapsed = time.perf_counter() - t0
            _wait_released(ctx, spec, "context", requests, deadline)
            t_done = time.monotonic()
            timed_checks = [p.call("rank_verify", requests=timed, timeout=spec.timeout_s) for p in gen]
            warm_checks = [p.call("rank_verify", requests=warm, timeout=spec.timeout_s) for p in gen]
            statuses = [("context", r, p.call("rank_status")) for r, p in enumerate(ctx)]
            statuses += [("generation", r, p.call("rank_status")) for r, p in enumerate(gen)]
            with ThreadPoolExecutor(len(ctx) + len(gen)) as pool:
                stops = list(pool.map(lambda p: p.call("rank_stop", timeout=120), gen + ctx))
        finally:
            for p in gen + ctx:
                p.close()
    nbytes = sum(c["verified_bytes"] for c in timed_checks)
    checks = timed_checks + warm_checks
    mismatches = sum(c["mismatches"] for c in checks)
    expected = sum(len(_mine(spec, role, rank, requests)) for role, rank, _ in statuses)
    states = [v[0] for _, _, st in statuses for v in st["outcomes"].values()]
    done = sum(s == "DONE" for s in states)
    errors_all = [
        f"{role} rank {rank} request {rid}: {v[1]}"
        for role, rank, st in statuses
        for rid, v in st["outcomes"].items()
        if v[1]
    ]
    names = [f"generation{r}" for r in range(len(gen))] + [f"context{r}" for r in range(len(ctx))]
    leaks = {n: st["leaks"] for n, st in zip(names, stops, strict=True) if st["leaks"]}
    stop_errors = {n: st["error"] for n, st in zip(names, stops, strict=True) if st["error"]}
    counters: dict[str, int] = {}
    for st in stops:
        for k, v in st["stats"].items():
            if k.endswith("_total"):
                counters[k] = counters.get(k, 0) + int(v)
    summary.update(
        requests=spec.requests,
        processes=len(ctx) + len(gen),
        bytes=nbytes + sum(c["verified_bytes"] for c in warm_checks),
        timed_bytes=nbytes,
        timed_requests=len(timed),
        seconds=elapsed,
        gbps=nbytes / elapsed / 1e9 if elapsed else 0.0,
        latency_ms_p50=None,  # the harness ranks do not time single requests; first contact is timed apart
        latency_ms_p99=None,
        first_contact_ms=first_contact * 1000,
        phases_s={"startup": t_ready - t_spawned, "run": t_done - t_ready},
        done=done,
        not_done=expected - done,
        mismatches=mismatches,
        # The harness verifies after release, not at DONE; nothing is reused in between.
        mismatches_at_done=0,
        checked_at_done=0,
        done_generation=sum(
            s == "DONE" for role, _, st in statuses if role == "generation" for s, _ in st["outcomes"].values()
        ),
        first_mismatch=next((c["first_bad"] for c in checks if c["first_bad"]), ""),
        errors={"count": len(errors_all), "first": errors_all[:3]} if errors_all else {},
        leaks=leaks,
        counters=counters,
        teardown={"killed": [], "exit_codes": stop_errors},
    )
    summary["ok"] = mismatches == 0 and summary["not_done"] == 0 and not leaks and not stop_errors and nbytes > 0
    return summary
