"""A bench rank's byte checks: each region against the expectation computed from the seed, not from kvcore's plans."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcore.tools.bench.blocks import _region_span
from kvcore.tools.bench.spec import Shape


class _VerifyModes:
    """The generation rank's checks (a mixin of :class:`kvcore.tools.bench.rank._Rank`, which owns these attributes)."""

    shape: Shape | None
    pool: Any
    expected: Any
    written: set[str]
    ids: dict[str, np.ndarray]

    def op_zero(self, region: str) -> dict[str, Any]:
        assert self.shape is not None
        a, b = _region_span(self.shape, region)
        self.pool[a:b].zero_()
        self.written.discard(region)
        return {}

    def op_verify(self, region: str) -> dict[str, Any]:
        """Compare a region with the expectation computed from the seed and block ids (not from kvcore's plans)."""
        import torch

        assert self.shape is not None
        a, b = _region_span(self.shape, region)
        got, want = self.pool[a:b], self.expected[a:b]
        if torch.equal(got, want):
            self.written.add(region)  # the region now holds its expectation (whoever wrote it)
            return {"ok": True, "bad_bytes": 0, "bytes": int(got.numel())}
        return {"ok": False, "bad_bytes": int((got != want).sum()), "bytes": int(got.numel())}

    def op_verify_slots(self, count: int, slot_blocks: int, slots: int) -> dict[str, Any]:
        """The first ``count`` blocks of the first ``slots`` slots hold their expectation, the rest of the region is zero.

        Then zero the region again, ready for the next cell.
        """
        import torch

        assert self.shape is not None
        ids = self.ids["big"]
        rows = torch.from_numpy(np.concatenate([ids[k * slot_blocks : k * slot_blocks + count] for k in range(slots)]))
        got, want = self.pool.index_select(0, rows), self.expected.index_select(0, rows)
        bad = int((got != want).sum())
        a, b = _region_span(self.shape, "big")
        bad += int(self.pool[a:b].count_nonzero()) - int(got.count_nonzero())  # nothing outside the written rows
        self.pool[a:b].zero_()
        self.written.discard("big")  # zero again: the end-of-case check expects zeros there
        return {"ok": bad == 0, "bad_bytes": bad}

    def op_verify_all(self) -> dict[str, Any]:
        """Written regions hold their expectation; the others are still zero (nothing landed outside its blocks)."""
        assert self.shape is not None
        bad = 0
        for region in ("big", "small", "first"):
            a, b = _region_span(self.shape, region)
            if region in self.written:
                bad += int((self.pool[a:b] != self.expected[a:b]).sum())
            else:
                bad += int(self.pool[a:b].count_nonzero())
        return {"ok": bad == 0, "bad_bytes": bad, "written": sorted(self.written)}
