"""Plain-PyTorch reference kernels for the ``tilert::*`` ops (any device, any float dtype).

These are the *definitions* of the ops: a faster kernel registered later for a device (CUDA,
Triton, ...) must agree with them up to rounding. They are written for clarity and for static
shapes (no host syncs, no data-dependent shapes on the decode path) so that they can be captured
in a CUDA graph, at the price of touching every cache row: attention over the whole static cache
``[S_max, L+R]`` with a mask, not over the valid prefix.

Accumulation is in float32 (float64 when the inputs are float64, so tests can compare two
formulations to 1e-12); outputs come back in the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    q: torch.Tensor, kv_cache: torch.Tensor, positions: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Absorbed MLA decode: MQA of ``H`` query heads of width ``L+R`` over one latent KV head.

    ``s[i,h,t] = scale * q[i,h,:] . kv_cache[t,:]`` for ``t <= positions[i]`` (causal, the new rows
    are already in the cache), ``p = softmax_t(s)``, ``o[i,h,:] = sum_t p[i,h,t] * kv_cache[t,:L]``.
    ``q = [W_UK^T q_nope | q_pe]`` and ``kv_cache[t] = [c_kv | k_pe]``, so ``q . kv`` equals the naive
    ``q_nope . k_nope + q_pe . k_pe``; the returned latent output still needs ``W_UV`` (per head).

    Shapes: ``q [n, H, L+R]``, ``kv_cache [S_max, L+R]``, ``positions int64 [n]`` -> ``[n, H, L]``.
    """
    acc = _acc_dtype(q)
    kv = kv_cache.to(acc)
    scores = torch.matmul(q.to(acc), kv.t()) * scale  # [n, H, S]
    t = torch.arange(kv_cache.shape[0], device=q.device)
    valid = t[None, :] <= positions[:, None]
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
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, positions: torch.Tensor, topk: int
) -> torch.Tensor:
    """DSA lightning-indexer selection.

    ``score[i,t] = sum_h weights[i,h] * relu(q[i,h,:] . k_cache[t,:])`` for ``t <= positions[i]``
    (computed in float32), and the indices of the ``topk`` largest scores, ``-1`` where fewer than
    ``topk`` rows are valid. transformers computes
    ``sum_h (w_h * Hi^-0.5) * relu(Di^-0.5 * q_h . k_t)``; since ``relu(c*x) = c*relu(x)`` for ``c > 0``
    the caller folds both constants into ``weights`` (``weights = weights_proj(x) * Hi^-0.5 * Di^-0.5``).

    Tie-breaking among equal scores is unspecified (torch.topk's), and the order of the returned
    indices is unspecified: consumers must treat the result as a set.

    Shapes: ``q [n, Hi, Di]``, ``weights fp32 [n, Hi]``, ``k_cache [S_max, Di]``, ``positions int64 [n]``
    -> ``int32 [n, topk]``.
    """
    acc = _acc_dtype(q)
    logits = torch.matmul(q.to(acc), k_cache.to(acc).t()).relu()  # [n, Hi, S]
    scores = torch.bmm(weights.to(acc)[:, None, :], logits)[:, 0]  # [n, S]
    s_max = k_cache.shape[0]
    t = torch.arange(s_max, device=q.device)
    valid = t[None, :] <= positions[:, None]
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
) -> torch.Tensor:
    """Routed SwiGLU experts: ``out[i] = sum_j w[i,j] * w2[e_ij] @ (silu(g) * u)`` with
    ``[g; u] = w13[e_ij] @ x[i]`` (the first ``I`` rows of ``w13[e]`` are the gate projection).

    Shapes: ``x [n, D]``, ``topk_ids int32 [n, k]``, ``topk_weights fp32 [n, k]``, ``w13 [E, 2I, D]``,
    ``w2 [E, D, I]`` -> ``[n, D]``. The expert matmuls run in ``x.dtype``, the weighted sum in float32.

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
        gu = torch.matmul(w13[ids].to(x.dtype), x[:, None, :, None])[..., 0]  # [n, k, 2I]
        h = F.silu(gu[..., :inter]) * gu[..., inter:]
        y = torch.matmul(w2[ids].to(x.dtype), h[..., None])[..., 0]  # [n, k, D]
        out = (y.to(acc) * topk_weights.to(acc)[..., None]).sum(dim=1)
        return out.to(x.dtype)
    out = torch.zeros(n, d, dtype=acc, device=x.device)
    flat = ids.reshape(-1)
    for e in torch.unique(flat).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gu = F.linear(x[tok], w13[e].to(x.dtype))
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = F.linear(h, w2[e].to(x.dtype))
        out.index_add_(0, tok, y.to(acc) * topk_weights[tok, slot].to(acc)[:, None])
    return out.to(x.dtype)
