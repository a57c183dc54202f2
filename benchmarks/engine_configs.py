"""Benchmark configurations as engine :class:`ModelArgs` (no checkpoint): the engine model is built from them
with random weights directly on the GPU (``tilert.engines.tilert.weights.random_model``).

``CONFIGS``: DeepSeek-V3.2-shaped models that fit one GPU whole. ``RANK_CONFIGS``: one rank of a full-size model
served tensor parallel (``v32-tp8-rank``: DeepSeek-V3.2, ``glm5-tp8-rank``: GLM-5, at TP 8): the dimensions are
the defaults of transformers' own config classes (``DeepseekV32Config``, ``GlmMoeDsaConfig``: the full-size
models'), block-FP8 weights, every layer plus the MTP layer, and rank 0's share by the engine's sharding rule
(``sharding.local_args``: heads, expert and dense widths and the ``lm_head`` vocabulary divided by the degree;
latent projections, the DSA indexer and the embedding whole). The MTP layer reads the main model's embedding
and head (as the engine does when a checkpoint's MTP layer holds no copies of its own).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tilert.engines.tilert import sharding  # noqa: E402
from tilert.engines.tilert.model import ModelArgs  # noqa: E402
from tilert.engines.tilert.weights import args_from_hf_config  # noqa: E402


def v32_args(
    *,
    hidden: int = 2048,
    layers: int = 27,
    heads: int = 16,
    experts: int = 64,
    top_k: int = 6,
    n_shared: int = 2,
    moe_inter: int = 1408,
    dense_layers: int = 1,
    dense_inter: int = 11264,
    vocab: int = 129280,
    idx_heads: int = 16,
    n_group: int = 1,
    topk_group: int = 1,
    route_scale: float = 1.0,
    q_lora: int = 1536,
    kv_lora: int = 512,
    rope: int = 64,
    nope: int = 128,
    v: int = 128,
    idx_dim: int = 128,
    idx_topk: int = 2048,
) -> ModelArgs:
    """DeepSeek-V3.2-shaped engine args (defaults: the 16B "lite" shape)."""
    return ModelArgs(
        arch="deepseek_v32",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=dense_inter,
        moe_intermediate_size=moe_inter,
        num_layers=layers,
        num_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        n_routed_experts=experts,
        n_shared_experts=n_shared,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=route_scale,
        mlp_layer_types=["dense"] * dense_layers + ["sparse"] * (layers - dense_layers),
        rms_norm_eps=1e-6,
        attention_bias=False,
        rope_interleave=True,
        softmax_scale=(nope + rope) ** -0.5,
        rope_inv_freq=[1.0 / (10000 ** (i / rope)) for i in range(0, rope, 2)],
        rope_attention_scaling=1.0,
        dsa=True,
        index_n_heads=idx_heads,
        index_head_dim=idx_dim,
        index_topk=idx_topk,
        indexer_rope_interleave=False,
        indexer_types=["full"] * layers,
    )


LITE_V32 = v32_args()
LAYER_V32 = v32_args(
    hidden=7168,
    layers=4,
    heads=128,
    experts=256,
    top_k=8,
    n_shared=1,
    moe_inter=2048,
    dense_layers=0,
    dense_inter=18432,
    idx_heads=64,
    n_group=8,
    topk_group=4,
    route_scale=2.5,
)
CONFIGS = {"lite-v32": LITE_V32, "layer-v32": LAYER_V32}


def small(args: ModelArgs, layers: int, vocab: int = 32000) -> ModelArgs:
    """Same layer dims, fewer layers and a smaller vocabulary (correctness runs)."""
    dense = min(args.mlp_layer_types.count("dense"), 1)
    return replace(
        args,
        num_layers=layers,
        vocab_size=vocab,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        indexer_types=["full"] * layers,
    )


# Configurations written as synthetic block-FP8 HF checkpoints (``gpu_serving.py --synthetic NAME``,
# ``tilert.models.synthetic``): lite-v32, and a tiny one of the same family for the CPU (its vocabulary is the
# tokenizer's it is written with).
TINY_V32 = v32_args(
    hidden=256,
    layers=2,
    heads=4,
    experts=8,
    top_k=2,
    n_shared=1,
    moe_inter=128,
    dense_inter=512,
    vocab=2048,
    idx_heads=4,
    q_lora=128,
    nope=32,
    v=32,
    idx_dim=64,
    idx_topk=64,
)
SYNTHETIC = {"lite-v32": LITE_V32, "tiny-v32": TINY_V32}


def hf_overrides(args: ModelArgs) -> dict[str, Any]:
    """A DeepSeek-V3.2-shaped configuration (``v32_args``) as the fields of transformers' ``DeepseekV32Config``
    that differ from its defaults' or are set anyway: what its checkpoint's ``config.json`` holds
    (``weights.args_from_hf_config`` reads them back as ``args``, rope included: theta 10000, no scaling)."""
    dense = args.mlp_layer_types.count("dense")
    if args.mlp_layer_types != ["dense"] * dense + ["sparse"] * (args.num_layers - dense):
        raise ValueError("the dense layers must come first (first_k_dense_replace)")
    return dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_layers,
        first_k_dense_replace=dense,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts,
        num_experts_per_tok=args.num_experts_per_tok,
        n_group=args.n_group,
        topk_group=args.topk_group,
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=args.routed_scaling_factor,
        rms_norm_eps=args.rms_norm_eps,
        index_n_heads=args.index_n_heads,
        index_head_dim=args.index_head_dim,
        index_topk=args.index_topk,
    )


# name -> (transformers config class, tensor-parallel degree)
RANK_CONFIGS = {"v32-tp8-rank": ("DeepseekV32Config", 8), "glm5-tp8-rank": ("GlmMoeDsaConfig", 8)}


def full_size_args(config_class: str, **reduce: int) -> ModelArgs:
    """The whole model of transformers' ``config_class`` at its default (full-size) dimensions as engine args:
    block-FP8, with its MTP layer (MoE, with an indexer). ``reduce``: config fields to override (e.g.
    ``num_hidden_layers``, ``vocab_size``, ``n_routed_experts`` for a run on the CPU)."""
    import transformers

    cfg = getattr(transformers, config_class)(**reduce)
    args = args_from_hf_config(cfg)
    return replace(args, fp8=True, num_mtp_layers=1, mtp_moe=True, mtp_indexer=args.dsa)


def rank_args(name: str, **reduce: int) -> ModelArgs:
    """Rank 0's share of ``RANK_CONFIGS[name]`` (its :class:`ModelArgs` as the tensor-parallel engine builds
    them; run alone, the model computes its rank's share without collectives)."""
    config_class, tp = RANK_CONFIGS[name]
    return sharding.local_args(full_size_args(config_class, **reduce), 0, tp)


# A reduced rank of each full-size model for CPU runs: every dimension of one layer kept but the experts, two
# layers (one dense, one MoE) and a small vocabulary.
CPU_REDUCE = dict(num_hidden_layers=2, first_k_dense_replace=1, vocab_size=8192, n_routed_experts=16)


def config_args(name: str) -> ModelArgs:
    """A named configuration: ``CONFIGS`` or ``RANK_CONFIGS``."""
    if name in RANK_CONFIGS:
        return rank_args(name)
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; choose from {', '.join([*CONFIGS, *RANK_CONFIGS])}")
    return CONFIGS[name]
