"""CUDA kernels (Triton) for the ``tilert::*`` ops, registered by :func:`register` (at start-up, through
``ops.register_device_kernels()``); importing this module registers nothing and imports no Triton.

Each registration replaces the reference kernel for the CUDA device only. Inputs the fast kernels do not
cover (float64, odd widths, CPU tensors never reach here) fall back to :mod:`.reference`, so the ops stay
total. All kernels are CUDA-graph capturable: no host syncs, grids depend only on shapes.

Block-FP8 weights (an op called with a weight's scale) go to :mod:`.triton_fp8` (GEMV, MoE) and to the FP8
variants of :mod:`.triton_fused` (``kv_b`` in ``mla_prep`` / ``mla_uv``), which read e4m3 and apply the scales in
registers; what those do not cover falls back to the reference (which dequantises).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from . import reference

_FAST_DTYPES = (torch.bfloat16, torch.float16)
_E4M3 = torch.float8_e4m3fn


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _rms_norm_cuda(x, weight, eps):
    if x.dtype not in _FAST_DTYPES + (torch.float32,) or x.shape[-1] > 16384 or x.numel() == 0:
        return reference.rms_norm(x, weight, eps)
    from .triton_gemv import rms_norm  # lazy: Triton, on CUDA machines only

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


def _mla_attention_cuda(q, kv_cache, positions, scale, kv_lora_rank, row_start=None, max_rows=0):
    if not _mla_ok(q, kv_cache, kv_lora_rank):
        return reference.mla_attention(q, kv_cache, positions, scale, kv_lora_rank, row_start)
    return _mla_dense(q, kv_cache, positions, scale, kv_lora_rank, row_start, max_rows)


def _mla_dense(q, kv_cache, positions, scale, kv_lora_rank, row_start, max_rows, uv=None):
    from .triton_mla import mla_decode  # lazy: Triton, on CUDA machines only

    p = positions.contiguous()
    return mla_decode(
        q.contiguous(), kv_cache, p, None, scale, kv_lora_rank, row_start=row_start, uv=uv, max_rows=max_rows
    )


def _mla_sparse_attention_cuda(q, kv_cache, indices, scale, kv_lora_rank):
    if not _mla_ok(q, kv_cache, kv_lora_rank):
        return reference.mla_sparse_attention(q, kv_cache, indices, scale, kv_lora_rank)
    from .triton_mla import mla_decode  # lazy: Triton, on CUDA machines only

    return mla_decode(q.contiguous(), kv_cache, None, indices.to(torch.int32).contiguous(), scale, kv_lora_rank)


def _indexer_topk_cuda(q, weights, k_cache, positions, topk, row_start=None):
    if q.dtype not in _FAST_DTYPES or k_cache.dtype != q.dtype or not _pow2(q.shape[-1]) or q.shape[-1] < 16:
        return reference.indexer_topk(q, weights, k_cache, positions, topk, row_start)
    from .triton_mla import indexer_topk  # lazy: Triton, on CUDA machines only

    return indexer_topk(
        q.contiguous(), weights.float().contiguous(), k_cache, positions.contiguous(), topk, row_start=row_start
    )


def _moe_ok(x, w13, w2, s13, s2) -> bool:
    """Whether the Triton expert kernels take these weights: e4m3 with both scales, or the activations' dtype
    without."""
    if s13 is not None or s2 is not None:
        ok = s13 is not None and s2 is not None and w13.dtype == _E4M3 and w2.dtype == _E4M3
    else:
        ok = w13.dtype == x.dtype and w2.dtype == x.dtype
    return ok and x.dtype in _FAST_DTYPES and 0 < x.shape[0] <= 16 and x.is_contiguous()


def _experts(
    x, topk_ids, topk_weights, w13, w2, s13, s2, *, norm_w=None, eps=1e-6, residual=None, out=None, static=None
):
    """The Triton experts (``triton_fp8``'s kernels, e4m3 or 16-bit) on weights :func:`_moe_ok` takes: ``moe_up``
    (RMSNorm fused when ``norm_w``), then ``moe_down`` (added into ``residual``, in place or into ``out``); returns
    ``moe_down``'s output."""
    from . import triton_fp8  # lazy: Triton, on CUDA machines only

    ids = topk_ids.to(torch.int32).contiguous()
    wts = topk_weights.float().contiguous()
    s13, s2 = (None, None) if s13 is None else (s13.contiguous(), s2.contiguous())
    act = triton_fp8.moe_up_fp8(x, ids, w13.contiguous(), s13, norm_w=norm_w, eps=eps, static=static)
    return triton_fp8.moe_down_fp8(act, ids, wts, w2.contiguous(), s2, residual=residual, out=out)


def _moe_experts_cuda(x, topk_ids, topk_weights, w13, w2, s13=None, s2=None):
    x = x.contiguous()
    if not _moe_ok(x, w13, w2, s13, s2):
        return reference.moe_experts(x, topk_ids, topk_weights, w13, w2, s13, s2)
    return _experts(x, topk_ids, topk_weights, w13, w2, s13, s2)


def _rows_ok(*ts) -> bool:
    return all(t.dim() >= 1 and t.stride(-1) == 1 for t in ts)


def _gemv_ok(x, w) -> bool:
    return x.dtype in _FAST_DTYPES and w.dtype == x.dtype and x.dim() == 2 and x.shape[0] <= 16 and _rows_ok(x, w)


def _gemv_fp8_ok(x, w, scale) -> bool:
    return (
        x.dtype in _FAST_DTYPES
        and w.dtype == _E4M3
        and x.dim() == 2
        and 0 < x.shape[0] <= 16
        and _rows_ok(x, w, scale)
        and scale.dim() == 2
    )


def _gemv_cuda(x, weight, norm_weight=None, eps=1e-6, bias=None, fp32_out=False, scale=None, tail=None):
    if tail is not None:
        if not (
            scale is not None
            and bias is None
            and _gemv_fp8_ok(x, weight, scale)
            and tail.dtype == x.dtype
            and _rows_ok(tail)
            and tail.shape[-1] == x.shape[-1]
        ):
            return torch.cat(
                [
                    _gemv_cuda(x, weight, norm_weight, eps, bias, fp32_out, scale),
                    _gemv_cuda(x, tail, norm_weight, eps, None, fp32_out),
                ],
                -1,
            )
        # one launch: the e4m3 rows, then the plain tail rows
        from . import triton_fp8  # lazy: Triton, on CUDA machines only

        nw = None if norm_weight is None else norm_weight.to(x.dtype).contiguous()
        return triton_fp8.gemv_fp8(x, weight, scale, norm_w=nw, eps=eps, out_f32=fp32_out, tail=tail)
    if scale is not None:
        if not _gemv_fp8_ok(x, weight, scale):
            return reference.gemv(x, weight, norm_weight, eps, bias, fp32_out, scale)
        from . import triton_fp8  # lazy: Triton, on CUDA machines only

        nw = None if norm_weight is None else norm_weight.to(x.dtype).contiguous()
        y = triton_fp8.gemv_fp8(x, weight, scale, norm_w=nw, eps=eps, out_f32=fp32_out)
        return y if bias is None else y + bias.to(y.dtype)
    if not _gemv_ok(x, weight) or x.shape[0] == 0:
        return reference.gemv(x, weight, norm_weight, eps, bias, fp32_out)
    from . import triton_gemv  # lazy: Triton, on CUDA machines only

    nw = None if norm_weight is None else norm_weight.to(x.dtype).contiguous()
    y = triton_gemv.gemv(x, weight, norm_w=nw, eps=eps, out_f32=fp32_out)
    return y if bias is None else y + bias.to(y.dtype)


def _gemv_residual_cuda(out, x, weight, residual, scale=None):
    if scale is not None:
        if not (_gemv_fp8_ok(x, weight, scale) and _out_ok(out, x, residual)):
            return reference.gemv_residual(out, x, weight, residual, scale)
        from . import triton_fp8  # lazy: Triton, on CUDA machines only

        triton_fp8.gemv_fp8(x, weight, scale, residual=residual, out=out)
        return None
    if not (_gemv_ok(x, weight) and _out_ok(out, x, residual)) or x.shape[0] == 0:
        return reference.gemv_residual(out, x, weight, residual)
    from . import triton_gemv  # lazy: Triton, on CUDA machines only

    triton_gemv.gemv(x, weight, residual=residual, out=out)


def _out_ok(out, x, residual) -> bool:
    """An output (and the residual it adds, if any) the Triton kernels write / read as plain rows."""
    return (
        out.dtype == x.dtype
        and out.is_contiguous()
        and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))
    )


def _router_cuda(h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared):
    e = gate_weight.shape[0]
    if not _gemv_ok(h, gate_weight) or (n_group > 1 and not _pow2(e)) or e > 1024 or h.shape[0] == 0:
        return reference.router(
            h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
        )
    from . import triton_moe  # lazy: Triton, on CUDA machines only

    # the split-K gate GEMV and the selection in one launch (the last program to finish selects)
    return triton_moe.router(
        h,
        gate_weight,
        bias.float().contiguous(),
        norm_w=norm_weight.to(h.dtype).contiguous(),
        eps=eps,
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        route_scale=route_scale,
        norm_topk=norm_topk,
        n_shared_slots=n_shared,
    )


def _moe_residual_cuda(h, norm_weight, eps, topk_ids, topk_weights, w13, w2, s13=None, s2=None, static=None):
    # static (not an op argument; from _moe_block_cuda): (first slot of the router's appended shared experts, its
    # expert id): moe_up's programs for those slots start without waiting on the router
    if not _moe_ok(h, w13, w2, s13, s2):
        return reference.moe_residual(h, norm_weight, eps, topk_ids, topk_weights, w13, w2, s13, s2)
    nw = norm_weight.to(h.dtype).contiguous()
    _experts(h, topk_ids, topk_weights, w13, w2, s13, s2, norm_w=nw, eps=eps, residual=h, static=static)
    return None


def _moe_partial_cuda(out, x, norm_weight, eps, topk_ids, topk_weights, w13, w2, residual, s13=None, s2=None):
    if not (_moe_ok(x, w13, w2, s13, s2) and _out_ok(out, x, residual)):
        return reference.moe_partial(out, x, norm_weight, eps, topk_ids, topk_weights, w13, w2, residual, s13, s2)
    nw = None if norm_weight is None else norm_weight.to(x.dtype).contiguous()
    # moe_up reads x before out is written
    _experts(x, topk_ids, topk_weights, w13, w2, s13, s2, norm_w=nw, eps=eps, residual=residual, out=out)
    return None


def _moe_block_cuda(
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
    ids, wts = _router_cuda(
        h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
    )
    fused = ids.device.type == "cuda" and ids.shape[1] == top_k + n_shared  # the fused router's output
    static = (top_k, gate_weight.shape[0]) if fused and n_shared > 0 else None
    _moe_residual_cuda(h, norm_weight, eps, ids, wts, w13, w2, s13, s2, static=static)
    return ids, wts


def _l2_prefetch_cuda(tensors, sites):
    from .triton_prefetch import l2_prefetch  # lazy: Triton, on CUDA machines only

    l2_prefetch(tensors, sites)


def _mla_prep_cuda(
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
    lat = kv_norm_weight.shape[0]
    r = kv_cache.shape[-1] - lat
    h, p = num_heads, nope_dim
    v = kv_b.shape[0] // h - p
    has_idx = index_cache is not None
    di = index_cache.shape[-1] if has_idx else 0
    ok = (
        a.dtype in _FAST_DTYPES
        and b.dtype == a.dtype
        and kv_cache.dtype == a.dtype
        and kv_b.dtype == (a.dtype if kv_b_scale is None else _E4M3)
        and (kv_b_scale is None or (kv_b_scale.dim() == 2 and kv_b_scale.stride(-1) == 1))
        and _pow2(lat)
        and _pow2(r)
        and p % 16 == 0
        and v % 16 == 0
        and r >= 2
        and (not has_idx or (index_cache.dtype == a.dtype and _pow2(di) and _pow2(di - r)))
        and _rows_ok(a, b, kv_cache, kv_b, cos, sin)
        and a.shape[0] > 0
    )
    if not ok:
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
            kv_b_scale,
        )
    from .triton_fused import mla_prep  # lazy: Triton, on CUDA machines only

    n = a.shape[0]
    q = torch.empty(n, h, lat + r, device=a.device, dtype=a.dtype)
    hi = index_heads if has_idx else 0
    iq = torch.empty(n, hi, di, device=a.device, dtype=a.dtype)
    iw = torch.empty(n, hi, device=a.device, dtype=torch.float32)
    mla_prep(
        a,
        b,
        positions.contiguous(),
        kv_b,
        cos,
        sin,
        kv_norm_weight.to(a.dtype).contiguous(),
        index_norm_weight.to(a.dtype).contiguous() if has_idx else None,
        index_norm_bias.to(a.dtype).contiguous() if has_idx else None,
        q,
        kv_cache,
        index_cache,
        iq if has_idx else None,
        iw if has_idx else None,
        H=h,
        Hi=hi,  # 0: no indexer queries or head weights (a dense step), the key row only
        QL=kv_offset,
        L=lat,
        R=r,
        P=p,
        V=v,
        DI=di if has_idx else 2 * r,
        eps=eps,
        iw_scale=index_weight_scale,
        kv_b_scale=kv_b_scale,
    )
    return q, iq, iw


def _mla_attention_uv_cuda(
    q, kv_cache, positions, indices, scale, kv_lora_rank, row_start, kv_b, nope_dim, kv_b_scale=None, max_rows=0
):
    n, h, _ = q.shape
    v = kv_b.shape[0] // h - nope_dim if h else 0
    want = q.dtype if kv_b_scale is None else _E4M3
    # bf16 kv_b at many heads (V3.2's 128) stays on the two kernels (merge, then mla_uv): the one case where the
    # fused kernel is not faster
    fuse = kv_b_scale is not None or h <= 32
    if not (
        fuse
        and _mla_ok(q, kv_cache, kv_lora_rank)
        and kv_b.dtype == want
        and v > 0
        and v % 16 == 0
        and n > 0
        and kv_b.is_contiguous()
        and kv_b.shape[-1] == kv_lora_rank
        and (kv_b_scale is None or (kv_b_scale.dim() == 2 and kv_b_scale.is_contiguous()))
        and (indices is not None or positions is not None)
    ):
        if indices is None:
            o_lat = _mla_attention_cuda(q, kv_cache, positions, scale, kv_lora_rank, row_start, max_rows)
        else:
            o_lat = _mla_sparse_attention_cuda(q, kv_cache, indices, scale, kv_lora_rank)
        return _mla_uv_cuda(o_lat, kv_b, nope_dim, kv_b_scale)
    uv = (kv_b, nope_dim, v, kv_b_scale)
    if indices is None:
        return _mla_dense(q, kv_cache, positions, scale, kv_lora_rank, row_start, max_rows, uv)
    from .triton_mla import mla_decode  # lazy: Triton, on CUDA machines only

    return mla_decode(q.contiguous(), kv_cache, None, indices.to(torch.int32).contiguous(), scale, kv_lora_rank, uv=uv)


def _mla_uv_cuda(o_lat, kv_b, nope_dim, kv_b_scale=None):
    n, h, lat = o_lat.shape
    v = kv_b.shape[0] // h - nope_dim
    want = o_lat.dtype if kv_b_scale is None else _E4M3
    if o_lat.dtype not in _FAST_DTYPES or kv_b.dtype != want or not _pow2(lat) or v % 16 or n == 0:
        return reference.mla_uv(o_lat, kv_b, nope_dim, kv_b_scale)
    from .triton_fused import mla_uv  # lazy: Triton, on CUDA machines only

    return mla_uv(
        o_lat.contiguous(),
        kv_b.contiguous(),
        P=nope_dim,
        V=v,
        kv_b_scale=None if kv_b_scale is None else kv_b_scale.contiguous(),
    )


_KERNELS: dict[str, Callable[..., Any]] = {
    "rms_norm": _rms_norm_cuda,
    "mla_attention": _mla_attention_cuda,
    "mla_sparse_attention": _mla_sparse_attention_cuda,
    "indexer_topk": _indexer_topk_cuda,
    "moe_experts": _moe_experts_cuda,
    "gemv": _gemv_cuda,
    "gemv_residual": _gemv_residual_cuda,
    "moe_residual": _moe_residual_cuda,
    "moe_block": _moe_block_cuda,
    "router": _router_cuda,
    "moe_partial": _moe_partial_cuda,
    "mla_prep": _mla_prep_cuda,
    "mla_uv": _mla_uv_cuda,
    "mla_attention_uv": _mla_attention_uv_cuda,
    "l2_prefetch": _l2_prefetch_cuda,
}


# Whether Triton is installed (CPU-only installs have none); looked up without importing it.
AVAILABLE = importlib.util.find_spec("triton") is not None
_registered = False


def register() -> bool:
    """Register every kernel of ``_KERNELS`` for the CUDA device, once; returns whether they are registered
    (False when Triton is missing: the reference kernels stay). Through
    :func:`tilert.engines.tilert.ops.register_device_kernels`, which also checks CUDA."""
    global _registered
    if _registered:
        return True
    if not AVAILABLE:
        return False
    try:
        import triton  # noqa: F401  (the kernels import it when they first run; a broken install shows here)
    except ImportError:
        return False
    for name, fn in _KERNELS.items():
        torch.library.register_kernel(f"tilert::{name}", "cuda", fn)
    _registered = True
    return True
