"""Tensor parallel decoding of the TileRT engine over N GPUs of one host: output against one GPU, speed,
communication. One process per GPU (spawned here; no torchrun needed).

    python3 benchmarks/tp_decode.py --tp 2 --out $OUT       (2 H200s: nvidia-h200-x2; ~6 min)
    python3 benchmarks/decode_speed.py --tp 2 --out $OUT    (the same: decode_speed.py hands over to this script)
    python3 benchmarks/tp_decode.py --tp 2 --device cpu     (a dry run of the same code on gloo, tiny dims)
    --sections collectives,lite,real                        (any subset: split a run that would not fit 10 min)

Never sets NCCL_NVLS_ENABLE, TORCH_SYMM_MEM_DISABLE_MULTICAST or NVSHMEM_DISABLE_NVLS: NVLink multicast is what the
machine says (the symmetric-memory all-reduces used here are the one-shot / two-shot ones, not multimem).

Rank 0 writes the JSON: by default the current result ``benchmarks/results/<machine>-tp<N>.json`` (``h200x2-tp2``;
``--device cpu``: ``cpu-tp2``), under ``--out DIR`` (or at ``--out FILE.json``) when given; ``--name`` sets the
benchmark's name; it starts with ``results_header``'s ``"recorded"`` (date, commit, machine, command).

Sections, all in one run (rank 0 prints):

1. **all-reduce / all-gather inside a CUDA graph**: one token's hidden state (bf16 ``[1, 2048]`` and ``[1, 7168]``)
   summed over the ranks by NCCL (``dist.all_reduce``), PyTorch symmetric-memory one-shot and two-shot
   (``torch.ops.symm_mem.one_shot_all_reduce_out`` / ``two_shot_all_reduce_``, through
   ``tilert.engines.tilert.parallel.Group``): 32 back-to-back collectives captured in one graph, us per
   collective; the logits all-gather (fp32 ``[1, V/N]``) the same way.
2. **output, TP vs one GPU** (lite-v32 random weights, bf16, caches of random rows at 1K and 32K context, MTP off
   and on): the one-GPU engine greedy-decodes ``--tokens`` tokens on GPU 0; then every GPU holds its shard of the
   same weights (``sharding.shard_model``) and the same caches, and the TP engine decodes the same tokens through
   the decode node's own leader / follower protocol (``tilert.decode.tp``). Reported: differing tokens (count and
   first index), the first step's logits max |diff| relative to max |logit| (bf16 reductions add in another order).
3. **prompt state to every rank**: the 32K-token prompt state (vLLM's layouts) broadcast over NCCL from the rank
   that received it (``LeaderEngine.inject``), time and equality of the ranks' caches afterwards.
4. **speed**: the engine's captured decode step (one token), per all-reduce kind, plus the same step with the
   collectives removed (wrong numbers, same work): communication time per token = the difference. Stacks: lite-v32
   and the real DeepSeek-V3.2 dims (``--real-layers``: TP at each count; one GPU at ``--one-gpu-layers`` as the
   same-layers comparison). tok/s, % of the N-GPU roofline (bytes each GPU reads per token over the copy bandwidth
   measured in this run; routed experts counted at ``top_k / N`` per GPU), and the one-GPU figure in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
import traceback
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from engine_configs import LAYER_V32, LITE_V32, v32_args  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402

from tilert.engines.tilert import parallel, sharding  # noqa: E402
from tilert.engines.tilert.model import ModelArgs  # noqa: E402

RESULT: dict = {}
KINDS = ("nccl", "symm_one_shot", "symm_two_shot")


def log(*a):
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(*a, flush=True)


class NoComm(parallel.Group):
    """The collectives removed (each rank keeps its own partial): the step's work without its communication."""

    def all_reduce(self, t):
        return t

    def reduce_into(self, h, out):
        if out is not h:
            h.copy_(out)

    def all_gather(self, t):
        return torch.cat([t] * self.size, dim=1)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_replays(replay, dev, iters=30, reps=5, alone=False) -> float:
    """Median seconds per ``replay()`` (every rank runs the same count, so collectives pair up; ``alone``: only
    this rank times, no barrier)."""
    if not alone:
        dist.barrier()
    for _ in range(3):
        replay()
    sync(dev)
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(iters):
                replay()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                replay()
            ts.append((time.perf_counter() - t0) / iters)
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth(dev) -> float:
    if dev.type != "cuda":
        return 10e9
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    a.random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    bw = 2 * n / time_replays(lambda a=a, b=b: b.copy_(a), dev, iters=5, reps=5)
    del a, b
    torch.cuda.empty_cache()
    return bw


def make_group(pg, kind, dev, dtype, hidden):
    if kind == "nocomm":
        return NoComm(pg, device=dev)
    return parallel.Group(pg, allreduce=kind, device=dev, dtype=dtype, max_numel=16 * hidden)


# ------------------------------------------------------------------------------------------------ 1. collectives


def bench_collectives(pg, dev, widths, vocab) -> list:
    """us per all-reduce of a ``[1, w]`` bf16 hidden state, and per logits all-gather, captured in a CUDA graph."""
    size = dist.get_world_size()
    rows = []
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    kinds = KINDS if dev.type == "cuda" else ("nccl",)
    for w in widths:
        for kind in kinds:
            r = dict(op="all_reduce", width=w, kind=kind)
            try:
                g = make_group(pg, kind, dev, dtype, w)
                t = torch.full((1, w), float(dist.get_rank() + 1), dtype=dtype, device=dev)
                g.all_reduce(t)
                want = size * (size + 1) / 2
                ok = bool((t.float() == want).all())
                r["correct"] = ok
                t.fill_(1.0)
                reps = 32
                if dev.type == "cuda":
                    s = torch.cuda.Stream(dev)
                    s.wait_stream(torch.cuda.current_stream(dev))
                    with torch.cuda.stream(s):
                        for _ in range(3):
                            g.all_reduce(t)
                    torch.cuda.current_stream(dev).wait_stream(s)
                    sync(dev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        for _ in range(reps):
                            t.mul_(0.5)  # keep the values finite: each all-reduce multiplies by N
                            g.all_reduce(t)
                    sync(dev)
                    base = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(base):
                        for _ in range(reps):
                            t.mul_(0.5)
                    sec = time_replays(graph.replay, dev) - time_replays(base.replay, dev)
                else:
                    sec = time_replays(lambda g=g, t=t: g.all_reduce(t), dev, iters=20, reps=3) * reps
                r["us"] = sec / reps * 1e6
            except Exception as exc:  # a kind that this machine / torch does not run: recorded, the rest goes on
                r["error"] = repr(exc)[:300]
                dist.barrier()
            rows.append(r)
            log(
                f"[collectives] {kind:>14} all-reduce [1, {w}]: "
                + (f"{r['us']:.2f} us (correct={r['correct']})" if "us" in r else r["error"])
            )
    r = dict(op="all_gather", width=vocab // size, kind="nccl")
    g = make_group(pg, "nccl", dev, dtype, 1)
    x = torch.randn(1, vocab // size, device=dev)
    if dev.type == "cuda":
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            g.all_gather(x)
        torch.cuda.current_stream(dev).wait_stream(s)
        sync(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(32):
                g.all_gather(x)
        r["us"] = time_replays(graph.replay, dev) / 32 * 1e6
    else:
        r["us"] = time_replays(lambda: g.all_gather(x), dev, iters=20, reps=3) * 1e6
    rows.append(r)
    log(f"[collectives] logits all-gather fp32 [1, {vocab // size}] x {size}: {r['us']:.2f} us")
    return rows


# ------------------------------------------------------------------------------------------------ 2. output


def seq_state(eng, ctx):
    """Sequence 0 holds ``ctx`` positions (random cache rows), MTP rows below valid, no hidden state recorded."""
    from tilert.engines.tilert.engine import _Seq

    eng._seqs[0] = _Seq(len=ctx, hid_lo=ctx, mtp_upto=ctx, mtp_lo=0)


CACHES = ("kv_cache", "index_cache", "mtp_kv_cache", "mtp_index_cache")


def decode(eng, ctx, n, mtp, num_draft):
    """``n`` greedy tokens after token 77 at ``ctx`` (plain steps or MTP speculative steps) and the first logits
    (the caller set sequence 0's state: :func:`seq_state`)."""
    first = eng.forward(torch.tensor([77]), ctx)[-1].float().cpu()
    tok, pos, out = int(first.argmax()), ctx + 1, []
    out.append(tok)
    while len(out) < n:
        if mtp:
            toks = eng.speculative_greedy_step(tok, pos, num_draft).tokens
        else:
            toks = [int(eng.forward(torch.tensor([tok]), pos)[-1].argmax())]
        out += toks
        pos += len(toks)
        tok = toks[-1]
    return out[:n], first


def run_tp_protocol(leader_or_none, eng, channel, ctx, n, mtp, num_draft):
    """The TP decode through the decode node's protocol: rank 0 drives a LeaderEngine, the others follow."""
    from tilert.decode.tp import Op, follow

    seq_state(eng, ctx)
    if leader_or_none is None:
        follow(eng, channel)
        return None
    res = decode(leader_or_none, ctx, n, mtp, num_draft)
    leader_or_none.channel.send(Op.STOP)  # the followers leave follow(); the same leader drives the next run
    return res


@torch.no_grad()
def check_output(
    pg, ctrl, dev, args, contexts, n_tokens, num_draft, kind, opts_variant="graphs", check_dtype="bfloat16"
) -> list:
    from tilert.decode.tp import Channel, LeaderEngine
    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.weights import random_model

    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if dev.type == "cuda" and check_dtype == "bfloat16" else torch.float32
    cap = max(contexts) + n_tokens + 32
    args = replace(args, num_mtp_layers=1)
    full = random_model(args, device=dev, dtype=dtype, max_seq_len=cap, seed=0)
    for p in full.parameters():  # the same weights on every rank (whatever the RNG does per device)
        dist.broadcast(p.data, 0)
    for name in CACHES:
        buf = getattr(full, name)
        if buf.numel():
            buf.normal_()
            dist.broadcast(buf, 0)
    orig = {name: getattr(full, name).clone() for name in CACHES}

    def restore(model):
        for name in CACHES:
            getattr(model, name).copy_(orig[name])

    ref: dict = {}
    one_gpu_ms: dict = {}
    if rank == 0:
        eng1 = _variant(TileRTEngine(full, dev, dtype, cap), opts_variant)
        for ctx in contexts:
            for mtp in (False, True):
                restore(full)
                seq_state(eng1, ctx)
                ref[(ctx, mtp)] = decode(eng1, ctx, n_tokens, mtp, num_draft)
                log(f"[output] one GPU ctx={ctx} mtp={mtp}: {ref[(ctx, mtp)][0][:12]} ...")
            if opts_variant == "graphs":  # the step timing replays the captured graph
                one_gpu_ms[ctx] = step_ms(eng1, ctx, dev, alone=True)
        del eng1
    dist.barrier()
    local = sharding.shard_model(full, rank, size)
    del full
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    restore(local)
    group = make_group(pg, kind, dev, dtype, args.hidden_size)
    local.use_group(group)
    eng = _variant(TileRTEngine(local, dev, dtype, cap), opts_variant)
    channel = Channel(group, ctrl, dev)
    leader = LeaderEngine(eng, channel) if rank == 0 else None
    rows = []
    for ctx in contexts:
        for mtp in (False, True):
            restore(local)
            got = run_tp_protocol(leader, eng, channel, ctx, n_tokens, mtp, num_draft)
            dist.barrier()
            if rank == 0:
                (want, want_first), (have, have_first) = ref[(ctx, mtp)], got
                diff = [i for i, (a, b) in enumerate(zip(want, have, strict=True)) if a != b]
                rel = float((want_first - have_first).abs().max() / want_first.abs().max())
                rows.append(
                    dict(
                        ctx=ctx,
                        mtp=mtp,
                        tokens=n_tokens,
                        differing=len(diff),
                        first_diff=diff[0] if diff else None,
                        logits_rel_err=rel,
                    )
                )
                log(
                    f"[output] TP{size} vs one GPU, ctx={ctx} MTP={'on' if mtp else 'off'}: {len(diff)} of {n_tokens}"
                    f" tokens differ (first at {diff[0] if diff else '-'}), first logits rel err {rel:.2e}"
                )
    RESULT["one_gpu_lite_ms"] = one_gpu_ms
    if opts_variant != "graphs":  # a diagnosis run: the output check only
        return rows, [], eng, local, leader
    RESULT["protocol"] = bench_protocol(eng, leader, channel, min(contexts), dev)
    state_rows = bench_inject(eng, leader, channel, max(contexts), dev)
    return rows, state_rows, eng, local, leader


def _variant(eng, variant: str):
    """``--variant``: the engine as served (graphs), without CUDA graphs (eager), or eager on the reference kernels."""
    if variant in ("eager", "reference"):
        eng.use_graphs = False
    if variant == "reference":
        from tilert.engines.tilert.ops import reference as ref_ops

        eng.model.use_kernels(ref_ops)
    return eng


def bench_protocol(eng, leader, channel, ctx, dev, n=50) -> dict:
    """Wall time of one greedy ``forward()`` step (+ the argmax read) called on every rank directly, and through
    the decode node's protocol (rank 0's LeaderEngine announces it on the gloo control group first)."""
    from tilert.decode.tp import Op, follow

    def steps(engine) -> float:
        sync(dev)
        t0 = time.perf_counter()
        for i in range(n):
            int(engine.forward(torch.tensor([77]), ctx + (i % 2))[-1].argmax())
        return (time.perf_counter() - t0) / n * 1e3

    seq_state(eng, ctx)
    steps(eng)  # warm: the graphs exist
    dist.barrier()
    direct = steps(eng)
    dist.barrier()
    out = dict(ctx=ctx, direct_ms=direct)
    if leader is not None:
        out["protocol_ms"] = steps(leader)
        leader.channel.send(Op.STOP)
        log(
            f"[protocol] ctx={ctx} forward()+argmax per token: every rank directly {direct:.3f} ms, through the "
            f"leader's announcements {out['protocol_ms']:.3f} ms"
        )
    else:
        follow(eng, channel)
    return out


def bench_inject(eng, leader, channel, ctx, dev) -> dict:
    """The prompt state of ``ctx`` tokens (vLLM layouts, encoded from rank 0's caches) handed to every rank."""
    from tilert.decode.tp import Op, follow
    from tilert.engines.tilert import layouts

    m, a = eng.model, eng.model.args
    rank = dist.get_rank()
    out: dict = {}
    if rank == 0:
        dt = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[eng.dtype]
        state = {"mla": layouts.encode_mla_dense(m.kv_cache[:, :ctx], dt, a.kv_lora_rank, True)}
        if a.dsa:
            state["indexer"] = layouts.encode_dsa_indexer(
                m.index_cache[:, :ctx], a.qk_rope_head_dim, a.indexer_rope_interleave
            )
        lay = eng.expected_layouts()
        nbytes = sum(t.numel() for t in state.values())
        sync(dev)
        t0 = time.perf_counter()
        leader.inject(state, lay, ctx)
        sync(dev)
        out = dict(ctx=ctx, bytes=nbytes, inject_ms=(time.perf_counter() - t0) * 1e3)
        leader.channel.send(Op.STOP)  # the followers leave follow(): the broadcast alone next
        on_dev = {k: v.to(dev) for k, v in state.items()}
        sync(dev)
        t0 = time.perf_counter()
        for k in sorted(on_dev):
            dist.broadcast(on_dev[k], 0)
        sync(dev)
        out["broadcast_ms"] = (time.perf_counter() - t0) * 1e3
    else:
        follow(eng, channel)
        shapes = _state_shapes(eng, ctx)
        for k in sorted(shapes):
            dist.broadcast(torch.empty(shapes[k], dtype=torch.uint8, device=dev), 0)
    sums = torch.stack([m.kv_cache[:, :ctx].float().sum(), m.index_cache[:, :ctx].float().sum()]).to(dev)
    every = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(every, sums)
    out["caches_equal_on_ranks"] = all(bool(torch.equal(every[0], e)) for e in every)
    log(
        f"[inject] {ctx} tokens, {out.get('bytes', 0) / 1e6:.1f} MB: inject (NCCL broadcast + conversion) "
        f"{out.get('inject_ms', 0):.1f} ms, broadcast alone {out.get('broadcast_ms', 0):.1f} ms; caches equal on "
        f"every rank: {out['caches_equal_on_ranks']}"
    )
    return out


def _state_shapes(eng, ctx) -> dict:
    from tilert.engines.tilert import layouts

    a = eng.model.args
    lay = eng.expected_layouts()
    shapes = {"mla": (lay["mla"].num_layers, ctx, lay["mla"].row_bytes)}
    if a.dsa:
        shapes["indexer"] = (lay["indexer"].num_layers, ctx, layouts.dsa_indexer_row_bytes(a.index_head_dim))
    return shapes


# ------------------------------------------------------------------------------------------------ 4. speed


def step_ms(eng, ctx, dev, alone=False) -> float:
    """The engine's captured one-token step at ``ctx`` (captured through ``forward``), ms per replay (``alone``:
    a one-GPU engine timed by one rank while the others wait)."""
    sparse = eng.model.args.dsa and ctx + 1 > eng.model.args.index_topk
    seq_state(eng, ctx)
    eng.forward(torch.tensor([77]), ctx)
    if dev.type != "cuda":
        return time_replays(lambda: eng.forward(torch.tensor([77]), ctx), dev, iters=5, reps=3, alone=alone) * 1e3
    step = eng._graphs[(1, sparse)]
    assert step is not None, "the step fell back to eager"
    return time_replays(step.replay, dev, alone=alone) * 1e3


def bytes_per_gpu(a: ModelArgs, ctx: int, sparse: bool, n: int) -> float:
    """Bytes one GPU reads per token at TP ``n`` (``a`` global): its heads, replicated W_a / indexer / router /
    latent KV, ``top_k / n`` routed and ``1/n`` of the shared experts, ``1/n`` of dense MLPs and lm_head."""
    el, d, h = 2, a.hidden_size, a.num_heads
    idx = a.index_n_heads * a.index_head_dim if a.dsa and sparse else 0  # the indexer's queries: sparse steps only
    attn = (
        a.wa_step_rows(a.dsa, sparse) * d
        + (a.q_width // n + idx) * (a.q_lora_rank or 0)
        + h // n * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
        + d * h // n * a.v_head_dim
    ) * el
    slot = 3 * d * a.moe_intermediate_size * el
    moe = (a.num_experts_per_tok + a.n_shared_experts) * slot / n + a.n_routed_experts * d * el
    dense = 3 * d * a.intermediate_size * el / n
    n_dense = a.mlp_layer_types.count("dense")
    head = d * el + a.vocab_size * d * el / n
    row = a.latent_dim * el
    kv = a.num_layers * (min(ctx, a.index_topk) * row + ctx * a.index_head_dim * el if sparse else ctx * row)
    return a.num_layers * attn + (a.num_layers - n_dense) * moe + n_dense * dense + head + kv


@torch.no_grad()
def bench_speed(name, eng, model, pg, dev, contexts, bw, kinds, one_gpu_ms) -> list:
    size = dist.get_world_size()
    a_local = model.args
    a = replace(
        a_local,
        num_heads=a_local.num_heads * size,
        intermediate_size=a_local.intermediate_size * size,
        moe_intermediate_size=a_local.moe_intermediate_size * size,
        tp_rank=0,
        tp_size=1,
    )  # the global args
    rows = []
    for ctx in contexts:
        sparse = a.dsa and ctx + 1 > a.index_topk
        per_kind = {}
        for kind in (*kinds, "nocomm"):
            try:
                model.use_group(make_group(pg, kind, dev, eng.dtype, a.hidden_size))
                eng._graphs.clear()
                per_kind[kind] = step_ms(eng, ctx, dev)
            except Exception as exc:
                per_kind[kind] = float("nan")
                log(f"[{name}] ctx={ctx} {kind}: failed {exc!r}"[:300])
                dist.barrier()
        best = min((k for k in kinds if per_kind[k] == per_kind[k]), key=lambda k: per_kind[k], default=kinds[0])
        ms = per_kind[best]
        b = bytes_per_gpu(a, ctx, sparse, size)
        roof = bw / b
        one = one_gpu_ms.get(ctx) if one_gpu_ms else None
        r = dict(
            config=name,
            layers=a.num_layers,
            ctx=ctx,
            sparse=sparse,
            tp=size,
            ms=per_kind,
            best=best,
            tok_s=1e3 / ms,
            comm_ms=ms - per_kind["nocomm"],
            comm_pct=100 * (ms - per_kind["nocomm"]) / ms,
            gb_per_gpu=b / 1e9,
            roof_tok_s=roof,
            pct_roof=100 * 1e3 / ms / roof,
            one_gpu_ms=one,
            speedup=(one / ms) if one else None,
        )
        rows.append(r)
        log(
            f"[{name}] TP{size} ctx={ctx}: "
            + ", ".join(f"{k} {v:.3f} ms" for k, v in per_kind.items())
            + f" | comm {r['comm_ms']:.3f} ms ({r['comm_pct']:.0f}%), {r['pct_roof']:.0f}% of roofline"
            + (f", one GPU {one:.3f} ms ({r['speedup']:.2f}x)" if one else "")
        )
    model.use_group(make_group(pg, "nccl", dev, eng.dtype, a.hidden_size))
    return rows


def kernel_timeline(fn, dev, steps: int = 3) -> dict:
    """The GPU kernels of one ``fn()`` (a graph replay) in launch order, each kernel's duration the mean over
    ``steps`` calls (torch.profiler), their sum and the span from the first start to the last end: what each
    kernel of the step costs and how much of the step is gaps. Call on every rank (collectives pair up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync(dev)
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    per = len(evs) // steps if steps else 0
    if per == 0:
        return dict(kernels=[], sum_us=0.0, span_us=0.0)
    names = [e.name.split("(")[0][:48] for e in evs[:per]]
    dur = [sum(evs[k * per + j].time_range.elapsed_us() for k in range(steps)) / steps for j in range(per)]
    span = sum(evs[(k + 1) * per - 1].time_range.end - evs[k * per].time_range.start for k in range(steps)) / steps
    return dict(kernels=list(zip(names, dur, strict=True)), sum_us=sum(dur), span_us=span)


def step_timeline(eng, ctx, dev) -> dict:
    """:func:`kernel_timeline` of the engine's captured one-token step at ``ctx`` (captured already), or of the
    same step run eagerly where the profiler sees no kernels inside graph replays."""
    m = eng.model
    sparse = m.args.dsa and ctx + 1 > m.args.index_topk
    tl = kernel_timeline(eng._graphs[(1, sparse)].replay, dev)
    if not tl["kernels"]:
        tok, pos = torch.tensor([77], device=dev), torch.tensor([ctx], device=dev)
        tl = dict(kernel_timeline(lambda: m.logits(m(tok, pos, sparse)), dev), eager=True)
    return tl


def log_timeline(tag: str, tl: dict, step_ms: float) -> None:
    """The timeline's kernels by name (count, total us), and the step's gaps (graph time - kernel sum)."""
    agg: dict = {}
    for name, us in tl["kernels"]:
        a = agg.setdefault(name, [0, 0.0])
        a[0] += 1
        a[1] += us
    log(
        f"{tag}{' (eager)' if tl.get('eager') else ''} {len(tl['kernels'])} kernels, sum {tl['sum_us']:.0f} us, "
        f"span {tl['span_us']:.0f} us, graph step "
        f"{step_ms * 1e3:.0f} us (gaps {step_ms * 1e3 - tl['sum_us']:.0f} us): "
        + ", ".join(f"{k} x{c} {us:.0f}" for k, (c, us) in sorted(agg.items(), key=lambda x: -x[1][1]))
    )


# Variants re-timed in the whole step (the first of each the default). TP2 real dims: the half-width experts
# (I = 1024 at hidden 7168: triton_fp8's "large" expert class), W_o [7168, 8192] 117 MB (gemv LARGE), the lm_head's
# 64640 rows (HEAD); one GPU: the LARGE and expert configs the TP2 tuning would touch there (W_b 100 MB and W_o
# 235 MB are LARGE on one GPU).
TUNING_TP = (
    ("triton_fp8", ("BF16_DOWN_CFG", "large"), ((16, 1, 1024, 8, True), (8, 1, 1024, 4, True), (16, 1, 512, 4, True))),
    ("triton_fp8", ("BF16_UP_CFG", "large"), ((8, 512, 4, 1), (8, 1024, 4, 1), (16, 512, 8, 1), (4, 1024, 4, 1))),
    ("triton_gemv", "LARGE_CFG", ((8, 512, 4, 3), (4, 512, 4, 3), (8, 1024, 8, 3), (8, 1024, 4, 3))),
    ("triton_gemv", "HEAD_CFG", ((16, 256, 4, 4), (8, 512, 4, 3))),
)
TUNING_ONE = (
    ("triton_gemv", "LARGE_CFG", ((8, 512, 4, 3), (4, 512, 4, 3), (8, 1024, 8, 3), (8, 1024, 4, 3))),
    ("triton_fp8", ("BF16_UP_CFG", "large"), ((8, 512, 4, 1), (8, 1024, 4, 1))),
)


def profile_and_tune(name, eng, model, pg, dev, contexts, kind, profile: bool, tune: bool) -> dict:
    """The TP step (``kind`` all-reduce): its kernel timeline at each context, and the TUNING_TP variants
    re-timed in the whole step at the first context (every rank in lockstep)."""
    from decode_speed import tune_variants

    out: dict = {}
    model.use_group(make_group(pg, kind, dev, eng.dtype, model.args.hidden_size))
    for ctx in contexts:
        eng._graphs.clear()
        ms = step_ms(eng, ctx, dev)
        if profile:
            tl = step_timeline(eng, ctx, dev)
            out[f"timeline_{ctx}"] = dict(step_ms=ms, **tl)
            log_timeline(f"[{name}] TP ctx={ctx} {kind}:", tl, ms)
        if tune and ctx == contexts[0]:
            out["tuning"] = tune_variants(
                f"[{name}] TP ctx={ctx}", lambda ctx=ctx: step_ms(_fresh(eng), ctx, dev), TUNING_TP, log
            )
    model.use_group(make_group(pg, "nccl", dev, eng.dtype, model.args.hidden_size))
    return out


def _fresh(eng):
    """``eng`` with its captured graphs dropped (the next step recaptures under the current configs)."""
    eng._graphs.clear()
    return eng


@torch.no_grad()
def bench_real(pg, dev, layers_tp, layers_one, contexts, bw, kinds, profile=False, tune=False) -> list:
    """The real DeepSeek-V3.2 dims: one GPU at ``layers_one`` layers (GPU 0), then TP at each of ``layers_tp``
    (``profile``: kernel timelines of both; ``tune``: TUNING_TP in the TP step at ``layers_one`` layers)."""
    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.weights import random_model

    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    base = (
        LAYER_V32
        if dev.type == "cuda"
        else v32_args(
            hidden=128,
            layers=2,
            heads=8,
            experts=16,
            top_k=4,
            n_shared=1,
            moe_inter=64,
            dense_layers=0,
            vocab=512,
            idx_heads=4,
            idx_topk=64,
            q_lora=64,
            kv_lora=64,
            rope=16,
            nope=16,
            v=16,
            idx_dim=32,
        )
    )
    cap = max(contexts) + 16
    one_ms: dict = {}
    if layers_one:
        args = replace(
            base, num_layers=layers_one, mlp_layer_types=["sparse"] * layers_one, indexer_types=["full"] * layers_one
        )
        if rank == 0:
            m = random_model(args, device=dev, dtype=dtype, max_seq_len=cap, seed=0)
            m.kv_cache.normal_()
            m.index_cache.normal_()
            eng = TileRTEngine(m, dev, dtype, cap)
            for ctx in contexts:
                one_ms[ctx] = step_ms(eng, ctx, dev, alone=True)
                log(f"[real x{layers_one}] one GPU ctx={ctx}: {one_ms[ctx]} ms")
                if tune and dev.type == "cuda" and ctx == contexts[0]:
                    from decode_speed import tune_variants

                    RESULT.setdefault("profile", {})["one_gpu_tuning"] = tune_variants(
                        f"[real x{layers_one}] one GPU ctx={ctx}",
                        lambda ctx=ctx, eng=eng: step_ms(_fresh(eng), ctx, dev, True),
                        TUNING_ONE,
                        log,
                    )
                if profile and dev.type == "cuda":
                    tl = step_timeline(eng, ctx, dev)
                    RESULT.setdefault("profile", {})[f"one_gpu_x{layers_one}_{ctx}"] = dict(step_ms=one_ms[ctx], **tl)
                    log_timeline(f"[real x{layers_one}] one GPU ctx={ctx}:", tl, one_ms[ctx])
            del eng, m
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        dist.barrier()
    rows = []
    for n_layers in layers_tp:
        args = replace(
            base, num_layers=n_layers, mlp_layer_types=["sparse"] * n_layers, indexer_types=["full"] * n_layers
        )
        t0 = time.time()
        m = random_model(sharding.local_args(args, rank, size), device=dev, dtype=dtype, max_seq_len=cap, seed=rank)
        m.kv_cache.normal_()
        m.index_cache.normal_()
        for name in ("kv_cache", "index_cache"):
            dist.broadcast(getattr(m, name), 0)
        m.use_group(make_group(pg, "nccl", dev, dtype, args.hidden_size))
        eng = TileRTEngine(m, dev, dtype, cap)
        gb = torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else 0
        log(f"[real x{n_layers}] TP{size} built in {time.time() - t0:.1f}s, {gb:.1f} GiB per GPU")
        rows += bench_speed(
            f"real-v32 x{n_layers}", eng, m, pg, dev, contexts, bw, kinds, one_ms if n_layers == layers_one else None
        )
        if (profile or tune) and n_layers == layers_one and dev.type == "cuda":
            best = min(kinds, key=lambda k: rows[-len(contexts)]["ms"].get(k, float("inf")))
            RESULT.setdefault("profile", {})[f"tp_x{n_layers}"] = profile_and_tune(
                f"real x{n_layers}", eng, m, pg, dev, contexts, best, profile, tune
            )
        del eng, m
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ main


def rank_main(rank: int, size: int, port: int, opts: argparse.Namespace) -> None:
    dev = torch.device("cuda", rank) if opts.device == "cuda" else torch.device("cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)
    pg, ctrl = parallel.init_process_group(rank, size, port, dev)
    if dev.type == "cuda":  # the Triton kernels, whatever --sections runs first (a plain TileRTEngine does not)
        from tilert.engines.tilert.ops import register_device_kernels

        register_device_kernels()
    contexts = [int(c) for c in opts.contexts.split(",")]
    kinds = tuple(k for k in opts.allreduce.split(",")) if dev.type == "cuda" else ("nccl",)
    try:
        if dev.type == "cuda":
            import triton

            RESULT.update(gpu=torch.cuda.get_device_name(dev), triton=triton.__version__, cuda=torch.version.cuda)
        RESULT.update(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            torch=torch.__version__,
            tp=size,
            device=opts.device,
            tokens=opts.tokens,
            env={
                k: os.environ.get(k)
                for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
            },
            conditions="batch 1, bf16, random weights, caches of random rows, the engine's CUDA graph "
            "replayed (median of 5x30), all ranks in lockstep",
        )
        bw = copy_bandwidth(dev)
        RESULT["copy_bw_tbs"] = bw / 1e12
        log(
            f"TP{size} on {RESULT.get('gpu', 'cpu')}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s; "
            f"multicast env (as the machine set it): {RESULT['env']}"
        )
        lite = (
            LITE_V32
            if dev.type == "cuda"
            else v32_args(
                hidden=128,
                layers=3,
                heads=8,
                experts=16,
                top_k=4,
                n_shared=2,
                moe_inter=64,
                dense_layers=1,
                dense_inter=256,
                vocab=512,
                idx_heads=4,
                idx_topk=64,
                q_lora=64,
                kv_lora=64,
                rope=16,
                nope=16,
                v=16,
                idx_dim=32,
            )
        )
        save = (lambda: _save(opts)) if rank == 0 else (lambda: None)
        sections = set(opts.sections.split(","))
        RESULT["speed"] = []
        if "collectives" in sections:
            RESULT["collectives"] = bench_collectives(
                pg, dev, (2048, 7168) if dev.type == "cuda" else (128,), lite.vocab_size
            )
            save()
        if "lite" in sections:
            rows, inject, eng, model, _leader = check_output(
                pg, ctrl, dev, lite, contexts, opts.tokens, opts.num_draft, "nccl", opts.variant, opts.check_dtype
            )
            RESULT["output"], RESULT["inject"] = rows, inject
            save()
            if opts.variant == "graphs":
                RESULT["speed"] += bench_speed(
                    "lite-v32", eng, model, pg, dev, contexts, bw, kinds, RESULT.get("one_gpu_lite_ms")
                )
            save()
            del eng, model, _leader
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        if "real" in sections and opts.real_layers:
            RESULT["speed"] += bench_real(
                pg,
                dev,
                [int(x) for x in opts.real_layers.split(",")],
                opts.one_gpu_layers,
                contexts,
                bw,
                kinds,
                "profile" in sections,
                "tune" in sections,
            )
    except Exception:
        traceback.print_exc()
        raise
    finally:
        if rank == 0:
            table()
            _save(opts)
        dist.destroy_process_group()


def _save(opts: argparse.Namespace) -> None:
    write_json(opts.result_path, RESULT, opts.recorded)


def table() -> None:
    log(
        f"\n=== TP{RESULT.get('tp')} decode, {RESULT.get('gpu', 'cpu')}, copy bw {RESULT.get('copy_bw_tbs', 0):.2f} "
        f"TB/s per GPU ==="
    )
    log("collectives inside a CUDA graph (us per op):")
    for r in RESULT.get("collectives", []):
        log(
            f"  {r['op']:<10} {r['kind']:>14} width {r['width']:>6}: "
            + (f"{r['us']:8.2f} us" if "us" in r else r.get("error", "?"))
        )
    log(f"output vs one GPU (lite-v32 random weights, {RESULT.get('tokens')} greedy tokens):")
    for r in RESULT.get("output", []):
        log(
            f"  ctx {r['ctx']:>6} MTP {'on ' if r['mtp'] else 'off'}: {r['differing']:>4} differing tokens "
            f"(first at {r['first_diff']}), first-step logits rel err {r['logits_rel_err']:.2e}"
        )
    pro = RESULT.get("protocol", {})
    if pro:
        log(
            f"decode loop step (forward()+argmax, ctx {pro['ctx']}): every rank directly {pro['direct_ms']:.3f} ms, "
            f"through the leader / follower protocol {pro.get('protocol_ms', float('nan')):.3f} ms"
        )
    inj = RESULT.get("inject", {})
    if inj:
        log(
            f"prompt state {inj.get('ctx')} tokens ({inj.get('bytes', 0) / 1e6:.0f} MB) to every rank: inject "
            f"{inj.get('inject_ms', 0):.1f} ms, NCCL broadcast alone {inj.get('broadcast_ms', 0):.1f} ms, caches "
            f"equal {inj.get('caches_equal_on_ranks')}"
        )
    log(
        f"{'stack':<16} {'ctx':>6} {'best':>14} {'ms/tok':>8} {'tok/s':>8} {'comm ms':>8} {'comm%':>6} "
        f"{'GB/GPU':>7} {'%roof':>6} {'1-GPU ms':>9} {'speedup':>8}   per kind (ms)"
    )
    for r in RESULT.get("speed", []):
        ms = r["ms"][r["best"]]
        one = f"{r['one_gpu_ms']:.3f}" if r.get("one_gpu_ms") else "-"
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        log(
            f"{r['config']:<16} {r['ctx']:>6} {r['best']:>14} {ms:>8.3f} {r['tok_s']:>8.1f} {r['comm_ms']:>8.3f} "
            f"{r['comm_pct']:>6.1f} {r['gb_per_gpu']:>7.2f} {r['pct_roof']:>6.1f} {one:>9} {sp:>8}   "
            + ", ".join(f"{k}={v:.3f}" for k, v in r["ms"].items())
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", default=None, help="a directory (or FILE.json) for the JSON (default: the current result)")
    ap.add_argument("--name", default=None, help="the benchmark's name in the file name (default tp<N>)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--contexts", default=None, help="default 1024,32768 (cuda), 80,200 (cpu)")
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens compared (default 256; cpu 16)")
    ap.add_argument("--num-draft", type=int, default=1, help="MTP drafts per speculative step")
    ap.add_argument("--allreduce", default=",".join(KINDS), help="all-reduce kinds timed in the step")
    ap.add_argument(
        "--sections",
        default="collectives,lite,real",
        help="what to run: collectives (section 1), lite (2, 3 and lite-v32's speed), real (real dims); "
        "with real, profile (kernel timelines of the one-GPU and TP steps) and tune (TUNING_TP variants "
        "re-timed in the TP step)",
    )
    ap.add_argument("--real-layers", default=None, help="real-dims V3.2 layers at TP (default 4,8; cpu 2)")
    ap.add_argument("--one-gpu-layers", type=int, default=None, help="real-dims layers on one GPU (default 4)")
    # decode_speed.py --tp N hands its own flags over; these are accepted and ignored
    ap.add_argument("--configs", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--check-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="the output check's dtype (float32 with --variant reference: the sharding's math alone, "
        "without bf16 rounding, which a deep random model amplifies)",
    )
    ap.add_argument(
        "--variant",
        default="graphs",
        choices=["graphs", "eager", "reference"],
        help="the output check's engines (both sides): graphs (as served), eager (no CUDA graphs), "
        "reference (no graphs, the plain-PyTorch reference kernels): which part of a TP mismatch is "
        "the kernels', the graphs' or the sharding's",
    )
    opts = ap.parse_args(argv)
    cpu = opts.device == "cpu"
    opts.contexts = opts.contexts or ("80,200" if cpu else "1024,32768")
    opts.tokens = opts.tokens or (16 if cpu else 256)
    opts.real_layers = opts.real_layers if opts.real_layers is not None else ("2" if cpu else "4,8")
    opts.one_gpu_layers = opts.one_gpu_layers if opts.one_gpu_layers is not None else (2 if cpu else 4)
    if not cpu and torch.cuda.device_count() < opts.tp:
        sys.exit(f"--tp {opts.tp} needs {opts.tp} GPUs; this machine has {torch.cuda.device_count()}")
    machine = machine_kind(gpus=opts.tp, device=opts.device)
    opts.result_path = str(result_path(machine, opts.name or f"tp{opts.tp}", ".json", opts.out))
    opts.recorded = recorded(machine, script="tp_decode.py")
    from tilert.netio import free_port

    port = free_port()
    torch.multiprocessing.spawn(rank_main, args=(opts.tp, port, opts), nprocs=opts.tp, join=True)


if __name__ == "__main__":
    main()
