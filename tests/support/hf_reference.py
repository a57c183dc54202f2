"""Seeded random transformers models of the three families, with unusual dims: the reference the TileRT engine
is compared with (CPU, float32), by its reference tests and its FP8 checkpoint tests.

DSA note: the indexer score ``sum_h w_h relu(q_h . k_t)`` is *exactly* zero whenever all heads' dot
products are negative (probability ~2^-Hi per pair). With 2 indexer heads such zero ties routinely sit
on the top-k boundary, and CPU ``torch.topk`` breaks ties arbitrarily and differently for rows of
different lengths (transformers' own prefill and decode then disagree). The DSA models therefore use
8 indexer heads (and top-k 12 < 40-token prompt, so sparsity matters).
"""

from __future__ import annotations

from typing import Any

import torch

FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
PROMPT_LEN = 40
VOCAB = 101

COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=72,
    intermediate_size=88,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=40,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=40,
    qk_nope_head_dim=24,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    eos_token_id=None,
    bos_token_id=None,
)
DSA: dict[str, Any] = dict(index_n_heads=8, index_head_dim=32, index_topk=12)


def hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A seeded random transformers model; weights re-drawn larger than HF's init so logits are not flat. Drawn
    from its own seed: torch's global generator is left as it was, whichever test calls this first."""
    import transformers as tf  # lazy: heavy, and only the model's construction needs it

    kw = {**COMMON, **overrides}
    if arch == "deepseek_v3":
        cfg, cls = tf.DeepseekV3Config(**kw), tf.DeepseekV3ForCausalLM
    elif arch == "deepseek_v32":
        cfg, cls = tf.DeepseekV32Config(**kw, **DSA), tf.DeepseekV32ForCausalLM
    else:
        cfg = tf.GlmMoeDsaConfig(**kw, **DSA, indexer_types=["full", "shared", "full"])
        cls = tf.GlmMoeDsaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.08)
            for mod in model.modules():
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.normal_(0.0, 0.1)
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.weight.normal_(1.0, 0.1)
                    mod.bias.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = None
    return model


def prompt_ids(seed: int = 1) -> torch.Tensor:
    """``PROMPT_LEN`` token ids drawn from ``seed``."""
    return torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between ``a`` and the reference ``b``, relative to ``b``'s largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()
