"""The bounce path of a write: gather the unmerged plan into staging and write it into the receiver's lease at once."""

from __future__ import annotations

import logging
import time

import numpy as np

from kvcore import errors as E
from kvcore.transceiver.send.push import SendPush
from kvcore.transceiver.sessions import (
    ReceiverTask,
    TxSession,
)
from kvcore.transport import bounce
from kvcore.transport.agent import TransferOp

log = logging.getLogger("kvcore.transceiver")

_Key = tuple[str, int]


class SendBounce(SendPush):
    """A push write through a bounce lease, when the receiver offered one and both plans agree."""

    def _submit_bounced(self, s: TxSession, t: ReceiverTask, t0: float) -> bool:
        """Gather the unmerged plan into staging and write it with one fragment; False: use the direct path."""
        try:
            plan = self._plan(s, t, layers=None, merge=False)
        except E.KvcoreError:
            return False  # the direct path reports the error
        if plan.nbytes != t.bounce_bytes or bounce.plan_digest(plan.dst, plan.sizes) != t.bounce_digest:
            self.counters["bounce_fallback_plan_mismatch"] += 1
            log.warning(
                "request %r: receiver's bounce plan differs from ours; writing fragments directly", s.request_id
            )
            return False
        if self.staging is None:
            self.staging = self.link.new_arena()
        off = self.staging.lease(plan.nbytes)
        if off is None:
            self.counters["bounce_fallback_staging_full"] += 1
            return False
        staging = self.staging.address + off
        try:
            bounce.gather(plan.src, plan.sizes, staging)
            t1 = time.monotonic()  # the gather counts as planning
            assert t.peer.agent_name is not None
            handle = self.link.submit_transfer(
                TransferOp.WRITE,
                t.peer.agent_name,
                np.array([staging], np.uint64),
                np.array([t.bounce_addr], np.uint64),
                np.array([plan.nbytes], np.uint64),
                self._done_hook(s, t),
            )
        except E.KvcoreError as exc:
            self.staging.release(off)
            self._fail_task(s, t, exc)
            return True
        t.staging, t.bounced = off, True
        self.counters["bounced_writes_total"] += 1
        self.link.metrics.transfer_posted(
            t.peer.name, plan.nbytes, plan.count, t1 - t0, time.monotonic() - t1, bounced=True
        )
        self._track(s, t, handle, plan.nbytes, plan.count, self.link.topology.layer_range[1])
        return True
