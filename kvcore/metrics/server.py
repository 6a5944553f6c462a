"""Serve kvcore's Prometheus metrics over HTTP (loopback by default)."""

from __future__ import annotations

from typing import Any

from kvcore.metrics.prometheus import _require_prometheus, register_metrics


def serve_metrics(port: int, host: str = "127.0.0.1", registry: Any = None) -> Any:
    """Serve ``registry`` (a fresh one holding kvcore's collector when None) on ``http://host:port/metrics``.

    Binds to loopback unless told otherwise; ``port=0`` picks a free one. Returns the HTTP server:
    ``server.server_port`` is the port, ``server.shutdown()`` stops it.
    """
    prometheus_client = _require_prometheus()
    if registry is None:
        registry = prometheus_client.CollectorRegistry()
    register_metrics(registry)
    server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
    return server
