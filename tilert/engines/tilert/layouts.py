"""Converting vLLM's KV layouts into the TileRT engine's cache layout (and encoders for tests).

Engine layout (per layer, per token): ``[c_kv (kv_lora) | k_pe (rope)]`` in the model dtype, with the
rope dims in **transformers' order**: for DeepSeek's interleaved RoPE transformers rotates pairs
``(2i, 2i+1)`` and writes the result evens-first, ``[x_0', x_2', ..., x_1', x_3', ...]``. vLLM keeps
the pairs interleaved. ``ROPE_DEINTERLEAVE = [0, 2, ..., R-2, 1, 3, ..., R-1]`` maps one to the other:
``engine[..., j] = vllm[..., perm[j]]``; the inverse permutation goes back.

Decoders here work on *per-token rows*: ``uint8 [num_layers, num_tokens, row_bytes]`` as the engine's
``inject`` receives them. vLLM's block-major DSA indexer cache is also decoded from whole blocks
(:func:`decode_dsa_indexer_blocks`). All decoders return float32.

Layouts (vLLM 0.32's, as its attention backends write them):

- ``mla_dense``: a row is ``L+R`` values of ``dtype`` (float32 / bfloat16 / float16).
- ``fp8_ds_mla``: ``L`` bytes of e4m3 ``c_kv / s_i`` (one fp32 scale per 128 values, ``s = max(amax/448,
  FLT_MIN)``), then ``L/128`` fp32 scales, then ``R`` bfloat16 rope values; 656 bytes for L=512, R=64.
- ``dsa_indexer``: a row is ``D`` e4m3 bytes then one fp32 scale (132 bytes for D=128); in vLLM's cache
  the block of 64 tokens stores all 64x``D`` fp8 bytes first, then the 64 scales.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FLT_MIN = torch.finfo(torch.float32).tiny
DSA_BLOCK_SIZE = 64
FP8_TILE = 128

_FLOAT_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def rope_deinterleave_perm(rope_dim: int) -> torch.Tensor:
    """``[0, 2, ..., R-2, 1, 3, ..., R-1]``: interleaved (vLLM) -> evens-first (transformers / engine)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def rope_interleave_perm(rope_dim: int) -> torch.Tensor:
    """Inverse of :func:`rope_deinterleave_perm`: evens-first (engine) -> interleaved (vLLM)."""
    return torch.argsort(rope_deinterleave_perm(rope_dim))


def _check_rows(rows: torch.Tensor, row_bytes: int, what: str) -> None:
    if rows.dtype != torch.uint8:
        raise ValueError(f"{what}: expected uint8 rows, got {rows.dtype}")
    if rows.shape[-1] != row_bytes:
        raise ValueError(f"{what}: expected rows of {row_bytes} bytes, got {rows.shape[-1]}")


def _bytes_as(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the last dim of a uint8 tensor as ``dtype`` (contiguous copy if needed)."""
    return rows.contiguous().view(dtype)


# ----------------------------------------------------------------------------------------------- MLA


def decode_mla_dense(
    rows: torch.Tensor, dtype: str, kv_lora_rank: int, rope_dim: int, rope_interleaved: bool = True
) -> torch.Tensor:
    """``mla_dense`` rows ``uint8 [..., (L+R)*itemsize]`` -> float32 ``[..., L+R]`` in engine layout."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"mla_dense: unsupported dtype {dtype!r} (supported: {sorted(_FLOAT_DTYPES)})")
    tdt = _FLOAT_DTYPES[dtype]
    width = kv_lora_rank + rope_dim
    _check_rows(rows, width * torch.empty((), dtype=tdt).element_size(), "mla_dense")
    vals = _bytes_as(rows, tdt).float()
    if rope_interleaved:
        perm = rope_deinterleave_perm(rope_dim).to(vals.device)
        vals = torch.cat([vals[..., :kv_lora_rank], vals[..., kv_lora_rank:][..., perm]], dim=-1)
    return vals


def encode_mla_dense(
    latent: torch.Tensor, dtype: str, kv_lora_rank: int, rope_interleaved: bool = True
) -> torch.Tensor:
    """Engine-layout latent rows ``[..., L+R]`` -> ``mla_dense`` uint8 rows as vLLM holds them."""
    tdt = _FLOAT_DTYPES[dtype]
    rope_dim = latent.shape[-1] - kv_lora_rank
    x = latent
    if rope_interleaved:
        perm = rope_interleave_perm(rope_dim).to(x.device)
        x = torch.cat([x[..., :kv_lora_rank], x[..., kv_lora_rank:][..., perm]], dim=-1)
    return x.to(tdt).contiguous().view(torch.uint8)


def fp8_ds_mla_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """``L`` fp8 bytes + ``L/128`` fp32 scales + ``R`` bf16 values (656 for 512/64)."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE) + 2 * rope_dim


def decode_fp8_ds_mla(
    rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, rope_interleaved: bool = True
) -> torch.Tensor:
    """``fp8_ds_mla`` rows ``uint8 [..., 656]`` -> float32 ``[..., L+R]`` in engine layout.

    ``c_kv[128*i + j] = e4m3(byte[128*i + j]) * scale_i``; the rope tail is bf16 (interleaved in vLLM).
    """
    if kv_lora_rank % FP8_TILE:
        raise ValueError(f"fp8_ds_mla needs kv_lora_rank % {FP8_TILE} == 0, got {kv_lora_rank}")
    n_tiles = kv_lora_rank // FP8_TILE
    _check_rows(rows, fp8_ds_mla_row_bytes(kv_lora_rank, rope_dim), "fp8_ds_mla")
    lead = rows.shape[:-1]
    q = _bytes_as(rows[..., :kv_lora_rank], torch.float8_e4m3fn).float()
    scales = _bytes_as(rows[..., kv_lora_rank : kv_lora_rank + 4 * n_tiles], torch.float32)
    c_kv = (q.reshape(*lead, n_tiles, FP8_TILE) * scales[..., None]).reshape(*lead, kv_lora_rank)
    rope = _bytes_as(rows[..., kv_lora_rank + 4 * n_tiles :], torch.bfloat16).float()
    if rope_interleaved:
        rope = rope[..., rope_deinterleave_perm(rope_dim).to(rope.device)]
    return torch.cat([c_kv, rope], dim=-1)


def _quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile e4m3 quantisation of ``x [..., T, 128]``: ``s = max(amax/448, FLT_MIN)``, bytes of ``x/s``."""
    xf = x.float()
    s = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=FLT_MIN)
    q = (xf / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return q, s


def encode_fp8_ds_mla(latent: torch.Tensor, kv_lora_rank: int, rope_interleaved: bool = True) -> torch.Tensor:
    """Engine-layout latent rows ``[..., L+R]`` -> ``fp8_ds_mla`` uint8 rows (the rules vLLM uses)."""
    lead = latent.shape[:-1]
    rope_dim = latent.shape[-1] - kv_lora_rank
    n_tiles = kv_lora_rank // FP8_TILE
    q, s = _quant_fp8(latent[..., :kv_lora_rank].reshape(*lead, n_tiles, FP8_TILE))
    rope = latent[..., kv_lora_rank:]
    if rope_interleaved:
        rope = rope[..., rope_interleave_perm(rope_dim).to(rope.device)]
    return torch.cat(
        [
            q.reshape(*lead, kv_lora_rank),
            s.contiguous().view(torch.uint8),
            rope.to(torch.bfloat16).contiguous().view(torch.uint8),
        ],
        dim=-1,
    )


# ------------------------------------------------------------------------------------- DSA indexer


def dsa_indexer_row_bytes(head_dim: int) -> int:
    """``head_dim`` fp8 bytes + one fp32 scale (132 for 128)."""
    return head_dim + 4


def decode_dsa_indexer(
    rows: torch.Tensor, head_dim: int, rope_dim: int = 0, rope_interleaved: bool = False
) -> torch.Tensor:
    """Per-token indexer rows ``uint8 [..., D+4]`` -> float32 keys ``[..., D]`` (``[rope | nope]``).

    ``k[j] = e4m3(byte[j]) * scale``. With ``rope_interleaved`` the first ``rope_dim`` values are
    de-interleaved into the engine's (transformers') evens-first order.
    """
    _check_rows(rows, dsa_indexer_row_bytes(head_dim), "dsa_indexer")
    k = _bytes_as(rows[..., :head_dim], torch.float8_e4m3fn).float()
    scale = _bytes_as(rows[..., head_dim:], torch.float32)
    k = k * scale
    if rope_interleaved and rope_dim:
        perm = rope_deinterleave_perm(rope_dim).to(k.device)
        k = torch.cat([k[..., :rope_dim][..., perm], k[..., rope_dim:]], dim=-1)
    return k


def encode_dsa_indexer(keys: torch.Tensor, rope_dim: int = 0, rope_interleaved: bool = False) -> torch.Tensor:
    """Engine-layout keys ``[..., D]`` -> per-token rows ``uint8 [..., D+4]`` (one scale per token)."""
    k = keys
    if rope_interleaved and rope_dim:
        perm = rope_interleave_perm(rope_dim).to(k.device)
        k = torch.cat([k[..., :rope_dim][..., perm], k[..., rope_dim:]], dim=-1)
    q, s = _quant_fp8(k)
    return torch.cat([q, s[..., None].contiguous().view(torch.uint8)], dim=-1)


def dsa_indexer_blocks_to_rows(blocks: torch.Tensor, num_tokens: int, head_dim: int = 128) -> torch.Tensor:
    """vLLM's block-major indexer cache ``uint8 [num_blocks, 64*(D+4)]`` (or flat) -> per-token rows
    ``uint8 [num_tokens, D+4]``.

    Token ``j`` of block ``b`` has its ``D`` bytes at ``b*B + j*D`` and its scale at ``b*B + 64*D + 4*j``
    with ``B = 64*(D+4)`` (8448 for D=128). Blocks are taken in order (block table already applied).
    """
    block_bytes = DSA_BLOCK_SIZE * (head_dim + 4)
    flat = blocks.reshape(-1)
    if flat.dtype != torch.uint8 or flat.numel() % block_bytes:
        raise ValueError(f"dsa_indexer blocks: expected uint8 with a multiple of {block_bytes} bytes")
    b = flat.view(-1, block_bytes)
    if b.shape[0] * DSA_BLOCK_SIZE < num_tokens:
        raise ValueError(f"dsa_indexer blocks: {b.shape[0]} blocks cannot hold {num_tokens} tokens")
    vals = b[:, : DSA_BLOCK_SIZE * head_dim].reshape(-1, DSA_BLOCK_SIZE, head_dim)
    scales = b[:, DSA_BLOCK_SIZE * head_dim :].reshape(-1, DSA_BLOCK_SIZE, 4)
    return torch.cat([vals, scales], dim=-1).reshape(-1, head_dim + 4)[:num_tokens].contiguous()


def dsa_indexer_rows_to_blocks(rows: torch.Tensor, head_dim: int = 128) -> torch.Tensor:
    """Inverse of :func:`dsa_indexer_blocks_to_rows` (pads the last block with zeros): ``uint8 [nb, 64*(D+4)]``."""
    n = rows.shape[0]
    nb = (n + DSA_BLOCK_SIZE - 1) // DSA_BLOCK_SIZE
    padded = torch.zeros(nb * DSA_BLOCK_SIZE, head_dim + 4, dtype=torch.uint8, device=rows.device)
    padded[:n] = rows
    padded = padded.view(nb, DSA_BLOCK_SIZE, head_dim + 4)
    return torch.cat(
        [padded[..., :head_dim].reshape(nb, -1), padded[..., head_dim:].reshape(nb, -1)], dim=-1
    ).contiguous()


def decode_dsa_indexer_blocks(
    blocks: torch.Tensor, num_tokens: int, head_dim: int = 128, rope_dim: int = 0, rope_interleaved: bool = False
) -> torch.Tensor:
    """vLLM block-major indexer cache -> float32 keys ``[num_tokens, D]`` in engine layout."""
    rows = dsa_indexer_blocks_to_rows(blocks, num_tokens, head_dim)
    return decode_dsa_indexer(rows, head_dim, rope_dim, rope_interleaved)


KNOWN_KINDS = ("mla_dense", "fp8_ds_mla", "dsa_indexer")


def mla_row_bytes(kind: str, dtype: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one token's row in one layer for an MLA layout; ``ValueError`` for one we cannot decode."""
    if kind == "mla_dense":
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"mla_dense: unsupported dtype {dtype!r} (supported: {sorted(_FLOAT_DTYPES)})")
        return (kv_lora_rank + rope_dim) * torch.empty((), dtype=_FLOAT_DTYPES[dtype]).element_size()
    if kind == "fp8_ds_mla":
        return fp8_ds_mla_row_bytes(kv_lora_rank, rope_dim)
    raise ValueError(f"unknown MLA KV layout kind {kind!r} (supported: 'mla_dense', 'fp8_ds_mla')")


def decode_mla_rows(
    rows: torch.Tensor, kind: str, dtype: str, kv_lora_rank: int, rope_dim: int, rope_interleaved: bool
) -> torch.Tensor:
    """Dispatch on ``kind`` for the latent (MLA) cache; ``ValueError`` on anything else."""
    if kind == "mla_dense":
        return decode_mla_dense(rows, dtype, kv_lora_rank, rope_dim, rope_interleaved)
    if kind == "fp8_ds_mla":
        return decode_fp8_ds_mla(rows, kv_lora_rank, rope_dim, rope_interleaved)
    raise ValueError(f"unknown MLA KV layout kind {kind!r} (supported: 'mla_dense', 'fp8_ds_mla')")
