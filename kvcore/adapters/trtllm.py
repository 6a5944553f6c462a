"""TensorRT-LLM's ``KvCacheTransceiver`` interface on one kvcore ``Transceiver`` per rank.

The interface is PyExecutor's (``tensorrt_llm/_torch/pyexecutor/kv_cache_transceiver.py``): the context rank calls
``respond_and_send_async`` when a request's prefill finished, the generation rank ``request_and_receive_async``
when it allocated the request's blocks, and every rank calls ``check_context_transfer_status`` /
``check_gen_transfer_status`` once per executor iteration. TensorRT-LLM is not imported: the adapter reads a
request through :class:`LlmRequestLike` (an id, the prompt length, the block ids, and the context-phase
``opaque_state`` the parameters travel in).

The promises an executor builds on:

* **A request is reported once, and only when its blocks may be freed.** The status checks return a request in
  :class:`TransferStatuses` (completed, failed or cancelled) only once kvcore *released* it: no write into its
  blocks (generation) and no read of them (context) can still happen.
* **``cancel_request`` returns True only when freeing the request's blocks is safe now**: the request was never
  handed to kvcore by this adapter, or it was already released. Otherwise it cancels the transfer (logical: a write
  already handed to the transport runs to completion) and returns False; the request is then reported by a later
  status check, and its blocks are freed then.
* **The status checks are collective**: they run ``Transceiver.poll()``, so every rank of the instance calls them
  equally often and with the same arguments, as PyExecutor does. Each rank then reports the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcore import errors as E
from kvcore.params import RequestId, TransferParams, derive_ticket
from kvcore.transceiver.facade import Outcome, Transceiver
from kvcore.transceiver.sessions import SessionState

__all__ = ["KvcoreCacheTransceiver", "LlmRequestLike", "TransferStatuses"]


class LlmRequestLike(Protocol):
    """What the adapter reads from (and writes to) a TensorRT-LLM ``LlmRequest``.

    ``request_id``: ``disagg_request_id`` when set, else ``py_request_id`` (the same number on both instances).
    ``prompt_len``: the prompt's tokens. ``block_ids``: this rank's blocks of the request in token order (from the
    KV cache manager). ``opaque_state``: ``context_phase_params.opaque_state``: the context side writes the transfer
    parameters there (JSON bytes), the generation side reads them.
    """

    @property
    def request_id(self) -> int: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def block_ids(self) -> Sequence[int]: ...

    opaque_state: bytes | None


@dataclass
class TransferStatuses:
    """Requests a status check found released, by outcome; each request's blocks may be freed now.

    ``completed``: DONE (context: delivered; generation: the KV is in place, ``aux`` has the context's payload).
    ``failed``: FAILED or TIMED_OUT, with ``errors[request_id]`` the typed error (TensorRT-LLM's
    ``DISAGG_TRANS_ERROR``). ``cancelled``: cancelled by this side or the peer.
    """

    completed: list[RequestId] = field(default_factory=list)
    failed: list[RequestId] = field(default_factory=list)
    cancelled: list[RequestId] = field(default_factory=list)
    errors: dict[RequestId, E.KvcoreError] = field(default_factory=dict)
    aux: dict[RequestId, bytes] = field(default_factory=dict)

    @property
    def all(self) -> list[RequestId]:
        return self.completed + self.failed + self.cancelled


class KvcoreCacheTransceiver:
    """TensorRT-LLM's ``KvCacheTransceiver`` on one rank; every rank of the instance calls the checks in step.

    ``ticket_secret``: 16+ random bytes every context rank holds. Each request's ticket is derived from it and the
    request id, so every context rank serves the request under the same ticket and any rank's parameters can be
    forwarded. Without it kvcore draws the ticket itself. ``poll_interval_s``: how long a blocking check sleeps
    between two polls when there is no news.
    """

    def __init__(self, tx: Transceiver, *, ticket_secret: bytes | None = None, poll_interval_s: float = 0.001) -> None:
        self.tx = tx
        self._secret = ticket_secret
        self._interval = float(poll_interval_s)
        self._pending: dict[RequestId, LlmRequestLike] = {}  # handed to kvcore, not yet released
        self._outcomes: dict[RequestId, Outcome] = {}  # agreed outcomes waiting for their release
        self._cancelled: set[RequestId] = set()  # cancel_request already told kvcore

    @property
    def is_context(self) -> bool:
        return self.tx.role == "context"

    # --- per request -------------------------------------------------------------------------

    def respond_and_send_async(self, req: LlmRequestLike) -> None:
        """Context: the request's KV is complete in ``req.block_ids``; send it and put its parameters on ``req``."""
        rid = req.request_id
        if rid in self._pending:
            raise E.SessionError(f"respond_and_send_async: request {rid!r} is already being sent")
        ticket = derive_ticket(self._secret, rid) if self._secret is not None else None
        params = self.tx.start_send(rid, list(req.block_ids), prompt_len=int(req.prompt_len), ticket=ticket)
        req.opaque_state = params.to_json().encode()
        self._pending[rid] = req

    def request_and_receive_async(self, req: LlmRequestLike) -> None:
        """Generation: receive the request into ``req.block_ids`` from the parameters in ``req.opaque_state``."""
        if not req.opaque_state:
            raise E.SessionError(
                f"request_and_receive_async: request {req.request_id!r} carries no opaque_state "
                "(the context's transfer parameters)"
            )
        params = TransferParams.from_json(req.opaque_state)
        if params.request_id != req.request_id:
            raise E.SessionError(
                f"request_and_receive_async: request {req.request_id!r} carries parameters of request "
                f"{params.request_id!r}"
            )
        if params.request_id in self._pending:
            raise E.SessionError(f"request_and_receive_async: request {params.request_id!r} is already received")
        self.tx.start_receive(params=params, block_ids=list(req.block_ids), prompt_len=int(req.prompt_len))
        self._pending[params.request_id] = req

    def request_and_receive_sync(self, req: LlmRequestLike) -> Outcome:
        """Generation: receive and block until the request is released (collective); raise its error unless DONE."""
        self.request_and_receive_async(req)
        rid = req.request_id
        while True:
            found = self._check(None, only=rid)
            if rid in found:
                outcome = found[rid]
                if outcome.state is not SessionState.DONE and outcome.error is not None:
                    raise outcome.error
                return outcome
            self._sleep()

    def cancel_request(self, req: LlmRequestLike) -> bool:
        """True only when freeing the request's blocks is safe now; else cancel it and report it later.

        Safe means no write into (generation) or read of (context) those blocks can still happen: the request was
        never handed to kvcore by this adapter, or a status check already reported it. Otherwise the transfer is
        cancelled (a write already submitted still completes) and False is returned: a later status check reports
        the request, cancelled (or completed, when its bytes landed anyway), and its blocks are freed then.
        Not collective.
        """
        rid = req.request_id
        if rid not in self._pending:
            return True
        if rid not in self._cancelled:
            self._cancelled.add(rid)
            self.tx.cancel(rid, "cancelled by TensorRT-LLM (cancel_request)")
        return False

    # --- status checks (collective) ----------------------------------------------------------

    def check_context_transfer_status(self, at_least_request_num: int | None = 0) -> TransferStatuses:
        """Context: the sends released since the last check; their blocks go back to the KV cache manager.

        ``at_least_request_num``: block until at least that many sends were released by this call (at most as many
        as are pending); 0: do not block; None: block until every pending send is released.
        """
        self._role("check_context_transfer_status", context=True)
        return self._statuses(self._check(at_least_request_num))

    def check_gen_transfer_status(self, at_least_request_num: int | None = 0) -> TransferStatuses:
        """Generation: the receives released since the last check (completed: ready to generate)."""
        self._role("check_gen_transfer_status", context=False)
        return self._statuses(self._check(at_least_request_num))

    def check_gen_transfer_complete(self) -> bool:
        """Generation: no receive is pending (every request handed to kvcore was reported)."""
        self._role("check_gen_transfer_complete", context=False)
        return not self._pending

    def prepare_context_requests(self, requests: Sequence[LlmRequestLike]) -> None:
        """Generation-first scheduling: nothing to gate, kvcore keeps an early ask until ``start_send``."""

    def get_disaggregated_params(self) -> dict[str, Any]:
        """What a generation-first request needs of this context instance (its info endpoint)."""
        return {"ctx_info_endpoint": self.tx.info_endpoint}

    def pending(self) -> list[RequestId]:
        """Requests handed to kvcore and not yet reported (their blocks are kvcore's)."""
        return list(self._pending)

    def shutdown(self) -> None:
        """Close the transceiver (call it after every request was reported)."""
        self.tx.close()

    # --- internals ---------------------------------------------------------------------------

    def _role(self, call: str, *, context: bool) -> None:
        if self.is_context != context:
            raise E.SessionError(f"{call} is for the {'context' if context else 'generation'} side; this is a "
                                 f"{self.tx.role} transceiver")  # fmt: skip

    def _check(self, at_least: int | None, only: RequestId | None = None) -> dict[RequestId, Outcome]:
        """Poll until enough pending requests were released (every rank sees the same polls: agreed results)."""
        if at_least is not None and (isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 0):
            raise E.SessionError(f"at_least_request_num must be None or an int >= 0, got {at_least!r}")
        found: dict[RequestId, Outcome] = {}
        while True:
            result = self.tx.poll()
            for o in result.outcomes:
                self._outcomes[o.request_id] = o
            for rid in result.released:
                req = self._pending.pop(rid, None)
                outcome = self._outcomes.pop(rid, None)
                self._cancelled.discard(rid)
                if req is not None and outcome is not None:
                    found[rid] = outcome
            want = len(self._pending) + len(found) if at_least is None else at_least
            want = min(want, len(self._pending) + len(found))
            if only is not None:
                if only in found or only not in self._pending:
                    return found
            elif len(found) >= want:
                return found
            self._sleep()

    def _sleep(self) -> None:
        if self.tx.topology.world_size == 1:
            self.tx.wait(self._interval)  # wakes as soon as this rank has news
        else:
            time.sleep(self._interval)  # collective: the other ranks poll on their own clocks

    @staticmethod
    def _statuses(found: dict[RequestId, Outcome]) -> TransferStatuses:
        out = TransferStatuses()
        for rid, o in found.items():
            if o.state is SessionState.DONE:
                out.completed.append(rid)
                if o.aux:
                    out.aux[rid] = o.aux
            elif o.state is SessionState.CANCELLED:
                out.cancelled.append(rid)
            else:
                out.failed.append(rid)
                if o.error is not None:
                    out.errors[rid] = o.error
        return out
