"""The GPU implementation of :meth:`tilert.connector.gather.LayerGroup.copy`: one Triton kernel per run of layers.

Program ``(i, j)`` copies tokens ``i*BT .. i*BT+BT-1`` of layer ``first + j``: each token's block from the block
table, its row's words from that block (:class:`~tilert.connector.gather.Geometry`, in words), into
``dst[first + j, token]``. Every cache of the group is addressed as the first one plus the layer's difference in
words (the caches are separate allocations of one shape), so one launch covers any run of layers. ``dst`` may be
pinned host memory: the kernel's stores then cross PCIe themselves (no temporary, no separate copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # words a program moves


@triton.jit(do_not_specialize=["dst", "first", "T", "block_size"])
def _gather_rows(
    src,  # int32 words of the group's first cache
    deltas,  # int64 [layers]: each cache's address less the first's, in words
    blocks,  # int32 [blocks]: the request's block table
    dst,  # int32 [layers, T, row_w]: the group's view of the request's extent
    first,
    T,
    block_size,
    block_w,
    a_stride,
    a_w,
    b_base,
    b_stride,
    b_w,
    BT: tl.constexpr,
    BW: tl.constexpr,
):
    layer = first + tl.program_id(1)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    w = tl.arange(0, BW)
    row_w = a_w + b_w
    live = t < T
    block = tl.load(blocks + t // block_size, mask=live, other=0).to(tl.int64)
    offset = (t % block_size).to(tl.int64)
    page = block * block_w
    a_at = (page + offset * a_stride)[:, None] + w[None, :]
    b_at = (page + b_base + offset * b_stride)[:, None] + (w[None, :] - a_w)
    at = tl.where(w[None, :] < a_w, a_at, b_at)
    mask = live[:, None] & (w[None, :] < row_w)
    values = tl.load(src + tl.load(deltas + layer) + at, mask=mask)
    out = (layer.to(tl.int64) * T + t.to(tl.int64))[:, None] * row_w + w[None, :]
    tl.store(dst + out, values, mask=mask)


class Kernel:
    """The copy for one group: its caches' word addresses fixed at start-up, one launch per run of layers."""

    def __init__(self, caches: list[torch.Tensor], words: tuple[int, ...]) -> None:
        self._src = caches[0].view(torch.uint8).view(torch.int32)
        base = caches[0].data_ptr()
        gaps = [c.data_ptr() - base for c in caches]
        if any(g % 4 for g in gaps):
            raise ValueError("the group's caches are not word-aligned to one another")
        self._deltas = torch.tensor([g // 4 for g in gaps], dtype=torch.int64, device=caches[0].device)
        self._block_w, self._a_stride, self._a_w, self._b_base, self._b_stride, self._b_w = words
        self._bw = triton.next_power_of_2(self._a_w + self._b_w)
        self._bt = max(1, TILE // self._bw)
        # compiled now, not in a request's first copy (the arguments that vary are not specialized on)
        scratch = torch.empty(1, 1, 4 * (self._a_w + self._b_w), dtype=torch.uint8, device=caches[0].device)
        self.copy(torch.zeros(1, dtype=torch.int32, device=caches[0].device), 1, 1, scratch, 0, 1)

    def copy(
        self, blocks: torch.Tensor, block_size: int, num_tokens: int, dst: torch.Tensor, first: int, count: int
    ) -> None:
        grid = (triton.cdiv(num_tokens, self._bt), count)
        _gather_rows[grid](
            self._src,
            self._deltas,
            blocks,
            dst.view(torch.int32),
            first,
            num_tokens,
            block_size,
            self._block_w,
            self._a_stride,
            self._a_w,
            self._b_base,
            self._b_stride,
            self._b_w,
            BT=self._bt,
            BW=self._bw,
            num_warps=4,
        )
