"""Block-FP8 checkpoints (DeepSeek-V3 / V3.2, GLM-5 ``*-FP8`` format) load as FP8 and decode exactly.

A tiny checkpoint of each family is quantised the way DeepSeek's FP8 checkpoints are (``tilert.models.quantize``:
e4m3 + ``weight_scale_inv`` per 128x128 block for every attention / MLP linear); the engine (CPU, float32)
must give the logits transformers gives on the *dequantised* checkpoint (1e-4), while holding its fused
weights in e4m3. Dims are chosen so blocks straddle every fusion: hidden 200 (K not a multiple of 128),
experts of 160 rows (gate|up halves and two shared experts split inside 128-row blocks), 5 heads of
q_b rows 40 each with rope rows permuted inside them, ``kv_a`` of 56 rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.hf_reference import FAMILIES, hf_model, prompt_ids, rel_err

from tilert.engines.tilert import fp8
from tilert.engines.tilert.engine import TileRTEngine
from tilert.models.quantize import dequantize_checkpoint, quantize_checkpoint

FP8_DIMS: dict[str, Any] = dict(
    hidden_size=200,
    moe_intermediate_size=160,
    intermediate_size=136,
    num_attention_heads=5,
    num_key_value_heads=5,
    n_shared_experts=2,
)
MAX_SEQ = 128

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_fp8_checkpoint(arch: str, root: Path) -> tuple[Path, Path]:
    """(FP8 checkpoint, its dequantised float32 twin) of a tiny seeded model of ``arch``."""
    hf_model(arch, **FP8_DIMS).save_pretrained(root / "src")
    return quantize_checkpoint(root / "src", root / "fp8"), dequantize_checkpoint(root / "fp8", root / "deq")


@pytest.fixture(scope="module")
def fp8_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for arch in FAMILIES:
        q, deq = make_fp8_checkpoint(arch, tmp_path_factory.mktemp(arch))
        ref = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
        with torch.no_grad():
            out[arch] = (q, ref(prompt_ids()[None]).logits[0].float())
    return out


def test_quantised_like_deepseek(fp8_cases: dict[str, tuple[Path, torch.Tensor]]) -> None:
    q, _ = fp8_cases["deepseek_v32"]
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    with safe_open(str(q / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        w = sf.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight")
        s = sf.get_tensor("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv")
        assert w.dtype == torch.float8_e4m3fn and s.shape == (2, 2) and s.dtype == torch.float32
        for kept in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.self_attn.indexer.weights_proj.weight",
        ):
            assert sf.get_tensor(kept).dtype != torch.float8_e4m3fn and kept + "_scale_inv" not in names
        for quantised in (
            "self_attn.q_a_proj",
            "self_attn.kv_a_proj_with_mqa",
            "self_attn.kv_b_proj",
            "self_attn.o_proj",
            "self_attn.indexer.wk",
            "self_attn.indexer.wq_b",
            "mlp.shared_experts.down_proj",
        ):
            assert f"model.layers.1.{quantised}.weight_scale_inv" in names, quantised


@pytest.mark.parametrize("cpu_fast", [True, False], ids=["ops.cpu", "reference-ops"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_engine_matches_dequantised_transformers(
    fp8_cases: dict[str, tuple[Path, torch.Tensor]], arch: str, cpu_fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both CPU kernel tables: the fast CPU kernels and the dispatched ``tilert::*`` reference ops."""
    monkeypatch.setenv("TILERT_CPU_FAST", "1" if cpu_fast else "0")
    path, want = fp8_cases[arch]
    eng = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    assert eng.cpu_kernels is cpu_fast
    params = dict(eng.model.named_parameters())
    for leaf in fp8.FUSED_LEAVES:  # held as e4m3 (no dequantised copy), each with its scale
        assert (
            params[f"layers.1.{'mlp' if leaf.startswith('w1') or leaf == 'w2' else 'attn'}.{leaf}"].dtype == fp8.E4M3
        ), leaf
    assert params["layers.1.mlp.w13_scale"].shape == (10, 320 // 32, 200 // 8)
    at_once = eng.forward(prompt_ids(), 0)
    assert rel_err(at_once, want) <= 1e-4
    eng2 = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    prompt = prompt_ids()
    steps = torch.stack([eng2.forward(prompt[i : i + 1], i)[0] for i in range(len(prompt))])
    assert rel_err(steps, want) <= 1e-4


def test_block_quantisation_roundtrip() -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 200)
    q, s = fp8.quantize_blocks(w)
    assert q.dtype == fp8.E4M3 and s.shape == (3, 2)
    deq = fp8.dequantize_blocks(q, s)
    assert (deq - w).abs().max() <= w.abs().max() * 2**-3  # e4m3: 3 mantissa bits
    # the engine layout (per-row scales, any grouping dividing 128) dequantises to the same values exactly
    qt = fp8.QTensor.from_checkpoint("w", q, s)
    for gn in (1, 4):
        assert torch.equal(fp8.dequant(q, qt.compress(gn, 8, "w"), torch.float32), deq)
    with pytest.raises(ValueError, match="300 rows cannot be stored in groups of 128"):
        qt.compress(128, 8, "w")
    swapped = qt.map_rows(lambda t: t[torch.tensor([200] + list(range(1, 200)) + [0] + list(range(201, 300)))])
    assert torch.equal(fp8.dequant(swapped.weight, swapped.compress(1, 8, "w"), torch.float32)[200], deq[0])
    with pytest.raises(ValueError, match="not constant over 4-row groups"):
        swapped.compress(4, 8, "w")  # a row moved into another 128-row block


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


def test_bad_fp8_checkpoints_are_refused(fp8_cases: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path) -> None:
    path, _ = fp8_cases["deepseek_v3"]
    name = "model.layers.1.self_attn.o_proj.weight"

    def load(p: Path) -> None:
        TileRTEngine.load(p, device="cpu", dtype=torch.float32, max_seq_len=8)

    bad = _rewrite(path, tmp_path / "noscale", lambda sd: sd.pop(name + "_scale_inv"))
    with pytest.raises(ValueError, match=f"{name} is FP8 but {name}_scale_inv is missing"):
        load(bad)
    bad = _rewrite(path, tmp_path / "shape", lambda sd: sd.__setitem__(name + "_scale_inv", torch.ones(3, 3)))
    with pytest.raises(ValueError, match=r"o_proj.weight.weight_scale_inv has shape \(3, 3\)"):
        load(bad)
    bad = _rewrite(
        path,
        tmp_path / "bf16part",
        lambda sd: (sd.pop(name + "_scale_inv"), sd.__setitem__(name, torch.zeros(200, 200))),
    )
    with pytest.raises(ValueError, match="layers.1.attn.wo: the checkpoint is FP8 but this weight is"):
        load(bad)
    bad = _rewrite(path, tmp_path / "missing", lambda sd: sd.pop("model.layers.1.self_attn.kv_a_layernorm.weight"))
    with pytest.raises(ValueError, match="checkpoint tensor 'layers.1.self_attn.kv_a_layernorm.weight' is missing"):
        load(bad)
    up = "model.layers.1.mlp.experts.3.up_proj.weight"
    bad = _rewrite(path, tmp_path / "expert", lambda sd: (sd.pop(up), sd.pop(up + "_scale_inv")))
    with pytest.raises(ValueError, match="checkpoint tensor 'layers.1.mlp.experts.3.up_proj.weight' is missing"):
        load(bad)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        load(bad)
    del cfg["quantization_config"]
    nocfg = _rewrite(path, tmp_path / "nocfg", lambda sd: None)
    (nocfg / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float8_e4m3fn but config.json has no quantization_config"):
        load(nocfg)


@pytest.mark.parametrize("arch", FAMILIES)
def test_converted_fp8_gives_the_hf_directory_logits(
    fp8_cases: dict[str, tuple[Path, torch.Tensor]], arch: str, tmp_path: Path
) -> None:
    from tilert.engines.tilert.convert import convert

    path, want = fp8_cases[arch]
    out = convert(path, tmp_path / "converted", progress=False)
    direct = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    converted = TileRTEngine.load(out, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    assert dict(converted.model.named_parameters())["layers.1.mlp.w13"].dtype == fp8.E4M3
    got, same = converted.forward(prompt_ids(), 0), direct.forward(prompt_ids(), 0)
    # The same weights, memory-mapped from the shards: equal up to float32 rounding (MKL's one-row products round
    # by the weight's memory alignment, and a shard's tensors sit at any 8-byte offset), the same greedy tokens.
    assert rel_err(got, same) <= 1e-6 and torch.equal(got.argmax(-1), same.argmax(-1))
    assert rel_err(got, want) <= 1e-4
