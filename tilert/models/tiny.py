"""Seeded tiny random-weight checkpoints with a locally trained tokenizer (no model hub needed).

``build_tiny_model("deepseek_v3", out)`` writes a transformers checkpoint (safetensors + config.json)
and a byte-level BPE tokenizer with a chat template. The ``deepseek_v3`` defaults are the values stock
vLLM's CPU build can serve: its MLA kernel takes head size 576 only (``kv_lora_rank=512``,
``qk_rope_head_dim=64``), and vLLM needs ``topk_method``/``scoring_func`` in config.json, which
transformers does not write.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# The tools of a request, when it has some, as one system turn of their JSON; an assistant turn's tool calls as
# hermes-style <tool_call> blocks (what vLLM's hermes parser reads back). A conversation without tools renders as
# it always did.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>' + (tools | tojson) + '<|end|>' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson)"
    " + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# A prompt (one special token) after which the tiny model's greedy first token is EOS, planted on
# purpose (see ``_plant_eos``) so the "prefill's only token is EOS" path can be tested for real.
EOS_TRIGGER_PROMPT = "<|system|>"

# Shared by all families: small enough for a 2-core CI machine, MLA dims vLLM's CPU kernel accepts.
_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}

_PER_ARCH: dict[str, dict[str, Any]] = {
    "deepseek_v3": {},
    "deepseek_v32": {"index_n_heads": 4, "index_head_dim": 64, "index_topk": 64},
    "glm_moe_dsa": {"index_n_heads": 4, "index_head_dim": 64, "index_topk": 64, "n_group": 1, "topk_group": 1},
}


def train_tokenizer(
    vocab_size: int = 2048, special_tokens: list[str] | None = None, files: list[str] | None = None
) -> Any:
    """Train a byte-level BPE on the Python standard library's sources (always on disk, deterministic):
    ``files`` (default: its first 120 top-level modules), ``special_tokens`` first (default :data:`SPECIAL_TOKENS`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if files is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(str(p) for p in stdlib.glob("*.py"))[:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS if special_tokens is None else special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    return tok


def save_tiny_tokenizer(out_dir: Path | str) -> Any:
    """The tiny models' tokenizer (:func:`train_tokenizer`'s defaults, with :data:`CHAT_TEMPLATE`) saved as a
    transformers tokenizer in ``out_dir``; returns it (a ``PreTrainedTokenizerFast``)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(arch: str, out_dir: Path | str, seed: int = 0, **config_overrides: Any) -> Path:
    """Write a seeded random checkpoint of family ``arch`` and its tokenizer to ``out_dir``."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = save_tiny_tokenizer(out)

    values = {**_COMMON, **_PER_ARCH[arch], **config_overrides}
    values.setdefault("vocab_size", 2048)
    values["bos_token_id"] = fast.bos_token_id
    values["eos_token_id"] = fast.eos_token_id
    values["pad_token_id"] = fast.pad_token_id
    config_cls, model_cls = {
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM),
    }[arch]
    config = config_cls(**values)
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    # The router's correction bias is zero-initialised; give it values so routing is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.normal_(0.0, 0.05)
    _plant_eos(model, fast(EOS_TRIGGER_PROMPT, add_special_tokens=False)["input_ids"], fast.eos_token_id, seed)
    model.save_pretrained(out, safe_serialization=True)

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"topk_method": "noaux_tc", "scoring_func": "sigmoid", "tilert_tiny_seed": seed})
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def _plant_eos(model: Any, trigger_ids: list[int], eos_id: int, seed: int) -> None:
    """Make EOS the greedy next token after exactly ``trigger_ids`` and nowhere else (in practice).

    The EOS row of ``lm_head`` becomes the trigger's final hidden state minus the mean hidden state
    of random contexts (their shared direction), scaled so that EOS beats the best other logit by 3
    at the trigger; for other contexts the EOS logit stays well below their best one.
    """
    import torch

    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        h = model.model(torch.tensor([trigger_ids])).last_hidden_state[0, -1]
        ref = model.model(torch.randint(8, vocab, (8, 32), generator=gen)).last_hidden_state
        direction = h - ref.reshape(-1, h.numel()).mean(0)
        target = model.lm_head(h).max() + 3.0
        model.lm_head.weight[eos_id] = direction * (target / (direction @ h))


def add_mtp_layer(
    src: Path | str, out_dir: Path | str, *, predictive: bool = False, main_scale: float = 1e-3, seed: int = 9
) -> Path:
    """Copy checkpoint ``src`` to ``out_dir`` with a DeepSeek-style MTP module (``num_nextn_predict_layers=1``).

    The MTP decoder layer ``model.layers.{N}.*`` is a copy of the last layer (its indexer too, for DSA
    families), the MTP-only weights (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.*``, ``embed_tokens``)
    seeded random. ``predictive``: the module predicts what a near-bigram main model predicts (the main
    model's ``o_proj``/``down_proj`` scaled by ``main_scale``; a larger scale predicts worse): ``eh_proj =
    [I | 0]`` and a pass-through block (zero ``o_proj``/expert outputs), so the MTP logits are about
    ``lm_head(norm(embed(t_{i+1})))`` and drafts get accepted."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    shutil.copytree(src, out)
    sd = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    last, p = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for k in list(sd):
        if k.startswith(last):
            sd[p + k[len(last) :]] = sd[k].clone()
    g = torch.Generator().manual_seed(seed)
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    for name in ("enorm", "hnorm", "shared_head.norm"):
        sd[p + name + ".weight"] = 1.0 + 0.1 * torch.randn(d, generator=g)
    sd[p + "eh_proj.weight"] = 0.08 * torch.randn(d, 2 * d, generator=g)
    if predictive:
        for k in list(sd):
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                sd[k] = sd[k] * (0.0 if k.startswith(p) else main_scale)
        sd[p + "eh_proj.weight"] = torch.cat([torch.eye(d), torch.zeros(d, d)], dim=1)
        sd[p + "enorm.weight"] = torch.ones(d)
        sd[p + "shared_head.norm.weight"] = sd["model.norm.weight"].clone()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
