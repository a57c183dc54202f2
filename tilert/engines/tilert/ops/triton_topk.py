"""Exact DSA top-k on the GPU: a multi-program two-pass radix select over fp32 scores, deterministic output.

Row ``i`` selects the ``K`` largest of ``scores[i, 0..positions[i]]`` (the indexer scores). Each score maps to
an order-preserving unsigned 32-bit key. Pass 1 histograms the keys' top 16 bits (65536 bins, plus a 256-bin
histogram of their top 8 bits so that one program finds the threshold bin reading 2 x 256 counters); pass 2
histograms the low 16 bits of the keys inside that bin. That fixes the exact threshold key ``T`` and how many
keys equal to ``T`` are taken; two compaction passes then write the winners at deterministic positions:
keys ``> T`` in index order, then the lowest-index keys ``== T``. No host sync, fixed grids: graph-capturable.

Launches (grid ``(chunks of CH scores, n)``):

1. ``hist_hi``: pass-1 histogram. On the DSA path it is fused into the indexer score kernel
   (``triton_mla.indexer_scores(..., topk_ws=...)``); ``topk`` runs it standalone for given scores.
2. ``hist_lo``: each program finds pass 1's threshold bin itself (2 x 256 counters: no launch of its own for that
   scan), then histograms the low 16 bits of its keys inside that bin (pass 2).
3. ``count``: each program finds the threshold key ``T`` and the number of keys ``== T`` taken from pass 2's
   counters the same way, then counts its keys ``> T`` and ``== T``.
4. ``write``: the compaction (rows with ``positions[i] + 1 <= K``: ``0..positions[i]`` then ``-1``).

A histogram is read by every program of the launch after the one that fills it, so it is zeroed one launch later
still: pass 1's by ``count``, pass 2's by ``write``; each replay then starts from zero (the workspace is
allocated zeroed). ``benchmarks/decode_speed.py`` times it against ``torch.topk`` in the same step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_pdl import pdl_begin

__all__ = ["TopkWorkspace", "topk", "select_from_hist"]

CH = 256  # scores per program in the per-chunk passes (a workspace keeps the value it was made with)
WARPS = 8  # warps per program of the standalone passes
BINS = 65536  # 16-bit digits
COARSE = 256


@triton.jit
def key64(v):
    """fp32 -> int64 key in [0, 2^32) with the same order as the floats."""
    b = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    return tl.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)


@triton.jit
def hist_update(digit, mask, fine_row, coarse_row):
    """Count 16-bit ``digit``s (int32) where ``mask`` into ``fine_row[65536]`` and their top 8 bits into
    ``coarse_row[256]`` (a local histogram first: few global atomics on the hot coarse bins)."""
    tl.atomic_add(fine_row + digit, 1, mask=mask, sem="relaxed")
    local = tl.histogram(digit >> 8, 256, mask=mask)
    tl.atomic_add(coarse_row + tl.arange(0, 256), local, mask=local > 0, sem="relaxed")


@triton.jit
def _chunk(s_ptr, pos_ptr, S, stride_s, CHUNK: tl.constexpr):
    """This program's row ``i``, its number of valid scores, the chunk's offsets, validity and keys."""
    i = tl.program_id(1)
    total = tl.minimum(tl.load(pos_ptr + i) + 1, S)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = offs < total
    key = key64(tl.load(s_ptr + i * stride_s + offs, mask=valid, other=0.0))
    return i, total, offs, valid, key


@triton.jit
def _threshold(state_ptr, i):
    """Row ``i``'s pass-1 bin and the exact threshold key ``T`` (int64)."""
    b = tl.load(state_ptr + i * 4).to(tl.int64)
    return b, (b << 16) | tl.load(state_ptr + i * 4 + 2).to(tl.int64)


@triton.jit
def _select_bin(cnt, need):
    """The bin (of 256 counts, high bins = large keys) holding the ``need``-th largest key, and how many keys
    are still needed from inside it."""
    bins = tl.arange(0, 256)
    ge = tl.cumsum(cnt, 0, reverse=True)
    gt = ge - cnt
    sel = (gt < need) & (ge >= need)
    return tl.sum(tl.where(sel, bins, 0), 0), need - tl.sum(tl.where(sel, gt, 0), 0)


@triton.jit
def _hist_hi_kernel(s_ptr, pos_ptr, fine_ptr, coarse_ptr, S, stride_s, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    i, total, offs, valid, key = _chunk(s_ptr, pos_ptr, S, stride_s, CHUNK)
    hist_update((key >> 16).to(tl.int32), valid, fine_ptr + i * 65536, coarse_ptr + i * 256)


@triton.jit
def _scan(fine_ptr, coarse_ptr, i, n, need, PASS: tl.constexpr):
    """Row ``i``'s threshold bin of pass ``PASS`` (16 bits) holding its ``need``-th largest key, and how many keys are
    still needed from inside it: the coarse counters, then the 256 fine ones under the coarse bin found."""
    bins = tl.arange(0, 256)
    cb, need = _select_bin(tl.load(coarse_ptr + (PASS * n + i) * 256 + bins), need)
    fb, need = _select_bin(tl.load(fine_ptr + (PASS * n + i).to(tl.int64) * 65536 + cb * 256 + bins), need)
    return cb * 256 + fb, need


@triton.jit
def _zero_row(coarse_ptr, i, n, PASS: tl.constexpr):
    """Program 0 of row ``i`` zeroes its pass-``PASS`` coarse counters (every reader of them has completed)."""
    if tl.program_id(0) == 0:
        tl.store(coarse_ptr + (PASS * n + i) * 256 + tl.arange(0, 256), tl.zeros([256], dtype=tl.int32))


@triton.jit
def _hist_lo_kernel(
    s_ptr,
    pos_ptr,
    fine_ptr,
    coarse_ptr,
    state_ptr,
    S,
    n,
    stride_s,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i, total, offs, valid, key = _chunk(s_ptr, pos_ptr, S, stride_s, CHUNK)
    b, need = _scan(fine_ptr, coarse_ptr, i, n, K + 0 * i, 0)
    if tl.program_id(0) == 0:  # for the launches after this one (this launch's programs each found it)
        tl.store(state_ptr + i * 4, b)
        tl.store(state_ptr + i * 4 + 1, need)
    hist_update(
        (key & 0xFFFF).to(tl.int32),
        valid & ((key >> 16).to(tl.int32) == b),
        fine_ptr + (n + i).to(tl.int64) * 65536,
        coarse_ptr + (n + i) * 256,
    )


@triton.jit
def _count_kernel(
    s_ptr,
    pos_ptr,
    fine_ptr,
    coarse_ptr,
    state_ptr,
    cnt_ptr,
    S,
    n,
    stride_s,
    NCHP: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i, total, offs, valid, key = _chunk(s_ptr, pos_ptr, S, stride_s, CHUNK)
    b = tl.load(state_ptr + i * 4).to(tl.int64)
    lo, take_eq = _scan(fine_ptr, coarse_ptr, i, n, tl.load(state_ptr + i * 4 + 1), 1)
    thr = (b << 16) | lo.to(tl.int64)
    c = tl.program_id(0)
    if c == 0:  # for the write launch
        tl.store(state_ptr + i * 4 + 2, lo)
        tl.store(state_ptr + i * 4 + 3, take_eq)
    tl.store(cnt_ptr + (i * 2) * NCHP + c, tl.sum((valid & (key > thr)).to(tl.int32), 0))
    tl.store(cnt_ptr + (i * 2 + 1) * NCHP + c, tl.sum((valid & (key == thr)).to(tl.int32), 0))
    tl.store(fine_ptr + i * 65536 + (key >> 16).to(tl.int32), 0, mask=valid)  # pass 1's bins: hist_lo read them
    _zero_row(coarse_ptr, i, n, 0)


@triton.jit
def _write_kernel(
    s_ptr,
    pos_ptr,
    fine_ptr,
    coarse_ptr,
    state_ptr,
    cnt_ptr,
    out_ptr,
    S,
    n,
    stride_s,
    stride_o,
    K: tl.constexpr,
    NCHP: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i, total, offs, valid, key = _chunk(s_ptr, pos_ptr, S, stride_s, CHUNK)
    b, thr = _threshold(state_ptr, i)
    in_bin = valid & ((key >> 16) == b)
    tl.store(fine_ptr + (n + i).to(tl.int64) * 65536 + (key & 0xFFFF).to(tl.int32), 0, mask=in_bin)  # count read them
    _zero_row(coarse_ptr, i, n, 1)
    orow = out_ptr + i * stride_o
    if total <= K:  # every valid row is selected: 0..total-1, then -1
        tl.store(orow + offs, tl.where(valid, offs, -1).to(tl.int32), mask=offs < K)
    else:
        take_eq = tl.load(state_ptr + i * 4 + 3)
        chunks = tl.arange(0, NCHP)
        before = chunks < tl.program_id(0)
        p_gt = tl.sum(tl.where(before, tl.load(cnt_ptr + (i * 2) * NCHP + chunks), 0), 0)
        p_eq = tl.sum(tl.where(before, tl.load(cnt_ptr + (i * 2 + 1) * NCHP + chunks), 0), 0)
        gtm = valid & (key > thr)
        eqm = valid & (key == thr)
        dst = p_gt + tl.cumsum(gtm.to(tl.int32), 0) - 1
        tl.store(orow + dst, offs.to(tl.int32), mask=gtm)
        rank = p_eq + tl.cumsum(eqm.to(tl.int32), 0) - 1
        tl.store(orow + (K - take_eq) + rank, offs.to(tl.int32), mask=eqm & (rank < take_eq))


class TopkWorkspace:
    """Histograms (pass 1 and 2), per-row state and per-chunk counts for ``n`` rows of ``S`` scores.

    One per call site shape; the kernels leave the histograms zeroed, so it is reused across replays."""

    def __init__(self, n: int, S: int, K: int, device: torch.device) -> None:
        self.n, self.S, self.K, self.ch = n, S, K, CH
        self.chunks = triton.cdiv(S, self.ch)
        self.write_chunks = triton.cdiv(max(S, K), self.ch)
        self.nchp = triton.next_power_of_2(self.write_chunks)
        self.fine = torch.zeros(2, n, BINS, dtype=torch.int32, device=device)
        self.coarse = torch.zeros(2, n, COARSE, dtype=torch.int32, device=device)
        self.state = torch.zeros(n, 4, dtype=torch.int32, device=device)
        self.counts = torch.zeros(n, 2, self.nchp, dtype=torch.int32, device=device)


_WS: dict = {}


def workspace(n: int, S: int, K: int, device: torch.device) -> TopkWorkspace:
    key = (n, S, K, device, CH)
    ws = _WS.get(key)
    if ws is None:
        ws = _WS[key] = TopkWorkspace(n, S, K, device)
    return ws


def select_from_hist(scores: torch.Tensor, positions: torch.Tensor, ws: TopkWorkspace, out=None) -> torch.Tensor:
    """Launches 2-4: ``scores [n, S]`` fp32 whose pass-1 histogram is already in ``ws`` -> ``[n, K]`` int32."""
    n, S = scores.shape
    K = ws.K
    assert scores.stride(-1) == 1 and (n, S) == (ws.n, ws.S)
    res = out if out is not None else torch.empty(n, K, device=scores.device, dtype=torch.int32)
    pdl = triton_pdl.kw()
    grid = (ws.chunks, n)
    _hist_lo_kernel[grid](
        scores,
        positions,
        ws.fine,
        ws.coarse,
        ws.state,
        S,
        n,
        scores.stride(0),
        K=K,
        CHUNK=ws.ch,
        num_warps=WARPS,
        **pdl,
    )
    _count_kernel[grid](
        scores,
        positions,
        ws.fine,
        ws.coarse,
        ws.state,
        ws.counts,
        S,
        n,
        scores.stride(0),
        NCHP=ws.nchp,
        CHUNK=ws.ch,
        num_warps=WARPS,
        **pdl,
    )
    _write_kernel[(ws.write_chunks, n)](
        scores,
        positions,
        ws.fine,
        ws.coarse,
        ws.state,
        ws.counts,
        res,
        S,
        n,
        scores.stride(0),
        res.stride(0),
        K=K,
        NCHP=ws.nchp,
        CHUNK=ws.ch,
        num_warps=WARPS,
        **pdl,
    )
    return res


def topk(scores: torch.Tensor, positions: torch.Tensor, k: int, out=None) -> torch.Tensor:
    """Exact top-``k`` index set of each row of fp32 ``scores [n, S]`` over columns ``0..positions[i]``:
    int32 ``[n, k]``, keys ``> T`` in index order then ties at ``T`` (lowest indices), ``-1`` padded when a
    row has ``<= k`` valid columns (then they are ``0..positions[i]`` in order)."""
    n, S = scores.shape
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    ws = workspace(n, S, k, scores.device)
    _hist_hi_kernel[(ws.chunks, n)](
        scores, positions, ws.fine, ws.coarse, S, scores.stride(0), CHUNK=ws.ch, num_warps=WARPS, **triton_pdl.kw()
    )
    return select_from_hist(scores, positions, ws, out=out)
