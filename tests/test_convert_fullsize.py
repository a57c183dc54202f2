"""``tilert convert --tp 8`` at full dimensions: a synthetic block-FP8 DeepSeek-V3.2 checkpoint with every
dimension of the full-size model (hidden 7168, 128 heads, q_lora 1536, expert width 2048, dense width 18432, the
DSA indexer; from transformers' ``DeepseekV32Config`` defaults) but two layers (one dense, one MoE) plus the MTP
layer, 8 routed experts and a 4K vocabulary, generated tensor by tensor (``tilert.models.synthetic``, never
committed), converted to TP 8 shards in a subprocess whose peak RSS is measured: it must stay far below the
checkpoint's size, and each rank's shard must load into exactly the tensors the engine makes of the original
checkpoint for that rank.
The peak RSS and the seconds per GB are printed (recorded in ``benchmarks/results/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tilert.engines.tilert import converted, fp8, sharding, weights
from tilert.engines.tilert.convert import LazyCheckpoint
from tilert.models.synthetic import write_fp8_checkpoint

pytestmark = pytest.mark.timeout(600)

TP = 8
REDUCE: dict[str, Any] = dict(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, vocab_size=4096)


_MEASURE = """
import json, sys, time
from pathlib import Path
from tilert.engines.tilert import convert, weights

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

weights.load_hf_config(Path(sys.argv[1]))  # transformers' config machinery imported before the baseline
open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
t0 = time.perf_counter()
convert.convert(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), progress=False)
print(json.dumps({"base_kb": base, "peak_kb": status("VmHWM"), "seconds": time.perf_counter() - t0}))
"""


def test_full_dimension_fp8_checkpoint_converts_to_tp8_in_bounded_memory(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "tp8"
    t0 = time.perf_counter()
    size = write_fp8_checkpoint(src, "DeepseekV32Config", REDUCE, files=6)
    made = time.perf_counter() - t0
    args = weights.args_from_hf_config(weights.load_hf_config(src), weights.checkpoint_keys(src))
    assert args.fp8 and args.hidden_size == 7168 and args.num_heads == 128 and args.num_mtp_layers == 1
    assert sharding.fp8_shares(args, TP) == {
        "query rows": 3072,
        "kv_b rows": 4096,
        "o_proj columns": 2048,
        "expert width": 256,
        "dense MLP width": 2304,
    }
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(out), str(TP)],
        check=True,
        capture_output=True,
        text=True,
        timeout=480,
    )
    m = json.loads(res.stdout.strip().splitlines()[-1])
    grew = (m["peak_kb"] - m["base_kb"]) * 1024
    written = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
    print(
        f"\nsynthetic full-dimension FP8 checkpoint {size / 1e9:.2f} GB written in {made:.1f} s; convert --tp {TP}: "
        f"{m['seconds']:.1f} s ({m['seconds'] / (size / 1e9):.1f} s per GB read), {written / 1e9:.2f} GB written, "
        f"peak RSS {m['peak_kb'] / 2**20:.2f} GiB ({grew / 2**20:.0f} MiB above the baseline)"
    )
    assert size > 1.5e9
    # The bound holds whatever the number of layers and experts (the real checkpoint is hundreds of GB): one group's
    # non-expert tensors and one expert slot (here the full-size dense MLP's fused gate / up) with their TP 8
    # shares are in memory at a time.
    assert grew < 1.5 * 2**30, f"peak RSS grew by {grew / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB checkpoint"

    # What the engine makes of the original for each rank (weights.load_model with tp: the fused layout of the
    # whole, stored, then sharded), one fused group at a time here to keep the test's own memory bounded.
    ranks = [
        converted.load_converted(out, device="cpu", dtype=torch.bfloat16, max_seq_len=8, tp=(r, TP)).state_dict()
        for r in range(TP)
    ]
    seen: set[str] = set()
    for group in weights.fused_groups(LazyCheckpoint(src, args), args):
        whole = weights.store_fp8(
            {k: v.materialize() if isinstance(v, weights.ExpertStack) else v for k, v in group.items()}, args
        )
        for r in range(TP):
            for k, want in sharding.shard_state_dict(whole, args, r, TP).items():
                have = ranks[r][k]
                assert have.dtype == want.dtype and torch.equal(have, want), (r, k)
        seen.update(whole)
    for r in range(TP):
        assert set(ranks[r]) == seen
    assert ranks[0]["layers.1.mlp.w13"].dtype == fp8.E4M3 and ranks[0]["layers.1.mlp.w13"].shape == (9, 512, 7168)
    assert ranks[0]["mtp.0.block.attn.wo"].shape == (7168, 2048)
