"""What a benchmark run is: its spec (sizes, iterations, bounds), the request shapes and the errors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from kvcore.errors import KvcoreError

_GB = 1e9

#: The names of the registered benchmark cases (``run.register_case`` adds each; ``BenchSpec`` checks against it).
CASE_NAMES: set[str] = set()


def _pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (the latency cases and the rank's soak report them)."""
    return float(np.percentile(np.asarray(values), q))


class BenchError(KvcoreError):
    """A benchmark spec was refused, or a request or check inside a rank failed (the message says which)."""


class BenchTimeoutError(BenchError, TimeoutError):
    """A benchmark rank did not answer a command within its bound."""


# --- what is measured --------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One request's KV geometry (TP1, head-major pool: a block of every layer is one contiguous slot)."""

    name: str
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"

    @property
    def blocks(self) -> int:
        return -(-self.tokens // self.tokens_per_block)

    @property
    def block_bytes(self) -> int:
        from kvcore.layout.topology import dtype_bytes

        return self.layers * 2 * self.kv_heads * self.tokens_per_block * self.head_dim * dtype_bytes(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes


@dataclass
class BenchSpec:
    """Everything one benchmark run needs (sizes, iterations, bounds); sent to every rank as msgpack."""

    backends: list[str] | None = None  # None: every installed transfer agent
    cases: list[str] = field(default_factory=lambda: ["llama8b", "frag16k", "small"])
    tokens: int = 4096
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 32
    dtype: str = "bfloat16"
    fragments: int = 4096  # the frag16k case: this many 16 KiB fragments
    iterations: int = 5
    small_requests: int = 1000  # one-block requests in flight together
    latency_requests: int = 200  # one-block requests sent one at a time
    hol_requests: int = 20  # the hol case: one-block requests per round (at least 8), alone and beside the big one
    poll_interval_s: float = 0.0  # the generation rank's engine loop: 0 waits in Transceiver.wait, else sleeps
    timeout_s: float = 120.0  # bound on every command a rank runs
    agent_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> agent options
    seed: int = 1234
    # the soak case (issue 9): many one-block requests with random cancels from both sides
    requests: int = 10000
    inflight: int = 512
    cancel_rate: float = 0.1  # fraction of requests cancelled, half by each side, at a random moment
    soak_request_timeout_s: float = 10.0  # the transceivers' request_timeout_s in the soak (tombstones live as long)
    # the matrix case: request size x fragment size x requests in flight, Llama-3-70B-shaped bytes per token
    matrix_tokens: list[int] = field(default_factory=lambda: [32, 256, 1024, 4096])
    matrix_fragment_bytes: list[int] = field(default_factory=lambda: [4096, 16384, 65536, 262144, 1048576, 0])
    matrix_inflight: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    matrix_layers: int = 80  # Llama-3-70B; heads, head dim, dtype and block size are the fields above
    matrix_iterations: int = 3  # timed rounds per cell, after one warm-up round
    matrix_max_bytes: int = 4 << 30  # cells that would move more per round (requests x size) are skipped
    matrix_pool_bytes: int = 2 << 30  # per side: request-sized slots the in-flight requests cycle through
    auth: bool = False  # also run the small case with CURVE configured (small_auth), beside small without
    native_lane: bool = False  # the transceivers run with config.native_lane (kvcore-native's lane, nixl and ucx)
    auth_config: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> auth_* fields (set by run_bench)

    def validate(self) -> None:
        """Raise ``BenchError`` naming the first field out of range."""
        for name in (
            "tokens",
            "layers",
            "kv_heads",
            "head_dim",
            "tokens_per_block",
            "fragments",
            "iterations",
            "small_requests",
            "latency_requests",
            "hol_requests",
            "requests",
            "inflight",
            "matrix_layers",
            "matrix_iterations",
            "matrix_max_bytes",
            "matrix_pool_bytes",
        ):
            if int(getattr(self, name)) < 1:
                raise BenchError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.small_requests > 4000:
            raise BenchError(f"small_requests must be <= 4000 (max_inflight_requests), got {self.small_requests}")
        unknown = [c for c in self.cases if c not in CASE_NAMES]
        if unknown:
            raise BenchError(f"unknown case(s) {unknown}; known: {sorted(CASE_NAMES)}")
        if not self.timeout_s > 0:
            raise BenchError(f"timeout_s must be > 0, got {self.timeout_s}")
        for name in ("matrix_tokens", "matrix_inflight"):
            values = getattr(self, name)
            if not values or any(int(v) < 1 for v in values):
                raise BenchError(f"{name} must be a non-empty list of integers >= 1, got {values!r}")
        for f in self.matrix_fragment_bytes:
            if f != 0 and (f < 512 or f % 512):
                raise BenchError(f"matrix_fragment_bytes entries must be 0 (whole block) or multiples of 512, got {f}")
        if self.inflight > 4000:
            raise BenchError(f"inflight must be <= 4000 (max_inflight_requests), got {self.inflight}")
        if not 0.0 <= self.cancel_rate <= 1.0:
            raise BenchError(f"cancel_rate must be in [0, 1], got {self.cancel_rate}")
        if not self.soak_request_timeout_s > 0:
            raise BenchError(f"soak_request_timeout_s must be > 0, got {self.soak_request_timeout_s}")
        if not 0 <= self.poll_interval_s < 1:
            raise BenchError(f"poll_interval_s must be in [0, 1), got {self.poll_interval_s}")

    def llama_shape(self) -> Shape:
        return Shape(
            "llama8b", self.tokens, self.layers, self.kv_heads, self.head_dim, self.tokens_per_block, self.dtype
        )

    def matrix_block_bytes(self) -> int:
        """One block of the matrix's model (all layers, K and V): the 'whole block' fragment size."""
        from kvcore.layout.topology import dtype_bytes

        return self.matrix_layers * 2 * self.kv_heads * self.tokens_per_block * self.head_dim * dtype_bytes(self.dtype)

    def quick_matrix(self) -> BenchSpec:
        """The ``--quick`` matrix: 2 request sizes x 3 fragment sizes x 2 in-flight counts of a 2-layer model."""
        return replace(
            self,
            matrix_tokens=[32, 64],
            matrix_fragment_bytes=[4096, 16384, 0],
            matrix_inflight=[1, 4],
            matrix_layers=2,
            matrix_iterations=1,
        )

    def frag16k_shape(self) -> Shape:
        # 1 layer x {K,V} x 1 head x 32 tokens x 128 x bf16 = 16 KiB per block, one fragment per block.
        return Shape("frag16k", self.fragments * 32, 1, 1, 128, 32, "bfloat16")
