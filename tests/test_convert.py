"""``tilert convert``: streamed conversion with bounded memory, per-rank shards, and refusal of corrupt output.

(Logits of converted directories against the HF directories they came from: ``test_fp8_checkpoints.py``.)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tilert.engines.tilert import convert, st_io
from tilert.engines.tilert.engine import TileRTEngine
from tilert.models.synthetic import checkpoint_shapes

# ~0.97 GB of bf16 in 1,000+ tensors: DeepSeek-V3 layout, 64 experts per MoE layer; the largest tensors are the
# embedding and the head (65.5 MB each).
BIG: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=8,
    n_shared_experts=1,
    n_routed_experts=64,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=64,
    v_head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def write_synthetic_checkpoint(out: Path, files: int = 4, **cfg_kw: Any) -> int:
    """A DeepSeek-V3 checkpoint of random bf16 tensors in DeepSeek's per-expert naming, written tensor by tensor
    over ``files`` shards (no model is ever built); returns the size of its largest tensor in bytes."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(**cfg_kw)
    out.mkdir(parents=True)
    cfg.save_pretrained(out)
    with torch.device("meta"):
        model = tf.DeepseekV3ForCausalLM(cfg)
    specs = checkpoint_shapes(model)
    names = list(specs)
    per = math.ceil(len(names) / files)
    gen = torch.Generator().manual_seed(0)
    for f in range(files):
        chunk = names[f * per : (f + 1) * per]
        w = st_io.ShardWriter(
            out / f"model-{f:05d}.safetensors",
            {n: (torch.float32 if n.endswith("correction_bias") else torch.bfloat16, specs[n]) for n in chunk},
        )
        for n in chunk:
            shape = specs[n]
            t = torch.randn(shape, generator=gen) * (0.02 if len(shape) > 1 else 1.0)
            w.write(n, t.to(torch.float32 if n.endswith("correction_bias") else torch.bfloat16))
        w.close()
    return max(math.prod(s) * 2 for s in specs.values())


_MEASURE = """
import json, sys
from pathlib import Path
from tilert.engines.tilert import convert, weights

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key + ":"))

weights.load_hf_config(Path(sys.argv[1]))  # transformers' config machinery imported before the baseline
open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
convert.convert(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"base_kb": base, "peak_kb": status("VmHWM")}))
"""


def test_convert_peak_memory_is_bounded_by_the_largest_tensors(tmp_path: Path) -> None:
    src = tmp_path / "src"
    largest = write_synthetic_checkpoint(src, **BIG)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert total > 0.9e9 and total > 12 * largest
    res = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(src), str(tmp_path / "out")],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    m = json.loads(res.stdout.strip().splitlines()[-1])
    grew = (m["peak_kb"] - m["base_kb"]) * 1024
    assert grew < 2 * largest, f"peak RSS grew by {grew / 2**20:.0f} MiB, largest tensor {largest / 2**20:.0f} MiB"
    written = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors"))
    assert written >= total * 0.99  # everything made it (bf16 in, bf16 out)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, converted) of a small synthetic checkpoint."""
    root = tmp_path_factory.mktemp("small")
    write_synthetic_checkpoint(
        root / "src",
        files=2,
        **{
            **BIG,
            "vocab_size": 512,
            "hidden_size": 256,
            "n_routed_experts": 8,
            "moe_intermediate_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
        },
    )
    res = subprocess.run(
        [sys.executable, "-m", "tilert.cli", "convert", "--model-dir", str(root / "src"), "--out", str(root / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "tensors" in res.stderr  # the progress bar
    return root / "src", root / "out"


def _load(path: Path) -> TileRTEngine:
    return TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=16)


def test_manifest_records_provenance(small: tuple[Path, Path]) -> None:
    src, out = small
    m = json.loads((out / convert.MANIFEST).read_text())
    assert m["layout_version"] == convert.LAYOUT_VERSION and m["converter_version"] == convert.CONVERTER_VERSION
    assert m["source"]["config_index_sha256"] == convert.source_hash(src) and m["dtypes"] == ["bfloat16", "float32"]
    assert (out / "config.json").exists()
    tokens = torch.tensor([1, 5, 9])
    a, b = _load(src).forward(tokens, 0), _load(out).forward(tokens, 0)
    assert torch.equal(a, b)


def _copy(out: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(out, dst)
    return dst


def _edit_manifest(d: Path, fn: Any) -> Path:
    m = json.loads((d / convert.MANIFEST).read_text())
    fn(m)
    (d / convert.MANIFEST).write_text(json.dumps(m))
    return d


def test_corrupt_or_mismatched_directories_are_refused(small: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = small
    wa = "layers.1.attn.wa"

    def tensors(m: dict[str, Any]) -> dict[str, Any]:
        return m["ranks"][0]["tensors"]

    d = _edit_manifest(_copy(out, tmp_path / "a"), lambda m: tensors(m).pop(wa))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['layers.1.attn.wa'\]"):
        _load(d)
    d = _edit_manifest(_copy(out, tmp_path / "b"), lambda m: tensors(m)[wa].__setitem__("shape", [7, 7]))
    with pytest.raises(ValueError, match=r"tensor layers.1.attn.wa has shape \[7, 7\], the model needs"):
        _load(d)
    d = _edit_manifest(_copy(out, tmp_path / "c"), lambda m: m.__setitem__("layout_version", 0))
    with pytest.raises(ValueError, match="layout version 0, this engine reads version 1"):
        _load(d)
    d = _edit_manifest(_copy(out, tmp_path / "e"), lambda m: m.pop("args"))
    with pytest.raises(ValueError, match=r"manifest lacks \['args'\]"):
        _load(d)
    d = _copy(out, tmp_path / "d")
    shard = d / json.loads((d / convert.MANIFEST).read_text())["ranks"][0]["tensors"][wa]["file"]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(ValueError, match=f"{shard.name}: tensor .* does not fit its bytes"):
        _load(d)
    shard.unlink()
    with pytest.raises(ValueError, match=f"shard {shard.name} is missing"):
        _load(d)


def test_convert_refuses_a_non_empty_destination(small: tuple[Path, Path]) -> None:
    src, out = small
    res = subprocess.run(
        [sys.executable, "-m", "tilert.cli", "convert", "--model-dir", str(src), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "exists and is not empty" in res.stderr


def test_tp_shards_are_what_the_tensor_parallel_engine_gives_each_rank(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """``tilert convert --tp 2``: rank ``r``'s shard loads (``load_model(tp=(r, 2))``, as ``tilert decode --tp 2``
    does) into exactly the weights the engine gives rank ``r`` when it shards the HF checkpoint itself."""
    from tilert.engines.tilert import weights

    src, out = small
    tp_out = convert.convert(src, tmp_path / "tp2", tp=2, progress=False)
    m = json.loads((tp_out / convert.MANIFEST).read_text())
    assert m["tp"] == 2 and [r["dir"] for r in m["ranks"]] == ["rank0", "rank1"]
    one = json.loads((out / convert.MANIFEST).read_text())["ranks"][0]["tensors"]
    for r in range(2):
        t = m["ranks"][r]["tensors"]
        assert t["layers.1.mlp.w13"]["shape"] == [8 + 1, 64, 256]  # every expert (8 routed + 1 shared), half wide
        assert t["lm_head"]["shape"][0] == one["lm_head"]["shape"][0] // 2
        kw: dict[str, Any] = dict(device="cpu", dtype=torch.float32, max_seq_len=16, tp=(r, 2))
        mine = weights.load_model(tp_out, **kw).state_dict()
        engines = weights.load_model(src, **kw).state_dict()
        assert mine.keys() == engines.keys()
        for k in engines:
            assert torch.equal(mine[k], engines[k]), k
    with pytest.raises(ValueError, match="per-rank shards are for the tensor-parallel engine"):
        _load(tp_out)
    with pytest.raises(ValueError, match="convert the checkpoint again with --tp 2"):
        weights.load_model(out, device="cpu", dtype=torch.float32, max_seq_len=16, tp=(0, 2))
    with pytest.raises(ValueError, match="degree 3 does not divide 8 attention heads"):
        convert.convert(src, tmp_path / "tp3", tp=3, progress=False)


def test_fp8_tp_that_cuts_scale_blocks_is_refused_as_the_engine_refuses_it(
    small: tuple[Path, Path], tmp_path: Path
) -> None:
    """The converter shards only what the tensor-parallel engine can load: FP8 shards that would cut the 128x128
    scale blocks are refused by the same rule (``sharding.check_degree``), with the reason, before anything is
    written; the engine refuses the same degree at load."""
    from tilert.engines.tilert import weights
    from tilert.models.quantize import quantize_checkpoint

    src, _ = small
    q = quantize_checkpoint(src, tmp_path / "fp8")
    says = "cut the checkpoint's 128x128 FP8 scale blocks .*expert width 32 per rank, dense MLP width 64 per rank"
    with pytest.raises(ValueError, match=says):
        convert.convert(q, tmp_path / "tp2", tp=2, progress=False)
    assert not (tmp_path / "tp2").exists()
    with pytest.raises(ValueError, match=says):
        weights.load_model(q, device="cpu", dtype=torch.float32, max_seq_len=16, tp=(0, 2))
