"""The nixl agent's lanes: one NIXL agent per UCX error-handling mode, chosen per peer from the host identities.

Peers on another host are exercised for real in ``tests/test_two_hosts.py`` (namespaced hosts); here two
agents share this process, so they are on one host, and descriptors are re-encoded to claim another.
"""

from __future__ import annotations

import msgspec
import pytest
from kvcore_nixl.agent import CROSS_HOST, SAME_HOST, NixlAgent, decode_payload, load_nixl

from kvcore.errors import ConfigError, RemoteAgentError
from kvcore.hostinfo import host_identity
from kvcore.transport.agent import TransferAgent

try:
    load_nixl()
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"nixl is not importable: {exc}", allow_module_level=True)


def _claim_host(descriptor: bytes, identity: str) -> bytes:
    """The same descriptor with its payload claiming another host identity."""
    desc = TransferAgent.decode_descriptor(descriptor)
    payload = decode_payload(descriptor)
    fake = msgspec.structs.replace(payload, host_identity=identity)
    return msgspec.msgpack.encode(msgspec.structs.replace(desc, payload=msgspec.msgpack.encode(fake)))


def test_default_agent_has_a_same_host_and_a_cross_host_lane() -> None:
    with NixlAgent("lanes") as agent:
        assert agent.lanes[SAME_HOST]["ucx_error_handling_mode"] == "none"
        assert agent.lanes[CROSS_HOST]["ucx_error_handling_mode"] == "peer"
        payload = decode_payload(agent.descriptor())
        assert payload.host_identity == host_identity() != ""
        assert [lane.scopes for lane in payload.lanes] == [[SAME_HOST], [CROSS_HOST]]
        assert [lane.error_mode for lane in payload.lanes] == ["none", "peer"]
        assert len({lane.nixl_name for lane in payload.lanes}) == 2
        assert (payload.nixl_name, payload.metadata) == (payload.lanes[0].nixl_name, payload.lanes[0].metadata)


def test_equal_params_share_one_lane() -> None:
    with NixlAgent("one", {"backend_params": {"ucx_error_handling_mode": "peer"}}) as agent:
        assert agent.lanes[SAME_HOST] == agent.lanes[CROSS_HOST]
        assert [lane.scopes for lane in decode_payload(agent.descriptor()).lanes] == [[SAME_HOST, CROSS_HOST]]


def test_peers_option_limits_the_lanes_and_is_validated() -> None:
    with NixlAgent("remote-only", {"peers": "cross_host"}) as agent:
        assert list(agent.lanes) == [CROSS_HOST]
    with pytest.raises(ConfigError, match="peers"):
        NixlAgent("bad", {"peers": "everyone"})
    with pytest.raises(
        ConfigError, match=r"nixl agent option 'cross_host_params': expected a mapping of str to str or int or float"
    ):
        NixlAgent("bad", {"cross_host_params": "peer"})


def test_peer_scope_follows_the_host_identity_in_the_descriptor() -> None:
    with NixlAgent("a") as a, NixlAgent("b") as b:
        buf = bytearray(4096)
        import torch

        b.register_memory(torch.frombuffer(buf, dtype=torch.uint8))
        assert a.peer_scope(a.load_remote_agent(b.descriptor())) == SAME_HOST
        a.unload_remote_agent("b")
        assert a.peer_scope(a.load_remote_agent(_claim_host(b.descriptor(), "another-boot/4026531836"))) == CROSS_HOST


def test_a_peer_without_the_needed_lane_is_refused_naming_it() -> None:
    with NixlAgent("local-only", {"peers": "same_host"}) as local, NixlAgent("peer") as peer:
        with pytest.raises(RemoteAgentError, match="no cross_host lane"):
            local.load_remote_agent(_claim_host(peer.descriptor(), "another-boot/1"))
    with NixlAgent("any") as agent, NixlAgent("remote-only", {"peers": "cross_host"}) as remote:
        with pytest.raises(RemoteAgentError, match="offers no same_host lane"):
            agent.load_remote_agent(remote.descriptor())


def test_mismatched_error_modes_are_refused_at_load() -> None:
    with NixlAgent("a") as a, NixlAgent("b", {"same_host_params": {"ucx_error_handling_mode": "peer"}}) as b:
        with pytest.raises(RemoteAgentError, match=r"ucx_error_handling_mode.*'none'.*'peer'"):
            a.load_remote_agent(b.descriptor())


def test_old_payload_version_is_refused() -> None:
    with NixlAgent("a") as a, NixlAgent("b") as b:
        desc = TransferAgent.decode_descriptor(b.descriptor())
        old = msgspec.structs.replace(decode_payload(b.descriptor()), version=1)
        bad = msgspec.msgpack.encode(msgspec.structs.replace(desc, payload=msgspec.msgpack.encode(old)))
        with pytest.raises(RemoteAgentError, match="expected 2, got 1"):
            a.load_remote_agent(bad)
