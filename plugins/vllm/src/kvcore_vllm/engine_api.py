"""The kvcore calls the connector's worker side makes, in one module, on kvcore's engine API.

* Parameters: :class:`kvcore.TransferParams`, made by the prefill scheduler
  (``TransferParams.make``, a fresh ticket) and forwarded in vLLM's
  ``kv_transfer_params`` under :data:`PARAMS_KEY` as ``to_dict()``; the decode
  side parses them with :func:`parse_params`.
* Request ids: kvcore's request id is the *prefill's* vLLM request id, carried in
  the parameters. vLLM gives every request an id of its own on each engine (it
  appends a random suffix by default), so the decode request's id differs: this
  module maps the decode request's id to the kvcore id of the KV it loads.
* Load failures: every load that does not happen (bad parameters, a refused
  ticket, the prefill gone, its lease run out, a failed transfer) is logged once
  at WARNING with its reason (:class:`LoadFailure`) and counted
  (``load_failures_<reason>`` in :data:`COUNTERS`); vLLM's ``kv_load_failure_policy``
  then recomputes or fails the request.
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
from kvcore.control.wire import parse_endpoint
from kvcore.params import TransferParams
from kvcore.transceiver import Transceiver

__all__ = [
    "COUNTERS",
    "PARAMS_KEY",
    "InvalidTransferParamsError",
    "EngineCollector",
    "KvcoreEngine",
    "LoadFailure",
    "TransferResults",
    "classify_load_failure",
    "parse_params",
]

log = logging.getLogger("kvcore_vllm.engine_api")

#: The key of kvcore's parameters (``TransferParams.to_dict()``) inside vLLM's ``kv_transfer_params`` dict.
PARAMS_KEY = "kvcore"


class InvalidTransferParamsError(E.KvcoreError, ValueError):
    """``kv_transfer_params`` from the router are missing, malformed, of another request or of another version."""


def parse_params(kv_transfer_params: Mapping[str, Any] | None) -> TransferParams:
    """kvcore's parameters inside vLLM's ``kv_transfer_params``, checked.

    Anything wrong raises :class:`InvalidTransferParamsError` naming the field:
    the parameters came through a router, so nothing in them is trusted. The
    kvcore request id they carry is the prefill's request id; vLLM's
    ``remote_request_id`` beside them, when present, must name the same request.
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
    except (RecursionError, TypeError, ValueError) as exc:  # hostile nesting or types msgspec refuses untyped
        raise InvalidTransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}]: malformed ({exc})") from None
    try:
        parse_endpoint(params.endpoint)  # checked here, not at the worker's first contact: a refused parameter
    except E.ProtocolError as exc:
        raise InvalidTransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}].endpoint: {exc}") from None
    remote = (kv_transfer_params or {}).get("remote_request_id")
    if remote is not None and remote != params.request_id:
        raise InvalidTransferParamsError(
            f"kv_transfer_params: remote_request_id {remote!r} and {PARAMS_KEY}.request_id "
            f"{params.request_id!r} name different requests"
        )
    if params.prompt_len < 1:
        raise InvalidTransferParamsError(
            f"kv_transfer_params[{PARAMS_KEY!r}].prompt_len: expected >= 1, got {params.prompt_len}"
        )
    return params


class LoadFailure(str, Enum):
    """Why a decode request's KV was not loaded (a closed set: metric labels and counter names)."""

    INVALID_PARAMS = "invalid_params"  # missing, malformed, of another version, or inconsistent parameters
    TICKET_REFUSED = "ticket_refused"  # the prefill refused the ticket (another receiver's, or a guess)
    PREFILL_LOST = "prefill_lost"  # the prefill instance is gone or unreachable
    LEASE_EXPIRED = "lease_expired"  # the prefill let the request go before the decode came
    REFUSED = "refused"  # kvcore refused to start the receive (geometry, mapping, a duplicate, ...)
    TRANSFER_FAILED = "transfer_failed"  # the bytes did not all arrive (transport error or timeout)


def classify_load_failure(error: BaseException | None) -> LoadFailure:
    """The :class:`LoadFailure` reason for a kvcore error that ended a receive."""
    if isinstance(error, InvalidTransferParamsError):
        return LoadFailure.INVALID_PARAMS
    if isinstance(error, E.TicketError):
        return LoadFailure.TICKET_REFUSED
    if isinstance(error, E.LeaseExpiredError):
        return LoadFailure.LEASE_EXPIRED
    if isinstance(error, (E.PeerLostError, E.NotRegisteredError, E.RemoteAgentError)):
        return LoadFailure.PREFILL_LOST
    if isinstance(error, E.TransferError):
        return LoadFailure.TRANSFER_FAILED
    return LoadFailure.REFUSED


@dataclass
class TransferResults:
    """One poll's worth of vLLM-visible results on this worker (ids are vLLM's request ids)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # failed receives included, as vLLM requires
    failed_recving: dict[str, E.KvcoreError] = field(default_factory=dict)
    failed_block_ids: set[int] = field(default_factory=set)


#: Counters :meth:`KvcoreEngine.take_counters` returns (per rank, since the last call): kvcore's outcomes and bytes,
#: the prompt tokens this rank loaded, and each :class:`LoadFailure` reason as ``load_failures_<reason>``.
COUNTERS = (
    "transfers_done",
    "transfers_failed",
    "transfers_cancelled",
    "bytes_moved",
    "tokens_loaded",
    "sends_started",  # prefill: start_send calls kvcore took
    "sends_started_early",  # of those, started in the step that computed the prompt's last token
    *(f"load_failures_{r.value}" for r in LoadFailure),
)


class Phase(str, Enum):
    """Where one request of this worker stands, as the connector sees it."""

    SENDING = "SENDING"  # prefill: start_send called; vLLM waits for finished_sending
    EXPECTED = "EXPECTED"  # decode: expect() called; vLLM has not allocated its blocks yet
    RECEIVING = "RECEIVING"  # decode: start_receive called; vLLM waits for finished_recving
    DROPPED = "DROPPED"  # decode: vLLM forgot the request (aborted, or nothing to load); kvcore still winds it down


@dataclass
class _Entry:
    phase: Phase
    kv_id: Any  # kvcore's request id: the prefill's vLLM request id (the same as the name on the prefill side)
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # decode: the prompt tokens this load brings
    delivered: bool | None = None  # None until kvcore reported an outcome
    error: E.KvcoreError | None = None
    released: bool = False
    aborted: bool = False  # vLLM aborted it: its end is reported to vLLM but is no load failure


class KvcoreEngine:
    """Drives one rank's :class:`Transceiver` on behalf of the connector's worker side (per-rank poll).

    Requests are named by *this* engine's vLLM request id; each maps to the kvcore
    request id its parameters carry (the prefill's id), at most one name per kvcore
    id at a time. Every send and every receive vLLM waits for is reported exactly
    once by :meth:`poll`, when kvcore released it on this rank: on the prefill side
    as finished sending (whatever the outcome: the blocks may be freed), on the
    decode side as finished receiving, plus failed receiving and its block ids
    when the KV did not arrive whole (logged once at WARNING with its
    :class:`LoadFailure` reason, and counted).
    """

    def __init__(self, transceiver: Transceiver, *, rank: int = 0) -> None:
        self.transceiver = transceiver
        self.rank = rank  # TP rank: failures the scheduler decided are counted on rank 0 only
        self._entries: dict[str, _Entry] = {}
        self._names: dict[Any, str] = {}  # kvcore request id -> name, for the entries above
        self._ready: list[tuple[str, _Entry]] = []  # released before vLLM waited for them, or refused at start
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._totals = dict.fromkeys(COUNTERS, 0)  # everything taken so far

    def take_counters(self) -> dict[str, int]:
        """Outcomes, bytes, loaded tokens and load failures since the last call (this rank; vLLM sums over ranks)."""
        out, self._counters = self._counters, dict.fromkeys(COUNTERS, 0)
        for key, value in out.items():
            self._totals[key] += value
        return out

    def totals(self) -> dict[str, int]:
        """The same counters since this engine started (for Prometheus; :meth:`take_counters` does not reset them)."""
        return {key: self._totals[key] + self._counters[key] for key in COUNTERS}

    @property
    def role(self) -> str:
        return self.transceiver.role

    @property
    def info_endpoint(self) -> str:
        return self.transceiver.info_endpoint

    @property
    def incarnation(self) -> str:
        return self.transceiver.incarnation

    def kv_request_id(self, name: str) -> Any:
        """The kvcore request id that request ``name`` of this engine sends or loads (None if not tracked)."""
        entry = self._entries.get(name)
        return None if entry is None else entry.kv_id

    def _track(self, name: str, entry: _Entry) -> None:
        self._entries[name] = entry
        self._names[entry.kv_id] = name

    def _untrack(self, name: str) -> _Entry:
        entry = self._entries.pop(name)
        if self._names.get(entry.kv_id) == name:
            del self._names[entry.kv_id]
        return entry

    def _claimed_by_other(self, name: str, kv_id: Any) -> str | None:
        other = self._names.get(kv_id)
        return other if other is not None and other != name else None

    # --- prefill side ------------------------------------------------------------------------------

    def send(
        self, name: str, block_ids: Sequence[int], prompt_len: int, params: TransferParams, *, early: bool = False
    ) -> None:
        """The KV of request ``name`` is complete in ``block_ids``; serve it to whoever presents ``params``' ticket.

        ``early``: started in the step that computed the prompt's last token, before vLLM finished the request
        (counted in ``sends_started_early``).
        """
        entry = _Entry(Phase.SENDING, params.request_id, list(block_ids))
        if name in self._entries or self._claimed_by_other(name, params.request_id):
            self._refuse(name, entry, E.SessionError(f"request {name!r} is already being sent from this worker"))
            return
        try:
            self.transceiver.start_send(params.request_id, block_ids, prompt_len=prompt_len, params=params)
        except E.KvcoreError as exc:
            self._refuse(name, entry, exc)
            return
        self._track(name, entry)
        self._counters["sends_started"] += 1
        self._counters["sends_started_early"] += early

    # --- decode side -------------------------------------------------------------------------------

    def expect(self, name: str, params: TransferParams) -> None:
        """Request ``name`` will be received here once vLLM allocated its blocks: keep the prefill's lease renewed."""
        if name in self._entries:
            return
        other = self._claimed_by_other(name, params.request_id)
        if other is not None:
            log.warning(
                "request %r: its parameters name prefill request %r, which request %r already loads here; "
                "not expecting it",
                name,
                params.request_id,
                other,
            )
            return
        try:
            self.transceiver.expect(params)
        except E.KvcoreError as exc:
            # Nothing started: receive() will try again and report what it finds.
            log.info("request %r: kvcore refused to expect it: %s", name, exc)
            return
        self._track(name, _Entry(Phase.EXPECTED, params.request_id))

    def receive(
        self, name: str, params: TransferParams, block_ids: Sequence[int], num_tokens: int = 0, cached_tokens: int = 0
    ) -> None:
        """Fetch request ``name``'s KV into ``block_ids``, the suffix after the ``cached_tokens`` vLLM holds already.

        Reported once kvcore released the request. kvcore checks that the blocks cover the prompt beyond
        ``cached_tokens``: a short list is refused (a ``MappingError``), never taken for a longer cached prefix.
        """
        blocks = list(block_ids)
        entry = self._entries.get(name)
        fresh = _Entry(Phase.RECEIVING, params.request_id, blocks, num_tokens)
        if entry is not None and entry.phase is not Phase.EXPECTED:
            self._refuse(name, fresh, E.SessionError(f"request {name!r} is in flight here"))
            return
        other = self._claimed_by_other(name, params.request_id)
        if other is not None:
            self._refuse(
                name,
                fresh,
                E.SessionError(
                    f"prefill request {params.request_id!r} is already being loaded here by request {other!r}"
                ),
            )
            return
        if entry is not None and entry.released:
            # Its expectation ended (lease expired, context lost) and kvcore let go of it: nothing will arrive.
            self._untrack(name)
            entry.phase, entry.block_ids, entry.num_tokens = Phase.RECEIVING, blocks, num_tokens
            self._ready.append((name, entry))
            return
        try:
            self.transceiver.start_receive(params=params, block_ids=blocks, cached_tokens=cached_tokens)
        except E.KvcoreError as exc:
            if entry is not None:
                # Expected but refused now: give the expectation up; report once kvcore released it.
                entry.phase, entry.block_ids, entry.num_tokens = Phase.RECEIVING, blocks, num_tokens
                entry.delivered, entry.error = False, exc
                self.transceiver.cancel(entry.kv_id, f"start_receive refused: {exc}")
                return
            self._refuse(name, fresh, exc)
            return
        if entry is None:
            self._track(name, fresh)
        else:
            entry.phase, entry.block_ids, entry.num_tokens = Phase.RECEIVING, blocks, num_tokens

    def fail_load(self, name: str, block_ids: Sequence[int], error: E.KvcoreError) -> None:
        """Report request ``name``'s load as failed at once (the scheduler refused its parameters; policy ``fail``).

        Counted and logged by :meth:`poll` on rank 0 only: the refusal concerns the request, not this rank.
        """
        entry = _Entry(Phase.RECEIVING, None, list(block_ids), aborted=self.rank != 0)
        self._refuse(name, entry, error)

    def note_fallback(self, name: str, error: str) -> None:
        """The scheduler computes request ``name``'s prompt locally (policy ``recompute``): count it and say why.

        The scheduler refused the parameters (:data:`LoadFailure.INVALID_PARAMS`), so no load was started.
        Counted on rank 0 only.
        """
        if self.rank != 0:
            return
        self._counters[f"load_failures_{LoadFailure.INVALID_PARAMS.value}"] += 1
        log.warning(
            "request %r: KV not loaded (%s): %s; computing its prompt locally",
            name,
            LoadFailure.INVALID_PARAMS.value,
            error,
        )

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
            self._untrack(name)
            return
        if params is None or self._claimed_by_other(name, params.request_id):
            if entry is not None:
                entry.phase = Phase.DROPPED
                self.transceiver.cancel(entry.kv_id, reason)
            return
        try:
            # The whole prompt is "cached" here: nothing is written, the context learns this receiver is done.
            self.transceiver.start_receive(params=params, block_ids=[], cached_tokens=max(0, params.prompt_len))
        except E.KvcoreError as exc:
            log.info("request %r: could not tell the prefill to free it (%s); its lease frees it", name, exc)
            if entry is not None:
                self.transceiver.cancel(entry.kv_id, reason)
        if entry is None:
            self._track(name, _Entry(Phase.DROPPED, params.request_id))
        else:
            entry.phase = Phase.DROPPED

    # --- both sides ----------------------------------------------------------------------------------

    def is_waited_for(self, name: str) -> bool:
        """True while a send or receive vLLM waits for is in flight on this worker."""
        entry = self._entries.get(name)
        return entry is not None and entry.phase in (Phase.SENDING, Phase.RECEIVING)

    def cancel(self, name: str, reason: str) -> bool:
        """Cancel request ``name``; it is still reported by :meth:`poll` once kvcore released it."""
        entry = self._entries.get(name)
        if entry is None:
            return False
        entry.aborted = True
        return self.transceiver.cancel(entry.kv_id, reason)

    def _refuse(self, name: str, entry: _Entry, exc: E.KvcoreError) -> None:
        """Nothing was started: vLLM gets the request back at once, as a failure."""
        if entry.phase is Phase.SENDING:
            log.warning("request %r: kvcore refused to send it: %s", name, exc)
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
            name = self._names.get(o.request_id)
            entry = self._entries.get(name) if name is not None else None
            if entry is not None and entry.delivered is None:
                entry.delivered, entry.error = o.request_id in done, o.error
        ready, self._ready = self._ready, []
        for rid in result.released:
            name = self._names.get(rid)
            if name is None:
                continue
            entry = self._entries[name]
            entry.released = True
            if entry.phase is Phase.EXPECTED:
                continue  # vLLM does not wait for it yet: reported when it allocates (receive) or forgets it (drop)
            self._untrack(name)
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
                if ok:
                    c["tokens_loaded"] += entry.num_tokens
                    continue
                error = entry.error or E.SessionError(f"request {name!r}: released without an outcome")
                out.failed_recving[name] = error
                out.failed_block_ids.update(entry.block_ids)
                if entry.aborted:
                    log.info("request %r: load given up (%s)", name, error)
                    continue
                reason = classify_load_failure(error)
                c[f"load_failures_{reason.value}"] += 1
                log.warning(
                    "request %r: KV not loaded (%s, prefill request %r): %s",
                    name,
                    reason.value,
                    entry.kv_id,
                    error,
                )
        return out

    @property
    def num_pending(self) -> int:
        """Requests this worker still tracks (in flight, expected, or winding down)."""
        return len(self._entries) + len(self._ready)

    def close(self) -> None:
        self.transceiver.close()


class EngineCollector:
    """A prometheus-client collector of one worker's load counters, served beside kvcore's own families.

    ``kvcore_vllm_load_failures_total{reason,rank}``, ``kvcore_vllm_tokens_loaded_total{rank}``: totals since the
    worker started, read at scrape time (``metrics_port`` in ``kv_connector_extra_config``).
    """

    def __init__(self, engine: KvcoreEngine) -> None:
        self._engine = engine

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily

        totals = self._engine.totals()
        rank = str(self._engine.rank)
        failures = CounterMetricFamily(
            "kvcore_vllm_load_failures",
            "Decode requests whose KV kvcore did not load on this worker, by reason.",
            labels=["reason", "rank"],
        )
        for r in LoadFailure:
            failures.add_metric([r.value, rank], totals[f"load_failures_{r.value}"])
        yield failures
        tokens = CounterMetricFamily(
            "kvcore_vllm_tokens_loaded", "Prompt tokens this decode worker loaded over kvcore.", labels=["rank"]
        )
        tokens.add_metric([rank], totals["tokens_loaded"])
        yield tokens

    def describe(self) -> list[Any]:
        return []
