"""Benchmark configurations as engine :class:`ModelArgs` (no checkpoint): the engine model is built from them
with random weights directly on the GPU (``tilert.engines.tilert.weights.random_model``)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tilert.engines.tilert.model import ModelArgs  # noqa: E402


def v32_args(*, hidden: int = 2048, layers: int = 27, heads: int = 16, experts: int = 64, top_k: int = 6,
             n_shared: int = 2, moe_inter: int = 1408, dense_layers: int = 1, dense_inter: int = 11264,
             vocab: int = 129280, idx_heads: int = 16, n_group: int = 1, topk_group: int = 1,
             route_scale: float = 1.0, q_lora: int = 1536, kv_lora: int = 512, rope: int = 64, nope: int = 128,
             v: int = 128, idx_dim: int = 128, idx_topk: int = 2048) -> ModelArgs:
    """DeepSeek-V3.2-shaped engine args (defaults: the 16B "lite" shape)."""
    return ModelArgs(
        arch="deepseek_v32", vocab_size=vocab, hidden_size=hidden, intermediate_size=dense_inter,
        moe_intermediate_size=moe_inter, num_layers=layers, num_heads=heads, q_lora_rank=q_lora,
        kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
        n_routed_experts=experts, n_shared_experts=n_shared, num_experts_per_tok=top_k, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=route_scale,
        mlp_layer_types=["dense"] * dense_layers + ["sparse"] * (layers - dense_layers), rms_norm_eps=1e-6,
        attention_bias=False, rope_interleave=True, softmax_scale=(nope + rope) ** -0.5,
        rope_inv_freq=[1.0 / (10000 ** (i / rope)) for i in range(0, rope, 2)], rope_attention_scaling=1.0,
        dsa=True, index_n_heads=idx_heads, index_head_dim=idx_dim, index_topk=idx_topk,
        indexer_rope_interleave=False, indexer_types=["full"] * layers,
    )


LITE_V32 = v32_args()
LAYER_V32 = v32_args(hidden=7168, layers=4, heads=128, experts=256, top_k=8, n_shared=1, moe_inter=2048,
                     dense_layers=0, dense_inter=18432, idx_heads=64, n_group=8, topk_group=4, route_scale=2.5)
CONFIGS = {"lite-v32": LITE_V32, "layer-v32": LAYER_V32}


def small(args: ModelArgs, layers: int, vocab: int = 32000) -> ModelArgs:
    """Same layer dims, fewer layers and a smaller vocabulary (correctness runs)."""
    dense = min(args.mlp_layer_types.count("dense"), 1)
    return replace(args, num_layers=layers, vocab_size=vocab,
                   mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense), indexer_types=["full"] * layers)
