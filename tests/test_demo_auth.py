"""``kvcore demo --auth`` pieces: the temporary instance keys, and a generation instance nobody allow-listed.

The refused instance runs in its own process through the public Transceiver
API (tests/_instances.py) against a context instance configured exactly as
the demo configures it (:func:`kvcore.tools.demo.instance_keys`).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from _instances import ContextProcess, GenerationProcess

from kvcore.control.auth import AuthConfig, write_key_pair
from kvcore.tools.demo import instance_keys


def test_instance_keys_are_private_listed_and_removed() -> None:
    with instance_keys() as keys:
        keydir = Path(keys["context"]["auth_allowed_keys_dir"])
        assert stat.S_IMODE(keydir.stat().st_mode) == 0o700
        for role in ("context", "generation"):
            secret = Path(keys[role]["auth_key_file"])
            assert secret.parent == keydir and stat.S_IMODE(secret.stat().st_mode) == 0o600
        assert keys["generation"]["auth_allowed_keys_dir"] == str(keydir)
        ctx = AuthConfig.from_files(keys["context"]["auth_key_file"], keydir)
        gen = AuthConfig.from_files(keys["generation"]["auth_key_file"], keydir, keys["generation"]["auth_server_key"])
        assert ctx.public_key != gen.public_key  # one pair per instance: the allow-list decides
        assert ctx.allowed_client_keys == gen.allowed_client_keys == {ctx.public_key, gen.public_key}
        assert gen.server_key == ctx.public_key
    assert not keydir.exists()


def test_instance_keys_are_removed_after_a_failure() -> None:
    try:
        with instance_keys() as keys:
            keydir = Path(keys["context"]["auth_allowed_keys_dir"])
            raise RuntimeError("the demo failed")
    except RuntimeError:
        pass
    assert not keydir.exists()


def test_generation_instance_not_allow_listed_gets_a_typed_error_and_no_byte(tmp_path: Path) -> None:
    """A stranger that knows the context's public key (it is public) but is not listed: refused, nothing written."""
    timeout = 60.0
    blocks = list(range(4))
    with instance_keys() as keys:
        _, stranger_secret = write_key_pair(tmp_path, "stranger")
        stranger = {
            "auth_key_file": str(stranger_secret),
            "auth_server_key": keys["generation"]["auth_server_key"],
        }
        ctx = ContextProcess(timeout=60.0, config=keys["context"])
        gen = GenerationProcess(timeout=timeout, config=stranger)
        legit = None
        try:
            ctx.send(1, blocks)
            t0 = time.monotonic()
            gen.receive(1, ctx.endpoint, blocks)
            outcome = gen.wait_released(1, timeout=timeout + 60)  # a bound, not a performance claim
            elapsed = time.monotonic() - t0
            # The handshake fails (ZAP refuses the key): the instance is refused at once, the request fails with
            # an error naming the authentication failure, not at request_timeout_s.
            assert outcome["state"] == "FAILED", outcome
            assert str(outcome["error"]).startswith("IncompatiblePeerError"), outcome
            assert "authentication" in str(outcome["error"]), outcome
            assert elapsed < timeout / 2, f"refused only after {elapsed:.1f}s"
            print(f"refused after {elapsed:.2f} s: {outcome['state']} {outcome['error']}")
            got = gen.read(blocks)
            assert got == bytes(len(got))  # no byte reached the stranger's pool
            cstats = ctx.stats()
            assert cstats["remote_agents"] == 0, cstats  # the stranger never registered: nothing to write to
            # The context instance is unharmed: the listed generation instance gets request 1 afterwards.
            legit = GenerationProcess(timeout=60.0, config=keys["generation"])
            legit.receive(1, ctx.endpoint, blocks)
            assert legit.wait_released(1, timeout=120)["state"] == "DONE"
            assert ctx.wait_released(1, timeout=120)["state"] == "DONE"
            got = legit.read(blocks)
            assert got == _expected(1, blocks, len(got) // len(blocks))
        finally:
            for p in (gen, legit, ctx):
                if p is not None:
                    p.close()
    assert not os.path.exists(keys["context"]["auth_allowed_keys_dir"])


def _expected(rid: int, blocks: list[int], nbytes_per_block: int) -> bytes:
    from _instances import fill_value

    return fill_value(rid, blocks, nbytes_per_block).tobytes()
