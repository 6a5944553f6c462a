"""The one place the transceiver plans a request: ``plan_transfer`` with the wire's ``-1`` (none) turned into None."""

from __future__ import annotations

from kvcore.layout.blocks import BlockIds
from kvcore.layout.mapping import FragmentPlan, MapperLookup, RankPlacement, plan_transfer

__all__ = ["plan_request"]


def _opt(value: int) -> int | None:
    return int(value) if value >= 0 else None


def plan_request(
    src: RankPlacement,
    dst: RankPlacement,
    src_block_ids: BlockIds,
    dst_block_ids: BlockIds,
    *,
    mappers: MapperLookup,
    src_state_slot: int = -1,
    dst_state_slot: int = -1,
    prompt_len: int = -1,
    layer_range: tuple[int, int] | None = None,
    merge: bool = True,
    cached_tokens: int = 0,
) -> FragmentPlan:
    """The fragments ``src`` writes into ``dst`` for one request; state slots and ``prompt_len`` use -1 for none;
    ``cached_tokens`` is the destination's stated cached prefix (0: none).

    The sender's write, the receiver's bounce pre-plan and the receiver's pull read all plan through here, so
    both sides of a request compute the same fragments from the same fields.
    """
    return plan_transfer(
        src,
        dst,
        src_block_ids,
        dst_block_ids,
        mappers=mappers,
        src_state_slot=_opt(src_state_slot),
        dst_state_slot=_opt(dst_state_slot),
        prompt_len=_opt(prompt_len),
        layer_range=layer_range,
        merge=merge,
        cached_tokens=cached_tokens,
    )
