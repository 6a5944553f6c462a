"""What a transceiver counts: the events (``RoleCounter``), which ``stats()`` keys only grow, which are caches."""

from __future__ import annotations

from typing import Literal

__all__ = ["RoleCounter", "COUNTERS", "CACHE_GAUGES", "leaks"]

#: The events a transceiver counts (``Link.counters``; ``stats()`` reports them, ``COUNTERS`` names those that only grow).
RoleCounter = Literal[
    "abandoned_transfers",
    "agent_errors",
    "bounce_fallback_arena_full",
    "bounce_fallback_plan_mismatch",
    "bounce_fallback_staging_full",
    "bounced_writes_total",
    "chunks_back_to_back",
    "early_requests_expired",
    "exposed_to_peers",
    "fenced_dead",
    "fenced_grace",
    "forged_messages",
    "idle_peers_dropped",
    "idle_peers_readmitted",
    "ignored_cancels",
    "ignored_messages",
    "ignored_renewals",
    "late_results",
    "lane_refusals",
    "lane_rejected_frames_total",  # reported by the native lane itself (its stats), never counted here
    "lane_requests_total",  # the same
    "lane_writes_total",  # the same
    "peers_closed",
    "peers_lost",
    "tickets_refused",
    "unexpected_messages",
    "worker_errors",
]

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
        "lane_declines",  # the native lane's answers for requests it does not serve (kept like tombstones)
        "lane_connections",  # connections to the lanes of the context ranks this rank asks
    }
)
#: ``stats()`` keys that only grow (events counted since start); every other key returns to zero when idle.
COUNTERS: frozenset[RoleCounter] = frozenset(
    {
        "bounced_writes_total",
        "bounce_fallback_arena_full",
        "bounce_fallback_plan_mismatch",
        "bounce_fallback_staging_full",
        "fenced_dead",
        "fenced_grace",
        "forged_messages",
        "peers_lost",
        "tickets_refused",
        "early_requests_expired",
        "peers_closed",
        "exposed_to_peers",
        "idle_peers_dropped",
        "idle_peers_readmitted",
        "lane_refusals",
        "lane_requests_total",
        "lane_rejected_frames_total",
        "lane_writes_total",
    }
)


def leaks(stats: dict[str, int]) -> dict[str, int]:
    """The per-request resources left in a ``stats()`` snapshot (sessions, leases, transfers...): {} when clean."""
    return {k: v for k, v in stats.items() if v and k not in CACHE_GAUGES and k not in COUNTERS}
