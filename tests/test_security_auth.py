"""CurveZMQ authentication of the control plane with real sockets: who gets through, who is refused, what is kept."""

from __future__ import annotations

import os
import queue
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from kvcore.config import TransceiverConfig
from kvcore.control import wire
from kvcore.control.auth import AuthConfig, load_public_keys, raw_key, write_key_pair, z85_key
from kvcore.control.messenger import Messenger, Source
from kvcore.errors import ConfigError

V = wire.PROTOCOL_VERSION
SETTLE_S = 1.5  # long enough for a CURVE handshake (and its refusal) on a loaded 2-core machine


def _cancel(rid: int = 1) -> wire.Cancel:
    return wire.Cancel(v=V, request_id=rid, instance="x", rank=0)


class _Node:
    """A messenger and the queue its handler fills."""

    def __init__(self, name: str, auth: AuthConfig | None, **kw: object) -> None:
        self.got: queue.Queue[tuple[Source, wire.Message]] = queue.Queue()
        self.auth_failures: list[tuple[str, str]] = []
        self.m = Messenger(
            lambda s, m: self.got.put((s, m)),
            name=name,
            auth=auth,
            on_auth_failed=lambda ep, why: self.auth_failures.append((ep, why)),
            **kw,  # type: ignore[arg-type]
        )
        self.m.start()

    def nothing_arrives(self, wait: float = SETTLE_S) -> bool:
        try:
            self.got.get(timeout=wait)
        except queue.Empty:
            return True
        return False


@pytest.fixture
def nodes() -> Iterator[Callable[..., _Node]]:
    made: list[_Node] = []

    def make(name: str, auth: AuthConfig | None = None, **kw: object) -> _Node:
        n = _Node(name, auth, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.m.close()


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_listed_key_round_trip_and_the_source_names_the_proven_key(nodes: Callable[..., _Node]) -> None:
    a_keys, b_keys = AuthConfig.generate(), AuthConfig.generate()
    a_auth = AuthConfig(a_keys.public_key, a_keys.secret_key, frozenset({b_keys.public_key}))
    b_auth = AuthConfig(b_keys.public_key, b_keys.secret_key, frozenset({a_keys.public_key}))
    a, b = nodes("a", a_auth), nodes("b", b_auth)
    a.m.send(b.m.endpoint, _cancel(7), server_key=b_keys.public_key)
    src, msg = b.got.get(timeout=10)
    assert isinstance(msg, wire.Cancel) and msg.request_id == 7
    assert src.peer_key == a_keys.public_key  # the client key ZAP admitted, not a claim in the message
    b.m.reply(src, wire.ErrorReply(v=V, kind="SessionError", error="x", request_id=7))
    src2, reply = a.got.get(timeout=10)
    assert isinstance(reply, wire.ErrorReply) and src2.peer_key == b_keys.public_key
    assert b.m.counters["auth_accepted"] >= 1 and b.m.counters["auth_denied"] == 0


def test_one_shared_key_pair_needs_no_per_peer_key(nodes: Callable[..., _Node]) -> None:
    shared = AuthConfig.generate()
    a, b = nodes("a", shared), nodes("b", shared)
    a.m.send(b.m.endpoint, _cancel(3))
    assert b.got.get(timeout=10)[1] == _cancel(3)


def test_client_without_a_key_is_refused_before_any_decode(nodes: Callable[..., _Node]) -> None:
    server = nodes("server", AuthConfig.generate())
    stranger = nodes("stranger", None)
    stranger.m.send(server.m.endpoint, _cancel())
    stranger.m.send_raw(server.m.endpoint, b"\x91" * 2000 + b"\xc0")
    assert server.nothing_arrives()
    assert server.m.counters["received"] == 0  # not even decoded
    # A raw ZeroMQ client that speaks NULL security gets nothing either.
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(server.m.endpoint)
        s.send(wire.encode(_cancel()))
        assert server.nothing_arrives(0.5) and server.m.counters["received"] == 0
        s.close(0)
    finally:
        ctx.term()


def test_wrong_server_key_gets_nothing_through_and_the_socket_is_closed(nodes: Callable[..., _Node]) -> None:
    shared = AuthConfig.generate()
    server = nodes("server", shared)
    client = nodes("client", shared)
    impostor_key = AuthConfig.generate().public_key
    client.m.send(server.m.endpoint, _cancel(), server_key=impostor_key)
    assert server.nothing_arrives()
    assert server.m.counters["received"] == 0
    assert _wait(lambda: client.m.peer_count == 0), "the DEALER to a server that failed auth was kept open"
    assert client.m.counters["peer_auth_failed"] >= 1
    assert [ep for ep, _ in client.auth_failures][:1] == [server.m.endpoint]
    # The right key afterwards works: nothing was poisoned.
    client.m.send(server.m.endpoint, _cancel(9), server_key=shared.public_key)
    assert server.got.get(timeout=10)[1] == _cancel(9)


def test_unlisted_client_key_is_refused_by_zap_and_its_socket_closed(nodes: Callable[..., _Node]) -> None:
    server_auth = AuthConfig.generate()
    outsider = AuthConfig.generate()  # knows the server's public key, but is not on its allow-list
    server = nodes("server", server_auth)
    client = nodes("client", AuthConfig(outsider.public_key, outsider.secret_key, frozenset(), server_auth.public_key))
    client.m.send(server.m.endpoint, _cancel())
    assert server.nothing_arrives()
    assert server.m.counters["received"] == 0 and server.m.counters["auth_denied"] >= 1
    assert _wait(lambda: client.m.peer_count == 0)
    assert client.m.counters["peer_auth_failed"] >= 1


def test_messengers_with_different_allow_lists_in_one_process_do_not_interfere(nodes: Callable[..., _Node]) -> None:
    x, y = AuthConfig.generate(), AuthConfig.generate()
    a_keys, b_keys = AuthConfig.generate(), AuthConfig.generate()
    a = nodes("a", AuthConfig(a_keys.public_key, a_keys.secret_key, frozenset({x.public_key})))
    b = nodes("b", AuthConfig(b_keys.public_key, b_keys.secret_key, frozenset({y.public_key})))
    cx, cy = nodes("cx", x), nodes("cy", y)
    cx.m.send(a.m.endpoint, _cancel(1), server_key=a_keys.public_key)
    cy.m.send(b.m.endpoint, _cancel(2), server_key=b_keys.public_key)
    cx.m.send(b.m.endpoint, _cancel(3), server_key=b_keys.public_key)
    cy.m.send(a.m.endpoint, _cancel(4), server_key=a_keys.public_key)
    assert a.got.get(timeout=10)[1] == _cancel(1)
    assert b.got.get(timeout=10)[1] == _cancel(2)
    assert a.nothing_arrives() and b.nothing_arrives(0.2)
    assert a.m.counters["auth_denied"] >= 1 and b.m.counters["auth_denied"] >= 1


def test_a_stranger_cannot_make_the_messenger_keep_sockets_open(nodes: Callable[..., _Node]) -> None:
    """Endpoints a peer names (registrations) cost one socket each only until they fail auth; and never above the cap."""
    me = AuthConfig.generate()
    victim = nodes("victim", me, max_peer_sockets=8)
    # Listeners that are not us (other keys): every handshake fails.
    strangers = [nodes(f"s{i}", AuthConfig.generate()) for i in range(5)]
    for s in strangers:
        victim.m.send(s.m.endpoint, _cancel())
    assert _wait(lambda: victim.m.peer_count == 0), f"{victim.m.peer_count} sockets kept to strangers"
    # Endpoints where nothing listens: bounded by max_peer_sockets.
    for port in range(1, 40):
        victim.m.send(f"tcp://127.0.0.1:{port}", _cancel())
    assert _wait(lambda: victim.m.counters["sent"] >= 44)
    assert victim.m.peer_count <= 8 and victim.m.counters["peer_sockets_evicted"] >= 31
    assert all(s.nothing_arrives(0.05) for s in strangers)


def test_non_loopback_bind_with_auth_is_allowed(nodes: Callable[..., _Node]) -> None:
    n = nodes("any", AuthConfig.generate(), host="0.0.0.0")
    assert wire.parse_endpoint(n.m.bound_endpoint)[0] == "0.0.0.0"  # bound on every address ...
    assert wire.parse_endpoint(n.m.endpoint)[0] != "0.0.0.0"  # ... and never advertised as the wildcard


def test_config_refuses_non_loopback_without_auth_and_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"auth_key_file.*allow_insecure_bind"):
        TransceiverConfig(host="0.0.0.0")
    assert TransceiverConfig(host="0.0.0.0", allow_insecure_bind=True).allow_insecure_bind
    assert TransceiverConfig.load(env={"KVCORE_HOST": "10.0.0.1", "KVCORE_ALLOW_INSECURE_BIND": "1"}).host == "10.0.0.1"


def test_auth_config_from_files_env_and_keygen(tmp_path: Path) -> None:
    pub, sec = write_key_pair(tmp_path / "keys", "ctx0")
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    write_key_pair(tmp_path / "allowed", "gen0")
    write_key_pair(tmp_path / "allowed", "gen1")
    with pytest.raises(ConfigError, match="already exists"):
        write_key_pair(tmp_path / "keys", "ctx0")
    cfg = TransceiverConfig.load(
        env={"KVCORE_AUTH_KEY_FILE": str(sec), "KVCORE_AUTH_ALLOWED_KEYS_DIR": str(tmp_path / "allowed")}
    )
    auth = AuthConfig.from_config(cfg)
    assert auth is not None
    public, secret = zmq.auth.load_certificate(sec)
    assert auth.public_key == public and auth.secret_key == secret
    assert auth.allowed_client_keys == load_public_keys(tmp_path / "allowed") | {public}
    assert len(auth.allowed_client_keys) == 3
    assert secret.decode() not in repr(auth) and secret.decode() not in repr(cfg)
    # From the environment alone: a Z85 secret key and a comma-separated allow-list.
    other = AuthConfig.generate()
    env_cfg = TransceiverConfig.load(
        env={"KVCORE_AUTH_SECRET_KEY": secret.decode(), "KVCORE_AUTH_ALLOWED_KEYS": other.public_key.decode() + ", "}
    )
    env_auth = AuthConfig.from_config(env_cfg)
    assert env_auth is not None and env_auth.public_key == public and env_auth.allows(raw_key(other.public_key))
    assert AuthConfig.from_config(TransceiverConfig(auth_mode="none")) is None
    with pytest.raises(ConfigError, match="holds no secret-key"):
        AuthConfig.from_files(pub)
    with pytest.raises(ConfigError, match="no own key"):
        AuthConfig.from_config(TransceiverConfig(auth_allowed_keys=[other.public_key.decode()]))
    with pytest.raises(ConfigError, match="CurveZMQ key"):
        z85_key("too-short")


def test_keygen_cli_writes_a_pair_and_prints_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcore.tools.cli import main

    assert main(["keygen", "--dir", str(tmp_path), "--name", "rank0"]) == 0
    out = capsys.readouterr().out
    sec = tmp_path / "rank0.key_secret"
    assert stat.S_IMODE(os.stat(sec).st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(sec)
    assert f'auth_key_file = "{sec}"' in out and public.decode() in out
    assert secret.decode() not in out  # the secret never goes to the terminal
    assert main(["keygen", "--dir", str(tmp_path), "--name", "rank0"]) == 1  # never overwrites


def test_the_proven_key_can_be_checked_against_a_claimed_rank_info_key(nodes: Callable[..., _Node]) -> None:
    from kvcore.control.auth import keys_equal

    shared = AuthConfig.generate()
    a, b = nodes("a", shared), nodes("b", shared)
    a.m.send(b.m.endpoint, _cancel())
    src, _ = b.got.get(timeout=10)
    assert keys_equal(src.peer_key, shared.public_key_raw)  # raw (RankInfo) against Z85 (Source)
    assert not keys_equal(src.peer_key, AuthConfig.generate().public_key_raw)
    assert not keys_equal(None, shared.public_key) and not keys_equal(b"junk", b"junk")


def test_callbacks_that_raise_do_not_stop_the_io_thread(nodes: Callable[..., _Node]) -> None:
    """on_disconnect and on_auth_failed run on the I/O thread: their exceptions are counted and the loop goes on."""

    def boom(*_: object) -> None:
        raise RuntimeError("callback bug")

    shared = AuthConfig.generate()
    server = nodes("server", shared)
    client = Messenger(lambda s, m: None, name="client", auth=shared, on_disconnect=boom, on_auth_failed=boom)
    client.start()
    try:
        client.send(server.m.endpoint, _cancel(), server_key=AuthConfig.generate().public_key)  # fails auth
        assert _wait(lambda: client.counters["monitor_errors"] >= 1)
        other = nodes("other", shared)
        client.send(other.m.endpoint, _cancel(1))
        assert other.got.get(timeout=10)[1] == _cancel(1)
        other.m.close()  # the peer goes away: on_disconnect raises too
        assert _wait(lambda: client.counters["monitor_errors"] >= 2)
        client.send(server.m.endpoint, _cancel(2), server_key=shared.public_key)
        assert server.got.get(timeout=10)[1] == _cancel(2)
        assert client.alive and client.counters["io_errors"] == 0
    finally:
        client.close()
