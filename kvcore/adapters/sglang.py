"""SGLang's disaggregation interface (``KVManager``, ``KVSender``, ``KVReceiver``) on one kvcore ``Transceiver`` per rank.

The interface is SGLang's (``python/sglang/srt/disaggregation/base/conn.py``, checked against 0.5.23; its
scheduler in ``prefill.py``/``decode.py``). When SGLang is importable the classes here subclass its base classes
(``BaseKVManager``, ``BaseKVSender``, ``BaseKVReceiver``) and use its ``KVPoll`` and ``KVTransferMetric``;
otherwise they stand alone with the same methods and values, so the adapter is tested without SGLang installed.

SGLang's router sends a request to a prefill and a decode instance at once, with the same ``bootstrap_room`` (the
request id here) and the prefill's bootstrap address; nothing travels from prefill to decode before the KV, so the
transfer is push: the decode side states its pages, the prefill writes them. Both sides derive the request's ticket
from a secret the deployment holds (``ticket_secret``, :func:`kvcore.params.derive_ticket`).

The promises the scheduler builds on:

* **``KVPoll.Success`` and ``KVPoll.Failed`` only once a request's pages may be freed.** A terminal value is
  reported only after kvcore *released* the request on every rank of the instance: no write into its pages
  (decode) and no read of them (prefill) can still happen. ``abort()`` never frees anything by itself; the
  request reports ``Failed`` (or ``Success``, when its bytes landed anyway) once released.
* **Every rank reports the same value in the same iteration.** The manager runs the collective
  ``Transceiver.poll()`` once per scheduler iteration (see :meth:`KvcoreKVManager.tick`), so SGLang's MIN
  all-reduce over its ranks sees agreed values and no rank frees pages another rank is still writing.
* **A chunked prefill is sent once its last chunk is in place**: ``send()`` collects the pages and starts the
  request when they add up to ``init()``'s page count (kvcore sends whole requests; layer-wise sending is
  :meth:`~kvcore.transceiver.Transceiver.layers_ready`, which SGLang's interface has no call for).
* **The metadata buffers travel with the KV**: the prefill's rows at ``aux_index`` (output token id, logprobs...)
  are packed as the request's ``aux`` payload and written into the decode's rows at its ``aux_index`` before
  ``Success`` is reported.

SGLang builds its manager itself, ``KVManager(args, disaggregation_mode, server_args, is_mla_backend)``; a kvcore
backend for SGLang builds the ``Transceiver`` from ``KVArgs`` (its pool pointers as a page table) and passes it
here as ``transceiver=``, with the deployment's ``ticket_secret`` and, on decode, ``endpoint_of`` (bootstrap
address -> the prefill's ``tx.info_endpoint``, e.g. from SGLang's bootstrap server).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvcore import errors as E
from kvcore.params import TransferParams, derive_ticket
from kvcore.transceiver.facade import Outcome, RequestStatus, Transceiver
from kvcore.transceiver.sessions import SessionState

__all__ = [
    "SGLANG_BASES",
    "KVPoll",
    "KVTransferMetric",
    "KvcoreKVManager",
    "KvcoreKVReceiver",
    "KvcoreKVSender",
]

log = logging.getLogger(__name__)


def _sglang_base() -> Any:
    """SGLang's ``disaggregation.base.conn`` module, or None when SGLang is not importable here."""
    import importlib.util

    try:
        if importlib.util.find_spec("sglang") is None:
            return None
        from sglang.srt.disaggregation.base import conn

        return conn
    except Exception as exc:  # an SGLang install that does not import: stand alone, and say why
        log.warning("kvcore.adapters.sglang: SGLang is installed but its base classes do not import (%s); "
                    "the adapter stands alone", exc)  # fmt: skip
        return None


_conn = _sglang_base()
#: True when the classes here subclass SGLang's own base classes (SGLang importable in this process).
SGLANG_BASES: bool = _conn is not None

if TYPE_CHECKING or _conn is None:

    class KVPoll:
        """SGLang's ``KVPoll`` values (``disaggregation/base/conn.py``)."""

        Failed = 0
        Bootstrapping = 1
        WaitingForInput = 2
        Transferring = 3
        Success = 4

    @dataclasses.dataclass
    class KVTransferMetric:
        """SGLang's ``KVTransferMetric``: what a sender reports once its request finished."""

        transfer_latency_s: float | None = None
        alloc_latency_s: float | None = None
        transfer_total_bytes: int | None = None

    _ManagerBase: Any = object
    _SenderBase: Any = object
    _ReceiverBase: Any = object
else:
    KVPoll = _conn.KVPoll
    KVTransferMetric = _conn.KVTransferMetric
    _ManagerBase = _conn.BaseKVManager
    _SenderBase = _conn.BaseKVSender
    _ReceiverBase = _conn.BaseKVReceiver

#: KVPoll values by name, for logs and tests (SGLang's KVPoll is a plain class of ints).
POLL_NAMES: dict[int, str] = {0: "Failed", 1: "Bootstrapping", 2: "WaitingForInput", 3: "Transferring", 4: "Success"}


def _room(bootstrap_room: Any, call: str) -> int:
    if isinstance(bootstrap_room, bool) or not isinstance(bootstrap_room, int) or bootstrap_room < 0:
        raise E.SessionError(f"{call}: bootstrap_room must be an int >= 0 (the request id), got {bootstrap_room!r}")
    return int(bootstrap_room)


def _state_slot(state_indices: Sequence[Any] | None, room: int) -> int:
    """SGLang's per-request state indices as kvcore's state slot: one Mamba slot, or none."""
    if state_indices is None:
        return -1
    given = [s for s in state_indices if s is not None]
    if not given:
        return -1
    if len(given) > 1:
        raise E.LayoutError(
            f"request {room}: {len(given)} kinds of extra state (SGLang state_indices); kvcore's SGLang adapter "
            "maps one Mamba slot (sliding-window and other per-group pages need kvcore's layer groups)"
        )
    s = given[0]
    if not isinstance(s, int):
        items = [int(x) for x in s]
        if len(items) != 1:
            raise E.LayoutError(f"request {room}: state indices {items!r}: kvcore's SGLang adapter maps one slot")
        s = items[0]
    return int(s)


class KvcoreKVManager(_ManagerBase):  # type: ignore[misc]
    """SGLang's ``KVManager`` on one rank: the rank's ``Transceiver`` and what the collective poll agreed on.

    ``args``: SGLang's ``KVArgs``; only the metadata buffers are read here (``aux_data_ptrs``, ``aux_data_lens``,
    ``aux_item_lens``: one row per request, ``aux_index`` picks it). ``disaggregation_mode``: "prefill" or
    "decode" (or SGLang's ``DisaggregationMode``); it must match the transceiver's role.

    ``transceiver``: this rank's kvcore ``Transceiver`` (role ``context`` for prefill, ``generation`` for decode).
    ``ticket_secret``: 16+ random bytes every prefill and decode rank of the deployment holds; each request's
    ticket is ``derive_ticket(ticket_secret, bootstrap_room)``. ``endpoint_of``: decode only, bootstrap address ->
    the prefill instance's ``tx.info_endpoint``. ``auto_tick``: run the collective poll from the senders' and
    receivers' ``poll()`` (once per scheduler iteration, see :meth:`tick`); False when the engine calls
    :meth:`tick` itself once per iteration on every rank.
    """

    supports_host_destination = False
    enable_deferred_decode_kv_release = False
    supports_deferred_decode_kv_release = False
    supports_role_switch = False

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any = None,
        is_mla_backend: bool | None = False,
        *,
        transceiver: Transceiver | None = None,
        ticket_secret: bytes | None = None,
        endpoint_of: Callable[[str], str] | None = None,
        auto_tick: bool = True,
    ) -> None:
        if transceiver is None:
            raise E.ConfigError(
                "KvcoreKVManager needs transceiver=: this rank's kvcore Transceiver, built from SGLang's KVArgs "
                "by the backend that registers kvcore with SGLang"
            )
        mode = str(getattr(disaggregation_mode, "value", disaggregation_mode)).lower()
        want = {"prefill": "context", "decode": "generation"}.get(mode)
        if want is None:
            raise E.ConfigError(f"disaggregation_mode must be prefill or decode, got {disaggregation_mode!r}")
        if transceiver.role != want:
            raise E.ConfigError(f"disaggregation_mode {mode} needs a {want} transceiver; got a {transceiver.role} one")
        if ticket_secret is None or len(ticket_secret) < 16:
            raise E.TicketError("KvcoreKVManager needs ticket_secret: 16+ random bytes the deployment holds")
        self.kv_args = args
        self.disaggregation_mode = mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.tx = transceiver
        self.secret = bytes(ticket_secret)
        self.endpoint_of = endpoint_of
        self.auto_tick = bool(auto_tick)
        self.polls = 0  # collective polls run (one per scheduler iteration)
        self._aux = [
            (int(p), int(n), int(i))
            for p, n, i in zip(
                getattr(args, "aux_data_ptrs", None) or [],
                getattr(args, "aux_data_lens", None) or [],
                getattr(args, "aux_item_lens", None) or [],
                strict=True,
            )
        ]
        self._outcomes: dict[int, Outcome] = {}  # agreed, not yet released
        self._settled: dict[int, tuple[int, Outcome | None, E.KvcoreError | None]] = {}  # room -> KVPoll, outcome
        self._polled: set[int] = set()  # rooms polled since the last tick

    @property
    def is_prefill(self) -> bool:
        return self.tx.role == "context"

    def register_to_bootstrap(self) -> None:
        """Nothing to register: kvcore's info endpoint answers first contact (geometry, page table, agent)."""

    def ticket(self, room: int) -> bytes:
        return derive_ticket(self.secret, room)

    # --- the collective poll -----------------------------------------------------------------

    def tick(self) -> None:
        """One collective ``Transceiver.poll()``: call it once per scheduler iteration on every rank, alike.

        With ``auto_tick`` the senders' and receivers' ``poll()`` call it: on the first poll ever, and whenever a
        request is polled a second time since the last tick (a new iteration of SGLang's queue, which every rank
        polls in the same order).
        """
        self._polled.clear()
        self.polls += 1
        result = self.tx.poll()
        for o in result.outcomes:
            rid = o.request_id
            if isinstance(rid, int):
                self._outcomes[rid] = o
        for rid in result.released:
            if not isinstance(rid, int):
                continue
            done = self._outcomes.pop(rid, None)
            if done is None:
                continue
            value = KVPoll.Success if done.state is SessionState.DONE else KVPoll.Failed
            self._settled[rid] = (value, done, done.error)

    def _on_poll(self, room: int) -> None:
        if self.auto_tick and (not self._polled or room in self._polled):
            self.tick()
        self._polled.add(room)

    def settled(self, room: int) -> tuple[int, Outcome | None, E.KvcoreError | None] | None:
        return self._settled.get(room)

    def _settle_now(self, room: int, value: int, err: E.KvcoreError | None) -> None:
        """A request kvcore never held (aborted before it started): terminal at once, nothing to wait for."""
        self._settled[room] = (value, None, err)

    def _forget(self, room: int) -> None:
        self._settled.pop(room, None)
        self._outcomes.pop(room, None)
        self._polled.discard(room)

    # --- the metadata buffers ----------------------------------------------------------------

    def pack_aux(self, aux_index: int | None) -> bytes:
        """The prefill's metadata rows at ``aux_index``, every buffer's row in order, as one payload."""
        if aux_index is None or not self._aux:
            return b""
        out = []
        for ptr, total, item in self._aux:
            if aux_index < 0 or (aux_index + 1) * item > total:
                raise E.LayoutError(f"aux_index {aux_index} is outside a metadata buffer of {total} bytes")
            out.append(ctypes.string_at(ptr + aux_index * item, item))
        return b"".join(out)

    def unpack_aux(self, aux_index: int | None, payload: bytes, room: int) -> None:
        """Write a received payload into the decode's metadata rows at ``aux_index``."""
        if aux_index is None or not self._aux:
            return
        need = sum(item for _, _, item in self._aux)
        if len(payload) != need:
            raise E.LayoutError(
                f"request {room}: the prefill's metadata rows are {len(payload)} bytes, this decode's {need} "
                "(different metadata buffers on the two instances)"
            )
        at = 0
        for ptr, total, item in self._aux:
            if aux_index < 0 or (aux_index + 1) * item > total:
                raise E.LayoutError(f"aux_index {aux_index} is outside a metadata buffer of {total} bytes")
            ctypes.memmove(ptr + aux_index * item, payload[at : at + item], item)
            at += item


class _Request:
    """What the sender and the receiver share: the room, its settled value, its metric, its failure."""

    kv_mgr: KvcoreKVManager
    room: int
    conclude_state: int | None
    _started_at: float | None
    _settled_at: float
    _aux_done: bool = True  # decode: False from send_metadata until the metadata rows were written

    def _poll_settled(self) -> int | None:
        """This poll's share of the collective tick, then the request's terminal value (None until released)."""
        self.kv_mgr._on_poll(self.room)
        value = self._terminal()
        if value is not None and not self._settled_at:
            self._settled_at = time.monotonic()
        return value

    def _terminal(self) -> int | None:
        s = self.kv_mgr.settled(self.room)
        if s is None:
            return None
        if s[0] == KVPoll.Success and not self._aux_done:
            self._finish_aux(s[1])
            s = self.kv_mgr.settled(self.room)
            assert s is not None
        self.conclude_state = s[0]
        return s[0]

    def _finish_aux(self, outcome: Outcome | None) -> None:  # decode only
        self._aux_done = True

    def failure_exception(self) -> None:
        """Raise the request's typed kvcore error (``PeerLostError``, ``LeaseExpiredError``, ``TicketError``...)."""
        s = self.kv_mgr.settled(self.room)
        if s is None:
            raise E.SessionError(f"request {self.room}: failure_exception() before poll() reported Failed")
        if s[2] is not None:
            raise s[2]
        if s[1] is not None and s[1].state is SessionState.CANCELLED:
            raise E.RequestCancelledError(f"request {self.room} was cancelled")
        if s[0] == KVPoll.Failed:
            raise E.TransferFailedError(f"request {self.room} failed")

    def get_transfer_metric(self) -> Any:
        """SGLang's ``KVTransferMetric``: bytes moved and the time from start to release."""
        s = self.kv_mgr.settled(self.room)
        started = getattr(self, "_started_at", None)
        latency = None if started is None or s is None else max(0.0, self._settled_at - started)
        nbytes = None if s is None or s[1] is None else int(s[1].nbytes)
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=nbytes)

    def clear(self) -> None:
        """SGLang is done with the request: forget its settled state."""
        self.kv_mgr._forget(self.room)


class KvcoreKVSender(_Request, _SenderBase):  # type: ignore[misc]
    """Prefill side of one request: collects the pages of a (chunked) prefill and pushes them when complete."""

    def __init__(
        self,
        mgr: KvcoreKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not mgr.is_prefill:
            raise E.SessionError("KvcoreKVSender needs a prefill KvcoreKVManager")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = _room(bootstrap_room, "KvcoreKVSender")
        self.conclude_state: int | None = None
        self.num_pages = -1
        self.aux_index: int | None = None
        self.pages: list[int] = []
        self.tokens = 0  # sum of send()'s num_kv_tokens, -1 once one was not given
        self.started = False
        self.aborted = False
        self._started_at: float | None = None
        self._settled_at = 0.0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        """The request's page count (what ``send`` will hand over in all) and its metadata-buffer row."""
        if isinstance(num_kv_indices, bool) or not isinstance(num_kv_indices, int) or num_kv_indices < 0:
            raise E.SessionError(f"request {self.room}: num_kv_indices must be an int >= 0, got {num_kv_indices!r}")
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index

    def pop_decode_prefix_len(self) -> int:
        """0: the prefill sends every page of the prompt; a decode prefix hit is skipped by kvcore itself.

        The decode states its hit (``send_metadata(..., decode_prefix_len=)``) and passes only the pages after
        it; kvcore writes only those (``cached_tokens``), so the prefill need not learn the hit beforehand.
        """
        return 0

    def send(self, kv_indices: Any, state_indices: list[Any] | None = None, num_kv_tokens: int | None = None,
             **kwargs: Any) -> None:  # fmt: skip
        """One chunk's pages (in token order); the chunk that completes ``init``'s page count starts the push."""
        if self.aborted or self.started:
            if self.started:
                raise E.SessionError(f"request {self.room}: send() after its last chunk")
            return  # aborted: SGLang frees the pages once poll() says Failed; nothing to send
        if self.num_pages < 0:
            raise E.SessionError(f"request {self.room}: send() before init()")
        self.pages.extend(int(i) for i in kv_indices)
        if num_kv_tokens is None or self.tokens < 0:
            self.tokens = -1
        else:
            self.tokens += int(num_kv_tokens)
        if len(self.pages) > self.num_pages:
            raise E.MappingError(
                f"request {self.room}: send() handed {len(self.pages)} pages, init() said {self.num_pages}"
            )
        if len(self.pages) < self.num_pages:
            return  # chunked prefill: more chunks to come
        mgr = self.kv_mgr
        self.started, self._started_at = True, time.monotonic()
        mgr.tx.start_send(
            self.room,
            self.pages,
            prompt_len=self.tokens,
            state_slot=_state_slot(state_indices, self.room),
            ticket=mgr.ticket(self.room),
            aux=mgr.pack_aux(self.aux_index),
        )

    def poll(self) -> int:
        """``WaitingForInput`` until the last chunk, then ``Transferring``; ``Success``/``Failed`` once released."""
        value = self._poll_settled()
        if value is not None:
            return value
        if not self.started:
            return KVPoll.WaitingForInput  # kvcore needs no bootstrap gate: an early ask waits for start_send
        status = self.kv_mgr.tx.status(self.room)
        if status in (RequestStatus.WAITING, RequestStatus.READY):
            return KVPoll.WaitingForInput
        return KVPoll.Transferring

    def abort(self) -> None:
        """Cancel the request; its pages come back with the ``Failed`` a later poll reports (never at once)."""
        if self.aborted:
            return
        self.aborted = True
        self.kv_mgr.tx.cancel(self.room, "aborted by SGLang")
        if not self.started and self.kv_mgr.settled(self.room) is None:
            # Never handed to kvcore: nothing reads the pages. The cancel is remembered, so a decode that asks
            # is answered at once.
            self.kv_mgr._settle_now(self.room, KVPoll.Failed, E.RequestCancelledError(
                f"request {self.room} was aborted before its KV was sent"))  # fmt: skip


class KvcoreKVReceiver(_Request, _ReceiverBase):  # type: ignore[misc]
    """Decode side of one request: renews the prefill's lease while queued, then receives into its pages."""

    def __init__(self, mgr: KvcoreKVManager, bootstrap_addr: str, bootstrap_room: int | None = None,
                 *args: Any, **kwargs: Any) -> None:  # fmt: skip
        if mgr.is_prefill:
            raise E.SessionError("KvcoreKVReceiver needs a decode KvcoreKVManager")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.room = _room(bootstrap_room, "KvcoreKVReceiver")
        self.conclude_state: int | None = None
        self.params: TransferParams | None = None
        self.aux_index: int | None = None
        self.started = False
        self.aborted = False
        self.abort_notified = False
        self.require_staging = False
        self._started_at: float | None = None
        self._settled_at = 0.0

    @property
    def supports_host_destination(self) -> bool:
        return False

    def init(self, prefill_dp_rank: int = 0) -> None:
        """The prefill instance is known: expect the request there (its lease is renewed while this one queues)."""
        mgr = self.kv_mgr
        if mgr.endpoint_of is None:
            raise E.ConfigError("a decode KvcoreKVManager needs endpoint_of (bootstrap address -> tx.info_endpoint)")
        endpoint = mgr.endpoint_of(self.bootstrap_addr)
        self.params = TransferParams.make(
            self.room, endpoint, ticket=mgr.ticket(self.room), dp_rank=int(prefill_dp_rank)
        )
        mgr.tx.expect(self.params)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
        **kwargs: Any,
    ) -> None:
        """The request's pages are allocated: receive into them (only the pages after a decode prefix hit).

        ``decode_prefix_len``: the prompt tokens this decode already holds (its prefix-cache hit); ``kv_indices``
        are then the pages from ``decode_prefix_len // page_size`` on, and kvcore writes only those.
        """
        if self.params is None:
            raise E.SessionError(f"request {self.room}: send_metadata() before init()")
        if destination is not None and str(getattr(destination, "value", destination)).lower() != "device":
            raise E.UnsupportedOperationError(f"request {self.room}: destination {destination!r}: kvcore's SGLang "
                                              "adapter receives into the device pool only")  # fmt: skip
        if self.aborted:
            return
        self.aux_index = aux_index
        self._aux_done = False
        self.started, self._started_at = True, time.monotonic()
        self.kv_mgr.tx.start_receive(
            params=self.params,
            block_ids=[int(i) for i in kv_indices],
            state_slot=_state_slot(state_indices, self.room),
            cached_tokens=int(decode_prefix_len or 0),
        )

    def _finish_aux(self, outcome: Outcome | None) -> None:
        """The KV landed: the prefill's metadata rows go into this decode's rows before Success is reported."""
        self._aux_done = True
        try:
            self.kv_mgr.unpack_aux(self.aux_index, outcome.aux if outcome is not None else b"", self.room)
        except E.KvcoreError as exc:
            self.kv_mgr._settled[self.room] = (KVPoll.Failed, outcome, exc)

    def poll(self) -> int:
        """``Bootstrapping`` before ``init``, ``WaitingForInput`` until ``send_metadata``, then ``Transferring``."""
        value = self._poll_settled()
        if value is not None:
            return value
        if self.params is None:
            return KVPoll.Bootstrapping
        if not self.started:
            return KVPoll.WaitingForInput
        return KVPoll.Transferring

    def abort(self) -> None:
        """Cancel the receive; the pages come back with the ``Failed`` a later poll reports, once no write can land."""
        if self.aborted:
            return
        self.aborted = self.abort_notified = True
        mgr = self.kv_mgr
        accepted = self.params is not None and mgr.tx.cancel(self.room, "aborted by SGLang")
        if not accepted and mgr.settled(self.room) is None and mgr.tx.status(self.room) is None:
            # kvcore holds nothing of it (never expected, or already released): no write can land.
            mgr._settle_now(self.room, KVPoll.Failed, E.RequestCancelledError(
                f"request {self.room} was aborted before kvcore received it"))  # fmt: skip

    def is_abort_release_safe(self) -> bool:
        """True once no write into the request's pages can still land (kvcore released it)."""
        return self.kv_mgr.settled(self.room) is not None
