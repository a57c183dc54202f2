# A copy of ops/triton_fp8.py before issue 10b (commit 9b3b81a), for benchmarks/micro_fp8.py comparisons only.
"""Block-FP8 weight kernels in Triton: GEMV (with its fused RMSNorm / residual) and the MoE experts.

Weights are e4m3 with a float32 scale per ``GN x GK`` group (``fp8.py``: ``GN``, ``GK`` divide 128 and are read
off the shapes; 128 x 128 for real models, ``GN = 1`` for the fused ``W_a`` / ``W_b``). Activations are bf16.
Each program streams e4m3 tiles (half the bytes of bf16) and applies the scales in registers: a ``[rows, BK]``
tile of products is summed per ``GK``-column group (``[rows, BK/GK, GK] -> [rows, BK/GK]``) and only those
partial sums are multiplied by their group's scale, so the scale costs one multiply per 128 weights. Structure,
grids and batch invariance as in :mod:`.triton_gemv` and :mod:`.triton_moe` (the bf16 kernels).

Numerics differ from the reference (which rounds the dequantised weight to bf16 before its matmul) only by
that rounding: accumulation is fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilert.engines.tilert.ops import triton_pdl
from tilert.engines.tilert.ops.triton_gemv import _row_rstd, gemv_config
from tilert.engines.tilert.ops.triton_pdl import pdl_begin

# Launch configs (rows, K tile, warps, stages). Not tuned on the GPU yet: each tile holds the bytes of the
# tuned bf16 kernel's tile (twice the e4m3 elements along K, or twice the rows where K is one expert's width).
FP8_UP_CFG = (8, 1024, 4, 4)  # bf16: triton_moe.UP_CFG (8, 512, 4, 4)
FP8_DOWN_CFG = (2, 2048, 4, 3)  # bf16: triton_moe.DOWN_CFG (1, 2048, 4, 3)

__all__ = ["gemv_fp8", "moe_up_fp8", "moe_down_fp8", "groups"]


def groups(w: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """(GN, GK) of an FP8 weight and its scale (as ``fp8.groups``)."""
    return w.shape[-2] // scale.shape[-2], w.shape[-1] // scale.shape[-1]


@triton.jit
def _fp8_tile(x_row, nw_ptr, rstd, w, s, offs_k, kmask, BN: tl.constexpr, NG: tl.constexpr, GK: tl.constexpr,
              HAS_NORM: tl.constexpr):
    """One ``[BN, BK]`` e4m3 tile against the activations: per-group sums ``[BN, BK/GK]`` times their scales."""
    xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
    if HAS_NORM:  # rounded to the activation dtype like the unfused reference
        g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * rstd * g).to(x_row.dtype.element_ty)
    prod = w.to(tl.float32) * xv.to(tl.float32)[None, :]
    return tl.sum(tl.reshape(prod, [BN, NG, GK]), 2) * s


@triton.jit
def _gemv_fp8_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, nw_ptr, res_ptr,
    N, K, KS, stride_xm, stride_wn, stride_sn, stride_ym, stride_rm, eps,
    BN: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, OUT_F32: tl.constexpr, PDL: tl.constexpr):
    NG: tl.constexpr = BK // GK
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + (offs_n // GN).to(tl.int64)[:, None] * stride_sn
    offs_g = tl.arange(0, NG)
    x_row = x_ptr + row * stride_xm
    # the first weight tile and its scales are static: fetch them before waiting on the previous kernel (PDL)
    offs_k = tl.arange(0, BK)
    kmask = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    s = tl.load(s_rows + offs_g[None, :], mask=nmask[:, None] & (offs_g < KS)[None, :], other=0.0)
    pdl_begin(PDL)
    rstd = 1.0
    if HAS_NORM:
        rstd = _row_rstd(x_row, K, eps, BK)
    acc = _fp8_tile(x_row, nw_ptr, rstd, w, s, offs_k, kmask, BN, NG, GK, HAS_NORM)
    for k0 in range(BK, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        gcol = k0 // GK + offs_g
        s = tl.load(s_rows + gcol[None, :], mask=nmask[:, None] & (gcol < KS)[None, :], other=0.0)
        acc += _fp8_tile(x_row, nw_ptr, rstd, w, s, offs_k, kmask, BN, NG, GK, HAS_NORM)
    out = tl.sum(acc, 1)
    if OUT_F32:
        tl.store(y_ptr + row * stride_ym + offs_n, out, mask=nmask)
    else:
        if HAS_RES:
            rp = res_ptr + row * stride_rm + offs_n
            r = tl.load(rp, mask=nmask, other=0.0).to(tl.float32)
            tl.store(rp, (r + out.to(res_ptr.dtype.element_ty).to(tl.float32)).to(res_ptr.dtype.element_ty), mask=nmask)
        else:
            tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=nmask)


def gemv_fp8(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm_w: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    out_f32: bool = False,
    cfg: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``rms(x)[n, K] @ (w * scale)[N, K]^T`` (``w`` e4m3); into ``residual`` in place when given."""
    assert x.dim() == 2 and x.stride(-1) == 1 and w.stride(-1) == 1 and scale.stride(-1) == 1
    nt, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and nt <= 16
    gn, gk = groups(w, scale)
    if cfg is None:  # the bf16 config of this shape, with a K tile of the same bytes (twice the elements)
        bn, bk, nw, ns = gemv_config(N, K, nt)
        bk = min(2 * bk, triton.next_power_of_2(K))
    else:
        bn, bk, nw, ns = cfg
    bk = max(bk, gk)
    if out_f32:
        y = torch.empty(nt, N, device=x.device, dtype=torch.float32)
    elif residual is not None:
        y = residual
    else:
        y = torch.empty(nt, N, device=x.device, dtype=x.dtype)
    res = residual if residual is not None else y
    _gemv_fp8_kernel[(nt, triton.cdiv(N, bn))](
        x, w, scale, y, norm_w if norm_w is not None else x, res,
        N, K, scale.shape[-1], x.stride(0), w.stride(0), scale.stride(0), y.stride(0), res.stride(0), eps,
        BN=bn, BK=bk, GN=gn, GK=gk, HAS_NORM=norm_w is not None, HAS_RES=residual is not None and not out_f32,
        OUT_F32=out_f32, num_warps=nw, num_stages=ns, **triton_pdl.kw())
    return y


@triton.jit
def _moe_up_fp8_kernel(
    x_ptr, nw_ptr, ids_ptr, w13_ptr, s13_ptr, act_ptr, D, I, KK, KS, stride_xm, stride_ids, stride_we, stride_wn,
    stride_se, stride_sn, stride_an, stride_ak, eps,
    BI: tl.constexpr, BK: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr):
    NG: tl.constexpr = BK // GK
    pdl_begin(PDL)
    r = tl.program_id(0)
    ib = tl.program_id(1)
    i = r // KK
    j = r % KK
    e = tl.load(ids_ptr + i * stride_ids + j)
    offs_i = ib * BI + tl.arange(0, BI)
    imask = offs_i < I
    out_ptr = act_ptr + i * stride_an + j * stride_ak + offs_i
    if e < 0:
        tl.store(out_ptr, tl.zeros([BI], dtype=tl.float32).to(act_ptr.dtype.element_ty), mask=imask)
    else:
        x_row = x_ptr + i * stride_xm
        if HAS_NORM:
            rstd = _row_rstd(x_row, D, eps, BK)
        wb = w13_ptr + e.to(tl.int64) * stride_we
        sb = s13_ptr + e.to(tl.int64) * stride_se
        g_rows = wb + offs_i.to(tl.int64)[:, None] * stride_wn
        u_rows = wb + (offs_i + I).to(tl.int64)[:, None] * stride_wn
        sg_rows = sb + (offs_i // GN).to(tl.int64)[:, None] * stride_sn
        su_rows = sb + ((offs_i + I) // GN).to(tl.int64)[:, None] * stride_sn
        offs_g = tl.arange(0, NG)
        acc_g = tl.zeros([BI, NG], dtype=tl.float32)
        acc_u = tl.zeros([BI, NG], dtype=tl.float32)
        for k0 in range(0, D, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < D
            xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
            if HAS_NORM:
                g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
                xv = (xv.to(tl.float32) * rstd * g).to(x_ptr.dtype.element_ty)
            xf = xv.to(tl.float32)[None, :]
            m2 = imask[:, None] & kmask[None, :]
            gcol = k0 // GK + offs_g
            sm = imask[:, None] & (gcol < KS)[None, :]
            wg = tl.load(g_rows + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(u_rows + offs_k[None, :], mask=m2, other=0.0).to(tl.float32)
            sg = tl.load(sg_rows + gcol[None, :], mask=sm, other=0.0)
            su = tl.load(su_rows + gcol[None, :], mask=sm, other=0.0)
            acc_g += tl.sum(tl.reshape(wg * xf, [BI, NG, GK]), 2) * sg
            acc_u += tl.sum(tl.reshape(wu * xf, [BI, NG, GK]), 2) * su
        gate = tl.sum(acc_g, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_u, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr, act.to(act_ptr.dtype.element_ty), mask=imask)


@triton.jit
def _moe_down_fp8_kernel(
    act_ptr, ids_ptr, wts_ptr, w2_ptr, s2_ptr, y_ptr, D, I, KK, KS, stride_an, stride_ak, stride_ids, stride_wts,
    stride_we, stride_wd, stride_se, stride_sd, stride_yn,
    BD: tl.constexpr, BI: tl.constexpr, GN: tl.constexpr, GK: tl.constexpr, HAS_RES: tl.constexpr,
    PDL: tl.constexpr):
    NG: tl.constexpr = BI // GK
    pdl_begin(PDL)
    i = tl.program_id(0)
    db = tl.program_id(1)
    offs_d = db * BD + tl.arange(0, BD)
    dmask = offs_d < D
    offs_g = tl.arange(0, NG)
    n_ch = tl.cdiv(I, BI)
    acc = tl.zeros([BD, NG], dtype=tl.float32)
    for t in range(0, KK * n_ch):
        j = t // n_ch
        i0 = (t - j * n_ch) * BI
        e = tl.load(ids_ptr + i * stride_ids + j)
        wj = tl.load(wts_ptr + i * stride_wts + j)
        offs_i = i0 + tl.arange(0, BI)
        imask = (offs_i < I) & ((offs_i * 0 + e) >= 0)  # an empty slot (-1) reads nothing
        e = tl.maximum(e, 0)
        a = tl.load(act_ptr + i * stride_an + j * stride_ak + offs_i, mask=imask, other=0.0).to(tl.float32)
        w = tl.load(w2_ptr + e.to(tl.int64) * stride_we + offs_d.to(tl.int64)[:, None] * stride_wd + offs_i[None, :],
                    mask=dmask[:, None] & imask[None, :], other=0.0)
        gcol = i0 // GK + offs_g
        s = tl.load(s2_ptr + e.to(tl.int64) * stride_se + (offs_d // GN).to(tl.int64)[:, None] * stride_sd
                    + gcol[None, :], mask=dmask[:, None] & (gcol < KS)[None, :], other=0.0)
        acc += tl.sum(tl.reshape(w.to(tl.float32) * (a * wj)[None, :], [BD, NG, GK]), 2) * s
    total = tl.sum(acc, 1)
    yp = y_ptr + i * stride_yn + offs_d
    if HAS_RES:
        r = tl.load(yp, mask=dmask, other=0.0).to(tl.float32)
        tl.store(yp, (r + total.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(yp, total.to(y_ptr.dtype.element_ty), mask=dmask)


def moe_up_fp8(x, ids, w13, s13, *, norm_w=None, eps=1e-6, cfg=None):
    """``act[n, k, I] = silu(gate) * up`` of each token's selected experts (e4m3 ``w13`` with ``s13``)."""
    n, D = x.shape
    KK = ids.shape[1]
    I = w13.shape[1] // 2
    assert w13.shape[2] == D and w13.stride(-1) == 1 and x.stride(-1) == 1 and s13.stride(-1) == 1
    gn, gk = groups(w13, s13)
    act = torch.empty(n, KK, I, device=x.device, dtype=x.dtype)
    BI, BK, nw, ns = cfg or FP8_UP_CFG
    BK = max(BK, gk)
    _moe_up_fp8_kernel[(n * KK, triton.cdiv(I, BI))](
        x, norm_w if norm_w is not None else x, ids, w13, s13, act, D, I, KK, s13.shape[-1], x.stride(0),
        ids.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), act.stride(0), act.stride(1),
        eps, BI=BI, BK=BK, GN=gn, GK=gk, HAS_NORM=norm_w is not None, num_warps=nw, num_stages=ns,
        **triton_pdl.kw())
    return act


def moe_down_fp8(act, ids, wts, w2, s2, *, residual=None, cfg=None):
    """``y[n, D] (+)= sum_j w_j * w2[e_j] @ act_j`` (e4m3 ``w2`` with ``s2``)."""
    n, KK, I = act.shape
    D = w2.shape[1]
    assert w2.shape[2] == I and w2.stride(-1) == 1 and s2.stride(-1) == 1
    gn, gk = groups(w2, s2)
    y = residual if residual is not None else torch.empty(n, D, device=act.device, dtype=act.dtype)
    BD, BI, nw, ns = cfg or FP8_DOWN_CFG
    BI = max(min(BI, triton.next_power_of_2(I)), gk)
    _moe_down_fp8_kernel[(n, triton.cdiv(D, BD))](
        act, ids, wts, w2, s2, y, D, I, KK, s2.shape[-1], act.stride(0), act.stride(1), ids.stride(0),
        wts.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        BD=BD, BI=BI, GN=gn, GK=gk, HAS_RES=residual is not None, num_warps=nw, num_stages=ns, **triton_pdl.kw())
    return y
