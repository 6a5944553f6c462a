"""kvcore-mooncake beyond the contract suite: options, the missing-library error, names, batches, the baseline.

Engines are real (``mooncake.engine.TransferEngine`` over TCP on loopback); peers that must die are real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution

import msgspec
import numpy as np
import pytest

try:
    distribution("kvcore-mooncake")
except PackageNotFoundError:  # only an absent plugin skips; a broken Mooncake install fails the tests
    pytest.skip("kvcore-mooncake is not installed (make install)", allow_module_level=True)

from kvcore_mooncake import syslibs
from kvcore_mooncake.agent import MooncakeAgent, MooncakeOptions, engine_settings, options_from_env

from kvcore.errors import ConfigError, PeerLostError, RemoteAgentError
from kvcore.testing.harness import PeerProcess, pattern
from kvcore.transport.agent import MemoryRegion, TransferAgent, TransferOp
from kvcore.transport.baselines import BaselinePlan

MiB = 1024 * 1024


@pytest.fixture
def pair() -> Iterator[tuple[MooncakeAgent, MooncakeAgent]]:
    a, b = MooncakeAgent(f"a-{uuid.uuid4().hex[:6]}"), MooncakeAgent(f"b-{uuid.uuid4().hex[:6]}")
    yield a, b
    a.close()
    b.close()


def _buffer(agent: MooncakeAgent, data: np.ndarray) -> np.ndarray:
    buf = data.copy()
    agent.register_memory(MemoryRegion(buf.ctypes.data, buf.nbytes))
    return buf


def _forged(real: bytes, **changes: object) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(TransferAgent.decode_descriptor(real), **changes))


# --- options ---------------------------------------------------------------------------------------


def test_options_are_typed_and_a_bad_one_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"mooncake agent.*protocol"):
        MooncakeAgent("x", {"protocol": "udp"})
    with pytest.raises(ConfigError, match="max_queued_transfers_per_peer"):
        MooncakeAgent("x", {"max_queued_transfers_per_peer": 65536})  # 0.3.13 ignores it silently above 65535
    with pytest.raises(ConfigError, match="bind_adress"):
        MooncakeAgent("x", {"bind_adress": "127.0.0.1"})


def test_queue_depths_timeout_and_log_level_become_the_engines_settings() -> None:
    got = engine_settings(MooncakeOptions(), env={})
    assert got == {
        "MC_TRANSFER_TIMEOUT": "30",
        "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "16384",
        "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16384",
        "MC_LOG_LEVEL": "WARNING",
    }
    env = {"MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "2048", "MC_LOG_LEVEL": "INFO"}
    mine = engine_settings(MooncakeOptions(max_pending_admissions_per_peer=99, engine_env={"MC_X": "1"}), env=env)
    assert "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER" not in mine and "MC_LOG_LEVEL" not in mine  # the user's stand
    assert mine["MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"] == "99" and mine["MC_X"] == "1"


def test_a_field_the_mapping_lacks_comes_from_its_environment_variable() -> None:
    env = {"KVCORE_MOONCAKE_BIND_ADDRESS": "auto", "KVCORE_MOONCAKE_SUBMIT_THREADS": "3"}
    assert options_from_env({"submit_threads": 1}, env) == {"submit_threads": 1, "bind_address": "auto"}
    with pytest.raises(ConfigError, match="KVCORE_MOONCAKE_BATCH_ENTRIES"):
        options_from_env({}, {"KVCORE_MOONCAKE_BATCH_ENTRIES": "many"})


# --- the system libraries ------------------------------------------------------------------------


def test_a_missing_library_is_named_with_its_package() -> None:
    absent = syslibs.missing({"libkvcore-no-such.so.7": "libkvcore-no-such7", "libibverbs.so.1": "libibverbs1"})
    assert [(s, p) for s, p, _ in absent] == [("libkvcore-no-such.so.7", "libkvcore-no-such7")]
    text = syslibs.describe_missing(absent)
    assert "libkvcore-no-such.so.7 (Debian package libkvcore-no-such7)" in text
    assert "apt-get install -y libkvcore-no-such7" in text


def test_kvcore_plugins_names_the_missing_library_instead_of_a_traceback() -> None:
    """libibverbs.so.1 hidden in a private mount namespace: the plugin is listed failed, the library named."""
    lib = next(
        (
            p
            for p in ("/usr/lib/x86_64-linux-gnu/libibverbs.so.1", "/lib/x86_64-linux-gnu/libibverbs.so.1")
            if os.path.exists(p)
        ),
        "",
    )
    unshare, kvcore = shutil.which("unshare"), shutil.which("kvcore")
    if unshare is None or kvcore is None or not lib:
        pytest.skip("needs unshare, the kvcore script and the system's libibverbs.so.1")
    probe = subprocess.run([unshare, "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespaces here: {probe.stderr.decode().strip()}")
    script = f"mount --bind /dev/null {lib} && exec {kvcore} plugins --json"
    p = subprocess.run([unshare, "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rec = next(r for r in json.loads(p.stdout) if r["name"] == "mooncake")
    assert rec["status"] == "failed" and rec["phase"] == "import"
    assert "libibverbs.so.1 (Debian package libibverbs1)" in rec["error"], rec["error"]
    assert "Traceback" not in p.stderr, p.stderr


# --- transfers -----------------------------------------------------------------------------------


def test_a_batch_longer_than_batch_entries_runs_in_turn_and_notifies_once_after_it() -> None:
    n, frag = 4096, 4096
    a, b = MooncakeAgent("split-a", {"batch_entries": 1000}), MooncakeAgent("split-b")
    try:
        src = _buffer(a, pattern(21, n * frag))
        dst = _buffer(b, np.zeros(2 * n * frag, dtype=np.uint8))
        b.load_remote_agent(a.descriptor())
        peer = a.load_remote_agent(b.descriptor())
        slots = np.random.default_rng(21).permutation(2 * n)[:n].astype(np.uint64)  # nothing merges
        note = bytes(range(256)) * 4  # every byte value survives Mooncake's string notifications
        h = a.submit(
            TransferOp.WRITE,
            peer,
            src.ctypes.data + np.arange(n, dtype=np.uint64) * frag,
            dst.ctypes.data + slots * frag,
            np.full(n, frag, dtype=np.uint64),
            notification=note,
        )
        a.wait(h, timeout=30)
        assert h.native.batches == 5  # 4096 fragments in batches of 1000
        a.release(h)
        expected = np.zeros((2 * n, frag), dtype=np.uint8)
        expected[slots.astype(np.int64)] = pattern(21, n * frag).reshape(n, frag)
        assert np.array_equal(dst.reshape(2 * n, frag), expected)
        got = []
        for _ in range(200):
            got += b.get_notifications()
            if got:
                break
            time.sleep(0.01)
        assert [(x.remote, x.message) for x in got] == [("split-a", note)]
    finally:
        a.close()
        b.close()


def test_a_peer_on_another_host_offering_only_loopback_is_refused_clearly(pair: tuple[MooncakeAgent, ...]) -> None:
    a, b = pair
    desc = TransferAgent.decode_descriptor(b.descriptor())
    payload = msgspec.msgpack.decode(desc.payload)
    payload[6] = "another-host"  # host_identity
    with pytest.raises(RemoteAgentError, match=r"bind_address.*auto"):
        a.load_remote_agent(_forged(b.descriptor(), payload=msgspec.msgpack.encode(payload)))
    assert a.remote_agents == ()


# --- names ---------------------------------------------------------------------------------------


def test_no_agent_loads_itself_and_no_other_engine_takes_a_loaded_name(pair: tuple[MooncakeAgent, ...]) -> None:
    a, b = pair
    with pytest.raises(RemoteAgentError, match="own"):
        a.load_remote_agent(a.descriptor())
    peer = a.load_remote_agent(b.descriptor())
    impostor = MooncakeAgent(b.name)  # the same process and name, another engine
    try:
        with pytest.raises(RemoteAgentError, match="already loaded"):
            a.load_remote_agent(impostor.descriptor())
    finally:
        impostor.close()
    assert a.remote(peer).native.engine_id == b._engine_id


def test_a_killed_peer_is_peer_lost_and_its_name_is_free_again() -> None:
    name = f"victim-{uuid.uuid4().hex[:6]}"
    agent = MooncakeAgent("survivor")
    first = PeerProcess("mooncake", {}, name=name)
    second: PeerProcess | None = None
    try:
        src = _buffer(agent, pattern(22, MiB))
        dst = first.call("alloc", key="k", nbytes=MiB)["address"]
        first.call("load", descriptor=agent.descriptor())
        peer = agent.load_remote_agent(first.call("descriptor")["descriptor"])
        first.kill()
        with pytest.raises(PeerLostError):
            h = agent.submit(TransferOp.WRITE, peer, [src.ctypes.data], [dst], [MiB])
            agent.wait(h, timeout=15)
        second = PeerProcess("mooncake", {}, name=name)  # a restart under the same name
        dst2 = second.call("alloc", key="k", nbytes=MiB)["address"]
        second.call("load", descriptor=agent.descriptor())
        assert agent.load_remote_agent(second.call("descriptor")["descriptor"]) == name
        h = agent.submit(TransferOp.WRITE, name, [src.ctypes.data], [dst2], [MiB])
        agent.wait(h, timeout=15)
        agent.release(h)
        assert np.array_equal(np.frombuffer(second.call("read", key="k")["data"], np.uint8), pattern(22, MiB))
    finally:
        agent.close()
        first.close()
        if second is not None:
            second.close()


# --- the bench baseline ----------------------------------------------------------------------------


def test_bare_mooncake_baseline_moves_the_plan_byte_for_byte(pair: tuple[MooncakeAgent, ...]) -> None:
    from kvcore.extension.plugins import make_plugin_manager

    _, b = pair
    n, frag = 512, 16 * 1024
    pool = pattern(23, n * frag).copy()
    dst = _buffer(b, np.zeros(n * frag, dtype=np.uint8))
    order = np.random.default_rng(23).permutation(n).astype(np.uint64)
    plan = BaselinePlan(
        pool.ctypes.data + np.arange(n, dtype=np.uint64) * frag,
        dst.ctypes.data + order * frag,
        np.full(n, frag, dtype=np.uint64),
        pool.ctypes.data,
        pool.nbytes,
        b.descriptor(),
        {},
        30.0,
    )
    registry = make_plugin_manager().registries.bench_baselines
    assert registry.matrix_mode("mooncake") == "mooncake_batch"
    base = registry.get("mooncake_batch")(plan)
    try:
        seconds, submit = base.once()
        assert seconds > 0 and submit == seconds
    finally:
        base.close()
    expected = np.zeros((n, frag), dtype=np.uint8)
    expected[order.astype(np.int64)] = pool.reshape(n, frag)
    assert np.array_equal(dst.reshape(n, frag), expected)


def test_every_option_is_documented_in_the_readme() -> None:
    """``MooncakeOptions`` is the one statement of the options; the README names every field."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = [f.name for f in msgspec.structs.fields(MooncakeOptions) if f"| `{f.name}` |" not in text]
    assert missing == [], f"plugins/mooncake/README.md does not document options {missing}"
