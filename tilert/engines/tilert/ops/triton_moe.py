"""Batch-1 MoE in Triton: reads only the selected experts' weights, GEMV-style.

Two kernels per MoE block:

1. ``moe_up``: grid (n * k, I / BI). Each program streams BI rows of the gate half and the same BI rows
   of the up half of ``w13[e]`` (e = this slot's expert), optionally RMS-normalising x on the fly, and
   writes ``act = silu(gate) * up`` (bf16) for its slice.
2. ``moe_down``: grid (n, D / BD). Each program streams ``w2[e_j][BD rows, :]`` for every slot j and
   accumulates ``sum_j w_j * w2[e_j] @ act_j`` in fp32; optionally adds a residual (in place, or into an output
   apart from it).

The token (and slot) index is the grid's fastest axis: the programs of all tokens for one weight block run
side by side, so an expert that several tokens of a step use (the shared experts always, routed ones when
routes meet: several sequences decoded together, an MTP verify batch) is read from HBM once and from L2
by the others. Each program computes exactly what it computes alone (batch invariance).

Shared experts fold in as extra slots: stack them after the routed experts (``w13[E + s]``) and append
ids ``E + s`` with weight 1.0 (an MLP with intermediate 2*I equals two MLPs of I on its halves). A dense
MLP is the same with one slot. ``router_select`` does sigmoid + bias + group-limited top-k + normalise +
scale for one token in one program, reading fp32 split-K partial logits from ``triton_gemv.gemv``;
(Doing that selection inside every ``moe_up`` program instead, to save the launch, is slower: it sits on every
program's path to its first weight load.) The engine's path, :func:`router`, runs the
split-K gate GEMV and the selection in one launch instead: the last of a token's GEMV programs to finish (a
counter, as ``triton_fp8``'s split reductions) selects, from the partials summed in split order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_gemv, triton_pdl
from .triton_gemv import _row_rstd, _x_normed, gemv_config, rstd_block
from .triton_pdl import pdl_begin
from .workspace import buffer

__all__ = ["moe_experts", "moe_up", "moe_down", "router_select", "router"]


@triton.jit
def _moe_up_kernel(
    x_ptr,
    nw_ptr,
    ids_ptr,
    w13_ptr,
    act_ptr,
    D,
    I,
    KK,
    stride_xm,
    stride_ids,
    stride_we,
    stride_wn,
    stride_an,
    stride_ak,
    eps,
    BI: tl.constexpr,
    BK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    # NS > 0 (BI dividing I): w13_ptr is w13's tensor descriptor (block [1, BI, BK]), its tiles brought into shared
    # memory by the TMA NS - 1 ahead of the one being summed.
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
        rstd = 1.0
        if HAS_NORM:
            sq = tl.zeros([BK], dtype=tl.float32)
            for k0 in range(0, D, BK):
                offs_k = k0 + tl.arange(0, BK)
                v = tl.load(x_row + offs_k, mask=offs_k < D, other=0.0).to(tl.float32)
                sq += v * v
            rstd = tl.rsqrt(tl.sum(sq, 0) / D + eps)
        acc_g = tl.zeros([BI, BK], dtype=tl.float32)
        acc_u = tl.zeros([BI, BK], dtype=tl.float32)
        if NS > 0:
            for k0 in tl.range(0, D, BK, num_stages=NS):
                wg = tl.reshape(w13_ptr.load([e, ib * BI, k0]), [BI, BK])
                wu = tl.reshape(w13_ptr.load([e, ib * BI + I, k0]), [BI, BK])
                offs_k = k0 + tl.arange(0, BK)
                xf = _x_normed(x_row, nw_ptr, rstd, offs_k, offs_k < D, wg.dtype, HAS_NORM)[None, :]
                acc_g += wg.to(tl.float32) * xf
                acc_u += wu.to(tl.float32) * xf
        else:
            wb = w13_ptr + e.to(tl.int64) * stride_we
            g_rows = wb + offs_i.to(tl.int64)[:, None] * stride_wn
            u_rows = wb + (offs_i + I).to(tl.int64)[:, None] * stride_wn
            for k0 in range(0, D, BK):
                offs_k = k0 + tl.arange(0, BK)
                kmask = offs_k < D
                xf = _x_normed(x_row, nw_ptr, rstd, offs_k, kmask, w13_ptr.dtype.element_ty, HAS_NORM)[None, :]
                m2 = imask[:, None] & kmask[None, :]
                wg = tl.load(g_rows + offs_k[None, :], mask=m2, other=0.0)
                wu = tl.load(u_rows + offs_k[None, :], mask=m2, other=0.0)
                acc_g += wg.to(tl.float32) * xf
                acc_u += wu.to(tl.float32) * xf
        gate = tl.sum(acc_g, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc_u, 1).to(act_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(act_ptr.dtype.element_ty).to(tl.float32) * up
        tl.store(out_ptr, act.to(act_ptr.dtype.element_ty), mask=imask)


@triton.jit
def _moe_down_kernel(
    act_ptr,
    ids_ptr,
    wts_ptr,
    w2_ptr,
    y_ptr,
    res_ptr,
    D,
    I,
    stride_an,
    stride_ak,
    stride_ids,
    stride_wts,
    stride_we,
    stride_wd,
    stride_yn,
    stride_rn,
    KK: tl.constexpr,
    N_CH: tl.constexpr,
    BD: tl.constexpr,
    BI: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i = tl.program_id(0)
    db = tl.program_id(1)
    offs_d = db * BD + tl.arange(0, BD)
    dmask = offs_d < D
    # One flat loop over (slot, I-chunk) so the software pipeline streams across experts.
    acc = tl.zeros([BD, BI], dtype=tl.float32)
    for t in range(0, KK * N_CH):
        j = t // N_CH
        i0 = (t - j * N_CH) * BI
        e = tl.load(ids_ptr + i * stride_ids + j)
        wj = tl.load(wts_ptr + i * stride_wts + j)
        ok = e >= 0
        e = tl.where(ok, e, 0)
        offs_i = i0 + tl.arange(0, BI)
        imask = (offs_i < I) & ok
        a = tl.load(act_ptr + i * stride_an + j * stride_ak + offs_i, mask=imask, other=0.0).to(tl.float32)
        w = tl.load(
            w2_ptr + e.to(tl.int64) * stride_we + offs_d.to(tl.int64)[:, None] * stride_wd + offs_i[None, :],
            mask=dmask[:, None] & imask[None, :],
            other=0.0,
        )
        acc += w.to(tl.float32) * (a * wj)[None, :]
    y = tl.sum(acc, 1).to(y_ptr.dtype.element_ty)
    if HAS_RES:
        r = tl.load(res_ptr + i * stride_rn + offs_d, mask=dmask, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + i * stride_yn + offs_d, y, mask=dmask)


# By expert width (``"narrow"``: I <= 1024, e.g. a tensor-parallel rank's slice of V3.2's 2048): best of the
# micro.py sweeps on the H200 for lite and V3.2 shapes and of ``decode_speed.py --tune`` / ``tp_decode.py
# --sections real,tune``, which re-time variants in the whole captured step.
# moe_up (rows, K tile, warps, stages).
UP_CFG = {"wide": (8, 512, 4, 4), "narrow": (8, 1024, 4, 3)}
# moe_up fed by the TMA: (rows, K tile, stages, warps) per width, or None for the register-fed kernel (off until
# measured in the whole step).
UP_TMA_CFG: dict[str, tuple[int, int, int, int] | None] = dict.fromkeys(UP_CFG)
# moe_down (rows, I tile, warps, stages): one flat loop over (slot, chunk). The stages change nothing in the sm_90
# build of these register-fed kernels (Triton pipelines the TMA's loads, not plain ones; kernel_resources.py).
DOWN_CFG = {"wide": (1, 2048, 4, 3), "narrow": (1, 1024, 4, 4)}


def _width(inter: int) -> str:
    return "narrow" if inter <= 1024 else "wide"


def moe_up(x, ids, w13, *, norm_w=None, eps=1e-6, out=None, cfg=None, tma=None):
    """``act[n, k, I] = silu(gate) * up`` of each token's selected experts. ``cfg`` (BI, BK, warps, stages) sets the
    register-fed kernel's tile, ``tma`` (BI, BK, stages, warps) the TMA-fed one's; by default the width picks
    (:data:`UP_TMA_CFG`, else :data:`UP_CFG`); weights the TMA cannot read, or rows it cannot tile whole, take the
    register-fed kernel."""
    n, D = x.shape
    KK = ids.shape[1]
    I = w13.shape[1] // 2
    assert w13.shape[2] == D and w13.stride(-1) == 1 and x.stride(-1) == 1
    act = out if out is not None else torch.empty(n, KK, I, device=x.device, dtype=x.dtype)
    if tma is None and cfg is None:
        tma = UP_TMA_CFG[_width(I)]
    if tma is not None and (I % tma[0] or not triton_gemv.tma_ready(w13)):
        tma, cfg = None, None
    if tma is not None:
        BI, BK, tma_ns, nw = tma
        BK = min(BK, triton.next_power_of_2(D))
        ns = tma_ns
    else:
        (BI, BK, nw, ns), tma_ns = cfg or UP_CFG[_width(I)], 0
    _moe_up_kernel[(n * KK, triton.cdiv(I, BI))](
        x,
        norm_w if norm_w is not None else x,
        ids,
        TensorDescriptor(w13, list(w13.shape), [w13.stride(0), w13.stride(1), 1], [1, BI, BK]) if tma_ns else w13,
        act,
        D,
        I,
        KK,
        x.stride(0),
        ids.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        act.stride(1),
        eps,
        BI=BI,
        BK=BK,
        HAS_NORM=norm_w is not None,
        NS=tma_ns,
        num_warps=nw,
        num_stages=ns,
        **triton_pdl.kw(),
    )
    return act


def moe_down(act, ids, wts, w2, *, residual=None, out=None, cfg=None):
    """``sum_j wts_j * w2[ids_j] @ act_j`` (+ ``residual``) into ``out`` (default: ``residual``, in place)."""
    n, KK, I = act.shape
    D = w2.shape[1]
    assert w2.shape[2] == I and w2.stride(-1) == 1
    if out is not None:
        y = out
    elif residual is not None:
        y = residual
    else:
        y = torch.empty(n, D, device=act.device, dtype=act.dtype)
    res = residual if residual is not None else y
    BD, BI, nw, ns = cfg or DOWN_CFG[_width(I)]
    _moe_down_kernel[(n, triton.cdiv(D, BD))](
        act,
        ids,
        wts,
        w2,
        y,
        res,
        D,
        I,
        act.stride(0),
        act.stride(1),
        ids.stride(0),
        wts.stride(0),
        w2.stride(0),
        w2.stride(1),
        y.stride(0),
        res.stride(0),
        KK=KK,
        N_CH=triton.cdiv(I, BI),
        BD=BD,
        BI=BI,
        HAS_RES=residual is not None,
        num_warps=nw,
        num_stages=ns,
        **triton_pdl.kw(),
    )
    return y


def moe_experts(x, topk_ids, topk_weights, w13, w2):
    """The ``tilert::moe_experts`` contract: ``sum_j w_j * w2[e_j] @ (silu(gate) * up)``."""
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    act = moe_up(x.contiguous(), ids.contiguous(), w13)
    return moe_down(act, ids.contiguous(), wts.contiguous(), w2)


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
