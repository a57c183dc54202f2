"""Batch-1 (n <= 16 tokens, each computed as if alone) GEMV kernels in Triton for the decode fast path.

``y[n, N] = x[n, K] @ W[N, K]^T`` with W in ``nn.Linear`` layout (row-major ``[out, in]``), bf16.
Optional fusions, all decided at compile time:

* ``norm_w``: RMSNorm of each input row first (``x * rsqrt(mean(x^2) + eps) * norm_w``, rounded to
  bf16 like the unfused reference); every program recomputes the row's norm (K <= 8K: a few KB from L2).
* ``residual``: ``out[n, N] = residual + y`` (``out`` defaults to ``residual``: in place; each program owns its
  output rows, so ``out`` may be ``residual`` or a buffer apart, e.g. a tensor-parallel rank's all-reduce input).
* ``split_k``: fp32 partial sums ``[split_k, n, N]`` for small N (the MoE router); the consumer sums.

Weight tiles reach the program one of two ways: loaded into registers (one tile in flight a program: Triton does
not pipeline plain loads, whatever ``num_stages`` says), or brought into shared memory by the TMA, ``NS - 1`` tiles
ahead of the one being summed (:data:`TMA_CFG`, per weight class; a tensor descriptor of the weight).

Everything is capturable in a CUDA graph (no host syncs, shapes fixed per call site).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import triton_pdl
from .triton_pdl import pdl_begin

__all__ = ["gemv", "rms_norm", "gemv_class", "gemv_config", "tma_addressable", "tma_ready"]


def tma_addressable(w: torch.Tensor) -> bool:
    """Whether a tensor descriptor can describe ``w`` (a weight, or a stack of them): a 16-byte aligned start and
    strides, the last dimension contiguous."""
    size = w.element_size()
    return not (w.data_ptr() % 16 or w.stride(-1) != 1 or any(st * size % 16 for st in w.stride()[:-1]))


def tma_ready(w: torch.Tensor) -> bool:
    """Whether the TMA can read ``w``: addressable (:func:`tma_addressable`) on a Hopper-class GPU (or Triton's
    interpreter, which emulates it)."""
    if not tma_addressable(w):
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return w.is_cuda and torch.cuda.get_device_capability(w.device)[0] >= 9


@triton.jit
def _row_rstd(x_row_ptr, K, eps, BK: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of a row, in ``BK`` chunks (the callers pass ``rstd_block(K)``: one wide load
    for K <= RSTD_MAX, each chunk a serial L2 round trip on the kernel's critical path)."""
    acc = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs = k0 + tl.arange(0, BK)
        v = tl.load(x_row_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _x_normed(x_row, nw_ptr, rstd, offs_k, kmask, dtype, HAS_NORM: tl.constexpr):
    """The activations at ``offs_k`` in fp32, RMS-normalised and rounded to ``dtype`` like the unfused reference when
    ``HAS_NORM``."""
    xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
    if HAS_NORM:
        g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
        xv = (xv.to(tl.float32) * rstd * g).to(dtype)
    return xv.to(tl.float32)


@triton.jit
def _tma_first_tile(k0, rstd, x_row, K, eps, RB: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """In a TMA-fed loop: at the first tile (its and the next ones' requests issued), the PDL wait, then the RMSNorm
    statistics (``rstd`` as given otherwise)."""
    if k0 == 0:
        pdl_begin(PDL)
        if HAS_NORM:
            rstd = _row_rstd(x_row, K, eps, RB)
    return rstd


@triton.jit
def _gemv_rows_tma(
    x_row,
    w_desc,
    nw_ptr,
    pid_n,
    K,
    eps,
    BN: tl.constexpr,
    BK: tl.constexpr,
    RB: tl.constexpr,
    NS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """``[BN]`` fp32 outputs of rows ``pid_n * BN ...`` over all of K, the weight's tiles brought into shared memory by
    the TMA (``w_desc``, block ``[BN, BK]``) ``NS - 1`` ahead; the first ones requested before the PDL wait, which the
    first iteration passes (then the RMSNorm statistics). Rows and columns past the weight read as zeros."""
    offs_k0 = tl.arange(0, BK)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    rstd = tl.full([], 1.0, tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=NS):
        w = w_desc.load([pid_n * BN, k0])
        rstd = _tma_first_tile(k0, rstd, x_row, K, eps, RB, HAS_NORM, PDL)
        offs_k = k0 + offs_k0
        xf = _x_normed(x_row, nw_ptr, rstd, offs_k, offs_k < K, w.dtype, HAS_NORM)
        acc += w.to(tl.float32) * xf[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    nw_ptr,
    res_ptr,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_rm,
    stride_ys,
    eps,
    BN: tl.constexpr,
    BK: tl.constexpr,
    RB: tl.constexpr,
    HAS_NORM: tl.constexpr,
    HAS_RES: tl.constexpr,
    OUT_F32: tl.constexpr,
    NS: tl.constexpr,
    PDL: tl.constexpr,
):
    # grid (rows, N / BN, split_k): the rows of one weight tile run side by side (one HBM read, L2 hits),
    # and every row is computed exactly as if it were alone (batch invariance: MTP verify == plain decode).
    # NS > 0 (split_k 1): the tiles come through the TMA (w_ptr is then the weight's tensor descriptor).
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    nmask = offs_n < N
    x_row = x_ptr + row * stride_xm
    if NS > 0:
        out = _gemv_rows_tma(x_row, w_ptr, nw_ptr, pid_n, K, eps, BN, BK, RB, NS, HAS_NORM, PDL)
    else:
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        # first weight tile is static: fetch it before waiting on the previous kernel (PDL)
        offs_k = k_lo + tl.arange(0, BK)
        kmask = offs_k < k_hi
        w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        pdl_begin(PDL)
        if HAS_NORM:
            rstd = _row_rstd(x_row, K, eps, RB)
        xv = tl.load(x_row + offs_k, mask=kmask, other=0.0)
        if HAS_NORM:
            g = tl.load(nw_ptr + offs_k, mask=kmask, other=0.0).to(tl.float32)
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
        out = tl.sum(acc, 1)
    if OUT_F32:
        tl.store(y_ptr + pid_k * stride_ys + row * stride_ym + offs_n, out, mask=nmask)
    else:
        y = out.to(y_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_rm + offs_n, mask=nmask, other=0.0).to(tl.float32)
            y = (r + y.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_ym + offs_n, y, mask=nmask)


RSTD_MAX = 2048  # widest tile of the RMSNorm statistics (0: the kernel's K tile)


def rstd_block(K: int, bk: int) -> int:
    """The ``_row_rstd`` tile for a row of K (``bk``: the kernel's K tile, used when RSTD_MAX is 0)."""
    return min(triton.next_power_of_2(K), RSTD_MAX) if RSTD_MAX else bk


# (BN rows, BK, num_warps, num_stages) per weight class, chosen on the H200 with benchmarks/micro.py and
# decode_speed.py --tune: tiny row blocks with long K tiles win for < 64 MB matrices (more
# programs in flight), 8 x 512 for large ones, 16 x 256 for the lm_head.
HEAD_CFG = (16, 256, 4, 4)  # >= 512 MB (the lm_head, whole or a tensor-parallel rank's vocabulary rows)
LARGE_CFG = (8, 512, 4, 3)  # >= 64 MB
SMALL_K1024_CFG = (2, 1024, 4, 3)  # < 64 MB, K a multiple of 1024 (W_a, W_o, router at lite / V3.2 dims)
MID_CFG = (8, 512, 4, 3)  # < 64 MB, N >= 4096 (W_b)
SMALL_CFG = (2, 512, 4, 3)


# The register-fed config of each weight class (module attributes, so that tuning can set them).
CLASS_CFG = {
    "head": "HEAD_CFG",
    "large": "LARGE_CFG",
    "k1024": "SMALL_K1024_CFG",
    "mid": "MID_CFG",
    "small": "SMALL_CFG",
}
# TMA-fed GEMVs (_gemv_rows_tma): (BN rows, BK, stages NS, warps) per class, or None for the register-fed kernel.
# Off until measured in the whole step (decode_speed.py --tune).
TMA_CFG: dict[str, tuple[int, int, int, int] | None] = dict.fromkeys(CLASS_CFG)


def gemv_class(N: int, K: int) -> str:
    """The config class of a bf16 weight of ``[N, K]`` (keys of :data:`TMA_CFG`)."""
    nbytes = N * K * 2
    if nbytes >= (512 << 20):
        return "head"
    if nbytes >= (64 << 20):
        return "large"
    if K % 1024 == 0:
        return "k1024"
    return "mid" if N >= 4096 else "small"


def gemv_config(N: int, K: int, nt: int) -> tuple[int, int, int, int]:
    """(BN, BK, num_warps, num_stages) for a weight of ``[N, K]`` (the same for every ``nt``: batch invariance)."""
    return globals()[CLASS_CFG[gemv_class(N, K)]]


def gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    norm_w: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_k: int = 1,
    out_f32: bool = False,
    cfg: tuple[int, int, int, int] | None = None,
    tma: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x[n, K] @ w[N, K]^T`` (bf16 out, or fp32 partials ``[split_k, n, N]`` when split_k > 1).

    With ``residual`` the result is ``residual + x @ w^T``, written into ``out`` (default: ``residual``, in place)
    and returned. ``x`` may be a strided row view (last dim contiguous). ``cfg`` (BN, BK, warps, stages) sets the
    register-fed kernel's tile, ``tma`` (BN, BK, stages, warps) the TMA-fed one's; by default the weight's class
    picks (:data:`TMA_CFG`, else :func:`gemv_config`). Split-K and weights the TMA cannot read take the register-fed
    kernel.
    """
    assert x.dim() == 2 and x.stride(-1) == 1 and w.stride(-1) == 1
    nt, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and nt <= 16
    if tma is None and cfg is None:
        tma = TMA_CFG[gemv_class(N, K)]
    if tma is not None and (split_k > 1 or not tma_ready(w)):
        tma, cfg = None, None
    if tma is not None:
        bn, bk, tma_ns, nw = tma
        bk = min(bk, triton.next_power_of_2(K))
        ns = tma_ns
    else:
        (bn, bk, nw, ns), tma_ns = cfg or gemv_config(N, K, nt), 0
    out_f32 = out_f32 or split_k > 1
    if out_f32:
        shape = (split_k, nt, N) if split_k > 1 else (nt, N)
        y = out if out is not None else torch.empty(shape, device=x.device, dtype=torch.float32)
    elif out is not None:
        y = out
    elif residual is not None:
        y = residual
    else:
        y = torch.empty(nt, N, device=x.device, dtype=x.dtype)
    k_per_split = triton.cdiv(triton.cdiv(K, split_k), bk) * bk
    grid = (nt, triton.cdiv(N, bn), split_k)
    res = residual if residual is not None else y
    _gemv_kernel[grid](
        x,
        TensorDescriptor(w, [N, K], [w.stride(0), 1], [bn, bk]) if tma_ns else w,
        y,
        norm_w if norm_w is not None else x,
        res,
        N,
        K,
        k_per_split,
        x.stride(0),
        w.stride(0),
        y.stride(-2),
        res.stride(0),
        y.stride(0) if (out_f32 and split_k > 1) else 0,
        eps,
        BN=bn,
        BK=bk,
        RB=rstd_block(K, bk),
        HAS_NORM=norm_w is not None,
        HAS_RES=residual is not None and not out_f32,
        OUT_F32=out_f32,
        NS=tma_ns,
        num_warps=nw,
        num_stages=ns,
        **triton_pdl.kw(),
    )
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_x, stride_y, eps, BD: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BD)
    m = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # Reference order: normalise in fp32, cast to the input dtype, then scale by the weight.
    xn = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (xn * w).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = out if out is not None else torch.empty(x.shape, device=x.device, dtype=x.dtype)
    y2 = y.view(-1, D)
    if x2.shape[0] == 0:
        return y
    BD = triton.next_power_of_2(D)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, y2, D, x2.stride(0), y2.stride(0), eps, BD=BD, num_warps=4 if BD <= 2048 else 8, **triton_pdl.kw()
    )
    return y
