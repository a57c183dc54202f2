"""Buffers the GPU kernels keep across calls: split partials and the counters of the programs that sum them.

A buffer is made at the first call that asks for it, which the engine makes before it captures its step in a CUDA
graph (it warms the step up first), so every replay works in the same memory. One buffer per name, shape, dtype and
device.
"""

from __future__ import annotations

import torch

__all__ = ["BUFFERS", "buffer"]

BUFFERS: dict[tuple, torch.Tensor] = {}


def buffer(name: str, shape: tuple[int, ...], dtype: torch.dtype, device, zero: bool = False) -> torch.Tensor:
    """The kept buffer ``name`` of this shape; ``zero``: counters, made zeroed (every kernel that counts in them
    zeroes them again for the next launch)."""
    key = (name, tuple(shape), dtype, torch.device(device))
    t = BUFFERS.get(key)
    if t is None:
        t = BUFFERS[key] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return t
