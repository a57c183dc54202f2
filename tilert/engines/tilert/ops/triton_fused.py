"""Model-specific fused kernels for the MLA(+DSA) decode layer, in Triton.

``mla_prep``: after the two input GEMVs (``a = [q_a | kv_a | idx_wk | idx_wproj](norm(h))`` and
``b = [q_b | idx_wq_b](norm(q_a))``), one launch does everything small that stands between them and
attention: per-head absorption ``q~_h = W_UK_h^T q_nope_h`` (programs over heads x 128-column blocks),
RoPE of ``q_pe`` and of the indexer queries, RMSNorm + RoPE of the new latent row and its write into the
KV cache at ``positions[i]``, LayerNorm + RoPE of the indexer key and its write into the indexer cache, and
the indexer head weights (scaled, fp32).

``mla_uv``: ``o[i, h*V:(h+1)*V] = W_UV_h @ o~[i, h]`` for all heads in one launch.

RoPE here is the half-split (rotate_half) form with fp32 cos/sin tables ``[S, R/2]``.

Block-FP8 ``kv_b`` (``fp8.py``): both kernels take its scale (``kv_b_scale``, groups ``KGN x KGK`` read off the
shapes) and multiply each e4m3 weight by its group's scale in registers (``HAS_SCALE``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_pdl import pdl_begin

__all__ = ["mla_prep", "mla_uv"]


@triton.jit
def _rope_pair(x1, x2, c, s):
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _mla_prep_kernel(
    a_ptr,
    b_ptr,
    pos_ptr,
    kvb_ptr,
    kvs_ptr,
    stride_ks,
    cos_ptr,
    sin_ptr,
    kvn_ptr,
    ikw_ptr,
    ikb_ptr,
    q_ptr,
    kv_ptr,
    ik_ptr,
    iq_ptr,
    iw_ptr,
    H,
    Hi,
    stride_a,
    stride_b,
    stride_q_n,
    stride_q_h,
    stride_kv,
    stride_ik,
    stride_iq_n,
    stride_iq_h,
    stride_iw,
    stride_cs,
    eps,
    iw_scale,
    QL: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    V: tl.constexpr,
    DI: tl.constexpr,
    BC: tl.constexpr,
    BP: tl.constexpr,
    HI_P2: tl.constexpr,
    HAS_INDEXER: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr = False,
    KGN: tl.constexpr = 128,
    KGK: tl.constexpr = 128,
    ROW_UNIFORM: tl.constexpr = False,
):
    i = tl.program_id(0)
    p = tl.program_id(1)
    NC: tl.constexpr = L // BC
    R2: tl.constexpr = R // 2
    pos = tl.load(pos_ptr + i)
    offs_r2 = tl.arange(0, R2)
    cs = tl.load(cos_ptr + pos * stride_cs + offs_r2)
    sn = tl.load(sin_ptr + pos * stride_cs + offs_r2)
    a_row = a_ptr + i * stride_a
    b_row = b_ptr + i * stride_b
    if p < H * NC:
        h = p // NC
        c = p % NC
        offs_p = tl.arange(0, BP)  # the head's P rows of W_UK, padded to a power of two (GLM-5: P = 192)
        mp = offs_p < P
        offs_c = c * BC + tl.arange(0, BC)
        w = tl.load(
            kvb_ptr + (h * (P + V) + offs_p).to(tl.int64)[:, None] * L + offs_c[None, :], mask=mp[:, None], other=0.0
        )  # static
        wf = w.to(tl.float32)
        if HAS_SCALE:
            if ROW_UNIFORM:  # the head's W_UK rows share one scale row: scale the column sums
                cs_ = tl.load(kvs_ptr + ((h * (P + V)) // KGN).to(tl.int64) * stride_ks + offs_c // KGK)
            else:  # e4m3 * its group's scale
                wf = wf * tl.load(
                    kvs_ptr
                    + ((h * (P + V) + offs_p) // KGN).to(tl.int64)[:, None] * stride_ks
                    + (offs_c // KGK)[None, :],
                    mask=mp[:, None],
                    other=0.0,
                )
        pdl_begin(PDL)
        qn = tl.load(b_row + h * (P + R) + offs_p, mask=mp, other=0.0).to(tl.float32)
        qt = tl.sum(wf * qn[:, None], 0)
        if HAS_SCALE:
            if ROW_UNIFORM:
                qt = qt * cs_
        qo = q_ptr + i * stride_q_n + h * stride_q_h
        tl.store(qo + offs_c, qt.to(q_ptr.dtype.element_ty))
        if c == 0:
            x1 = tl.load(b_row + h * (P + R) + P + offs_r2).to(tl.float32)
            x2 = tl.load(b_row + h * (P + R) + P + R2 + offs_r2).to(tl.float32)
            o1, o2 = _rope_pair(x1, x2, cs, sn)
            tl.store(qo + L + offs_r2, o1.to(q_ptr.dtype.element_ty))
            tl.store(qo + L + R2 + offs_r2, o2.to(q_ptr.dtype.element_ty))
    elif p == H * NC:
        pdl_begin(PDL)
        # latent row: RMSNorm(c_kv) | RoPE(k_pe)  -> kv cache row pos
        offs_l = tl.arange(0, L)
        ckv = tl.load(a_row + QL + offs_l).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(ckv * ckv, 0) / L + eps)
        g = tl.load(kvn_ptr + offs_l).to(tl.float32)
        ckv = (ckv * rstd).to(kv_ptr.dtype.element_ty).to(tl.float32) * g
        kv_row = kv_ptr + pos * stride_kv
        tl.store(kv_row + offs_l, ckv.to(kv_ptr.dtype.element_ty))
        x1 = tl.load(a_row + QL + L + offs_r2).to(tl.float32)
        x2 = tl.load(a_row + QL + L + R2 + offs_r2).to(tl.float32)
        o1, o2 = _rope_pair(x1, x2, cs, sn)
        tl.store(kv_row + L + offs_r2, o1.to(kv_ptr.dtype.element_ty))
        tl.store(kv_row + L + R2 + offs_r2, o2.to(kv_ptr.dtype.element_ty))
    elif p == H * NC + 1:
        pdl_begin(PDL)
        if HAS_INDEXER:
            # indexer key: LayerNorm then RoPE on its first R dims -> indexer cache row pos
            kbase = a_row + QL + L + R
            offs_d = tl.arange(0, DI)
            kf = tl.load(kbase + offs_d).to(tl.float32)
            mean = tl.sum(kf, 0) / DI
            var = tl.sum((kf - mean) * (kf - mean), 0) / DI
            rs = tl.rsqrt(var + eps)
            ik_row = ik_ptr + pos * stride_ik
            y1 = (
                (
                    (tl.load(kbase + offs_r2).to(tl.float32) - mean) * rs * tl.load(ikw_ptr + offs_r2).to(tl.float32)
                    + tl.load(ikb_ptr + offs_r2).to(tl.float32)
                )
                .to(ik_ptr.dtype.element_ty)
                .to(tl.float32)
            )
            y2 = (
                (
                    (tl.load(kbase + R2 + offs_r2).to(tl.float32) - mean)
                    * rs
                    * tl.load(ikw_ptr + R2 + offs_r2).to(tl.float32)
                    + tl.load(ikb_ptr + R2 + offs_r2).to(tl.float32)
                )
                .to(ik_ptr.dtype.element_ty)
                .to(tl.float32)
            )
            offs_k = tl.arange(0, DI - R)
            yr = (tl.load(kbase + R + offs_k).to(tl.float32) - mean) * rs * tl.load(ikw_ptr + R + offs_k).to(
                tl.float32
            ) + tl.load(ikb_ptr + R + offs_k).to(tl.float32)
            o1, o2 = _rope_pair(y1, y2, cs, sn)
            tl.store(ik_row + offs_r2, o1.to(ik_ptr.dtype.element_ty))
            tl.store(ik_row + R2 + offs_r2, o2.to(ik_ptr.dtype.element_ty))
            tl.store(ik_row + R + offs_k, yr.to(ik_ptr.dtype.element_ty))
            # head weights
            offs_hi = tl.arange(0, HI_P2)
            himask = offs_hi < Hi
            wv = tl.load(kbase + DI + offs_hi, mask=himask, other=0.0).to(tl.float32) * iw_scale
            tl.store(iw_ptr + i * stride_iw + offs_hi, wv, mask=himask)
    else:
        pdl_begin(PDL)
        if HAS_INDEXER:
            offs_hi = tl.arange(0, HI_P2)
            himask = offs_hi < Hi
            # indexer queries: RoPE on the first R dims of every head
            qb = b_row + H * (P + R) + offs_hi[:, None] * DI
            q1 = tl.load(qb + offs_r2[None, :], mask=himask[:, None], other=0.0).to(tl.float32)
            q2 = tl.load(qb + R2 + offs_r2[None, :], mask=himask[:, None], other=0.0).to(tl.float32)
            r1, r2 = _rope_pair(q1, q2, cs[None, :], sn[None, :])
            offs_rest = tl.arange(0, DI - R)
            qr = tl.load(qb + R + offs_rest[None, :], mask=himask[:, None], other=0.0)
            iqo = iq_ptr + i * stride_iq_n + offs_hi[:, None] * stride_iq_h
            tl.store(iqo + offs_r2[None, :], r1.to(iq_ptr.dtype.element_ty), mask=himask[:, None])
            tl.store(iqo + R2 + offs_r2[None, :], r2.to(iq_ptr.dtype.element_ty), mask=himask[:, None])
            tl.store(iqo + R + offs_rest[None, :], qr, mask=himask[:, None])


# Latent columns per W_UK program of mla_prep (programs: heads x L / BC): bf16 kv_b, FP8 kv_b.
PREP_BC = 128
PREP_BC_FP8 = 128  # 64 is no better in the whole step (decode_speed --tune)


def mla_prep(
    a,
    b,
    positions,
    kv_b,
    cos,
    sin,
    kv_norm_w,
    idx_k_norm_w,
    idx_k_norm_b,
    q_out,
    kv_cache,
    idx_cache,
    iq_out,
    iw_out,
    *,
    H,
    Hi,
    QL,
    L,
    R,
    P,
    V,
    DI,
    eps,
    iw_scale,
    kv_b_scale=None,
):
    n = a.shape[0]
    BC = min(PREP_BC if kv_b_scale is None else PREP_BC_FP8, L)
    has_idx = idx_cache is not None
    dummy = kv_cache
    kgn, kgk = _groups(kv_b, kv_b_scale)
    _mla_prep_kernel[(n, H * (L // BC) + 3)](
        a,
        b,
        positions,
        kv_b,
        kv_b_scale if kv_b_scale is not None else kv_norm_w,
        kv_b_scale.stride(0) if kv_b_scale is not None else 0,
        cos,
        sin,
        kv_norm_w,
        idx_k_norm_w if has_idx else kv_norm_w,
        idx_k_norm_b if has_idx else kv_norm_w,
        q_out,
        kv_cache,
        idx_cache if has_idx else dummy,
        iq_out if has_idx else dummy,
        iw_out if has_idx else dummy,
        H,
        Hi,
        a.stride(0),
        b.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        kv_cache.stride(0),
        idx_cache.stride(0) if has_idx else 0,
        iq_out.stride(0) if has_idx else 0,
        iq_out.stride(1) if has_idx else 0,
        iw_out.stride(0) if has_idx else 0,
        cos.stride(0),
        eps,
        iw_scale,
        QL=QL,
        L=L,
        R=R,
        P=P,
        V=V,
        DI=DI,
        BC=BC,
        BP=triton.next_power_of_2(P),
        HI_P2=triton.next_power_of_2(max(Hi, 1)),
        HAS_INDEXER=has_idx,
        HAS_SCALE=kv_b_scale is not None,
        KGN=kgn,
        KGK=kgk,
        ROW_UNIFORM=(P + V) % kgn == 0 and P <= kgn,
        num_warps=4,
        **triton_pdl.kw(),
    )


def _groups(w, scale):
    """(row group, column group) of an FP8 weight's scale (``fp8.groups``); (1, 1) without one."""
    if scale is None:
        return 1, 1
    return w.shape[-2] // scale.shape[-2], w.shape[-1] // scale.shape[-1]


@triton.jit
def _mla_uv_kernel(
    o_ptr,
    kvb_ptr,
    kvs_ptr,
    y_ptr,
    H,
    stride_on,
    stride_oh,
    stride_yn,
    stride_ks,
    L: tl.constexpr,
    P: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    PDL: tl.constexpr,
    HAS_SCALE: tl.constexpr = False,
    KGN: tl.constexpr = 128,
    KGK: tl.constexpr = 128,
    ROW_UNIFORM: tl.constexpr = False,
):
    pdl_begin(PDL)
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    offs_l = tl.arange(0, L)
    offs_v = vb * BV + tl.arange(0, BV)
    ol = tl.load(o_ptr + i * stride_on + h * stride_oh + offs_l).to(tl.float32)
    w = tl.load(kvb_ptr + (h * (P + V) + P + offs_v).to(tl.int64)[:, None] * L + offs_l[None, :])
    wf = w.to(tl.float32)
    if HAS_SCALE:
        if ROW_UNIFORM:  # the program's BV rows share one scale row: fold it into o~
            ol = ol * tl.load(kvs_ptr + ((h * (P + V) + P + vb * BV) // KGN).to(tl.int64) * stride_ks + offs_l // KGK)
        else:  # e4m3 * its group's scale
            wf = wf * tl.load(
                kvs_ptr
                + ((h * (P + V) + P + offs_v) // KGN).to(tl.int64)[:, None] * stride_ks
                + (offs_l // KGK)[None, :]
            )
    y = tl.sum(wf * ol[None, :], 1)
    tl.store(y_ptr + i * stride_yn + h * V + offs_v, y.to(y_ptr.dtype.element_ty))


def mla_uv(o_lat, kv_b, *, P, V, out=None, kv_b_scale=None):
    """``o_lat [n, H, L]`` -> ``[n, H*V]`` through ``W_UV = kv_b.view(H, P+V, L)[:, P:]`` (FP8 ``kv_b`` with
    ``kv_b_scale``)."""
    n, H, L = o_lat.shape
    y = out if out is not None else torch.empty(n, H * V, device=o_lat.device, dtype=o_lat.dtype)
    BV = 16
    kgn, kgk = _groups(kv_b, kv_b_scale)
    _mla_uv_kernel[(n, H, V // BV)](
        o_lat,
        kv_b,
        kv_b_scale if kv_b_scale is not None else kv_b,
        y,
        H,
        o_lat.stride(0),
        o_lat.stride(1),
        y.stride(0),
        kv_b_scale.stride(0) if kv_b_scale is not None else 0,
        L=L,
        P=P,
        V=V,
        BV=BV,
        HAS_SCALE=kv_b_scale is not None,
        KGN=kgn,
        KGK=kgk,
        ROW_UNIFORM=kgn % BV == 0 and P % BV == 0 and V % BV == 0,
        num_warps=4,
        **triton_pdl.kw(),
    )
    return y
