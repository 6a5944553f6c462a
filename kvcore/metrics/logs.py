"""Log context for requests: records that carry ``kvcore_request_id`` and ``kvcore_peer``."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any


def log_extra(request_id: int | None = None, peer: str | None = None) -> dict[str, Any]:
    """The ``extra=`` of a log record about a request: ``kvcore_request_id`` and ``kvcore_peer`` attributes."""
    return {"kvcore_request_id": request_id, "kvcore_peer": peer}


class _RequestAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Adds ``kvcore_request_id`` / ``kvcore_peer`` to every record, and prefixes the message for plain handlers."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        rid, peer = extra.get("kvcore_request_id"), extra.get("kvcore_peer")
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        prefix = " ".join(x for x in (f"request {rid}" if rid is not None else "", f"peer {peer}" if peer else "") if x)
        return (f"[{prefix}] {msg}" if prefix else msg), kwargs


def request_logger(
    logger: logging.Logger, request_id: int | None = None, peer: str | None = None
) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """A logger whose records carry ``kvcore_request_id`` and ``kvcore_peer`` (for JSON formatters and filters)."""
    return _RequestAdapter(logger, log_extra(request_id, peer))
