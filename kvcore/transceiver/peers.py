"""Peer lifecycles: what a rank knows about the other side, with incarnations, as an explicit state machine.

::

    UNKNOWN ──► CONNECTING ──► READY ◄──► SUSPECT
                    │            │           │
                    ├──► REFUSED │           │
                    │       │    ▼           ▼
                    └──────►│── LOST ◄───────┘
                            ▼    │
                        UNLOADED ◄┘

* A generation rank tracks each **context instance** it fetched (``CtxInstance``,
  keyed by the endpoint of the instance's rank 0); a context rank tracks each
  **generation rank** that registered (``GenPeer``, keyed by instance name and rank).
* ``SUSPECT``: the control connection dropped; the peer may come back (ZeroMQ
  reconnects). Coming back with the same incarnation makes it ``READY`` again; with
  another incarnation it was restarted: the old peer is ``LOST`` and a new one
  replaces it. No reconnection within ``peer_lost_timeout_s``: ``LOST``.
* ``LOST``: its requests fail with ``PeerLostError``; writes it may still make are
  fenced (see :func:`writer_fenced`). Once nothing references it any more it is
  ``UNLOADED``: its agent unloaded, its sockets closed, its entries dropped.
* ``REFUSED``: incompatible or failed first contact; cached for
  ``refused_peer_ttl_s`` so repeated requests fail fast, then forgotten.
* A generation rank that asks for nothing for ``idle_peer_ttl_s`` (or, while the
  table is full, one that never asked) is dropped like a lost one: ``LOST``, then
  ``UNLOADED``. If it had asked before, a later ask admits it again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from kvcore import hostinfo
from kvcore.control import wire
from kvcore.errors import KvcoreError, SessionError

__all__ = ["PeerState", "Peer", "CtxInstance", "GenPeer", "FenceHow", "writer_fenced"]


class PeerState(str, Enum):
    UNKNOWN = "UNKNOWN"
    CONNECTING = "CONNECTING"  # first contact under way (fetching info, loading the agent, registering)
    READY = "READY"
    SUSPECT = "SUSPECT"  # control connection dropped; waiting for it to come back
    LOST = "LOST"  # dead, restarted or unreachable: its requests failed, its writers being fenced
    REFUSED = "REFUSED"  # incompatible or first contact failed; remembered for a while
    UNLOADED = "UNLOADED"  # gone from every table; agent unloaded, sockets closed


# The one place the allowed peer transitions live.
_ALLOWED: dict[PeerState, frozenset[PeerState]] = {
    PeerState.UNKNOWN: frozenset({PeerState.CONNECTING, PeerState.READY, PeerState.REFUSED}),
    PeerState.CONNECTING: frozenset({PeerState.READY, PeerState.REFUSED, PeerState.LOST, PeerState.SUSPECT}),
    # READY/SUSPECT -> REFUSED: a context rank's answer to our registration (sent once its agents were loaded
    # here) refuses us; it serves us nothing, so its instance is refused as at first contact.
    PeerState.READY: frozenset({PeerState.SUSPECT, PeerState.LOST, PeerState.REFUSED}),
    PeerState.SUSPECT: frozenset({PeerState.READY, PeerState.CONNECTING, PeerState.LOST, PeerState.REFUSED}),
    PeerState.LOST: frozenset({PeerState.UNLOADED}),
    PeerState.REFUSED: frozenset({PeerState.UNLOADED}),
    PeerState.UNLOADED: frozenset(),
}


@dataclass(eq=False)
class Peer:
    """Common lifecycle of a peer; ``deadline`` bounds the current state where it has a bound."""

    state: PeerState = PeerState.UNKNOWN
    created: float = field(default_factory=time.monotonic)
    since: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    error: KvcoreError | None = None

    def move(self, new: PeerState, *, deadline: float | None = None, error: KvcoreError | None = None) -> bool:
        """Move along the table; False (nothing changes) when the move is not allowed from here."""
        if new is self.state:
            return False
        if new not in _ALLOWED[self.state]:
            if self.state in (PeerState.LOST, PeerState.REFUSED, PeerState.UNLOADED):
                return False  # a peer's end is final; late news changes nothing
            raise SessionError(f"peer {self}: illegal transition {self.state.value} -> {new.value}")
        self.state, self.since, self.deadline = new, time.monotonic(), deadline
        if error is not None:
            self.error = error
        return True

    @property
    def gone(self) -> bool:
        return self.state in (PeerState.LOST, PeerState.REFUSED, PeerState.UNLOADED)


@dataclass(eq=False)
class CtxInstance(Peer):
    """A context instance as a generation rank knows it: every rank's info, of one incarnation."""

    endpoint: str = ""  # the instance's rank 0 endpoint (its disagg_info_endpoint)
    ranks: list[wire.RankInfo] = field(default_factory=list)
    peers: list[int] = field(default_factory=list)  # ctx ranks this generation rank exchanges with
    agents: dict[int, str] = field(default_factory=dict)  # ctx rank -> loaded agent name
    registered: set[int] = field(default_factory=set)  # ctx ranks that loaded our agent (we may READ from them)
    loaded: dict[int, bytes] = field(default_factory=dict)  # ctx rank -> the agent descriptor of its we loaded last
    exposed: set[int] = field(default_factory=set)  # ctx ranks whose full descriptor we loaded (pull reads)
    exposing: dict[int, bytes] = field(default_factory=dict)  # ctx rank -> nonce of our unanswered ExposeRequest
    #: REFUSED for compatibility: the ranks that hear of each request refused meanwhile (empty: tell nobody)
    refusal_ranks: list[wire.RankInfo] = field(default_factory=list)
    lost_at: float | None = None
    goodbye: set[int] = field(default_factory=set)  # ctx ranks that said they are closing (wire.Goodbye)
    #: The agent name a load of this instance waits for (its previous incarnation still holds it); "" when none.
    name_held: str = ""

    @property
    def incarnation(self) -> str:
        return self.ranks[0].incarnation if self.ranks else ""

    @property
    def name(self) -> str:
        return self.ranks[0].instance_name if self.ranks else ""

    def rank_of_endpoint(self, endpoint: str) -> int | None:
        for info in self.ranks:
            if info.endpoint == endpoint:
                return info.rank
        return None

    def __str__(self) -> str:
        return f"context instance at {self.endpoint}"


@dataclass(eq=False)
class GenPeer(Peer):
    """A generation rank (one incarnation) registered with this context rank."""

    info: wire.RankInfo | None = None
    agent_name: str | None = None
    inflight: int = 0  # transfers submitted to it and not yet terminal at the transport
    lost_at: float | None = None
    ready_at: float = 0.0
    identity: bytes | None = None  # ROUTER identity of the connection it registered (and last asked) on
    goodbye: bool = False  # it said it is closing (wire.Goodbye); final once its connection drops
    #: When it last asked for a request (RequestData, PullDone, Renew); None: never since it registered.
    asked_at: float | None = None
    lane_descriptor: bytes = b""  # its native poster's descriptor (RegisterRankInfo.lane); empty: none
    #: What this rank's lane answered its registration with: (endpoint, token, CURVE key); None: no lane for it.
    lane: tuple[str, bytes, bytes] | None = None

    @property
    def active_at(self) -> float:
        """Since when it has asked for nothing: its last ask, else its registration."""
        return self.asked_at if self.asked_at is not None else self.created

    @property
    def name(self) -> str:
        return self.info.instance_name if self.info else ""

    @property
    def key(self) -> tuple[str, int]:
        assert self.info is not None
        return (self.info.instance_name, self.info.rank)

    @property
    def incarnation(self) -> str:
        return self.info.incarnation if self.info else ""

    def __str__(self) -> str:
        return f"generation rank {self.key}" if self.info else "generation rank (unregistered)"


#: How a writer was fenced: its process is provably gone (same host), or its fencing grace ran out ("": not fenced).
FenceHow = Literal["dead", "grace", ""]


def writer_fenced(info: wire.RankInfo, lost_at: float | None, grace_s: float, now: float) -> tuple[bool, FenceHow]:
    """Whether a writer process can provably write nothing more, and why: ``(fenced, how)``.

    Same host (same kernel and pid namespace): its process is gone, or its pid now
    belongs to another process (start time differs): proven at once. Another host:
    nothing can be proven from here, so once the peer was declared lost (control
    connection down past its timeout, or a transport endpoint error) the writer is
    fenced after ``grace_s`` more seconds; the writer's own side never posts a write
    after its deadline, which the grace must exceed (see docs/architecture.md).
    """
    if info.host_id and hostinfo.same_host(info.host_id) and info.pid > 0:
        if not hostinfo.process_alive(info.pid, info.start_time or None):
            return True, "dead"
        return False, ""
    if lost_at is not None and now - lost_at >= grace_s:
        return True, "grace"
    return False, ""
