"""Batch-1 decode speed on one GPU: fused Triton fast path in a CUDA graph vs the roofline vs transformers.

    python3 benchmarks/decode_speed.py --out $OUT            (H200; writes decode_speed.json into --out)

Configs: ``lite-v32`` (DeepSeek-V3.2 family, 16B: hidden 2048, 27 layers, 64 experts top-6 + 2 shared) and
``layer-v32`` (4 layers at the real DeepSeek-V3.2 dims). Random bf16 weights built on the GPU in the fused
layout (``benchmarks/fused_model.py``); caches filled with random rows; contexts 1K / 8K / 32K.

For every (config, context): tok/s (median of graph replays), bytes read per token (weights actually read:
attention + top-k and shared experts + router, the embedding row and lm_head, plus KV / indexer-cache bytes),
the copy bandwidth measured in the same run, % of roofline; a time breakdown from graphs that run only one
part of the step (attention projections, attention core, indexer, MoE, head); MTP draft+verify timings; the
engine's own model (``tilert.engines.tilert``) with the CUDA ops in a CUDA graph; transformers eager.
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

from fused_model import LAYER_V32, LITE_V32, FusedDecoder  # noqa: E402
from tilert.engines.tilert.fast import GraphStep  # noqa: E402

DEV = torch.device("cuda")
RESULT: dict = {}


def log(*a):
    print(*a, flush=True)


def time_graph(step: GraphStep, iters=30, reps=5) -> float:
    """Median seconds per replay (events around ``iters`` back-to-back replays, ``reps`` times)."""
    for _ in range(3):
        step.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(iters):
            step.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / iters)
    ts.sort()
    return ts[len(ts) // 2]


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


def capture(fn, n, tok, pos):
    st = GraphStep(fn, n, DEV)
    st.capture(tok, pos)
    return st


def bench_fused(cfg, contexts, bw, do_mtp, breakdown=True, profile=False):
    rows = []
    max_seq = max(contexts) + 16
    t0 = time.time()
    model = FusedDecoder(cfg, max_seq, DEV, mtp=do_mtp)
    torch.cuda.synchronize()
    log(f"[{cfg.name}] built weights+caches in {time.time() - t0:.1f}s; "
        f"GPU mem {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    for ctx in contexts:
        sparse = ctx + 1 > cfg.idx_topk
        tok = torch.tensor([1234], device=DEV)
        pos = torch.tensor([ctx], device=DEV)
        st = capture(lambda t, p: model.forward(t, p, sparse), 1, tok, pos)
        t = time_graph(st)
        by = model.bytes_per_token(ctx + 1, sparse)
        roof = by["total"] / bw
        if ctx == contexts[0]:
            from tilert.engines.tilert.ops import triton_pdl

            triton_pdl.set_enabled(False)
            s0 = capture(lambda t_, p_: model.forward(t_, p_, sparse), 1, tok, pos)
            t_nopdl = time_graph(s0)
            del s0
            triton_pdl.set_enabled(True)
            log(f"[{cfg.name}] ctx={ctx}: without PDL {t_nopdl * 1e3:.3f} ms, with PDL {t * 1e3:.3f} ms")
        else:
            t_nopdl = None
        row = dict(config=cfg.name, ctx=ctx, sparse=sparse, ms=t * 1e3, ms_no_pdl=t_nopdl and t_nopdl * 1e3,
                   tok_s=1 / t, bytes=by,
                   bytes_gb=by["total"] / 1e9, roof_ms=roof * 1e3, roof_tok_s=1 / roof, pct_roof=100 * roof / t,
                   achieved_tbs=by["total"] / t / 1e12)
        del st
        if breakdown:
            parts = {"attn_proj(gemv+prep+uv+o)": ("proj",), "attn_core": ("attn",), "moe/mlp": ("moe",),
                     "head(embed+lm_head)": ("head",)}
            if sparse:
                parts["indexer(score+topk)"] = ("indexer",)
            bd = {}
            for name, pp in parts.items():
                s2 = capture(lambda t_, p_, pp=pp: model.forward(t_, p_, sparse, parts=pp), 1, tok, pos)
                bd[name] = time_graph(s2, iters=20, reps=3) * 1e3
                del s2
            bd["sum_of_parts"] = sum(bd.values())
            row["breakdown_ms"] = bd
        if profile and ctx in (contexts[0], contexts[-1]):
            row["kernels"] = kernel_profile(lambda: model.forward(tok, pos, sparse))
        rows.append(row)
        log(f"[{cfg.name}] ctx={ctx:>6} sparse={sparse} {t * 1e3:.3f} ms  {1 / t:7.1f} tok/s  "
            f"{by['total'] / 1e9:.3f} GB/token  {100 * roof / t:5.1f}% of roofline ({1 / roof:.0f} tok/s)  "
            f"{row.get('breakdown_ms', '')}")
    mtp = None
    if do_mtp:
        mtp = {}
        for ctx in (contexts[0],):
            sparse = ctx + 4 > cfg.idx_topk
            res = {}
            for K in (1, 2, 3):
                tokv = torch.arange(K + 1, device=DEV) + 7
                posv = torch.arange(ctx, ctx + K + 1, device=DEV)
                sv = capture(lambda t, p: model.forward(t, p, sparse), K + 1, tokv, posv)
                tv = time_graph(sv)
                del sv
                h0 = torch.randn(1, cfg.hidden, device=DEV).to(torch.bfloat16)
                sd = capture(lambda t, p, K=K: model.draft_chain(t, h0, p, K, sparse), 1, tokv[:1], posv[:1])
                td = time_graph(sd)
                del sd
                res[K] = dict(verify_ms=tv * 1e3, draft_ms=td * 1e3, step_ms=(tv + td) * 1e3)
                log(f"[{cfg.name}] MTP K={K} ctx={ctx}: draft chain {td * 1e3:.3f} ms + verify(n={K + 1}) "
                    f"{tv * 1e3:.3f} ms = {(tv + td) * 1e3:.3f} ms/step")
            mtp[ctx] = res
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows, mtp


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


def hf_config(cfg, layers=None):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.dense_inter,
        moe_intermediate_size=cfg.moe_inter, num_hidden_layers=layers or cfg.layers,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, n_shared_experts=cfg.n_shared,
        n_routed_experts=cfg.experts, num_experts_per_tok=cfg.top_k, routed_scaling_factor=cfg.route_scale,
        kv_lora_rank=cfg.kv_lora, q_lora_rank=cfg.q_lora, qk_rope_head_dim=cfg.rope, v_head_dim=cfg.v,
        qk_nope_head_dim=cfg.nope, n_group=cfg.n_group, topk_group=cfg.topk_group,
        first_k_dense_replace=cfg.dense_layers, norm_topk_prob=True, max_position_embeddings=65536,
        index_n_heads=cfg.idx_heads, index_head_dim=cfg.idx_dim, index_topk=cfg.idx_topk,
        tie_word_embeddings=False,
    )


@torch.no_grad()
def bench_transformers(cfg, contexts, layers=None, steps=3):
    from transformers import DeepseekV32ForCausalLM

    hc = hf_config(cfg, layers)
    hc._attn_implementation = "eager"
    t0 = time.time()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEV):
            m = DeepseekV32ForCausalLM(hc)
    finally:
        torch.set_default_dtype(prev)
    m.eval()
    torch.cuda.synchronize()
    log(f"[transformers {cfg.name} layers={hc.num_hidden_layers}] built in {time.time() - t0:.1f}s")
    out = {}
    for ctx in contexts:
        try:
            ids = torch.randint(0, cfg.vocab, (1, ctx), device=DEV)
            o = m(input_ids=ids, use_cache=True)
            pkv = o.past_key_values
            nxt = o.logits[:, -1:].argmax(-1)
            del o
            torch.cuda.synchronize()
            ts = []
            for _ in range(steps + 1):
                t1 = time.time()
                o = m(input_ids=nxt, past_key_values=pkv, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                ts.append(time.time() - t1)
                del o
            t = sorted(ts[1:])[len(ts[1:]) // 2]
            out[ctx] = dict(ms=t * 1e3, tok_s=1 / t, layers=hc.num_hidden_layers)
            log(f"[transformers {cfg.name} layers={hc.num_hidden_layers}] ctx={ctx}: {t * 1e3:.1f} ms/token "
                f"({1 / t:.2f} tok/s)")
            del pkv
        except Exception as exc:  # OOM at long contexts (eager indexer materialises [S, H, T] scores)
            out[ctx] = dict(error=repr(exc)[:200])
            log(f"[transformers] ctx={ctx} failed: {exc!r}"[:300])
        gc.collect()
        torch.cuda.empty_cache()
    del m
    gc.collect()
    torch.cuda.empty_cache()
    return out


@torch.no_grad()
def bench_engine_model(cfg, contexts, bw):
    """The engine's own model (tilert.engines.tilert.model) with the CUDA ops, captured by fast.GraphStep."""
    import tilert.engines.tilert.ops as ops  # noqa: F401
    from tilert.engines.tilert.ops import cuda as _c  # noqa: F401
    from tilert.engines.tilert.model import Transformer
    from tilert.engines.tilert.weights import args_from_hf_config

    args = args_from_hf_config(hf_config(cfg))
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=DEV)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.data = torch.empty(p.shape, device=DEV, dtype=torch.bfloat16).normal_(0, p.shape[-1] ** -0.5)
        else:
            p.data = (1 + 0.1 * torch.randn(p.shape, device=DEV)).to(
                torch.float32 if "bias" in name and "correction" in name else torch.bfloat16)
    for mod in model.modules():
        if hasattr(mod, "weights_proj"):
            mod.weights_proj.weight.data = mod.weights_proj.weight.data.float()
    model.eval()
    model.setup_caches(max(contexts) + 16, DEV, torch.bfloat16)
    model.kv_cache.normal_()
    model.index_cache.normal_()
    out = {}
    for ctx in contexts:
        tok = torch.tensor([77], device=DEV)
        pos = torch.tensor([ctx], device=DEV)
        st = capture(lambda t, p: model.logits(model(t, p)), 1, tok, pos)
        t = time_graph(st, iters=10, reps=3)
        out[ctx] = dict(ms=t * 1e3, tok_s=1 / t)
        log(f"[engine model {cfg.name}] ctx={ctx}: {t * 1e3:.3f} ms ({1 / t:.1f} tok/s) (CUDA ops, CUDA graph)")
        del st
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--configs", default="lite-v32,layer-v32")
    ap.add_argument("--contexts", default="1024,8192,32768")
    ap.add_argument("--no-tf", action="store_true")
    ap.add_argument("--no-engine", action="store_true")
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel torch.profiler table (first/last context)")
    ap.add_argument("--tf-json", default="", help="reuse transformers numbers from an earlier decode_speed.json")
    args = ap.parse_args()
    import triton
    import transformers

    contexts = [int(x) for x in args.contexts.split(",")]
    RESULT.update(date=datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                  gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  transformers_version=transformers.__version__, cuda=torch.version.cuda,
                  conditions="batch 1, bf16, random weights built on the GPU, caches filled with random rows, "
                             "CUDA graph replay, median of 5x30 replays")
    bw = copy_bandwidth()
    RESULT["copy_bw_tbs"] = bw / 1e12
    log(f"GPU {RESULT['gpu']}  torch {torch.__version__}  triton {triton.__version__}  "
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write)")
    cfgs = {"lite-v32": LITE_V32, "layer-v32": LAYER_V32}
    RESULT["runs"] = []
    RESULT["mtp"] = {}
    RESULT["transformers"] = {}
    RESULT["engine_model"] = {}

    def save():
        with open(os.path.join(args.out, "decode_speed.json"), "w") as f:
            json.dump(RESULT, f, indent=1, default=str)

    for name in args.configs.split(","):
        cfg = cfgs[name]
        try:
            rows, mtp = bench_fused(cfg, contexts, bw, do_mtp=(name == "lite-v32"),
                                    breakdown=not args.no_breakdown, profile=args.profile)
            RESULT["runs"] += rows
            if mtp:
                RESULT["mtp"][name] = mtp
        except Exception:
            traceback.print_exc()
        save()
        if name == "lite-v32" and not args.no_engine:
            try:
                RESULT["engine_model"][name] = bench_engine_model(cfg, contexts[:1], bw)
            except Exception as exc:
                traceback.print_exc()
                RESULT["engine_model"][name] = dict(error=repr(exc)[:300])
            save()
        if args.tf_json:
            with open(args.tf_json) as f:
                old = json.load(f)["transformers"]
            RESULT["transformers"].update({k: {int(c): v for c, v in d.items()} for k, d in old.items()
                                            if k.startswith(name)})
            RESULT["transformers_source"] = args.tf_json
        elif not args.no_tf:
            try:
                if name == "lite-v32":
                    RESULT["transformers"][name] = bench_transformers(cfg, [c for c in contexts if c <= 8192])
                else:
                    r1 = bench_transformers(cfg, contexts[:1], layers=1)
                    RESULT["transformers"][name + "(1 layer)"] = r1
            except Exception as exc:
                traceback.print_exc()
                RESULT["transformers"][name] = dict(error=repr(exc)[:300])
            save()

    # ---------------------------------------------------------------- the table
    log("\n=== batch-1 decode, " + RESULT["gpu"] + f", copy bw {bw / 1e12:.2f} TB/s ===")
    log(f"{'config':<10} {'ctx':>6} {'mode':>6} {'ms/tok':>8} {'tok/s':>8} {'GB/tok':>7} {'roof tok/s':>10} "
        f"{'%roof':>6} {'TB/s':>5} {'HF eager tok/s':>15}")
    for r in RESULT["runs"]:
        tf = RESULT["transformers"].get(r["config"], {}).get(r["ctx"], {})
        tf1 = RESULT["transformers"].get(r["config"] + "(1 layer)", {}).get(r["ctx"], {})
        tfs = f"{tf['tok_s']:.2f}" if "tok_s" in tf else (f"1L:{tf1['tok_s']:.2f}" if "tok_s" in tf1 else "-")
        log(f"{r['config']:<10} {r['ctx']:>6} {'sparse' if r['sparse'] else 'dense':>6} {r['ms']:>8.3f} "
            f"{r['tok_s']:>8.1f} {r['bytes_gb']:>7.3f} {r['roof_tok_s']:>10.0f} {r['pct_roof']:>6.1f} "
            f"{r['achieved_tbs']:>5.2f} {tfs:>15}")
    for r in RESULT["runs"]:
        if "breakdown_ms" in r:
            log(f"breakdown {r['config']} ctx={r['ctx']}: " + ", ".join(f"{k}={v:.3f}ms" for k, v in r["breakdown_ms"].items())
                + f" | full={r['ms']:.3f}ms")
    for name, per_ctx in RESULT["mtp"].items():
        for ctx, res in per_ctx.items():
            base = [r for r in RESULT["runs"] if r["config"] == name and r["ctx"] == ctx][0]["ms"]
            log(f"MTP {name} ctx={ctx} (plain step {base:.3f} ms = {1e3 / base:.0f} tok/s):")
            for K, v in res.items():
                accs = [a for a in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0) if a <= K + 1]
                log(f"  K={K}: draft {v['draft_ms']:.3f} + verify {v['verify_ms']:.3f} = {v['step_ms']:.3f} ms/step; "
                    + "  ".join(f"acc {a:.1f}->{a * 1e3 / v['step_ms']:.0f} tok/s" for a in accs))
    for name, v in RESULT["engine_model"].items():
        log(f"engine model (tilert.engines.tilert.model + CUDA ops, CUDA graph) {name}: {v}")
    save()


if __name__ == "__main__":
    main()
