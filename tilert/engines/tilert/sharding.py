"""The tensor-parallel sharding rule: what each of ``N`` ranks holds of the fused model, one rule for the engine
(:func:`shard_state_dict`, when it loads an HF checkpoint or shards a random model) and the converter
(``tilert convert --tp N`` calls :func:`shard` on each fused tensor as it streams). The collectives the ranks run
live in ``parallel.py``; how the model computes with its share, in ``model.py``'s docstring.

What rank ``r`` holds:

- attention: heads ``r H/N .. (r+1) H/N - 1``: those heads' rows of ``q_b`` (of ``q_proj`` without q_lora) and
  of ``kv_b``, their columns of ``o_proj`` (``o_proj``'s bias on rank 0, zeros elsewhere). ``W_a`` (``q_a``,
  ``kv_a``), the norms, the latent cache and the whole DSA indexer (its weights, its key cache) are replicated:
  MLA has a single latent KV head that every query head reads (so every rank writes and reads the same latent
  rows; the cache is not split), and the indexer's top-k needs the sum over all indexer heads.
- MoE: the router (gate, bias) replicated; every expert (routed, shared, a dense MLP alike) split along its
  intermediate width: rank ``r`` holds gate / up rows and down columns ``r I/N .. (r+1) I/N - 1`` of each, in the
  one-GPU layout (shared experts stacked after the routed ones), so each rank runs the one-GPU MoE kernels on
  narrower experts. Not expert parallel: at decode batch sizes a rank would read the experts the router sends
  it, ``top_k / N`` only on average (``max(X, top_k - X)`` of ``top_k`` for two ranks), and the step waits for the
  busiest rank; split along the width every rank reads the same bytes.
- ``lm_head`` and the MTP module's own head: vocabulary rows ``r V/N .. (r+1) V/N - 1``. Embeddings, the final
  norm and the rest of the MTP module (its norms, ``eh_proj``) replicated; the MTP module's decoder layer is
  sharded as a main layer.

Block-FP8 weights (``fp8.py``) shard by the same rule: a fused weight and its scale move together
(:class:`fp8.QTensor`: the rows' scales with the rows, the columns' scale groups with the columns), so every
rank's scales are copies of the checkpoint's. Each rank's share of a sharded FP8 dimension (query and ``kv_b``
rows, ``o_proj`` columns, the expert and dense-MLP widths) must be whole 128x128 blocks of the checkpoint:
:func:`check_degree` refuses any other degree, naming the dimensions and why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import fp8
from .fp8 import QTensor
from .model import ModelArgs, Transformer, finish_model


def check_degree(args: ModelArgs, size: int) -> None:
    """``ValueError`` naming every dimension that ``size`` ranks cannot split (evenly, and for block-FP8 weights
    on whole 128-wide scale blocks). The one check of the engine, ``tilert decode --tp`` and ``tilert convert``."""
    if size < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1 (got {size})")
    if size == 1:
        return
    problems = []
    if args.num_heads % size:
        problems.append(f"{args.num_heads} attention heads")
    if _has_routed(args) and args.moe_intermediate_size % size:
        problems.append(f"the experts' width {args.moe_intermediate_size}")
    if _has_dense(args) and args.intermediate_size % size:
        problems.append(f"the dense MLP width {args.intermediate_size}")
    if args.vocab_size % size:
        problems.append(f"the vocabulary of {args.vocab_size}")
    if problems:
        raise ValueError(f"tensor-parallel degree {size} does not divide {', '.join(problems)}")
    cut = [f"{what} {n} per rank" for what, n in fp8_shares(args, size).items() if n % fp8.BLOCK]
    if cut:
        raise ValueError(
            f"tensor-parallel degree {size} would cut the checkpoint's {fp8.BLOCK}x{fp8.BLOCK} FP8 scale "
            f"blocks ({', '.join(cut)}: not a multiple of {fp8.BLOCK}); block-FP8 weights are split only "
            "on whole blocks: choose a degree that leaves each rank whole blocks"
        )


def fp8_shares(args: ModelArgs, size: int) -> dict[str, int]:
    """Each rank's share of every block-FP8 dimension that ``size`` ranks split (``{}`` for a bf16 model): the
    query rows (``q_b``, or ``q_proj`` without q_lora), ``kv_b`` rows, ``o_proj`` columns, expert and dense widths."""
    if not args.fp8 or size == 1:
        return {}
    h = args.num_heads // size
    out = {
        "query rows": h * args.qk_head_dim,
        "kv_b rows": h * (args.qk_nope_head_dim + args.v_head_dim),
        "o_proj columns": h * args.v_head_dim,
    }
    if _has_routed(args):
        out["expert width"] = args.moe_intermediate_size // size
    if _has_dense(args):
        out["dense MLP width"] = args.intermediate_size // size
    return out


def _has_routed(args: ModelArgs) -> bool:
    return "sparse" in args.mlp_layer_types or bool(args.num_mtp_layers and args.mtp_moe)


def _has_dense(args: ModelArgs) -> bool:
    return "dense" in args.mlp_layer_types or bool(args.num_mtp_layers and not args.mtp_moe)


def local_args(args: ModelArgs, rank: int, size: int) -> ModelArgs:
    """Rank ``rank``'s :class:`ModelArgs`: its heads, dense-MLP and expert widths; ``tp_rank``/``tp_size`` set."""
    check_degree(args, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if args.tp_size != 1:
        raise ValueError("the args are already rank-local")
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // size,
        intermediate_size=args.intermediate_size // size,
        moe_intermediate_size=args.moe_intermediate_size // size,
        tp_rank=rank,
        tp_size=size,
    )


def _part(t: Tensor, rank: int, size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s ``1/size`` of ``t`` along ``dim``."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def _rows(t: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """A row operation (any dim but the last) on a plain tensor, or on a :class:`fp8.QTensor`'s weight and scale."""
    return t.map_rows(fn) if isinstance(t, QTensor) else fn(t)


def _cols(t: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s ``1/size`` of the last dim (columns) of a plain tensor or a :class:`fp8.QTensor`."""
    if isinstance(t, QTensor):
        n = t.shape[-1] // size
        return t.narrow_cols(rank * n, n)
    return _part(t, rank, size, -1).contiguous()


def shard_expert(leaf: str, t: Any, rank: int, size: int) -> Any:
    """Rank ``rank``'s share of an expert weight (a dense MLP is one expert), split along its intermediate width:
    ``w13 [..., 2I, D]``'s gate and up rows, ``w2 [..., D, I]``'s columns. ``t`` is one expert or a stack of them
    (the leading dims are kept), plain or a :class:`fp8.QTensor`: the engine shards stacks, ``tilert convert`` one
    expert at a time."""
    if leaf == "w13":
        inter = t.shape[-2] // 2

        def gate_up(x: Tensor) -> Tensor:
            g, u = x[..., :inter, :], x[..., inter:, :]
            return torch.cat([_part(g, rank, size, -2), _part(u, rank, size, -2)], -2).contiguous()

        return _rows(t, gate_up)
    if leaf == "w2":
        return _cols(t, rank, size)
    raise ValueError(f"{leaf!r} is not an expert weight")


def shard_tensor(key: str, t: Any, args: ModelArgs, rank: int, size: int) -> Any:
    """Rank ``rank``'s share of fused tensor ``key`` (``args`` global; ``t`` plain or a :class:`fp8.QTensor`), the
    rule of the module docstring for everything but the experts (:func:`shard_expert`): a replicated tensor comes
    back as it is."""
    pre, _, leaf = key.rpartition(".")
    h, p, r, v = args.num_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    q_in = "wb" if args.q_lora_rank is not None else "wa"  # the block whose first H(P+R) rows are the query
    attn = pre.endswith("attn")
    if attn and leaf in (q_in, q_in + "_bias"):

        def query(x: Tensor) -> Tensor:
            q = x[: h * (p + r)].unflatten(0, (h, p + r))
            return torch.cat([_part(q, rank, size).flatten(0, 1), x[h * (p + r) :]])

        return _rows(t, query)
    if attn and leaf == "wkv_b":
        return _rows(t, lambda x: _part(x.unflatten(0, (h, p + v)), rank, size).flatten(0, 1).contiguous())
    if attn and leaf == "wo":
        return _cols(t, rank, size)
    if attn and leaf == "wo_bias":  # added once, by rank 0
        return t if rank == 0 else torch.zeros_like(t)
    if key in ("lm_head", "mtp.0.head"):
        return _rows(t, lambda x: _part(x, rank, size).contiguous())
    return t


def shard(key: str, t: Any, args: ModelArgs, rank: int, size: int) -> Any:
    """Rank ``rank``'s share of fused tensor ``key``: an expert weight (``w13`` / ``w2``, one expert or a stack) by
    :func:`shard_expert`, anything else by :func:`shard_tensor`."""
    leaf = key.rpartition(".")[2]
    return shard_expert(leaf, t, rank, size) if leaf in ("w13", "w2") else shard_tensor(key, t, args, rank, size)


def shard_state_dict(sd: dict[str, Tensor], args: ModelArgs, rank: int, size: int) -> dict[str, Tensor]:
    """The fused state dict of the whole model (engine layout: FP8 weights as ``X`` + ``X_scale``; ``args``
    global) -> rank ``rank``'s (for ``Transformer(local_args(args, rank, size))``). Replicated tensors are shared,
    not copied; an FP8 weight is sharded with its scale (:func:`shard` on the pair) and its scale regrouped for the
    rank's shape (``fp8.scale_groups``)."""
    check_degree(args, size)
    if size == 1:
        return dict(sd)
    out: dict[str, Tensor] = {}
    for key, t in sd.items():
        scale = sd.get(key + fp8.SCALE_SUFFIX)
        if key.endswith(fp8.SCALE_SUFFIX) and key[: -len(fp8.SCALE_SUFFIX)] in sd:
            continue  # with its weight
        if scale is None or t.dtype not in fp8.FP8_DTYPES:
            out[key] = shard(key, t, args, rank, size)
            continue
        q = shard(key, QTensor.from_engine(t, scale), args, rank, size)
        out[key] = q.weight.contiguous()
        out[key + fp8.SCALE_SUFFIX] = q.compress(*fp8.scale_groups(key.rpartition(".")[2], tuple(q.shape)), key)
    return out


def shard_model(model: Transformer, rank: int, size: int) -> Transformer:
    """Rank ``rank``'s share of a whole ``model`` (weights on the model's device and dtype; caches allocated as the
    model's). Used with ``weights.random_model`` (benchmarks, tests); checkpoints shard as they load."""
    sd = {k: t.detach() for k, t in model.state_dict().items()}
    args = local_args(model.args, rank, size)
    with torch.device("meta"):
        local = Transformer(args)
    device, dtype = model.embed.device, model.embed.dtype
    return finish_model(
        local, shard_state_dict(sd, model.args, rank, size), device, dtype, model.max_seq_len, model.max_sequences
    )
