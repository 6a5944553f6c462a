"""The kvcore calls the connector makes, in one module: what issue 14's engine API will replace.

Everything the connector needs from kvcore's per-request API goes through
here, so that switching to the engine API (a transfer-parameters value
returned by ``start_send``, str request ids, a per-rank poll, pull mode) is a
change to this file only:

* :class:`TransferParams`: what the prefill instance hands the router in
  ``kv_transfer_params`` (today a small dict built here; later kvcore's own
  value, forwarded as is).
* :func:`request_key`: vLLM's str request id -> kvcore's 64-bit id (a stable
  hash; later kvcore takes the str).
* :class:`KvcoreEngine`: start a send or a receive, cancel, and turn
  ``Transceiver.poll()`` outcomes into vLLM's finished/failed sets, reporting a
  request only once kvcore *released* it (no write into its blocks can still
  land), which is the moment vLLM may free or reuse the blocks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvcore import errors as E
from kvcore import wire
from kvcore.transceiver import Transceiver

__all__ = [
    "PARAMS_KEY",
    "PARAMS_VERSION",
    "InvalidTransferParamsError",
    "KvcoreEngine",
    "TransferParams",
    "TransferResults",
    "request_key",
]

log = logging.getLogger("kvcore_vllm.engine_api")

#: The key of kvcore's parameters inside vLLM's ``kv_transfer_params`` dict.
PARAMS_KEY = "kvcore"
PARAMS_VERSION = 1
_MAX_ENDPOINT_CHARS = 256


class InvalidTransferParamsError(E.KvcoreError, ValueError):
    """``kv_transfer_params`` from the router are missing, malformed or of another version."""


class TransferParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a decode instance needs to fetch one request's KV from the prefill instance that computed it.

    JSON-safe; travels through the router inside ``kv_transfer_params[PARAMS_KEY]``.
    """

    v: int = PARAMS_VERSION
    ctx_endpoint: str  # the prefill instance's info endpoint (its rank 0), ``tcp://host:port``
    request_id: int  # kvcore's 64-bit id of the request, the same on both instances
    prompt_len: int  # tokens whose KV the prefill instance holds
    ctx_dp_rank: int = 0  # kvcore attention-DP group on the prefill instance (vLLM DP engines are separate instances)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, data: object) -> TransferParams:
        """Validate a dict from the router; anything wrong raises :class:`InvalidTransferParamsError`."""
        if not isinstance(data, dict):
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}]: expected a mapping, got {type(data).__name__}"
            )
        version = data.get("v")
        if version != PARAMS_VERSION:
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}].v: expected {PARAMS_VERSION}, got {version!r}"
            )
        try:
            params = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise InvalidTransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}]: {exc}") from None
        if not 0 <= params.request_id <= wire.MAX_U64:
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}].request_id: expected 0..2**64-1, got {params.request_id}"
            )
        if params.prompt_len < 1:
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}].prompt_len: expected >= 1, got {params.prompt_len}"
            )
        if params.ctx_dp_rank < 0:
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}].ctx_dp_rank: expected >= 0, got {params.ctx_dp_rank}"
            )
        if len(params.ctx_endpoint) > _MAX_ENDPOINT_CHARS:
            raise InvalidTransferParamsError(
                f"kv_transfer_params[{PARAMS_KEY!r}].ctx_endpoint: expected at most {_MAX_ENDPOINT_CHARS} "
                f"characters, got {len(params.ctx_endpoint)}"
            )
        try:
            wire.parse_endpoint(params.ctx_endpoint)
        except E.KvcoreError as exc:
            raise InvalidTransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}].ctx_endpoint: {exc}") from None
        return params


def request_key(engine_id: str, request_id: str) -> int:
    """kvcore's 64-bit id for vLLM request ``request_id`` of prefill engine ``engine_id`` (stable across processes).

    The engine id is part of the key so that two prefill instances reusing a
    request id cannot collide on a decode instance that fetches from both.
    """
    digest = hashlib.blake2b(f"{engine_id}\x00{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


@dataclass
class TransferResults:
    """One poll's worth of vLLM-visible results (ids are vLLM's str request ids)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # failed receives included, as vLLM requires
    failed_recving: dict[str, E.KvcoreError] = field(default_factory=dict)
    failed_block_ids: set[int] = field(default_factory=set)


#: Counters :meth:`KvcoreEngine.take_counters` returns (per rank, since the last call).
COUNTERS = ("transfers_done", "transfers_failed", "transfers_cancelled", "bytes_moved")


@dataclass
class _Pending:
    name: str
    block_ids: list[int]
    report: bool = True  # False: vLLM forgot the request already (a release without transfer)
    delivered: bool | None = None  # None until kvcore reported an outcome
    error: E.KvcoreError | None = None


class KvcoreEngine:
    """Drives one rank's :class:`Transceiver` on behalf of the connector's worker side.

    Every request started here is reported exactly once by :meth:`poll`, when
    kvcore released it: on the prefill side as finished sending (whatever the
    outcome: the blocks may be freed), on the decode side as finished receiving,
    plus failed receiving and its block ids when the KV did not arrive.
    """

    def __init__(self, transceiver: Transceiver) -> None:
        self.transceiver = transceiver
        self._pending: dict[int, _Pending] = {}
        self._keys: dict[str, int] = {}  # vLLM request id -> kvcore id, for cancel
        self._failed_at_start: list[_Pending] = []
        self._counters = dict.fromkeys(COUNTERS, 0)

    def take_counters(self) -> dict[str, int]:
        """Outcomes and bytes since the last call (this rank; the engine sums over ranks)."""
        out, self._counters = self._counters, dict.fromkeys(COUNTERS, 0)
        return out

    @property
    def role(self) -> str:
        return self.transceiver.role

    @property
    def info_endpoint(self) -> str:
        return self.transceiver.info_endpoint

    def send(self, name: str, key: int, block_ids: Sequence[int], prompt_len: int) -> None:
        """Prefill side: the KV of request ``name`` (kvcore id ``key``) is complete in ``block_ids``."""
        self._start(
            name, key, list(block_ids), lambda: self.transceiver.start_send(key, block_ids, prompt_len=prompt_len)
        )

    def receive(self, name: str, params: TransferParams, block_ids: Sequence[int]) -> None:
        """Decode side: fetch request ``name``'s KV into ``block_ids`` (the suffix not cached locally)."""
        self._start(
            name,
            params.request_id,
            list(block_ids),
            lambda: self.transceiver.start_receive(
                params.request_id,
                params.ctx_endpoint,
                block_ids,
                prompt_len=params.prompt_len,
                ctx_dp_rank=params.ctx_dp_rank,
            ),
        )

    def release_remote(self, name: str, params: TransferParams) -> None:
        """Decode side: request ``name`` will not load (aborted before it was scheduled); let the prefill free now.

        A receive into no blocks: nothing is written here, and the prefill instance's send completes at once
        instead of holding its blocks until ``request_timeout_s``. Not reported to vLLM.
        """
        self._start(
            name,
            params.request_id,
            [],
            lambda: self.transceiver.start_receive(
                params.request_id, params.ctx_endpoint, [], prompt_len=params.prompt_len, ctx_dp_rank=params.ctx_dp_rank
            ),
            report=False,
        )

    def _start(self, name: str, key: int, block_ids: list[int], start: Any, report: bool = True) -> None:
        entry = _Pending(name, block_ids, report)
        if key in self._pending:
            # A 64-bit hash collision or a router replaying parameters: refuse this one, keep the live one intact.
            entry.delivered = False
            entry.error = E.SessionError(f"request {name!r}: kvcore id {key} is already in flight here")
            self._failed_at_start.append(entry)
            return
        try:
            start()
        except E.KvcoreError as exc:
            # Nothing was started: the blocks are safe to hand back at once, as a failure.
            log.warning("request %r: kvcore refused to start: %s", name, exc)
            entry.delivered = False
            entry.error = exc
            self._failed_at_start.append(entry)
            return
        self._pending[key] = entry
        self._keys[name] = key

    def is_pending(self, name: str) -> bool:
        """True while a send or receive vLLM waits for is in flight (releases are not: vLLM forgot them)."""
        key = self._keys.get(name)
        return key is not None and self._pending[key].report

    def cancel(self, name: str, reason: str) -> bool:
        """Cancel request ``name`` if vLLM waits for it; it is still reported by :meth:`poll` once released."""
        if not self.is_pending(name):
            return False
        return self.transceiver.cancel(self._keys[name], reason)

    def poll(self) -> TransferResults:
        """Poll kvcore once (collective across the instance's ranks) and report what it released."""
        out = TransferResults()
        result = self.transceiver.poll()
        c = self._counters
        c["transfers_done"] += len(result.done)
        c["transfers_failed"] += len(result.failed)
        c["transfers_cancelled"] += len(result.cancelled)
        c["bytes_moved"] += sum(o.nbytes for o in result.done)
        for o in result.done:
            if (entry := self._pending.get(o.request_id)) is not None:
                entry.delivered = True
        for o in [*result.failed, *result.cancelled]:
            if (entry := self._pending.get(o.request_id)) is not None:
                entry.delivered, entry.error = False, o.error
        released = [self._pending.pop(rid) for rid in result.released if rid in self._pending]
        released.extend(self._failed_at_start)
        self._failed_at_start = []
        for entry in released:
            self._keys.pop(entry.name, None)
            if not entry.report:
                log.debug("request %r: prefill told to release (%s)", entry.name, entry.error or "done")
                continue
            ok = entry.delivered is True
            if self.role == "context":
                if not ok:
                    log.info("request %r: KV not delivered: %s", entry.name, entry.error)
                out.finished_sending.add(entry.name)
                continue
            out.finished_recving.add(entry.name)
            if not ok:
                out.failed_recving[entry.name] = entry.error or E.SessionError(
                    f"request {entry.name!r}: released without an outcome"
                )
                out.failed_block_ids.update(entry.block_ids)
        return out

    @property
    def num_pending(self) -> int:
        return len(self._pending) + len(self._failed_at_start)

    def close(self) -> None:
        self.transceiver.close()
