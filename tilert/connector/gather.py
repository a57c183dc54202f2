"""Reading a request's KV rows out of vLLM's paged caches into its staging extent.

The extent holds the groups one after the other (``mla``, then ``indexer``: as the offer lists them), each
``[layers, T, row_bytes]``. Its pieces are numbered *items*, decoder layer by decoder layer (layer 0's MLA rows,
layer 0's indexer rows, layer 1's ...), so that the layers a forward has completed are one run of items. One contract,
:meth:`KVCopier.copy`: a run of items, rows ``0..T-1`` of the request through its block table, into the extent. Two
implementations of it:

- the reference, on every device: per item, one gather (:func:`take_rows` over :func:`row_index`) and one copy into
  the extent;
- on CUDA, one Triton kernel a run (:mod:`tilert.connector.gather_triton`): it reads the rows through the block table
  and writes them straight into the extent, pinned host memory included (the kernel's stores cross PCIe
  themselves), so a run costs one launch of host time however many layers and tokens it holds, and no temporary on
  the GPU. ``benchmarks/check_connector_gather.py`` checks it against the reference on a GPU.

The kernel reads every cache through the first one's address plus a difference, in 4-byte words: caches that cannot
be addressed so (a row or a stride not a whole number of words, rows not contiguous) use the reference, as does a
machine without Triton.
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

    def pinned_blocks(self) -> torch.Tensor:
        """The block table, int32 in pinned host memory: the kernel reads it there (a few bytes a program), with no
        copy to queue. The caller keeps it until the kernel has run (torch's caching host allocator would hand the
        memory out again as soon as the tensor is freed)."""
        if self._blocks is None:
            self._blocks = torch.tensor(self.block_ids, dtype=torch.int32).pin_memory()
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


@dataclass(frozen=True)
class Group:
    """One group of caches (``mla``, ``indexer``) in the extent's order: its layout kind, row bytes, caches by
    position."""

    name: str
    kind: str
    row_bytes: int
    caches: list[torch.Tensor]


class KVCopier:
    """Every group's caches, and the copy of a run of items (see the module's doc) into a request's extent."""

    def __init__(self, groups: list[Group], *, kernel: bool = True) -> None:
        """``kernel=False``: the reference even on a GPU (to check the kernel against)."""
        self.groups = groups
        depth = max((len(g.caches) for g in groups), default=0)
        self.items = [(gi, pos) for pos in range(depth) for gi, g in enumerate(groups) if pos < len(g.caches)]
        self.item_of = {(groups[gi].name, pos): i for i, (gi, pos) in enumerate(self.items)}
        group_base = [sum(len(g.caches) for g in groups[:gi]) for gi in range(len(groups))]
        self.chunk_of = [group_base[gi] + pos for gi, pos in self.items]  # the item's chunk (extent order)
        # bytes of the extent before each group's rows, and before each item's, per token of the request
        self._before = [sum(len(g.caches) * g.row_bytes for g in groups[:gi]) for gi in range(len(groups))]
        self.prefix = [self._before[gi] + pos * groups[gi].row_bytes for gi, pos in self.items]
        # the fewest blocks any cache has: a block id at or past it is refused (on a GPU, read out of bounds)
        self._num_blocks = min((g.caches[0].shape[0] for g in groups if g.caches), default=0)
        self._kernel: Any = None  # gather_triton.Kernel when the GPU path applies
        if kernel and groups and groups[0].caches and groups[0].caches[0].is_cuda:
            self._kernel = self._gpu_kernel()

    def _gpu_kernel(self) -> Any:
        words: list[tuple[int, ...]] = []
        for g in self.groups:
            geo = geometry(g.kind, g.row_bytes, g.caches[0])
            w = geo.words() if geo is not None else None
            first = g.caches[0]
            if w is None or any(c.shape != first.shape or c.stride() != first.stride() for c in g.caches):
                log.warning("connector_gather_reference", group=g.name, reason="pages not addressable in words")
                return None
            words.append(w)
        try:
            from tilert.connector import gather_triton  # lazy: Triton exists only where vLLM runs on a GPU
        except ImportError as exc:
            log.warning("connector_gather_reference", reason=f"no Triton: {exc}")
            return None
        caches = [self.groups[gi].caches[pos] for gi, pos in self.items]
        layout = [(*words[gi], self.prefix[i] // WORD) for i, (gi, _) in enumerate(self.items)]
        return gather_triton.Kernel(caches, layout)

    @property
    def on_gpu_kernel(self) -> bool:
        return self._kernel is not None

    def extent_chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        """The extent's chunks ``(offset, nbytes)``, one per cache layer, in byte order (groups one after the other)."""
        return [
            (num_tokens * (before + pos * g.row_bytes), num_tokens * g.row_bytes)
            for g, before in zip(self.groups, self._before, strict=True)
            for pos in range(len(g.caches))
        ]

    def copy(self, rows: RequestRows, extent: torch.Tensor, first: int, count: int) -> Any:
        """Items ``first .. first+count-1`` of the request into ``extent`` (its uint8 bytes), queued on the current
        stream. Returns what must outlive the copy (the pinned block table the kernel reads), or None."""
        t = rows.num_tokens
        if len(rows.block_ids) * rows.block_size < t or max(rows.block_ids, default=0) >= self._num_blocks:
            raise ValueError(
                f"a block table of {len(rows.block_ids)} blocks of {rows.block_size} tokens (highest "
                f"{max(rows.block_ids, default=0)}) for {t} tokens of a {self._num_blocks}-block cache"
            )
        if self._kernel is not None:
            blocks = rows.pinned_blocks()
            self._kernel.copy(blocks, rows.block_size, t, extent, first, count)
            return blocks
        for item in range(first, first + count):
            gi, pos = self.items[item]
            g = self.groups[gi]
            index = rows.index.get(g.name)
            if index is None:
                index = row_index(g.kind, g.row_bytes, g.caches[0], rows.slots(), rows.block_size)
                rows.index[g.name] = index
            dst = extent[t * self.prefix[item] : t * (self.prefix[item] + g.row_bytes)].view(t, g.row_bytes)
            dst.copy_(take_rows(g.kind, g.caches[pos], index), non_blocking=True)
        return None
