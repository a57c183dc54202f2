"""Reading a request's KV rows out of vLLM's paged caches into its staging extent.

One contract, :meth:`LayerGroup.copy`: rows ``0..T-1`` of a request (through its block table) of a run of one
group's layers, into ``dst[layer, token]`` of the request's extent. Two implementations of it:

- the reference, on every device: per layer, one gather (:func:`take_rows` over :func:`row_index`) and one copy
  into the extent;
- on CUDA, one Triton kernel per run of layers (:mod:`tilert.connector.gather_triton`): it reads the rows through
  the block table and writes them straight into the extent, pinned host memory included (the kernel's stores
  cross PCIe themselves), so a run costs one launch of host time however many layers and tokens it holds, and no
  temporary on the GPU. ``benchmarks/check_connector_gather.py`` checks it against the reference on a GPU.

The kernel reads every cache of a group through the first one's address plus a per-layer difference, in 4-byte
words: a group whose caches cannot be addressed so (a row or a stride not a whole number of words, a row not
contiguous) uses the reference, as does a machine without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

log = structlog.get_logger("tilert.connector.gather")

INDEXER_SCALE_BYTES = 4  # one fp32 scale per token's fp8 key
WORD = 4  # the kernel moves 4-byte words


def row_index(kind: str, row_bytes: int, cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """What :func:`take_rows` reads for ``slots`` (block_id * block_size + offset) from a cache of this shape: the rows'
    numbers, or for the DSA indexer's block-major pages (per block, block_size fp8 keys of row_bytes-4 bytes, then
    block_size fp32 scales) each row's ``row_bytes`` byte offsets. Every layer of a group has the same shape: one
    index serves all of them."""
    if kind == "dsa_indexer":
        key_bytes = row_bytes - INDEXER_SCALE_BYTES
        block_bytes = cache[0].numel()
        bs = block_bytes // row_bytes
        base = (slots // block_size) * block_bytes
        offset = slots % block_size
        keys = (base + offset * key_bytes)[:, None] + torch.arange(key_bytes, device=slots.device)
        scales = (base + bs * key_bytes + offset * INDEXER_SCALE_BYTES)[:, None]
        return torch.cat([keys, scales + torch.arange(INDEXER_SCALE_BYTES, device=slots.device)], dim=1)
    rows = cache.shape.numel() // cache.shape[-1]
    if rows % block_size:
        raise ValueError(f"cache of {rows} rows is not a whole number of {block_size}-token blocks")
    return slots


def take_rows(kind: str, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The ``[T, row_bytes]`` uint8 rows that ``index`` (:func:`row_index`) names, from one layer's cache: one gather,
    which reads only those rows."""
    if kind == "dsa_indexer":
        return cache.take(index)
    rows = cache.reshape(-1, cache.shape[-1]).index_select(0, index)
    return rows if rows.dtype == torch.uint8 else rows.view(torch.uint8)


@dataclass
class RequestRows:
    """One request's rows in the paged caches (its block table), and what the copies derive from it, once."""

    block_ids: list[int]
    num_tokens: int
    block_size: int
    device: torch.device
    index: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> its row_index (the reference)
    _slots: torch.Tensor | None = None
    _blocks: torch.Tensor | None = None

    def slots(self) -> torch.Tensor:
        """Every token's slot (block_id * block_size + offset), int64 on the caches' device."""
        if self._slots is None:
            bs = self.block_size
            blocks = torch.tensor(self.block_ids, dtype=torch.long)
            self._slots = _to(self.device, (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)[: self.num_tokens])
        return self._slots

    def blocks(self) -> torch.Tensor:
        """The block table, int32 on the caches' device (the kernel's input)."""
        if self._blocks is None:
            self._blocks = _to(self.device, torch.tensor(self.block_ids, dtype=torch.int32))
        return self._blocks


def _to(device: torch.device, host: torch.Tensor) -> torch.Tensor:
    """``host`` on ``device``, without waiting for the work queued there: a GPU gets it from pinned memory (torch's
    caching host allocator keeps that until the copy ran), since from pageable memory the driver may first wait for
    the stream, i.e. for the whole forward queued so far."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Geometry:
    """Where a token's row lies in one block of a group's pages, in bytes: ``a_bytes`` at ``offset * a_stride``,
    then ``b_bytes`` at ``b_base + offset * b_stride`` (the DSA indexer's scale; none for MLA); blocks
    ``block_stride`` apart."""

    block_stride: int
    a_stride: int
    a_bytes: int
    b_base: int = 0
    b_stride: int = 0
    b_bytes: int = 0

    def words(self) -> tuple[int, ...] | None:
        """Every field in 4-byte words, or None when one is not a whole number of them."""
        fields = (self.block_stride, self.a_stride, self.a_bytes, self.b_base, self.b_stride, self.b_bytes)
        return None if any(f % WORD for f in fields) else tuple(f // WORD for f in fields)


def geometry(kind: str, row_bytes: int, cache: torch.Tensor) -> Geometry | None:
    """The group's page geometry from one of its caches, or None when its rows are not contiguous bytes."""
    size = cache.element_size()
    if cache.stride(-1) != 1:
        return None
    if kind == "dsa_indexer":  # uint8 [num_blocks, ...]: each block one contiguous page (keys, then scales)
        if cache.dim() < 2 or not cache[0].is_contiguous():
            return None
        key_bytes = row_bytes - INDEXER_SCALE_BYTES
        bs = cache[0].numel() // row_bytes
        return Geometry(cache.stride(0), key_bytes, key_bytes, bs * key_bytes, INDEXER_SCALE_BYTES, INDEXER_SCALE_BYTES)
    # MLA: [num_blocks, (1,) block_size, row]; a block's tokens along its one dimension of size above 1
    tokens = [d for d in range(1, cache.dim() - 1) if cache.shape[d] != 1]
    if cache.dim() < 3 or len(tokens) > 1 or cache.shape[-1] * size != row_bytes:
        return None
    token_stride = cache.stride(tokens[0]) if tokens else row_bytes // size
    return Geometry(cache.stride(0) * size, token_stride * size, row_bytes)


class LayerGroup:
    """One group's caches, by position, and the copy of a run of them into a request's extent."""

    def __init__(
        self, group: str, kind: str, row_bytes: int, caches: list[torch.Tensor], *, kernel: bool = True
    ) -> None:
        """``kernel=False``: the reference even on a GPU (to check the kernel against)."""
        self.group, self.kind, self.row_bytes, self.caches = group, kind, row_bytes, caches
        self._kernel: Any = None  # gather_triton.Kernel when the GPU path applies
        if kernel and caches and caches[0].is_cuda:
            self._kernel = self._gpu_kernel()

    def _gpu_kernel(self) -> Any:
        geo = geometry(self.kind, self.row_bytes, self.caches[0])
        words = geo.words() if geo is not None else None
        first = self.caches[0]
        if words is None or any(c.shape != first.shape or c.stride() != first.stride() for c in self.caches):
            log.warning("connector_gather_reference", group=self.group, reason="pages not addressable in words")
            return None
        try:
            from tilert.connector import gather_triton  # lazy: Triton exists only where vLLM runs on a GPU
        except ImportError as exc:
            log.warning("connector_gather_reference", group=self.group, reason=f"no Triton: {exc}")
            return None
        return gather_triton.Kernel(self.caches, words)

    @property
    def on_gpu_kernel(self) -> bool:
        return self._kernel is not None

    def copy(self, rows: RequestRows, dst: torch.Tensor, first: int, count: int) -> None:
        """Layers ``first .. first+count-1``'s rows of the request into ``dst[layer]`` (uint8 ``[layers, T,
        row_bytes]``: the group's view of the extent), queued on the current stream."""
        if self._kernel is not None:
            self._kernel.copy(rows.blocks(), rows.block_size, rows.num_tokens, dst, first, count)
            return
        index = rows.index.get(self.group)
        if index is None:
            index = row_index(self.kind, self.row_bytes, self.caches[0], rows.slots(), rows.block_size)
            rows.index[self.group] = index
        for position in range(first, first + count):
            dst[position].copy_(take_rows(self.kind, self.caches[position], index), non_blocking=True)
