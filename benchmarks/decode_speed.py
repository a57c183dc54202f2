"""Batch-1 decode speed of the TileRT ENGINE on one GPU (its model, CUDA ops, its CUDA graph) vs the roofline.

    python3 benchmarks/decode_speed.py --out $OUT            (H200; writes h200-decode-bf16.json into --out)

Without ``--out`` it writes the current result, ``benchmarks/results/<machine>-<benchmark>.json``: the benchmark
``decode-bf16`` (``decode-fp8`` when ``--weights`` has fp8, ``decode-tp8-rank`` for the rank configs,
``decode-multiseq`` with ``--sequences``; ``--name`` sets it), the machine from the GPU (``h200``); the JSON starts
with ``results_header``'s ``"recorded"`` (date, commit, machine, command).

Configs (``engine_configs.py``): ``lite-v32`` (DeepSeek-V3.2 family, 16B: hidden 2048, 27 layers, 64 experts
top-6 + 2 shared) and ``layer-v32`` (4 layers at the real DeepSeek-V3.2 dims). The engine model
(``tilert.engines.tilert.model.Transformer``) is built with random bf16 weights directly on the GPU
(``weights.random_model``), wrapped in ``TileRTEngine``; caches filled with random rows; contexts 1K/8K/32K.

For every (config, context): the engine's captured decode step (``TileRTEngine._step``: the graph that
``engine.forward`` replays for one token), tok/s (median of replays), bytes read per token (weights actually
read: attention + top-k and shared experts + router, the embedding row and lm_head, plus KV / indexer-cache
bytes), the copy bandwidth measured in the same run, % of roofline, a per-kernel time breakdown
(torch.profiler over eager steps, plus the gaps between kernels), at DSA contexts the same step with torch.topk
in place of the radix top-k; for lite-v32 (with its MTP module) the speculative step (MTP catch-up + K drafts +
verify, one CUDA graph) for K = 1, 2, 3 and the tok/s at mean accepted lengths 1.0-4.0; transformers' eager
speed on the same shapes in the same run (``--transformers CTXS``).

Rank configs (``--configs v32-tp8-rank,glm5-tp8-rank``, ``engine_configs.RANK_CONFIGS``): one TP-8 rank of
full-size DeepSeek-V3.2 / GLM-5 (dimensions from transformers' config classes; every layer and the MTP layer;
block-FP8), timed alone: the rank's step without its collectives, bytes per step counting the rank's share, and
the rank's speculative step. Rows carry ``config``, ``context``, ``weights``, ``ms_per_step``, ``tok_s``,
``bytes_per_step`` and ``pct_roofline`` (``benchmarks/project_tp.py`` reads them). ``--cpu-smoke`` runs those
configurations reduced on the CPU (no GPU), checking the code path. ``--rank-experts N`` builds each rank with N
routed experts a layer instead of the model's (rows ``<config>-e<N>``): a step reads the same routed experts' bytes,
only the router's gate is smaller, and the rank then fits a GPU of 80 GB (a proxy for the rank's step where no
larger GPU is at hand, never its record).

``--weights bf16,fp8`` runs every config twice in the same process: bf16 weights, then block-FP8 weights
(``ModelArgs.fp8``: e4m3 with 128x128-block scales, read by ``ops/triton_fp8.py``; rows ``<config>-fp8``), bytes
per token counting 1 byte per FP8 weight plus its scales.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch
from engine_configs import CONFIGS, CPU_REDUCE, RANK_CONFIGS, config_args, hf_overrides, rank_args  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402

from tilert.engines.tilert.fast import CapturedFn  # noqa: E402
from tilert.engines.tilert.model import ModelArgs  # noqa: E402

DEV = torch.device("cuda")
RESULT: dict = {}
TUNE_ONLY: list = []  # --tune-only


def log(*a):
    print(*a, flush=True)


def time_replays(replay, iters=30, reps=5) -> float:
    """Median seconds per ``replay()`` (events around ``iters`` back-to-back calls, ``reps`` times)."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / iters)
    ts.sort()
    return ts[len(ts) // 2]


def time_graph(step: CapturedFn, iters=30, reps=5) -> float:
    """Median seconds per replay of a captured engine graph."""
    return time_replays(step.replay, iters, reps)


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    ts.sort()
    bw = 2 * n / ts[len(ts) // 2]
    del a, b
    torch.cuda.empty_cache()
    return bw


CATEGORIES = (
    ("moe_up", "moe up (norm + w13 + silu*up)"),
    ("moe_down", "moe down (+residual)"),
    ("router", "router select"),
    ("gemv", "GEMVs (W_a, W_b, W_o, router, lm_head)"),
    ("mla_split", "attention core"),
    ("mla_combine", "attention core"),
    ("mla_prep", "mla prep"),
    ("mla_uv", "mla W_UV"),
    ("indexer", "indexer scores"),
    ("topk", "indexer top-k"),
    ("sort", "indexer top-k"),
    ("radix", "indexer top-k"),
)


def _wbytes(a, leaf: str, *shape: int) -> int:
    """Bytes of one fused weight: bf16, or e4m3 plus its float32 scales (``fp8.scale_shape``)."""
    import math

    from tilert.engines.tilert import fp8

    if not a.fp8:
        return 2 * math.prod(shape)
    return math.prod(shape) + 4 * math.prod(fp8.scale_shape(leaf, shape))


def _projection_bytes(a, has_indexer: bool, sparse: bool) -> int:
    """W_a and W_b as a step reads them (``ModelArgs.wa_step_rows``: the indexer's queries and head weights on a
    sparse step only)."""
    b = _wbytes(a, "wa", a.wa_step_rows(has_indexer, sparse), a.hidden_size)
    if a.q_lora_rank is not None:
        b += _wbytes(a, "wb", a.wb_step_rows(has_indexer, sparse), a.q_lora_rank)
    if has_indexer and sparse and a.fp8:  # indexer.weights_proj, kept bf16 apart from W_a
        b += a.index_n_heads * a.hidden_size * 2
    return b


def _attn_bytes(a, has_indexer: bool, sparse: bool) -> int:
    """One layer's attention weights: W_a and W_b (:func:`_projection_bytes`), W_kv_b, W_o."""
    d, h = a.hidden_size, a.num_heads
    return (
        _projection_bytes(a, has_indexer, sparse)
        + _wbytes(a, "wkv_b", h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
        + _wbytes(a, "wo", d, h * a.v_head_dim)
    )


def routed_union(args, tokens: int) -> float:
    """Expected distinct routed experts a layer reads for ``tokens`` tokens routed independently and uniformly (random
    weights route so; a trained model's consecutive tokens share more): ``E (1 - (1 - k / E) ** tokens)``."""
    e, k = args.n_routed_experts, args.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def _moe_bytes(a, tokens: int = 1) -> float:
    """One MoE layer's weights for ``tokens`` tokens: the router's gate, the shared experts, the routed union."""
    d, i = a.hidden_size, a.moe_intermediate_size
    slot = _wbytes(a, "w13", 1, 2 * i, d) + _wbytes(a, "w2", 1, d, i)
    return (routed_union(a, tokens) + a.n_shared_experts) * slot + a.n_routed_experts * d * 2


def _dense_bytes(a) -> int:
    return _wbytes(a, "w13", 1, 2 * a.intermediate_size, a.hidden_size) + _wbytes(
        a, "w2", 1, a.hidden_size, a.intermediate_size
    )


def bytes_per_token(args, ctx: int, sparse: bool, tokens: int = 1) -> dict:
    """Bytes one decode step reads (weights actually touched + KV rows), counted from the engine's args (rank-local
    args: that rank's share, its ``V / tp`` rows of ``lm_head``). Per layer: attention (the indexer's weights in
    layers that run their own), then the router and the top-k + shared experts of a MoE layer or the dense MLP;
    the MTP layer is not read by a plain step. ``tokens`` > 1: a step over that many tokens at once (a verify), whose
    MoE layers read the union of the experts its tokens route to (:func:`routed_union`)."""
    a, el = args, 2
    d = a.hidden_size
    index_layers = set(a.index_layers)
    weights = sum(
        _attn_bytes(a, j in index_layers, sparse)
        + (_moe_bytes(a, tokens) if a.mlp_layer_types[j] == "sparse" else _dense_bytes(a))
        for j in range(a.num_layers)
    )
    head = d * el + (a.vocab_size // a.tp_size) * d * el  # the embedding row and this rank's lm_head rows
    row = a.latent_dim * el
    if sparse:
        kv = a.num_layers * min(ctx, a.index_topk) * row + len(index_layers) * ctx * a.index_head_dim * el
    else:
        kv = a.num_layers * ctx * row
    return dict(weights=weights, head=head, kv=kv, total=weights + head + kv)


def spec_bytes_per_step(
    args, ctx: int, sparse: bool, drafts: int, caught_up: int, fp8_head: bool = False, head_rows: int | None = None
) -> dict:
    """Bytes of one speculative step (``speculative_greedy_step``): the MTP layer over the ``caught_up`` rows the
    previous step accepted (1 when it accepted no draft, ``drafts`` + 1 when it accepted all), then ``drafts`` - 1
    more MTP steps of one row, each draft reading ``lm_head``, and the main model's verify of ``drafts`` + 1 tokens
    (:func:`bytes_per_token` over that many). ``ratio``: over the plain step's bytes; ``ceiling_speedup``: the
    tokens a step yields when every draft is accepted over that ratio, the speedup over MTP off at equal bandwidth.
    ``fp8_head``: the drafts read a block-FP8 copy of the head (``--draft-head fp8``); ``head_rows``: only that many
    of its rows (``--draft-vocab``)."""
    a, el = args, 2
    d = a.hidden_size
    rows = head_rows or a.vocab_size // a.tp_size
    head = rows * d * (1 if fp8_head else el) + (d * el if a.mtp_own_embed else 0)
    mlp = (lambda t: _moe_bytes(a, t)) if a.mtp_moe else (lambda t: _dense_bytes(a))
    layer = lambda t: 2 * d * 2 * d + _attn_bytes(a, a.mtp_indexer, sparse) + mlp(t)  # noqa: E731 (eh_proj stays bf16)
    mtp_kv = ctx * a.latent_dim * el
    mtp = layer(caught_up) + head + mtp_kv + (drafts - 1) * (layer(1) + head + mtp_kv)
    verify = bytes_per_token(a, ctx, sparse, tokens=drafts + 1)["total"]
    plain = bytes_per_token(a, ctx, sparse)["total"]
    total = mtp + verify
    return dict(
        mtp=mtp,
        verify=verify,
        total=total,
        plain=plain,
        ratio=total / plain,
        ceiling_speedup=(drafts + 1) * plain / total,
    )


def category_bytes(args, ctx: int, sparse: bool) -> dict:
    """Bytes one step reads per breakdown category (``CATEGORIES``' labels; the weights as
    :func:`bytes_per_token` counts them): the achieved bandwidth of each category is these over its kernel time."""
    a, el = args, 2
    d, h = a.hidden_size, a.num_heads
    index_layers = set(a.index_layers)
    i = a.moe_intermediate_size
    out = dict.fromkeys([c for _, c in CATEGORIES], 0)
    gemv, up, down, route, core, idx = (
        "GEMVs (W_a, W_b, W_o, router, lm_head)",
        "moe up (norm + w13 + silu*up)",
        "moe down (+residual)",
        "router select",
        "attention core",
        "indexer scores",
    )
    rows = min(ctx, a.index_topk) if sparse else ctx
    for j in range(a.num_layers):
        has_idx = j in index_layers
        out[gemv] += _projection_bytes(a, has_idx, sparse) + _wbytes(a, "wo", d, h * a.v_head_dim)
        out[core] += _wbytes(a, "wkv_b", h * a.v_head_dim, a.kv_lora_rank)  # W_UV: in the combine kernel
        out["mla prep"] += _wbytes(a, "wkv_b", h * a.qk_nope_head_dim, a.kv_lora_rank)
        out[core] += rows * a.latent_dim * el
        if has_idx and sparse:
            out[idx] += ctx * a.index_head_dim * el
        if a.mlp_layer_types[j] == "sparse":
            k = a.num_experts_per_tok + a.n_shared_experts
            out[up] += k * _wbytes(a, "w13", 1, 2 * i, d)
            out[down] += k * _wbytes(a, "w2", 1, d, i)
            out[route] += a.n_routed_experts * d * el
        else:
            out[up] += _wbytes(a, "w13", 1, 2 * a.intermediate_size, d)
            out[down] += _wbytes(a, "w2", 1, d, a.intermediate_size)
    out[gemv] += (a.vocab_size // a.tp_size) * d * el
    return {k: v for k, v in out.items() if v}


def step_row(name: str, args, ctx: int, sparse: bool, seconds: float, bw: float | None) -> dict:
    """One JSON row of the table: ``config``, ``context``, ``weights`` (bf16 / fp8), ``ms_per_step``, ``tok_s``,
    ``bytes_per_step`` and ``pct_roofline`` (the step's bytes at the copy bandwidth ``bw`` measured in the same run,
    over the step's time; ``None`` without a bandwidth), plus the earlier names of these fields."""
    b = bytes_per_token(args, ctx, sparse)
    roof = bw / b["total"] if bw else None  # roofline: the measured copy bandwidth (2 x bytes / time) over bytes
    pct = 100 / seconds / roof if roof else None
    return dict(
        config=name,
        context=ctx,
        weights="fp8" if args.fp8 else "bf16",
        ms_per_step=seconds * 1e3,
        tok_s=1 / seconds,
        bytes_per_step=b["total"],
        pct_roofline=pct,
        tp=args.tp_size,
        ctx=ctx,
        sparse=sparse,
        ms=seconds * 1e3,
        bytes_gb=b["total"] / 1e9,
        bytes=b,
        roof_tok_s=roof,
        pct_roof=pct,
        achieved_tbs=b["total"] / seconds / 1e12,
    )


def wall_per_call(fn, iters=30, reps=3) -> float:
    """Median wall seconds per ``fn()`` call (each call ends in a host sync, as in the decode loop)."""
    fn()
    ts = []
    for _ in range(reps):
        t1 = time.perf_counter()
        for _ in range(iters):
            fn()
        ts.append((time.perf_counter() - t1) / iters)
    return sorted(ts)[len(ts) // 2]


MTP_STREAM_STEPS = 24  # speculative_stream's steps timed, every draft taken (K + 1 positions each)
MTP_ROOM = 16 + MTP_STREAM_STEPS * 4 + 8  # positions past the last context an engine with MTP timed holds


def bench_mtp(name, eng, ctx, plain_graph_s) -> dict:
    """Speculative steps of the engine (``speculative_greedy_step``: MTP catch-up of 1 row + K chained drafts +
    verify of K+1 tokens + argmax, one CUDA graph, one host read) at ``ctx``: graph replay time, the whole
    call's wall time, and the tok/s it gives at mean accepted lengths 1.0..4.0 (tokens per step, bonus
    token included; at most K+1) next to the plain step's; and, every draft taken, ``speculative_stream``'s
    wall time a step against the same steps called one by one."""
    tok = torch.tensor([77], device=DEV)
    plain_wall = wall_per_call(lambda: int(eng.forward(tok, ctx)[-1].argmax()))
    n_stream = 64
    stream_wall = wall_per_call(lambda: sum(1 for _ in eng.greedy_stream(77, ctx, n_stream)), iters=3) / n_stream
    out = dict(
        ctx=ctx,
        plain_graph_ms=plain_graph_s * 1e3,
        plain_wall_ms=plain_wall * 1e3,
        stream_wall_ms=stream_wall * 1e3,
        steps={},
    )
    log(
        f"[{name}] ctx={ctx} plain step: graph {plain_graph_s * 1e3:.3f} ms, forward()+argmax call "
        f"{plain_wall * 1e3:.3f} ms, pipelined greedy_stream {stream_wall * 1e3:.3f} ms/token"
    )

    def spec_call(K):
        # The steady state after a step that accepted nothing: sequence of ctx tokens, MTP rows < ctx-1 done,
        # h_{ctx-1} recorded; the step catches up MTP row ctx-1, drafts K, verifies K+1.
        st = eng._seqs[0]
        st.len, st.mtp_upto = ctx, ctx - 1
        return eng.speculative_greedy_step(77, ctx, K)

    def stream_step(K, ahead=True):
        # every draft taken, from the steady state (hidden states and MTP rows below ctx held): speculative_stream,
        # whose steps run from the device's state, the next launched before one is read (ahead), or the same
        # steps called one by one (speculative_greedy_step: its catch-up then K + 1 rows as well)
        st = eng._seqs[0]
        st.len, st.mtp_upto, st.hid_lo = ctx, ctx - 1, 0
        stream = eng.speculative_stream(77, ctx, K, accept_all=True) if ahead else None
        tok_, pos = 77, ctx
        t1 = time.perf_counter()
        for _ in range(MTP_STREAM_STEPS):
            res = next(stream) if stream else eng.speculative_greedy_step(tok_, pos, K, accept_all=True)
            tok_, pos = res.tokens[-1], pos + len(res.tokens)
        t = (time.perf_counter() - t1) / MTP_STREAM_STEPS
        if stream:
            stream.close()
        torch.cuda.synchronize()
        return t

    eng.forward(tok, ctx - 1)  # records h_{ctx-1}
    for K in (1, 2, 3):
        spec_call(K)
        sparse = ctx + K + 1 > eng.model.args.index_topk
        step = eng._spec_graphs.get((K, 1, sparse))
        assert step is not None, "the speculative step fell back to eager"
        tg = time_graph(step, iters=10, reps=3)
        tw = wall_per_call(lambda K=K: spec_call(K))
        rates = {a: a / tw for a in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0) if a <= K + 1}
        full = spec_bytes_per_step(eng.model.args, ctx, sparse, K, K + 1)  # after a step that accepted every draft
        stream_step(K)  # captures its graph
        stream_step(K, ahead=False)
        ts = sorted(stream_step(K) for _ in range(3))[1]
        t1s = sorted(stream_step(K, ahead=False) for _ in range(3))[1]
        eng.forward(tok, ctx - 1)  # the steady state spec_call assumes again
        out["steps"][K] = dict(
            graph_ms=tg * 1e3,
            wall_ms=tw * 1e3,
            ratio_to_plain=tg / plain_graph_s,
            tok_s_at_accepted_len=rates,
            bytes_ratio_to_plain=full["ratio"],
            ceiling_speedup_all_accepted=full["ceiling_speedup"],
            stream_all_accepted_ms=ts * 1e3,
            stream_all_accepted_tok_s=(K + 1) / ts,
            one_by_one_all_accepted_ms=t1s * 1e3,
        )
        log(
            f"[{name}] ctx={ctx} MTP K={K}: draft+verify graph {tg * 1e3:.3f} ms ({tg / plain_graph_s:.2f}x plain; "
            f"{full['ratio']:.2f}x its bytes, every draft accepted: at most {full['ceiling_speedup']:.2f}x MTP off), "
            f"call {tw * 1e3:.3f} ms; tok/s at accepted length "
            + ", ".join(f"{a}: {r:.0f}" for a, r in rates.items())
            + f"; every draft taken: speculative_stream {ts * 1e3:.3f} ms a step ({(K + 1) / ts:.0f} tok/s), the "
            f"steps one by one {t1s * 1e3:.3f} ms"
        )
    # K = 3 again with other draft heads (--draft-head fp8, --draft-vocab of the first DRAFT_VOCAB ids), every
    # draft taken
    K, a = 3, eng.model.args
    out["draft_heads"] = {}
    for label, head, rows in DRAFT_VARIANTS:
        rows = min(rows, a.vocab_size) if rows else None
        eng.use_draft_head(head, range(rows) if rows else None)
        try:
            stream_step(K)  # captures its graph
            ts = sorted(stream_step(K) for _ in range(3))[1]
            full = spec_bytes_per_step(a, ctx, ctx + K + 1 > a.index_topk, K, K + 1, head == "fp8", rows)
        finally:
            eng.use_draft_head()
            eng.forward(tok, ctx - 1)
        out["draft_heads"][label] = dict(
            K=K,
            stream_all_accepted_ms=ts * 1e3,
            stream_all_accepted_tok_s=(K + 1) / ts,
            bytes_ratio_to_plain=full["ratio"],
            ceiling_speedup_all_accepted=full["ceiling_speedup"],
        )
        log(
            f"[{name}] ctx={ctx} MTP K={K}, drafts from {label}: speculative_stream {ts * 1e3:.3f} ms a step "
            f"({(K + 1) / ts:.0f} tok/s; {full['ratio']:.2f}x the plain step's bytes, at most "
            f"{full['ceiling_speedup']:.2f}x MTP off), against {out['steps'][K]['stream_all_accepted_ms']:.3f} ms "
            "with the model's head"
        )
    return out


DRAFT_VOCAB = 32768  # token ids of the --draft-vocab rows timed
# (label, --draft-head, rows of --draft-vocab or None) timed after the model's head
DRAFT_VARIANTS = (
    ("a block-FP8 head", "fp8", None),
    (f"a block-FP8 head of {DRAFT_VOCAB} tokens", "fp8", DRAFT_VOCAB),
)


# The DSA path (a context past index_topk only): the indexer's rows and warps per program, the top-k's passes'
# scores and warps per program.
DSA_TUNING = (
    ("triton_mla", "INDEXER_BT", (128, 64, 256)),
    ("triton_mla", "INDEXER_WARPS", (4, 8)),
    ("triton_topk", "CH", (256, 512, 1024)),
    ("triton_topk", "WARPS", (8, 4)),
)
# Weights brought into L2 while latency-bound kernels run (ops/triton_prefetch.py): which sites, as whole plans,
# with the experts' loads marked evict-first or not (MOE_EVICT_FIRST).
_EVERY_SITE = ("wo", "gate", "shared", "wa_next")  # triton_prefetch.ALL_SITES (no Triton here)
L2_TUNING = (
    (
        "triton_prefetch",
        ["SITES", "MOE_EVICT_FIRST"],
        (
            ((), False),
            (("wo",), False),
            (("wo", "gate"), False),
            (("wo", "gate", "shared"), False),
            (_EVERY_SITE, False),
            (_EVERY_SITE, True),
            (("wo", "gate", "shared"), True),
            (("wa_next",), True),
        ),
    ),
    (  # the requests' size, every site on
        "triton_prefetch",
        ["SITES", "CHUNK"],
        tuple((_EVERY_SITE, c) for c in (4096, 16384, 1024)),
    ),
)
# Fewer, fuller splits of the dense attention at short contexts (its rows per split and its cap, together).
DENSE_SPLIT_TUNING = (
    ("triton_mla", ["DENSE_MIN_TOKENS_PER_SPLIT", ("DENSE_CAP_ROWS", "one")], ((32, 32), (64, 64), (128, 128))),
)
# The FP8 GEMVs and moe_up fed by the TMA (triton_fp8.FP8_TMA_CFG, FP8_UP_TMA_CFG: rows, K tile, stages, warps;
# None the register-fed kernel), one weight class at a time, then every GEMV class at once (the rank's W_a is
# "k1024", W_o "k2048", its lm_head slice "large"; lite's W_a / W_o "k2048", W_b "small" / "mid", its lm_head "head").
_TMA_CLASSES = ("k1024", "k2048", "mid", "small", "large", "head")  # triton_fp8.FP8_GEMV_CFG's keys (no Triton here)
TMA_TUNING = (
    (
        "triton_fp8",
        ("FP8_TMA_CFG", "k1024"),
        (None, (8, 512, 4, 4), (8, 512, 8, 4), (8, 1024, 6, 4), (16, 256, 8, 4), (4, 1024, 8, 4), (16, 512, 6, 8)),
    ),
    ("triton_fp8", ("FP8_TMA_CFG", "k2048"), (None, (8, 512, 4, 4), (8, 512, 8, 4), (16, 512, 4, 8), (4, 1024, 6, 4))),
    ("triton_fp8", ("FP8_TMA_CFG", "mid"), (None, (8, 512, 4, 4), (16, 512, 4, 8))),
    ("triton_fp8", ("FP8_TMA_CFG", "small"), (None, (8, 512, 4, 4), (4, 1024, 4, 4))),
    ("triton_fp8", ("FP8_TMA_CFG", "large"), (None, (8, 1024, 4, 4), (16, 512, 6, 8))),
    ("triton_fp8", ("FP8_TMA_CFG", "head"), (None, (16, 512, 4, 8), (32, 256, 6, 8))),
    (  # moe_up (rows, K tile, stages, warps): the rank's experts are "narrow", lite's "small"
        "triton_fp8",
        ("FP8_UP_TMA_CFG", "narrow"),
        (None, (8, 512, 4, 4), (8, 512, 8, 4), (8, 1024, 3, 8), (16, 256, 6, 4), (16, 512, 4, 8)),
    ),
    ("triton_fp8", ("FP8_UP_TMA_CFG", "small"), (None, (16, 256, 4, 4), (8, 512, 4, 4), (16, 512, 3, 8))),
    ("triton_fp8", ("FP8_UP_TMA_CFG", "large"), (None, (8, 512, 4, 4), (8, 1024, 3, 8), (16, 512, 4, 8))),
    (
        "triton_fp8",
        [("FP8_TMA_CFG", k) for k in _TMA_CLASSES],
        (
            (None,) * len(_TMA_CLASSES),
            ((8, 512, 8, 4), (8, 512, 4, 4), (8, 512, 4, 4), (8, 512, 4, 4), (8, 1024, 4, 4), (16, 512, 4, 8)),
        ),
    ),
)
# bf16 weights fed by the TMA (triton_gemv.TMA_CFG, triton_fp8.BF16_UP_TMA_CFG: rows, K tile, stages, warps; None
# the register-fed kernel, whose num_stages pipelines nothing): lite's W_a / W_o are "k1024", W_b "small", its
# lm_head "head", its experts "small" (layer-v32's "large").
BF16_TMA_TUNING = (
    (
        "triton_gemv",
        ("TMA_CFG", "k1024"),
        (None, (4, 512, 4, 4), (8, 256, 6, 4), (4, 1024, 4, 8), (8, 512, 4, 8), (2, 1024, 6, 4)),
    ),
    ("triton_gemv", ("TMA_CFG", "small"), (None, (4, 512, 4, 4), (8, 256, 6, 4), (8, 512, 3, 8))),
    ("triton_gemv", ("TMA_CFG", "mid"), (None, (8, 256, 4, 4), (16, 256, 4, 8))),
    ("triton_gemv", ("TMA_CFG", "large"), (None, (8, 512, 4, 8), (16, 256, 4, 8))),
    ("triton_gemv", ("TMA_CFG", "head"), (None, (16, 256, 4, 8), (8, 512, 4, 8), (32, 128, 6, 8))),
    (
        "triton_fp8",
        ("BF16_UP_TMA_CFG", "small"),
        (None, (8, 256, 4, 4), (8, 512, 4, 8), (16, 256, 6, 8), (4, 512, 6, 4)),
    ),
    ("triton_fp8", ("BF16_UP_TMA_CFG", "large"), (None, (8, 256, 4, 4), (8, 512, 4, 8), (4, 512, 6, 4))),
)
TUNING = (  # (module, attribute, values): variants re-timed in the whole captured step (first context)
    ("triton_mla", "DENSE_MIN_TOKENS_PER_SPLIT", (32, 64, 16)),
    ("triton_mla", "SPLIT_ROWS_EARLY", (True, False)),
    ("triton_mla", "SKIP_EMPTY_SPLITS", (True, False)),
    ("triton_mla", "UV_ONE_READ_MAX", (64, 0)),
    ("triton_mla", "SPLITS_BY_MAX_ROWS", (False, True)),
    (
        "triton_fp8",
        ("BF16_UP_CFG", "small"),
        ((8, 512, 4, 1), (16, 256, 4, 1), (8, 1024, 4, 1), (4, 1024, 4, 1), (16, 512, 8, 1), (8, 256, 4, 1)),
    ),
    (
        "triton_fp8",
        ("BF16_DOWN_CFG", "small"),
        (
            (8, 1, 512, 4, True),
            (16, 1, 512, 4, True),
            (32, 1, 512, 8, True),
            (16, 1, 256, 4, True),
            (8, 2, 512, 8, True),
            (8, 1, 1024, 4, True),
            (4, 1, 1024, 4, True),
            (8, 1, 2048, 8, True),
        ),
    ),
    ("triton_fp8", ("BF16_UP_CFG", "large"), ((8, 512, 4, 1), (8, 1024, 4, 1), (4, 1024, 4, 1), (16, 512, 8, 1))),
    (
        "triton_fp8",
        ("BF16_DOWN_CFG", "large"),
        ((16, 1, 1024, 8, True), (8, 1, 1024, 4, True), (16, 1, 512, 4, True), (32, 1, 512, 8, True)),
    ),
    (
        "triton_gemv",
        "SMALL_K1024_CFG",
        ((2, 1024, 4, 3), (1, 2048, 4, 3), (4, 1024, 4, 3), (2, 2048, 8, 2), (1, 1024, 4, 4)),
    ),
    ("triton_gemv", "MID_CFG", ((8, 512, 4, 3), (4, 512, 4, 3), (2, 512, 4, 4), (16, 512, 8, 3))),
    ("triton_gemv", "HEAD_CFG", ((16, 256, 4, 4), (8, 512, 4, 3), (16, 512, 8, 3), (32, 256, 8, 4))),
    *BF16_TMA_TUNING,
    *DSA_TUNING,
    *L2_TUNING,
    *DENSE_SPLIT_TUNING,
)
# FP8 weights (ops/triton_fp8.py): (module, attribute or (dict attribute, key), values), the first the default.
# GEMV / moe_up (rows, K tile, warps); moe_down (rows, slots, I tile, warps).
TUNING_FP8 = (
    ("triton_fp8", ("FP8_GEMV_CFG", "k2048"), ((4, 2048, 8), (4, 1024, 4), (2, 2048, 4), (2, 1024, 4))),
    ("triton_fp8", ("FP8_GEMV_CFG", "mid"), ((8, 512, 4), (8, 512, 8), (16, 512, 8), (4, 1024, 4), (4, 512, 4))),
    ("triton_fp8", "FP8_PRE_BYTES", (96, 0, 128)),
    *TMA_TUNING,
    ("triton_fp8", "UP_RSTD_EARLY", (True, False)),
    ("triton_gemv", "RSTD_MAX", (2048, 4096, 8192, 0)),
    (  # W_a at V3.2 / GLM-5 dims (K 7168 / 6144); (2, 2048, 8) and (1, 2048, 4) request all of K before the PDL wait
        "triton_fp8",
        ("FP8_GEMV_CFG", "k1024"),
        ((4, 4096, 8), (2, 2048, 4), (8, 4096, 8), (4, 4096, 4), (2, 4096, 4), (4, 2048, 8), (1, 2048, 4)),
    ),
    ("triton_fp8", ("FP8_GEMV_CFG", "large"), ((8, 1024, 4), (16, 1024, 8))),
    ("triton_fp8", ("FP8_UP_CFG", "small"), ((16, 256, 4, 1), (16, 256, 4, 2), (8, 1024, 4, 1))),
    ("triton_fp8", ("FP8_UP_CFG", "large"), ((8, 1024, 4, 1), (8, 512, 4, 2), (8, 512, 4, 1), (4, 1024, 4, 1))),
    ("triton_fp8", ("FP8_DOWN_CFG", "small"), ((16, 1, 512, 4, True), (32, 1, 512, 8, True), (4, 4, 512, 8, False))),
    ("triton_fp8", ("FP8_DOWN_CFG", "large"), ((16, 1, 1024, 8, True), (8, 1, 1024, 4, True), (8, 1, 1024, 8, False))),
    (
        "triton_fp8",
        ("FP8_UP_CFG", "narrow"),
        ((8, 1024, 4, 1), (16, 512, 4, 7), (8, 1024, 4, 2), (16, 1024, 8, 4), (8, 512, 4, 1), (4, 1024, 4, 1)),
    ),
    (
        "triton_fp8",
        ("FP8_DOWN_CFG", "narrow"),
        (
            (16, 1, 1024, 8, True),
            (64, 1, 256, 8, True),
            (32, 1, 256, 4, True),
            (128, 1, 256, 8, True),
            (32, 2, 256, 4, True),
        ),
    ),
    ("triton_moe", "ROUTER_SPLIT", (8, 4, 14, 16)),
    ("triton_gemv", "LARGE_CFG", ((8, 512, 4, 3), (16, 256, 4, 4), (16, 512, 8, 3))),
    ("triton_fused", "PREP_BC_FP8", (128, 64)),
    ("triton_mla", "SPLIT_ROWS_EARLY", (True, False)),
    ("triton_mla", "SKIP_EMPTY_SPLITS", (True, False)),
    ("triton_mla", "UV_ONE_READ_MAX", (64, 0)),
    ("triton_mla", "SPLITS_BY_MAX_ROWS", (False, True)),
    ("triton_mla", "UV_TAIL", (True, False)),
    ("triton_mla", "UV_LIVE_LOOP", (True, False)),
    ("triton_mla", ("UV_BV", "few"), (16, 8, 32)),
    ("triton_mla", ("UV_BV", "many"), (64, 32)),
    ("triton_mla", "UV_SB", (4, 8, 16)),
    ("triton_mla", "UV_STAGES", (1, 2, 3)),
    ("triton_mla", "UV_LIVE_ONE_READ", (32, 0, 64)),
    ("triton_mla", "UV_LIVE_EARLY", (True, False)),
    ("triton_mla", ("UV_SLICE_L", "dense"), (0, 32, 64, 16)),
    ("triton_mla", ("UV_SLICE_L", "sparse"), (0, 32, 64)),
    ("triton_mla", ("DENSE_CAP_ROWS", "one"), (32, 16, 32, 16)),
    ("triton_mla", ("DENSE_CAP_ROWS", "many"), (64, 32)),
    ("triton_moe", "ROUTER_WARPS", (0, 1, 8)),
    *DSA_TUNING,
    *L2_TUNING,
    *DENSE_SPLIT_TUNING,
)


def step_timer(eng, ctx):
    """A function that recaptures the engine's one-token step at ``ctx`` (the ops as they are then) and times it, ms."""
    tok = torch.tensor([77], device=DEV)
    sparse = ctx + 1 > eng.model.args.index_topk

    def timed() -> float:
        eng._graphs.clear()
        eng.forward(tok, ctx)
        return time_graph(eng._graphs[(1, sparse)]) * 1e3

    return timed


def tune_in_situ(name, eng, ctx) -> list:
    """Each TUNING variant (one at a time, the others at their defaults): recapture the engine's step and
    time it, with the default re-timed around the variants (drift check)."""
    timed = step_timer(eng, ctx)
    table = TUNING_FP8 if eng.model.args.fp8 else TUNING
    if TUNE_ONLY:  # --tune-only: the rows whose attribute, dict or dict key is named
        table = tuple(r for r in table if _row_names(r[1]) & set(TUNE_ONLY))
    return tune_variants(f"[{name}] ctx={ctx}", timed, table, log)


# (what, [(module, function, index of the argument that names the call), ...]): kernel classes left out of the step
ABLATIONS = (
    ("the FP8 GEMVs (W_a, W_b, W_o)", [("triton_fp8", "gemv_fp8", 1)]),
    ("the router (gate GEMV + selection)", [("triton_moe", "router", 1)]),
    ("mla_prep", [("triton_fused", "mla_prep", 3)]),
    ("the attention core (+ W_uv)", [("triton_mla", "mla_decode", 1)]),
    ("the DSA top-k", [("triton_mla", "indexer_topk", 2)]),
    ("the experts (moe_up + moe_down)", [("triton_fp8", "moe_up_fp8", 2), ("triton_fp8", "moe_down_fp8", 3)]),
)


def ablate_in_situ(name, eng, ctx) -> list:
    """The step recaptured with each kernel class of :data:`ABLATIONS` left out: every call of its functions
    returns what the same call (the same weight or cache) returned in an eager step before, launching nothing. What
    the step loses is that class's cost in the step, overlap included. Timing only: the outputs are stale."""
    import importlib

    timed = step_timer(eng, ctx)
    tok, positions = torch.tensor([77], device=DEV), torch.tensor([ctx], device=DEV)
    sparse = ctx + 1 > eng.model.args.index_topk
    base = timed()
    rows = [dict(without=None, ms=base)]
    for what, fns in ABLATIONS:
        saved, memo = [], {}
        for mod_name, fn_name, key_arg in fns:
            mod = importlib.import_module(f"tilert.engines.tilert.ops.{mod_name}")
            real = getattr(mod, fn_name)

            def left_out(*a, real=real, fn_name=fn_name, key_arg=key_arg, memo=memo, **kw):
                t = a[key_arg]
                key = (fn_name, t.data_ptr(), tuple(t.shape))
                if key not in memo:
                    memo[key] = real(*a, **kw)
                return memo[key]

            saved.append((mod, fn_name, real))
            setattr(mod, fn_name, left_out)
        try:
            eng.model.logits(eng.model(tok, positions, sparse))  # records every call's output, eagerly
            ms = timed() if memo else float("nan")  # nan: the step has no such kernel
        finally:
            for mod, fn_name, real in saved:
                setattr(mod, fn_name, real)
        rows.append(dict(without=what, ms=ms))
        log(f"[{name}] ctx={ctx} without {what}: {ms:.4f} ms ({base - ms:+.4f} ms)")
    again = timed()
    rows.append(dict(without="nothing, again", ms=again))
    log(f"[{name}] ctx={ctx} the whole step again: {again:.4f} ms")
    return rows


def _row_names(attr) -> set[str]:
    """What names a tuning row (``--tune-only``): its attribute, or its dict and key; its first knob's."""
    if isinstance(attr, list):
        return _row_names(attr[0])
    return set(attr) if isinstance(attr, tuple) else {attr}


def _knob(mod, attr):
    """(get, put) of one knob of ``mod``: an attribute, or ``(dict attribute, key)`` an entry of one."""
    if isinstance(attr, tuple):
        table_, key = getattr(mod, attr[0]), attr[1]
        return (lambda: table_[key]), (lambda v: table_.__setitem__(key, v))
    return (lambda: getattr(mod, attr)), (lambda v: setattr(mod, attr, v))


def tune_variants(tag: str, timed, table, say) -> list:
    """``timed()`` (ms of the recaptured step) under each variant of ``table`` (rows ``(module, attribute or
    (dict attribute, key), values)`` of ``tilert.engines.tilert.ops``; or ``(module, [knob, ...], values)`` whose
    values set every knob at once, a tuple each), one at a time, the others at their defaults, then the defaults
    again (drift check). Used by this script and ``tp_decode.py`` (every rank runs it in lockstep)."""
    import importlib

    rows = []
    for mod_name, attr, values in table:
        mod = importlib.import_module(f"tilert.engines.tilert.ops.{mod_name}")
        several = isinstance(attr, list)
        knobs = [_knob(mod, a) for a in (attr if several else [attr])]

        def get(knobs=knobs, several=several):
            got = tuple(g() for g, _ in knobs)
            return got if several else got[0]

        def put(v, knobs=knobs, several=several):
            for (_, p), x in zip(knobs, v if several else (v,), strict=True):
                p(x)

        default = get()
        for v in values:
            put(v)
            try:
                ms = timed()
            except Exception as exc:  # a variant that does not compile / fit
                ms = float("nan")
                say(f"   {attr}={v}: failed {exc!r}"[:200])
            finally:
                put(default)
            rows.append(dict(attr=str(attr), value=v, ms=ms, default=v == default))
            say(f"{tag} tuning {attr}={v}: {ms:.4f} ms{' (default)' if v == default else ''}")
    base = timed()
    rows.append(dict(attr="default again", value=None, ms=base, default=True))
    say(f"{tag} tuning: defaults again {base:.4f} ms")
    return rows


@torch.no_grad()
def bench_engine(name, args, contexts, bw, mtp=True, profile=True, topk_compare=True, tune=False, ablate=False):
    """The engine: random weights on the GPU, caches of random rows, its own CUDA-graph decode step."""
    from dataclasses import replace

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.ops import register_device_kernels, triton_mla
    from tilert.engines.tilert.weights import random_model

    register_device_kernels()
    if mtp and not args.num_mtp_layers:
        args = replace(args, num_mtp_layers=1)  # DeepSeek-V3.2's one MTP module (not read by the plain step)
    max_seq = max(contexts) + (MTP_ROOM if mtp else 16)
    t0 = time.time()
    model = random_model(args, device=DEV, dtype=torch.bfloat16, max_seq_len=max_seq, seed=0)
    model.kv_cache.normal_()
    model.index_cache.normal_()
    model.mtp_kv_cache.normal_()
    eng = TileRTEngine(model, DEV, torch.bfloat16, max_seq)
    torch.cuda.synchronize()
    log(f"[{name}] built in {time.time() - t0:.1f}s, {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    rows, verify = [], {}
    for ctx in contexts:
        sparse = ctx + 1 > args.index_topk
        tok = torch.tensor([77], device=DEV)
        eng.forward(tok, ctx)  # captures the (1, regime) graph through the engine's own path
        step = eng._graphs[(1, sparse)]
        assert step is not None, "the engine fell back to eager"
        t = time_graph(step)
        r = step_row(name, args, ctx, sparse, t, bw)
        r["model"] = "engine (tilert.engines.tilert.model via TileRTEngine CUDA graph)"
        log(
            f"[{name}] ctx={ctx} {'DSA' if sparse else 'dense'}: {t * 1e3:.3f} ms  {1 / t:.1f} tok/s  "
            f"{r['bytes_gb']:.3f} GB/tok  roofline {r['roof_tok_s']:.0f} tok/s  {r['pct_roof']:.1f}%"
        )
        if profile and ctx in (contexts[0], contexts[-1]):
            positions = torch.tensor([ctx], device=DEV)

            def eager(model=model, tok=tok, positions=positions, sparse=sparse):
                model.logits(model(tok, positions, sparse))

            prof = kernel_profile(eager)
            cats: dict = {}
            for k, us, _c2 in prof["top"]:
                cat = next((c for key, c in CATEGORIES if key in k), "other")
                cats[cat] = cats.get(cat, 0.0) + us
            cats["gaps between kernels (graph step - kernel sum)"] = t * 1e6 - prof["total_us"]
            r["kernel_profile"] = prof
            r["breakdown_us"] = cats
            cb = category_bytes(args, ctx, sparse)
            r["breakdown_tbs"] = {k: cb[k] / (us * 1e-6) / 1e12 for k, us in cats.items() if k in cb and us > 0}
            log("   breakdown (us/step, achieved TB/s where the category streams counted bytes): " + _cats(r))
        if sparse and topk_compare:  # the same step with torch.topk instead of the radix top-k, same run
            triton_mla.TOPK_IMPL = "torch"
            eng._graphs.clear()
            eng.forward(tok, ctx)
            r["torch_topk_ms"] = time_graph(eng._graphs[(1, sparse)]) * 1e3
            triton_mla.TOPK_IMPL = "radix"
            eng._graphs.clear()
            eng.forward(tok, ctx)
            log(
                f"[{name}] ctx={ctx} same step with torch.topk: {r['torch_topk_ms']:.3f} ms "
                f"(radix top-k saves {r['torch_topk_ms'] - r['ms']:.3f} ms)"
            )
        if tune and ctx == contexts[0]:
            r["tuning"] = tune_in_situ(name, eng, ctx)
        if ablate:
            r["ablation"] = ablate_in_situ(name, eng, ctx)
        rows.append(r)
        if mtp and ctx == contexts[0]:
            verify = bench_mtp(name, eng, ctx, t)
    del eng, model
    gc.collect()
    torch.cuda.empty_cache()
    return rows, verify


def bench_sequences(name, args, ctx, ns, capacity):
    """Several sequences decoded together (``TileRTEngine.decode_step``): one engine holding ``max(ns)`` sequences
    of ``capacity`` positions (random cache rows), every sequence at context ``ctx``; for each n the step's CUDA
    graph (n rows, one per sequence) replayed back to back, and the wall time of a whole ``decode_step_greedy``
    call (inputs to the GPU, replay, argmax, one host read). Per-user tok/s = 1 / step time; total = n / step."""
    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.engines.tilert.weights import random_model

    register_device_kernels()
    B = max(ns)
    t0 = time.time()
    model = random_model(args, device=DEV, dtype=torch.bfloat16, max_seq_len=capacity, seed=0, max_sequences=B)
    model.kv_cache.normal_()
    model.index_cache.normal_()
    eng = TileRTEngine(model, DEV, torch.bfloat16, capacity)
    torch.cuda.synchronize()
    log(
        f"[{name} x{B} sequences] built in {time.time() - t0:.1f}s, "
        f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated"
    )
    sparse = ctx + 1 > args.index_topk
    out = []
    for n in ns:
        seqs = list(range(n))
        toks, pos = [77 + s for s in seqs], [ctx + s for s in seqs]  # a context of ~ctx each, not all equal
        eng.decode_step(toks, pos, seqs)  # captures the (n, regime) graph through the engine's own path
        step = eng._graphs[(n, sparse)]
        assert step is not None, "the engine fell back to eager"
        t = time_graph(step)
        assert all((p + 1 > args.index_topk) == sparse for p in pos), "keep every row in one attention regime"
        wall = wall_per_call(lambda e=eng, toks=toks, pos=pos, seqs=seqs: e.decode_step_greedy(toks, pos, seqs))
        r = dict(
            config=name,
            ctx=ctx,
            sparse=sparse,
            sequences=n,
            capacity=capacity,
            graph_ms=t * 1e3,
            per_user_tok_s=1 / t,
            total_tok_s=n / t,
            wall_ms=wall * 1e3,
            wall_per_user_tok_s=1 / wall,
            wall_total_tok_s=n / wall,
        )
        out.append(r)
        log(
            f"[{name}] ctx={ctx} {'DSA' if sparse else 'dense'} n={n}: graph {t * 1e3:.3f} ms = {1 / t:.1f} tok/s per "
            f"user, {n / t:.1f} total; decode_step_greedy call {wall * 1e3:.3f} ms = {1 / wall:.1f} per user, "
            f"{n / wall:.1f} total"
        )
    base = out[0]["per_user_tok_s"] if out and out[0]["sequences"] == 1 else None
    for r in out:
        if base:
            r["per_user_vs_one"] = r["per_user_tok_s"] / base
    del eng, model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _cats(r: dict) -> str:
    tbs = r.get("breakdown_tbs", {})
    return ", ".join(
        f"{k}={v:.0f}" + (f" ({tbs[k]:.2f} TB/s)" if k in tbs else "")
        for k, v in sorted(r["breakdown_us"].items(), key=lambda x: -x[1])
    )


def kernel_profile(fn, steps=3):
    """Per-kernel GPU time of one eager step (torch.profiler; durations only, launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    agg: dict = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name.split("(")[0][:60]
        a = agg.setdefault(name, [0.0, 0])
        a[0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        a[1] += 1
    rows = sorted(((k, v[0] / steps, v[1] // steps) for k, v in agg.items()), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    log(f"   kernel time per step (sum of kernel durations) {total / 1e3:.3f} ms, {sum(r[2] for r in rows)} launches:")
    for k, us, cnt in rows[:14]:
        log(f"     {us:9.1f} us  x{cnt:<4} {k}")
    return dict(total_us=total, launches=sum(r[2] for r in rows), top=[(k, us, c) for k, us, c in rows[:20]])


def hf_config(args: ModelArgs):
    """transformers' DeepseekV32Config with the engine config's shapes (for the side-by-side eager run): the fields a
    synthetic checkpoint of these args writes (``engine_configs.hf_overrides``), positions for the longest context."""
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**hf_overrides(args), max_position_embeddings=65536, tie_word_embeddings=False)


@torch.no_grad()
def bench_transformers(name: str, args: ModelArgs, contexts: list[int], steps: int = 5) -> dict:
    """transformers' own eager DeepseekV32ForCausalLM, same shapes, its own random init, bf16: median
    decode-step time after a prefill of ``ctx`` random tokens (measured in the same run as the engine)."""
    from transformers import DeepseekV32ForCausalLM

    hc = hf_config(args)
    hc._attn_implementation = "eager"
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            m = DeepseekV32ForCausalLM(hc).eval()
    finally:
        torch.set_default_dtype(prev)
    torch.cuda.synchronize()
    log(f"[transformers {name}] built in {time.time() - t0:.1f}s")
    out: dict = {}
    for ctx in contexts:
        try:
            o = m(input_ids=torch.randint(0, args.vocab_size, (1, ctx), device=DEV), use_cache=True)
            pkv, nxt = o.past_key_values, o.logits[:, -1:].argmax(-1)
            del o
            ts = []
            for _ in range(steps + 1):
                torch.cuda.synchronize()
                t1 = time.time()
                o = m(input_ids=nxt, past_key_values=pkv, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                ts.append(time.time() - t1)
                del o
            t = sorted(ts[1:])[len(ts[1:]) // 2]
            out[ctx] = dict(ms=t * 1e3, tok_s=1 / t, layers=args.num_layers)
            log(f"[transformers {name}] ctx={ctx}: {t * 1e3:.1f} ms/token ({1 / t:.2f} tok/s)")
            del pkv
        except Exception as exc:  # OOM at long contexts: the eager indexer materialises [S, H, T] scores
            out[ctx] = dict(error=repr(exc)[:200])
            log(f"[transformers {name}] ctx={ctx} failed: {exc!r}"[:300])
        gc.collect()
        torch.cuda.empty_cache()
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _bench_child(job, opts, tune_only):
    TUNE_ONLY[:] = tune_only
    return bench_engine(*job, **opts)


def _isolated(job, opts):
    """``bench_engine(*job, **opts)`` in a fresh process (spawned: CUDA is initialised here already)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_bench_child, job, opts, list(TUNE_ONLY)).result()


def rank_with_experts(name: str, experts: int):
    """Rank ``name`` (``RANK_CONFIGS``) built with ``experts`` routed experts a layer; refuses a count its routing
    cannot use (groups of equal size, enough experts in the kept groups for its top-k)."""
    a = rank_args(name, n_routed_experts=experts)
    if experts % a.n_group or experts // a.n_group * a.topk_group < a.num_experts_per_tok:
        raise SystemExit(
            f"--rank-experts {experts}: {name} routes top-{a.num_experts_per_tok} within {a.topk_group} of "
            f"{a.n_group} groups; a count divisible by {a.n_group} with at least "
            f"{-(-a.num_experts_per_tok // a.topk_group)} a group is needed "
            f"(the model's own: {rank_args(name).n_routed_experts})"
        )
    return a


@torch.no_grad()
def cpu_smoke(out_dir: str, reduce: dict | None = None) -> list:
    """Each rank configuration, reduced (``reduce``, default ``engine_configs.CPU_REDUCE``), built as the GPU run
    builds it (random FP8 weights, random cache rows, ``TileRTEngine``) on the CPU in float32, one step timed at
    each context and one speculative step: writes ``decode_speed_cpu_smoke.json`` rows of the GPU table's fields
    (no roofline: no bandwidth measured)."""
    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.weights import random_model

    cpu = torch.device("cpu")
    rows = []
    for name in RANK_CONFIGS:
        a = rank_args(name, **(CPU_REDUCE if reduce is None else reduce))
        contexts = [64, a.index_topk + 64]
        cap = max(contexts) + 8
        model = random_model(a, device=cpu, dtype=torch.float32, max_seq_len=cap, seed=0)
        model.kv_cache.normal_()
        model.index_cache.normal_()
        eng = TileRTEngine(model, cpu, torch.float32, cap)
        for ctx in contexts:
            t0 = time.perf_counter()
            logits = eng.forward(torch.tensor([77]), ctx)
            t = time.perf_counter() - t0
            assert logits.shape == (1, a.vocab_size // a.tp_size) and bool(logits.isfinite().all())
            rows.append(step_row(name + "-cpu-smoke", a, ctx, ctx + 1 > a.index_topk, t, None))
            log(f"[{name} reduced, CPU] ctx={ctx}: {t * 1e3:.1f} ms, {rows[-1]['bytes_per_step'] / 1e9:.3f} GB/step")
        spec = eng.speculative_greedy_step(77, contexts[-1], 2)  # the MTP layer's rank share runs
        assert 1 <= len(spec.tokens) <= 3
    write_json(os.path.join(out_dir, "decode_speed_cpu_smoke.json"), {"runs": rows}, recorded("cpu"))
    return rows


def bench_name(args: argparse.Namespace) -> str:
    """The benchmark a run of these flags records (the ``<benchmark>`` of its file name)."""
    if args.sequences:
        return "decode-multiseq"
    if args.ablate:
        return "decode-ablation"
    if all(name in RANK_CONFIGS for name in args.configs.split(",")):
        return f"decode-tp8-rank-e{args.rank_experts}" if args.rank_experts else "decode-tp8-rank"
    return "decode-fp8" if "fp8" in args.weights.split(",") else "decode-bf16"


def main():
    if "--tp" in sys.argv[1:]:  # tensor parallel over several GPUs: benchmarks/tp_decode.py
        import tp_decode

        return tp_decode.main(sys.argv[1:])
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out",
        default=None,
        help="a directory (or FILE.json) for the JSON (default: the current result in benchmarks/results/)",
    )
    ap.add_argument("--name", default=None, help="the benchmark's name in the file name (default: from the flags)")
    ap.add_argument("--configs", default="lite-v32,layer-v32")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--tune", action="store_true", help="re-time kernel-config variants in the whole step")
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="at each context, the step again with each kernel class left out (ABLATIONS: what each costs in it)",
    )
    ap.add_argument(
        "--tune-only",
        default="",
        metavar="NAMES",
        help="with --tune: only these rows (attribute, dict or dict key names, comma separated)",
    )
    ap.add_argument("--no-mtp", action="store_true", help="skip lite-v32's MTP speculative-step timings")
    ap.add_argument("--tf-json", default="", help="reuse transformers numbers from an earlier decode_speed.py JSON")
    ap.add_argument(
        "--transformers",
        default="",
        metavar="CTXS",
        help="also time transformers eager at these contexts (comma list), in this run",
    )
    ap.add_argument(
        "--sequences",
        default="",
        metavar="NS",
        help="only the multi-sequence table: decode_step over n = NS sequences (comma list) at each "
        "--contexts, lite-v32 unless --configs says otherwise",
    )
    ap.add_argument("--capacity", type=int, default=32768 + 16, help="positions per sequence (--sequences)")
    ap.add_argument("--weights", default="bf16", help="bf16, fp8 or bf16,fp8 (each config in each, same run)")
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="each (config, weights) engine in a fresh process of its own, one after another (the copy "
        "bandwidth is still measured once, here): no engine is timed in a process an earlier one "
        "built, timed and freed its model in (that can slow the later engine's step)",
    )
    ap.add_argument(
        "--rank-experts",
        type=int,
        default=0,
        help="build each rank configuration with this many routed experts a layer (rows <config>-e<N>): the same "
        "bytes a step but the router's, small enough for an 80 GB GPU (0: the model's own)",
    )
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="no GPU: the rank configurations reduced (engine_configs.CPU_REDUCE) through the same engine "
        "and the same JSON rows on the CPU, at contexts 64 and past the DSA top-k (checks the code, "
        "times nothing worth recording)",
    )
    args = ap.parse_args()
    if args.rank_experts < 0 or (args.rank_experts and not set(args.configs.split(",")) & set(RANK_CONFIGS)):
        ap.error(f"--rank-experts: a positive count, for a rank configuration ({', '.join(RANK_CONFIGS)}) in --configs")
    if args.cpu_smoke:
        return cpu_smoke(args.out or ".")
    TUNE_ONLY[:] = [x for x in args.tune_only.split(",") if x]
    import transformers
    import triton

    contexts = [int(x) for x in args.contexts.split(",")]
    RESULT.update(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        transformers_version=transformers.__version__,
        cuda=torch.version.cuda,
        conditions="batch 1, bf16 activations, weights bf16 or block-FP8 (--weights; rows named "
        "<config>-fp8), random weights built on the GPU, caches filled with random rows, "
        "the engine's CUDA graph replayed, median of 5x30 replays",
    )
    bw = copy_bandwidth()
    RESULT["copy_bw_tbs"] = bw / 1e12
    log(
        f"GPU {RESULT['gpu']}  torch {torch.__version__}  triton {triton.__version__}  "
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)"
    )
    RESULT["runs"] = []
    RESULT["mtp_verify"] = {}
    RESULT["transformers"] = {}
    RESULT["engine_model"] = {}

    machine = machine_kind(gpus=1)
    path = result_path(machine, args.name or bench_name(args), ".json", args.out)
    rec = recorded(machine)

    def save():
        write_json(path, RESULT, rec)

    if args.sequences:
        ns = [int(x) for x in args.sequences.split(",")]
        names = args.configs.split(",") if args.configs != "lite-v32,layer-v32" else ["lite-v32"]
        RESULT["sequences"] = []
        for name in names:
            for ctx in contexts:
                RESULT["sequences"] += bench_sequences(name, CONFIGS[name], ctx, ns, args.capacity)
                save()
        log(
            f"\n=== several sequences per step (decode_step), {RESULT['gpu']}: graph replay per step; "
            "per-user tok/s = 1 / step ==="
        )
        log(
            f"{'config':<10} {'ctx':>6} {'n':>3} {'ms/step':>8} {'tok/s/user':>11} {'total tok/s':>12} "
            f"{'vs n=1':>7} {'call ms':>8} {'call tok/s/user':>16}"
        )
        for r in RESULT["sequences"]:
            log(
                f"{r['config']:<10} {r['ctx']:>6} {r['sequences']:>3} {r['graph_ms']:>8.3f} "
                f"{r['per_user_tok_s']:>11.1f} {r['total_tok_s']:>12.1f} "
                f"{r.get('per_user_vs_one', float('nan')):>7.2f} {r['wall_ms']:>8.3f} "
                f"{r['wall_per_user_tok_s']:>16.1f}"
            )
        save()
        return

    from dataclasses import replace

    for name in args.configs.split(","):
        rank = name in RANK_CONFIGS  # one rank of a full-size model: block-FP8 only, its MTP layer built
        for weights in ["fp8"] if rank else args.weights.split(","):
            label = name if weights == "bf16" or rank else f"{name}-{weights}"
            try:
                if rank and args.rank_experts:
                    margs, label = rank_with_experts(name, args.rank_experts), f"{name}-e{args.rank_experts}"
                else:
                    margs = config_args(name)
                job = (label, replace(margs, fp8=weights == "fp8"), contexts, bw)
                opts = dict(
                    mtp=(rank or name == "lite-v32") and not args.no_mtp,
                    profile=not args.no_breakdown,
                    tune=args.tune,
                    ablate=args.ablate,
                )
                if args.isolate:
                    rows, verify = _isolated(job, opts)
                else:
                    rows, verify = bench_engine(*job, **opts)
                RESULT["runs"] += rows
                if verify:
                    RESULT["mtp_verify"][label] = verify
            except Exception:
                traceback.print_exc()
        if args.transformers and name in ("lite-v32",):
            RESULT["transformers"][name] = bench_transformers(
                name, CONFIGS[name], [int(c) for c in args.transformers.split(",")]
            )
            RESULT["transformers_source"] = "measured in this run"
        save()
        if args.tf_json:
            with open(args.tf_json) as f:
                old = json.load(f)["transformers"]
            RESULT["transformers"].update(
                {k: {int(c): v for c, v in d.items()} for k, d in old.items() if k.startswith(name)}
            )
            RESULT["transformers_source"] = args.tf_json

    # ---------------------------------------------------------------- the table
    log("\n=== batch-1 decode, " + RESULT["gpu"] + f", copy bw {bw / 1e12:.2f} TB/s ===")
    log(
        f"{'config':<10} {'ctx':>6} {'mode':>6} {'ms/tok':>8} {'tok/s':>8} {'GB/tok':>7} {'roof tok/s':>10} "
        f"{'%roof':>6} {'TB/s':>5} {'HF eager tok/s':>15}"
    )
    for r in RESULT["runs"]:
        tf = RESULT["transformers"].get(r["config"], {}).get(r["ctx"], {})
        tf1 = RESULT["transformers"].get(r["config"] + "(1 layer)", {}).get(r["ctx"], {})
        tfs = f"{tf['tok_s']:.2f}" if "tok_s" in tf else (f"1L:{tf1['tok_s']:.2f}" if "tok_s" in tf1 else "-")
        log(
            f"{r['config']:<10} {r['ctx']:>6} {'sparse' if r['sparse'] else 'dense':>6} {r['ms']:>8.3f} "
            f"{r['tok_s']:>8.1f} {r['bytes_gb']:>7.3f} {r['roof_tok_s']:>10.0f} {r['pct_roof']:>6.1f} "
            f"{r['achieved_tbs']:>5.2f} {tfs:>15}"
        )
    for r in RESULT["runs"]:
        if "breakdown_us" in r:
            log(
                f"breakdown {r['config']} ctx={r['ctx']} (kernel us/step, eager; TB/s): "
                + _cats(r)
                + f" | graph step {r['ms'] * 1e3:.0f} us"
            )
    for r in RESULT["runs"]:
        if "tuning" in r:
            best: dict = {}
            variants = [t for t in r["tuning"] if t["attr"] != "default again"]  # a default may be None
            for t in variants:
                timed = t["ms"] == t["ms"]  # not a failure
                if timed and (t["attr"] not in best or t["ms"] < best[t["attr"]]["ms"]):
                    best[t["attr"]] = t
            dflt = {t["attr"]: t["ms"] for t in variants if t["default"]}
            for a, t in best.items():
                was = f"default {dflt[a]:.4f}" if a in dflt else "the default is not among the values"
                log(f"tuning {r['config']} {a}: best {t['value']} {t['ms']:.4f} ms ({was})")
    for r in RESULT["runs"]:
        if "torch_topk_ms" in r:
            log(
                f"DSA top-k {r['config']} ctx={r['ctx']}: radix {r['ms']:.3f} ms/step vs torch.topk "
                f"{r['torch_topk_ms']:.3f} ms/step (same run)"
            )
    for name, res in RESULT["mtp_verify"].items():
        log(
            f"\n=== plain greedy decode loop, {name} ctx={res['ctx']}: graph replay {res['plain_graph_ms']:.3f} ms; "
            f"forward()+argmax per token {res['plain_wall_ms']:.3f} ms = {1e3 / res['plain_wall_ms']:.0f} tok/s; "
            f"pipelined greedy_stream {res['stream_wall_ms']:.3f} ms = {1e3 / res['stream_wall_ms']:.0f} tok/s ==="
        )
        log(f"=== MTP speculative step, {name} ctx={res['ctx']} ===")
        lens = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
        log(
            f"{'K':>2} {'graph ms':>9} {'x plain':>8} {'call ms':>8} {'stream ms':>9} {'stream tok/s':>12} "
            f"{'1by1 ms':>8} " + " ".join(f"{'L=' + str(a):>7}" for a in lens)
        )
        for K, v in res["steps"].items():
            cells = " ".join(
                f"{v['tok_s_at_accepted_len'][a]:>7.0f}" if a in v["tok_s_at_accepted_len"] else f"{'-':>7}"
                for a in lens
            )
            log(
                f"{K:>2} {v['graph_ms']:>9.3f} {v['ratio_to_plain']:>8.2f} {v['wall_ms']:>8.3f} "
                f"{v['stream_all_accepted_ms']:>9.3f} {v['stream_all_accepted_tok_s']:>12.0f} "
                f"{v['one_by_one_all_accepted_ms']:>8.3f} {cells}"
            )
        log(
            "(tok/s = accepted length / call time; accepted length counts the bonus token, at most K+1; stream: "
            "speculative_stream's steps, every draft taken, K+1 tokens a step, the next launched before one is read; "
            "1by1: the same steps called one by one)"
        )
        for label, f8 in res.get("draft_heads", {}).items():
            log(
                f"K={f8['K']}, drafts from {label}: stream {f8['stream_all_accepted_ms']:.3f} ms = "
                f"{f8['stream_all_accepted_tok_s']:.0f} tok/s, every draft taken (byte ceiling "
                f"{f8['ceiling_speedup_all_accepted']:.2f}x MTP off)"
            )
    save()


if __name__ == "__main__":
    main()
