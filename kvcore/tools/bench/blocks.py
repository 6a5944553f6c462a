"""Where each request's blocks lie in the pools and what bytes they hold.

Both ranks compute these from the seed alone (different permutations per side), so the generation rank's
expectation owes nothing to kvcore's arithmetic.
"""

from __future__ import annotations

import numpy as np

from kvcore.tools.bench.spec import Shape

_MIX = np.uint64(0x9E3779B97F4A7C15)  # per-block word offset: a misplaced or torn block never matches
SMALL_SLOTS = 8  # distinct one-block slots the small requests cycle through


def _block_ids(shape: Shape, seed: int, role: str) -> dict[str, np.ndarray]:
    """Physical block ids per region; both ranks compute them from the seed (different permutations per side).

    Pool index space: ``big`` request ``[0, blocks)``, ``small`` slots after it, one ``first``-contact block last.
    """
    rng = np.random.default_rng([seed, 0 if role == "context" else 1])
    nb = shape.blocks
    return {
        "big": rng.permutation(nb).astype(np.int64),
        "small": (nb + rng.permutation(SMALL_SLOTS)).astype(np.int64),
        "first": np.array([nb + SMALL_SLOTS], dtype=np.int64),
    }


def _region_span(shape: Shape, region: str) -> tuple[int, int]:
    nb = shape.blocks
    return {"big": (0, nb), "small": (nb, nb + SMALL_SLOTS), "first": (nb + SMALL_SLOTS, nb + SMALL_SLOTS + 1)}[region]


def _fill_logical(words: np.ndarray, phys: np.ndarray, logical: np.ndarray, seed: int) -> None:
    """Write logical block ``logical[i]`` into row ``phys[i]`` of ``words`` ([blocks, words] uint64), in chunks."""
    base = np.random.default_rng([seed, 7]).integers(0, 2**63, words.shape[1], dtype=np.uint64)
    chunk = max(1, (64 << 20) // max(1, words.shape[1] * 8))
    for a in range(0, len(phys), chunk):
        words[phys[a : a + chunk]] = base[None, :] + logical[a : a + chunk, None].astype(np.uint64) * _MIX  # type: ignore[index]


def _logical_ids(shape: Shape) -> dict[str, np.ndarray]:
    nb = shape.blocks
    return {
        "big": np.arange(nb, dtype=np.int64),
        "small": nb + np.arange(SMALL_SLOTS, dtype=np.int64),
        "first": np.array([nb + SMALL_SLOTS], dtype=np.int64),
    }


def request_blocks(
    ids: dict[str, np.ndarray], region: str, i: int, count: int | None = None, slot_blocks: int | None = None
) -> np.ndarray:
    """Request ``i``'s blocks of ``region`` (``ids``: :func:`_block_ids`): a small slot, the whole region, or the
    first ``count`` of slot ``i % slots``."""
    region_ids = ids[region]
    if region == "small":
        return region_ids[i % SMALL_SLOTS : i % SMALL_SLOTS + 1]
    if slot_blocks:
        k = i % (len(region_ids) // slot_blocks)
        return region_ids[k * slot_blocks : k * slot_blocks + (count or slot_blocks)]
    return region_ids[:count]
