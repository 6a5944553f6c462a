"""kvcore plugin module for kvcore-mixers: registers the re-sharding layout mappers (lazily)."""

from __future__ import annotations

from kvcore.extension.hookspecs import hookimpl
from kvcore.extension.registry import LayoutMapperRegistry

KVCORE_PLUGIN_API = 1

_MAPPERS = {
    "head_mismatch_head_major": (
        "HeadMajorShardMapper",
        "KV heads re-sharded, head-major blocks: one fragment per buffer",
    ),
    "head_mismatch_token_major": (
        "TokenMajorShardMapper",
        "KV heads re-sharded, token-major blocks: one fragment per token",
    ),
    "replicated": ("ReplicatedMapper", "replicated pools (MLA latent, index keys): whole buffers, one sender each"),
    "mamba_conv": ("SectionedMapper", "Mamba/GDN conv state: every section (x|B|C, q|k|v) re-sharded on its own"),
    "mamba_ssm": ("SsmHeadMapper", "Mamba SSM state re-sharded by heads, one slot per request"),
}


@hookimpl
def kvcore_register_layout_mappers(registry: LayoutMapperRegistry) -> None:
    """Register the mixers' mapper kinds; each is imported only when a view pair needs it."""
    for kind, (cls, description) in _MAPPERS.items():
        registry.add(kind, f"kvcore_mixers.mappers:{cls}", description=description)
