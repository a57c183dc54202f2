"""``tilert tiny-model`` writes loadable seeded checkpoints for every family, deterministically."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_tiny_model_cli_builds_a_loadable_checkpoint(arch: str, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / arch
    subprocess.run([sys.executable, "-m", "tilert.cli", "tiny-model", "--arch", arch, "--out", str(out)], check=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["kv_lora_rank"] == 512 and cfg["qk_rope_head_dim"] == 64
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = tok("def f(x):", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[-1] == cfg["vocab_size"]


def test_tiny_model_is_seeded(tmp_path: Path) -> None:
    from tilert.models.tiny import build_tiny_model

    digests = []
    for seed, name in ((0, "a"), (0, "b"), (1, "c")):
        path = build_tiny_model("deepseek_v3", tmp_path / name, seed=seed, num_hidden_layers=1)
        digests.append(hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1] != digests[2]
