"""Plain-PyTorch reference kernels for the ``tilert::*`` ops (any device, any float dtype).

These are the *definitions* of the ops: a faster kernel registered later for a device (CUDA,
Triton, ...) must agree with them up to rounding. They are written for clarity and for static
shapes (no host syncs, no data-dependent shapes on the decode path) so that they can be captured
in a CUDA graph, at the price of touching every cache row: attention over the whole static cache
``[S_max, L+R]`` with a mask, not over the valid prefix.

Accumulation is in float32 (float64 when the inputs are float64, so tests can compare two
formulations to 1e-12); outputs come back in the input dtype.

Block-FP8 weights (``fp8.py``): every op that reads a weight takes its scale too (``scale``, ``s13``/``s2``,
``kv_b_scale``; ``None`` for a plain weight) and the reference dequantises it exactly first (``fp8.dequant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8 import dequant


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs, float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``y = weight * (x / sqrt(mean(x^2) + eps))``.

    The normalisation is computed in float32; the result is cast back to ``x.dtype`` *before* the
    multiplication by ``weight``, exactly as transformers' ``DeepseekV3RMSNorm`` does (so bf16 runs
    are bit-identical to HF).
    """
    acc = _acc_dtype(x)
    xf = x.to(acc)
    var = xf.pow(2).mean(-1, keepdim=True)
    y = (xf * torch.rsqrt(var + eps)).to(x.dtype)
    return (weight.to(x.dtype) * y).contiguous()


def _softmax_latent(scores: torch.Tensor, valid: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """``o[n,h] = sum_t softmax_t(scores[n,h,t] | valid[n,t]) * latent[n?,t]``; rows with no valid key give 0.

    ``scores``: ``[n, H, T]`` (acc dtype), ``valid``: bool ``[n, T]``, ``latent``: ``[T, L]`` or ``[n, T, L]``.
    """
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all-masked rows: avoid inf - inf
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if latent.dim() == 2:
        return torch.matmul(p, latent)  # [n, H, T] @ [T, L]
    return torch.bmm(p, latent)  # [n, H, T] @ [n, T, L]


def mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    row_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: MQA of ``H`` query heads of width ``L+R`` over one latent KV head.

    ``s[i,h,t] = scale * q[i,h,:] . kv_cache[t,:]`` for ``t <= positions[i]`` (causal, the new rows
    are already in the cache), ``p = softmax_t(s)``, ``o[i,h,:] = sum_t p[i,h,t] * kv_cache[t,:L]``.
    ``q = [W_UK^T q_nope | q_pe]`` and ``kv_cache[t] = [c_kv | k_pe]``, so ``q . kv`` equals the naive
    ``q_nope . k_nope + q_pe . k_pe``; the returned latent output still needs ``W_UV`` (per head).

    ``row_start`` (int64 ``[1]`` or ``[n]``, optional): rows below it (below ``row_start[i]`` for query ``i``)
    are skipped too: the MTP layer's valid range, or each query's own sequence in a cache that holds several
    sequences one after the other.

    Shapes: ``q [n, H, L+R]``, ``kv_cache [S_max, L+R]``, ``positions int64 [n]`` -> ``[n, H, L]``.
    """
    acc = _acc_dtype(q)
    kv = kv_cache.to(acc)
    scores = torch.matmul(q.to(acc), kv.t()) * scale  # [n, H, S]
    t = torch.arange(kv_cache.shape[0], device=q.device)
    valid = t[None, :] <= positions[:, None]
    if row_start is not None:
        valid = valid & (t[None, :] >= row_start.reshape(-1, 1))
    return _softmax_latent(scores, valid, kv[:, :kv_lora_rank]).to(q.dtype)


def mla_sparse_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Sparse absorbed MLA (DSA): like :func:`mla_attention` but query ``i`` attends only to the cache rows
    ``indices[i, :]`` (``-1`` marks an empty slot and is skipped; order and duplicates-free-ness of the
    valid entries do not matter since softmax-weighted sums are permutation invariant).

    Shapes: ``q [n, H, L+R]``, ``kv_cache [S_max, L+R]``, ``indices int32 [n, topk]`` -> ``[n, H, L]``.
    A query with no valid index returns zeros.
    """
    acc = _acc_dtype(q)
    idx = indices.long()
    valid = idx >= 0
    rows = kv_cache[idx.clamp(min=0)].to(acc)  # [n, topk, L+R]
    scores = torch.bmm(q.to(acc), rows.transpose(1, 2)) * scale  # [n, H, topk]
    return _softmax_latent(scores, valid, rows[..., :kv_lora_rank]).to(q.dtype)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    positions: torch.Tensor,
    topk: int,
    row_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """DSA lightning-indexer selection.

    ``score[i,t] = sum_h weights[i,h] * relu(q[i,h,:] . k_cache[t,:])`` for ``t <= positions[i]``
    (computed in float32), and the indices of the ``topk`` largest scores, ``-1`` where fewer than
    ``topk`` rows are valid. transformers computes
    ``sum_h (w_h * Hi^-0.5) * relu(Di^-0.5 * q_h . k_t)``; since ``relu(c*x) = c*relu(x)`` for ``c > 0``
    the caller folds both constants into ``weights`` (``weights = weights_proj(x) * Hi^-0.5 * Di^-0.5``).

    Tie-breaking among equal scores is unspecified (torch.topk's), and the order of the returned
    indices is unspecified: consumers must treat the result as a set.

    ``row_start`` (int64 ``[1]`` or ``[n]``, optional): rows below ``row_start[i]`` are not candidates for
    query ``i`` (its sequence starts there in a cache holding several sequences).

    Shapes: ``q [n, Hi, Di]``, ``weights fp32 [n, Hi]``, ``k_cache [S_max, Di]``, ``positions int64 [n]``
    -> ``int32 [n, topk]``.
    """
    acc = _acc_dtype(q)
    logits = torch.matmul(q.to(acc), k_cache.to(acc).t()).relu()  # [n, Hi, S]
    scores = torch.bmm(weights.to(acc)[:, None, :], logits)[:, 0]  # [n, S]
    s_max = k_cache.shape[0]
    t = torch.arange(s_max, device=q.device)
    valid = t[None, :] <= positions[:, None]
    if row_start is not None:
        valid = valid & (t[None, :] >= row_start.reshape(-1, 1))
    scores = scores.masked_fill(~valid, float("-inf"))
    k = min(topk, s_max)
    vals, idx = scores.topk(k, dim=-1)
    idx = torch.where(torch.isfinite(vals), idx, torch.full_like(idx, -1)).to(torch.int32)
    if k < topk:
        pad = torch.full((idx.shape[0], topk - k), -1, dtype=torch.int32, device=idx.device)
        idx = torch.cat([idx, pad], dim=-1)
    return idx


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts: ``out[i] = sum_j w[i,j] * w2[e_ij] @ (silu(g) * u)`` with
    ``[g; u] = w13[e_ij] @ x[i]`` (the first ``I`` rows of ``w13[e]`` are the gate projection).

    Shapes: ``x [n, D]``, ``topk_ids int32 [n, k]``, ``topk_weights fp32 [n, k]``, ``w13 [E, 2I, D]``,
    ``w2 [E, D, I]`` -> ``[n, D]``. The expert matmuls run in ``x.dtype``, the weighted sum in float32.
    An id ``-1`` marks an empty slot (skipped).

    Two equivalent strategies: when ``n*k <= E`` (decode) gather the selected experts' weights (static
    shapes, reads only the chosen experts); otherwise loop over the experts that were hit (prefill).
    """
    n, d = x.shape
    k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    acc = _acc_dtype(x)
    ids = topk_ids.long()
    if n * k <= num_experts:
        wts = torch.where(ids >= 0, topk_weights.to(acc), 0.0)
        ids = ids.clamp(min=0)
        g13 = dequant(w13[ids], None if s13 is None else s13[ids], x.dtype)
        gu = torch.matmul(g13, x[:, None, :, None])[..., 0]  # [n, k, 2I]
        h = F.silu(gu[..., :inter]) * gu[..., inter:]
        g2 = dequant(w2[ids], None if s2 is None else s2[ids], x.dtype)
        y = torch.matmul(g2, h[..., None])[..., 0]  # [n, k, D]
        out = (y.to(acc) * wts[..., None]).sum(dim=1)
        return out.to(x.dtype)
    out = torch.zeros(n, d, dtype=acc, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat[flat >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = F.linear(x[tok], dequant(w13[e], None if s13 is None else s13[e], x.dtype))
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = F.linear(h, dequant(w2[e], None if s2 is None else s2[e], x.dtype))
        out.index_add_(0, tok, y.to(acc) * topk_weights[tok, slot].to(acc)[:, None])
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Fused decode-layer ops. Each is the unfused PyTorch formulation of one fused CUDA kernel sequence;
# on CPU they reproduce transformers' math (same casts, same order), so the engine stays exact.


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate_half) RoPE on the last dim ``R``: pairs ``(x_i, x_{i+R/2})`` rotated by
    ``cos/sin [..., R/2]`` (broadcast), ``[x1 cos - x2 sin | x2 cos + x1 sin]``, in ``x.dtype``.

    DeepSeek's interleaved RoPE (pairs ``(x_2i, x_2i+1)``, written evens-first by transformers) is the same
    map once the projection rows that produce ``x`` are permuted evens-first; ``weights.py`` does that at
    load time, so every RoPE in the engine is this one.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
    scale: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = rms_norm(x; norm_weight) @ weight^T (+ bias)`` (the norm only when ``norm_weight`` is given),
    in ``x.dtype``; ``fp32_out`` returns it as float32 (the lm_head's logits). ``tail [NT, K]``: plain rows
    appended after ``weight``'s (no bias, no scale), ``[y | rms_norm(x) @ tail^T]`` (an FP8 model's bf16
    indexer ``weights_proj`` after the e4m3 ``W_a``)."""
    if tail is not None:
        return torch.cat(
            [gemv(x, weight, norm_weight, eps, bias, fp32_out, scale), gemv(x, tail, norm_weight, eps, None, fp32_out)],
            -1,
        )
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    y = F.linear(x, dequant(weight, scale, x.dtype), None if bias is None else bias.to(x.dtype))
    return y.float() if fp32_out else y


def gemv_residual(
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> None:
    """``out = residual + x @ weight^T`` (o_proj folded into the residual add; ``residual`` may be ``out``, in
    place; ``None``: the product alone, a tensor-parallel rank's share)."""
    write_residual(out, F.linear(x, dequant(weight, scale, x.dtype)), residual)


def write_residual(out: torch.Tensor, y: torch.Tensor, residual: torch.Tensor | None) -> None:
    """``out = residual + y`` (one rounding, as an in-place add), or ``y`` when ``residual`` is ``None``."""
    if residual is None:
        out.copy_(y)
    else:
        torch.add(residual, y, out=out)


def router(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk: bool,
    n_shared: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing of ``x = rms_norm(h)`` (DeepSeek-V3 / V3.2 / GLM-5, as transformers computes it).

    ``s = sigmoid(x @ gate^T)`` in float32; choice scores ``s + bias``; experts split in ``n_group``
    groups ranked by the sum of their two best choice scores, the best ``topk_group`` groups kept;
    ``top_k`` experts by choice score among them; weights ``s[e]`` (normalised to sum 1 when
    ``norm_topk``) times ``route_scale``. Then ``n_shared`` shared-expert slots are appended: ids
    ``E..E+n_shared-1`` (the shared experts stacked after the routed ones), weight 1.

    Shapes: ``h [n, D]``, ``gate_weight [E, D]``, ``bias fp32 [E]`` -> ``(int32 [n, k+S], fp32 [n, k+S])``.
    """
    n = h.shape[0]
    e, g = gate_weight.shape[0], n_group
    acc = _acc_dtype(h)
    x = rms_norm(h, norm_weight, eps)
    scores = F.linear(x.to(acc), gate_weight.to(acc)).sigmoid()
    choice = scores + bias.to(acc)
    group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask[:, :, None].expand(n, g, e // g).reshape(n, e)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * route_scale
    shared_ids = torch.arange(e, e + n_shared, device=h.device).expand(n, n_shared)
    ids = torch.cat([ids, shared_ids], dim=1).to(torch.int32)
    weights = torch.cat([weights.float(), torch.ones(n, n_shared, device=h.device)], dim=1)
    return ids, weights


def moe_residual(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
) -> None:
    """In place: ``h += moe_experts(rms_norm(h), ...)`` (post-attention norm, experts incl. the stacked
    shared ones, and the residual add in one op)."""
    x = rms_norm(h, norm_weight, eps)
    h.add_(moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2))


def moe_partial(
    out: torch.Tensor,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    residual: torch.Tensor | None,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
) -> None:
    """``out = residual + moe_experts(rms_norm(x; norm_weight), ...)`` (``x`` as it is without ``norm_weight``;
    ``residual`` ``None``: the experts' sum alone); ``out`` may be ``x`` or ``residual`` (``moe_partial(h, h,
    norm, ..., h)`` is :func:`moe_residual`)."""
    xn = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    write_residual(out, moe_experts(xn, topk_ids, topk_weights, w13, w2, s13, s2), residual)


def moe_block(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    route_scale: float,
    norm_topk: bool,
    n_shared: int,
    w13: torch.Tensor,
    w2: torch.Tensor,
    s13: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed MoE block in place: :func:`router` then :func:`moe_residual`; returns the routing
    (``ids``, ``weights``) it used."""
    ids, weights = router(
        h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
    )
    moe_residual(h, norm_weight, eps, ids, weights, w13, w2, s13, s2)
    return ids, weights


def mla_prep(
    a: torch.Tensor,
    b: torch.Tensor,
    positions: torch.Tensor,
    kv_b: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_norm_weight: torch.Tensor,
    kv_cache: torch.Tensor,
    index_norm_weight: torch.Tensor | None,
    index_norm_bias: torch.Tensor | None,
    index_cache: torch.Tensor | None,
    num_heads: int,
    nope_dim: int,
    kv_offset: int,
    index_heads: int,
    eps: float,
    index_weight_scale: float,
    kv_b_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Everything between the two input GEMVs of an MLA(+DSA) layer and attention.

    Inputs: ``a = W_a rms(h)`` laid out ``[q_a (kv_offset) | c_kv (L) | k_pe (R) | idx_k (Di) | idx_w (Hi)]``
    and ``b = W_b rms(q_a)`` laid out ``[q (H*(P+R)) | idx_q (Hi*Di)]`` (without q_lora ``b`` is ``a`` and
    ``q`` its first ``H*(P+R)`` columns); ``kv_b [H*(P+V), L]`` (``[W_UK; W_UV]`` per head); RoPE tables
    ``cos/sin [S, R/2]``.

    - ``q~_h = W_UK_h^T q_nope_h``; the query is ``[q~_h | rope(q_pe_h)]`` ``[n, H, L+R]``.
    - cache row ``kv_cache[pos] = [rms_norm(c_kv; kv_norm_weight) | rope(k_pe)]``.
    - with an indexer: ``index_cache[pos] = [rope(k[:R]) | k[R:]]`` with ``k = LayerNorm(idx_k)``;
      indexer queries ``[rope(q_i[:R]) | q_i[R:]]`` ``[n, Hi, Di]``; head weights
      ``idx_w * index_weight_scale`` (float32 ``[n, Hi]``). Without one, both come back empty.

    Returns ``(q, index_q, index_w)``; writes the cache rows at ``positions``.
    """
    n = a.shape[0]
    h, p = num_heads, nope_dim
    lat = kv_norm_weight.shape[0]
    r = kv_cache.shape[-1] - lat
    if kv_b_scale is not None:
        kv_b = dequant(kv_b, kv_b_scale, a.dtype)
    q = b[:, : h * (p + r)].reshape(n, h, p + r)
    q_nope, q_pe = q[..., :p], q[..., p:]
    w_kvb = kv_b.view(h, -1, lat)
    cs, sn = cos[positions], sin[positions]  # [n, R/2]
    # Absorb W_UK into the query (per-head batched matmul): q~ [n, H, L].
    q_abs = torch.bmm(q_nope.transpose(0, 1), w_kvb[:, :p].to(q.dtype)).transpose(0, 1)
    q_full = torch.cat([q_abs, apply_rope_half(q_pe, cs[:, None], sn[:, None])], dim=-1).to(kv_cache.dtype)

    c_kv = rms_norm(a[:, kv_offset : kv_offset + lat], kv_norm_weight, eps)
    k_pe = apply_rope_half(a[:, kv_offset + lat : kv_offset + lat + r], cs, sn)
    kv_cache.index_copy_(0, positions, torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype))

    if index_cache is None:
        return q_full, a.new_empty(n, 0, 0), a.new_empty(n, 0, dtype=torch.float32)
    assert index_norm_weight is not None and index_norm_bias is not None, "an indexer cache needs its norm"
    di, hi = index_cache.shape[-1], index_heads
    o = kv_offset + lat + r
    k = F.layer_norm(a[:, o : o + di], (di,), index_norm_weight.to(a.dtype), index_norm_bias.to(a.dtype), eps)
    k = torch.cat([apply_rope_half(k[:, :r], cs, sn), k[:, r:]], dim=-1)
    index_cache.index_copy_(0, positions, k.to(index_cache.dtype))
    iw = a[:, o + di : o + di + hi].float() * index_weight_scale
    iq = b[:, h * (p + r) : h * (p + r) + hi * di].reshape(n, hi, di)
    iq = torch.cat([apply_rope_half(iq[..., :r], cs[:, None], sn[:, None]), iq[..., r:]], dim=-1)
    return q_full, iq.contiguous(), iw


def mla_uv(
    o_lat: torch.Tensor, kv_b: torch.Tensor, nope_dim: int, kv_b_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``o_h = W_UV_h o~_h`` for every head: ``o_lat [n, H, L]``, ``kv_b [H*(P+V), L]`` -> ``[n, H*V]``."""
    n, h, lat = o_lat.shape
    if kv_b_scale is not None:
        kv_b = dequant(kv_b, kv_b_scale, o_lat.dtype)
    w_kvb = kv_b.view(h, -1, lat)
    o = torch.bmm(o_lat.transpose(0, 1), w_kvb[:, nope_dim:].transpose(1, 2).to(o_lat.dtype))  # [H, n, V]
    return o.transpose(0, 1).reshape(n, -1)


def mla_attention_uv(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    positions: torch.Tensor | None,
    indices: torch.Tensor | None,
    scale: float,
    kv_lora_rank: int,
    row_start: torch.Tensor | None,
    kv_b: torch.Tensor,
    nope_dim: int,
    kv_b_scale: torch.Tensor | None = None,
    max_rows: int = 0,
) -> torch.Tensor:
    """Attention straight to ``o [n, H*V]``: :func:`mla_uv` of :func:`mla_attention` (dense, ``indices is None``:
    rows ``row_start..positions``) or of :func:`mla_sparse_attention` (``indices``); ``o~`` is rounded to ``q``'s
    dtype in between, as the two ops do. ``max_rows`` (a bound for the device kernels' splits) changes nothing
    here."""
    if indices is None:
        assert positions is not None, "dense MLA needs positions"
        o_lat = mla_attention(q, kv_cache, positions, scale, kv_lora_rank, row_start)
    else:
        o_lat = mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank)
    return mla_uv(o_lat, kv_b, nope_dim, kv_b_scale)


def l2_prefetch(tensors: list[torch.Tensor], sites: str) -> None:
    """Nothing: a cache hint has no result (CUDA: :mod:`.triton_prefetch`)."""
    return None
