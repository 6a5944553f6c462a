"""What comes in on a messenger's sockets: ZAP requests, frames on the ROUTER and the DEALERs, decoded and dispatched.

Nothing a peer sends can stop the I/O thread: a frame that fails to decode is answered with an ``ErrorReply``
(on the ROUTER) and counted; an exception from a handler is counted and logged (rate-limited). Each drain is
bounded per loop turn, so a flood on one socket leaves the others their share. With authentication, ZAP (RFC 27)
admits only allow-listed CURVE client keys, before any frame of theirs is decoded.
"""

from __future__ import annotations

import logging

import zmq

from kvcore.control import wire
from kvcore.control.auth import z85_key
from kvcore.control.messenger_state import Source, _Dealer, _readable
from kvcore.control.outbox import Outbox
from kvcore.errors import KvcoreError

log = logging.getLogger("kvcore.control.messenger")

_ZAP_DOMAIN = b"kvcore"


class Inbound(Outbox):
    """Draining the ZAP socket, the ROUTER and the DEALERs, and handing each decoded message to the handler."""

    def _drain_zap(self) -> None:
        """Answer ZAP requests (RFC 27): admit CURVE clients whose public key is allow-listed, refuse the rest."""
        assert self._zap is not None and self._auth is not None
        for _ in range(1000):  # bounded per turn: other sockets get their share under a flood
            try:
                parts = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) < 6:  # not a ZAP request; a REP socket must still answer something
                self._zap.send_multipart([b"1.0", b"", b"500", b"malformed ZAP request", b"", b""])
                continue
            version, request_id, domain, address, _identity, mechanism = parts[:6]
            credentials = parts[6:]
            ok = (
                version == b"1.0"
                and domain == _ZAP_DOMAIN
                and mechanism == b"CURVE"
                and len(credentials) == 1
                and self._auth.allows(credentials[0])
            )
            if ok:
                user = z85_key(credentials[0])
                self.counters["auth_accepted"] += 1
                self._zap.send_multipart([b"1.0", request_id, b"200", b"OK", user, b""])
            else:
                self.counters["auth_denied"] += 1
                self._rlog(
                    logging.WARNING,
                    "zap",
                    "messenger %s: refused a %s connection from %s (client key not on the allow-list)",
                    self.name,
                    mechanism.decode("ascii", "replace")[:16],
                    address.decode("ascii", "replace")[:64],
                )
                self._zap.send_multipart([b"1.0", request_id, b"400", b"client key not allowed", b"", b""])

    def _drain_router(self) -> None:
        if self._auth is not None:
            self._drain_router_authenticated()
            return
        for _ in range(10_000):
            try:
                raw = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(raw) != 2:
                self._bad_multipart(len(raw))
                continue
            self._dispatch(Source(identity=raw[0]), raw[1])
            if not _readable(self._router):
                return  # drained: no zmq.Again raised (and built) per message

    def _drain_router_authenticated(self) -> None:
        # Frames (copy=False) carry the "User-Id" ZAP set: the client key the handshake proved.
        for _ in range(10_000):
            try:
                parts = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(parts) != 2:
                self._bad_multipart(len(parts))
                continue
            user = parts[1].get("User-Id")
            key = user.encode() if isinstance(user, str) and user else None
            self._dispatch(Source(identity=parts[0].bytes, peer_key=key), parts[1].bytes)
            if not _readable(self._router):
                return

    def _bad_multipart(self, parts: int) -> None:
        self.counters["bad_frames"] += 1
        self._rlog(
            logging.WARNING,
            "frames",
            "messenger %s: dropped a message with %d frames (expected 1)",
            self.name,
            parts - 1,
        )

    def _drain_dealer(self, d: _Dealer) -> None:
        for _ in range(10_000):
            try:
                frame = d.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(Source(endpoint=d.endpoint, peer_key=d.server_key), frame)
            if d.sock.closed or not _readable(d.sock):
                return  # drained (or a handler dropped this socket)

    def _dispatch(self, source: Source, frame: bytes) -> None:
        self.counters["received"] += 1
        try:
            msg = wire.decode(frame, self._max)
        except KvcoreError as exc:
            self.counters["bad_frames"] += 1
            self._rlog(
                logging.WARNING,
                "decode",
                "messenger %s: rejected a frame from %s: %s",
                self.name,
                source.endpoint or "a peer",
                exc,
            )
            if source.identity is not None:
                err = wire.ErrorReply(v=wire.PROTOCOL_VERSION, kind=type(exc).__name__, error=str(exc)[:4096])
                try:
                    self._router.send_multipart([source.identity, wire.encode(err)], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            if self._on_error is not None:
                try:
                    self._on_error(source, exc)
                except Exception:
                    self.counters["handler_errors"] += 1
                    self._rlog(
                        logging.ERROR, "on_error", "messenger %s: error handler failed", self.name, exc_info=True
                    )
            return
        try:
            self._handler(source, msg)
        except Exception:
            self.counters["handler_errors"] += 1
            self._rlog(
                logging.ERROR,
                "handler",
                "messenger %s: handler failed on %s",
                self.name,
                type(msg).__name__,
                exc_info=True,
            )
