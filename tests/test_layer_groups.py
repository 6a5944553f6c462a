"""Layer groups: each group its own layers, pools and block ids (full attention + sliding window).

Expectations come from plain numpy indexing of the request's logical KV, never
from kvcore's mappers; plans run as memcpy on real tensors and every
destination byte is compared and write-counted.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvcore.errors import IncompatiblePeerError, LayoutError, MappingError, PoolMismatchError
from kvcore.layout.blocks import normalize_block_ids
from kvcore.layout.builders import allocate_kv_cache, build_kv_page_table
from kvcore.layout.mapping import RankPlacement, plan_transfer, validate_compatible
from kvcore.layout.page import DEFAULT_GROUP, HEAD_MAJOR, PageTable, Pool, PoolView, ViewSharding, check_group_name
from kvcore.layout.peer import peer_ranks
from kvcore.layout.topology import AttentionGeometry, Topology
from kvcore.testing.oracle import Memory

SENTINEL = 0x5A
GEOM = AttentionGeometry(num_layers=4, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype="float16")
FULL, SWA = (0, 2), (1, 3)
WINDOW = 8
BLOCKS = {"full": 12, "swa": 6}  # each group its own pool size


def raw(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().reshape(-1)


def heads_of(topo: Topology) -> list[int]:
    per = GEOM.num_kv_heads // topo.tp_size
    return list(range(topo.tp_rank * per, (topo.tp_rank + 1) * per))


def build(topo: Topology, swa_group: str = "swa") -> tuple[dict[str, torch.Tensor], RankPlacement]:
    """A rank with a "full" pool for layers 0, 2 and a sliding-window pool for layers 1, 3."""
    tensors, tables = {}, []
    for name, layers, window in (("full", FULL, None), (swa_group, SWA, WINDOW)):
        kv = allocate_kv_cache(topo, GEOM, BLOCKS.get(name, 6), layers=layers)
        raw(kv)[:] = SENTINEL
        tensors[name] = kv
        tables.append(build_kv_page_table(kv, topology=topo, geometry=GEOM, layers=layers, group=name, window=window))
    return tensors, RankPlacement(topology=topo, geometry=GEOM, page_table=PageTable.combine(tables))


def fill(kv: torch.Tensor, topo: Topology, layers, logical: np.ndarray, ids, first_block: int) -> None:
    """Write blocks ``first_block..`` of the request into ``ids`` of a group's tensor ``[blocks, layers, kv, h, t, d]``."""
    tpb = GEOM.tokens_per_block
    start, stop = topo.layer_range
    local = [layer for layer in layers if start <= layer < stop]
    heads = heads_of(topo)
    for j, blk in enumerate(np.asarray(ids).tolist()):
        toks = slice((first_block + j) * tpb, (first_block + j + 1) * tpb)
        for li, layer in enumerate(local):
            for k in range(2):
                raw(kv[blk, li, k])[:] = logical[layer, k][heads][:, toks].reshape(-1)


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (1, 2), (2, 1)])
def test_each_group_moves_its_own_blocks(ctx_tp, gen_tp):
    prompt_len, tpb = 22, GEOM.tokens_per_block
    total = -(-prompt_len // tpb)  # 6 blocks
    stale = (prompt_len + 1 - WINDOW) // tpb  # 3: sliding-window blocks before this are not needed
    rng = np.random.default_rng(7)
    logical = rng.integers(0, 255, (4, 2, 2, total * tpb, GEOM.head_dim * 2), dtype=np.uint8)
    ctx_ids = {"full": rng.permutation(12)[:total], "swa": rng.permutation(6)[: total - stale]}  # resident suffix
    gen_ids = {"full": rng.permutation(12)[:total], "swa": rng.permutation(6)[:4]}  # one block more than needed
    ctx = [build(Topology.create(ctx_tp, 1, r, 4)) for r in range(ctx_tp)]
    gen = [build(Topology.create(gen_tp, 1, r, 4)) for r in range(gen_tp)]
    mem = Memory()
    for tensors, _ in ctx + gen:
        for t in tensors.values():
            mem.add(t)
    for tensors, lay in ctx:
        fill(tensors["full"], lay.topology, FULL, logical, ctx_ids["full"], 0)
        fill(tensors["swa"], lay.topology, SWA, logical, ctx_ids["swa"], stale)
    for _, glay in gen:
        for c in peer_ranks(glay.topology, ctx[0][1].topology):
            mem.execute(plan_transfer(ctx[c][1], glay, ctx_ids, gen_ids, prompt_len=prompt_len))
    for tensors, lay in gen:
        for name, layers, ids, first in (
            ("full", FULL, gen_ids["full"], 0),
            ("swa", SWA, gen_ids["swa"][1:], stale),  # gen_ids["swa"][0] holds a stale block: untouched
        ):
            exp, mask = tensors[name].clone(), torch.zeros_like(tensors[name])
            raw(exp)[:] = SENTINEL
            fill(exp, lay.topology, layers, logical, ids, first)
            fill(mask, lay.topology, layers, np.ones_like(logical), ids, first)
            assert np.array_equal(raw(tensors[name]), raw(exp)), f"group {name}: bytes differ"
            assert np.array_equal(mem.count_of(tensors[name]), raw(mask).astype(np.int32)), f"group {name}: counts"


def test_a_window_group_needs_the_source_to_hold_the_window():
    _, a = build(Topology.create(1, 1, 0, 4))
    full = {"full": list(range(6))}
    # prompt 22, window 8: blocks 3..5 are needed; a source holding only blocks 4..5 would leave a hole
    with pytest.raises(
        MappingError, match=r"destination needs blocks 3\.\.5 of the request, the source holds only blocks 4\.\.5"
    ):
        plan_transfer(a, a, {**full, "swa": [0, 1]}, {"full": list(range(6, 12)), "swa": [2, 3, 4]}, prompt_len=22)
    plan = plan_transfer(
        a, a, {**full, "swa": [0, 1, 5]}, {"full": list(range(6, 12)), "swa": [2, 3, 4]}, prompt_len=22
    )
    assert plan.count > 0


def test_group_errors_name_the_group():
    topo = Topology.create(1, 1, 0, 4)
    _, a = build(topo)
    ids = {"full": [0, 1], "swa": [2]}
    with pytest.raises(MappingError, match=r"src_block_ids: the page table holds layer groups \['full', 'swa'\]"):
        plan_transfer(a, a, [0, 1], ids, prompt_len=8)
    with pytest.raises(MappingError, match=r"destination block ids: expected ids for layer group 'swa'"):
        plan_transfer(a, a, ids, {"full": [0, 1]}, prompt_len=8)
    _, b = build(topo, swa_group="sliding")
    with pytest.raises(PoolMismatchError, match=r"layer group differs: source 'swa', destination 'sliding'"):
        plan_transfer(a, b, ids, {"full": [0, 1], "sliding": [2]}, prompt_len=8)
    with pytest.raises(IncompatiblePeerError, match=r"view 'kv' layer group: context 'swa', generation 'sliding'"):
        validate_compatible(a, b)
    # every layer in one group on one side, two groups on the other: also refused, naming both
    kv = allocate_kv_cache(topo, GEOM, 12)
    one = RankPlacement(topology=topo, geometry=GEOM, page_table=build_kv_page_table(kv, topology=topo, geometry=GEOM))
    with pytest.raises(PoolMismatchError, match=r"layer group differs: source 'default', destination '(full|swa)'"):
        plan_transfer(one, a, [0, 1], ids, prompt_len=8)


def test_a_plain_list_means_the_only_group():
    topo = Topology.create(1, 1, 0, 4)
    kv = allocate_kv_cache(topo, GEOM, 8, layers=FULL)
    table = build_kv_page_table(kv, topology=topo, geometry=GEOM, layers=FULL, group="full")
    lay = RankPlacement(topology=topo, geometry=GEOM, page_table=table)
    as_list = plan_transfer(lay, lay, [1, 2], [3, 4])
    as_map = plan_transfer(lay, lay, {"full": [1, 2]}, {"full": np.array([3, 4])})
    assert as_list.count == as_map.count == 1 and as_list.nbytes == as_map.nbytes == 2 * kv[0].numel() * 2
    assert (as_list.src == as_map.src).all() and (as_list.dst == as_map.dst).all()
    assert [v.tolist() for v in normalize_block_ids([1, 2], table).values()] == [[1, 2]]
    assert list(normalize_block_ids((5,), table)) == ["full"]


@pytest.mark.parametrize("n", [65, 300, 4096])
def test_long_block_lists_refuse_every_duplicate_wherever_it_is(n: int) -> None:
    """Lists longer than the short-list path (> 64 ids) find duplicates without sorting; every position of a
    repeated id, the top slot and a permutation of every slot are checked against ``len(set(ids))``."""
    from kvcore.layout.blocks import _check_ids

    rng = np.random.default_rng(n)
    slots = n + 7
    ids = rng.permutation(slots)[:n].astype(np.int64)
    _check_ids(ids, slots, "ids")  # distinct: accepted
    _check_ids(rng.permutation(slots).astype(np.int64), slots, "ids")  # every slot once, the top one too
    for i, j in [(0, 1), (0, n - 1), (n // 2, n // 3), (n - 2, n - 1)]:
        dup = ids.copy()
        dup[j] = dup[i]
        assert len(set(dup.tolist())) == n - 1
        with pytest.raises(LayoutError, match=rf"ids: block id {int(dup[i])} appears 2 times"):
            _check_ids(dup, slots, "ids")
    with pytest.raises(LayoutError, match=rf"ids: block ids must be in 0\.\.{slots - 1}, got {slots}"):
        _check_ids(np.append(ids[:-1], slots), slots, "ids")
    huge = np.array([(1 << 40) + k for k in range(n)], dtype=np.int64)  # beyond the table's reach: sorted instead
    _check_ids(huge, 1 << 41, "ids")
    huge[-1] = huge[0]
    with pytest.raises(LayoutError, match="appears 2 times"):
        _check_ids(huge, 1 << 41, "ids")


def test_normalize_block_ids_checks_each_group_against_its_own_pools():
    _, lay = build(Topology.create(1, 1, 0, 4))
    table = lay.page_table
    assert table.groups() == {"full": FULL, "swa": SWA}
    assert table.group_slots("full") == 12 and table.group_slots("swa") == 6
    got = normalize_block_ids({"full": range(3), "swa": np.array([5], np.int32), "mamba": [0]}, table)
    assert sorted(got) == ["full", "swa"] and got["swa"].dtype == np.int64  # names this rank lacks are ignored
    with pytest.raises(LayoutError, match=r"block_ids\['swa'\]: block ids must be in 0\.\.5, got 7"):
        normalize_block_ids({"full": [7], "swa": [7]}, table)
    with pytest.raises(LayoutError, match=r"block_ids\['full'\]: block id 3 appears 2 times"):
        normalize_block_ids({"full": [3, 3], "swa": []}, table)
    with pytest.raises(
        LayoutError, match=r"expected block ids for layer group 'swa' \(this rank holds groups \['full', 'swa'\]\)"
    ):
        normalize_block_ids({"full": [1], "sw": [1]}, table)
    with pytest.raises(LayoutError, match=r"holds layer groups \['full', 'swa'\]; expected a mapping"):
        normalize_block_ids([1, 2], table)
    with pytest.raises(LayoutError, match=r"block_ids\['full'\]: expected integer block ids, got 1.5"):
        normalize_block_ids({"full": [1.5], "swa": []}, table)
    with pytest.raises(LayoutError, match=r"block_ids group name: expected a name of 1\.\.64 printable"):
        normalize_block_ids({"": [1], "full": [], "swa": []}, table)
    with pytest.raises(LayoutError, match=r"block_ids group name: expected a name of 1\.\.64 printable"):
        normalize_block_ids({3: [1], "full": [], "swa": []}, table)
    with pytest.raises(LayoutError, match=r"block_ids\['full'\]: expected a flat list of block ids, got shape"):
        normalize_block_ids({"full": [[1, 2]], "swa": []}, table)


def test_groups_sharing_memory_may_not_share_a_block_id():
    """vLLM's hybrid allocator: layers of two groups share one buffer, and block ids come from one pool."""
    buf = 2 * 2 * 2 * 4 * 4 * 2  # kv * heads * tokens... of one layer in one block
    sharding = ViewSharding(kind=HEAD_MAJOR, num_shards=1, unit_bytes=buf // 4)
    pool = Pool(base=4096, slot_bytes=2 * buf, slot_stride=2 * buf, num_slots=8)

    def view(layer: int, group: str) -> PoolView:
        return PoolView(
            role="kv",
            mapper="head_mismatch_head_major",
            layers=(layer,),
            buffers_per_layer=2,
            buffer_bytes=buf,
            pools=(0, 0),
            offsets=(0, buf),
            sharding=sharding,
            tokens_per_slot=4,
            group=group,
        )

    table = PageTable(pools=(pool,), views=(view(0, "full"), view(1, "swa")))
    assert normalize_block_ids({"full": [0, 1], "swa": [2]}, table)["swa"].tolist() == [2]
    with pytest.raises(LayoutError, match=r"block id 1 appears in layer groups 'full' and 'swa'"):
        normalize_block_ids({"full": [0, 1], "swa": [1]}, table)


def test_group_travels_in_the_encoded_table_and_defaults():
    _, lay = build(Topology.create(1, 1, 0, 4))
    back = PageTable.decode(lay.page_table.encode())
    assert back == lay.page_table and [v.group for v in back.views] == ["full", "swa"]
    kv = allocate_kv_cache(Topology.create(1, 1, 0, 4), GEOM, 2)
    (plain,) = build_kv_page_table(kv, topology=Topology.create(1, 1, 0, 4), geometry=GEOM).views
    assert plain.group == DEFAULT_GROUP == "default"
    # a table encoded without the field (an older peer) decodes into the default group
    as_dict = msgspec.to_builtins(lay.page_table)
    for v in as_dict["views"]:
        del v["group"]
    old = PageTable.decode(msgspec.msgpack.encode(as_dict))
    assert {v.group for v in old.views} == {"default"}
    for bad in ("", "x" * 65, "a\nb"):
        with pytest.raises(LayoutError, match=r"expected a name of 1\.\.64 printable characters"):
            check_group_name(bad)
    with pytest.raises(LayoutError, match="group"):
        msgspec.structs.replace(plain, group="")


def test_pp_stage_without_a_group_ignores_its_ids():
    """Stage 0 holds layers 0, 1: it has both groups; stage 1 of a [3, 1] split holds only layer 3 (swa)."""
    topo = Topology.create(1, 2, 1, 4, [3, 1])
    tensors, lay = build(topo)
    assert tuple(tensors["full"].shape)[1] == 0 and lay.page_table.groups() == {"swa": (3,)}
    got = normalize_block_ids({"full": [0, 1, 2], "swa": [4]}, lay.page_table)
    assert list(got) == ["swa"]
    assert normalize_block_ids([4], lay.page_table)["swa"].tolist() == [4]  # its only group


def test_group_ids_round_trip_the_wire_form_and_bound_what_a_peer_sends():
    from kvcore.errors import MessageDecodeError
    from kvcore.layout.blocks import MAX_GROUPS, decode_group_ids, encode_group_ids

    _, lay = build(Topology.create(1, 1, 0, 4))
    ids = normalize_block_ids({"full": [11, 0, 5], "swa": []}, lay.page_table)
    raw = encode_group_ids(ids)
    assert raw == {"full": np.array([11, 0, 5], "<i8").tobytes(), "swa": b""}
    back = decode_group_ids(raw, max_blocks=16)
    assert {k: v.tolist() for k, v in back.items()} == {"full": [11, 0, 5], "swa": []}
    with pytest.raises(MessageDecodeError, match=r"group_block_ids\['full'\]: expected little-endian int64"):
        decode_group_ids({"full": b"\x01" * 7}, max_blocks=16)
    with pytest.raises(MessageDecodeError, match="at most 2 block ids in all"):
        decode_group_ids(raw, max_blocks=2)
    with pytest.raises(MessageDecodeError, match=f"at most {MAX_GROUPS} groups"):
        decode_group_ids({f"g{i}": b"" for i in range(MAX_GROUPS + 1)}, max_blocks=16)
    with pytest.raises(MessageDecodeError, match="group_block_ids name"):
        decode_group_ids({"": b""}, max_blocks=16)
    # what decodes is then checked against the peer's own table: ranges per group
    with pytest.raises(LayoutError, match=r"destination block_ids\['swa'\]: block ids must be in 0\.\.5, got 9"):
        normalize_block_ids(decode_group_ids(encode_group_ids({"full": [1], "swa": [9]}), max_blocks=16),
                            lay.page_table, "destination block_ids")  # fmt: skip
