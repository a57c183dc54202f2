"""CPU decode kernels for the ``tilert::*`` ops: the reference math (:mod:`.reference`) in native kernels
(:mod:`.native`) and fewer, larger ATen calls, called *directly* by the model on CPU (``Transformer.use_kernels(cpu)``,
set by the engine), not through the ``torch.library`` dispatcher.

Why (``benchmarks/cpu_decode_speed.py`` measures it): at the tiny models' sizes a decode step's real arithmetic is a
small part of the step; the rest is overhead. The dispatcher costs tens of microseconds per custom-op call; the
reference kernels spend hundreds of small ATen calls per step (five for each RMSNorm, two RoPE rotations of seven
ops per layer, the MoE weights gathered by copy, ...); and the reference attention and indexer read the whole static
cache (``max_seq_len`` rows, masked) because they must keep static shapes for CUDA graphs. The CPU takes no graphs,
so these kernels read the host position (a CPU tensor, no device sync) and touch only the cache rows up to the last
position.

Each function has the signature of the op of the same name and agrees with the reference up to float32
rounding (the engine's tests compare the fast path with transformers at 1e-4 and greedy tokens exactly;
``tests/test_ops_reference.py`` compares each kernel with the reference). Inputs the fast code does not cover
(dtypes other than float32, shapes of no decode step) go to the reference.

**Row-invariant**: every kernel gives each row exactly what it gives that row alone, whatever the row count, so a
decode step over the rows of several sequences (``TileRTEngine.decode_step``: one model call, flat cache rows) is bit
for bit each sequence's step alone. Up to ``ROWWISE_MAX`` rows the products, norms, attention, router and experts run
in the native kernels (:mod:`.native`, ``native/rows.c``): one fixed floating-point chain per output, each weight read
once for all rows, every sequence's attention in one call, each chosen expert once over the rows that chose it; they
also replace most of a step's hundreds of small ATen calls, which on a small model cost more than the arithmetic.
Where the native kernels cannot be built (no C compiler, ``TILERT_CPU_NATIVE=0``) or the weights are FP8, ATen
computes, row-invariant the slow way: CPU BLAS is not batch-invariant across row counts (MKL's sgemm of 1 row, of 2-3
rows and of 4+ rows round differently), so products with several rows run as a batch of one-row products
(:func:`_linear`: ``bmm`` of ``[n, 1, K]`` rows against the weight broadcast, which MKL computes as ``n`` one-row
products, the same rounding as ``F.linear`` of one row), and what reads a row's own cache rows (attention, the
indexer) or its own experts loops over the rows. A transcendental element-wise function over a *contiguous* block of
several rows runs row by row too (:func:`_each_row`; the router's sigmoid): ATen computes a tensor's elements in SIMD
blocks and its last, partial block with scalar code of another rounding, so where a row's width is not a multiple of
the block an element's value depends on ``n`` (the router's 8 scores on an AVX2 host: one row is all scalar tail, two
rows one full block). Over a strided view (the SwiGLU's gate half) ATen already walks row by row. Only a step of one
sequence's several tokens (a prompt, an MTP verification) needs no such match; over ``ROWWISE_MAX`` rows (a prompt)
the kernels batch.

Block-FP8 weights (``fp8.py``) are dequantised exactly (``fp8.dequant``) right before use, one weight (one
expert) at a time: the model stays FP8 in memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ..fp8 import dequant
from . import native, reference

__all__ = [
    "rms_norm",
    "gemv",
    "gemv_residual",
    "mla_prep",
    "mla_attention",
    "mla_sparse_attention",
    "indexer_topk",
    "mla_uv",
    "mla_attention_uv",
    "moe_experts",
    "moe_residual",
    "moe_block",
    "router",
    "moe_partial",
    "l2_prefetch",
]

_F32 = torch.float32

l2_prefetch = reference.l2_prefetch  # a cache hint: nothing to do on the CPU

ROWWISE_MAX = 64
"""Steps of up to this many rows compute row by row (a decode step of several sequences, an MTP verification);
longer ones (prompts: the engine's own prefill) take the batched, faster products."""


def _fast(*ts: Tensor | None) -> bool:
    for t in ts:  # a plain loop: this runs some 40 times a decode step
        if t is not None and t.dtype != _F32:
            return False
    return True


def _native(n: int) -> native.Kernels | None:
    """The native kernels for a step of ``n`` rows; None where ATen computes (no kernels, or more than
    ``ROWWISE_MAX`` rows: a prompt, which the batched products compute faster)."""
    return native.kernels() if n <= ROWWISE_MAX else None


def _no_indexer(a: Tensor) -> tuple[Tensor, Tensor]:
    """``mla_prep``'s indexer outputs for a layer without one (empty)."""
    n = a.shape[0]
    return a.new_empty(n, 0, 0), a.new_empty(n, 0, dtype=torch.float32)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The native kernel (or one ATen call, ``F.rms_norm``) in float32; the reference's formula."""
    if not _fast(x, weight):
        return reference.rms_norm(x, weight, eps)
    return _rms(x, weight, eps)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    nk = _native(x.shape[0])
    if nk is not None and x.dim() == 2 and x.stride(-1) == 1:
        return nk.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T (+ bias)`` with each row rounded exactly as that row alone (module docstring)."""
    n = x.shape[0]
    nk = _native(n)
    if n > ROWWISE_MAX:
        y = F.linear(x, weight)
    elif nk is not None and x.stride(-1) == 1 and weight.stride(-1) == 1:
        y = nk.linear(x, weight)
    elif n == 1:
        y = F.linear(x, weight)
    else:
        y = torch.bmm(x.unsqueeze(1), weight.t().expand(n, -1, -1)).squeeze(1)
    return y if bias is None else y.add_(bias)


def _each_row(n: int, row: Callable[[int], Tensor], batched: Callable[[], Tensor]) -> Tensor:
    """``row(i)`` (a one-row result) for ``i < n``, stacked: a kernel applied to every row on its own; over
    ``ROWWISE_MAX`` rows ``batched()`` instead."""
    if n > ROWWISE_MAX:
        return batched()
    return row(0) if n == 1 else torch.cat([row(i) for i in range(n)])


def gemv(
    x: Tensor,
    weight: Tensor,
    norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    bias: Tensor | None = None,
    fp32_out: bool = False,
    scale: Tensor | None = None,
    tail: Tensor | None = None,
) -> Tensor:
    if tail is not None:  # reference.gemv's tail: plain rows after weight's
        return torch.cat(
            [gemv(x, weight, norm_weight, eps, bias, fp32_out, scale), gemv(x, tail, norm_weight, eps, None, fp32_out)],
            -1,
        )
    if scale is not None:
        weight = dequant(weight, scale, x.dtype)
    if not _fast(x, weight, norm_weight, bias):
        return reference.gemv(x, weight, norm_weight, eps, bias, fp32_out)
    if norm_weight is not None:
        x = _rms(x, norm_weight, eps)
    return _linear(x, weight, bias)


def gemv_residual(out: Tensor, x: Tensor, weight: Tensor, residual: Tensor | None, scale: Tensor | None = None) -> None:
    if scale is not None:
        weight = dequant(weight, scale, x.dtype)
    if not _fast(out, x, weight, residual):
        return reference.gemv_residual(out, x, weight, residual)
    reference.write_residual(out, _linear(x, weight), residual)


def mla_prep(
    a: Tensor,
    b: Tensor,
    positions: Tensor,
    kv_b: Tensor,
    cos: Tensor,
    sin: Tensor,
    kv_norm_weight: Tensor,
    kv_cache: Tensor,
    index_norm_weight: Tensor | None,
    index_norm_bias: Tensor | None,
    index_cache: Tensor | None,
    num_heads: int,
    nope_dim: int,
    kv_offset: int,
    index_heads: int,
    eps: float,
    index_weight_scale: float,
    kv_b_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`reference.mla_prep` with every RoPE'd slice (query heads, key, indexer query heads and key)
    rotated in one pass, and the norm as one call."""
    if kv_b_scale is not None:
        kv_b = dequant(kv_b, kv_b_scale, a.dtype)
    if not _fast(a, b, kv_b, cos, kv_norm_weight, kv_cache, index_norm_weight, index_cache):
        return reference.mla_prep(
            a,
            b,
            positions,
            kv_b,
            cos,
            sin,
            kv_norm_weight,
            kv_cache,
            index_norm_weight,
            index_norm_bias,
            index_cache,
            num_heads,
            nope_dim,
            kv_offset,
            index_heads,
            eps,
            index_weight_scale,
        )
    n = a.shape[0]
    nk = _native(n)
    if nk is not None and index_cache is None:
        q_full = nk.mla_prep(
            a, b, positions, kv_b, cos, sin, kv_norm_weight, kv_cache, num_heads, nope_dim, kv_offset, eps
        )
        return q_full, *_no_indexer(a)
    h, p = num_heads, nope_dim
    lat = kv_norm_weight.shape[0]
    r = kv_cache.shape[-1] - lat
    half = r // 2
    qw = h * (p + r)
    q = b[:, :qw].view(n, h, p + r)
    ko = kv_offset + lat
    parts = [q[..., p:], a[:, ko : ko + r].unsqueeze(1)]  # [n, H, R], [n, 1, R]
    hi = di = 0
    k_idx = iq = None
    if index_cache is not None:
        assert index_norm_weight is not None and index_norm_bias is not None, "an indexer cache needs its norm"
        di, hi = index_cache.shape[-1], index_heads
        o = ko + r
        k_idx = F.layer_norm(a[:, o : o + di], (di,), index_norm_weight, index_norm_bias, eps)
        iq = b[:, qw : qw + hi * di].view(n, hi, di)
        parts += [iq[..., :r], k_idx[:, None, :r]]
    x = torch.cat(parts, dim=1)  # [n, H + 1 (+ Hi + 1), R]: everything RoPE'd at these positions
    cs, sn = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([x1 * cs - x2 * sn, x2 * cs + x1 * sn], dim=-1)

    w_uk = kv_b.view(h, -1, lat)[:, :p]  # [H, P, L]
    if nk is not None:
        q_abs = nk.linear_kn(q[..., :p].transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, L]
    else:
        q_abs = _each_row(
            n,
            lambda i: torch.bmm(q[i, :, None, :p], w_uk).transpose(0, 1),
            lambda: torch.bmm(q[..., :p].transpose(0, 1), w_uk).transpose(0, 1),
        )
    q_full = torch.cat([q_abs, rot[:, :h]], dim=-1)
    c_kv = _rms(a[:, kv_offset:ko], kv_norm_weight, eps)
    kv_cache.index_copy_(0, positions, torch.cat([c_kv, rot[:, h]], dim=-1))
    if index_cache is None:
        return q_full, *_no_indexer(a)
    assert k_idx is not None and iq is not None
    index_cache.index_copy_(0, positions, torch.cat([rot[:, -1], k_idx[:, r:]], dim=-1))
    o = ko + r
    iw = a[:, o + di : o + di + hi] * index_weight_scale
    iq_full = torch.cat([rot[:, h + 1 : h + 1 + hi], iq[..., r:]], dim=-1)
    return q_full, iq_full, iw


def _rows_upto(positions: Tensor) -> int:
    """Cache rows a step reads: up to its last position (a host read of a CPU tensor, no sync)."""
    return int(positions.max()) + 1


def _row_bounds(positions: Tensor, row_start: Tensor | None, i: int) -> tuple[int, int]:
    """Row ``i``'s cache rows ``lo..end-1``: from its sequence's first row to its own position."""
    end = int(positions[i]) + 1
    if row_start is None:
        return 0, end
    starts = row_start.reshape(-1)
    return min(int(starts[i if starts.numel() > 1 else 0]), end), end


def _attend(q: Tensor, kv: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    """One query ``q [H, L+R]`` over exactly the rows ``kv [T, L+R]``: a plain softmax, three ATen calls."""
    s = torch.mm(q, kv.t()).mul_(scale)  # [H, T]
    return torch.mm(torch.softmax(s, dim=-1), kv[:, :kv_lora_rank]).unsqueeze(0)


def mla_attention(
    q: Tensor, kv_cache: Tensor, positions: Tensor, scale: float, kv_lora_rank: int, row_start: Tensor | None = None
) -> Tensor:
    """Over rows ``row_start..positions[i]`` only (the reference masks the whole static cache). Up to
    ``ROWWISE_MAX`` queries with the native kernels: each query over its own rows in one call. Without them: one
    query, or one query per sequence (``row_start`` given), each row on its own; several tokens of one sequence (a
    prompt, an MTP verification), the reference over the rows up to the last position."""
    n = q.shape[0]
    nk = _native(n)
    if nk is not None and _fast(q, kv_cache) and kv_cache.is_contiguous():
        out = nk.mla_attend(q, kv_cache, positions, row_start, scale, kv_lora_rank)
        if out is not None:
            return out
    if (n == 1 or row_start is not None) and _fast(q, kv_cache):
        bounds = [_row_bounds(positions, row_start, i) for i in range(n)]
        if all(lo < end for lo, end in bounds):
            return torch.cat(
                [_attend(q[i], kv_cache[lo:end], scale, kv_lora_rank) for i, (lo, end) in enumerate(bounds)]
            )
    return reference.mla_attention(q, kv_cache[: _rows_upto(positions)], positions, scale, kv_lora_rank, row_start)


def mla_sparse_attention(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    """The reference, row by row (its batched product rounds each row by the row count)."""
    return _each_row(
        q.shape[0],
        lambda i: reference.mla_sparse_attention(q[i : i + 1], kv_cache, indices[i : i + 1], scale, kv_lora_rank),
        lambda: reference.mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank),
    )


def indexer_topk(
    q: Tensor, weights: Tensor, k_cache: Tensor, positions: Tensor, topk: int, row_start: Tensor | None = None
) -> Tensor:
    """Scores over rows ``..positions[i]`` only (the reference scores the whole static cache). One query per
    sequence (``row_start`` given): each row over its own sequence's rows, its indices shifted back to cache
    rows, so a row picks exactly what it picks alone."""
    n = q.shape[0]
    if row_start is None:
        return reference.indexer_topk(q, weights, k_cache[: _rows_upto(positions)], positions, topk)

    def row(i: int) -> Tensor:
        lo, end = _row_bounds(positions, row_start, i)
        idx = reference.indexer_topk(q[i : i + 1], weights[i : i + 1], k_cache[lo:end], positions[i : i + 1] - lo, topk)
        return torch.where(idx >= 0, idx + lo, idx)

    return torch.cat([row(i) for i in range(n)])


def mla_attention_uv(
    q: Tensor,
    kv_cache: Tensor,
    positions: Tensor | None,
    indices: Tensor | None,
    scale: float,
    kv_lora_rank: int,
    row_start: Tensor | None,
    kv_b: Tensor,
    nope_dim: int,
    kv_b_scale: Tensor | None = None,
    max_rows: int = 0,
) -> Tensor:
    """:func:`mla_uv` of :func:`mla_attention` / :func:`mla_sparse_attention` (``reference.mla_attention_uv``;
    ``max_rows`` only sizes the device kernels' work)."""
    if indices is None:
        assert positions is not None, "dense MLA needs positions"
        o_lat = mla_attention(q, kv_cache, positions, scale, kv_lora_rank, row_start)
    else:
        o_lat = mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank)
    return mla_uv(o_lat, kv_b, nope_dim, kv_b_scale)


def mla_uv(o_lat: Tensor, kv_b: Tensor, nope_dim: int, kv_b_scale: Tensor | None = None) -> Tensor:
    if kv_b_scale is not None:
        kv_b = dequant(kv_b, kv_b_scale, o_lat.dtype)
    n, h, lat = o_lat.shape
    nk = _native(n)
    if nk is not None and _fast(o_lat, kv_b) and o_lat.stride(-1) == 1:
        w_uv = kv_b.view(h, -1, lat)[:, nope_dim:]  # [H, V, L]
        return nk.linear(o_lat.transpose(0, 1), w_uv).transpose(0, 1).reshape(n, -1)
    return _each_row(
        o_lat.shape[0],
        lambda i: reference.mla_uv(o_lat[i : i + 1], kv_b, nope_dim),
        lambda: reference.mla_uv(o_lat, kv_b, nope_dim),
    )


def _expert(w: Tensor, s: Tensor | None, e: int, dtype: torch.dtype) -> Tensor:
    """Expert ``e``'s weight, in place (plain) or dequantised (FP8)."""
    return w[e] if s is None else dequant(w[e], s[e], dtype)


def _expert_sum(
    x: Tensor,
    ids: list[int],
    weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> Tensor:
    """``sum_j weights[j] * expert_{ids[j]}(x)`` for one token ``x [1, D]``: each expert's weights read in place
    (the reference gathers them by copy), the sum in float32 in slot order; ids ``-1`` are skipped."""
    out: Tensor | None = None
    for j, e in enumerate(ids):
        if e < 0:
            continue
        y = _mlp(x, _expert(w13, s13, e, x.dtype), _expert(w2, s2, e, x.dtype)).mul_(weights[:, j : j + 1])
        out = y if out is None else out.add_(y)
    return torch.zeros_like(x) if out is None else out


def _mlp(x: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """One SwiGLU expert over the rows of ``x`` (gate rows first in ``w13``), each row as alone."""
    inter = w13.shape[0] // 2
    gu = _linear(x, w13)
    return _linear(F.silu(gu[:, :inter]) * gu[:, inter:], w2)


def _experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> Tensor:
    """The experts of every row (float32). Up to ``ROWWISE_MAX`` rows with float32 weights: the native kernel
    (each chosen expert once over the rows that chose it). Otherwise a dense MLP (one expert, id 0) over all rows
    at once, routed experts token by token (each token reads its own experts in place)."""
    n = x.shape[0]
    nk = _native(n)
    if nk is not None and s13 is None and s2 is None:
        return nk.moe_experts(x, topk_ids, topk_weights, w13, w2)
    if w13.shape[0] == 1 and topk_ids.shape[1] == 1:
        return _mlp(x, _expert(w13, s13, 0, x.dtype), _expert(w2, s2, 0, x.dtype)).mul_(topk_weights)
    if n > ROWWISE_MAX:
        return reference.moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2)
    ids = topk_ids.tolist()
    return torch.cat(
        [_expert_sum(x[i : i + 1], ids[i], topk_weights[i : i + 1], w13, w2, s13, s2) for i in range(len(ids))]
    )


def _weights_fast(x: Tensor, w: Tensor, s: Tensor | None) -> bool:
    """Float32 weights, or FP8 ones dequantised to float32 (``x`` float32)."""
    return _fast(w) or (s is not None and _fast(x))


def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> Tensor:
    if not (_fast(x, topk_weights) and _weights_fast(x, w13, s13) and _weights_fast(x, w2, s2)):
        return reference.moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2)
    return _experts(x, topk_ids, topk_weights, w13, w2, s13, s2)


def _experts_residual(
    h: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> None:
    """``h += moe_experts(x, ...)`` with ``x = rms_norm(h)`` already computed."""
    h.add_(moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2))


def moe_residual(
    h: Tensor,
    norm_weight: Tensor,
    eps: float,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> None:
    _experts_residual(h, rms_norm(h, norm_weight, eps), topk_ids, topk_weights, w13, w2, s13, s2)


def moe_partial(
    out: Tensor,
    x: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    residual: Tensor | None,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> None:
    xn = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    reference.write_residual(out, moe_experts(xn, topk_ids, topk_weights, w13, w2, s13, s2), residual)


def _router(
    x: Tensor,
    gate_weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk: bool,
    n_shared: int,
) -> tuple[Tensor, Tensor]:
    """:func:`reference.router` on ``x = rms_norm(h)`` (computed once for the router and the experts); the group
    mask is skipped when every group is kept (it is then all ones)."""
    n = x.shape[0]
    nk = _native(n)
    if nk is not None:
        return nk.moe_route(x, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared)
    e, g = gate_weight.shape[0], n_group
    logits = _linear(x, gate_weight)
    scores = _each_row(n, lambda i: logits[i : i + 1].sigmoid(), logits.sigmoid)  # module docstring
    choice = scores + bias
    if topk_group < g:
        group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros(n, g, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.view(n, g, e // g).masked_fill(~keep[:, :, None], float("-inf")).view(n, e)
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * route_scale
    if n_shared:
        ids = torch.cat([ids, torch.arange(e, e + n_shared).expand(n, n_shared)], dim=1)
        weights = torch.cat([weights, torch.ones(n, n_shared)], dim=1)
    return ids.to(torch.int32), weights


def moe_block(
    h: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk: bool,
    n_shared: int,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    if not (_fast(h, norm_weight, gate_weight, bias) and _weights_fast(h, w13, s13) and _weights_fast(h, w2, s2)):
        return reference.moe_block(
            h,
            norm_weight,
            eps,
            gate_weight,
            bias,
            top_k,
            n_group,
            topk_group,
            route_scale,
            norm_topk,
            n_shared,
            w13,
            w2,
            s13,
            s2,
        )
    x = _rms(h, norm_weight, eps)
    ids, weights = _router(x, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared)
    _experts_residual(h, x, ids, weights, w13, w2, s13, s2)
    return ids, weights


def router(
    h: Tensor,
    norm_weight: Tensor,
    eps: float,
    gate_weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk: bool,
    n_shared: int,
) -> tuple[Tensor, Tensor]:
    if not _fast(h, norm_weight, gate_weight, bias):
        return reference.router(
            h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
        )
    x = _rms(h, norm_weight, eps)
    return _router(x, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared)
