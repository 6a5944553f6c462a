"""Every error of docs/engine-guide.md's table, raised through the transceiver by a real scenario.

The table promises what an engine sees; these tests make each promise happen the
way it would in a deployment (a limit reached, a peer configured differently, a
peer that speaks another protocol version, pools allocated outside the agent,
a peer that shuts down with requests in flight) and check the typed error, its
message and that nothing was written or leaked.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _faults import RankGroup, fault_plugin_manager
from _instances import ContextProcess, fill_value, ticket_for

from kvcore import errors as E
from kvcore.control import wire
from kvcore.transceiver import SessionState

pytestmark = pytest.mark.timeout(120)


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(cache.shape[0], -1).view(torch.uint8)


def _wait(group: RankGroup, rids: list[int], timeout: float = 30.0) -> dict[int, Any]:
    return dict(group.txs[0].wait_all(rids, timeout))


@pytest.fixture
def pm() -> Any:
    return fault_plugin_manager()


@pytest.fixture
def ctx(pm: Any) -> Iterator[RankGroup]:
    g = RankGroup.build("context", pm=pm)
    try:
        yield g
    finally:
        g.close()


def test_resource_exhausted_at_the_call_and_admitted_again_after_release(ctx: RankGroup, pm: Any) -> None:
    """``max_inflight_requests`` live requests: the next start_receive raises; after a release it is admitted."""
    gen = RankGroup.build("generation", pm=pm, max_inflight_requests=2)
    try:
        tx = gen.txs[0]
        tx.start_receive(1, ctx.info_endpoint, [0], ticket=ticket_for(1))
        tx.start_receive(2, ctx.info_endpoint, [1], ticket=ticket_for(2))
        with pytest.raises(E.ResourceExhaustedError, match="max_inflight_requests=2"):
            tx.start_receive(3, ctx.info_endpoint, [2], ticket=ticket_for(3))
        ctx.txs[0].start_send(1, [5], ticket=ticket_for(1))
        assert _wait(gen, [1])[1].state is SessionState.DONE
        tx.start_receive(3, ctx.info_endpoint, [2], ticket=ticket_for(3))  # one slot free again
        ctx.txs[0].start_send(2, [6], ticket=ticket_for(2))
        ctx.txs[0].start_send(3, [7], ticket=ticket_for(3))
        assert {o.state for o in _wait(gen, [2, 3]).values()} == {SessionState.DONE}
    finally:
        gen.close()


def test_resource_exhausted_from_the_context_side_reaches_the_receiver(pm: Any) -> None:
    """A context rank holding its limit of requests that wait for start_send refuses one more, typed, at once."""
    ctx = RankGroup.build("context", pm=pm, max_early_requests=1)
    gen = RankGroup.build("generation", pm=pm)
    try:
        gen.txs[0].start_receive(1, ctx.info_endpoint, [0], ticket=ticket_for(1))
        deadline = time.monotonic() + 20
        while ctx.txs[0].stats()["early_requests"] != 1:
            assert time.monotonic() < deadline, "the first request never reached the context rank"
            time.sleep(0.01)
        gen.txs[0].start_receive(2, ctx.info_endpoint, [1], ticket=ticket_for(2))
        out = gen.txs[0].wait_all([2], 20)[2]  # long before the 30 s request timeout
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.ResourceExhaustedError), repr(out.error)
        assert not _flat(gen.caches[0])[1].any()
    finally:
        gen.close()
        ctx.close()


def test_backend_mismatch_is_refused_at_first_contact_naming_both_backends(pm: Any) -> None:
    ctx = RankGroup.build("context", backend="other-shm", pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    try:
        _flat(ctx.caches[0])[[1, 2]] = torch.from_numpy(fill_value(1, [1, 2], _flat(ctx.caches[0]).shape[1]))
        ctx.txs[0].start_send(1, [1, 2], ticket=ticket_for(1))
        gen.txs[0].start_receive(1, ctx.info_endpoint, [3, 4], ticket=ticket_for(1))
        out = _wait(gen, [1])[1]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.IncompatiblePeerError), repr(out.error)
        msg = str(out.error)
        assert "backend" in msg and "'shm-other'" in msg and "'shm'" in msg, msg
        # refused by the generation rank itself from the instance's rank list, before it registers anywhere (not
        # left to the context's answer to its registration, which says "generation rank uses ...")
        assert "context rank 0 uses 'shm-other'" in msg, msg
        assert not _flat(gen.caches[0]).any(), "a refused peer wrote bytes"
    finally:
        gen.close()
        ctx.close()


def test_an_instance_speaking_another_protocol_version_is_refused_with_a_typed_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A generation instance that speaks only protocol 2 meets a context that speaks only 1: typed, prompt refusal."""
    c = ContextProcess(timeout=60.0)
    try:
        monkeypatch.setattr(wire, "PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 1)
        monkeypatch.setattr(wire, "MIN_PROTOCOL_VERSION", wire.PROTOCOL_VERSION)
        gen = RankGroup.build("generation", pm=fault_plugin_manager(), timeout=60.0)
        try:
            c.send(1, [2])
            gen.txs[0].start_receive(1, c.endpoint, [3], ticket=ticket_for(1))
            out = gen.txs[0].wait_all([1], 15)[1]  # well before the 60 s request timeout
            assert out.state is SessionState.FAILED
            assert isinstance(out.error, E.ProtocolVersionError), repr(out.error)
            assert "1..1" in str(out.error) or "version" in str(out.error)
            assert not _flat(gen.caches[0]).any()
        finally:
            gen.close()
    finally:
        c.close()


def test_remote_range_error_when_the_receiver_pools_are_not_agent_memory(ctx: RankGroup, pm: Any) -> None:
    """Pools allocated with plain torch (not ``agent.allocate_tensor``) are not exported: typed failure, no byte moved."""
    gen = RankGroup.build("generation", pm=pm, allocator=lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    try:
        _flat(ctx.caches[0])[[1]] = torch.from_numpy(fill_value(1, [1], _flat(ctx.caches[0]).shape[1]))
        ctx.txs[0].start_send(1, [1], ticket=ticket_for(1))
        gen.txs[0].start_receive(1, ctx.info_endpoint, [2], ticket=ticket_for(1))
        out = _wait(gen, [1])[1]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.RemoteRangeError), repr(out.error)
        ctx_out = _wait(ctx, [1])[1]
        assert ctx_out.state is SessionState.FAILED and isinstance(ctx_out.error, E.RemoteRangeError)
        assert not _flat(gen.caches[0]).any(), "RemoteRangeError promises that nothing moved"
    finally:
        gen.close()


def test_pull_from_a_context_pool_not_allocated_by_the_shm_agent_is_refused_at_construction(pm: Any) -> None:
    """A pull-mode context whose pools are plain torch memory is refused by the constructor, naming allocate_tensor."""
    from kvcore.config import TransceiverConfig, create_agent
    from kvcore.layout.builders import allocate_kv_cache, build_page_table
    from kvcore.layout.topology import AttentionGeometry, Topology
    from kvcore.transceiver import Transceiver

    geo = AttentionGeometry(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype="bfloat16")
    topo = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=geo.num_layers)
    cfg = TransceiverConfig(backend="shm", transfer_mode="pull")
    agent = create_agent(cfg, "pull-ctx", pm)
    try:
        for allocator, refused in (
            (lambda shape, dtype: torch.zeros(shape, dtype=dtype), True),
            (agent.allocate_tensor, False),
        ):
            caches = allocate_kv_cache(topo, geo, 8, allocator=allocator)
            table = build_page_table("head_major_pool", caches, topology=topo, geometry=geo)

            def build(table: Any = table) -> Transceiver:
                return Transceiver(
                    cfg, role="context", agent=agent, topology=topo, geometry=geo, page_table=table, pm=pm
                )

            if refused:
                with pytest.raises(E.RegistrationError, match=r"transfer_mode='pull'.*agent\.allocate_tensor"):
                    build()
                assert agent.registrations == (), "the refused pools stay registered"
            else:
                build().close()  # the same pools from the agent's shared memory are accepted
    finally:
        agent.close()


def test_peer_closing_with_requests_in_flight_fails_them_with_peer_lost() -> None:
    """The context instance shuts down cleanly while a receiver waits for a request: PeerLostError, then released."""
    c = ContextProcess(timeout=60.0)
    gen = RankGroup.build("generation", pm=fault_plugin_manager(), timeout=60.0)
    try:
        c.send(1, [2])
        gen.txs[0].start_receive(1, c.endpoint, [3], ticket=ticket_for(1))
        assert _wait(gen, [1])[1].state is SessionState.DONE  # connected and working
        gen.txs[0].start_receive(2, c.endpoint, [4], ticket=ticket_for(2))  # the context never starts sending it
        deadline = time.monotonic() + 20
        while c.stats()["early_requests"] != 1:
            assert time.monotonic() < deadline, "the request never reached the context rank"
            time.sleep(0.01)
        c.close()  # Transceiver.close() with a request in flight, then the process exits
        out = gen.txs[0].wait_all([2], 30)[2]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.PeerLostError), repr(out.error)
        assert gen.txs[0].stats()["rx_sessions"] == 0
    finally:
        c.close()
        gen.close()


def test_close_with_requests_in_flight_returns_and_refuses_later_calls(ctx: RankGroup, pm: Any) -> None:
    gen = RankGroup.build("generation", pm=pm)
    try:
        gen.txs[0].start_receive(1, ctx.info_endpoint, [0], ticket=ticket_for(1))  # never sent
        ctx.txs[0].start_send(2, [1], ticket=ticket_for(2))  # never asked for
        gen.txs[0].close()
        ctx.txs[0].close()
        with pytest.raises(E.SessionError, match="closed"):
            gen.txs[0].start_receive(3, ctx.info_endpoint, [0], ticket=ticket_for(3))
        with pytest.raises(E.SessionError, match="closed"):
            ctx.txs[0].start_send(4, [0], ticket=ticket_for(4))
        gen.txs[0].close()  # idempotent
    finally:
        gen.close()


def test_missing_mapper_plugin_is_a_typed_error_naming_the_missing_mapper() -> None:
    """Context TP2 -> generation TP1 needs the head-count mixer; without kvcore-mixers the request fails, typed.

    The core names no plugin: the error names the mapper kind and points at 'kvcore plugins'."""
    from kvcore.extension.plugins import make_plugin_manager

    pm = make_plugin_manager(load_entry_points=False)  # the built-ins only: no kvcore-mixers
    ctx = RankGroup.build("context", tp=2, pm=pm)
    gen = RankGroup.build("generation", pm=pm)
    try:
        ctx.each(lambda _r, tx: tx.start_send(1, [1], ticket=ticket_for(1)))
        gen.txs[0].start_receive(1, ctx.info_endpoint, [2], ticket=ticket_for(1))
        out = _wait(gen, [1])[1]
        assert out.state is SessionState.FAILED
        assert isinstance(out.error, E.MappingError), repr(out.error)
        assert "head_mismatch_head_major" in str(out.error) and "kvcore plugins" in str(out.error), str(out.error)
        assert not _flat(gen.caches[0]).any()
    finally:
        gen.close()
        ctx.close()
