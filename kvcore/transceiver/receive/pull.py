"""Pull mode: read the context's blocks with the agent's READ, report with ``PullDone``, wait for its word."""

from __future__ import annotations

import functools
import hmac
import logging
import os
import time

from kvcore import errors as E
from kvcore.control import wire
from kvcore.control.messenger import Source
from kvcore.layout.blocks import normalize_block_ids
from kvcore.params import InternalId
from kvcore.transceiver.digests import blocks_digest
from kvcore.transceiver.link import error_from
from kvcore.transceiver.peers import CtxInstance
from kvcore.transceiver.planning import plan_request
from kvcore.transceiver.receive.peers import RecvPeers
from kvcore.transceiver.receive.settle import answer_outcome
from kvcore.transceiver.sessions import RxSession, SessionState, WriterState
from kvcore.transport.agent import TransferOp, TransferStatus

log = logging.getLogger("kvcore.transceiver")


class RecvPull(RecvPeers):
    """Exposure asks, reads, read reports and the context's answers to them."""

    def _pull(self, rid: InternalId) -> None:
        """Worker, pull mode: read the request from every writer rank's blocks (one READ per rank)."""
        link = self.link
        with link.lock:
            s = self.rx.get(rid)
            if s is None or s.terminal or s.instance is None or s.writers:
                return
            inst = s.instance
            ranks = sorted(s.nonces)
            if not set(ranks) <= inst.registered:
                return
            closed = [r for r in ranks if r not in inst.exposed]
            if closed:
                self._ask_exposure(s, inst, closed)  # the answer posts this read again
                return
            for r in ranks:
                self._put_writer(s, r, WriterState.READING)  # claimed (not settled: a read may be posted from now on)
        posted: list[int] = []
        for r in ranks:
            try:
                info = inst.ranks[r]
                src_blocks = normalize_block_ids(
                    s.ctx_block_ids, info.page_table, f"request {rid} context block_ids (parameters)"
                )
                t0 = time.monotonic()
                plan = plan_request(
                    info.placement,
                    link.placement,
                    src_blocks,
                    s.block_ids,
                    mappers=link.mappers,
                    src_state_slot=s.ctx_state_slot,
                    dst_state_slot=s.state_slot,
                    prompt_len=s.prompt_len,
                    merge=True,
                    cached_tokens=s.cached_tokens,
                )
                t1 = time.monotonic()
                handle = None
                if plan.count:
                    # Through the link: chunked like a WRITE, and an asynchronous agent's completion wakes us.
                    handle = link.submit_transfer(
                        TransferOp.READ,
                        inst.agents[r],
                        plan.dst,
                        plan.src,
                        plan.sizes,
                        on_done=functools.partial(self._read_ended, s, r),
                    )
                link.metrics.transfer_posted(inst.name, plan.nbytes, plan.count, t1 - t0, time.monotonic() - t1)
            except E.KvcoreError as exc:
                log.warning("request %r: reading from context rank %d: %s", rid, r, exc)
                with link.lock:
                    self._move(s, SessionState.FAILED, exc)
                    for r2 in ranks:
                        if r2 not in posted:
                            self._put_writer(s, r2, WriterState.FAILED)
                            self._send_pull_done(s, inst, r2, "failed", kind=type(exc).__name__, error=str(exc))
                    self._note_quarantine(s)
                break
            with link.lock:
                s.read_bytes[r] = (plan.nbytes, plan.count)
                s.reads[r] = handle
                s.asked_at[r] = time.monotonic()
                self._put_writer(s, r, WriterState.READING)
                self.reads[(id(s), r)] = (s, r)
            posted.append(r)
            self._check_read(s, r, time.monotonic())

    def _read_ended(self, s: RxSession, r: int) -> None:
        """The link saw our READ from rank ``r`` end (worker thread)."""
        self._check_read(s, r, time.monotonic())

    def _check_read(self, s: RxSession, r: int, now: float) -> None:
        """Poll our READ from context rank ``r``; when it ends, tell that rank (worker thread)."""
        handle = s.reads.get(r)
        status = TransferStatus.DONE if handle is None else self.link.poll_transfer(handle)
        inst = s.instance
        assert inst is not None
        if status is TransferStatus.PENDING:
            if now - s.asked_at.get(r, now) > self.config.transfer_timeout_s and not s.terminal:
                assert handle is not None
                self.link.stop_transfer(handle, "read timed out")  # no further chunk; the one in flight may land
                with self.link.lock:
                    self._move(
                        s,
                        SessionState.TIMED_OUT,
                        E.TransferTimeoutError(
                            f"request {s.request_id}: read from context rank {r} still pending after "
                            f"{self.config.transfer_timeout_s}s"
                        ),
                    )
                    self._note_quarantine(s)
            return
        err = handle.error if handle is not None else None
        if handle is not None:
            self.link.metrics.transfer_finished(inst.name, status is TransferStatus.DONE, now - s.asked_at.get(r, now))
            self.link.release_transfer(handle)
        with self.link.lock:
            self.reads.pop((id(s), r), None)
            s.reads.pop(r, None)
            if s.writers.get(r) is not WriterState.READING:
                return  # fenced meanwhile
            if status is TransferStatus.DONE and not s.terminal:
                self._settle_writer(s, r, WriterState.PULLED)
                s.nbytes += s.read_bytes.get(r, (0, 0))[0]
                self._send_pull_done(s, inst, r, "ok")
            elif status is TransferStatus.DONE:
                self._settle_writer(s, r, WriterState.CANCELLED)  # ended meanwhile: we keep nothing of it
                self._send_pull_done(s, inst, r, "cancelled", error="the receiver gave the request up")
            else:
                exc = err or E.TransferFailedError(f"read from context rank {r} failed")
                self._settle_writer(s, r, WriterState.FAILED)
                self._send_pull_done(s, inst, r, "failed", kind=type(exc).__name__, error=str(exc))
                self._move(s, SessionState.FAILED, exc)
            self._note_quarantine(s)

    def _pull_answer(self, s: RxSession, r: int, msg: wire.TransferResult) -> None:
        """A context rank's word on our read of its blocks (lock held)."""
        w = s.writers[r]
        if w is not WriterState.PULLED:
            if w is WriterState.READING and msg.status != "ok":
                # The context gave the request up while we read (lease, cancel): the bytes we get are not its KV.
                err = error_from(msg.error_kind, f"context rank {r}: {msg.error}")
                self._move(s, answer_outcome(msg.status, err, timeouts=False), err)
                self._note_quarantine(s)
            return
        if msg.status == "ok":
            if not self._take_aux(s, r, msg.aux):
                self._settle_writer(s, r, WriterState.FAILED)
                return
            self._settle_writer(s, r, WriterState.OK)
            if s.all_ok() and not s.terminal:
                self._move(s, SessionState.DONE)
            return
        err = error_from(msg.error_kind, f"context rank {r} did not confirm request {msg.request_id}: {msg.error}")
        self._settle_writer(s, r, WriterState.CANCELLED if msg.status == "cancelled" else WriterState.FAILED)
        self._move(s, answer_outcome(msg.status, err), err)
        self._note_quarantine(s)

    def _pull_unread(self, s: RxSession, status: wire.ResultStatus, reason: str) -> None:
        """Tell the context ranks we never read from (and never will) that they may let go (lock held)."""
        inst = s.instance
        if inst is None or inst.gone:
            return
        for r in s.nonces:
            if r in s.writers:
                continue  # a read was posted: its end tells the context
            self._put_writer(s, r, WriterState.CANCELLED)
            self._send_pull_done(s, inst, r, status, error=reason)

    def _send_pull_done(
        self, s: RxSession, inst: CtxInstance, r: int, status: wire.ResultStatus, *, kind: str = "", error: str = ""
    ) -> None:
        nbytes, fragments = s.read_bytes.get(r, (0, 0))
        link = self.link
        msg = wire.PullDone(
            v=wire.PROTOCOL_VERSION,
            request_id=s.request_id,
            gen_instance=link.instance_name,
            gen_rank=link.topology.rank,
            gen_incarnation=link.incarnation,
            ticket=s.ticket,
            nonce=s.nonces[r],
            status=status,
            ctx_incarnation=inst.ranks[r].incarnation,
            blocks_digest=blocks_digest(s.ctx_block_ids, s.ctx_state_slot, s.ctx_incarnation),
            nbytes=nbytes,
            fragments=fragments,
            error_kind=kind,
            error=error[:1000],
            prompt_len=s.prompt_len,
        )
        s.pull_done[r] = msg
        link.send(inst.ranks[r].endpoint, msg)

    def _kick_pulls(self, inst: CtxInstance) -> None:
        """Post a read for every pull request of ``inst`` that waits only for its writers' registration (lock held)."""
        for s in self.rx.values():
            if (
                s.mode == "pull"
                and s.instance is inst
                and not s.terminal
                and not s.writers
                and set(s.nonces) <= inst.registered
            ):
                self.link.post(self._pull, s.request_id)

    def _ask_exposure(self, s: RxSession, inst: CtxInstance, ranks: list[int]) -> None:
        """Ask the context ranks ``ranks`` for access to their memory for pull request ``s`` (lock held; once per
        rank at a time: the answer lets every waiting request read)."""
        link = self.link
        for r in ranks:
            if r in inst.exposing:
                continue
            nonce = os.urandom(16)
            inst.exposing[r] = nonce
            link.send(
                inst.ranks[r].endpoint,
                wire.ExposeRequest(
                    v=wire.PROTOCOL_VERSION,
                    request_id=s.request_id,
                    gen_instance=link.instance_name,
                    gen_rank=link.topology.rank,
                    gen_incarnation=link.incarnation,
                    ticket=s.ticket,
                    nonce=nonce,
                ),
            )

    def on_exposure(self, source: Source, msg: wire.Exposure) -> None:
        """A context rank's answer to our ExposeRequest: its full descriptor (we may read it), or why not."""
        if source.endpoint is None:
            self.counters["ignored_messages"] += 1
            return
        with self.link.lock:
            for inst in self.instances.values():
                r = inst.rank_of_endpoint(source.endpoint)
                if r is None or r != msg.ctx_rank or inst.gone:
                    continue
                nonce = inst.exposing.get(r)
                if nonce is None or not msg.nonce or not hmac.compare_digest(nonce, msg.nonce):
                    self.counters["forged_messages"] += 1
                    return
                if msg.ctx_incarnation != inst.ranks[r].incarnation:
                    self.counters["forged_messages"] += 1
                    return
                if msg.error_kind or not msg.agent_descriptor:
                    del inst.exposing[r]
                    err = error_from(
                        msg.error_kind or "ProtocolError",
                        f"context rank {r} gave no access to its memory for request {msg.request_id}: "
                        f"{msg.error or 'no descriptor'}",
                    )
                    s = self.rx.get(msg.request_id)
                    if s is not None and s.instance is inst and not s.terminal and not s.writers:
                        self._move(s, SessionState.FAILED, err)
                        self._note_quarantine(s)
                    self._kick_pulls(inst)  # another waiting request asks with its own ticket
                    return
                self.link.post(self._load_exposed, inst, r, msg.agent_descriptor, nonce)
                return
        self.counters["ignored_messages"] += 1

    def _load_exposed(self, inst: CtxInstance, r: int, desc: bytes, nonce: bytes) -> None:
        """Worker: load context rank ``r``'s full descriptor (same agent as its identity: a refresh)."""
        link = self.link
        if not self._free_agent_name(inst, desc, lambda: self._load_exposed(inst, r, desc, nonce)):
            return  # a request still needs the predecessor's agent under that name: ``tick`` retries
        try:
            name = link.agent.load_remote_agent(desc, expose=True)
            if inst.agents.get(r, name) != name:
                raise E.ProtocolError(f"context rank {r} of {inst} exposed another agent than it registered with")
        except E.KvcoreError as exc:
            with link.lock:
                self._refuse(inst, exc, tell=inst.ranks)
            return
        with link.lock:
            inst.agents[r], inst.loaded[r] = name, desc
            if inst.exposing.get(r) == nonce:
                del inst.exposing[r]
            if inst.gone:
                return
            inst.exposed.add(r)
            self._kick_pulls(inst)
