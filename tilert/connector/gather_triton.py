"""The GPU implementation of :meth:`tilert.connector.gather.KVCopier.copy`: one Triton kernel a run of items.

Program ``(i, j)`` copies tokens ``i*BT .. i*BT+BT-1`` of item ``first + j`` (a cache layer of one group): each
token's block from the block table, its row's words from that block (:class:`~tilert.connector.gather.Geometry`,
in words), to the item's place in the request's extent. Every cache is addressed as the first one plus its
difference in words (separate allocations), and each item's geometry is a row of a small table on the GPU, so one
launch covers any run of items of any group. The extent may be pinned host memory (the kernel's stores then cross
PCIe themselves: no temporary, no separate copy), and so may the block table (read a few bytes a program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # words a program moves at most
FIELDS = 8  # an item's row of the table: delta, block_w, a_stride, a_w, b_base, b_stride, b_w, prefix_w


@triton.jit(do_not_specialize=["blocks", "dst", "first", "T", "block_size"])
def _gather_rows(
    src,  # int32 words of the first item's cache
    items,  # int64 [items, FIELDS]: the cache's address less src's and its geometry, in words
    blocks,  # int32 [blocks]: the request's block table
    dst,  # int32 words of the request's extent
    first,
    T,
    block_size,
    BT: tl.constexpr,
    BW: tl.constexpr,
):
    row = items + (first + tl.program_id(1)) * 8
    delta = tl.load(row)
    block_w = tl.load(row + 1)
    a_stride = tl.load(row + 2)
    a_w = tl.load(row + 3)
    b_base = tl.load(row + 4)
    b_stride = tl.load(row + 5)
    b_w = tl.load(row + 6)
    prefix_w = tl.load(row + 7)
    row_w = a_w + b_w
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    w = tl.arange(0, BW)
    live = t < T
    block = tl.load(blocks + t // block_size, mask=live, other=0).to(tl.int64)
    offset = (t % block_size).to(tl.int64)
    page = block * block_w
    a_at = (page + offset * a_stride)[:, None] + w[None, :]
    b_at = (page + b_base + offset * b_stride)[:, None] + (w[None, :] - a_w)
    at = tl.where(w[None, :] < a_w, a_at, b_at)
    mask = live[:, None] & (w[None, :] < row_w)
    values = tl.load(src + delta + at, mask=mask)
    out = (T.to(tl.int64) * prefix_w + t.to(tl.int64) * row_w)[:, None] + w[None, :]
    tl.store(dst + out, values, mask=mask)


class Kernel:
    """The copy for one set of caches: their word addresses and geometries fixed at start-up, one launch a run."""

    def __init__(self, caches: list[torch.Tensor], layout: list[tuple[int, ...]]) -> None:
        """``caches[i]`` is item i's cache; ``layout[i]`` its geometry in words (block_w, a_stride, a_w, b_base,
        b_stride, b_w) and the words of the extent before its rows, per token."""
        device = caches[0].device
        self._src = caches[0].view(torch.uint8).view(torch.int32)
        base = caches[0].data_ptr()
        gaps = [c.data_ptr() - base for c in caches]
        if any(g % 4 for g in gaps):
            raise ValueError("the caches are not word-aligned to one another")
        table = [(g // 4, *geo) for g, geo in zip(gaps, layout, strict=True)]
        assert all(len(r) == FIELDS for r in table)
        self._items = torch.tensor(table, dtype=torch.int64, device=device)
        self._bw = triton.next_power_of_2(max(r[3] + r[6] for r in table))
        self._bt = max(1, TILE // self._bw)
        # compiled now, not in a request's first copy (the arguments that vary are not specialized on)
        scratch = torch.empty(sum(r[3] + r[6] for r in table), dtype=torch.int32, device=device)
        self.copy(torch.zeros(1, dtype=torch.int32, device=device), 1, 1, scratch, 0, len(table))

    def copy(
        self, blocks: torch.Tensor, block_size: int, num_tokens: int, extent: torch.Tensor, first: int, count: int
    ) -> None:
        grid = (triton.cdiv(num_tokens, self._bt), count)
        _gather_rows[grid](
            self._src,
            self._items,
            blocks,
            extent.view(torch.int32),
            first,
            num_tokens,
            block_size,
            BT=self._bt,
            BW=self._bw,
            num_warps=4,
        )
