"""Absorbed MLA decode over the 576-wide latent cache (flash-decoding / split-K), dense and sparse,
plus the DSA indexer scores (and their exact top-k through :mod:`.triton_topk`), in Triton.

Dense: query i attends to cache rows ``row_start[i]..positions[i]`` (``row_start`` optional: one row for every
query, or one per query, e.g. each query's own sequence in a cache holding several). The number of splits is fixed
per launch (a
CUDA graph captures one grid); each program derives its token range from ``positions[i]`` on the device,
so the same graph serves every context length. Sparse: query i attends to ``indices[i, :]`` (``-1`` skipped).
Partials (fp32 ``o`` and a base-2 log-sum-exp per split) are merged by a second kernel that writes the
latent output ``[n, H, L]`` in the query dtype, or (``uv``: ``tilert::mla_attention_uv``) rounds the merged
``o~`` to that dtype and applies ``W_UV`` (bf16 or block-FP8 ``kv_b``) in the same kernel, ``[n, H*V]``: by blocks
of ``W_UV``'s rows (each program merges its head's whole ``o~``), or (``UV_SLICE_L``) by slices of the latent (each
program merges a slice once and applies the matching columns; the head's last program sums the slices' outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_pdl, triton_topk
from .triton_pdl import pdl_begin
from .triton_topk import hist_update, key64
from .workspace import buffer

__all__ = ["mla_decode", "indexer_scores", "indexer_topk"]

_LOG2E = 1.4426950408889634


@triton.jit
def _rows_per_split(rows, NUM_SPLITS: tl.constexpr, MIN_TPS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows each split of ``rows`` takes: whole ``BLOCK_T`` tiles, at least ``MIN_TPS``."""
    return tl.maximum(tl.cdiv(tl.cdiv(rows, NUM_SPLITS), BLOCK_T) * BLOCK_T, MIN_TPS)


@triton.jit
def _dense_rows(
    pos_ptr,
    start_ptr,
    i,
    stride_start,
    NUM_SPLITS: tl.constexpr,
    MIN_TPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_START: tl.constexpr,
):
    """Query ``i``'s dense rows ``first..total - 1`` and the rows ``tps`` each split takes."""
    total = tl.load(pos_ptr + i).to(tl.int32) + 1
    first = 0
    if HAS_START:
        first = tl.minimum(tl.load(start_ptr + i * stride_start).to(tl.int32), total)
    return first, total, _rows_per_split(total - first, NUM_SPLITS, MIN_TPS, BLOCK_T)


@triton.jit
def _live_splits(
    pos_ptr,
    start_ptr,
    i,
    stride_start,
    NUM_SPLITS: tl.constexpr,
    MIN_TPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_START: tl.constexpr,
):
    """How many of query ``i``'s dense splits hold rows (a prefix: the split kernel's own count)."""
    first, total, tps = _dense_rows(pos_ptr, start_ptr, i, stride_start, NUM_SPLITS, MIN_TPS, BLOCK_T, HAS_START)
    return tl.cdiv(total - first, tps)


@triton.jit
def _split_weights(lse):
    """Each split's weight in the merge, from the splits' base-2 log-sum-exps: 0 for a split with no rows."""
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wts = tl.exp2(lse - mx)
    wsum = tl.sum(wts, 0)
    return wts / tl.where(wsum > 0, wsum, 1.0)


@triton.jit
def _partials(ob, offs, stride_os, offs_l, live):
    """One (query, head)'s split partials ``offs``, ``[len(offs), L]``; a row not ``live`` is 0 and never requested."""
    return tl.load(ob + offs[:, None] * stride_os + offs_l[None, :], mask=live[:, None], other=0.0)


@triton.jit
def _weighted(o, ls, mx, inv):
    """The partials ``o`` summed, each by its split's share ``exp2(ls - mx) * inv`` of the softmax."""
    return tl.sum(o * (tl.exp2(ls - mx) * inv)[:, None], 0)


@triton.jit
def _mla_split_kernel(
    q_ptr,
    kv_ptr,
    pos_ptr,
    idx_ptr,
    start_ptr,
    o_ptr,
    lse_ptr,
    H,
    n_idx,
    stride_qn,
    stride_qh,
    stride_kv,
    stride_idx,
    stride_start,
    stride_on,
    stride_oh,
    stride_os,
    qk_scale,
    NUM_SPLITS: tl.constexpr,
    MIN_TPS: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SPARSE: tl.constexpr,
    HAS_START: tl.constexpr,
    EARLY: tl.constexpr,
    WRITE_EMPTY: tl.constexpr,
    PDL: tl.constexpr,
):
    # WRITE_EMPTY: a split with no rows writes its partial too (zeros, for a merge that reads every split);
    # otherwise only its log-sum-exp (-inf), which every other merge reads first.
    # EARLY: the split's rows (from positions / row_start, step inputs written before the step or several kernels
    # back, as mla_prep reads them) are worked out before the PDL wait: no L2 round trip for them after it.
    if not EARLY:
        pdl_begin(PDL)
    pid_s = tl.program_id(0)
    i = tl.program_id(1)
    hb = tl.program_id(2)
    if SPARSE:
        first = 0
        total = n_idx
        tps = _rows_per_split(total, NUM_SPLITS, MIN_TPS, BLOCK_T)
    else:
        first, total, tps = _dense_rows(pos_ptr, start_ptr, i, stride_start, NUM_SPLITS, MIN_TPS, BLOCK_T, HAS_START)
    start = first + pid_s * tps
    end = tl.minimum(start + tps, total)
    if EARLY:
        pdl_begin(PDL)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < H
    lse = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    if WRITE_EMPTY or start < end:
        offs_l = tl.arange(0, L)
        offs_r = tl.arange(0, R)
        qrow = q_ptr + i * stride_qn + offs_h[:, None] * stride_qh
        q_nope = tl.load(qrow + offs_l[None, :], mask=hmask[:, None], other=0.0)
        q_pe = tl.load(qrow + L + offs_r[None, :], mask=hmask[:, None], other=0.0)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, L], dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            tmask = offs_t < end
            if SPARSE:
                rows = tl.load(idx_ptr + i * stride_idx + offs_t, mask=tmask, other=-1)
                valid = tmask & (rows >= 0)
                rows = tl.where(valid, rows, 0).to(tl.int64)
            else:
                valid = tmask
                rows = offs_t.to(tl.int64)
            kbase = kv_ptr + rows[:, None] * stride_kv
            kc = tl.load(kbase + offs_l[None, :], mask=valid[:, None], other=0.0)
            kp = tl.load(kbase + L + offs_r[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q_nope, tl.trans(kc))
            s = tl.dot(q_pe, tl.trans(kp), s)
            s = s * qk_scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
            m_i = m_new
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        obase = o_ptr + i * stride_on + offs_h[:, None] * stride_oh + pid_s * stride_os
        tl.store(obase + offs_l[None, :], o, mask=hmask[:, None])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(lse_ptr + (i * H + offs_h) * NUM_SPLITS + pid_s, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    H,
    stride_on,
    stride_oh,
    stride_os,
    stride_outn,
    stride_outh,
    NUM_SPLITS: tl.constexpr,
    BS: tl.constexpr,
    L: tl.constexpr,
    BL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    i = tl.program_id(0)
    h = tl.program_id(1)
    lb = tl.program_id(2)
    offs_s = tl.arange(0, BS)
    smask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + (i * H + h) * NUM_SPLITS + offs_s, mask=smask, other=float("-inf"))
    wts = _split_weights(lse)
    offs_l = lb * BL + tl.arange(0, BL)
    live = smask & (lse > float("-inf"))
    o = tl.load(
        o_ptr + i * stride_on + h * stride_oh + offs_s[:, None] * stride_os + offs_l[None, :],
        mask=live[:, None],
        other=0.0,
    )
    res = tl.sum(o * wts[:, None], 0)
    tl.store(out_ptr + i * stride_outn + h * stride_outh + offs_l, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _mla_combine_uv_kernel(
    o_ptr,
    lse_ptr,
    kvb_ptr,
    kvs_ptr,
    y_ptr,
    pos_ptr,
    start_ptr,
    H,
    stride_on,
    stride_oh,
    stride_os,
    stride_yn,
    stride_ks,
    stride_start,
    NUM_SPLITS: tl.constexpr,
    MIN_TPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr,
    HAS_START: tl.constexpr,
    SB: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    KGN: tl.constexpr,
    KGK: tl.constexpr,
    ROW_UNIFORM: tl.constexpr,
    BS: tl.constexpr,
    ONE_READ: tl.constexpr,
    TAIL: tl.constexpr,
    LIVE_LOOP: tl.constexpr,
    LIVE_EARLY: tl.constexpr,
    READ: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (n, H, V / BV): merges head h's split partials into o~ (rounded to the activation dtype, as the combine
    # kernel writes it), then o[i, h*V + v] = W_UV_h[v] . o~ for its BV rows (mla_uv's math): one launch for both.
    # READ > 0: the live splits' partials [READ + TAIL, L] are requested right after the PDL wait, with their
    # log-sum-exps (one L2 round trip; the loop over SB splits at a time reads them only once the weights are
    # known); TAIL > 0: splits READ.. are a second tile of TAIL rows (33 splits read as 32 + 2 rows, not 64). Dense:
    # the live splits are a prefix, counted from the query's rows as the split kernel splits them (positions /
    # row_start: step inputs written kernels before, read before the PDL wait); sparse: every split is live, each
    # written by the split kernel (an empty one's o is 0, its weight 0: WRITE_EMPTY). ONE_READ: READ (= BS) + TAIL
    # spans every split. Otherwise (dense, the live splits counted before the PDL wait; BS spans every split for the
    # weights) a query with at most READ + TAIL live splits is read so, one with more loops over them (a long
    # cache's graph at a short context: 33 live of 128 at 1K).
    i = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    n_live = NUM_SPLITS
    if DENSE and (ONE_READ or LIVE_EARLY):  # the split kernel's rows (before the PDL wait, as its EARLY reads them)
        n_live = _live_splits(pos_ptr, start_ptr, i, stride_start, NUM_SPLITS, MIN_TPS, BLOCK_T, HAS_START)
    offs_l = tl.arange(0, L)
    offs_v = vb * BV + tl.arange(0, BV)
    w = tl.load(kvb_ptr + (h * (P + V) + P + offs_v).to(tl.int64)[:, None] * L + offs_l[None, :])  # static
    wf = w.to(tl.float32)
    cs = tl.full([L], 1.0, dtype=tl.float32)
    if HAS_SCALE:
        if ROW_UNIFORM:  # the program's BV rows share one scale row: fold it into o~
            cs = tl.load(kvs_ptr + ((h * (P + V) + P + vb * BV) // KGN).to(tl.int64) * stride_ks + offs_l // KGK)
        else:  # e4m3 * its group's scale
            wf = wf * tl.load(
                kvs_ptr
                + ((h * (P + V) + P + offs_v) // KGN).to(tl.int64)[:, None] * stride_ks
                + (offs_l // KGK)[None, :]
            )
    pdl_begin(PDL)
    offs_s = tl.arange(0, BS)
    lse_row = lse_ptr + (i * H + h) * NUM_SPLITS
    ob = o_ptr + i * stride_on + h * stride_oh
    if READ > 0:  # ONE_READ: every split (few always holds); else nothing is requested for a query with more
        offs_r = tl.arange(0, READ)
        few = n_live <= READ + TAIL
        o_r = _partials(ob, offs_r, stride_os, offs_l, (offs_r < n_live) & few)
        if TAIL > 0:
            offs_t = READ + tl.arange(0, TAIL)
            o_t = _partials(ob, offs_t, stride_os, offs_l, (offs_t < n_live) & few)
            lse_t = tl.load(lse_row + offs_t, mask=(offs_t < n_live) & few, other=float("-inf"))
        if not ONE_READ:  # the weights of the splits read; the loop's tile below spans every split
            lse_r = tl.load(lse_row + offs_r, mask=(offs_r < n_live) & few, other=float("-inf"))
    lse = tl.load(lse_row + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    if ONE_READ:
        lse_r = lse
    mx = tl.max(lse, 0)
    if ONE_READ and TAIL > 0:  # the tail's splits lie past the tile of every split's log-sum-exp
        mx = tl.maximum(mx, tl.max(lse_t, 0))
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wsum = tl.sum(tl.exp2(lse - mx), 0)
    if ONE_READ and TAIL > 0:
        wsum += tl.sum(tl.exp2(lse_t - mx), 0)
    inv = 1.0 / tl.where(wsum > 0, wsum, 1.0)
    acc = tl.zeros([L], dtype=tl.float32)
    if READ > 0:  # exact zeros for a query the loop below merges instead (every weight exp2(-inf) = 0)
        acc = _weighted(o_r, lse_r, mx, inv)
        if TAIL > 0:
            acc += _weighted(o_t, lse_t, mx, inv)
    if not ONE_READ:
        # Only up to the last split with rows (a graph sized for a long cache runs short contexts with most of its
        # splits empty: 33 live of 128 at 1K in a 32K-row engine). Those after it would add exact zeros, so the
        # bound changes no bit; it is this query's own, so alone or in a batch alike. The partials' loads do not
        # wait for their log-sum-exps (empty splits are a suffix: every split before the last live one has rows).
        if LIVE_LOOP:
            if not (DENSE and LIVE_EARLY):  # else counted from the query's rows before the PDL wait (the same count)
                n_live = tl.max(tl.where(lse > float("-inf"), offs_s + 1, 0), 0)
            s_first = 0
            if READ > 0:
                s_first = tl.where(few, n_live, 0)
            for s0 in tl.range(s_first, n_live, SB, num_stages=STAGES):
                offs = s0 + tl.arange(0, SB)
                ls = tl.load(lse_row + offs, mask=offs < NUM_SPLITS, other=float("-inf"))
                # past the last live split nothing may be read: an empty split writes no partial (SKIP_EMPTY_SPLITS)
                acc += _weighted(_partials(ob, offs, stride_os, offs_l, offs < n_live), ls, mx, inv)
        else:  # every split, each step's partials loaded once its log-sum-exps say which hold rows
            for s0 in tl.static_range(0, NUM_SPLITS, SB):
                offs = s0 + tl.arange(0, SB)
                ls = tl.load(lse_row + offs, mask=offs < NUM_SPLITS, other=float("-inf"))
                live = ls > float("-inf")
                acc += _weighted(_partials(ob, offs, stride_os, offs_l, live), ls, mx, inv)
    ol = acc.to(y_ptr.dtype.element_ty).to(tl.float32) * cs
    y = tl.sum(wf * ol[None, :], 1)
    tl.store(y_ptr + i * stride_yn + h * V + offs_v, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _mla_merge_uv_sliced_kernel(
    o_ptr,
    lse_ptr,
    kvb_ptr,
    kvs_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    pos_ptr,
    start_ptr,
    H,
    stride_on,
    stride_oh,
    stride_os,
    stride_yn,
    stride_ks,
    stride_start,
    NUM_SPLITS: tl.constexpr,
    MIN_TPS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DENSE: tl.constexpr,
    HAS_START: tl.constexpr,
    BS: tl.constexpr,
    L: tl.constexpr,
    P: tl.constexpr,
    V: tl.constexpr,
    BL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    KGN: tl.constexpr,
    KGK: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (n, H, L / BL): program (i, h, lb) merges columns lb*BL.. of head h's split partials (dense: the live
    # ones, counted from the query's rows before the PDL wait; sparse: every split, each written), rounds them to
    # the activation dtype (o~, as the merge over whole rows does) and applies the same BL columns of W_UV_h: a
    # partial y [V] in fp32, ws[i, h, lb]. The last of the head's L / BL programs to finish (a counter per query and
    # head) sums the partials in one fixed tree, writes y and zeroes its counter for the next launch (which waits on
    # this one). Each partial is read once, where the merge over whole rows reads a head's partials once per block
    # of V rows.
    NLB: tl.constexpr = L // BL
    i = tl.program_id(0)
    h = tl.program_id(1)
    lb = tl.program_id(2)
    n_live = NUM_SPLITS
    if DENSE:
        n_live = _live_splits(pos_ptr, start_ptr, i, stride_start, NUM_SPLITS, MIN_TPS, BLOCK_T, HAS_START)
    offs_l = lb * BL + tl.arange(0, BL)
    offs_v = tl.arange(0, V)
    rows = (h * (P + V) + P + offs_v).to(tl.int64)
    wf = tl.load(kvb_ptr + rows[:, None] * L + offs_l[None, :]).to(tl.float32)  # [V, BL], static
    if HAS_SCALE:
        wf = wf * tl.load(kvs_ptr + (rows // KGN)[:, None] * stride_ks + (offs_l // KGK)[None, :])
    pdl_begin(PDL)
    offs_s = tl.arange(0, BS)
    lse = tl.load(lse_ptr + (i * H + h) * NUM_SPLITS + offs_s, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    ob = o_ptr + i * stride_on + h * stride_oh
    o = _partials(ob, offs_s, stride_os, offs_l, offs_s < n_live)
    ol = tl.sum(o * _split_weights(lse)[:, None], 0).to(y_ptr.dtype.element_ty).to(tl.float32)
    part = tl.sum(wf * ol[None, :], 1)  # [V]
    ws_row = ws_ptr + ((i * H + h) * NLB).to(tl.int64) * V
    tl.store(ws_row + lb * V + offs_v, part)
    tl.debug_barrier()  # every thread's partial is written before the (release) arrival below
    cnt = cnt_ptr + i * H + h
    arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if arrived == NLB - 1:  # the head's last program: its partials summed in a fixed order, whatever the arrival
        parts = tl.load(ws_row + tl.arange(0, NLB)[:, None] * V + offs_v[None, :], cache_modifier=".cg")
        tl.store(y_ptr + i * stride_yn + h * V + offs_v, tl.sum(parts, 0).to(y_ptr.dtype.element_ty))
        tl.atomic_xchg(cnt, 0)


# mla_decode with W_UV (mla_attention_uv): rows of W_UV per program by head count ("few": H <= 32; each
# program merges its head's splits again, so many heads want fewer, wider programs), splits merged per step.
UV_BV = {"few": 16, "many": 64}  # chosen with decode_speed --tune in engines sized for 32K (few heads: 16 rows, 8
# programs a head, each reading the head's live splits at once)
UV_SB = 4
# Merge + W_UV reads every split's partial in one request when the splits (padded to a power of two) are at most
# this many (ONE_READ; 8 warps above 32, to keep the [splits, L] fp32 tile at 128 registers a thread); 0: off.
UV_ONE_READ_MAX = 64
# ONE_READ over a split count that is not a power of two: the largest power of two below it in one tile and the
# rest in a second (TAIL) when that is at most an eighth of the first (33 splits: 32 + 2 rows, not 64; 65: 64 + 2,
# where the padded 128 would not be read at once at all); and UV_LIVE_ONE_READ's read takes up to an eighth more
# splits so (33 live as 32 + 4). False: one padded tile; the live read, at most its bound.
UV_TAIL = True
# Over UV_ONE_READ_MAX splits (an engine sized for a long cache): the merge loops only to the query's last split
# with rows (LIVE_LOOP; bit-identical); False: over every split.
UV_LIVE_LOOP = True
# That loop's bound, dense: the live splits counted from the query's rows before the PDL wait (as the one read counts
# them), so that the partials' loads do not wait for the log-sum-exps; False: from the log-sum-exps (the same count).
UV_LIVE_EARLY = True
# That loop, dense, when a query's live splits are at most this many (a power of two, and UV_TAIL's eighth more; 0:
# always the loop): read in one request instead, as UV_ONE_READ_MAX's merge reads every split (8 warps above 32). A
# graph sized for 32K rows runs a 1K step with 33 live splits of its 128.
UV_LIVE_ONE_READ = 32  # chosen with decode_speed --tune
# Stages of that loop (Triton's software pipelining: the partials of the next STAGES - 1 steps requested through
# shared memory while one step is summed); 1: each step's loads issued when it starts.
UV_STAGES = 1
# Merge + W_UV by slices of the latent (_mla_merge_uv_sliced_kernel): BL columns a program, each partial read
# once, the head's output summed by its last program; 0: by blocks of W_UV's rows (_mla_combine_uv_kernel). Per
# regime: a sparse launch merges every split it was given (the DSA top-k's rows), a dense one only its live ones.
UV_SLICE_L = {"dense": 0, "sparse": 32}  # chosen with decode_speed --tune


# Fewest cache rows one split of the dense kernel takes: short contexts use fewer, fuller splits.
DENSE_MIN_TOKENS_PER_SPLIT = 32  # chosen with decode_speed --tune
# Dense: at most one split per this many cache rows (of the whole cache: the graph serves every context); by
# head blocks ("one": H <= 16, lite; "many": V3.2's 128 heads, whose merge reads every split; chosen with
# decode_speed --tune). Below 32 the
# split's tile (BLOCK_T) and fewest rows (DENSE_MIN_TOKENS_PER_SPLIT) shrink to it.
DENSE_CAP_ROWS = {"one": 32, "many": 64}
# The split kernel works out its rows before the PDL wait (_mla_split_kernel's EARLY); False: after it.
SPLIT_ROWS_EARLY = True
# A split with no rows (a graph sized for a long cache, run at a short context: 96 of 128 splits at 1K in a 32K-row
# engine) writes only its log-sum-exp, not a partial of zeros that no merge reads (every merge but the sparse
# ONE_READ one skips splits whose log-sum-exp is -inf, stops at the last live one or reads only the live ones);
# False: it writes the zeros too.
SKIP_EMPTY_SPLITS = True


# True: a dense launch given max_rows (a DSA model's dense steps, below its top-k) sizes its splits by those rows, not
# by the whole cache: fewer splits, few enough for the merge's one read (UV_ONE_READ_MAX), each longer. False (the
# default): by the cache, more and shorter splits, which the whole step at one TP8 rank's and lite-v32's shapes runs
# faster (benchmarks/results/h200-decode-tp8-rank.md).
SPLITS_BY_MAX_ROWS = False


def _pick_splits(hblocks: int, sparse: bool, n_idx: int, max_tokens: int) -> int:
    """Splits per query, independent of the number of queries: each query's result is the same whether it
    runs alone or in a verify batch (batch invariance, so MTP verify reproduces plain decoding exactly)."""
    sms = (
        torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        if torch.cuda.is_available()
        else 132
    )
    want = max(1, (2 * sms) // hblocks)
    rows = DENSE_CAP_ROWS["one" if hblocks == 1 else "many"]
    cap = triton.cdiv(max(n_idx, 1), 64) if sparse else triton.cdiv(max(max_tokens, 1), rows)
    return max(1, min(want, 128, cap))


def _tail(bs: int) -> int:
    """The most rows a tile of ``bs`` splits takes in a second tile (UV_TAIL): an eighth of it, at least 2."""
    return max(2, bs // 8)


def _uv_tiles(S: int) -> tuple[int, int, bool]:
    """(BS, TAIL, ONE_READ) of the merge + ``W_UV`` kernel over ``S`` splits (UV_ONE_READ_MAX, UV_TAIL)."""
    bs = triton.next_power_of_2(S)
    tail = 0
    if UV_TAIL and bs != S and triton.next_power_of_2(S - bs // 2) <= _tail(bs // 2):
        bs //= 2
        tail = max(2, triton.next_power_of_2(S - bs))
    one_read = bs <= UV_ONE_READ_MAX
    if not one_read:  # the loop's weights come from one tile of every split's log-sum-exp
        bs, tail = triton.next_power_of_2(S), 0
    return bs, tail, one_read


def _merge_uv_sliced(o_part, lse, kv_b, kvs, y, pos, row_start, S, min_tps, block_t, dense, P, V, BL, kgn, kgk) -> None:
    n, H, _, L = o_part.shape
    ws = buffer("mla_uv_ws", (n, H, L // BL, V), torch.float32, o_part.device)
    cnt = buffer("mla_uv_cnt", (n, H), torch.int32, o_part.device, zero=True)
    _mla_merge_uv_sliced_kernel[(n, H, L // BL)](
        o_part,
        lse,
        kv_b,
        kvs if kvs is not None else kv_b,
        y,
        ws,
        cnt,
        pos,
        row_start if row_start is not None else pos,
        H,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        y.stride(0),
        kvs.stride(0) if kvs is not None else 0,
        row_start.stride(0) if row_start is not None and row_start.shape[0] > 1 else 0,
        NUM_SPLITS=S,
        MIN_TPS=min_tps,
        BLOCK_T=block_t,
        DENSE=dense,
        HAS_START=dense and row_start is not None,
        BS=triton.next_power_of_2(S),
        L=L,
        P=P,
        V=V,
        BL=BL,
        HAS_SCALE=kvs is not None,
        KGN=kgn,
        KGK=kgk,
        num_warps=4,
        **triton_pdl.kw(),
    )


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor | None,
    indices: torch.Tensor | None,
    scale: float,
    kv_lora_rank: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    row_start: torch.Tensor | None = None,
    uv: tuple | None = None,
    max_rows: int = 0,
) -> torch.Tensor:
    """Dense (``indices is None``, rows ``row_start[i]..positions[i]``; ``row_start`` int64 ``[1]`` or ``[n]``) or
    sparse absorbed MLA; ``[n, H, L]``. With ``uv = (kv_b, P, V, kv_b_scale or None)``: ``W_UV`` applied too
    (``triton_fused.mla_uv``'s math, in the merging kernel), ``[n, H*V]``. ``max_rows``: the most rows a dense
    query of this launch reads (0: the whole cache), which sizes the splits; any query longer is still whole."""
    n, H, D = q.shape
    L = kv_lora_rank
    R = D - L
    assert kv_cache.shape[-1] == D and kv_cache.stride(-1) == 1 and q.stride(-1) == 1
    kv = kv_cache.reshape(-1, D)
    sparse = indices is not None
    BLOCK_H = 16 if H <= 16 else (32 if H <= 32 else 64)
    hblocks = triton.cdiv(H, BLOCK_H)
    n_idx = indices.shape[-1] if indices is not None else 0
    S = num_splits or _pick_splits(hblocks, sparse, n_idx, (max_rows if SPLITS_BY_MAX_ROWS else 0) or kv.shape[0])
    rows = DENSE_CAP_ROWS["one" if hblocks == 1 else "many"]
    BLOCK_T = 32 if sparse else min(32, rows)
    min_tps = BLOCK_T if sparse else min(DENSE_MIN_TOKENS_PER_SPLIT, rows)
    o_part = buffer("mla_o", (n, H, S, L), torch.float32, q.device)
    lse = buffer("mla_lse", (n, H, S), torch.float32, q.device)
    if indices is not None:
        idx = indices if indices.stride(-1) == 1 else indices.contiguous()
        pos = idx  # unused
    else:
        assert positions is not None, "dense MLA needs positions"
        idx = positions
        pos = positions
    if row_start is not None:
        row_start = row_start.reshape(-1)
        assert row_start.shape[0] in (1, n), "row_start: one row, or one per query"
    bs, tail, one_read = _uv_tiles(S)
    # the merge + W_UV by slices of the latent (0: by W_UV's rows)
    BL = min(UV_SLICE_L["sparse" if sparse else "dense"], L) if uv is not None else 0
    BL = BL if BL and L % BL == 0 else 0
    _mla_split_kernel[(S, n, hblocks)](
        q,
        kv,
        pos,
        idx,
        row_start if row_start is not None else pos,
        o_part,
        lse,
        H,
        n_idx,
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        idx.stride(0) if sparse else 0,
        row_start.stride(0) if row_start is not None and row_start.shape[0] > 1 else 0,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        scale * _LOG2E,
        NUM_SPLITS=S,
        MIN_TPS=min_tps,
        L=L,
        R=R,
        BLOCK_H=BLOCK_H,
        BLOCK_T=BLOCK_T,
        SPARSE=sparse,
        HAS_START=row_start is not None and not sparse,
        EARLY=SPLIT_ROWS_EARLY,
        # the sparse ONE_READ and sliced merges read every partial; the dense ones only their query's live splits
        WRITE_EMPTY=not SKIP_EMPTY_SPLITS or (uv is not None and (one_read or BL > 0) and sparse),
        num_warps=8 if BLOCK_H >= 64 else 4,
        num_stages=2,
        **triton_pdl.kw(),
    )
    if uv is not None:
        kv_b, P, V, kvs = uv
        y = out if out is not None else torch.empty(n, H * V, device=q.device, dtype=q.dtype)
        BV = min(UV_BV["few" if H <= 32 else "many"], V)
        kgn, kgk = (1, 1) if kvs is None else (kv_b.shape[-2] // kvs.shape[-2], kv_b.shape[-1] // kvs.shape[-1])
        read, read_tail = bs, tail  # ONE_READ: every split at once
        if not one_read:  # a query's live splits at once when they are few (dense, counted before the PDL wait)
            read = UV_LIVE_ONE_READ if not sparse and UV_LIVE_LOOP and UV_LIVE_EARLY else 0
            read = min(read, bs // 2)  # a read of every split is the ONE_READ merge's
            read_tail = _tail(read) if read and UV_TAIL else 0
        if BL:
            _merge_uv_sliced(
                o_part, lse, kv_b, kvs, y, pos, row_start, S, min_tps, BLOCK_T, not sparse, P, V, BL, kgn, kgk
            )
            return y
        _mla_combine_uv_kernel[(n, H, V // BV)](
            o_part,
            lse,
            kv_b,
            kvs if kvs is not None else kv_b,
            y,
            pos,
            row_start if row_start is not None else pos,
            H,
            o_part.stride(0),
            o_part.stride(1),
            o_part.stride(2),
            y.stride(0),
            kvs.stride(0) if kvs is not None else 0,
            row_start.stride(0) if row_start is not None and row_start.shape[0] > 1 else 0,
            NUM_SPLITS=S,
            MIN_TPS=min_tps,
            BLOCK_T=BLOCK_T,
            DENSE=not sparse,
            HAS_START=row_start is not None and not sparse,
            SB=min(UV_SB, triton.next_power_of_2(S)),
            L=L,
            P=P,
            V=V,
            BV=BV,
            HAS_SCALE=kvs is not None,
            KGN=kgn,
            KGK=kgk,
            ROW_UNIFORM=kgn % BV == 0 and P % BV == 0 and V % BV == 0,
            BS=bs,
            ONE_READ=one_read,
            TAIL=read_tail,
            LIVE_LOOP=UV_LIVE_LOOP,
            LIVE_EARLY=UV_LIVE_EARLY,
            READ=read,
            STAGES=UV_STAGES,
            num_warps=8 if read > 32 else 4,
            **triton_pdl.kw(),
        )
        return y
    res = out if out is not None else torch.empty(n, H, L, device=q.device, dtype=q.dtype)
    BL = min(L, 128 if S <= 32 else 64)
    _mla_combine_kernel[(n, H, triton.cdiv(L, BL))](
        o_part,
        lse,
        res,
        H,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        res.stride(0),
        res.stride(1),
        NUM_SPLITS=S,
        BS=triton.next_power_of_2(S),
        L=L,
        BL=BL,
        num_warps=4,
        **triton_pdl.kw(),
    )
    return res


@triton.jit
def _indexer_score_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    pos_ptr,
    start_ptr,
    out_ptr,
    fine_ptr,
    coarse_ptr,
    S,
    Hi,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_k,
    stride_on,
    stride_start,
    DI: tl.constexpr,
    BH: tl.constexpr,
    BT: tl.constexpr,
    HIST: tl.constexpr,
    HAS_START: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_begin(PDL)
    pid_t = tl.program_id(0)
    i = tl.program_id(1)
    pos = tl.load(pos_ptr + i)
    first = pos * 0
    if HAS_START:  # column t scores cache row first + t (the query's own sequence starts at row first)
        first = tl.load(start_ptr + i * stride_start)
        pos = pos - first
    offs_t = pid_t * BT + tl.arange(0, BT)
    tmask = offs_t < S
    valid = offs_t <= pos
    res = tl.full([BT], float("-inf"), dtype=tl.float32)
    if pid_t * BT <= pos:
        offs_d = tl.arange(0, DI)
        k = tl.load(
            k_ptr + (first + offs_t.to(tl.int64))[:, None] * stride_k + offs_d[None, :],
            mask=(valid & tmask)[:, None],
            other=0.0,
        )
        acc = tl.zeros([BT], dtype=tl.float32)
        for h0 in range(0, Hi, BH):
            offs_h = h0 + tl.arange(0, BH)
            hmask = offs_h < Hi
            q = tl.load(
                q_ptr + i * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0
            )
            w = tl.load(w_ptr + i * stride_wn + offs_h, mask=hmask, other=0.0)
            s = tl.dot(q, tl.trans(k))  # [BH, BT]
            s = tl.maximum(s, 0.0) * w[:, None]
            acc += tl.sum(s, 0)
        res = tl.where(valid, acc, float("-inf"))
        if HIST:  # pass 1 of the radix top-k (triton_topk), fused: no second read of the scores
            key = key64(res)
            hist_update((key >> 16).to(tl.int32), valid & tmask, fine_ptr + i * 65536, coarse_ptr + i * 256)
    tl.store(out_ptr + i * stride_on + offs_t, res, mask=tmask)


def indexer_scores(
    q, weights, k_cache, positions, out=None, topk_ws: triton_topk.TopkWorkspace | None = None, row_start=None
):
    """fp32 ``[n, S_max]``: sum_h w[h] relu(q[h].k[t]) for t <= pos, -inf elsewhere. With ``topk_ws`` the
    radix top-k's pass-1 histogram is accumulated on the way (``triton_topk.select_from_hist`` finishes it).
    With ``row_start`` (int64 ``[n]``) column ``t`` of row ``i`` scores cache row ``row_start[i] + t``, valid for
    ``t <= positions[i] - row_start[i]``."""
    n, Hi, Di = q.shape
    S = k_cache.shape[0]
    k = k_cache.reshape(S, -1)
    res = out if out is not None else torch.empty(n, S, device=q.device, dtype=torch.float32)
    BT = INDEXER_BT
    BH = 16 if Hi <= 16 else 32
    hist = topk_ws is not None
    fine, coarse = (topk_ws.fine, topk_ws.coarse) if topk_ws is not None else (res, res)
    _indexer_score_kernel[(triton.cdiv(S, BT), n)](
        q,
        weights,
        k,
        positions,
        row_start if row_start is not None else positions,
        res,
        fine,
        coarse,
        S,
        Hi,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        k.stride(0),
        res.stride(0),
        row_start.stride(0) if row_start is not None else 0,
        DI=Di,
        BH=BH,
        BT=BT,
        HIST=hist,
        HAS_START=row_start is not None,
        num_warps=INDEXER_WARPS,
        num_stages=2,
        **triton_pdl.kw(),
    )
    return res


INDEXER_BT = 128  # cache rows per program of the indexer's score kernel
INDEXER_WARPS = 4


# "radix" (default): triton_topk's multi-program radix select, pass 1 fused into the score kernel;
# "torch": torch.topk (kept to compare side by side).
TOPK_IMPL = "radix"


def indexer_topk(q, weights, k_cache, positions, topk: int, scores_out=None, row_start=None):
    """Indexer scores + exact top-``topk`` index set per query (int32 ``[n, topk]``, -1 padded) over cache rows
    ``row_start[i]..positions[i]`` (``row_start`` int64 ``[1]`` or ``[n]``, default 0): scored and selected in
    the query's own row window (columns relative to ``row_start[i]``), then offset back to cache rows."""
    n, S = q.shape[0], k_cache.shape[0]
    local = positions
    if row_start is not None:
        row_start = row_start.reshape(-1).expand(n).contiguous()
        local = positions - row_start
    if TOPK_IMPL == "radix":
        ws = triton_topk.workspace(n, S, topk, q.device)
        scores = indexer_scores(q, weights, k_cache, positions, out=scores_out, topk_ws=ws, row_start=row_start)
        idx = triton_topk.select_from_hist(scores, local, ws)
    else:
        scores = indexer_scores(q, weights, k_cache, positions, out=scores_out, row_start=row_start)
        kk = min(topk, S)
        vals, idx = torch.topk(scores, kk, dim=-1, sorted=False)
        idx = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
        if kk < topk:
            idx = torch.nn.functional.pad(idx, (0, topk - kk), value=-1)
    if row_start is not None:
        idx = torch.where(idx >= 0, idx + row_start[:, None].to(torch.int32), idx)
    return idx
