"""The MoE router in Triton: the gate GEMV and the expert selection of each token.

:func:`router` runs the split-K gate GEMV (the RMSNorm fused) and the selection in one launch: the last of a
token's GEMV programs to finish (a counter, as ``triton_fp8``'s split reductions) selects, from the partials
summed in split order: sigmoid + bias + group-limited top-k (one bitonic top-k over index-packed keys) +
normalise + scale, and appends the shared experts as extra slots (ids ``E + s``, weight 1.0) for the expert
kernels. :func:`router_select` is the selection alone, reading fp32 split-K partial logits from
``triton_gemv.gemv``. (Doing the selection inside every ``moe_up`` program instead, to save the launch, is
slower: it sits on every program's path to its first weight load.)

The experts themselves, e4m3 or 16-bit, are ``triton_fp8``'s ``moe_up_fp8`` / ``moe_down_fp8``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_pdl
from .triton_gemv import _row_rstd, gemv_config, rstd_block
from .triton_pdl import pdl_begin
from .workspace import buffer

__all__ = ["router_select", "router"]


@triton.jit
def _route(
    part_ptr,
    bias_ptr,
    i,
    SPLIT,
    stride_ps,
    stride_pn,
    route_scale,
    E_real,
    E: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    N_SHARED: tl.constexpr,
    NORM: tl.constexpr,
):
    """Token ``i``'s noaux_tc routing from fp32 split-K partial logits: (ids, weights) ``[KPAD]``, the
    shared-expert slots appended (ids ``E_real + s``, weight 1), -1 / 0 beyond ``K + N_SHARED``."""
    offs = tl.arange(0, E)
    emask = offs < E_real
    logits = tl.zeros([E], dtype=tl.float32)
    for s in range(0, SPLIT):
        logits += tl.load(part_ptr + s * stride_ps + i * stride_pn + offs, mask=emask, other=0.0)
    return _select(logits, bias_ptr, route_scale, E_real, E, G, TOPK_G, K, KPAD, N_SHARED, NORM)


@triton.jit
def _first_k(key, offs, K: tl.constexpr, KEEP: tl.constexpr):
    """Indices ``[KEEP]`` of the K largest of ``key``, largest first, ties to the lower index (what K rounds of
    ``tl.argmax`` would pick), -1 beyond K: one bitonic top-k over keys that carry their index, a few rounds of
    shuffles where rounds of argmax take two block reductions each."""
    kk = tl.arange(0, KEEP)
    if K == 1:  # (tl.topk cannot return a single element)
        ids = tl.where(kk == 0, tl.argmax(key, 0).to(tl.int32), -1)
    else:
        n: tl.constexpr = key.shape[0]
        KTOP: tl.constexpr = triton.next_power_of_2(K)
        c = tl.where(key == 0.0, 0.0, key)  # -0.0 orders as +0.0, as the float compare does
        bits = c.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # the float order as a signed integer order
        packed = (ordered.to(tl.int64) << 32) | (offs ^ (n - 1)).to(tl.int64)  # the lower index the larger key
        top = (tl.topk(packed, KTOP) & 0xFFFFFFFF).to(tl.int32) ^ (n - 1)  # [KTOP], largest first
        t = tl.arange(0, KTOP)
        ids = tl.sum(tl.where((kk[:, None] == t[None, :]) & (t[None, :] < K), top[None, :] + 1, 0), 1) - 1
    return ids


@triton.jit
def _select(
    logits,
    bias_ptr,
    route_scale,
    E_real,
    E: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    N_SHARED: tl.constexpr,
    NORM: tl.constexpr,
):
    """The selection of :func:`_route` from the summed logits ``[E]``."""
    offs = tl.arange(0, E)
    emask = offs < E_real
    scores = 1.0 / (1.0 + tl.exp(-logits))
    choice = scores + tl.load(bias_ptr + offs, mask=emask, other=0.0).to(tl.float32)
    choice = tl.where(emask, choice, float("-inf"))
    if G > 1:
        c2 = tl.reshape(choice, [G, E // G])
        cols = tl.arange(0, E // G)
        a1 = tl.argmax(c2, 1)
        m1 = tl.max(c2, 1)
        m2 = tl.max(tl.where(cols[None, :] == a1[:, None], float("-inf"), c2), 1)
        gidx = tl.arange(0, G)
        kept = _first_k(m1 + m2, gidx, TOPK_G, triton.next_power_of_2(TOPK_G))
        keep = tl.sum((gidx[:, None] == kept[None, :]).to(tl.int32), 1) > 0
        c2 = tl.where(keep[:, None], c2, float("-inf"))
        choice = tl.reshape(c2, [E])
    kk = tl.arange(0, KPAD)
    sel_ids = _first_k(choice, offs, K, KPAD)
    # each chosen expert's score: the one term of a row that is not zero (exact)
    sel_w = tl.sum(tl.where(offs[None, :] == sel_ids[:, None], scores[None, :], 0.0), 1)
    if NORM:
        sel_w = sel_w / (tl.sum(sel_w, 0) + 1e-20)
    sel_w = sel_w * route_scale
    for s in tl.static_range(N_SHARED):
        sel_ids = tl.where(kk == K + s, (E_real + s).to(tl.int32), sel_ids)
        sel_w = tl.where(kk == K + s, 1.0, sel_w)
    return sel_ids, sel_w


@triton.jit
def _router_select_kernel(
    part_ptr,
    bias_ptr,
    ids_ptr,
    wts_ptr,
    n,
    SPLIT,
    stride_ps,
    stride_pn,
    stride_ids,
    stride_wts,
    route_scale,
    E_real,
    E: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    N_SHARED: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i = tl.program_id(0)
    sel_ids, sel_w = _route(
        part_ptr, bias_ptr, i, SPLIT, stride_ps, stride_pn, route_scale, E_real, E, G, TOPK_G, K, KPAD, N_SHARED, NORM
    )
    kk = tl.arange(0, KPAD)
    m = kk < K + N_SHARED
    tl.store(ids_ptr + i * stride_ids + kk, sel_ids, mask=m)
    tl.store(wts_ptr + i * stride_wts + kk, sel_w, mask=m)


def router_select(
    partials,
    bias,
    *,
    top_k,
    n_group,
    topk_group,
    route_scale,
    norm_topk=True,
    n_shared_slots=0,
    ids_out=None,
    wts_out=None,
):
    """partials fp32 ``[split, n, E]`` (summed here) -> ids int32 ``[n, top_k + n_shared_slots]`` and fp32 weights.

    Shared-expert slots get ids ``E..E+n_shared_slots-1`` and weight 1.0.
    """
    split, n, E_real = partials.shape
    KK = top_k + n_shared_slots
    ids = ids_out if ids_out is not None else torch.empty(n, KK, device=partials.device, dtype=torch.int32)
    wts = wts_out if wts_out is not None else torch.empty(n, KK, device=partials.device, dtype=torch.float32)
    E = triton.next_power_of_2(E_real)
    G = n_group if n_group > 1 else 1
    assert G == 1 or E == E_real
    _router_select_kernel[(n,)](
        partials,
        bias,
        ids,
        wts,
        n,
        split,
        partials.stride(0),
        partials.stride(1),
        ids.stride(0),
        wts.stride(0),
        route_scale,
        E_real,
        E=E,
        G=G,
        TOPK_G=topk_group,
        K=top_k,
        KPAD=triton.next_power_of_2(KK),
        N_SHARED=n_shared_slots,
        NORM=norm_topk,
        num_warps=4,
        **triton_pdl.kw(),
    )
    return ids, wts


@triton.jit
def _router_kernel(
    x_ptr,
    w_ptr,
    nw_ptr,
    part_ptr,
    bias_ptr,
    ids_ptr,
    wts_ptr,
    cnt_ptr,
    K,
    k_per_split,
    E_real,
    stride_xm,
    stride_wn,
    stride_ps,
    stride_pn,
    stride_ids,
    stride_wts,
    eps,
    route_scale,
    BN: tl.constexpr,
    BK: tl.constexpr,
    RB: tl.constexpr,
    NB: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_NORM: tl.constexpr,
    E: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K_SEL: tl.constexpr,
    KPAD: tl.constexpr,
    N_SHARED: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (n, NB, SPLIT): the split-K router GEMV of triton_gemv (fp32 partials, same arithmetic), then the last of
    # token i's NB * SPLIT programs to finish (a counter per token) runs the selection over the partials (summed in
    # split order, as router_select does), writes ids / weights and zeroes its counter for the next launch.
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < E_real
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_row = x_ptr + row * stride_xm
    offs_k = k_lo + tl.arange(0, BK)
    kmask = offs_k < k_hi
    w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
    if HAS_NORM:
        g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)  # static, before the PDL wait too
    pdl_begin(PDL)
    # x's tile is requested before the statistics (one L2 round trip for both; same arithmetic as the GEMV)
    xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
    if HAS_NORM:
        rstd = _row_rstd(x_row, K, eps, RB)
        xv = (xv.to(tl.float32) * rstd * g).to(w_ptr.dtype.element_ty)
    acc = w.to(tl.float32) * xv.to(tl.float32)[None, :]
    for k0 in range(k_lo + BK, k_hi, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < k_hi
        xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
        if HAS_NORM:
            g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
            xv = (xv.to(tl.float32) * rstd * g).to(w_ptr.dtype.element_ty)
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    tl.store(part_ptr + pid_k * stride_ps + row * stride_pn + offs_n, tl.sum(acc, 1), mask=nmask)
    tl.debug_barrier()  # every thread's partials are written before the (release) arrival below
    cnt = cnt_ptr + row
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == NB * SPLIT - 1:
        sel_ids, sel_w = _route_cg(
            part_ptr,
            bias_ptr,
            row,
            SPLIT,
            stride_ps,
            stride_pn,
            route_scale,
            E_real,
            E,
            G,
            TOPK_G,
            K_SEL,
            KPAD,
            N_SHARED,
            NORM,
        )
        kk = tl.arange(0, KPAD)
        m = kk < K_SEL + N_SHARED
        tl.store(ids_ptr + row * stride_ids + kk, sel_ids, mask=m)
        tl.store(wts_ptr + row * stride_wts + kk, sel_w, mask=m)
        tl.atomic_xchg(cnt, 0)


@triton.jit
def _route_cg(
    part_ptr,
    bias_ptr,
    i,
    SPLIT,
    stride_ps,
    stride_pn,
    route_scale,
    E_real,
    E: tl.constexpr,
    G: tl.constexpr,
    TOPK_G: tl.constexpr,
    K: tl.constexpr,
    KPAD: tl.constexpr,
    N_SHARED: tl.constexpr,
    NORM: tl.constexpr,
):
    """:func:`_route` reading partials that other programs of the same launch wrote (from L2, past L1)."""
    offs = tl.arange(0, E)
    emask = offs < E_real
    logits = tl.zeros([E], dtype=tl.float32)
    row = part_ptr + i * stride_pn + offs
    for s in range(0, SPLIT):
        logits += tl.load(row + s * stride_ps, mask=emask, other=0.0, cache_modifier=".cg")
    return _select(logits, bias_ptr, route_scale, E_real, E, G, TOPK_G, K, KPAD, N_SHARED, NORM)


ROUTER_SPLIT = 8  # the router GEMV's split_k (as the separate GEMV + router_select had it)
ROUTER_WARPS = 0  # warps per router program (0: the bf16 GEMV's)


def router(
    x,
    gate,
    bias,
    *,
    norm_w=None,
    eps=1e-6,
    top_k,
    n_group,
    topk_group,
    route_scale,
    norm_topk=True,
    n_shared_slots=0,
    cfg=None,
):
    """``router_select(gemv(x, gate, norm_w, split_k), bias, ...)`` in one launch: ids int32 ``[n, top_k +
    n_shared_slots]`` and fp32 weights, the same values as the two kernels."""
    n, K = x.shape
    E_real = gate.shape[0]
    assert gate.shape[1] == K and x.stride(-1) == 1 and gate.stride(-1) == 1 and n <= 16
    if cfg is None:  # the bf16 GEMV's tile for the gate's shape (triton_gemv.gemv_config)
        bn_, bk_, nw_, _ = gemv_config(E_real, K, n)
        cfg = (bn_, bk_, ROUTER_WARPS or nw_, ROUTER_SPLIT)
    bn, bk, nw, split = cfg
    k_per_split = triton.cdiv(triton.cdiv(K, split), bk) * bk
    split = triton.cdiv(K, k_per_split)  # only splits with work
    KK = top_k + n_shared_slots
    E = triton.next_power_of_2(E_real)
    G = n_group if n_group > 1 else 1
    assert G == 1 or E == E_real
    dev = x.device
    part = buffer("router_part", (split, n, E_real), torch.float32, dev)
    cnt = buffer("router_cnt", (n,), torch.int32, dev, zero=True)
    ids = torch.empty(n, KK, device=dev, dtype=torch.int32)
    wts = torch.empty(n, KK, device=dev, dtype=torch.float32)
    nb = triton.cdiv(E_real, bn)
    _router_kernel[(n, nb, split)](
        x,
        gate,
        norm_w if norm_w is not None else x,
        part,
        bias,
        ids,
        wts,
        cnt,
        K,
        k_per_split,
        E_real,
        x.stride(0),
        gate.stride(0),
        part.stride(0),
        part.stride(1),
        ids.stride(0),
        wts.stride(0),
        eps,
        route_scale,
        BN=bn,
        BK=bk,
        RB=rstd_block(K, bk),
        NB=nb,
        SPLIT=split,
        HAS_NORM=norm_w is not None,
        E=E,
        G=G,
        TOPK_G=topk_group,
        K_SEL=top_k,
        KPAD=triton.next_power_of_2(KK),
        N_SHARED=n_shared_slots,
        NORM=norm_topk,
        num_warps=nw,
        num_stages=1,
        **triton_pdl.kw(),
    )
    return ids, wts
