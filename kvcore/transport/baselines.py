"""What a plugin hands ``kvcore bench`` to measure its transport bare: the ``BenchBaseline`` contract.

A transport plugin that has a native API worth comparing against (NIXL's own
``initialize_xfer``, say) registers one ``BenchBaseline`` subclass per mode
through ``kvcore_register_bench_baselines``. ``kvcore bench`` then runs that
mode next to ``kvcore`` and the bare ``agent`` on the identical fragment plan,
in the context rank process, and verifies its bytes the same way. The core
names no plugin: which baselines exist is whatever the installed plugins
registered (``kvcore plugins`` lists them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BaselinePlan", "BenchBaseline"]


@dataclass(frozen=True)
class BaselinePlan:
    """One request's fragment plan, as kvcore's own agent would submit it, plus what a native API needs to run it."""

    src: np.ndarray  # uint64 source addresses (in this process: the context rank's KV pool)
    dst: np.ndarray  # uint64 destination addresses (in the generation rank's pool)
    sizes: np.ndarray  # uint64 fragment sizes
    pool_base: int  # the local pool holding every source fragment: register this region
    pool_bytes: int
    peer_descriptor: bytes  # the generation rank's kvcore agent descriptor (``TransferAgent.descriptor()``)
    agent_options: Mapping[str, Any]  # the run's agent options for this backend (as the kvcore agent got them)
    timeout_s: float  # bound on one transfer; raise ``kvcore.errors.TransferTimeoutError`` past it


class BenchBaseline(ABC):
    """One bare-transport bench mode: set up in ``__init__``, timed by ``once``, torn down by ``close``.

    ``__init__(plan)`` does everything that is not per transfer (registration, loading the peer, preparing
    descriptor lists); ``kvcore bench`` reports its duration as the mode's setup time. The instance lives in the
    context rank process for one case and is closed exactly once.
    """

    def __init__(self, plan: BaselinePlan) -> None:
        self.plan = plan

    @abstractmethod
    def once(self) -> tuple[float, float]:
        """Move the whole plan once and wait until it is done: (seconds to done, seconds to submit), from
        ``time.perf_counter``. A transfer that fails raises a ``kvcore.errors.TransferError``."""

    @abstractmethod
    def close(self) -> None:
        """Release what ``__init__`` set up (handles, remote peer, registrations)."""
