"""KV pools in GPU memory (VRAM): what the engine guide promises for ``device="cuda"``, across two processes.

Skipped where torch sees no CUDA device (the CPU machines CI runs on); run on a GPU machine with
``pytest -m cuda`` (CONTRIBUTING.md, "GPU checks"). Each test asserts the path as well as the bytes: the
pools are CUDA tensors registered with the agent as VRAM on the side that asked for it, and every byte that
arrives matches ``fill_value``, computed without kvcore.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _instances import ContextProcess, _pattern_id, fill_value, make_rank, rank_parts

from kvcore import errors as E
from kvcore.transceiver import SessionState, leaks
from kvcore.transport.agent_types import MemoryKind

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (KV pools in VRAM)"),
]

#: The backends that declare VRAM; shm is DRAM only (its refusal is tested below).
VRAM_BACKENDS = ["nixl", "ucx"]
#: (context pools, generation pools): both in VRAM, and each side alone in VRAM.
PLACEMENTS = [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]


class _Gen:
    """A one-rank generation instance in this process with its pools on ``device``."""

    def __init__(self, backend: str, device: str, name: str, num_blocks: int = 64) -> None:
        self.agent, self.cache, self.tx = make_rank(
            "generation", name, backend, num_blocks, 60.0, None, name, device=device
        )
        self.flat = self.cache.view(num_blocks, -1).view(torch.uint8)

    def close(self) -> None:
        self.tx.close()
        self.agent.close()


def _kinds(agent: Any) -> set[str]:
    return {r.region.kind.value for r in agent.registrations}


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize(("ctx_dev", "gen_dev"), PLACEMENTS)
@pytest.mark.parametrize("backend", VRAM_BACKENDS)
def test_kv_moves_exactly_between_vram_and_dram(
    backend: str, ctx_dev: str, gen_dev: str, mode: str, closing: list[Any]
) -> None:
    """Scattered blocks of several requests land byte-exact, with each side's pools where it asked for them."""
    name = f"gen-vram-{backend}-{ctx_dev}-{gen_dev}-{mode}"
    ctx = ContextProcess(backend, num_blocks=64, timeout=60.0, device=ctx_dev)
    closing.append(ctx)
    gen = _Gen(backend, gen_dev, name)
    closing.append(gen)
    assert gen.cache.device.type == ("cuda" if gen_dev == "cuda" else "cpu")
    assert _kinds(gen.agent) == {"VRAM" if gen_dev == "cuda" else "DRAM"}, gen.agent.registrations
    ctx_kinds = set(ctx.call("memory_kinds")["kinds"])
    assert ctx_kinds == {"VRAM" if ctx_dev == "cuda" else "DRAM"}

    cases = [(1, [1, 2, 3], [40, 41, 42]), (2, [7], [5]), (3, [10, 20, 30, 31], [60, 2, 33, 34])]
    for rid, src, dst in cases:
        p = ctx.start_send(rid, src, mode=mode)
        gen.tx.start_receive(params=p, block_ids=dst)
    outs = gen.tx.wait_all([c[0] for c in cases], 60)
    got = gen.flat.cpu().numpy()
    for rid, src, dst in cases:
        assert outs[rid].state is SessionState.DONE, outs[rid].error
        assert outs[rid].nbytes == len(dst) * gen.flat.shape[1]
        want = fill_value(_pattern_id(rid), src, gen.flat.shape[1])
        assert np.array_equal(got[dst], want), f"request {rid}: the bytes in the generation's pools differ"
        assert ctx.wait_released(rid, 30)["state"] == "DONE"
    untouched = sorted(set(range(64)) - {b for _, _, dst in cases for b in dst})
    assert not got[untouched].any(), "a block no request named was written"
    assert gen.tx.stats()["bounced_writes_total"] == 0, "the bytes went through the bounce arena"
    assert gen.tx.leaks() == {}
    assert leaks(ctx.stats()) == {}


@pytest.mark.parametrize("backend", VRAM_BACKENDS)
def test_a_large_vram_request_lands_exactly(backend: str, closing: list[Any]) -> None:
    """256 blocks of 128 KiB (32 MiB) from VRAM to VRAM in one request: the big-copy path of each agent."""
    geo = dict(num_layers=4, num_kv_heads=8, head_dim=64, tokens_per_block=16)
    ctx = ContextProcess(backend, num_blocks=300, timeout=60.0, device="cuda", **geo)
    closing.append(ctx)
    agent, cache, tx = make_rank(
        "generation", f"gen-vram-large-{backend}", backend, 300, 60.0, None, f"gen-vram-large-{backend}",
        device="cuda", **geo,
    )  # fmt: skip
    closing.append(agent)
    closing.append(tx)
    flat = cache.view(300, -1).view(torch.uint8)
    assert flat.shape[1] == 2 * 4 * 8 * 64 * 16 * 2  # K and V, 4 layers, 8 heads, 64 dims, 16 tokens, bf16
    src, dst = list(range(0, 256)), list(range(299, 43, -1))
    p = ctx.start_send(5, src)
    tx.start_receive(params=p, block_ids=dst)
    out = tx.wait_all([5], 120)[5]
    assert out.state is SessionState.DONE, out.error
    assert np.array_equal(flat[dst].cpu().numpy(), fill_value(5, src, flat.shape[1]))


def test_shm_refuses_vram_by_name() -> None:
    """The shm agent holds host memory only: CUDA memory is a typed error naming it, never a silent copy."""
    from kvcore.config import TransceiverConfig, create_agent

    agent = create_agent(TransceiverConfig(backend="shm"), "gen-vram-shm")
    try:
        with pytest.raises(E.UnsupportedOperationError, match=r"DRAM only.*cuda"):
            agent.allocate_tensor((4, 1024), torch.uint8, "cuda")
        with pytest.raises(E.UnsupportedOperationError, match="VRAM"):
            agent.register_memory(torch.zeros(4096, dtype=torch.uint8, device="cuda"))
        assert agent.registrations == ()
    finally:
        agent.close()


def test_vram_device_index_is_kept_in_the_registration(closing: list[Any]) -> None:
    """``cuda:N`` registers on device N (the last visible GPU here), not on device 0."""
    n = torch.cuda.device_count() - 1
    agent, cache, tx = make_rank(
        "generation", "gen-vram-index", "nixl", 8, 10.0, None, "gen-vram-index", device=f"cuda:{n}"
    )
    closing.extend([agent, tx])
    assert cache.device.index == n
    regs = agent.registrations
    assert regs and all(r.region.kind is MemoryKind.VRAM and r.region.device_id == n for r in regs)


@pytest.mark.parametrize("named", ["cpu", "cuda:{count}"])
def test_vram_pools_under_another_device_name_are_refused_before_registering(named: str) -> None:
    """Pools on cuda:0 with ``device="cpu"`` (the default) or a GPU they are not on: a ConfigError naming where
    they are (torch's CUDA allocator holds them), and nothing registered with the agent."""
    from kvcore.transceiver import Transceiver

    agent, cache, kwargs = rank_parts("generation", f"gen-vram-named-{named[:4]}", "nixl", 8, device="cuda:0")
    try:
        assert cache.device == torch.device("cuda:0")
        device = named.format(count=torch.cuda.device_count())
        with pytest.raises(E.ConfigError, match=r"is (GPU memory )?on cuda:0 "):
            Transceiver(**{**kwargs, "device": device})
        assert agent.registrations == ()
    finally:
        agent.close()
