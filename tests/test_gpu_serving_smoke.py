"""``benchmarks/gpu_serving.py --smoke --device cpu``: the serving benchmark end to end on a tiny DSA checkpoint.

The real router and decode node, the prefill stand-in prefilling with the engine and handing the prompt's KV (the
MLA latent and the DSA indexer's keys, in vLLM's layouts) to the real connector, the OpenAI SDK streaming at one and
two users, then one user on a node that drafts with the checkpoint's MTP layer and accepts every draft (its head as
the checkpoint has it, then a block-FP8 copy of its first 300 rows: ``--draft-head fp8 --draft-vocab``). Its prompt
passes the model's ``index_topk``, so the node's decode steps select rows with the indexer keys that travelled.
Every stream must equal the engine's own tokens for its prompt (greedy; with every draft accepted, the engine's on
that path).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_serving.py"

pytestmark = pytest.mark.timeout(300)


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    """``gpu_serving.py argv`` with this checkout on its path; it must succeed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(SCRIPT), *argv], env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def test_smoke_run_streams_the_engines_own_tokens(tmp_path: Path) -> None:
    from tilert.models.tiny import add_mtp_layer, build_tiny_model

    model = add_mtp_layer(build_tiny_model("deepseek_v32", tmp_path / "tiny-v32", seed=0), tmp_path / "tiny-v32-mtp")
    out = tmp_path / "out"
    done = _run(
        "--smoke", "--device", "cpu", "--model", str(model), "--out", str(out), "--drafts", "0,2all,2all+fp8+v300"
    )
    doc = json.loads((out / "cpu-serving.json").read_text())
    assert doc["recorded"]["machine"] == "cpu"
    assert [(r["node"], r["users"]) for r in doc["rows"]] == [
        ("MTP off", 1),
        ("MTP off", 2),
        ("MTP 2 all accepted", 1),
        ("MTP 2 all accepted, FP8 draft head, drafts among the first 300 tokens", 1),
    ]
    for r in doc["rows"]:
        assert r["errors"] == 0 and r["requests"] == r["users"], r
        assert r["same_tokens"] is True, r
    accepted = doc["rows"][2]
    assert accepted["engine_tokens_per_step"] == 3.0 and "every draft accepted" in accepted["engine_path"], accepted
    # the node's own spec-decode counters: every draft it drafted, it accepted (two a step)
    assert accepted["node_spec_drafts"] > 0, accepted
    assert (
        accepted["node_spec_accepted_tokens"] == accepted["node_spec_draft_tokens"] == 2 * accepted["node_spec_drafts"]
    )
    assert accepted["node_spec_accepted_per_pos"] == [accepted["node_spec_drafts"]] * 2
    assert doc["rows"][0]["node_spec_drafts"] == 0  # MTP off
    fp8_head = doc["rows"][3]  # every draft taken: the stream is the drafts, from the node's FP8 copy of 300 rows
    assert fp8_head["engine_tokens_per_step"] == 3.0 and "block-FP8 head" in fp8_head["engine_path"], fp8_head
    assert "first 300 tokens" in fp8_head["engine_path"], fp8_head
    rows = {r["users"]: r for r in doc["rows"][:2]}
    for r in rows.values():
        assert r["client_tok_s"] > 0 and r["engine_tok_s"] > 0, r
        assert r["ttft_ms"] > 0 and r["itl_p50_ms"] > 0, r
    # the prefill's dense pages hold the engine's own latent exactly (the indexer's keys travel as fp8, as in vLLM)
    assert all(r["kv_latent_max_err"] == 0.0 and r["kv_indexer_max_err"] > 0.0 for r in rows.values()), rows
    assert rows[1]["engine_path"] == "greedy_stream"
    assert rows[2]["engine_batch_same"] is True  # the engine's two sequences at once give each its tokens alone
    assert doc["conditions"]["prefill_kv_layout"] == "dense"
    # time to first token through the router and calling the stand-in directly (its one token streamed as vLLM does)
    ttft = doc["ttft"]
    assert ttft["pairs"] == 3 and ttft["errors"] == 0, ttft
    assert len(ttft["routed_ms"]) == len(ttft["direct_ms"]) == 3 and ttft["direct_ttft_ms"] > 0, ttft
    hooks = ttft["routed_connector_hooks_ms"]  # the routed prefill ran the connector's hooks, the direct one did not
    assert hooks["save_kv_layer"] > 0 and hooks["build_connector_meta"] > 0 and ttft["routed_connector_ms"] > 0, ttft
    assert ttft["added_ms"] > 0, ttft
    # the router's own part, from its metrics over the timed pairs: inside the routed TTFT, outside the prefill
    assert 0 < ttft["router_own_ms"] < ttft["routed_ttft_ms"], ttft
    assert "TTFT added by the router, the node and the transfer" in done.stdout
    assert "The same tokens as the engine's own greedy on every stream." in done.stdout


def test_synthetic_checkpoint_written_converted_and_served(tmp_path: Path) -> None:
    """``--synthetic tiny-v32``: the checkpoint written in DeepSeek's FP8 format with its MTP layer, converted by
    ``tilert convert``, then served; the streams are the engine's own tokens and the conditions say how long the
    two steps took."""
    out, keep = tmp_path / "out", tmp_path / "synthetic"
    argv = ["--synthetic", "tiny-v32", "--synthetic-dir", str(keep), "--device", "cpu", "--out", str(out)]
    done = _run(*argv, "--users", "1,2", "--tokens", "4", "--prompt-len", "72", "--no-warmup")
    doc = json.loads((out / "cpu-serving.json").read_text())
    rows = {r["users"]: r for r in doc["rows"]}
    assert set(rows) == {1, 2} and all(r["same_tokens"] is True and r["errors"] == 0 for r in rows.values()), rows
    syn = doc["conditions"]["synthetic"]
    assert syn["name"] == "tiny-v32" and syn["write_s"] > 0 and syn["convert_s"] > 0 and syn["checkpoint_gb"] > 0
    assert doc["conditions"]["model"] == str((keep / "converted").resolve())
    assert doc["conditions"]["engine_mtp"] is True  # the MTP layer came through the conversion
    assert json.loads((keep / "hf" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert (keep / "converted" / "tilert_manifest.json").is_file()
    assert "written:" in done.stdout and "converted:" in done.stdout
    assert "The same tokens as the engine's own greedy on every stream." in done.stdout
