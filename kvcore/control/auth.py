"""Control-plane authentication: CurveZMQ key pairs and the allow-list of client keys a messenger accepts.

With an ``AuthConfig`` a ``Messenger``'s ROUTER is a CURVE server: a client
completes the handshake only if it knows the server's public key, and the
messenger's own ZAP handler admits it only if its public key is on the
allow-list. Both happen inside libzmq before a single frame reaches kvcore's
decoder. DEALERs connect as CURVE clients with the same key pair.

Keys come from zmq certificate files (``zmq.auth.create_certificates``,
``kvcore keygen``) or from Z85 strings (environment variables). A deployment
may share one key pair among all its ranks (the own public key is always on
the allow-list, and it is the default server key of every peer) or give each
rank its own pair and list the others' public keys.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvcore.errors import ConfigError
from kvcore.hostinfo import is_loopback_host

if TYPE_CHECKING:
    from kvcore.config import TransceiverConfig

__all__ = [
    "AuthConfig",
    "is_loopback_host",
    "z85_key",
    "raw_key",
    "load_public_keys",
    "write_key_pair",
    "keys_equal",
    "local_key_dir",
    "local_auth",
]

log = logging.getLogger("kvcore.auth")

#: A CurveZMQ key: 32 raw bytes, 40 characters in Z85.
KEY_BYTES = 32
Z85_KEY_CHARS = 40


def z85_key(key: bytes | str, what: str = "key") -> bytes:
    """A CurveZMQ key as 40 Z85 bytes, from 40 Z85 characters or 32 raw bytes; ``ConfigError`` otherwise."""
    from zmq.utils import z85

    if isinstance(key, str):
        key = key.strip().encode("ascii", "replace")
    if len(key) == KEY_BYTES:
        return z85.encode(key)
    if len(key) == Z85_KEY_CHARS:
        try:
            if len(z85.decode(key)) == KEY_BYTES:
                return bytes(key)
        except (ValueError, KeyError, IndexError, TypeError):
            pass
    raise ConfigError(f"{what}: expected a CurveZMQ key (40 Z85 characters or 32 bytes), got {len(key)} bytes")


def raw_key(key: bytes | str, what: str = "key") -> bytes:
    """A CurveZMQ key as its 32 raw bytes (what ``RankInfo.curve_public_key`` carries)."""
    from zmq.utils import z85

    return bytes(z85.decode(z85_key(key, what)))


def keys_equal(a: bytes | str | None, b: bytes | str | None) -> bool:
    """Whether two CurveZMQ keys (raw or Z85, either form) are the same key; False if either is missing or malformed.

    For the transceiver: a ``RankInfo.curve_public_key`` (raw) claimed in a
    registration must equal ``Source.peer_key`` (Z85), the key the handshake proved.
    """
    if not a or not b:
        return False
    try:
        return z85_key(a) == z85_key(b)
    except ConfigError:
        return False


def _load_certificate(path: Path) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CurveZMQ certificate {str(path)!r}: {exc}") from exc
    if not public:
        raise ConfigError(f"CurveZMQ certificate {str(path)!r} holds no public-key")
    return z85_key(public, f"public-key in {path}"), (z85_key(secret, f"secret-key in {path}") if secret else None)


def load_public_keys(directory: str | os.PathLike[str]) -> frozenset[bytes]:
    """Every public key in the ``*.key`` certificate files of ``directory`` (Z85); ``ConfigError`` if none."""
    path = Path(directory)
    if not path.is_dir():
        raise ConfigError(f"auth_allowed_keys_dir: {str(path)!r} is not a directory")
    keys = frozenset(_load_certificate(p)[0] for p in sorted(path.glob("*.key")) if p.is_file())
    if not keys:
        raise ConfigError(f"auth_allowed_keys_dir: {str(path)!r} holds no *.key certificate file")
    return keys


@dataclass(frozen=True)
class AuthConfig:
    """This messenger's CurveZMQ key pair, the client keys it admits, and the server key it expects of peers.

    ``allowed_client_keys`` always includes the own public key (ranks sharing a
    key pair reach each other). ``default_server_key`` is the key a DEALER
    expects of a peer endpoint nobody told it about (``Messenger.set_peer_key``);
    ``None`` means the own public key: one key pair for the whole deployment.
    All keys are Z85 (40 bytes); the secret never appears in ``repr``.
    """

    public_key: bytes
    secret_key: bytes = field(repr=False)
    allowed_client_keys: frozenset[bytes] = frozenset()
    default_server_key: bytes | None = None

    def __post_init__(self) -> None:
        import zmq

        object.__setattr__(self, "public_key", z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", z85_key(self.secret_key, "secret_key"))
        if zmq.curve_public(self.secret_key) != self.public_key:
            raise ConfigError("secret_key does not belong to public_key (zmq.curve_public differs)")
        allowed = frozenset(z85_key(k, "allowed client key") for k in self.allowed_client_keys)
        object.__setattr__(self, "allowed_client_keys", allowed | {self.public_key})
        if self.default_server_key is not None:
            object.__setattr__(self, "default_server_key", z85_key(self.default_server_key, "default_server_key"))

    @property
    def server_key(self) -> bytes:
        """The server key a DEALER uses for an endpoint with no key of its own."""
        return self.default_server_key or self.public_key

    @property
    def public_key_raw(self) -> bytes:
        """The own public key as 32 raw bytes (for ``RankInfo.curve_public_key``)."""
        return raw_key(self.public_key)

    def allows(self, client_key: bytes) -> bool:
        """Whether a client presenting ``client_key`` (raw or Z85) may connect."""
        try:
            return z85_key(client_key) in self.allowed_client_keys
        except ConfigError:
            return False

    @classmethod
    def generate(cls, allowed_client_keys: frozenset[bytes] = frozenset()) -> AuthConfig:
        """A fresh random key pair (tests, one-off deployments)."""
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public, secret, allowed_client_keys)

    @classmethod
    def from_secret_key(
        cls,
        secret_key: bytes | str,
        allowed_client_keys: frozenset[bytes] = frozenset(),
        default_server_key: bytes | str | None = None,
    ) -> AuthConfig:
        """From a Z85 secret key alone (the public key is derived from it)."""
        import zmq

        secret = z85_key(secret_key, "auth_secret_key")
        server = None if not default_server_key else z85_key(default_server_key, "auth_server_key")
        return cls(zmq.curve_public(secret), secret, allowed_client_keys, server)

    @classmethod
    def from_files(
        cls,
        key_file: str | os.PathLike[str],
        allowed_keys_dir: str | os.PathLike[str] | None = None,
        default_server_key: bytes | str | None = None,
    ) -> AuthConfig:
        """From a secret certificate file (``*.key_secret``) and optionally a directory of allowed ``*.key`` files."""
        path = Path(key_file)
        public, secret = _load_certificate(path)
        if secret is None:
            raise ConfigError(
                f"auth_key_file: {str(path)!r} holds no secret-key; give the *.key_secret file, not the public *.key"
            )
        allowed = load_public_keys(allowed_keys_dir) if allowed_keys_dir else frozenset()
        server = None if not default_server_key else z85_key(default_server_key, "auth_server_key")
        return cls(public, secret, allowed, server)

    @classmethod
    def from_config(cls, config: TransceiverConfig) -> AuthConfig | None:
        """The ``AuthConfig`` a transceiver configuration describes, or None for no authentication.

        ``auth_mode="auto"`` (the default): the configured key if there is one; otherwise, on a loopback host, this
        uid's local key (``local_auth``), so that processes of other users are refused; otherwise (a non-loopback
        host that ``allow_insecure_bind`` accepted) none. ``auth_mode="none"``: none, whatever else is set.
        """
        configured = bool(config.auth_key_file or config.auth_secret_key)
        if config.auth_mode == "none":
            if configured:
                raise ConfigError("auth_mode is 'none' but an own key is configured (auth_key_file/auth_secret_key)")
            return None
        if not configured:
            if config.auth_allowed_keys_dir or config.auth_allowed_keys or config.auth_server_key:
                raise ConfigError(
                    "auth_allowed_keys_dir/auth_allowed_keys/auth_server_key are set but no own key is: "
                    "set auth_key_file (a *.key_secret file from `kvcore keygen`) or auth_secret_key"
                )
            if is_loopback_host(str(config.host)):
                return local_auth(local_key_dir(config.auth_local_dir))
            return None
        if config.auth_key_file and config.auth_secret_key:
            raise ConfigError("set either auth_key_file or auth_secret_key, not both")
        listed = frozenset(z85_key(k, "auth_allowed_keys entry") for k in config.auth_allowed_keys)
        if config.auth_key_file:
            auth = cls.from_files(config.auth_key_file, config.auth_allowed_keys_dir or None, config.auth_server_key)
        else:
            from_dir = load_public_keys(config.auth_allowed_keys_dir) if config.auth_allowed_keys_dir else frozenset()
            auth = cls.from_secret_key(config.auth_secret_key, from_dir, config.auth_server_key or None)
        if listed:
            auth = cls(auth.public_key, auth.secret_key, auth.allowed_client_keys | listed, auth.default_server_key)
        return auth


def write_key_pair(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public, mode 0644) and ``name.key_secret`` (mode 0600) into ``directory``.

    The files use zmq's certificate format (``zmq.auth.load_certificate`` reads
    them). Existing files are never overwritten (``ConfigError``).
    """
    import zmq

    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = out / f"{name}.key", out / f"{name}.key_secret"
    for p in (pub_path, sec_path):
        if p.exists():
            raise ConfigError(f"{str(p)!r} already exists; remove it or choose another name")
    header = "#   ****  Generated by kvcore keygen  ****\n#   ZeroMQ CURVE {kind}\n#   THIS FILE IS FOR {use}\n"
    body = 'metadata\ncurve\n    public-key = "{public}"\n'
    pub_text = header.format(kind="Public Certificate", use="DISTRIBUTION TO PEERS") + body.format(
        public=public.decode()
    )
    sec_text = (
        header.format(kind="**Secret** Certificate", use="THIS RANK ONLY: DO NOT PROVIDE TO OTHER PARTIES")
        + body.format(public=public.decode())
        + f'    secret-key = "{secret.decode()}"\n'
    )
    # O_EXCL with mode 0600 from the start: the secret is never readable by others, not even briefly.
    fd = os.open(sec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(sec_text)
    fd = os.open(pub_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(pub_text)
    return pub_path, sec_path


LOCAL_KEY_NAME = "local"


def local_key_dir(configured: str = "") -> Path:
    """Where this uid's local key lives: ``configured``, else ``$KVCORE_STATE_DIR``, else ``~/.local/state/kvcore``."""
    if configured:
        return Path(configured)
    env = os.environ.get("KVCORE_STATE_DIR", "")
    if env:
        return Path(env)
    try:
        home = Path.home()
    except (KeyError, RuntimeError) as exc:
        raise ConfigError(
            f"no home directory for uid {os.getuid()} to keep the local authentication key in ({exc}); set "
            "auth_local_dir (KVCORE_AUTH_LOCAL_DIR) or KVCORE_STATE_DIR, or configure a key (docs/security.md)"
        ) from None
    return home / ".local" / "state" / "kvcore"


def _check_private(st: os.stat_result, path: Path, kind: str) -> None:
    """``ConfigError`` unless ``path`` (``st``: its lstat) is a ``kind`` of this uid that no other user can access."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        raise ConfigError(f"local authentication key: {str(path)!r} is not a {kind} (a link or another file type?)")
    if st.st_uid != os.getuid():
        raise ConfigError(
            f"local authentication key: {str(path)!r} belongs to uid {st.st_uid}, not to this process's uid "
            f"{os.getuid()}; it cannot prove who we are"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"local authentication key: {str(path)!r} has mode {stat.S_IMODE(st.st_mode):o}: other users could "
            f"read it; `chmod {'700' if kind == 'directory' else '600'}` it (or remove it to have a new one made)"
        )


def local_auth(directory: str | os.PathLike[str]) -> AuthConfig:
    """This uid's own key pair on this host, made on first use: instances of one user admit each other only.

    The secret lives in ``directory/local.key_secret`` (directory mode 0700, file mode 0600, both owned by this
    uid; anything else is a ``ConfigError``, never a silent weaker key). Every instance of the uid serves and
    connects with the same pair, so no set-up is needed and another uid, which cannot read the file, can neither
    connect to their control ports nor pose as one of them. Processes racing to make it agree on one file (it is
    written aside and hard-linked into place, so a reader never sees half of it).
    """
    import zmq

    d = Path(directory)
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(os.lstat(d), d, "directory")
        path = d / f"{LOCAL_KEY_NAME}.key_secret"
        if not os.path.lexists(path):
            public, secret = zmq.curve_keypair()
            text = (
                "#   ****  Generated by kvcore: this user's local authentication key  ****\n"
                "#   ZeroMQ CURVE **Secret** Certificate\n#   THIS USER ONLY: DO NOT PROVIDE TO OTHER PARTIES\n"
                f'metadata\ncurve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n'
            )
            tmp = d / f".{LOCAL_KEY_NAME}.{os.getpid()}.{os.urandom(4).hex()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                try:
                    os.link(tmp, path)
                    log.info("kvcore made this user's local authentication key: %s", path)
                except FileExistsError:
                    pass  # another process made it first: use theirs
            finally:
                os.unlink(tmp)
        _check_private(os.lstat(path), path, "file")
    except OSError as exc:
        raise ConfigError(
            f"local authentication key in {str(d)!r}: {exc}; set auth_local_dir (KVCORE_AUTH_LOCAL_DIR) to a "
            "private directory, configure a key (docs/security.md), or turn authentication off (auth_mode='none')"
        ) from exc
    public, own_secret = _load_certificate(path)
    if own_secret is None:
        raise ConfigError(f"local authentication key: {str(path)!r} holds no secret-key; remove it to have one made")
    return AuthConfig(public, own_secret)
