"""The kvcore calls the connector's worker side makes, in one module, on kvcore's engine API.

* Parameters: :class:`kvcore.TransferParams`, made by the prefill scheduler
  (``TransferParams.make``, a fresh ticket) and forwarded in vLLM's
  ``kv_transfer_params`` under :data:`PARAMS_KEY` as ``to_dict()``; the decode
  side parses them with :func:`parse_params`.
* Request ids: vLLM's str request id *is* kvcore's request id, on both instances.
* :class:`KvcoreEngine`: start a send, announce (``expect``), start or give up
  a receive, and turn this rank's ``Transceiver.poll_local()`` into vLLM's
  per-worker finished/failed sets (vLLM's KVOutputAggregator combines the
  workers). A request is reported exactly once, when kvcore *released* it on
  this rank (no write into its blocks can still land, no read of them is still
  under way): the moment vLLM may free or reuse the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvcore import errors as E
from kvcore.params import TransferParams
from kvcore.transceiver import Transceiver

__all__ = [
    "COUNTERS",
    "PARAMS_KEY",
    "InvalidTransferParamsError",
    "KvcoreEngine",
    "TransferResults",
    "parse_params",
]

log = logging.getLogger("kvcore_vllm.engine_api")

#: The key of kvcore's parameters (``TransferParams.to_dict()``) inside vLLM's ``kv_transfer_params`` dict.
PARAMS_KEY = "kvcore"


class InvalidTransferParamsError(E.KvcoreError, ValueError):
    """``kv_transfer_params`` from the router are missing, malformed, of another request or of another version."""


def parse_params(kv_transfer_params: Mapping[str, Any] | None, request_id: str) -> TransferParams:
    """kvcore's parameters inside vLLM's ``kv_transfer_params`` for request ``request_id``, checked.

    Anything wrong raises :class:`InvalidTransferParamsError` naming the field:
    the parameters came through a router, so nothing in them is trusted.
    """
    raw = (kv_transfer_params or {}).get(PARAMS_KEY)
    if not isinstance(raw, Mapping):
        raise InvalidTransferParamsError(
            f"kv_transfer_params[{PARAMS_KEY!r}]: expected a mapping (TransferParams.to_dict()), "
            f"got {type(raw).__name__}"
        )
    try:
        params = TransferParams.from_dict(raw)
    except E.KvcoreError as exc:
        raise InvalidTransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from None
    if params.request_id != request_id:
        raise InvalidTransferParamsError(
            f"kv_transfer_params[{PARAMS_KEY!r}].request_id: expected {request_id!r} (the request they came with), "
            f"got {params.request_id!r}"
        )
    if params.prompt_len < 1:
        raise InvalidTransferParamsError(
            f"kv_transfer_params[{PARAMS_KEY!r}].prompt_len: expected >= 1, got {params.prompt_len}"
        )
    return params


@dataclass
class TransferResults:
    """One poll's worth of vLLM-visible results on this worker (ids are vLLM's request ids)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # failed receives included, as vLLM requires
    failed_recving: dict[str, E.KvcoreError] = field(default_factory=dict)
    failed_block_ids: set[int] = field(default_factory=set)


#: Counters :meth:`KvcoreEngine.take_counters` returns (per rank, since the last call).
COUNTERS = ("transfers_done", "transfers_failed", "transfers_cancelled", "bytes_moved")


class Phase(str, Enum):
    """Where one request of this worker stands, as the connector sees it."""

    SENDING = "SENDING"  # prefill: start_send called; vLLM waits for finished_sending
    EXPECTED = "EXPECTED"  # decode: expect() called; vLLM has not allocated its blocks yet
    RECEIVING = "RECEIVING"  # decode: start_receive called; vLLM waits for finished_recving
    DROPPED = "DROPPED"  # decode: vLLM forgot the request (aborted, or nothing to load); kvcore still winds it down


@dataclass
class _Entry:
    phase: Phase
    block_ids: list[int] = field(default_factory=list)
    delivered: bool | None = None  # None until kvcore reported an outcome
    error: E.KvcoreError | None = None
    released: bool = False


class KvcoreEngine:
    """Drives one rank's :class:`Transceiver` on behalf of the connector's worker side (per-rank poll).

    Every send and every receive vLLM waits for is reported exactly once by
    :meth:`poll`, when kvcore released it on this rank: on the prefill side as
    finished sending (whatever the outcome: the blocks may be freed), on the
    decode side as finished receiving, plus failed receiving and its block ids
    when the KV did not arrive whole.
    """

    def __init__(self, transceiver: Transceiver) -> None:
        self.transceiver = transceiver
        self._entries: dict[str, _Entry] = {}
        self._ready: list[tuple[str, _Entry]] = []  # released before vLLM waited for them, or refused at start
        self._counters = dict.fromkeys(COUNTERS, 0)

    def take_counters(self) -> dict[str, int]:
        """Outcomes and bytes since the last call (this rank; vLLM sums over ranks)."""
        out, self._counters = self._counters, dict.fromkeys(COUNTERS, 0)
        return out

    @property
    def role(self) -> str:
        return self.transceiver.role

    @property
    def info_endpoint(self) -> str:
        return self.transceiver.info_endpoint

    @property
    def incarnation(self) -> str:
        return self.transceiver.incarnation

    # --- prefill side ------------------------------------------------------------------------------

    def send(self, name: str, block_ids: Sequence[int], prompt_len: int, params: TransferParams) -> None:
        """The KV of request ``name`` is complete in ``block_ids``; serve it to whoever presents ``params``' ticket."""
        entry = _Entry(Phase.SENDING, list(block_ids))
        if name in self._entries:
            self._refuse(name, entry, E.SessionError(f"request {name!r} is already being sent from this worker"))
            return
        try:
            self.transceiver.start_send(name, block_ids, prompt_len=prompt_len, params=params)
        except E.KvcoreError as exc:
            self._refuse(name, entry, exc)
            return
        self._entries[name] = entry

    # --- decode side -------------------------------------------------------------------------------

    def expect(self, name: str, params: TransferParams) -> None:
        """Request ``name`` will be received here once vLLM allocated its blocks: keep the prefill's lease renewed."""
        if name in self._entries:
            return
        try:
            self.transceiver.expect(params)
        except E.KvcoreError as exc:
            # Nothing started: receive() will try again and report what it finds.
            log.warning("request %r: kvcore refused to expect it: %s", name, exc)
            return
        self._entries[name] = _Entry(Phase.EXPECTED)

    def receive(self, name: str, params: TransferParams, block_ids: Sequence[int]) -> None:
        """Fetch request ``name``'s KV into ``block_ids`` (the suffix not cached locally); reported once released."""
        blocks = list(block_ids)
        entry = self._entries.get(name)
        if entry is not None and entry.phase is not Phase.EXPECTED:
            self._refuse(name, _Entry(Phase.RECEIVING, blocks), E.SessionError(f"request {name!r} is in flight here"))
            return
        if entry is not None and entry.released:
            # Its expectation ended (lease expired, context lost) and kvcore let go of it: nothing will arrive.
            del self._entries[name]
            entry.phase, entry.block_ids = Phase.RECEIVING, blocks
            self._ready.append((name, entry))
            return
        try:
            self.transceiver.start_receive(params=params, block_ids=blocks)
        except E.KvcoreError as exc:
            if entry is not None:
                # Expected but refused now: give the expectation up; report once kvcore released it.
                entry.phase, entry.block_ids = Phase.RECEIVING, blocks
                entry.delivered, entry.error = False, exc
                self.transceiver.cancel(name, f"start_receive refused: {exc}")
                return
            self._refuse(name, _Entry(Phase.RECEIVING, blocks), exc)
            return
        if entry is None:
            self._entries[name] = _Entry(Phase.RECEIVING, blocks)
        else:
            entry.phase, entry.block_ids = Phase.RECEIVING, blocks

    def drop(self, name: str, params: TransferParams | None, reason: str) -> None:
        """vLLM forgot request ``name`` (aborted before it loaded, or nothing to load): let the prefill free now.

        Nothing is reported to vLLM for a dropped request that it was not waiting for.
        A receive into no blocks tells the context this receiver is done with it
        (an expectation is turned into one), so the prefill frees its blocks at once
        instead of at the end of its lease.
        """
        entry = self._entries.get(name)
        if entry is not None and entry.phase is Phase.RECEIVING:
            self.cancel(name, reason)
            return
        if entry is not None and entry.released:
            del self._entries[name]
            return
        if params is None:
            if entry is not None:
                entry.phase = Phase.DROPPED
                self.transceiver.cancel(name, reason)
            return
        try:
            self.transceiver.start_receive(params=params, block_ids=[])
        except E.KvcoreError as exc:
            log.info("request %r: could not tell the prefill to free it (%s); its lease frees it", name, exc)
            if entry is not None:
                self.transceiver.cancel(name, reason)
        if entry is None:
            self._entries[name] = _Entry(Phase.DROPPED)
        else:
            entry.phase = Phase.DROPPED

    # --- both sides ----------------------------------------------------------------------------------

    def is_waited_for(self, name: str) -> bool:
        """True while a send or receive vLLM waits for is in flight on this worker."""
        entry = self._entries.get(name)
        return entry is not None and entry.phase in (Phase.SENDING, Phase.RECEIVING)

    def cancel(self, name: str, reason: str) -> bool:
        """Cancel request ``name``; it is still reported by :meth:`poll` once kvcore released it."""
        if name not in self._entries:
            return False
        return self.transceiver.cancel(name, reason)

    def _refuse(self, name: str, entry: _Entry, exc: E.KvcoreError) -> None:
        """Nothing was started: vLLM gets the request back at once, as a failure."""
        log.warning("request %r: kvcore refused to start: %s", name, exc)
        entry.delivered, entry.error, entry.released = False, exc, True
        self._ready.append((name, entry))

    def poll(self) -> TransferResults:
        """Poll this rank's transceiver (``poll_local``: no collective) and report what it released."""
        out = TransferResults()
        result = self.transceiver.poll_local()
        c = self._counters
        c["transfers_done"] += len(result.done)
        c["transfers_failed"] += len(result.failed)
        c["transfers_cancelled"] += len(result.cancelled)
        c["bytes_moved"] += sum(o.nbytes for o in result.done)
        done = {o.request_id for o in result.done}
        for o in result.outcomes:
            entry = self._entries.get(str(o.request_id))
            if entry is not None and entry.delivered is None:
                entry.delivered, entry.error = o.request_id in done, o.error
        ready, self._ready = self._ready, []
        for rid in result.released:
            name = str(rid)
            entry = self._entries.get(name)
            if entry is None:
                continue
            entry.released = True
            if entry.phase is Phase.EXPECTED:
                continue  # vLLM does not wait for it yet: reported when it allocates (receive) or forgets it (drop)
            del self._entries[name]
            ready.append((name, entry))
        for name, entry in ready:
            ok = entry.delivered is True
            if entry.phase is Phase.DROPPED:
                log.debug("request %r: the prefill was told to free it (%s)", name, entry.error or "done")
            elif entry.phase is Phase.SENDING:
                if not ok:
                    log.info("request %r: KV not delivered: %s", name, entry.error)
                out.finished_sending.add(name)
            else:
                out.finished_recving.add(name)
                if not ok:
                    out.failed_recving[name] = entry.error or E.SessionError(
                        f"request {name!r}: released without an outcome"
                    )
                    out.failed_block_ids.update(entry.block_ids)
        return out

    @property
    def num_pending(self) -> int:
        """Requests this worker still tracks (in flight, expected, or winding down)."""
        return len(self._entries) + len(self._ready)

    def close(self) -> None:
        self.transceiver.close()
