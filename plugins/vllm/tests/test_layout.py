"""describe_kv_caches against KV views made by vLLM's own planner and allocator, every layout vLLM 0.33 has."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from kvcore_vllm.layout import describe_kv_caches, layer_index
from vllm_engine import BLOCK_SIZE, HEAD_SIZE, NUM_KV_HEADS, NUM_LAYERS

from kvcore.errors import LayoutError
from kvcore.layout.page import HEAD_MAJOR, TOKEN_MAJOR
from kvcore.layout.topology import Topology

NUM_BLOCKS = 12
TOPOLOGY = Topology.create(tp_size=1, pp_size=1, rank=0, num_layers=NUM_LAYERS)


def vllm_kv_caches(model_dir: str, layout: str, kernel_block_size: int | None = None) -> dict[str, torch.Tensor]:
    """vLLM's planner (get_kv_cache_config_from_groups) and allocator (allocate_kv_cache) for ``layout``."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        scheduler_config=SchedulerConfig(max_model_len=512, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        device_config=DeviceConfig("cpu"),
    )
    vc.cache_config.kv_cache_layout = layout
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )
        for i in range(NUM_LAYERS)
    }
    groups = get_kv_cache_groups(vc, specs)
    page = groups[0].kv_cache_spec.page_size_bytes
    kcc = get_kv_cache_config_from_groups(vc, groups, page * NUM_LAYERS * NUM_BLOCKS)
    kernel = None if kernel_block_size is None else [kernel_block_size]
    return allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout], kernel)


def fill(kv_caches: dict[str, torch.Tensor]) -> None:
    for i, name in enumerate(sorted(kv_caches)):
        t = kv_caches[name]
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + i * 1_000_000)


def slot_bytes(addr: int, n: int) -> np.ndarray:
    return np.frombuffer(ctypes.string_at(addr, n), dtype=np.uint8)


@pytest.mark.parametrize(
    ("layout", "kind"),
    [("LBHNC", HEAD_MAJOR), ("BLHNC", HEAD_MAJOR), ("LBNHC", TOKEN_MAJOR), ("BLNHC", TOKEN_MAJOR)],
)
def test_page_table_addresses_vllm_pages(model_dir: str, layout: str, kind: str) -> None:
    kv = vllm_kv_caches(model_dir, layout)
    fill(kv)
    d = describe_kv_caches(kv, topology=TOPOLOGY, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE)
    (view,) = d.page_table.views
    assert view.sharding.kind == kind and view.layers == tuple(range(NUM_LAYERS))
    assert d.kernel_blocks_per_block == 1
    blocks = np.arange(NUM_BLOCKS)
    addrs = d.page_table.entry_addresses(0, np.arange(view.num_entries), blocks)
    for e, name in enumerate(d.layer_names):
        t = kv[name]  # logical [B, H, N, K|V]
        for b in blocks:
            # The declared order of one page: head-major [H][N][C], token-major [N][H][C].
            page = t[b] if kind == HEAD_MAJOR else t[b].permute(1, 0, 2)
            expected = page.contiguous().view(torch.uint8).numpy().reshape(-1)
            got = slot_bytes(int(addrs[e, b]), view.buffer_bytes)
            assert np.array_equal(got, expected), f"{layout} layer {name} block {b}"


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_layouts_that_split_a_page_are_refused(model_dir: str, layout: str) -> None:
    kv = vllm_kv_caches(model_dir, layout)
    with pytest.raises(LayoutError, match="page-contiguous layout"):
        describe_kv_caches(kv, topology=TOPOLOGY, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE)


def test_kernel_blocks_smaller_than_the_vllm_block(model_dir: str) -> None:
    kv = vllm_kv_caches(model_dir, "LBHNC", kernel_block_size=BLOCK_SIZE // 2)
    fill(kv)
    d = describe_kv_caches(kv, topology=TOPOLOGY, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE)
    (view,) = d.page_table.views
    assert d.kernel_blocks_per_block == 2 and view.buffers_per_layer == 2
    addrs = d.page_table.entry_addresses(0, np.arange(view.num_entries), np.arange(NUM_BLOCKS))
    name = d.layer_names[1]
    t = kv[name]  # [2*B, H, N/2, C]
    for b in range(NUM_BLOCKS):
        for k in range(2):
            expected = t[2 * b + k].contiguous().view(torch.uint8).numpy().reshape(-1)
            assert np.array_equal(slot_bytes(int(addrs[2 + k, b]), view.buffer_bytes), expected)


def test_legacy_flash_attention_tensors() -> None:
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) for i in range(2)}
    d = describe_kv_caches(kv, topology=TOPOLOGY, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE)
    assert d.kind == "legacy_kv_first" and d.geometry.block_order == "token_major"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda kv: {k: v[:, :1] for k, v in kv.items()}, "expected 2 KV heads"),
        (lambda kv: {k: v[..., :HEAD_SIZE] for k, v in kv.items()}, "K and V of one head side by side"),
        (lambda kv: {"model.layers.0.self_attn.attn": kv["model.layers.0.self_attn.attn"], "lm_head": None}, "layer"),
        (lambda kv: {}, "at least one attention layer"),
    ],
)
def test_bad_caches_raise_layout_error(model_dir: str, mutate: Any, message: str) -> None:
    kv = vllm_kv_caches(model_dir, "LBHNC")
    with pytest.raises(LayoutError, match=message):
        describe_kv_caches(
            mutate(kv), topology=TOPOLOGY, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE
        )


def test_layer_index_names_the_bad_name() -> None:
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(LayoutError, match="exactly one integer"):
        layer_index("model.layers.1.experts.2")
