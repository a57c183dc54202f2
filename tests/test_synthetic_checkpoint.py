"""Synthetic block-FP8 checkpoints (``tilert.models.synthetic``): DeepSeek's HF FP8 format, an MTP layer, the
tokenizer copied in, the same bytes from the same seed, and values a model can run on: written at reduced
dimensions, converted by ``tilert convert`` and loaded by the engine as the decode node loads it, greedy decoding
gives finite logits and varied tokens. The benchmark's named configurations (``engine_configs.SYNTHETIC``) are
written with the fields that read back as the engine's own configuration of them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tilert.cli import main as tilert_main
from tilert.engines.tilert import fp8, st_io, weights
from tilert.engines.tilert.engine import TileRTEngine
from tilert.models.synthetic import checkpoint_specs, hf_config, write_fp8_checkpoint

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from engine_configs import SYNTHETIC, TINY_V32, hf_overrides  # noqa: E402

TINY: dict[str, Any] = hf_overrides(TINY_V32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert.models.tiny import save_tiny_tokenizer

    out = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> Path:
    out = tmp_path_factory.mktemp("synthetic") / "hf"
    write_fp8_checkpoint(out, "DeepseekV32Config", TINY, tokenizer=tokenizer, device="cpu", files=2)
    return out


def test_written_in_deepseeks_fp8_format_with_an_mtp_layer(checkpoint: Path, tokenizer: Path) -> None:
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["hidden_size"] == TINY["hidden_size"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)  # the tiny tokenizer's <|bos|>, <|eos|>
    assert (checkpoint / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    entries = {k: e for f in sorted(checkpoint.glob("*.safetensors")) for k, e in st_io.read_header(f).items()}
    assert set(index) == set(entries) and len(set(index.values())) == 2
    assert entries["model.layers.1.mlp.experts.7.up_proj.weight"].dtype == fp8.E4M3
    q = entries["model.layers.0.self_attn.q_b_proj.weight"]
    s = entries["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
    assert q.dtype == fp8.E4M3 and s.dtype == torch.float32 and s.shape == (-(-q.shape[0] // 128), q.shape[1] // 128)
    assert entries["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert entries["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    mtp = "model.layers.2."
    eh = entries[mtp + "eh_proj.weight"]
    assert eh.shape == (256, 512) and eh.dtype == torch.bfloat16
    assert entries[mtp + "mlp.experts.0.down_proj.weight"].dtype == fp8.E4M3
    args = weights.args_from_hf_config(weights.load_hf_config(checkpoint), set(entries))
    assert args.fp8 and args.num_mtp_layers == 1 and args.mtp_moe and args.mtp_indexer
    # the effective weights are HF-init-like: e4m3 values N(0, 1), block scales fan_in^-0.5 times U(0.5, 1.5)
    w = fp8.dequantize_blocks(st_io.read_tensor(q), st_io.read_tensor(s), torch.float32)
    assert torch.isfinite(w).all() and 0.5 < float(w.std()) * q.shape[1] ** 0.5 < 1.5


def test_the_same_seed_writes_the_same_bytes(checkpoint: Path, tokenizer: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    write_fp8_checkpoint(again, "DeepseekV32Config", TINY, tokenizer=tokenizer, device="cpu", files=2, workers=1)
    for f in checkpoint.glob("*.safetensors"):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(ValueError, match="not empty"):
        write_fp8_checkpoint(again, "DeepseekV32Config", TINY)
    with pytest.raises(ValueError, match="more than vocab_size 512"):
        write_fp8_checkpoint(tmp_path / "small", "DeepseekV32Config", {**TINY, "vocab_size": 512}, tokenizer=tokenizer)


def test_converted_and_loaded_it_decodes_finite_varied_tokens(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "converted"
    assert tilert_main(["convert", "--model-dir", str(checkpoint), "--out", str(out), "--quiet"]) == 0
    engine = TileRTEngine.load(out, device="cpu", dtype=torch.float32, max_seq_len=128)
    assert engine.supports_mtp and engine.model.args.fp8
    prompt = torch.randint(8, TINY["vocab_size"], (24,), generator=torch.Generator().manual_seed(0))
    logits = engine.forward(prompt, 0)
    tokens, pos = [int(logits[-1].argmax())], len(prompt)
    for _ in range(50):
        logits = engine.forward(torch.tensor([tokens[-1]]), pos)
        assert torch.isfinite(logits).all(), len(tokens)
        tokens.append(int(logits[-1].argmax()))
        pos += 1
    assert 0.3 < float(logits[-1].std()) < 3.0  # logits of unit scale: neither vanishing nor exploding
    assert len(set(tokens)) > 20, tokens


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_named_configurations_read_back_as_the_engines(name: str) -> None:
    want = SYNTHETIC[name]
    have = weights.args_from_hf_config(hf_config("DeepseekV32Config", hf_overrides(want)))
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(have, f.name)
        if f.name == "rope_inv_freq":
            assert all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b, strict=True))
        else:
            assert a == b, (name, f.name, a, b)
    specs = checkpoint_specs(hf_config("DeepseekV32Config", hf_overrides(want)))
    size = sum(math.prod(s) * dt.itemsize for dt, s in specs.values())
    if name == "lite-v32":  # the 16B model: 27 layers of 64 experts, its MTP layer, 129280 tokens
        assert 15e9 < size < 18e9, size
