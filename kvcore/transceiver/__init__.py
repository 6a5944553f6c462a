"""The transceiver an engine drives, split by role around explicit peer and request lifecycles.

``Transceiver`` (:mod:`.facade`, its polling and reporting in :mod:`.reporting`) is the engine-facing API; the
context role lives in :mod:`.send`, the generation role in :mod:`.receive` (each a thin role class over one module
per concern and one settle module that alone moves states), what both share (messenger, agent, worker thread) in
:mod:`.link`, the chunked data plane in :mod:`.dataplane`. Request lifecycles are in :mod:`.sessions`, peer
lifecycles in :mod:`.peers`.
"""

from __future__ import annotations

from kvcore.transceiver.facade import CACHE_GAUGES, COUNTERS, Outcome, PollResult, RequestStatus, Transceiver, leaks
from kvcore.transceiver.peers import PeerState
from kvcore.transceiver.sessions import SessionState, TaskState, WriterState

__all__ = [
    "COUNTERS",
    "CACHE_GAUGES",
    "leaks",
    "Transceiver",
    "PollResult",
    "Outcome",
    "RequestStatus",
    "SessionState",
    "PeerState",
    "TaskState",
    "WriterState",
]
