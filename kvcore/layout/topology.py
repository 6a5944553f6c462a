"""What a rank's parallelism (TP/PP/CP sizes and ranks, attention DP) and a model's attention geometry look like.

Rank ordering (instance-global rank, CP-minor, as in TensorRT-LLM's current code)::

    rank = pp_rank * (tp_size * cp_size) + tp_rank * cp_size + cp_rank

Attention data parallelism (``attention_dp=True``) follows TensorRT-LLM: every TP
rank is its own DP group (``dp_size = tp_size``, ``dp_rank = tp_rank``), holds
all KV heads, and the TP group used for sharding attention state has size 1.

Context parallelism can be *described* (``cp_size > 1``) so that peers can say
what they run, but every planning function refuses it with ``TopologyError``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvcore.errors import LayoutError, TopologyError

__all__ = [
    "DTYPE_BYTES",
    "AttentionGeometry",
    "BlockOrder",
    "MambaGeometry",
    "Topology",
    "dtype_bytes",
    "dtype_name",
    "require_no_cp",
]

#: Element sizes of the dtypes a KV cache may use, by torch dtype name.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
}


def dtype_name(dtype: object, field: str = "dtype") -> str:
    """The name ``dtype`` stands for: a name as given (``torch.`` prefix dropped), or a ``torch.dtype``'s name.

    Raises ``LayoutError`` naming ``field`` for anything else, or a dtype a KV cache may not use.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    elif type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"; no torch import needed here
    else:
        raise LayoutError(
            f"{field}: expected a dtype name such as 'bfloat16' or a torch.dtype, got {type(dtype).__name__} {dtype!r}"
        )
    if name not in DTYPE_BYTES:
        raise LayoutError(f"{field}: expected one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of the dtype called ``dtype`` (a torch dtype name, ``torch.`` prefix allowed)."""
    return DTYPE_BYTES[dtype_name(dtype)]


def _check_range(field: str, value: int, size: int) -> None:
    if not 0 <= value < size:
        raise TopologyError(f"{field}: expected 0 <= {field} < {size}, got {value}")


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's place in its instance: TP/PP/CP sizes and ranks, attention DP, layers per PP stage.

    ``layers_per_pp[p]`` is the number of model layers PP stage ``p`` holds
    (uneven splits allowed, each >= 1); stage ``p`` holds global layers
    ``[sum(layers_per_pp[:p]), sum(layers_per_pp[:p+1]))``.
    """

    tp_size: int
    tp_rank: int
    pp_size: int
    pp_rank: int
    layers_per_pp: tuple[int, ...]
    cp_size: int = 1
    cp_rank: int = 0
    attention_dp: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "cp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name}: expected an integer >= 1, got {value!r}")
        _check_range("tp_rank", self.tp_rank, self.tp_size)
        _check_range("pp_rank", self.pp_rank, self.pp_size)
        _check_range("cp_rank", self.cp_rank, self.cp_size)
        layers = tuple(self.layers_per_pp)
        if len(layers) != self.pp_size:
            raise TopologyError(f"layers_per_pp: expected {self.pp_size} entries (pp_size), got {list(layers)}")
        if any(not isinstance(n, int) or n < 1 for n in layers):
            raise TopologyError(f"layers_per_pp: expected every stage to hold >= 1 layer, got {list(layers)}")
        if not isinstance(self.layers_per_pp, tuple):
            msgspec.structs.force_setattr(self, "layers_per_pp", layers)

    @classmethod
    def create(
        cls,
        tp_size: int,
        pp_size: int,
        rank: int,
        num_layers: int,
        layers_per_pp: list[int] | tuple[int, ...] | None = None,
        attention_dp: bool = False,
        cp_size: int = 1,
    ) -> Topology:
        """The topology of instance-global ``rank``; layers split evenly (earlier stages get the remainder)."""
        world = tp_size * pp_size * cp_size
        if not 0 <= rank < world:
            raise TopologyError(f"rank: expected 0 <= rank < {world} (tp*pp*cp), got {rank}")
        if layers_per_pp is None:
            if pp_size < 1 or num_layers < pp_size:
                raise TopologyError(f"num_layers: expected >= pp_size ({pp_size}), got {num_layers}")
            base, extra = divmod(num_layers, pp_size)
            layers_per_pp = [base + (1 if p < extra else 0) for p in range(pp_size)]
        elif sum(layers_per_pp) != num_layers:
            raise TopologyError(
                f"layers_per_pp: expected a sum of {num_layers} (num_layers), got {list(layers_per_pp)}"
            )
        return cls(
            tp_size=tp_size,
            tp_rank=(rank // cp_size) % tp_size,
            pp_size=pp_size,
            pp_rank=rank // (tp_size * cp_size),
            cp_size=cp_size,
            cp_rank=rank % cp_size,
            attention_dp=attention_dp,
            layers_per_pp=tuple(layers_per_pp),
        )

    @property
    def rank(self) -> int:
        """Instance-global rank: ``pp_rank*tp*cp + tp_rank*cp + cp_rank``."""
        return self.rank_of(self.pp_rank, self.tp_rank, self.cp_rank)

    def rank_of(self, pp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        """Instance-global rank of the rank at (pp_rank, tp_rank, cp_rank) in this instance."""
        return pp_rank * self.tp_size * self.cp_size + tp_rank * self.cp_size + cp_rank

    def with_rank(self, rank: int) -> Topology:
        """The topology of another rank of the same instance."""
        return Topology.create(
            self.tp_size,
            self.pp_size,
            rank,
            self.num_layers,
            self.layers_per_pp,
            attention_dp=self.attention_dp,
            cp_size=self.cp_size,
        )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size * self.cp_size

    @property
    def num_layers(self) -> int:
        return sum(self.layers_per_pp)

    @property
    def dp_size(self) -> int:
        """Attention DP groups: ``tp_size`` under attention DP, else 1."""
        return self.tp_size if self.attention_dp else 1

    @property
    def dp_rank(self) -> int:
        """This rank's attention DP group: ``tp_rank`` under attention DP, else 0."""
        return self.tp_rank if self.attention_dp else 0

    @property
    def tp_per_dp(self) -> int:
        """TP ranks sharing one attention DP group (1 under attention DP)."""
        return self.tp_size // self.dp_size

    @property
    def attention_tp(self) -> tuple[int, int]:
        """(size, rank) of the group attention state is sharded over: (1, 0) under attention DP."""
        return (1, 0) if self.attention_dp else (self.tp_size, self.tp_rank)

    def stage_range(self, pp_rank: int) -> tuple[int, int]:
        """Global layers ``[start, stop)`` of PP stage ``pp_rank``."""
        start = sum(self.layers_per_pp[:pp_rank])
        return start, start + self.layers_per_pp[pp_rank]

    @property
    def layer_range(self) -> tuple[int, int]:
        """Global layers ``[start, stop)`` this rank holds."""
        return self.stage_range(self.pp_rank)

    @property
    def num_local_layers(self) -> int:
        return self.layers_per_pp[self.pp_rank]


def require_no_cp(*topologies: Topology, what: str = "this operation") -> None:
    """Raise ``TopologyError`` if any topology uses context parallelism (not supported)."""
    for topo in topologies:
        if topo.cp_size != 1:
            raise TopologyError(
                f"cp_size: expected 1 ({what} does not support context parallelism), got {topo.cp_size}"
            )


#: One of the two orders of the axes inside one block of one layer's K (or V) buffer.
BlockOrder = Literal["head_major", "token_major"]


class AttentionGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Model-wide attention KV geometry: totals over the model, not per rank.

    ``kv_factor`` is 2 (K and V) or 1 (MLA: one latent buffer, replicated over TP).
    ``dtype`` is the element type's name (``"bfloat16"``); a ``torch.dtype`` is accepted and kept as its name.
    ``block_order`` is the order of the axes inside one block of one layer's buffer:
    ``head_major`` ``[heads, tokens, dim]`` or ``token_major`` ``[tokens, heads, dim]``.
    It travels under the wire key ``layout``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str
    kv_factor: int = 2
    block_order: BlockOrder = msgspec.field(default="head_major", name="layout")

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.kv_factor not in (1, 2):
            raise LayoutError(f"kv_factor: expected 1 (MLA) or 2 (K and V), got {self.kv_factor!r}")
        if self.kv_factor == 1 and self.num_kv_heads != 1:
            raise LayoutError(f"num_kv_heads: expected 1 with kv_factor=1 (MLA), got {self.num_kv_heads}")
        if self.block_order not in ("head_major", "token_major"):
            raise LayoutError(f"block_order: expected 'head_major' or 'token_major', got {self.block_order!r}")
        # A torch.dtype (as engines hold it) or a "torch."-prefixed name is kept, compared and sent as its name.
        name = dtype_name(self.dtype)
        if name is not self.dtype:
            msgspec.structs.force_setattr(self, "dtype", name)

    @property
    def is_mla(self) -> bool:
        return self.kv_factor == 1

    @property
    def element_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    def kv_heads_per_rank(self, topology: Topology) -> int:
        """KV heads one rank holds: total/TP, or 1 when TP exceeds the heads (GQA duplication: replicas).

        Under attention DP a rank holds all heads. MLA always holds its single latent "head".
        """
        size, _ = topology.attention_tp
        heads = self.num_kv_heads
        if self.is_mla:
            return 1
        if heads % size and size % heads:
            raise TopologyError(f"tp_size: expected a divisor or a multiple of num_kv_heads ({heads}), got {size}")
        return max(1, heads // size)

    def head_bytes(self) -> int:
        """Bytes of one KV head of one K or V buffer of one block: ``tokens_per_block*head_dim*element_bytes``."""
        return self.tokens_per_block * self.head_dim * self.element_bytes

    def buffer_bytes(self, topology: Topology) -> int:
        """Bytes of one K (or V) buffer of one layer in one block on this rank."""
        return self.kv_heads_per_rank(topology) * self.head_bytes()


class MambaGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """Model-wide Mamba2 / GDN state geometry (totals over the model; conv and SSM state are TP-sharded).

    Conv state per slot and layer holds the concatenated channel sections
    (``x|B|C`` for Mamba2, ``q|k|v`` for GDN), each sharded over TP on its own;
    SSM state per slot and layer is ``[nheads, head_dim, d_state]``, sharded by heads.

    ``n_groups`` (Mamba2) declares that ``conv_sections`` is ``x|B|C`` with B
    and C holding ``n_groups*d_state`` channels each. B and C are then sharded
    by whole groups: with ``n_groups >= TP`` each rank holds ``n_groups/TP``
    groups; with ``n_groups < TP`` each rank holds the one group its SSM heads
    belong to (group ``tp_rank*n_groups//TP``), so ranks replicate it. For
    ``n_groups == 1`` that is vLLM's rule (``extra_groups_for_head_shards``:
    every rank holds the whole group). ``n_groups=0`` (not declared) shards
    every section over TP.
    """

    layers: tuple[int, ...]
    conv_sections: tuple[int, ...]
    d_conv: int
    nheads: int
    head_dim: int
    d_state: int
    conv_dtype: str
    ssm_dtype: str
    n_groups: int = 0

    def __post_init__(self) -> None:
        if not self.conv_sections or any(s < 1 for s in self.conv_sections):
            raise LayoutError(f"conv_sections: expected non-empty positive channel counts, got {self.conv_sections}")
        for name in ("d_conv", "nheads", "head_dim", "d_state"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}: expected an integer >= 1, got {value!r}")
        if self.d_conv < 2:
            raise LayoutError(f"d_conv: expected >= 2, got {self.d_conv}")
        for field in ("conv_dtype", "ssm_dtype"):
            value = getattr(self, field)
            name = dtype_name(value, field)
            if name is not value:
                msgspec.structs.force_setattr(self, field, name)
        if not isinstance(self.layers, tuple):
            msgspec.structs.force_setattr(self, "layers", tuple(self.layers))
        if not isinstance(self.conv_sections, tuple):
            msgspec.structs.force_setattr(self, "conv_sections", tuple(self.conv_sections))
        if not isinstance(self.n_groups, int) or self.n_groups < 0:
            raise LayoutError(f"n_groups: expected an integer >= 0 (0: not declared), got {self.n_groups!r}")
        if self.n_groups:
            bc = self.n_groups * self.d_state
            if len(self.conv_sections) != 3 or self.conv_sections[1:] != (bc, bc):
                raise LayoutError(
                    f"conv_sections: expected (d_inner, n_groups*d_state, n_groups*d_state) = (x, {bc}, {bc}) "
                    f"with n_groups={self.n_groups}, got {list(self.conv_sections)}"
                )
            if self.nheads % self.n_groups:
                raise LayoutError(f"nheads: expected a multiple of n_groups {self.n_groups}, got {self.nheads}")

    def tp_shards(self, topology: Topology) -> int:
        """Shards of the head-sharded state (x channels, SSM heads) over the attention TP group (1 under attention DP)."""
        size, _ = topology.attention_tp
        sharded = self.conv_sections[:1] if self.n_groups else self.conv_sections
        for name, value in [("nheads", self.nheads)] + [(f"conv_sections[{i}]", s) for i, s in enumerate(sharded)]:
            if value % size:
                raise TopologyError(f"{name}: expected a multiple of the TP size {size}, got {value}")
        if self.n_groups:
            self.group_position(topology)
        return size

    def group_position(self, topology: Topology) -> tuple[int, int, int, int]:
        """``(num_shards, shard_index, num_replicas, replica_index)`` of this rank's B|C groups (``n_groups`` declared).

        ``num_shards = min(TP, n_groups)``; the surplus ranks are replicas. TP and
        ``n_groups`` must divide one another (``TopologyError`` otherwise).
        """
        if not self.n_groups:
            raise LayoutError("n_groups: expected a declared value (>= 1) for group sharding, got 0")
        size, rank = topology.attention_tp
        shards = min(size, self.n_groups)
        if size % shards or self.n_groups % shards:
            raise TopologyError(
                f"n_groups: expected a divisor or a multiple of the TP size {size}, got {self.n_groups}"
            )
        replicas = size // shards
        return shards, rank // replicas, replicas, rank % replicas

    def local_layers(self, topology: Topology) -> tuple[int, ...]:
        start, stop = topology.layer_range
        return tuple(layer for layer in self.layers if start <= layer < stop)

    def conv_section_channels(self, topology: Topology) -> tuple[int, ...]:
        """Per-rank channels of each conv section (B and C by whole groups when ``n_groups`` is declared)."""
        n = self.tp_shards(topology)
        if not self.n_groups:
            return tuple(s // n for s in self.conv_sections)
        shards = self.group_position(topology)[0]
        bc = self.n_groups // shards * self.d_state
        return (self.conv_sections[0] // n, bc, bc)

    def conv_section_bytes(self, topology: Topology) -> tuple[int, ...]:
        """Per-rank bytes of each conv section in one slot of one layer."""
        eb = dtype_bytes(self.conv_dtype)
        return tuple(c * (self.d_conv - 1) * eb for c in self.conv_section_channels(topology))

    def conv_dim(self, topology: Topology) -> int:
        """Conv channels one rank holds (vLLM's ``conv_dim // tp`` after ``extra_groups_for_head_shards``)."""
        return sum(self.conv_section_channels(topology))

    def conv_shape(self, topology: Topology) -> tuple[int, int]:
        """Channel-major conv state of one slot and layer: ``(conv_dim, d_conv-1)``."""
        return (self.conv_dim(topology), self.d_conv - 1)

    def ssm_shape(self, topology: Topology) -> tuple[int, int, int]:
        n = self.tp_shards(topology)
        return (self.nheads // n, self.head_dim, self.d_state)

    def ssm_head_bytes(self) -> int:
        return self.head_dim * self.d_state * dtype_bytes(self.ssm_dtype)
