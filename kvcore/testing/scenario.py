"""A demo scenario: the spec of one run (:class:`DemoSpec`) and one rank's storage with its oracle view.

Shared by ``kvcore demo`` (:mod:`kvcore.tools.demo`), the two-host harness
(:mod:`kvcore.testing.host_peer`) and tests: a rank allocates its pools the way an
engine would, fills or verifies a request's bytes from the model-definition
oracle (:mod:`kvcore.testing.oracle`), and uses the same block and slot
assignment as every other rank of its instance. It never asks kvcore which
heads, layers or channels it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcore.testing.oracle import (
    conv_channels_of_rank,
    expected_conv,
    expected_ssm,
    expected_values,
    heads_of_rank,
    layers_of_rank,
    ssm_heads_of_rank,
)

__all__ = ["BOUNCE_MODES", "MAX_PROCESSES", "DemoSpec", "Rank", "assignment", "tp_pp_rank"]

#: ``--bounce`` choices: ``auto`` keeps the transceiver's own thresholds, ``on`` forces it, ``off`` disables it.
BOUNCE_MODES = ("auto", "on", "off")
#: Ranks a demo may start in all (both instances); each is a process importing torch.
MAX_PROCESSES = 16


@dataclass
class DemoSpec:
    """Everything one demo run needs; sent to every rank as msgpack."""

    backend: str = "auto"
    requests: int = 32
    tokens: int = 256
    layers: int = 8
    kv_heads: int = 8
    head_dim: int = 128
    tokens_per_block: int = 16
    dtype: str = "bfloat16"
    block_order: str = "head_major"  # the KV block order: "head_major" or "token_major" (flag --block-order)
    ctx_tp: int = 2
    ctx_pp: int = 1
    gen_tp: int = 2
    gen_pp: int = 1
    ctx_layers_per_pp: list[int] | None = None  # uneven PP split of the context instance, e.g. [3, 1]
    gen_layers_per_pp: list[int] | None = None
    ctx_attention_dp: bool = False
    gen_attention_dp: bool = False
    mla: bool = False  # kv_factor 1: one latent "head" of head_dim, replicated on every TP rank (kv_heads ignored)
    mamba: bool = False  # hybrid: Mamba2 state on the odd layers besides attention KV on every layer
    mamba_heads: int = 8
    mamba_head_dim: int = 16
    mamba_groups: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_ssm_dtype: str = "float32"
    bounce: str = "auto"
    layerwise: bool = False  # context ranks send the first half of their layers, then the rest (layers_ready)
    mode: str = "push"  # "pull": generation ranks read the context's blocks (transfer parameters carry them)
    cached_prefix_blocks: int = 0
    spare_blocks: int = 8  # at least one per DP group: the first-contact requests use them
    timeout_s: float = 120.0
    seed: int = 1234
    extra: dict[str, Any] = field(default_factory=dict)  # more TransceiverConfig fields, passed through
    poison: int = -1  # self-check: context ranks fill this request with another request's values (must fail)
    auth: bool = False  # CURVE on the control plane: a fresh key pair per instance (see instance_keys)
    auth_config: dict[str, dict[str, str]] = field(default_factory=dict)  # role -> auth_* fields (set by run_demo)
    two_hosts: bool = False  # context instance in namespaced host a, generation in host b (kvcore.tools.demo.two_hosts)

    # --- derived -------------------------------------------------------------------------------

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.tokens_per_block)

    @property
    def num_blocks(self) -> int:
        return self.requests * self.blocks_per_request + self.spare_blocks

    @property
    def model_kv_heads(self) -> int:
        """KV heads of the model: 1 latent buffer under MLA."""
        return 1 if self.mla else self.kv_heads

    @property
    def kv_factor(self) -> int:
        return 1 if self.mla else 2

    def side(self, role: str) -> tuple[int, int, list[int] | None, bool]:
        """``(tp, pp, layers_per_pp, attention_dp)`` of the instance playing ``role``."""
        if role == "context":
            return self.ctx_tp, self.ctx_pp, self.ctx_layers_per_pp, self.ctx_attention_dp
        return self.gen_tp, self.gen_pp, self.gen_layers_per_pp, self.gen_attention_dp

    def dp_size(self, role: str) -> int:
        tp, _, _, adp = self.side(role)
        return tp if adp else 1

    def dp_group(self, role: str, request: int) -> int:
        """The attention-DP group of instance ``role`` that owns ``request`` (round robin)."""
        return request % self.dp_size(role)

    @property
    def warm_ids(self) -> list[int]:
        """First-contact requests, one per DP group of either side (paid once per peer, measured apart)."""
        n = max(self.dp_size("context"), self.dp_size("generation"))
        return list(range(self.requests, self.requests + n))

    @property
    def num_slots(self) -> int:
        """Mamba state slots: one per request, warm-up ones included."""
        return self.requests + len(self.warm_ids)

    @property
    def mamba_layers(self) -> list[int]:
        return [layer for layer in range(self.layers) if layer % 2 == 1]

    @property
    def mamba_sections(self) -> tuple[int, int, int]:
        """Conv channels ``x|B|C``: ``heads*head_dim``, ``groups*d_state`` twice."""
        bc = self.mamba_groups * self.mamba_d_state
        return (self.mamba_heads * self.mamba_head_dim, bc, bc)

    def config_overrides(self, role: str | None = None) -> dict[str, Any]:
        """``TransceiverConfig`` fields this spec sets (bounce mode, passthrough extras, ``role``'s auth keys)."""
        out: dict[str, Any] = {"request_timeout_s": self.timeout_s}
        if self.bounce == "on":
            out.update(bounce_enabled=True, bounce_min_fragments=1)
        elif self.bounce == "off":
            out.update(bounce_enabled=False)
        out.update(self.extra)
        if role is not None:
            out.update(self.auth_config.get(role, {}))
        return out

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that cannot work."""
        if self.bounce not in BOUNCE_MODES:
            raise ValueError(f"bounce: expected one of {list(BOUNCE_MODES)}, got {self.bounce!r}")
        if self.mode not in ("push", "pull"):
            raise ValueError(f"mode: expected 'push' or 'pull', got {self.mode!r}")
        if self.mode == "pull" and self.layerwise:
            raise ValueError("mode 'pull' reads every layer at once: it cannot be combined with layerwise")
        if self.block_order not in ("head_major", "token_major"):
            raise ValueError(f"block_order: expected 'head_major' or 'token_major', got {self.block_order!r}")
        for name in (
            "requests",
            "tokens",
            "layers",
            "kv_heads",
            "head_dim",
            "tokens_per_block",
            "ctx_tp",
            "ctx_pp",
            "gen_tp",
            "gen_pp",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        procs = self.ctx_tp * self.ctx_pp + self.gen_tp * self.gen_pp
        if procs > MAX_PROCESSES:
            raise ValueError(f"ranks: expected at most {MAX_PROCESSES} processes in all, got {procs}")
        for role in ("context", "generation"):
            _, pp, lpp, _ = self.side(role)
            if lpp is not None and (len(lpp) != pp or sum(lpp) != self.layers or min(lpp) < 1):
                raise ValueError(
                    f"{role} layers_per_pp: expected {pp} positive entries summing to {self.layers}, got {lpp}"
                )
            if lpp is None and pp > self.layers:
                raise ValueError(f"{role} pp: expected <= layers ({self.layers}), got {pp}")
        if not 0 <= self.cached_prefix_blocks < self.blocks_per_request:
            raise ValueError(
                f"cached_prefix_blocks: expected 0 <= n < {self.blocks_per_request}, got {self.cached_prefix_blocks}"
            )
        if self.spare_blocks < len(self.warm_ids):
            raise ValueError(
                f"spare_blocks: expected >= {len(self.warm_ids)} (one per DP group), got {self.spare_blocks}"
            )
        if self.mamba and not self.mamba_layers:
            raise ValueError("mamba: expected at least 2 layers (Mamba state lives on the odd layers)")
        # two_hosts: kvcore.tools.demo.two_hosts.validate_two_hosts checks what a two-host run can honour.


# --- oracles: written from the model definition, independent of kvcore's arithmetic --------------


def tp_pp_rank(rank: int, tp_size: int) -> tuple[int, int]:
    """``(tp_rank, pp_rank)`` of an instance-global rank (TP-minor: ``rank = pp*tp_size + tp``)."""
    return rank % tp_size, rank // tp_size


# --- rank-local tensor access ------------------------------------------------------------------


def _logical(caches: Any, layout: str, blocks: Any) -> Any:
    """Gather a request's blocks from this rank's pools as ``[layers, kv, heads, tokens, dim]``."""
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.int64)
    if layout == "head_major":
        x = caches.index_select(0, idx)  # [nb, L, kv, H, tpb, D]
        nb, L, kv, H, tpb, D = x.shape
        return x.permute(1, 2, 3, 0, 4, 5).reshape(L, kv, H, nb * tpb, D)
    per_layer = []
    for c in caches:  # [blocks, kv, tpb, H, D]
        y = c.index_select(0, idx)  # [nb, kv, tpb, H, D]
        nb, kv, tpb, H, D = y.shape
        per_layer.append(y.permute(1, 3, 0, 2, 4).reshape(kv, H, nb * tpb, D))
    return torch.stack(per_layer)


def _scatter(caches: Any, layout: str, blocks: Any, values: Any) -> None:
    """Write ``[layers, kv, heads, tokens, dim]`` values into this rank's pools at ``blocks``."""
    import torch

    idx = torch.as_tensor(blocks, dtype=torch.int64)
    L, kv, H, T, D = values.shape
    nb = idx.numel()
    tpb = T // nb
    if layout == "head_major":
        x = values.reshape(L, kv, H, nb, tpb, D).permute(3, 0, 1, 2, 4, 5).contiguous()
        caches.index_copy_(0, idx, x)
        return
    for li, c in enumerate(caches):  # [blocks, kv, tpb, H, D]
        y = values[li].reshape(kv, H, nb, tpb, D).permute(2, 0, 3, 1, 4).contiguous()
        c.index_copy_(0, idx, y)


def _differ(got: Any, want: Any) -> int:
    """Elements whose bits differ (exact: compares the raw integers of equal-size dtypes)."""
    import torch

    if got.shape != want.shape:
        raise AssertionError(f"shape {list(got.shape)} expected {list(want.shape)}")
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return int((got.contiguous().view(bits) != want.contiguous().view(bits)).sum())


# --- orchestration messages ------------------------------------------------------------------------


def assignment(spec: DemoSpec, role: str) -> tuple[dict[int, Any], dict[int, int]]:
    """Each request's blocks and state slot on one instance (the same on every rank of it, as a block manager's)."""
    import numpy as np

    rng = np.random.default_rng(spec.seed + (0 if role == "context" else 1))
    perm = rng.permutation(spec.num_blocks)
    nbpr = spec.blocks_per_request
    blocks = {r: perm[r * nbpr : (r + 1) * nbpr] for r in range(spec.requests)}
    spare = perm[spec.requests * nbpr :]
    blocks.update({w: spare[i : i + 1] for i, w in enumerate(spec.warm_ids)})
    slots = rng.permutation(spec.num_slots)
    return blocks, {r: int(slots[r]) for r in range(spec.num_slots)}


class Rank:
    """One rank's storage, its oracle view of what it holds, and its request assignment."""

    def __init__(self, role: str, rank: int, spec: DemoSpec, agent: Any) -> None:
        import torch

        from kvcore.layout.builders import allocate_kv_cache, allocate_mamba_state, build_page_table
        from kvcore.layout.page import PageTable
        from kvcore.layout.topology import AttentionGeometry, MambaGeometry, Topology

        self.role, self.rank, self.spec = role, rank, spec
        tp, pp, lpp, adp = spec.side(role)
        self.topology = Topology.create(
            tp_size=tp, pp_size=pp, rank=rank, num_layers=spec.layers, layers_per_pp=lpp, attention_dp=adp
        )
        self.geometry = AttentionGeometry(
            num_layers=spec.layers,
            num_kv_heads=spec.model_kv_heads,
            head_dim=spec.head_dim,
            tokens_per_block=spec.tokens_per_block,
            dtype=spec.dtype,
            kv_factor=spec.kv_factor,
            block_order=spec.block_order,  # type: ignore[arg-type]  # checked by DemoSpec.validate
        )
        self.caches = allocate_kv_cache(self.topology, self.geometry, spec.num_blocks, allocator=agent.allocate_tensor)
        for c in self.caches if isinstance(self.caches, list) else [self.caches]:
            c.fill_(0)  # touch every page now, as an engine's warm pools would be: page faults are not transfer cost
        builder = "head_major_pool" if spec.block_order == "head_major" else "token_major_layers"
        tables = [build_page_table(builder, self.caches, topology=self.topology, geometry=self.geometry)]
        # The oracle's own view of this rank (never asks kvcore which heads/layers/channels it holds).
        tp_rank, pp_rank = tp_pp_rank(rank, tp)
        self.dp_rank = tp_rank if adp else 0
        self.layers = layers_of_rank(spec.layers, pp, pp_rank, lpp)
        self.heads = heads_of_rank(spec.model_kv_heads, tp, tp_rank, adp, spec.mla)
        self.dtype = getattr(torch, spec.dtype)
        self.conv: Any = None
        self.ssm: Any = None
        self.mamba_layers = [layer for layer in spec.mamba_layers if layer in self.layers] if spec.mamba else []
        # Model-wide, so every rank declares the same geometry whether or not it holds Mamba layers.
        self.mamba = (
            MambaGeometry(
                layers=tuple(spec.mamba_layers),
                conv_sections=spec.mamba_sections,
                d_conv=spec.mamba_d_conv,
                nheads=spec.mamba_heads,
                head_dim=spec.mamba_head_dim,
                d_state=spec.mamba_d_state,
                conv_dtype=spec.dtype,
                ssm_dtype=spec.mamba_ssm_dtype,
            )
            if spec.mamba
            else None
        )
        if self.mamba_layers:
            mg = self.mamba
            assert mg is not None
            self.conv, self.ssm = allocate_mamba_state(
                self.topology, mg, spec.num_slots, allocator=agent.allocate_tensor
            )
            self.conv.fill_(0)
            self.ssm.fill_(0)
            tables.append(build_page_table("mamba_state", self.conv, self.ssm, topology=self.topology, geometry=mg))
            self.channels = conv_channels_of_rank(spec.mamba_sections, tp, tp_rank, adp)
            self.ssm_heads = ssm_heads_of_rank(spec.mamba_heads, tp, tp_rank, adp)
            self.ssm_dtype = getattr(torch, spec.mamba_ssm_dtype)
        self.page_table = tables[0] if len(tables) == 1 else PageTable.combine(tables)
        # Same block and slot assignment on every rank of an instance (as a real block manager would do),
        # different between the instances so addresses never line up by accident.
        self.blocks, self.slots = assignment(spec, role)

    def mine(self, ids: list[int] | range) -> list[int]:
        """The requests among ``ids`` that this rank's DP group handles."""
        return [r for r in ids if self.spec.dp_group(self.role, r) == self.dp_rank]

    def state_slot(self, request: int) -> int:
        return self.slots[request] if self.spec.mamba else -1

    def fill(self, request: int) -> None:
        """Context side: write the request's KV (all its tokens) and its Mamba state."""
        spec = self.spec
        tokens = range(spec.blocks_per_request * spec.tokens_per_block)
        source = request + 1 if request == spec.poison else request
        want = expected_values(source, self.layers, spec.kv_factor, self.heads, tokens, spec.head_dim, self.dtype)
        _scatter(self.caches, spec.block_order, self.blocks[request], want)
        if self.mamba_layers:
            slot = self.slots[request]
            self.conv[:, slot] = expected_conv(
                request, self.mamba_layers, self.channels, spec.mamba_d_conv - 1, self.dtype
            )
            self.ssm[:, slot] = expected_ssm(
                request, self.mamba_layers, self.ssm_heads, spec.mamba_head_dim, spec.mamba_d_state, self.ssm_dtype
            )

    def verify(self, request: int, received: bool) -> tuple[int, int, str]:
        """Generation side: ``(mismatching elements, verified bytes, first problem)`` for one request.

        A received request must hold the expected suffix and an untouched (zero)
        cached prefix; a request of another DP group must be untouched entirely.
        """
        import torch

        spec = self.spec
        skip = spec.cached_prefix_blocks if received else spec.blocks_per_request
        tpb = spec.tokens_per_block
        total = spec.blocks_per_request * tpb
        got = _logical(self.caches, spec.block_order, self.blocks[request])
        want = expected_values(
            request, self.layers, spec.kv_factor, self.heads, range(total), spec.head_dim, self.dtype
        )
        want[:, :, :, : skip * tpb] = 0
        bad = _differ(got, want)
        what = "KV" if bad else ""
        nbytes = got[:, :, :, skip * tpb :].numel() * got.element_size()
        if self.mamba_layers:
            slot = self.slots[request]
            conv_want = expected_conv(request, self.mamba_layers, self.channels, spec.mamba_d_conv - 1, self.dtype)
            ssm_want = expected_ssm(
                request, self.mamba_layers, self.ssm_heads, spec.mamba_head_dim, spec.mamba_d_state, self.ssm_dtype
            )
            if not received:
                conv_want, ssm_want = torch.zeros_like(conv_want), torch.zeros_like(ssm_want)
            for name, t, w in (
                ("conv state", self.conv[:, slot], conv_want),
                ("SSM state", self.ssm[:, slot], ssm_want),
            ):
                n = _differ(t, w)
                bad += n
                what = what or (name if n else "")
                if received:
                    nbytes += t.numel() * t.element_size()
        first = f"request {request} ({'received' if received else 'not received here'}): {bad} {what} elements differ"
        return bad, (nbytes if received else 0), (first if bad else "")
