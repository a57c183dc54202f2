"""The benchmark configurations of one tensor-parallel rank of full-size DeepSeek-V3.2 and GLM-5
(``benchmarks/engine_configs.py``, timed by ``benchmarks/decode_speed.py`` on a GPU): their dimensions are the
transformers config classes' divided as the engine shards them, the bytes a step reads are counted from the
model the engine builds, and a reduced version runs through the same code on the CPU."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import decode_speed  # noqa: E402
import engine_configs  # noqa: E402

from tilert.engines.tilert import fp8  # noqa: E402
from tilert.engines.tilert.model import Transformer  # noqa: E402

ROW_FIELDS = ("config", "context", "weights", "ms_per_step", "tok_s", "pct_roofline", "bytes_per_step")


@pytest.mark.parametrize("name", list(engine_configs.RANK_CONFIGS))
def test_rank_is_the_full_size_models_share(name: str) -> None:
    import transformers

    cls, tp = engine_configs.RANK_CONFIGS[name]
    cfg = getattr(transformers, cls)()
    a = engine_configs.rank_args(name)
    assert (a.tp_size, a.tp_rank, a.fp8, a.num_mtp_layers) == (tp, 0, True, 1)
    assert a.hidden_size == cfg.hidden_size and a.num_layers == cfg.num_hidden_layers
    assert a.num_heads == cfg.num_attention_heads // tp
    assert a.moe_intermediate_size == cfg.moe_intermediate_size // tp
    assert a.intermediate_size == cfg.intermediate_size // tp
    assert (a.kv_lora_rank, a.q_lora_rank, a.index_n_heads) == (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.index_n_heads)


def _bytes_read(model: Transformer, sparse: bool) -> int:
    """Bytes one plain step reads, counted from the model's parameters (bf16 weights, e4m3 FP8 weights, float32
    scales): each MoE layer's experts at (top-k + shared) of its slots, one embedding row, no norms, no MTP; a dense
    step the query rows of W_b and not the indexer's head weights (it scores no rows)."""
    a = model.args
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or p.dim() == 1:
            continue
        size = 1 if p.dtype == fp8.E4M3 else 4 if name.endswith(fp8.SCALE_SUFFIX) else 2
        n = p.numel() * size
        if name == "embed":
            n = a.hidden_size * 2
        elif ".mlp.w" in name and p.shape[0] == a.n_routed_experts + a.n_shared_experts:
            n = n * (a.num_experts_per_tok + a.n_shared_experts) // p.shape[0]
        elif not sparse and name.endswith((".attn.wb", ".attn.wb" + fp8.SCALE_SUFFIX)):
            n = n * a.q_width // p.shape[0]
        elif not sparse and name.endswith(".attn.index_wproj"):
            n = 0
        total += n
    return total


@pytest.mark.parametrize("name", list(engine_configs.RANK_CONFIGS))
def test_bytes_per_step_are_the_rank_models(name: str) -> None:
    a = engine_configs.rank_args(name)
    with torch.device("meta"):
        model = Transformer(a)
    b = decode_speed.bytes_per_token(a, 1024, sparse=False)
    assert b["weights"] + b["head"] == _bytes_read(model, sparse=False)
    assert b["kv"] == a.num_layers * 1024 * a.latent_dim * 2
    sparse = decode_speed.bytes_per_token(a, 32768, sparse=True)
    assert sparse["weights"] + sparse["head"] == _bytes_read(model, sparse=True) > _bytes_read(model, sparse=False)
    assert sparse["kv"] == a.num_layers * a.index_topk * a.latent_dim * 2 + len(a.index_layers) * 32768 * 128 * 2
    assert 3e9 < b["total"] < 20e9  # the attention and top-k experts of a 600B+ FP8 model, one rank's share


@pytest.mark.parametrize("name", list(engine_configs.RANK_CONFIGS))
def test_rank_with_fewer_experts_reads_the_same_but_the_gate(name: str) -> None:
    """``--rank-experts``: the proxy of a rank for a smaller GPU holds half the experts, and a step reads the same
    bytes but the router's gate (one row an expert)."""
    full = engine_configs.rank_args(name)
    half = full.n_routed_experts // 2
    a = decode_speed.rank_with_experts(name, half)
    assert a.n_routed_experts == half and a.moe_intermediate_size == full.moe_intermediate_size
    with torch.device("meta"):
        names = [n for n, _ in Transformer(a).named_parameters()]
    moe_layers = sum(n.endswith("mlp.gate") and not n.startswith("mtp.") for n in names)  # a plain step's
    assert moe_layers > 0
    b_full = decode_speed.bytes_per_token(full, 1024, sparse=False)["total"]
    b_half = decode_speed.bytes_per_token(a, 1024, sparse=False)["total"]
    assert b_full - b_half == moe_layers * half * a.hidden_size * 2  # the gate's rows, read as bf16


def test_rank_with_experts_refuses_what_routing_cannot_use() -> None:
    with pytest.raises(SystemExit, match="divisible by"):
        decode_speed.rank_with_experts("v32-tp8-rank", 12)


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ({}, "decode-bf16"),
        ({"weights": "bf16,fp8"}, "decode-fp8"),
        ({"configs": "v32-tp8-rank"}, "decode-tp8-rank"),
        ({"configs": "v32-tp8-rank", "rank_experts": 128}, "decode-tp8-rank-e128"),
        ({"configs": "v32-tp8-rank,lite-v32", "rank_experts": 128, "ablate": True}, "decode-ablation"),
        ({"sequences": "1,4"}, "decode-multiseq"),
    ],
)
def test_each_run_records_under_its_benchmarks_name(flags: dict[str, Any], name: str) -> None:
    args = {"sequences": "", "ablate": False, "configs": "lite-v32,layer-v32", "rank_experts": 0, "weights": "bf16"}
    assert decode_speed.bench_name(argparse.Namespace(**(args | flags))) == name


def test_reduced_ranks_run_on_the_cpu(tmp_path: Path) -> None:
    """``decode_speed.py --cpu-smoke``'s path (smaller still here: the suite's time): the rank configurations built
    with random FP8 weights, a plain step at a dense and a DSA context and a speculative step, JSON rows with the
    table's fields."""
    import json

    reduce: dict[str, Any] = dict(engine_configs.CPU_REDUCE, hidden_size=1024, vocab_size=1024)
    rows = decode_speed.cpu_smoke(str(tmp_path), reduce)
    saved = json.loads((tmp_path / "decode_speed_cpu_smoke.json").read_text())["runs"]
    assert [r["config"] for r in saved] == [f"{n}-cpu-smoke" for n in engine_configs.RANK_CONFIGS for _ in (0, 1)]
    for r in saved:
        assert all(k in r for k in ROW_FIELDS), r.keys()
        assert r["weights"] == "fp8" and r["tp"] == 8 and math.isclose(r["tok_s"] * r["ms_per_step"], 1e3)
    assert len(rows) == len(saved)


def test_projection_adds_the_collectives_of_each_step(tmp_path: Path) -> None:
    """``project_tp.py``: a plain step pays two all-reduces per layer and one all-gather; a speculative step of K
    drafts its verify's and K + 1 MTP passes'; rows marked projected."""
    import json

    import project_tp

    runs = [
        dict(config="v32-tp8-rank", context=c, weights="fp8", ms_per_step=ms) for c, ms in ((1024, 4.0), (32768, 6.0))
    ]
    steps = {str(k): dict(graph_ms=4.0 + k) for k in (1, 2, 3)}
    src = tmp_path / "rank.json"
    src.write_text(json.dumps(dict(runs=runs, mtp_verify={"v32-tp8-rank": dict(ctx=1024, steps=steps)})))
    rows = project_tp.main(
        ["--rank-json", str(src), "--allreduce-us", "10", "--allgather-us", "20", "--out", str(tmp_path)]
    )
    saved = json.loads((tmp_path / "cpu-project-tp8.json").read_text())["rows"]
    assert saved == rows and all(r["projected"] for r in rows)
    plain = {r["context"]: r for r in rows if r["mtp"] == "off"}
    assert math.isclose(plain[1024]["ms_per_step"], 4.0 + 122 * 0.01 + 0.02)
    spec = {(r["context"], r["accepted_len"]): r for r in rows if r["mtp"] != "off"}
    k3 = spec[(32768, 4.0)]  # K = 3: t_spec(3) measured at 1K, plus the plain step's growth to 32K
    assert k3["mtp"] == 3 and math.isclose(k3["ms_per_step"], 7.0 + 2.0 + (122 + 8) * 0.01 + 5 * 0.02)
    assert math.isclose(k3["tok_s"], 4.0 * 1e3 / k3["ms_per_step"])


def test_speculative_step_bytes() -> None:
    """The bytes of a speculative step: a verify of one token reads what a plain step reads; with more tokens the
    MoE layers read the union of their experts (random routing), so at full acceptance a step yields fewer tokens
    per byte than ``drafts + 1`` plain steps would, and the ceiling it sets stays below ``drafts + 1``."""
    a = engine_configs.LITE_V32
    k, e = a.num_experts_per_tok, a.n_routed_experts
    assert decode_speed.routed_union(a, 1) == pytest.approx(k)
    assert k < decode_speed.routed_union(a, 4) < min(4 * k, e)
    plain = decode_speed.bytes_per_token(a, 1024, False)
    assert decode_speed.bytes_per_token(a, 1024, False, tokens=1) == plain
    one = decode_speed.spec_bytes_per_step(a, 1024, False, 1, 1)
    assert one["verify"] > plain["total"] and one["ratio"] > 1
    full = decode_speed.spec_bytes_per_step(a, 1024, False, 3, 4)
    assert full["total"] == pytest.approx(full["mtp"] + full["verify"])
    assert full["mtp"] > decode_speed.spec_bytes_per_step(a, 1024, False, 3, 1)["mtp"]  # the catch-up's union
    assert 1 < full["ceiling_speedup"] < 4
    assert full["ceiling_speedup"] == pytest.approx(4 * plain["total"] / full["total"])
    fp8_head = decode_speed.spec_bytes_per_step(a, 1024, False, 3, 4, fp8_head=True)  # each draft reads half the head
    assert full["total"] - fp8_head["total"] == pytest.approx(3 * a.vocab_size * a.hidden_size)
    subset = decode_speed.spec_bytes_per_step(a, 1024, False, 3, 4, fp8_head=True, head_rows=1000)
    assert fp8_head["total"] - subset["total"] == pytest.approx(3 * (a.vocab_size - 1000) * a.hidden_size)
