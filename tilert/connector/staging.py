"""The staging pool: one bounded buffer the worker stages claimed prompts' KV into, accounted by the scheduler.

The pool is allocated once, at start-up, in the worker process (``WorkerSide.register``) and registered with
the transport's sender there (an RDMA NIC reads only registered memory). The scheduler half, in vLLM's
EngineCore process, owns the *accounting*: it knows each claimed prompt's length and the bytes per token, so
it places each claimed request's extent (first fit over byte ranges, :class:`ExtentAllocator`) when it
builds the step's connector metadata, and a claim that finds no room is refused there, at once, with a
reason the router sees (``ClaimResult.busy``); prefill itself is never held back. The worker hands each
extent back after its sender's last use of it (success, abort, peer loss, timeout) through vLLM's
worker->scheduler channel (:class:`~tilert.connector.claims.TileRTWorkerMeta`).

Both halves compute the two numbers that must agree from the same inputs with the functions here:
:func:`bytes_per_token` (from vLLM's ``KVCacheConfig``; the worker also checks its cache tensors against it
at start-up) and :func:`pool_bytes`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

ALIGN = 4096  # every extent starts on a page boundary (and a DMA-friendly one on GPU)
DEFAULT_PROMPTS = 4  # the default pool holds this many prompts of the model's maximum length ...
DEFAULT_CAP_BYTES = 4 << 30  # ... but no more than this, unless a single such prompt needs more


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def bytes_per_token(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one prompt token occupies in the staging pool: every cache layer's row, back to back.

    A layer's row is its page (``block_size`` tokens, padding excluded) over ``block_size``: 576 x 2 for
    dense bf16 MLA, 656 for ``fp8_ds_mla``, 128 + 4 for the DSA indexer; exactly the ``row_bytes`` of the
    layouts the worker detects on the cache tensors (it checks so at start-up)."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        for name in group.layer_names:
            spec = per_layer[name] if per_layer else group.kv_cache_spec
            page = int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))
            if page % spec.block_size:
                raise ValueError(f"{name}: a page of {page} bytes is not a whole number of {spec.block_size} rows")
            total += page // spec.block_size
    if total <= 0:
        raise ValueError("the KV cache config names no cache layer")
    return total


def pool_bytes(configured: Any, per_token: int, max_model_len: int) -> int:
    """The pool's size: ``tilert_staging_bytes`` when configured, else room for ``DEFAULT_PROMPTS`` prompts
    of ``max_model_len`` tokens capped at ``DEFAULT_CAP_BYTES`` (but always room for one such prompt)."""
    if configured is not None:
        if isinstance(configured, bool) or not isinstance(configured, int) or configured <= 0:
            raise ValueError(f"tilert_staging_bytes must be a positive integer, not {configured!r}")
        return align_up(configured)
    if max_model_len <= 0:
        raise ValueError("cannot size the staging pool: no max_model_len and no tilert_staging_bytes")
    one = align_up(per_token * max_model_len)
    return max(one, min(DEFAULT_PROMPTS * one, DEFAULT_CAP_BYTES))


class ExtentAllocator:
    """First fit over the byte range ``[0, capacity)``, extents aligned to ``ALIGN``. Not thread-safe."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("an extent allocator needs a positive capacity")
        self.capacity = capacity
        self._starts: list[int] = [0]  # free ranges, sorted, disjoint, never adjacent
        self._ends: list[int] = [capacity]
        self._live: dict[int, int] = {}  # offset -> size of every allocated extent

    @property
    def used(self) -> int:
        return sum(self._live.values())

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def largest_free(self) -> int:
        return max((e - s for s, e in zip(self._starts, self._ends, strict=True)), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a fresh extent of ``nbytes``, or ``None`` when no free range is large enough."""
        size = align_up(max(nbytes, 1))
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= size:
                self._cut(i, start, start + size)
                return start
        return None

    def take(self, offset: int, nbytes: int) -> None:
        """Mark the extent at ``offset`` allocated (the worker mirrors the scheduler's placement); ``ValueError``
        when it is not wholly free: the two views disagree, and staging there would corrupt another request."""
        size = align_up(max(nbytes, 1))
        i = bisect.bisect_right(self._starts, offset) - 1
        if offset % ALIGN or i < 0 or offset + size > self._ends[i]:
            raise ValueError(
                f"staging extent [{offset}, {offset + size}) is not free in this pool of {self.capacity} bytes"
            )
        self._cut(i, offset, offset + size)

    def free(self, offset: int) -> int:
        """Return the extent at ``offset`` to the pool; its size. ``KeyError`` for an unknown offset."""
        size = self._live.pop(offset)
        start, end = offset, offset + size
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:  # merge with the free range before
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:  # and the one after
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        return size

    def _cut(self, i: int, start: int, end: int) -> None:
        """Allocate ``[start, end)`` out of free range ``i``."""
        lo, hi = self._starts[i], self._ends[i]
        pieces = [(a, b) for a, b in ((lo, start), (end, hi)) if b > a]
        self._starts[i : i + 1] = [a for a, _ in pieces]
        self._ends[i : i + 1] = [b for _, b in pieces]
        self._live[start] = end - start

    def extents(self) -> Iterable[tuple[int, int]]:
        return sorted(self._live.items())
