"""The bounce path: lease a range of the arena per writer, send the unmerged plan's digest, scatter at the end."""

from __future__ import annotations

import logging
from abc import abstractmethod

import numpy as np

from kvcore import errors as E
from kvcore.params import InternalId
from kvcore.transceiver.peers import CtxInstance
from kvcore.transceiver.planning import plan_request
from kvcore.transceiver.receive.leases import RecvLeases
from kvcore.transceiver.sessions import RxSession, SessionState
from kvcore.transport import bounce

log = logging.getLogger("kvcore.transceiver")


class RecvBounce(RecvLeases):
    """Bounce leases: which writers go through one, and the scatter once every writer reported."""

    def _may_bounce(self, inst: CtxInstance, writers: list[int], nblocks: int) -> bool:
        """Cheap pre-check from each writer's cached plan shape: False when no writer could qualify for bounce."""
        for r in writers:
            shape = self._plan_shape.get((inst.endpoint, r))
            if shape is None:
                return True  # unknown yet: plan it once
            per_block, mean_bytes = shape
            if (
                per_block * nblocks >= self.config.bounce_min_fragments
                and mean_bytes <= self.config.bounce_max_fragment_bytes
            ):
                return True
        return False

    def _ask_bounced(self, rid: InternalId) -> None:
        """Worker: decide per writer whether its fragments go through a bounce lease, then ask."""
        link = self.link
        with link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or s.instance is None:
                return
            inst = s.instance
            writers = list(s.writers)
        bounce_args: dict[int, tuple[int, int, bytes]] = {}
        tpb = link.geometry.tokens_per_block
        for r in writers:
            src_ids = {
                g: np.zeros(-(-s.prompt_len // tpb) if s.prompt_len >= 0 else len(s.block_ids.get(g, ())), np.int64)
                for g in inst.ranks[r].placement.page_table.groups()
            }
            try:
                # The destination side of the unmerged plan does not depend on the source's block ids,
                # only on how many there are: the context rank computes the same order with its real ids.
                plan = plan_request(
                    inst.ranks[r].placement,
                    link.placement,
                    src_ids,
                    s.block_ids,
                    mappers=link.mappers,
                    src_state_slot=0 if s.state_slot >= 0 else -1,
                    dst_state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    merge=False,
                    cached_tokens=s.cached_tokens,
                )
            except E.KvcoreError as exc:
                log.debug("request %r: no bounce for context rank %d: %s", rid, r, exc)
                continue
            if plan.count and _count(s.block_ids):
                self._plan_shape[(inst.endpoint, r)] = (plan.count / _count(s.block_ids), plan.nbytes / plan.count)
            if not bounce.wants_bounce(
                plan.count,
                plan.nbytes,
                min_fragments=self.config.bounce_min_fragments,
                max_fragment_bytes=self.config.bounce_max_fragment_bytes,
            ):
                continue
            assert self.arena is not None
            off = self.arena.lease(plan.nbytes)
            if off is None:
                self.counters["bounce_fallback_arena_full"] += 1
                log.debug("request %r: bounce arena full, context rank %d writes fragments directly", rid, r)
                continue
            with link.lock:
                s.leases[r] = off
                s.unpack[r] = (plan.dst, plan.sizes)
            bounce_args[r] = (self.arena.address + off, plan.nbytes, bounce.plan_digest(plan.dst, plan.sizes))
        with link.lock:
            if not s.terminal:
                self._send_requests(s, inst, writers, bounce_args)

    def _unpack(self, rid: InternalId) -> None:
        """Worker: scatter every bounced writer's lease into the pools, then the request is DONE."""
        with self.link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or self.arena is None:
                return
            work = [(self.arena.address + s.leases[r], *s.unpack[r]) for r in sorted(s.bounced)]
        try:
            for addr, dst, sizes in work:
                bounce.scatter(addr, dst, sizes)
                self.counters["bounced_writes_total"] += 1
        except Exception as exc:  # pragma: no cover - addresses were validated when planned
            with self.link.lock:
                self._move(
                    s, SessionState.FAILED, E.TransferFailedError(f"request {rid}: bounce scatter failed: {exc}")
                )
            return
        with self.link.lock:
            self._move(s, SessionState.DONE)

    @abstractmethod
    def _send_requests(
        self, s: RxSession, inst: CtxInstance, ranks: list[int], bounce_args: dict[int, tuple[int, int, bytes]]
    ) -> None:
        """Send each writer in ``ranks`` its RequestData, with its bounce lease if it has one (:mod:`.push`)."""


def _count(ids: dict[str, np.ndarray]) -> int:
    return sum(len(v) for v in ids.values())
