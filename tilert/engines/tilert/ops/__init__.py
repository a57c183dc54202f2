"""The ``tilert::*`` custom ops: the only way the model computes attention, indexer top-k, MoE experts
and RMSNorm.

Each op is a ``torch.library.custom_op`` whose default kernel (every device) is the plain-PyTorch
reference in :mod:`.reference`, plus a ``register_fake`` so ``torch.compile`` can trace it. A device
kernel registered later (``torch.library.register_kernel("tilert::mla_attention", "cuda", fn)``, e.g.
the Triton kernels of :mod:`.cuda`, registered at start-up by :func:`register_device_kernels`) replaces the
reference for that device with no change to the model. Importing this package registers nothing.

:mod:`.cpu` holds CPU kernels with the same signatures (the reference math in fewer ATen calls, over only the
cache rows a step reads); the CPU engine calls them directly, not through the dispatcher
(``Transformer.use_kernels``), which on a small model costs more than the arithmetic.

Block-FP8 weights (``fp8.py``): the ops that read weights take the weight's scale as a trailing optional
argument (``scale``, ``s13``/``s2``, ``kv_b_scale``; ``None`` for bf16/fp32 weights).

CUDA-graph friendliness: no op takes a Python int that changes from one decode step to the next;
positions and indices are device tensors, shapes depend only on the batch of new tokens and the
static cache size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference

__all__ = [
    "register_device_kernels",
    "rms_norm",
    "mla_attention",
    "mla_sparse_attention",
    "indexer_topk",
    "moe_experts",
    "gemv",
    "gemv_residual",
    "moe_residual",
    "moe_block",
    "router",
    "moe_partial",
    "mla_prep",
    "mla_uv",
    "mla_attention_uv",
    "l2_prefetch",
]


@torch.library.custom_op("tilert::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of ``x [..., D]`` with ``weight [D]``; see :func:`reference.rms_norm`."""
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tilert::mla_attention", mutates_args=())
def mla_attention(
    q: Tensor, kv_cache: Tensor, positions: Tensor, scale: float, kv_lora_rank: int, row_start: Tensor | None = None
) -> Tensor:
    """Absorbed causal MLA: ``q [n,H,L+R]`` over ``kv_cache [S_max,L+R]`` rows ``row_start[i]..positions[i]``
    (``row_start`` int64 ``[1]`` or ``[n]``, default 0) -> latent output ``[n,H,L]``; see
    :func:`reference.mla_attention`."""
    return reference.mla_attention(q, kv_cache, positions, scale, kv_lora_rank, row_start)


@mla_attention.register_fake
def _(
    q: Tensor, kv_cache: Tensor, positions: Tensor, scale: float, kv_lora_rank: int, row_start: Tensor | None = None
) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], kv_lora_rank))


@torch.library.custom_op("tilert::mla_sparse_attention", mutates_args=())
def mla_sparse_attention(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    """Absorbed MLA over the cache rows in ``indices [n, topk]`` (int32, -1 = empty) -> ``[n,H,L]``;
    see :func:`reference.mla_sparse_attention`."""
    return reference.mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank)


@mla_sparse_attention.register_fake
def _(q: Tensor, kv_cache: Tensor, indices: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], kv_lora_rank))


@torch.library.custom_op("tilert::indexer_topk", mutates_args=())
def indexer_topk(
    q: Tensor, weights: Tensor, k_cache: Tensor, positions: Tensor, topk: int, row_start: Tensor | None = None
) -> Tensor:
    """DSA indexer: ``score[i,t] = sum_h weights[i,h] * relu(q[i,h] . k_cache[t])`` over
    ``row_start[i] <= t <= positions[i]`` (``row_start`` int64 ``[1]`` or ``[n]``, default 0), top-``topk``
    indices (int32, -1 padded, unordered); see :func:`reference.indexer_topk`."""
    return reference.indexer_topk(q, weights, k_cache, positions, topk, row_start)


@indexer_topk.register_fake
def _(
    q: Tensor, weights: Tensor, k_cache: Tensor, positions: Tensor, topk: int, row_start: Tensor | None = None
) -> Tensor:
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("tilert::moe_experts", mutates_args=())
def moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> Tensor:
    """Routed SwiGLU experts, ``out = sum_j w_j * w2[e_j] @ (silu(gate) * up)``; see
    :func:`reference.moe_experts`."""
    return reference.moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2)


@moe_experts.register_fake
def _(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor | None = None,
    s2: Tensor | None = None,
) -> Tensor:
    return torch.empty_like(x)


# ------------------------------------------------------------------------------------------------
# Fused decode-layer ops (one CUDA kernel, or a short fixed sequence, each). In-place ops (trailing
# residual ``h``) return nothing and mutate ``h``; cache-writing ops declare the caches they mutate.


@torch.library.custom_op("tilert::gemv", mutates_args=())
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
    """``rms_norm(x; norm_weight) @ weight^T (+ bias)``, then ``tail``'s rows; see :func:`reference.gemv`."""
    return reference.gemv(x, weight, norm_weight, eps, bias, fp32_out, scale, tail)


@gemv.register_fake
def _(x, weight, norm_weight=None, eps=1e-6, bias=None, fp32_out=False, scale=None, tail=None):
    n = weight.shape[0] + (0 if tail is None else tail.shape[0])
    return x.new_empty((x.shape[0], n), dtype=torch.float32 if fp32_out else x.dtype)


@torch.library.custom_op("tilert::gemv_residual", mutates_args=("out",))
def gemv_residual(out: Tensor, x: Tensor, weight: Tensor, residual: Tensor | None, scale: Tensor | None = None) -> None:
    """``out = residual + x @ weight^T`` (``residual`` may be ``out``: in place; ``None``: the product alone); see
    :func:`reference.gemv_residual`."""
    reference.gemv_residual(out, x, weight, residual, scale)


@gemv_residual.register_fake
def _(out, x, weight, residual, scale=None):
    return None


@torch.library.custom_op("tilert::moe_residual", mutates_args=("h",))
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
    """In place ``h += moe_experts(rms_norm(h), ...)``; see :func:`reference.moe_residual`."""
    reference.moe_residual(h, norm_weight, eps, topk_ids, topk_weights, w13, w2, s13, s2)


@moe_residual.register_fake
def _(h, norm_weight, eps, topk_ids, topk_weights, w13, w2, s13=None, s2=None):
    return None


@torch.library.custom_op("tilert::moe_block", mutates_args=("h",))
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
    """A routed MoE block in place (``router`` then ``moe_residual``); returns the routing it used (what
    the GPU checks record); see :func:`reference.moe_block`."""
    ids, weights = reference.moe_block(
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
    return ids, weights


@moe_block.register_fake
def _(
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
    s13=None,
    s2=None,
):
    k = top_k + n_shared
    return h.new_empty((h.shape[0], k), dtype=torch.int32), h.new_empty((h.shape[0], k), dtype=torch.float32)


@torch.library.custom_op("tilert::router", mutates_args=())
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
    """The routing of :func:`moe_block` alone (``ids int32 [n, k+S]``, ``weights fp32``); the tensor-parallel
    MoE runs it on every rank, then :func:`moe_partial` over the rank's slice of every expert; see
    :func:`reference.router`."""
    ids, weights = reference.router(
        h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
    )
    return ids, weights


@router.register_fake
def _(h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared):
    k = top_k + n_shared
    return h.new_empty((h.shape[0], k), dtype=torch.int32), h.new_empty((h.shape[0], k), dtype=torch.float32)


@torch.library.custom_op("tilert::moe_partial", mutates_args=("out",))
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
    """``out = residual + moe_experts(rms_norm(x) or x, ...)`` (``residual`` ``None``: the experts' sum alone;
    ``out`` may be ``x`` or ``residual``): :func:`moe_residual` with the output apart from the input (a
    tensor-parallel rank writes its share, rank 0's with ``h``, into its all-reduce buffer); see
    :func:`reference.moe_partial`."""
    reference.moe_partial(out, x, norm_weight, eps, topk_ids, topk_weights, w13, w2, residual, s13, s2)


@moe_partial.register_fake
def _(out, x, norm_weight, eps, topk_ids, topk_weights, w13, w2, residual, s13=None, s2=None):
    return None


@torch.library.custom_op("tilert::mla_prep", mutates_args=("kv_cache", "index_cache"))
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
    """Query absorption + RoPE, latent / indexer cache rows, indexer queries and weights; see
    :func:`reference.mla_prep`."""
    q, iq, iw = reference.mla_prep(
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
        kv_b_scale,
    )
    return q, iq, iw


@mla_prep.register_fake
def _(
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
    kv_b_scale=None,
):
    n = a.shape[0]
    q = kv_cache.new_empty((n, num_heads, kv_cache.shape[-1]))
    if index_cache is None:
        return q, a.new_empty((n, 0, 0)), a.new_empty((n, 0), dtype=torch.float32)
    return q, a.new_empty((n, index_heads, index_cache.shape[-1])), a.new_empty((n, index_heads), dtype=torch.float32)


@torch.library.custom_op("tilert::mla_uv", mutates_args=())
def mla_uv(o_lat: Tensor, kv_b: Tensor, nope_dim: int, kv_b_scale: Tensor | None = None) -> Tensor:
    """``W_UV`` per head: ``[n, H, L]`` -> ``[n, H*V]``; see :func:`reference.mla_uv`."""
    return reference.mla_uv(o_lat, kv_b, nope_dim, kv_b_scale)


@mla_uv.register_fake
def _(o_lat, kv_b, nope_dim, kv_b_scale=None):
    n, h, _ = o_lat.shape
    return o_lat.new_empty((n, kv_b.shape[0] - h * nope_dim))


@torch.library.custom_op("tilert::mla_attention_uv", mutates_args=())
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
    """``mla_uv(mla_attention(...))`` (``indices is None``) or ``mla_uv(mla_sparse_attention(...))``: attention
    straight to ``o [n, H*V]`` (one kernel fewer on CUDA); see :func:`reference.mla_attention_uv`. ``max_rows``:
    the most cache rows a dense query reads (0: the whole cache), a bound the device kernels size their work by;
    it changes no result."""
    return reference.mla_attention_uv(
        q, kv_cache, positions, indices, scale, kv_lora_rank, row_start, kv_b, nope_dim, kv_b_scale, max_rows
    )


@mla_attention_uv.register_fake
def _(q, kv_cache, positions, indices, scale, kv_lora_rank, row_start, kv_b, nope_dim, kv_b_scale=None, max_rows=0):
    return q.new_empty((q.shape[0], kv_b.shape[0] - q.shape[1] * nope_dim))


@torch.library.custom_op("tilert::l2_prefetch", mutates_args=())
def l2_prefetch(tensors: list[Tensor], sites: str) -> None:
    """A hint: bring weights a later kernel reads into the device's cache ahead of it (``sites``: comma-separated,
    the i-th names what ``tensors[i]`` is). Computes nothing; see :func:`reference.l2_prefetch`."""
    reference.l2_prefetch(tensors, sites)


@l2_prefetch.register_fake
def _(tensors, sites):
    return None


def register_device_kernels() -> bool:
    """Register the Triton CUDA kernels (:mod:`.cuda`) over the reference kernels of every ``tilert::*`` op.

    Called at start-up (``TileRTEngine.load`` on a CUDA device, the GPU benchmarks), never at import.
    Idempotent. Returns whether the CUDA kernels are in place: False, with the reference kernels kept,
    when CUDA or Triton is missing.
    """
    if not torch.cuda.is_available():
        return False
    from . import cuda  # lazy: Triton, on CUDA machines only

    return cuda.register()
