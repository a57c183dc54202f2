"""Block-FP8 checkpoints under tensor parallelism on the CPU: two ranks on gloo, each loading its shard of
``tilert convert --tp 2`` (what ``tilert decode --tp 2`` loads), against the one-rank engine on the FP8 checkpoint
itself: the same greedy tokens over 256 steps after 1K-token prompts, MTP off (plain steps) and on (speculative
steps), logits within 1e-4 relative (float32, the ranks sum partials in another order).

The checkpoints are tiny DeepSeek-V3.2 (DSA, with an MTP module) and GLM-5 models whose per-rank shares are whole
128x128 scale blocks at TP 2 (four heads of nope 64 + rope 64 and value 64; expert and dense widths 256), quantised
as DeepSeek's FP8 checkpoints are (``tilert.models.quantize``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ranks import run_ranks_beside

from tilert.engines.base import DecodeEngine
from tilert.engines.tilert import fp8, parallel, sharding
from tilert.engines.tilert.engine import TileRTEngine
from tilert.engines.tilert.model import ModelArgs
from tilert.engines.tilert.weights import args_from_hf_config, checkpoint_keys, load_hf_config

pytestmark = pytest.mark.timeout(400)

# Per rank at TP 2: query rows 2 x 128, kv_b rows 2 x 128, o_proj columns 128, expert / dense width 128.
ALIGNED: dict[str, Any] = dict(
    qk_nope_head_dim=64, v_head_dim=64, moe_intermediate_size=256, intermediate_size=256, index_topk=16, vocab_size=2048
)
PREFILL = 1024  # prompt of each sequence (past index_topk: the sparse path runs from the first step)
STEPS = 256  # greedy steps of the two sequences (MTP off)
LOGIT_STEPS = 8  # of which the first ones return logits
SPEC_TOKENS = 48  # tokens of sequence 1 by speculative steps (MTP on)
MAX_SEQ = PREFILL + STEPS + SPEC_TOKENS + 8
CASES = ("deepseek_v32_mtp", "glm_moe_dsa")


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """``name -> (FP8 checkpoint, its tilert convert --tp 2 directory)``."""
    from tilert.engines.tilert.convert import convert
    from tilert.models.quantize import quantize_checkpoint
    from tilert.models.tiny import add_mtp_layer, build_tiny_model

    root = tmp_path_factory.mktemp("tp_fp8")
    v32 = build_tiny_model("deepseek_v32", root / "v32", seed=1, **ALIGNED)
    glm = build_tiny_model("glm_moe_dsa", root / "glm", seed=2, indexer_types=["full", "shared", "full"], **ALIGNED)
    srcs = {"deepseek_v32_mtp": add_mtp_layer(v32, root / "v32_mtp", predictive=True), "glm_moe_dsa": glm}
    out = {}
    for name, src in srcs.items():
        q = quantize_checkpoint(src, root / f"{name}_fp8")
        out[name] = (q, convert(q, root / f"{name}_tp2", tp=2, progress=False))
    return out


def scenario(eng: DecodeEngine, vocab: int) -> dict[str, Any]:
    """Two prompts, then greedy steps of both (the first with logits), then speculative steps of sequence 1 when
    the model has MTP; returns the logits and tokens seen, and the seconds spent."""
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    nxt, pos = [], [PREFILL, PREFILL]
    for seq in (0, 1):
        ids = torch.randint(8, vocab, (PREFILL,), generator=torch.Generator().manual_seed(3 + seq))
        last = eng.forward(ids, 0, seq)[-1]
        out[f"prefill{seq}"] = last
        nxt.append(int(last.argmax()))
    logits, tokens = [], []
    for step in range(STEPS):
        if step < LOGIT_STEPS:
            lg = eng.decode_step(nxt, pos, [0, 1])
            logits.append(lg)
            nxt = lg.argmax(-1).tolist()
        else:
            nxt = eng.decode_step_greedy(nxt, pos, [0, 1])
        tokens.append(nxt)
        pos = [p + 1 for p in pos]
    out["steps"], out["tokens"] = torch.stack(logits), tokens
    if eng.capabilities().mtp:
        spec, accepted, tok, p = [], [], nxt[1], pos[1]
        while len(spec) < SPEC_TOKENS:
            res = eng.speculative_greedy_step(tok, p, 2, seq=1)
            spec += res.tokens
            accepted.append(len(res.tokens))
            tok, p = res.tokens[-1], p + len(res.tokens)
        out["spec"], out["accepted"] = spec, accepted
    out["seconds"] = time.perf_counter() - t0
    return out


def _rank(rank: int, port: int, paths: dict[str, str], results: Any) -> None:
    """One of two ranks: rank 0 runs :func:`scenario` through a LeaderEngine, rank 1 follows."""
    torch.set_num_threads(1)
    from tilert.decode.tp import FollowerState, LeaderEngine, follow, load_rank

    pg, ctrl = parallel.init_process_group(rank, 2, port, "cpu")
    got = {}
    for name, path in paths.items():
        eng, channel = load_rank(Path(path), pg, ctrl, torch.device("cpu"), torch.float32, MAX_SEQ, 2)
        a = eng.model.args
        assert a.fp8 and a.tp_size == 2 and a.num_heads == 2 and a.moe_intermediate_size == 128
        assert dict(eng.model.named_parameters())["layers.1.mlp.w13"].dtype == fp8.E4M3
        if rank == 0:
            leader = LeaderEngine(eng, channel)
            got[name] = {
                k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in scenario(leader, eng.vocab_size).items()
            }
            leader.close()
        else:
            assert follow(eng, channel) is FollowerState.STOPPED
    if rank == 0:
        results.put(got)
    torch.distributed.destroy_process_group()


def _rel(have: torch.Tensor, want: torch.Tensor) -> float:
    return float((have - want).abs().max() / want.abs().max())


def test_fp8_two_ranks_equal_one_rank(cases: dict[str, tuple[Path, Path]]) -> None:
    """Two ranks loading ``tilert convert --tp 2`` shards decode what one rank decodes from the FP8 checkpoint."""
    torch.set_num_threads(1)

    def one_rank() -> dict[str, dict[str, Any]]:
        refs = {}
        for name in CASES:
            one = TileRTEngine.load(
                cases[name][0], device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=2
            )
            assert one.model.args.fp8 and one.model.args.tp_size == 1
            refs[name] = scenario(one, one.vocab_size)
        return refs

    got, refs = run_ranks_beside(_rank, ({name: str(cases[name][1]) for name in CASES},), one_rank, timeout_s=360)
    for name in CASES:
        ref = refs[name]
        two = got[name]
        print(
            f"{name}: one rank {ref['seconds']:.1f} s, two ranks {two['seconds']:.1f} s; accepted per speculative "
            f"step {ref.get('accepted')}"
        )
        for key in ("prefill0", "prefill1", "steps"):
            want, have = ref[key], torch.tensor(two[key])
            assert have.shape == want.shape
            assert _rel(have, want) < 1e-4, (name, key, _rel(have, want))
        assert two["tokens"] == ref["tokens"], name
        assert two.get("spec") == ref.get("spec"), name
        assert ("spec" in ref) == name.endswith("mtp")
        if "spec" in ref:  # drafts were accepted: the MTP layer's shards predicted
            assert max(ref["accepted"]) > 1, ref["accepted"]


def test_fp8_degree_that_cuts_scale_blocks_is_refused(cases: dict[str, tuple[Path, Path]]) -> None:
    """TP 4 would leave each rank 64 of the 128-wide expert blocks: refused with the reason, by the one check the
    engine, ``tilert decode --tp`` and ``tilert convert`` share."""
    q = cases["glm_moe_dsa"][0]
    args = args_from_hf_config(load_hf_config(q), checkpoint_keys(q))
    assert sharding.fp8_shares(args, 2) == {
        "query rows": 256,
        "kv_b rows": 256,
        "o_proj columns": 128,
        "expert width": 128,
        "dense MLP width": 128,
    }
    sharding.check_degree(args, 2)
    with pytest.raises(
        ValueError,
        match=r"degree 4 would cut the checkpoint's 128x128 FP8 scale blocks \(o_proj "
        r"columns 64 per rank, expert width 64 per rank, dense MLP width 64 per rank",
    ):
        sharding.check_degree(args, 4)


def test_fp8_shards_carry_the_block_scales_exactly() -> None:
    """Every rank's FP8 weight dequantises to exactly its slice of the dequantised whole (rows, columns, and an
    expert stack's gate / up halves), and the ranks' slices tile the whole; the engine-layout path
    (``shard_state_dict``) and the converter's (``shard`` on per-row :class:`fp8.QTensor`) store the same bytes."""
    g = torch.Generator().manual_seed(0)
    e, i, d = 3, 256, 384
    w13 = torch.randn(e, 2 * i, d, generator=g)
    w2 = torch.randn(e, d, i, generator=g)
    wo = torch.randn(d, 512, generator=g)

    def quant(w: torch.Tensor, leaf: str) -> tuple[torch.Tensor, torch.Tensor]:
        qs = [fp8.QTensor.from_checkpoint(leaf, *fp8.quantize_blocks(m)) for m in w.reshape(-1, *w.shape[-2:])]
        qt = fp8.stack(qs) if w.dim() == 3 else qs[0]
        return qt.weight, qt.compress(*fp8.scale_groups(leaf, tuple(w.shape)), leaf)

    sd: dict[str, torch.Tensor] = {}
    for key, w in (("layers.0.mlp.w13", w13), ("layers.0.mlp.w2", w2), ("layers.0.attn.wo", wo)):
        sd[key], sd[key + fp8.SCALE_SUFFIX] = quant(w, key.rpartition(".")[2])
    args = ModelArgs(
        arch="deepseek_v3",
        vocab_size=64,
        hidden_size=d,
        intermediate_size=256,
        moe_intermediate_size=i,
        num_layers=1,
        num_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=2,
        n_shared_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        mlp_layer_types=["sparse"],
        rms_norm_eps=1e-6,
        attention_bias=False,
        rope_interleave=True,
        softmax_scale=0.1,
        rope_inv_freq=[1.0] * 32,
        rope_attention_scaling=1.0,
        fp8=True,
    )
    whole = {
        k: fp8.dequant(sd[k], sd[k + fp8.SCALE_SUFFIX], torch.float32)
        for k in ("layers.0.mlp.w13", "layers.0.mlp.w2", "layers.0.attn.wo")
    }
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in whole}
    for rank in range(2):
        local = sharding.shard_state_dict(sd, args, rank, 2)
        for k in whole:
            q, s = local[k], local[k + fp8.SCALE_SUFFIX]
            assert q.dtype == fp8.E4M3 and fp8.groups(q, s) == (128, 128), k
            parts[k].append(fp8.dequant(q, s, torch.float32))
            streamed = sharding.shard(k, fp8.QTensor.from_engine(sd[k], sd[k + fp8.SCALE_SUFFIX]), args, rank, 2)
            assert torch.equal(streamed.weight, q), k
            assert torch.equal(streamed.compress(*fp8.scale_groups(k.rpartition(".")[2], tuple(q.shape)), k), s), k
    half = i // 2
    assert torch.equal(torch.cat(parts["layers.0.mlp.w2"], -1), whole["layers.0.mlp.w2"])
    assert torch.equal(torch.cat(parts["layers.0.attn.wo"], -1), whole["layers.0.attn.wo"])
    gate = torch.cat([p[:, :half] for p in parts["layers.0.mlp.w13"]], 1)
    up = torch.cat([p[:, half:] for p in parts["layers.0.mlp.w13"]], 1)
    assert torch.equal(torch.cat([gate, up], 1), whole["layers.0.mlp.w13"])
