"""Weights pulled into L2 ahead of the kernel that reads them (Hopper's bulk L2 prefetch).

A decode step alternates kernels that stream weights at the memory's bandwidth with kernels that are bound
by latency and read almost nothing (the attention core, the router's expert selection, the DSA top-k): while
those run, the memory sits idle. :func:`l2_prefetch` is one small kernel placed in the step's chain before
such a stretch: it asks the memory system for a later kernel's weights (``cp.async.bulk.prefetch.L2``, one
asynchronous request per thread and chunk) and ends at once, so the weights arrive in L2 while the
latency-bound kernels run, and the kernel that reads them finds them there.

Each tensor comes with the name of its *site* (what it is); only the sites in :data:`SITES` are fetched, so
the choice is measured in the whole step (``benchmarks/decode_speed.py --tune``) without touching the model.
The kernel reads nothing and writes nothing: results cannot depend on it. Under programmatic dependent
launch it issues its requests and lets the next kernel launch at once, then waits on its predecessor, so that
it ends after it and the chain's ordering stays transitive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_pdl import gdc_launch_dependents, gdc_wait

__all__ = ["l2_prefetch", "moe_eviction", "SITES", "ALL_SITES", "MOE_EVICT_FIRST"]

# The plan: sites fetched ahead, "wo" (attention's output projection, fetched before the attention core),
# "gate" (the router's gate, same place), "shared" (the shared experts' weights, fetched before the router),
# "wa_next" (the next layer's W_a / W_b, same place).
SITES: tuple[str, ...] = ()
ALL_SITES = ("wo", "gate", "shared", "wa_next")
# The experts' weight loads (each row read once a step) marked first to leave L2, so that they do not push out what
# was fetched for later.
MOE_EVICT_FIRST = False
CHUNK = 4096  # bytes of one prefetch request (one thread's)
WARPS = 1
SEGMENTS = 6  # tensors one launch covers (more: several launches)
_ALIGN = 16  # the bulk prefetch's address and size granularity


@triton.jit
def _segment(ptr, nbytes, c, CHUNK: tl.constexpr, PER: tl.constexpr):
    offs = (c * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(nbytes - offs, 0), CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr + offs, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(
    p0, n0, p1, n1, p2, n2, p3, n3, p4, n4, p5, n5, CHUNK: tl.constexpr, PER: tl.constexpr, PDL: tl.constexpr
):
    # grid (chunks of the largest segment / PER, segments): program (c, s) requests segment s's chunks c*PER ...
    c = tl.program_id(0)
    s = tl.program_id(1)
    if s == 0:
        _segment(p0, n0, c, CHUNK, PER)
    elif s == 1:
        _segment(p1, n1, c, CHUNK, PER)
    elif s == 2:
        _segment(p2, n2, c, CHUNK, PER)
    elif s == 3:
        _segment(p3, n3, c, CHUNK, PER)
    elif s == 4:
        _segment(p4, n4, c, CHUNK, PER)
    else:
        _segment(p5, n5, c, CHUNK, PER)
    if PDL:  # the next kernel may start now; this grid still ends after its predecessor (the chain's order)
        gdc_launch_dependents()
        gdc_wait()


def moe_eviction() -> str:
    """The L2 eviction policy of the experts' weight loads (a ``tl.load`` ``eviction_policy``)."""
    return "evict_first" if MOE_EVICT_FIRST else ""


def _span(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A flat byte view of ``t``'s elements, its start and length rounded inwards to the prefetch's grain."""
    b = t.reshape(-1).view(torch.uint8)
    skip = (-b.data_ptr()) % _ALIGN
    n = max(b.numel() - skip, 0)
    return b[skip:], n - n % _ALIGN


def l2_prefetch(tensors: list[torch.Tensor], sites: str) -> None:
    """Request into L2 each contiguous ``tensors[i]`` whose site (the i-th of the comma-separated ``sites``) is in
    :data:`SITES` (nothing else)."""
    named = zip(tensors, sites.split(","), strict=True)
    spans = [_span(t) for t, site in named if site in SITES and t.is_contiguous()]
    spans = [s for s in spans if s[1] > 0]
    for i in range(0, len(spans), SEGMENTS):
        _launch(spans[i : i + SEGMENTS])


def _launch(spans: list[tuple[torch.Tensor, int]]) -> None:
    """One kernel for up to :data:`SEGMENTS` spans (byte view, length); the unused segments are empty."""
    per = 32 * WARPS  # one request per thread
    most = max(n for _, n in spans)
    args: list = []
    for k in range(SEGMENTS):
        b, n = spans[k] if k < len(spans) else spans[0]
        args += [b, n if k < len(spans) else 0]
    grid = (triton.cdiv(triton.cdiv(most, CHUNK), per), len(spans))
    _prefetch_kernel[grid](*args, CHUNK=CHUNK, PER=per, num_warps=WARPS, **triton_pdl.kw())
