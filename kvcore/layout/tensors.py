"""The tensor checks and allocation helpers every page-table builder shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvcore.errors import LayoutError
from kvcore.layout.topology import dtype_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["Allocator", "torch_dtype", "zeros", "check_tensor"]

#: ``allocator(shape, dtype) -> tensor``; e.g. a shared-memory agent's ``allocate_tensor``.
Allocator = Callable[[tuple[int, ...], "torch.dtype"], "torch.Tensor"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"bfloat16"``).

    Args:
        name: a dtype name kvcore knows (``torch.`` prefix allowed).

    Returns:
        The ``torch.dtype`` of that name.

    Raises:
        LayoutError: ``name`` is not a dtype kvcore knows.
    """
    import torch

    dtype_bytes(name)
    return getattr(torch, name.removeprefix("torch."))  # type: ignore[no-any-return]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor: the default allocator."""
    import torch

    return torch.zeros(shape, dtype=dtype)


def check_tensor(t: Any, expected: tuple[int, ...], dtype: str, what: str) -> None:
    """``LayoutError`` (prefixed ``what``) unless ``t`` has exactly this shape and dtype and is contiguous."""
    actual = tuple(t.shape)
    if actual != expected:
        raise LayoutError(f"{what}: expected shape {list(expected)}, got {list(actual)}")
    if str(t.dtype).removeprefix("torch.") != dtype.removeprefix("torch."):
        raise LayoutError(f"{what}: expected dtype {dtype}, got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise LayoutError(f"{what}: expected a contiguous tensor, got strides {list(t.stride())}")
