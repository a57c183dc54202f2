"""CUDA kernels (Triton) for the ``tilert::*`` ops; imported by ``ops/__init__.py`` when CUDA is available.

Each registration replaces the reference kernel for the CUDA device only. Inputs the fast kernels do not
cover (float64, odd widths, CPU tensors never reach here) fall back to :mod:`.reference`, so the ops stay
total. All kernels are CUDA-graph capturable: no host syncs, grids depend only on shapes.
"""

from __future__ import annotations

import torch

from . import reference

_FAST_DTYPES = (torch.bfloat16, torch.float16)


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _rms_norm_cuda(x, weight, eps):
    if x.dtype not in _FAST_DTYPES + (torch.float32,) or x.shape[-1] > 16384 or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    from .triton_gemv import rms_norm

    return rms_norm(x.contiguous(), weight.contiguous(), eps)


def _mla_ok(q, kv_cache, kv_lora_rank):
    r = q.shape[-1] - kv_lora_rank
    return (
        q.dtype in _FAST_DTYPES
        and kv_cache.dtype == q.dtype
        and _pow2(kv_lora_rank)
        and _pow2(r)
        and r >= 16
        and kv_cache.stride(-1) == 1
    )


def _mla_attention_cuda(q, kv_cache, positions, scale, kv_lora_rank):
    if not _mla_ok(q, kv_cache, kv_lora_rank):
        return reference.mla_attention(q, kv_cache, positions, scale, kv_lora_rank)
    from .triton_mla import mla_decode

    return mla_decode(q.contiguous(), kv_cache, positions.contiguous(), None, scale, kv_lora_rank)


def _mla_sparse_attention_cuda(q, kv_cache, indices, scale, kv_lora_rank):
    if not _mla_ok(q, kv_cache, kv_lora_rank):
        return reference.mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank)
    from .triton_mla import mla_decode

    return mla_decode(q.contiguous(), kv_cache, None, indices.to(torch.int32).contiguous(), scale, kv_lora_rank)


def _indexer_topk_cuda(q, weights, k_cache, positions, topk):
    if q.dtype not in _FAST_DTYPES or k_cache.dtype != q.dtype or not _pow2(q.shape[-1]) or q.shape[-1] < 16:
        return reference.indexer_topk(q, weights, k_cache, positions, topk)
    from .triton_mla import indexer_topk

    return indexer_topk(q.contiguous(), weights.float().contiguous(), k_cache, positions.contiguous(), topk)


def _moe_experts_cuda(x, topk_ids, topk_weights, w13, w2):
    if x.dtype not in _FAST_DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype or x.shape[0] > 16:
        return reference.moe_experts(x, topk_ids, topk_weights, w13, w2)
    from .triton_moe import moe_experts

    return moe_experts(x, topk_ids, topk_weights, w13.contiguous(), w2.contiguous())


def register() -> None:
    torch.library.register_kernel("tilert::rms_norm", "cuda", _rms_norm_cuda)
    torch.library.register_kernel("tilert::mla_attention", "cuda", _mla_attention_cuda)
    torch.library.register_kernel("tilert::mla_sparse_attention", "cuda", _mla_sparse_attention_cuda)
    torch.library.register_kernel("tilert::indexer_topk", "cuda", _indexer_topk_cuda)
    torch.library.register_kernel("tilert::moe_experts", "cuda", _moe_experts_cuda)


try:  # Triton missing (CPU-only installs) leaves the reference kernels in place.
    import triton  # noqa: F401

    register()
    AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the install
    AVAILABLE = False
