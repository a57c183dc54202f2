"""Block-FP8 weight kernels in Triton: GEMV (with its fused RMSNorm / residual, and an optional bf16 tail of
rows) and the MoE experts. The expert kernels are the engine's for 16-bit experts too: given no scales (``GK``
0) they skip the scaling and keep everything else (the early starts, split reductions and tiles below).

Weights are e4m3 with a float32 scale per ``GN x GK`` group (``fp8.py``: ``GN``, ``GK`` divide 128 and are read
off the shapes; 128 x 128 for real models, ``GN = 1`` for the fused ``W_a`` / ``W_b``). Activations are bf16.

Each program streams 2-D e4m3 tiles ``[rows, BK]`` (16 contiguous bytes per thread and row) and sums the
products of every 16-column chunk inside the thread (a register reshape ``[rows, BK/16, 16]``, no shuffles, no
layout change); each chunk sum is then scaled once (``V = 16`` divides ``GK``). Where a program's rows lie in one
scale-row group (``GN % rows == 0``: the experts and ``W_o``) the scales are folded into the activations instead
(``x[k] * s[k // GK]``, once per tile for all rows); ``W_a`` / ``W_b`` (one scale per row) scale the ``[rows,
BK/16]`` chunk sums. ``moe_down``'s tile is ``[SB, BD, BI]``: ``SB`` slots side by side.

Split reductions without a second launch (``moe_down`` over slot groups, optionally ``moe_up`` over ``D``): each
program writes fp32 partials, then (after a CTA barrier) counts itself in with a release/acquire atomic on a
counter of its output block; the program that arrives last reads the partials from L2 in a fixed order (so the
result does not depend on which program finishes last: deterministic and batch-invariant), writes the output and
zeroes the counter for the next launch (which waits on this one). Partials and counters are kept buffers.

Latency (a decode step is a chain of short kernels): each program issues its first weight tile before the PDL
wait (static data) and computes the RMSNorm statistics while it is in flight. No e4m3 tile is carried from one
loop iteration to the next (Triton then unpacks and repacks its bytes: measured slower); a larger K tile is
the way to more bytes in flight.
``moe_up``'s programs for the router's appended shared experts (``static``) do not wait on the router at all:
their expert is known and their input was written two kernels back (read from L2).
``moe_down`` reads its slots' expert ids and routing weights before the PDL wait too: they were written two
kernels back (the router), and ``moe_up`` (the kernel it waits on) passes its own PDL wait before it lets
``moe_down`` launch, so they are complete and visible. ``W_a``'s GEMV also reads the FP8 model's bf16
indexer ``weights_proj`` as plain tail rows (``tail``): one launch instead of a GEMV and a ``cat``.

Numerics differ from the reference (which rounds the dequantised weight to bf16 before its matmul) only by
that rounding and fp32 reassociation: accumulation is fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_gemv, triton_pdl, triton_prefetch
from .triton_gemv import _row_rstd, _tma_first_tile, rstd_block
from .triton_pdl import gdc_launch_dependents, pdl_begin
from .workspace import buffer

__all__ = ["gemv_fp8", "moe_up_fp8", "moe_down_fp8", "groups", "gemv_fp8_class", "gemv_fp8_config"]

# Launch configs. GEMV: (rows BN, K tile BK (e4m3 elements), warps) per weight class (the classes of
# triton_gemv.gemv_config: lm_head-sized, >= 64 MB in bf16, K a multiple of 1024, N >= 4096, other).
# moe_up: (rows BI, K tile BK, warps, splits of D); moe_down: (rows BD, slots SB, I tile BI, warps, split over
# slot groups); by hidden size: "small" D < 4096 (lite), "large" (V3.2), and "narrow" for a
# tensor-parallel rank's slice of the experts (I <= 512; moe_class). Chosen with benchmarks/micro_fp8.py
# (--rank for the narrow class) and decode_speed.py --tune on the H200: moe_down split one slot per program (64
# rows of the whole 256-wide slice at the narrow class); moe_up split over D is kept as an option (1 = off),
# slower at every shape.
FP8_GEMV_CFG = {
    "head": (16, 512, 8),
    "large": (8, 1024, 4),
    "k2048": (4, 2048, 8),  # K = 1024 / 2048 (W_a, W_o at lite dims): all before the PDL wait, one wave
    "k1024": (4, 4096, 8),  # W_a at V3.2 / GLM-5 dims (K 7168 / 6144): x read by fewer, wider programs
    "mid": (8, 512, 4),  # W_b (K = 1536): 3 tiles before the PDL wait; lite's whole W_b is 640 programs in one wave
    "small": (2, 1024, 4),
}
# GEMVs whose K fits in <= 4 tiles of at most FP8_PRE_BYTES weight bytes per thread (e4m3, or the bf16 tail)
# request all of them before the PDL wait and read x once (_gemv_fp8_rows_pre); 0 turns that off.
FP8_PRE_BYTES = 96
UP_RSTD_EARLY = True  # moe_up after the router: the routed programs' RMSNorm statistics before the PDL wait
# GEMVs whose e4m3 tiles the TMA brings into shared memory, NS - 1 tiles ahead (_gemv_fp8_rows_tma): (rows BN, K
# tile BK, stages NS, warps) per class of FP8_GEMV_CFG, or None for the register-fed kernels. The bytes a program
# keeps in flight then cost shared memory, not registers (Triton pipelines only the TMA's loads of a loop, not
# plain ones: num_stages changes nothing in the register-fed kernels). Every class is off until measured in the
# whole step (decode_speed.py --tune).
FP8_TMA_CFG: dict[str, tuple[int, int, int, int] | None] = dict.fromkeys(FP8_GEMV_CFG)
FP8_UP_CFG = {"small": (16, 256, 4, 1), "large": (8, 1024, 4, 1), "narrow": (8, 1024, 4, 1)}
# moe_up fed by the TMA (_up_tiles_tma): (rows BI, K tile BK, stages NS, warps) per class, or None (as FP8_TMA_CFG;
# no split over D, and no eviction hint: the TMA's loads take none). Off until measured.
FP8_UP_TMA_CFG: dict[str, tuple[int, int, int, int] | None] = dict.fromkeys(FP8_UP_CFG)
FP8_DOWN_CFG = {"small": (16, 1, 512, 4, True), "large": (16, 1, 1024, 8, True), "narrow": (64, 1, 256, 8, True)}
# The same kernels on bf16 / fp16 experts (no scales; a tile's K / I sizes count elements, 8 to a 16-byte load):
# the configs of the 16-bit weights, by the same classes.
BF16_UP_CFG = {"small": (8, 512, 4, 1), "large": (8, 512, 4, 1), "narrow": (8, 512, 4, 1)}
BF16_UP_TMA_CFG: dict[str, tuple[int, int, int, int] | None] = dict.fromkeys(BF16_UP_CFG)
BF16_DOWN_CFG = {"small": (8, 1, 512, 4, True), "large": (16, 1, 1024, 8, True), "narrow": (32, 1, 256, 8, True)}
VEC = 16  # e4m3 elements of one 16-byte load: the innermost, in-thread tile axis


def groups(w: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(GN, GK) of an FP8 weight and its scale (as ``fp8.groups``)."""
    return w.shape[-2] // scale.shape[-2], w.shape[-1] // scale.shape[-1]


def gemv_fp8_class(N: int, K: int) -> str:
    """The config class of an ``[N, K]`` e4m3 weight (the bf16 classes: keys of :data:`FP8_GEMV_CFG`)."""
    if N >= 65536:
        return "head"
    if N * K * 2 >= (64 << 20):
        return "large"
    if K % 1024 == 0:
        return "k2048" if K <= 2048 else "k1024"
    return "mid" if N >= 2048 else "small"


def gemv_fp8_config(N: int, K: int) -> tuple[int, int, int]:
    """(BN, BK, warps) of an ``[N, K]`` e4m3 weight (:data:`FP8_GEMV_CFG`)."""
    return FP8_GEMV_CFG[gemv_fp8_class(N, K)]


def moe_class(D: int, I: int) -> str:  # noqa: E741  (I: the expert width)
    """The MoE config class of hidden size ``D`` and expert width ``I``: ``"narrow"`` for a tensor-parallel
    rank's slice of a full-size model's experts (I <= 512), else by hidden size."""
    if I <= 512:
        return "narrow"
    return "large" if D >= 4096 else "small"


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


@triton.jit
def _x_tile(x_row, nw_ptr, rstd, offs, K, HAS_NORM: tl.constexpr, CG: tl.constexpr = False):
    """The activations at ``offs`` (any shape) in fp32, RMS-normalised and rounded to the activation dtype
    like the unfused reference when ``HAS_NORM``. ``CG``: read from L2, past L1 (activations a program reads
    without a PDL wait of its own)."""
    kmask = offs < K
    if CG:
        xv = tl.load(x_row + offs, mask=kmask, other=0.0, cache_modifier=".cg")
    else:
        xv = tl.load(x_row + offs, mask=kmask, other=0.0)
    if HAS_NORM:
        g = tl.load(nw_ptr + offs, mask=kmask, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * rstd * g).to(x_row.dtype.element_ty)
    return xv.to(tl.float32)


@triton.jit
def _gemv_fp8_tile(
    w,
    x_row,
    nw_ptr,
    rstd,
    s_row,
    s_rows,
    nmask,
    kk,
    kc,
    K,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """``[BN, C]`` partial sums of one e4m3 tile ``w [BN, C * V]`` at columns ``kk``, scaled."""
    xv = _x_tile(x_row, nw_ptr, rstd, kk, K, HAS_NORM)
    if ROW_BLOCK:
        xs = xv * tl.load(s_row + kk // GK, mask=kk < K, other=0.0)
        return tl.sum(tl.reshape(w.to(tl.float32) * xs[None, :], [BN, C, V]), 2)
    else:
        s = tl.load(s_rows + (kc // GK)[None, :], mask=nmask[:, None] & (kc < K)[None, :], other=0.0)
        return tl.sum(tl.reshape(w.to(tl.float32) * xv[None, :], [BN, C, V]), 2) * s


@triton.jit
def _gemv_fp8_rows(
    x_row,
    w_ptr,
    s_ptr,
    nw_ptr,
    pid_n,
    N,
    K,
    KS,
    stride_wn,
    stride_sn,
    eps,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    RB: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """``[BN]`` fp32 outputs of e4m3 rows ``pid_n * BN ...`` (waits on the previous kernel after its first tile).
    No e4m3 tile is carried across loop iterations (that unpacks and repacks its bytes): the first is used before
    the loop, each later one in the iteration that loads it."""
    BK: tl.constexpr = C * V
    ROW_BLOCK: tl.constexpr = GN % BN == 0  # all rows of the program share their scales: fold them into x
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_k = tl.arange(0, BK)
    kc = tl.arange(0, C) * V  # first column of each V-chunk
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + ((pid_n * BN) // GN).to(tl.int64) * stride_sn
    s_rows = s_ptr + (offs_n // GN).to(tl.int64)[:, None] * stride_sn  # [BN, 1]
    # the first weight tile is static: fetch it before waiting on the previous kernel (PDL)
    w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_begin(PDL)
    rstd = 1.0
    if HAS_NORM:
        rstd = _row_rstd(x_row, K, eps, RB)
    acc = _gemv_fp8_tile(w, x_row, nw_ptr, rstd, s_row, s_rows, nmask, offs_k, kc, K, BN, C, V, GK, ROW_BLOCK, HAS_NORM)
    for k0 in range(BK, K, BK):
        kk = k0 + offs_k
        w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)
        acc += _gemv_fp8_tile(
            w, x_row, nw_ptr, rstd, s_row, s_rows, nmask, kk, k0 + kc, K, BN, C, V, GK, ROW_BLOCK, HAS_NORM
        )
    return tl.sum(acc, 1)


@triton.jit
def _gemv_fp8_rows_tma(
    x_row,
    w_desc,
    s_ptr,
    nw_ptr,
    pid_n,
    N,
    K,
    stride_sn,
    eps,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    RB: tl.constexpr,
    NS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_gemv_fp8_rows` with its e4m3 tiles brought into shared memory by the TMA (``w_desc``: a tensor
    descriptor of the weight, block ``[BN, C * V]``), ``NS - 1`` tiles ahead of the one being summed: the bytes in
    flight no longer live in registers. The pipeline's first tiles are requested before the PDL wait, which the
    first iteration passes (it then computes the RMSNorm statistics); rows and columns past the weight read as
    zeros."""
    BK: tl.constexpr = C * V
    ROW_BLOCK: tl.constexpr = GN % BN == 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    offs_k = tl.arange(0, BK)
    kc = tl.arange(0, C) * V
    s_row = s_ptr + ((pid_n * BN) // GN).to(tl.int64) * stride_sn
    s_rows = s_ptr + (offs_n // GN).to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BN, C], dtype=tl.float32)
    rstd = tl.full([], 1.0, tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        w = w_desc.load([pid_n * BN, k0])
        rstd = _tma_first_tile(k0, rstd, x_row, K, eps, RB, HAS_NORM, PDL)
        acc += _gemv_fp8_tile(
            w, x_row, nw_ptr, rstd, s_row, s_rows, nmask, k0 + offs_k, k0 + kc, K, BN, C, V, GK, ROW_BLOCK, HAS_NORM
        )
    return tl.sum(acc, 1)


@triton.jit
def _gemv_bf16_rows(
    x_row,
    t_ptr,
    nw_ptr,
    pid_t,
    NT,
    K,
    stride_tn,
    eps,
    BN: tl.constexpr,
    BK: tl.constexpr,
    RB: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """``[BN]`` fp32 outputs of the plain (bf16) tail rows ``pid_t * BN ...``."""
    offs_n = pid_t * BN + tl.arange(0, BN)
    nmask = offs_n < NT
    w_rows = t_ptr + offs_n.to(tl.int64)[:, None] * stride_tn
    offs_k = tl.arange(0, BK)
    w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl_begin(PDL)
    rstd = 1.0
    if HAS_NORM:
        rstd = _row_rstd(x_row, K, eps, RB)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        xv = _x_tile(x_row, nw_ptr, rstd, k0 + offs_k, K, HAS_NORM)
        acc += w.to(tl.float32) * xv[None, :]
        kn = k0 + BK + offs_k
        w = tl.load(w_rows + kn[None, :], mask=nmask[:, None] & (kn < K)[None, :], other=0.0)
    return tl.sum(acc, 1)


@triton.jit
def _pre_w(w_rows, nmask, kk, K):
    return tl.load(w_rows + kk[None, :], mask=nmask[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _pre_s(s_row, s_rows, nmask, kk, kc, K, GK: tl.constexpr, ROW_BLOCK: tl.constexpr):
    """The scales of the e4m3 tile at columns ``kk``: ``[BK]`` (folded into x) or ``[BN, C]`` (per chunk)."""
    if ROW_BLOCK:
        return tl.load(s_row + kk // GK, mask=kk < K, other=0.0)
    else:
        return tl.load(s_rows + (kc // GK)[None, :], mask=nmask[:, None] & (kc < K)[None, :], other=0.0)


@triton.jit
def _pre_x(x_row, kk, K):
    return tl.load(x_row + kk, mask=kk < K, other=0.0).to(tl.float32)


@triton.jit
def _pre_norm(xv, rstd, g, dtype):
    return (xv * rstd * g.to(tl.float32)).to(dtype).to(tl.float32)


@triton.jit
def _pre_part(w, xv, s, BN: tl.constexpr, C: tl.constexpr, V: tl.constexpr, ROW_BLOCK: tl.constexpr):
    if ROW_BLOCK:
        return tl.sum(tl.reshape(w.to(tl.float32) * (xv * s)[None, :], [BN, C, V]), 2)
    else:
        return tl.sum(tl.reshape(w.to(tl.float32) * xv[None, :], [BN, C, V]), 2) * s


@triton.jit
def _gemv_fp8_rows_pre(
    x_row,
    w_ptr,
    s_ptr,
    nw_ptr,
    res_row,
    pid_n,
    N,
    K,
    stride_wn,
    stride_sn,
    eps,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    NK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_gemv_fp8_rows` for K in ``NK <= 4`` tiles: every weight tile, its scales and the norm weight are
    requested before the PDL wait (all static); after it ``x`` is read once (one L2 round trip) for both the
    RMSNorm statistics and the products, and the residual rows (``HAS_RES``) in the same round trip. Tiles are
    separate values (unrolled), none carried by a loop. Returns (outputs, residual rows or the outputs)."""
    BK: tl.constexpr = C * V
    ROW_BLOCK: tl.constexpr = GN % BN == 0
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    k0 = tl.arange(0, BK)
    kc = tl.arange(0, C) * V
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + ((pid_n * BN) // GN).to(tl.int64) * stride_sn
    s_rows = s_ptr + (offs_n // GN).to(tl.int64)[:, None] * stride_sn
    w0 = _pre_w(w_rows, nmask, k0, K)
    s0 = _pre_s(s_row, s_rows, nmask, k0, kc, K, GK, ROW_BLOCK)
    if NK > 1:
        w1 = _pre_w(w_rows, nmask, k0 + BK, K)
        s1 = _pre_s(s_row, s_rows, nmask, k0 + BK, kc + BK, K, GK, ROW_BLOCK)
    if NK > 2:
        w2 = _pre_w(w_rows, nmask, k0 + 2 * BK, K)
        s2 = _pre_s(s_row, s_rows, nmask, k0 + 2 * BK, kc + 2 * BK, K, GK, ROW_BLOCK)
    if NK > 3:
        w3 = _pre_w(w_rows, nmask, k0 + 3 * BK, K)
        s3 = _pre_s(s_row, s_rows, nmask, k0 + 3 * BK, kc + 3 * BK, K, GK, ROW_BLOCK)
    if HAS_NORM:
        g0 = tl.load(nw_ptr + k0, mask=k0 < K, other=0.0)
        if NK > 1:
            g1 = tl.load(nw_ptr + k0 + BK, mask=k0 + BK < K, other=0.0)
        if NK > 2:
            g2 = tl.load(nw_ptr + k0 + 2 * BK, mask=k0 + 2 * BK < K, other=0.0)
        if NK > 3:
            g3 = tl.load(nw_ptr + k0 + 3 * BK, mask=k0 + 3 * BK < K, other=0.0)
    pdl_begin(PDL)
    x0 = _pre_x(x_row, k0, K)
    if NK > 1:
        x1 = _pre_x(x_row, k0 + BK, K)
    if NK > 2:
        x2 = _pre_x(x_row, k0 + 2 * BK, K)
    if NK > 3:
        x3 = _pre_x(x_row, k0 + 3 * BK, K)
    if HAS_RES:
        r = tl.load(res_row + offs_n, mask=nmask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = x0 * x0
        if NK > 1:
            ss += x1 * x1
        if NK > 2:
            ss += x2 * x2
        if NK > 3:
            ss += x3 * x3
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        dt = x_row.dtype.element_ty
        x0 = _pre_norm(x0, rstd, g0, dt)
        if NK > 1:
            x1 = _pre_norm(x1, rstd, g1, dt)
        if NK > 2:
            x2 = _pre_norm(x2, rstd, g2, dt)
        if NK > 3:
            x3 = _pre_norm(x3, rstd, g3, dt)
    acc = _pre_part(w0, x0, s0, BN, C, V, ROW_BLOCK)
    if NK > 1:
        acc += _pre_part(w1, x1, s1, BN, C, V, ROW_BLOCK)
    if NK > 2:
        acc += _pre_part(w2, x2, s2, BN, C, V, ROW_BLOCK)
    if NK > 3:
        acc += _pre_part(w3, x3, s3, BN, C, V, ROW_BLOCK)
    out = tl.sum(acc, 1)
    if not HAS_RES:
        r = out
    return out, r


@triton.jit
def _gemv_bf16_rows_pre(
    x_row,
    t_ptr,
    nw_ptr,
    pid_t,
    NT,
    K,
    stride_tn,
    eps,
    BN: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_gemv_bf16_rows` for K in ``NK <= 4`` tiles, every tile and the norm weight requested before the
    PDL wait (as :func:`_gemv_fp8_rows_pre`)."""
    offs_n = pid_t * BN + tl.arange(0, BN)
    nmask = offs_n < NT
    w_rows = t_ptr + offs_n.to(tl.int64)[:, None] * stride_tn
    k0 = tl.arange(0, BK)
    w0 = _pre_w(w_rows, nmask, k0, K)
    if NK > 1:
        w1 = _pre_w(w_rows, nmask, k0 + BK, K)
    if NK > 2:
        w2 = _pre_w(w_rows, nmask, k0 + 2 * BK, K)
    if NK > 3:
        w3 = _pre_w(w_rows, nmask, k0 + 3 * BK, K)
    if HAS_NORM:
        g0 = tl.load(nw_ptr + k0, mask=k0 < K, other=0.0)
        if NK > 1:
            g1 = tl.load(nw_ptr + k0 + BK, mask=k0 + BK < K, other=0.0)
        if NK > 2:
            g2 = tl.load(nw_ptr + k0 + 2 * BK, mask=k0 + 2 * BK < K, other=0.0)
        if NK > 3:
            g3 = tl.load(nw_ptr + k0 + 3 * BK, mask=k0 + 3 * BK < K, other=0.0)
    pdl_begin(PDL)
    x0 = _pre_x(x_row, k0, K)
    if NK > 1:
        x1 = _pre_x(x_row, k0 + BK, K)
    if NK > 2:
        x2 = _pre_x(x_row, k0 + 2 * BK, K)
    if NK > 3:
        x3 = _pre_x(x_row, k0 + 3 * BK, K)
    if HAS_NORM:
        ss = x0 * x0
        if NK > 1:
            ss += x1 * x1
        if NK > 2:
            ss += x2 * x2
        if NK > 3:
            ss += x3 * x3
        rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
        dt = x_row.dtype.element_ty
        x0 = _pre_norm(x0, rstd, g0, dt)
        if NK > 1:
            x1 = _pre_norm(x1, rstd, g1, dt)
        if NK > 2:
            x2 = _pre_norm(x2, rstd, g2, dt)
        if NK > 3:
            x3 = _pre_norm(x3, rstd, g3, dt)
    acc = w0.to(tl.float32) * x0[None, :]
    if NK > 1:
        acc += w1.to(tl.float32) * x1[None, :]
    if NK > 2:
        acc += w2.to(tl.float32) * x2[None, :]
    if NK > 3:
        acc += w3.to(tl.float32) * x3[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_fp8_out(
    x_row,
    w_ptr,
    s_ptr,
    nw_ptr,
    res_row,
    pid_n,
    N,
    K,
    KS,
    stride_wn,
    stride_sn,
    eps,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    RB: tl.constexpr,
    NK: tl.constexpr,
    NS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """The ``[BN]`` fp32 outputs of e4m3 rows ``pid_n * BN ...`` and (``HAS_RES``) their residual rows, read the way
    the launch chose: all of K before the PDL wait (``NK`` tiles: the residual read with x), the TMA (``NS`` stages:
    ``w_ptr`` is the weight's descriptor), or the register-fed loop."""
    if NK > 0:
        out, r = _gemv_fp8_rows_pre(
            x_row,
            w_ptr,
            s_ptr,
            nw_ptr,
            res_row,
            pid_n,
            N,
            K,
            stride_wn,
            stride_sn,
            eps,
            BN,
            C,
            V,
            GK,
            GN,
            NK,
            HAS_NORM,
            HAS_RES,
            PDL,
        )
    else:
        if NS > 0:
            out = _gemv_fp8_rows_tma(
                x_row, w_ptr, s_ptr, nw_ptr, pid_n, N, K, stride_sn, eps, BN, C, V, GK, GN, RB, NS, HAS_NORM, PDL
            )
        else:
            out = _gemv_fp8_rows(
                x_row,
                w_ptr,
                s_ptr,
                nw_ptr,
                pid_n,
                N,
                K,
                KS,
                stride_wn,
                stride_sn,
                eps,
                BN,
                C,
                V,
                GK,
                GN,
                RB,
                HAS_NORM,
                PDL,
            )
        r = out
        if HAS_RES:
            offs_o = pid_n * BN + tl.arange(0, BN)
            r = tl.load(res_row + offs_o, mask=offs_o < N, other=0.0).to(tl.float32)
    return out, r


@triton.jit
def _gemv_fp8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    nw_ptr,
    res_ptr,
    t_ptr,
    N,
    K,
    KS,
    NB8,
    NT,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_rm,
    stride_tn,
    eps,
    BN: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    BT: tl.constexpr,
    RB: tl.constexpr,
    NK: tl.constexpr,
    NKT: tl.constexpr,
    NS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    OUT_F32: tl.constexpr,
    HAS_TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (rows, NB8 + tail blocks): programs < NB8 own BN e4m3 rows; the others BN rows of the bf16 tail,
    # written after the e4m3 rows (output columns N ... N + NT - 1). NK / NKT > 0: K in that many tiles, all
    # requested before the PDL wait (_gemv_fp8_rows_pre); 0: the loop (RB: its RMSNorm statistics' tile), fed by
    # the TMA through NS stages when NS > 0 (w_ptr is then the weight's tensor descriptor).
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    x_row = x_ptr + row * stride_xm
    e4m3_rows = True
    if HAS_TAIL:
        e4m3_rows = pid_n < NB8
    if e4m3_rows:
        out, r = _gemv_fp8_out(
            x_row,
            w_ptr,
            s_ptr,
            nw_ptr,
            res_ptr + row * stride_rm,
            pid_n,
            N,
            K,
            KS,
            stride_wn,
            stride_sn,
            eps,
            BN,
            C,
            V,
            GK,
            GN,
            RB,
            NK,
            NS,
            HAS_NORM,
            HAS_RES,
            PDL,
        )
        offs_o = pid_n * BN + tl.arange(0, BN)
        omask = offs_o < N
    else:  # the bf16 tail's rows (a tail excludes HAS_RES)
        if NKT > 0:
            out = _gemv_bf16_rows_pre(
                x_row, t_ptr, nw_ptr, pid_n - NB8, NT, K, stride_tn, eps, BN, BT, NKT, HAS_NORM, PDL
            )
        else:
            out = _gemv_bf16_rows(x_row, t_ptr, nw_ptr, pid_n - NB8, NT, K, stride_tn, eps, BN, BT, RB, HAS_NORM, PDL)
        offs_o = N + (pid_n - NB8) * BN + tl.arange(0, BN)
        omask = offs_o < N + NT
        r = out
    if OUT_F32:
        tl.store(y_ptr + row * stride_ym + offs_o, out, mask=omask)
    else:
        if HAS_RES:  # into y: the residual itself (in place) or an output apart from it
            yp = y_ptr + row * stride_ym + offs_o
            tl.store(yp, (r + out.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty), mask=omask)
        else:
            tl.store(y_ptr + row * stride_ym + offs_o, out.to(y_ptr.dtype.element_ty), mask=omask)


def gemv_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_w: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    out_f32: bool = False,
    tail: torch.Tensor | None = None,
    cfg: tuple[int, int, int] | None = None,
    tma: tuple[int, int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rms(x)[n, K] @ (w * scale)[N, K]^T`` (``w`` e4m3), then ``rms(x) @ tail[NT, K]^T`` (plain rows in
    ``x``'s dtype) in columns ``N ... N + NT - 1`` when ``tail`` is given; plus ``residual`` when given (no tail
    then), into ``out`` (default: ``residual``, in place; a tensor-parallel rank's all-reduce buffer).

    ``cfg`` (BN, BK, warps) sets the register-fed kernel's tile, ``tma`` (BN, BK, stages, warps) the TMA-fed one's;
    by default the weight's class picks (:data:`FP8_TMA_CFG`, else :data:`FP8_GEMV_CFG`). A weight the TMA cannot
    read (:func:`~.triton_gemv.tma_ready`) takes the register-fed kernel at its class's tile."""
    assert x.dim() == 2 and x.stride(-1) == 1 and w.stride(-1) == 1 and scale.stride(-1) == 1
    nt, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and nt <= 16
    assert tail is None or (residual is None and tail.shape[1] == K and tail.stride(-1) == 1 and tail.dtype == x.dtype)
    gn, gk = groups(w, scale)
    if tma is None and cfg is None:
        tma = FP8_TMA_CFG.get(gemv_fp8_class(N, K))
    if tma is not None and not triton_gemv.tma_ready(w):
        tma, cfg = None, None
    if tma is not None:
        bn, bk, ns, nw = tma
    else:
        (bn, bk, nw), ns = cfg or gemv_fp8_config(N, K), 0
    v = min(VEC, gk)
    bk = max(min(bk, triton.next_power_of_2(K)), v)
    NT = 0 if tail is None else tail.shape[0]
    assert out is None or (not out_f32 and tail is None and out.shape == (nt, N) and out.stride(-1) == 1)
    if out_f32:
        y = torch.empty(nt, N + NT, device=x.device, dtype=torch.float32)
    elif out is not None:
        y = out
    elif residual is not None:
        y = residual
    else:
        y = torch.empty(nt, N + NT, device=x.device, dtype=x.dtype)
    res = residual if residual is not None else y
    nb8 = triton.cdiv(N, bn)
    bt = max(16, min(triton.next_power_of_2(K), bk // 2))  # bf16 tail: a K tile of the same bytes
    nk = triton.cdiv(K, bk)
    nk = nk if nk <= 4 and bn * bk * nk <= FP8_PRE_BYTES * 32 * nw and not ns else 0  # all of K before the PDL wait
    nkt = triton.cdiv(K, bt)
    nkt = nkt if nkt <= 4 and bn * bt * 2 * nkt <= FP8_PRE_BYTES * 32 * nw else 0
    _gemv_fp8_kernel[(nt, nb8 + triton.cdiv(NT, bn))](
        x,
        TensorDescriptor(w, [N, K], [w.stride(0), 1], [bn, bk]) if ns else w,
        scale,
        y,
        norm_w if norm_w is not None else x,
        res,
        tail if tail is not None else x,
        N,
        K,
        scale.shape[-1],
        nb8,
        NT,
        x.stride(0),
        w.stride(0),
        scale.stride(0),
        y.stride(0),
        res.stride(0),
        tail.stride(0) if tail is not None else 0,
        eps,
        BN=bn,
        C=bk // v,
        V=v,
        GK=gk,
        GN=gn,
        BT=bt,
        RB=rstd_block(K, bk),
        NK=nk,
        NKT=nkt,
        NS=ns,
        HAS_NORM=norm_w is not None,
        HAS_RES=residual is not None and not out_f32,
        OUT_F32=out_f32,
        HAS_TAIL=tail is not None,
        num_warps=nw,
        num_stages=max(ns, 1),
        **triton_pdl.kw(),
    )
    return y


@triton.jit
def _row_rstd_cg(x_row_ptr, K, eps, BK: tl.constexpr):
    """``triton_gemv._row_rstd`` reading from L2, past L1 (see :func:`_x_tile`'s ``CG``)."""
    acc = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        v = tl.load(x_row_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _up_tile(
    wg,
    wu,
    x_row,
    nw_ptr,
    rstd,
    sg_row,
    su_row,
    kk,
    D,
    BI: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """``[BI, C]`` scaled partial sums of the gate and up tiles at columns ``kk`` (``GK == 0``: unscaled 16-bit
    weights)."""
    xv = _x_tile(x_row, nw_ptr, rstd, kk, D, HAS_NORM, True)
    if GK > 0:
        xg = xv * tl.load(sg_row + kk // GK, mask=kk < D, other=0.0)
        xu = xv * tl.load(su_row + kk // GK, mask=kk < D, other=0.0)
    else:
        xg = xv
        xu = xv
    return (
        tl.sum(tl.reshape(wg.to(tl.float32) * xg[None, :], [BI, C, V]), 2),
        tl.sum(tl.reshape(wu.to(tl.float32) * xu[None, :], [BI, C, V]), 2),
    )


@triton.jit
def _up_tiles_tma(
    w_desc,
    e,
    row_g,
    row_u,
    x_row,
    nw_ptr,
    rstd,
    need_rstd,
    sg_row,
    su_row,
    D,
    eps,
    BI: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    RB: tl.constexpr,
    NS: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """``[BI, C]`` scaled partial sums of expert ``e``'s gate rows from ``row_g`` and up rows from ``row_u``, over all
    of D, their e4m3 tiles brought into shared memory by the TMA (``w_desc``: ``w13``'s descriptor, block ``[1, BI,
    C * V]``) ``NS - 1`` tiles ahead; the RMSNorm statistics (``need_rstd``) while the first tiles are in flight."""
    BK: tl.constexpr = C * V
    offs_k = tl.arange(0, BK)
    acc_g = tl.zeros([BI, C], dtype=tl.float32)
    acc_u = tl.zeros([BI, C], dtype=tl.float32)
    r = rstd + tl.zeros([], dtype=tl.float32)
    for k0 in tl.range(0, D, BK, num_stages=NS):
        wg = tl.reshape(w_desc.load([e, row_g, k0]), [BI, BK])
        wu = tl.reshape(w_desc.load([e, row_u, k0]), [BI, BK])
        if HAS_NORM:
            if k0 == 0:
                if need_rstd:
                    r = _row_rstd_cg(x_row, D, eps, RB)
        pg, pu = _up_tile(wg, wu, x_row, nw_ptr, r, sg_row, su_row, k0 + offs_k, D, BI, C, V, GK, HAS_NORM)
        acc_g += pg
        acc_u += pu
    return acc_g, acc_u


@triton.jit
def _moe_up_fp8_kernel(
    x_ptr,
    nw_ptr,
    ids_ptr,
    w13_ptr,
    w13_desc,
    s13_ptr,
    act_ptr,
    ws_ptr,
    cnt_ptr,
    D,
    I,
    KK,
    KS,
    KPS,
    NIB,
    static_from,
    static_base,
    stride_xm,
    stride_ids,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_an,
    stride_ak,
    eps,
    BI: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    SPLIT: tl.constexpr,
    RB: tl.constexpr,
    HAS_NORM: tl.constexpr,
    X_READY: tl.constexpr,
    EV: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (n * k, I / BI, SPLIT); BI divides GN, so the program's gate rows share their scales, and its up rows
    # theirs. SPLIT > 1: program (r, ib, ks) sums D columns ks*KPS ... into fp32 partials ws[r, ks]; the last of
    # the SPLIT programs of (r, ib) to finish (a counter each) adds them in the order ks = 0 ... SPLIT-1, writes
    # act and zeroes its counter (as moe_down's slot groups).
    # Slots j >= static_from hold known experts (static_base + j - static_from: the shared experts the router
    # appends): their programs do not wait on the router (the previous kernel). Their input x was written two
    # kernels back (the router passes its own PDL wait, on that writer, before this kernel can launch), so it is
    # complete; it is read from L2 (CG). X_READY (static given: the router is the kernel before): the routed
    # slots' programs compute the RMSNorm statistics of x before their PDL wait too (one wide L2 read, RB).
    # NS > 0 (SPLIT 1, BI dividing I): the weight tiles come through the TMA (w13_desc), NS - 1 ahead.
    BK: tl.constexpr = C * V
    r = tl.program_id(0)
    ib = tl.program_id(1)
    ks = tl.program_id(2)
    i = r // KK
    j = r % KK
    x_row = x_ptr + i * stride_xm
    rstd = 1.0
    if j >= static_from:
        if PDL:
            gdc_launch_dependents()
        e = static_base + j - static_from
    else:
        if HAS_NORM and X_READY:  # x is complete (see above): its statistics while the router runs
            rstd = _row_rstd_cg(x_row, D, eps, RB)
        pdl_begin(PDL)  # the expert ids come from the previous kernel
        e = tl.load(ids_ptr + i * stride_ids + j)
    offs_i = ib * BI + tl.arange(0, BI)
    imask = offs_i < I
    out_ptr = act_ptr + i * stride_an + j * stride_ak + offs_i
    if e < 0:
        if ks == 0:
            tl.store(out_ptr, tl.zeros([BI], dtype=tl.float32).to(act_ptr.dtype.element_ty), mask=imask)
    else:
        sb = s13_ptr + e.to(tl.int64) * stride_se
        sg_row = sb + ((ib * BI) // GN).to(tl.int64) * stride_sn
        su_row = sb + ((ib * BI + I) // GN).to(tl.int64) * stride_sn
        if NS > 0:
            acc_g, acc_u = _up_tiles_tma(
                w13_desc,
                e,
                ib * BI,
                ib * BI + I,
                x_row,
                nw_ptr,
                rstd,
                not X_READY or j >= static_from,
                sg_row,
                su_row,
                D,
                eps,
                BI,
                C,
                V,
                GK,
                RB,
                NS,
                HAS_NORM,
            )
        else:
            wb = w13_ptr + e.to(tl.int64) * stride_we
            k_lo = ks * KPS
            k_hi = tl.minimum(k_lo + KPS, D)
            offs_k = k_lo + tl.arange(0, BK)
            g_rows = wb + offs_i.to(tl.int64)[:, None] * stride_wn
            u_rows = wb + (offs_i + I).to(tl.int64)[:, None] * stride_wn
            im2 = imask[:, None]
            # the first tiles are in flight while the RMSNorm statistics are computed
            wg = tl.load(g_rows + offs_k[None, :], mask=im2 & (offs_k < k_hi)[None, :], other=0.0, eviction_policy=EV)
            wu = tl.load(u_rows + offs_k[None, :], mask=im2 & (offs_k < k_hi)[None, :], other=0.0, eviction_policy=EV)
            if HAS_NORM:
                if not X_READY or j >= static_from:
                    rstd = _row_rstd_cg(x_row, D, eps, RB)
            acc_g, acc_u = _up_tile(wg, wu, x_row, nw_ptr, rstd, sg_row, su_row, offs_k, k_hi, BI, C, V, GK, HAS_NORM)
            for k0 in range(k_lo + BK, k_hi, BK):
                kk = k0 + tl.arange(0, BK)
                m2 = im2 & (kk < k_hi)[None, :]
                wg = tl.load(g_rows + kk[None, :], mask=m2, other=0.0, eviction_policy=EV)
                wu = tl.load(u_rows + kk[None, :], mask=m2, other=0.0, eviction_policy=EV)
                pg, pu = _up_tile(wg, wu, x_row, nw_ptr, rstd, sg_row, su_row, kk, k_hi, BI, C, V, GK, HAS_NORM)
                acc_g += pg
                acc_u += pu
        gate = tl.sum(acc_g, 1)
        up = tl.sum(acc_u, 1)
        last = True
        if SPLIT > 1:
            ws_r = ws_ptr + (r * SPLIT).to(tl.int64) * (2 * I) + offs_i
            tl.store(ws_r + ks * (2 * I), gate, mask=imask)
            tl.store(ws_r + ks * (2 * I) + I, up, mask=imask)
            tl.debug_barrier()  # every thread's partials are written before the (release) arrival below
            cnt = cnt_ptr + r * NIB + ib
            last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                gate = tl.load(ws_r, mask=imask, other=0.0, cache_modifier=".cg")
                up = tl.load(ws_r + I, mask=imask, other=0.0, cache_modifier=".cg")
                for kq in range(1, SPLIT):
                    gate += tl.load(ws_r + kq * (2 * I), mask=imask, other=0.0, cache_modifier=".cg")
                    up += tl.load(ws_r + kq * (2 * I) + I, mask=imask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(cnt, 0)  # zero for the next launch (which waits on this one: PDL)
        if last:
            gate = gate.to(act_ptr.dtype.element_ty).to(tl.float32)
            up = up.to(act_ptr.dtype.element_ty).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32) * up
            tl.store(out_ptr, act.to(act_ptr.dtype.element_ty), mask=imask)


@triton.jit
def _down_tile(
    ids_row,
    wts_row,
    act_row,
    w2_ptr,
    s2_ptr,
    w_d,
    dm3,
    dg,
    jb0,
    t,
    n_ch,
    KK,
    I,
    stride_ak,
    stride_we,
    stride_se,
    stride_sd,
    SB: tl.constexpr,
    BD: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    LOADED: tl.constexpr,
    EV: tl.constexpr,
    w_in,
):
    """Step ``t`` of ``moe_down``'s loop (slot block ``jb0 + t // n_ch``, I chunk ``t % n_ch``): loads the e4m3
    tile ``[SB, BD, BI]`` of its slots' experts (unless ``LOADED``: ``w_in``, fetched before the PDL wait) and
    returns the ``[SB, BD, C]`` partial sums."""
    BI: tl.constexpr = C * V
    tb = t // n_ch
    jb = jb0 + tb
    c0 = (t - tb * n_ch) * BI
    j = jb * SB + tl.arange(0, SB)
    e = tl.load(ids_row + j, mask=j < KK, other=-1)
    ok = e >= 0  # an empty slot (-1) reads nothing
    e = tl.maximum(e, 0).to(tl.int64)
    ii = c0 + tl.arange(0, BI)
    m2 = ok[:, None] & (ii < I)[None, :]  # [SB, BI]
    if LOADED:
        w = w_in
    else:
        w = tl.load(
            w2_ptr + e[:, None, None] * stride_we + w_d + ii[None, None, :],
            mask=dm3 & m2[:, None, :],
            other=0.0,
            eviction_policy=EV,
        )
    wj = tl.load(wts_row + j, mask=j < KK, other=0.0)
    a = tl.load(act_row + j[:, None] * stride_ak + ii[None, :], mask=m2, other=0.0)
    if GK > 0:
        s = tl.load(s2_ptr + e[:, None] * stride_se + dg * stride_sd + (ii // GK)[None, :], mask=m2, other=0.0)
        a = a.to(tl.float32) * s * wj[:, None]  # [SB, BI]
    else:
        a = a.to(tl.float32) * wj[:, None]
    return tl.sum(tl.reshape(w.to(tl.float32) * a[:, None, :], [SB, BD, C, V]), 3)


@triton.jit
def _moe_down_fp8_kernel(
    act_ptr,
    ids_ptr,
    wts_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    D,
    I,
    KK,
    KS,
    NDB,
    stride_an,
    stride_ak,
    stride_ids,
    stride_wts,
    stride_we,
    stride_wd,
    stride_se,
    stride_sd,
    stride_yn,
    BD: tl.constexpr,
    SB: tl.constexpr,
    C: tl.constexpr,
    V: tl.constexpr,
    GK: tl.constexpr,
    GN: tl.constexpr,
    G: tl.constexpr,
    HAS_RES: tl.constexpr,
    EV: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (n, D / BD, G); BD divides GN: the program's rows share each expert's scales (folded into act).
    # G == 1: each program sums every slot (SB side by side per tile). G > 1 (split over slots): program g sums
    # slots g*SB ... g*SB + SB - 1 into fp32 partials ws[i, g]; the last of the G programs of a row block to
    # finish (a counter per row block) adds them in the order g = 0 ... G-1 (deterministic, whatever the arrival
    # order), writes the rows and resets its counter for the next launch.
    BI: tl.constexpr = C * V
    i = tl.program_id(0)
    db = tl.program_id(1)
    g = tl.program_id(2)
    offs_d = db * BD + tl.arange(0, BD)
    dmask = offs_d < D
    dg = ((db * BD) // GN).to(tl.int64)
    w_d = offs_d.to(tl.int64)[None, :, None] * stride_wd  # tiles [SB, BD, BI]
    dm3 = dmask[None, :, None]
    ids_row = ids_ptr + i * stride_ids
    wts_row = wts_ptr + i * stride_wts
    act_row = act_ptr + i * stride_an
    n_ch = tl.cdiv(I, BI)
    if G == 1:
        n_t = tl.cdiv(KK, SB) * n_ch
    else:
        n_t = n_ch
    # ids were written two kernels back (module docstring): the first tile is fetched before the PDL wait
    j0 = g * SB + tl.arange(0, SB)
    e0 = tl.load(ids_row + j0, mask=j0 < KK, other=-1)
    ii0 = tl.arange(0, BI)
    m0 = (e0 >= 0)[:, None] & (ii0 < I)[None, :]
    w0 = tl.load(
        w2_ptr + tl.maximum(e0, 0).to(tl.int64)[:, None, None] * stride_we + w_d + ii0[None, None, :],
        mask=dm3 & m0[:, None, :],
        other=0.0,
        eviction_policy=EV,
    )
    pdl_begin(PDL)
    acc = _down_tile(
        ids_row,
        wts_row,
        act_row,
        w2_ptr,
        s2_ptr,
        w_d,
        dm3,
        dg,
        g,
        0,
        n_ch,
        KK,
        I,
        stride_ak,
        stride_we,
        stride_se,
        stride_sd,
        SB,
        BD,
        C,
        V,
        GK,
        True,
        EV,
        w0,
    )
    for t in range(1, n_t):
        acc += _down_tile(
            ids_row,
            wts_row,
            act_row,
            w2_ptr,
            s2_ptr,
            w_d,
            dm3,
            dg,
            g,
            t,
            n_ch,
            KK,
            I,
            stride_ak,
            stride_we,
            stride_se,
            stride_sd,
            SB,
            BD,
            C,
            V,
            GK,
            False,
            EV,
            w0,
        )
    total = tl.sum(tl.sum(acc, 2), 0)
    yp = y_ptr + i * stride_yn + offs_d
    if G == 1:
        if HAS_RES:
            r = tl.load(yp, mask=dmask, other=0.0).to(tl.float32)
            tl.store(yp, (r + total.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty), mask=dmask)
        else:
            tl.store(yp, total.to(y_ptr.dtype.element_ty), mask=dmask)
    else:
        ws_row = ws_ptr + (i * G).to(tl.int64) * D + offs_d
        tl.store(ws_row + g * D, total, mask=dmask)
        tl.debug_barrier()  # every thread's partial is written before the (release) arrival below
        cnt = cnt_ptr + i * NDB + db
        arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        if arrived == G - 1:  # the last program of this row block: sum the partials in a fixed order
            if HAS_RES:  # requested with the partials (one L2 round trip)
                r = tl.load(yp, mask=dmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tot = tl.load(ws_row, mask=dmask, other=0.0, cache_modifier=".cg")
            for gg in range(1, G):
                tot += tl.load(ws_row + gg * D, mask=dmask, other=0.0, cache_modifier=".cg")
            if HAS_RES:
                tl.store(yp, (r + tot.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty), mask=dmask)
            else:
                tl.store(yp, tot.to(y_ptr.dtype.element_ty), mask=dmask)
            tl.atomic_xchg(cnt, 0)  # zero for the next launch (which waits on this one: PDL)


def _expert_groups(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[int, int, int]:
    """(GN, GK, V) of an expert weight stack: its scale groups and the elements of one 16-byte load; a 16-bit
    weight without scales has GK 0 (the kernels' unscaled path) and one group of all its rows."""
    if scale is None:
        return w.shape[-2], 0, 16 // w.element_size()
    gn, gk = groups(w, scale)
    return gn, gk, min(VEC, gk)


def _expert_cfg(table: dict, fp8_table: dict, scale: torch.Tensor | None, D: int, I: int):  # noqa: E741
    """The launch config of an expert kernel: the e4m3 table's class entry (weights with scales), else the 16-bit
    one's."""
    return (fp8_table if scale is not None else table)[moe_class(D, I)]


def moe_up_fp8(x, ids, w13, s13, *, norm_w=None, eps=1e-6, cfg=None, tma=None, static=None):
    """``act[n, k, I] = silu(gate) * up`` of each token's selected experts (e4m3 ``w13`` with ``s13``, or a bf16 /
    fp16 ``w13`` with ``s13`` None: the same kernel without scales, tiles by :data:`BF16_UP_CFG`).
    ``static = (j0, e0)``: slots ``j >= j0`` hold experts ``e0 + j - j0`` whatever ``ids`` says (the shared experts
    that the router appends); their programs start without waiting on the kernel before (the router), whose own
    PDL wait must cover ``x``'s writer. ``cfg`` (BI, BK, warps, splits) sets the register-fed kernel's tile, ``tma``
    (BI, BK, stages, warps) the TMA-fed one's; by default the class picks (:data:`FP8_UP_TMA_CFG`, else
    :data:`FP8_UP_CFG`); weights the TMA cannot read, or rows it cannot tile whole, take the register-fed kernel."""
    n, D = x.shape
    KK = ids.shape[1]
    I = w13.shape[1] // 2
    assert w13.shape[2] == D and w13.stride(-1) == 1 and x.stride(-1) == 1
    assert s13 is None or s13.stride(-1) == 1
    gn, gk, v = _expert_groups(w13, s13)
    gn = min(gn, I)  # unscaled: the gate and the up half each one group
    assert I % gn == 0
    act = torch.empty(n, KK, I, device=x.device, dtype=x.dtype)
    if tma is None and cfg is None:
        tma = _expert_cfg(BF16_UP_TMA_CFG, FP8_UP_TMA_CFG, s13, D, I)
    if tma is not None and (I % min(tma[0], _pow2_floor(gn)) or not triton_gemv.tma_ready(w13)):
        tma, cfg = None, None
    if tma is not None:
        BI, BK, ns, nw = tma
        split = 1
    else:
        (BI, BK, nw, split), ns = cfg or _expert_cfg(BF16_UP_CFG, FP8_UP_CFG, s13, D, I), 0
    BI = min(BI, _pow2_floor(gn))
    BK = max(min(BK, triton.next_power_of_2(D)), v)
    kps = triton.cdiv(triton.cdiv(D, split), BK) * BK  # columns per split, whole K tiles
    split = triton.cdiv(D, kps)
    nib = triton.cdiv(I, BI)
    if split > 1:
        ws = buffer("up_ws", (n * KK, split, 2, I), torch.float32, x.device)
        cnt = buffer("up_cnt", (n * KK, nib), torch.int32, x.device, zero=True)
    else:
        ws, cnt = act, ids
    _moe_up_fp8_kernel[(n * KK, nib, split)](
        x,
        norm_w if norm_w is not None else x,
        ids,
        w13,
        TensorDescriptor(w13, list(w13.shape), [w13.stride(0), w13.stride(1), 1], [1, BI, BK]) if ns else w13,
        s13 if s13 is not None else w13,
        act,
        ws,
        cnt,
        D,
        I,
        KK,
        s13.shape[-1] if s13 is not None else 0,
        kps,
        nib,
        static[0] if static is not None else KK,
        static[1] if static is not None else 0,
        x.stride(0),
        ids.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0) if s13 is not None else 0,
        s13.stride(1) if s13 is not None else 0,
        act.stride(0),
        act.stride(1),
        eps,
        BI=BI,
        C=BK // v,
        V=v,
        GK=gk,
        GN=gn,
        SPLIT=split,
        RB=rstd_block(D, BK),
        HAS_NORM=norm_w is not None,
        X_READY=static is not None and UP_RSTD_EARLY,
        EV=triton_prefetch.moe_eviction(),
        NS=ns,
        num_warps=nw,
        num_stages=max(ns, 1),
        **triton_pdl.kw(),
    )
    return act


def moe_down_fp8(act, ids, wts, w2, s2, *, residual=None, out=None, cfg=None):
    """``y[n, D] = (residual +) sum_j w_j * w2[e_j] @ act_j`` (e4m3 ``w2`` with ``s2``, or a bf16 / fp16 ``w2`` with
    ``s2`` None: tiles by :data:`BF16_DOWN_CFG`) into ``out`` (default:
    ``residual``, in place). ``ids`` / ``wts`` must come from a kernel before the one that wrote ``act`` (the router
    before ``moe_up``): they are read before the PDL wait."""
    n, KK, I = act.shape
    D = w2.shape[1]
    assert w2.shape[2] == I and w2.stride(-1) == 1 and (s2 is None or s2.stride(-1) == 1)
    gn, gk, v = _expert_groups(w2, s2)
    if out is not None and residual is not None and out is not residual:
        out.copy_(residual)  # the kernel adds in place (a tensor-parallel rank 0's share on top of h)
        residual = out
    if out is not None:
        y = out
    else:
        y = residual if residual is not None else torch.empty(n, D, device=act.device, dtype=act.dtype)
    BD, SB, BI, nw, split = cfg or _expert_cfg(BF16_DOWN_CFG, FP8_DOWN_CFG, s2, D, I)
    BD = min(BD, _pow2_floor(gn))
    SB = min(SB, triton.next_power_of_2(KK))
    G = triton.cdiv(KK, SB) if split else 1
    BI = max(min(BI, triton.next_power_of_2(I)), v)
    ndb = triton.cdiv(D, BD)
    if G > 1:
        ws = buffer("down_ws", (n, G, D), torch.float32, act.device)
        cnt = buffer("down_cnt", (n, ndb), torch.int32, act.device, zero=True)
    else:
        ws, cnt = y, ids
    _moe_down_fp8_kernel[(n, ndb, G)](
        act,
        ids,
        wts,
        w2,
        s2 if s2 is not None else w2,
        y,
        ws,
        cnt,
        D,
        I,
        KK,
        s2.shape[-1] if s2 is not None else 0,
        ndb,
        act.stride(0),
        act.stride(1),
        ids.stride(0),
        wts.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0) if s2 is not None else 0,
        s2.stride(1) if s2 is not None else 0,
        y.stride(0),
        BD=BD,
        SB=SB,
        C=BI // v,
        V=v,
        GK=gk,
        GN=gn,
        G=G,
        HAS_RES=residual is not None,
        EV=triton_prefetch.moe_eviction(),
        num_warps=nw,
        num_stages=1,
        **triton_pdl.kw(),
    )
    return y
