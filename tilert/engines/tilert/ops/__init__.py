"""The ``tilert::*`` custom ops: the only way the model computes attention, indexer top-k, MoE experts
and RMSNorm.

Each op is a ``torch.library.custom_op`` whose default kernel (every device) is the plain-PyTorch
reference in :mod:`.reference`, plus a ``register_fake`` so ``torch.compile`` can trace it. A device
kernel registered later (``torch.library.register_kernel("tilert::mla_attention", "cuda", fn)``, e.g.
from a sibling module imported at the bottom of this file) replaces the reference for that device with
no change to the model.

CUDA-graph friendliness: no op takes a Python int that changes from one decode step to the next;
positions and indices are device tensors, shapes depend only on the batch of new tokens and the
static cache size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference

__all__ = ["rms_norm", "mla_attention", "mla_sparse_attention", "indexer_topk", "moe_experts"]


@torch.library.custom_op("tilert::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim of ``x [..., D]`` with ``weight [D]``; see :func:`reference.rms_norm`."""
    return reference.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("tilert::mla_attention", mutates_args=())
def mla_attention(q: Tensor, kv_cache: Tensor, positions: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
    """Absorbed causal MLA: ``q [n,H,L+R]`` over ``kv_cache [S_max,L+R]`` rows ``0..positions[i]``
    -> latent output ``[n,H,L]``; see :func:`reference.mla_attention`."""
    return reference.mla_attention(q, kv_cache, positions, scale, kv_lora_rank)


@mla_attention.register_fake
def _(q: Tensor, kv_cache: Tensor, positions: Tensor, scale: float, kv_lora_rank: int) -> Tensor:
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
def indexer_topk(q: Tensor, weights: Tensor, k_cache: Tensor, positions: Tensor, topk: int) -> Tensor:
    """DSA indexer: ``score[i,t] = sum_h weights[i,h] * relu(q[i,h] . k_cache[t])`` over ``t <= positions[i]``,
    top-``topk`` indices (int32, -1 padded, unordered); see :func:`reference.indexer_topk`."""
    return reference.indexer_topk(q, weights, k_cache, positions, topk)


@indexer_topk.register_fake
def _(q: Tensor, weights: Tensor, k_cache: Tensor, positions: Tensor, topk: int) -> Tensor:
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@torch.library.custom_op("tilert::moe_experts", mutates_args=())
def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """Routed SwiGLU experts, ``out = sum_j w_j * w2[e_j] @ (silu(gate) * up)``; see
    :func:`reference.moe_experts`."""
    return reference.moe_experts(x, topk_ids, topk_weights, w13, w2)


@moe_experts.register_fake
def _(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    return torch.empty_like(x)

if torch.cuda.is_available(): from . import cuda  # noqa: E701,F401  Triton kernels for CUDA (ops/cuda.py)
