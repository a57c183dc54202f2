"""Block-scaled FP8 weights (the DeepSeek-V3 / V3.2 and GLM-5 ``*-FP8`` checkpoints) in the engine.

**Checkpoint format** (``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128]}``): a quantised linear ``X.weight`` is e4m3 ``[N, K]`` with ``X.weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``; the real weight is ``w[n, k] = float(q[n, k]) * s[n // 128, k // 128]``.
Which tensors are quantised follows the published checkpoints: every linear of attention and of the MLPs
(``q_a_proj``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, the indexer's
``wq_b`` and ``wk``, ``gate/up/down_proj`` of routed, shared and dense MLPs, in the MTP layer too). Kept in
bf16: embeddings, ``lm_head``, every norm, the router (``mlp.gate`` and its bias), the indexer's
``weights_proj`` and ``k_norm``, and the MTP module's ``eh_proj`` and ``shared_head`` (:data:`BF16_LINEARS`).

**Engine layout**: a fused weight ``X`` ``[..., N, K]`` stays e4m3 (no bf16 copy is ever made) with
``X_scale`` float32 ``[..., N/gn, K/gk]``: element ``(n, k)`` has scale ``X_scale[n // gn, k // gk]``; ``gn``
and ``gk`` divide 128 and are read off the shapes by every kernel (:func:`groups`). How the block scales
follow the fusion (:func:`scale_groups`, one rule for the loader, the converter and the model):

- columns: ``gk = gcd(128, K)`` (``K`` of each fused part: ``I`` for ``w2``, whose shared experts are split
  along columns), so 128 for every real model;
- ``wa = [q_a | kv_a | indexer.wk]`` and ``wb = [q_b | indexer.wq_b]``: ``gn = 1``, one scale per row. They
  concatenate parts whose row counts are not multiples of 128 (``kv_a`` has 576 rows) and permute rope rows
  evens-first, which can move rows across 128-row blocks; per-row scales carry the blocks exactly through
  both and cost 1/32 of those weights' bytes (a few percent of a decode step's reads at most);
- ``w13 [E+S, 2I, D]``: ``gn = gcd(128, I)`` (the gate and up halves, and shared experts split at ``I``
  rows); every other weight: ``gn = gcd(128, N)``.

The scales are copies of the checkpoint's (never requantised), so dequantising the engine layout gives
exactly the dequantised checkpoint. ``indexer.weights_proj`` (bf16) cannot join ``wa``'s e4m3 rows without
requantising it: FP8 models keep it as ``attn.index_wproj``, read as ``W_a``'s plain tail rows by the same
GEMV (``tilert::gemv``'s ``tail``; see ``model.MLAttention``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BLOCK = 128
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale"  # engine layout: ``X`` and ``X_scale``
CKPT_SCALE_SUFFIX = ".weight_scale_inv"  # checkpoint: ``X.weight`` and ``X.weight_scale_inv``
# Linears that the published FP8 checkpoints keep in bf16 (name suffixes, HF naming).
BF16_LINEARS = (
    "embed_tokens.weight",
    "lm_head.weight",
    "mlp.gate.weight",
    "indexer.weights_proj.weight",
    "eh_proj.weight",
    "shared_head.head.weight",
)


def check_quantization_config(qc: Any) -> None:
    """Accept exactly the block-FP8 scheme of the DeepSeek / GLM checkpoints; anything else is refused,
    naming the field that differs."""
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be a mapping, got {type(qc).__name__}")
    if qc.get("quant_method") != "fp8":
        raise ValueError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported (only 'fp8')")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise ValueError(
            f"quantization_config.weight_block_size {qc.get('weight_block_size')!r} is not supported "
            f"(only [{BLOCK}, {BLOCK}])"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {qc.get('activation_scheme')!r} is not supported")


# ------------------------------------------------------------------------------------------- checkpoint format


def quantize_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """DeepSeek's block quantisation of ``w [N, K]``: per 128x128 block ``s = amax / 448``, ``q = e4m3(w / s)``;
    returns ``(q, weight_scale_inv = s)`` (an all-zero block gets ``s = 1``)."""
    n, k = w.shape
    pad = torch.zeros(-(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK, dtype=torch.float32)
    pad[:n, :k] = w.float()
    q, s = _quantize_groups(pad, BLOCK, BLOCK)
    return q[:n, :k].to(E4M3).contiguous(), s


def quantize_tiled(w: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`quantize_blocks` in groups that tile ``w [N, K]`` exactly (each side's largest power of two dividing
    it, at most :data:`BLOCK`: a tensor-parallel shard's rows need not be a multiple of 128), on ``w``'s device;
    ``(q, scale)`` in the engine's layout (:func:`dequant`, the kernels)."""
    n, k = w.shape
    q, s = _quantize_groups(w.float(), min(BLOCK, n & -n), min(BLOCK, k & -k))
    return q.to(E4M3).contiguous(), s


def _quantize_groups(w: Tensor, gn: int, gk: int) -> tuple[Tensor, Tensor]:
    """float32 ``w [N, K]`` (N, K multiples of ``gn``, ``gk``) in ``gn x gk`` groups: ``s = amax / 448`` (1 for an
    all-zero group) and ``w / s`` clamped to e4m3's range, still float32."""
    n, k = w.shape
    groups = w.reshape(n // gn, gn, k // gk, gk)
    amax = groups.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (groups / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).reshape(n, k), s.contiguous()


def dequantize_blocks(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The checkpoint's real weight: ``float(q) * scale_inv`` per 128x128 block, in ``dtype``."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (q.float() * s).to(dtype)


def check_scale_inv(name: str, q: Tensor, scale_inv: Tensor) -> None:
    """Refuse a ``weight_scale_inv`` whose shape does not cover ``q``'s 128x128 blocks."""
    if q.dim() != 2 or q.dtype != E4M3:
        raise ValueError(f"{name}: FP8 weights must be 2-D float8_e4m3fn, got {tuple(q.shape)} {q.dtype}")
    want = (-(-q.shape[0] // BLOCK), -(-q.shape[1] // BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}.weight_scale_inv has shape {tuple(scale_inv.shape)}; {tuple(q.shape)} needs {want}")


# ---------------------------------------------------------------------------------------------- engine layout


def groups(weight: Tensor, scale: Tensor) -> tuple[int, int]:
    """``(gn, gk)`` of an engine-layout FP8 weight, read off the shapes (and checked)."""
    n, k = weight.shape[-2:]
    sn, sk = scale.shape[-2:]
    if sn == 0 or sk == 0 or n % sn or k % sk or BLOCK % (n // sn) or BLOCK % (k // sk):
        raise ValueError(
            f"scale {tuple(scale.shape)} does not tile weight {tuple(weight.shape)} in groups dividing {BLOCK}"
        )
    return n // sn, k // sk


def dequant(weight: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Engine layout -> real weight in ``dtype`` (``scale=None``: a plain weight, cast). Exact in float32."""
    if scale is None:
        return weight.to(dtype)
    gn, gk = groups(weight, scale)
    s = scale.repeat_interleave(gn, -2).repeat_interleave(gk, -1)
    return (weight.to(torch.float32) * s).to(dtype)


FUSED_LEAVES = ("wa", "wb", "wkv_b", "wo", "w13", "w2")  # the engine's FP8 weights (model.py names)


def scale_groups(leaf: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(gn, gk)`` the engine stores fused weight ``leaf`` (one of :data:`FUSED_LEAVES`) of ``shape`` with
    (module docstring)."""
    if leaf not in FUSED_LEAVES:
        raise ValueError(f"{leaf!r} is not an FP8 weight of the engine ({FUSED_LEAVES})")
    n, k = shape[-2:]
    gk = math.gcd(BLOCK, k)
    if leaf in ("wa", "wb"):
        return 1, gk
    if leaf == "w13":  # [.., 2I, D]: gate and up halves of I rows each
        return math.gcd(BLOCK, n // 2), gk
    return math.gcd(BLOCK, n), gk


def scale_shape(leaf: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of ``leaf``'s scale tensor for a weight of ``shape`` (see :func:`scale_groups`)."""
    gn, gk = scale_groups(leaf, shape)
    return (*shape[:-2], shape[-2] // gn, shape[-1] // gk)


@dataclass
class QTensor:
    """An FP8 weight while it is being fused: e4m3 ``weight [..., n, k]`` and a *per-row* scale
    ``[..., n, k / gk]``, so that every row operation of the fusion (concatenation, rope-row permutation,
    splitting shared experts) applies to both alike."""

    weight: Tensor
    scale: Tensor

    @classmethod
    def from_checkpoint(cls, name: str, q: Tensor, scale_inv: Tensor) -> QTensor:
        check_scale_inv(name, q, scale_inv)
        n, k = q.shape
        gk = math.gcd(BLOCK, k)
        s = scale_inv.float().repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK // gk, 1)[:, : k // gk]
        return cls(q, s.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @classmethod
    def from_engine(cls, weight: Tensor, scale: Tensor) -> QTensor:
        """An engine-layout FP8 weight (``weight`` e4m3, ``scale`` in ``(gn, gk)`` groups) with per-row scales."""
        gn, _ = groups(weight, scale)
        return cls(weight, scale.repeat_interleave(gn, -2))

    def col_group(self) -> int:
        return self.weight.shape[-1] // self.scale.shape[-1]

    def narrow_cols(self, start: int, length: int) -> QTensor:
        """Columns ``start .. start + length - 1`` of both tensors; the column groups shrink to
        ``gcd(group, start, length)`` where the slice does not fall on group boundaries (the scales stay exact)."""
        gk = self.col_group()
        g = math.gcd(gk, start, length)
        s = self.scale if g == gk else self.scale.repeat_interleave(gk // g, -1)
        return QTensor(self.weight.narrow(-1, start, length), s.narrow(-1, start // g, length // g))

    def map_rows(self, fn: Any) -> QTensor:
        """Apply a row operation (one that moves whole rows, leaving the last dim alone) to both tensors."""
        return QTensor(fn(self.weight), fn(self.scale))

    def split_cols(self, parts: int) -> QTensor:
        """``[D, parts*I] -> [parts, D, I]`` (the shared experts' ``down_proj``), regrouping columns if ``I``
        is not a multiple of the column group."""
        d, kk = self.weight.shape
        i = kk // parts
        gk = self.col_group()
        g = math.gcd(gk, i)
        s = self.scale.repeat_interleave(gk // g, -1)
        return QTensor(self.weight.view(d, parts, i).transpose(0, 1), s.view(d, parts, i // g).transpose(0, 1))

    def compress(self, gn: int, gk: int, name: str) -> Tensor:
        """The engine-layout scale ``[..., n/gn, k/gk]``; checks that it represents every row's scale exactly."""
        s = self.scale
        have = self.col_group()
        if have != gk:
            if have % gk:
                raise ValueError(f"{name}: column groups of {have} cannot be stored at {gk}")
            s = s.repeat_interleave(have // gk, -1)
        n = s.shape[-2]
        if n % gn:
            raise ValueError(f"{name}: {n} rows cannot be stored in groups of {gn}")
        grouped = s.reshape(*s.shape[:-2], n // gn, gn, s.shape[-1])
        out = grouped[..., 0, :]
        if not torch.equal(grouped, out.unsqueeze(-2).expand_as(grouped)):
            raise ValueError(
                f"{name}: the checkpoint's block scales are not constant over {gn}-row groups of the fused layout"
            )
        return out.contiguous()


def cat_rows(parts: list[Any], name: str) -> Any:
    """``torch.cat(parts, -2)`` for plain tensors or :class:`QTensor` s (all of one kind: a bf16 part cannot
    join e4m3 rows without requantising)."""
    if all(isinstance(p, Tensor) for p in parts):
        return torch.cat(parts, -2 if parts[0].dim() > 1 else 0)
    if not all(isinstance(p, QTensor) for p in parts):
        kinds = ["fp8" if isinstance(p, QTensor) else str(p.dtype) for p in parts]
        raise ValueError(
            f"{name}: cannot fuse FP8 and non-FP8 parts ({kinds}); the checkpoint quantises "
            "different tensors than DeepSeek's"
        )
    return QTensor(torch.cat([p.weight for p in parts], -2), torch.cat([p.scale for p in parts], -2))


def stack(parts: list[Any]) -> Any:
    """``torch.stack`` for plain tensors or :class:`QTensor` s."""
    if all(isinstance(p, QTensor) for p in parts):
        return QTensor(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]))
    if any(isinstance(p, QTensor) for p in parts):
        raise ValueError("cannot stack FP8 and non-FP8 experts")
    return torch.stack(parts)
