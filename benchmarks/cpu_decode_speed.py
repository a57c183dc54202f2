"""CPU decode speed of the TileRT engine: one table per model (run on the CPU machine, not the GPU).

For each configuration (the tiny ``deepseek_v3`` checkpoint the stack serves, and a larger random DeepSeek-V3.2
shaped model) and thread count it prints:

- the decode step (one token, ``max_seq_len`` static cache, decoding after a ``--context``-token prompt):
  eager with the dispatched reference ops, eager with ``ops.cpu`` (the engine's CPU path), each under
  ``torch.no_grad`` and ``torch.inference_mode``; the engine's own ``forward()`` step and ``greedy_stream`` tokens/s;
- ``torch.compile`` of the same step (default inductor, static shapes; ``--compile`` off skips it): with the
  dispatched custom ops (opaque to inductor), with the reference kernels inlined (inductor sees every op), and
  with ``ops.cpu`` inlined; compile time (first call) and step time;
- a per-op breakdown: the time spent in each ``tilert::*`` op per step (reference vs ``ops.cpu``) and the rest
  (the model's own Python, embedding, slicing).

Usage: ``python benchmarks/cpu_decode_speed.py [--configs tiny,small-v32] [--threads 1,2] [--json FILE|DIR]``.
Writes ``benchmarks/results/cpu-decode.json`` (``cpu-decode-sequences.json`` with ``--sequences``) unless ``--json``
names another file or directory; ``{"recorded": <results_header's date, commit, machine, command>, "results":
[...]}``.
``--sequences 1,2,4,8`` prints only the several-sequences table instead: one decode step over the rows of ``n``
sequences (``decode_step_greedy``) with the native kernels and with ATen only, and the same rows one after the
other, interleaved; ms per step, per-user and total tokens/s, and whether the arms gave the same tokens.
Timings are medians over ``--steps`` steps, repeated ``--repeats`` times (the minimum of the medians is shown:
a shared machine is noisy); the several-sequences table shows the best of the repeats' means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from results_header import recorded, result_path, write_json  # noqa: E402

from tilert.engines.tilert import ops  # noqa: E402
from tilert.engines.tilert.engine import TileRTEngine  # noqa: E402
from tilert.engines.tilert.model import ModelArgs, Transformer  # noqa: E402
from tilert.engines.tilert.ops import cpu as cpu_ops  # noqa: E402
from tilert.engines.tilert.ops import native, reference  # noqa: E402
from tilert.engines.tilert.weights import load_model, random_model  # noqa: E402

OP_NAMES = (
    "gemv",
    "gemv_residual",
    "mla_prep",
    "mla_attention",
    "mla_sparse_attention",
    "indexer_topk",
    "mla_uv",
    "mla_attention_uv",
    "moe_block",
    "moe_residual",
    "rms_norm",
)


def small_v32() -> ModelArgs:
    """A larger random model: DeepSeek-V3.2-shaped (DSA), hidden 1024, 4 layers (1 dense), 32 experts top-4 +
    1 shared, 8 heads, vocab 16K (~130M parameters, 0.5 GB in float32); DSA top-k 256."""
    sys.path.insert(0, os.path.dirname(__file__))
    import engine_configs as ec

    return ec.v32_args(
        hidden=1024,
        layers=4,
        heads=8,
        experts=32,
        top_k=4,
        n_shared=1,
        moe_inter=256,
        dense_inter=2816,
        vocab=16384,
        idx_heads=8,
        idx_dim=64,
        idx_topk=256,
        q_lora=384,
        kv_lora=512,
        rope=64,
        nope=64,
        v=64,
        n_group=4,
        topk_group=2,
        route_scale=2.5,
    )


def build_model(config: str, max_seq_len: int, tiny_dir: Path, max_sequences: int = 1) -> Transformer:
    if config == "tiny":
        if not (tiny_dir / "config.json").exists():
            from tilert.models.tiny import build_tiny_model

            build_tiny_model("deepseek_v3", tiny_dir, seed=0)
        return load_model(
            tiny_dir, device="cpu", dtype=torch.float32, max_seq_len=max_seq_len, max_sequences=max_sequences
        )
    if config == "small-v32":
        return random_model(
            small_v32(), device="cpu", dtype=torch.float32, max_seq_len=max_seq_len, seed=0, max_sequences=max_sequences
        )
    raise SystemExit(f"unknown config {config!r} (tiny, small-v32)")


def median_ms(fn: Callable[[int], None], steps: int, repeats: int) -> float:
    """``fn(i)`` for i in range(steps), timed one by one; the minimum over repeats of the median (ms)."""
    meds = []
    for _ in range(repeats):
        ts = []
        for i in range(steps):
            t0 = time.perf_counter()
            fn(i)
            ts.append(time.perf_counter() - t0)
        meds.append(statistics.median(ts) * 1e3)
    return min(meds)


class OpTimer:
    """A kernel table that times every op of another one (per-op breakdown)."""

    def __init__(self, kernels: Any) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.ns = types.SimpleNamespace()
        for name in OP_NAMES:
            setattr(self.ns, name, self._wrap(name, getattr(kernels, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.total[name] += time.perf_counter() - t0
            return out

        return timed


def model_step(model: Transformer, use_indexer: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.logits(model(tok, pos, use_indexer))

    return step


def run_config(config: str, threads: int, a: argparse.Namespace, tiny_dir: Path) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model = build_model(config, a.max_seq_len, tiny_dir)
    args = model.args
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab_size, (a.context,), generator=gen)
    res: dict[str, Any] = {
        "config": config,
        "threads": threads,
        "arch": args.arch,
        "layers": args.num_layers,
        "hidden": args.hidden_size,
        "max_seq_len": a.max_seq_len,
        "context": a.context,
    }
    ctx = a.context
    use_indexer = args.dsa and ctx + 1 > args.index_topk
    steps, reps = a.steps, a.repeats

    # -------- the engine, as the decode node runs it (forward() per step, greedy_stream), reference ops vs ops.cpu
    for label, fast in (("reference ops", False), ("ops.cpu", True)):
        eng = TileRTEngine(model, torch.device("cpu"), torch.float32, a.max_seq_len, cpu_kernels=fast)
        if not fast:
            model.use_kernels(ops)
        first = int(eng.forward(prompt, 0)[-1].argmax())
        tok = torch.tensor([first])
        fwd = median_ms(lambda i: eng.forward(tok, ctx + i % 8), steps, reps)  # noqa: B023
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            n = sum(1 for _ in eng.greedy_stream(first, ctx, steps))
            best = min(best, (time.perf_counter() - t0) / n * 1e3)
        res[f"engine forward ms [{label}]"] = fwd
        res[f"greedy_stream tok/s [{label}]"] = 1e3 / best
        toks = list(eng.greedy_stream(first, ctx, 16))
        res.setdefault("greedy tokens", {})[label] = toks
    res["same greedy tokens"] = len({tuple(v) for v in res["greedy tokens"].values()}) == 1

    # -------- the model step alone: eager, no_grad vs inference_mode, reference vs ops.cpu
    pos = lambda i: torch.tensor([ctx + i % 8])  # noqa: E731
    tok = torch.tensor([int(prompt[-1])])
    for kname, kernels in (("reference ops (dispatched)", ops), ("ops.cpu", cpu_ops)):
        model.use_kernels(kernels)
        step = model_step(model, use_indexer)
        for mode, cm in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            with cm():
                res[f"eager step ms [{kname}, {mode}]"] = median_ms(lambda i: step(tok, pos(i)), steps, reps)  # noqa: B023

    # -------- per-op breakdown (inference_mode)
    for kname, kernels in (("reference ops (dispatched)", ops), ("ops.cpu", cpu_ops)):
        timer = OpTimer(kernels)
        model.use_kernels(timer.ns)
        step = model_step(model, use_indexer)
        n = steps
        with torch.inference_mode():
            for i in range(8):
                step(tok, pos(i))
            timer.total.clear()
            t0 = time.perf_counter()
            for i in range(n):
                step(tok, pos(i))
            wall = (time.perf_counter() - t0) / n * 1e3
        per = {k: v / n * 1e3 for k, v in sorted(timer.total.items(), key=lambda kv: -kv[1])}
        per["(rest: model glue)"] = wall - sum(per.values())
        res[f"per-op ms [{kname}]"] = per

    # -------- torch.compile of the step
    if a.compile:
        for kname, kernels in (
            ("dispatched custom ops", ops),
            ("reference inlined", reference),
            ("ops.cpu inlined", cpu_ops),
        ):
            model.use_kernels(kernels)
            torch._dynamo.reset()
            step = torch.compile(model_step(model, use_indexer), dynamic=False)
            try:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    step(tok, pos(0))
                    first_s = time.perf_counter() - t0
                    for i in range(1, 16):  # later recompiles (graph breaks, specialised ints) count as compile too
                        t1 = time.perf_counter()
                        step(tok, pos(i))
                        if time.perf_counter() - t1 > 0.5:
                            first_s += time.perf_counter() - t1
                    ms = median_ms(lambda i: step(tok, pos(i)), steps, reps)  # noqa: B023
                res[f"compiled step ms [{kname}]"] = ms
                res[f"compile s [{kname}]"] = first_s
            except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not stop
                res[f"compiled step ms [{kname}]"] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        torch._dynamo.reset()
    model.use_kernels(cpu_ops)
    return res


SEQ_ARMS = ("native, one call", "ATen, one call", "native, row by row")
"""The several-sequences table's arms: the step over all rows with the native kernels (the engine's CPU path) and
with ATen only (``TILERT_CPU_NATIVE=0``: the path without a C compiler), and the rows as ``n`` single-row steps."""


def _use_native(on: bool) -> None:
    """Switch the CPU kernels' path for the next steps (``native.kernels`` decides it once per process: re-ask)."""
    os.environ["TILERT_CPU_NATIVE"] = "1" if on else "0"
    native.kernels.cache_clear()


def run_sequences(config: str, threads: int, a: argparse.Namespace, tiny_dir: Path) -> dict[str, Any]:
    """Several sequences per decode step (``decode_step_greedy``, one model call over the rows of ``n``
    sequences, each at its own position) in each of :data:`SEQ_ARMS`, interleaved (each repeat runs every arm
    once); every arm must give the same tokens."""
    torch.set_num_threads(threads)
    ns = [int(x) for x in a.sequences.split(",")]
    model = build_model(config, a.max_seq_len, tiny_dir, max_sequences=max(ns))
    eng = TileRTEngine(model, torch.device("cpu"), torch.float32, a.max_seq_len)
    gen = torch.Generator().manual_seed(0)
    ctx = a.context
    firsts = []
    for s in range(max(ns)):  # each sequence its own prompt, its own position
        prompt = torch.randint(0, model.args.vocab_size, (ctx + s,), generator=gen)
        firsts.append(int(eng.forward(prompt, 0, seq=s)[-1].argmax()))
    rows = []
    try:
        for n in ns:
            seqs = list(range(n))
            out: dict[str, Any] = {"config": config, "threads": threads, "sequences": n}
            best = dict.fromkeys(SEQ_ARMS, float("inf"))
            got: dict[str, list[list[int]]] = {}
            for _ in range(a.repeats):
                for arm in SEQ_ARMS:
                    _use_native(not arm.startswith("ATen"))
                    toks = list(firsts[:n])
                    tokens: list[list[int]] = [[] for _ in seqs]
                    t0 = time.perf_counter()
                    for i in range(a.steps):
                        pos = [ctx + s + i for s in seqs]
                        if arm.endswith("one call"):
                            toks = eng.decode_step_greedy(toks, pos, seqs)
                        else:
                            toks = [
                                eng.decode_step_greedy([t], [p], [s])[0]
                                for t, p, s in zip(toks, pos, seqs, strict=True)
                            ]
                        for s in seqs:
                            tokens[s].append(toks[s])
                    best[arm] = min(best[arm], (time.perf_counter() - t0) / a.steps * 1e3)
                    got.setdefault(arm, tokens)
            for arm in SEQ_ARMS:
                out[f"step ms [{arm}]"] = best[arm]
            native_tokens = got[SEQ_ARMS[0]]
            out["same tokens"] = got[SEQ_ARMS[2]] == native_tokens
            out["same tokens as ATen"] = got[SEQ_ARMS[1]] == native_tokens
            rows.append(out)
    finally:
        _use_native(True)
    first = rows[0] if rows and rows[0]["sequences"] == 1 else None
    for r in rows:
        ms = r[f"step ms [{SEQ_ARMS[0]}]"]
        r["per-user tok/s"], r["total tok/s"] = 1e3 / ms, 1e3 * r["sequences"] / ms
        for arm in SEQ_ARMS[:2]:
            r[f"step vs 1 sequence [{arm}]"] = r[f"step ms [{arm}]"] / first[f"step ms [{arm}]"] if first else None
    return {"config": config, "threads": threads, "context": ctx, "rows": rows}


def print_sequences(r: dict[str, Any]) -> None:
    print(
        f"\n## {r['config']}: several sequences per step, threads={r['threads']}, decoding after ~{r['context']} "
        "tokens (step ms: the best of the repeats' means, arms interleaved)"
    )
    print(
        "| sequences | step ms: native, one call | ATen, one call | native, row by row | per-user tok/s (native) | "
        "total tok/s (native) | step vs 1 sequence: native | ATen | same tokens (row by row / ATen) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")

    def rel(x: float | None) -> str:
        return f"{x:.2f}x" if x else ""

    for x in r["rows"]:
        ms = [x[f"step ms [{arm}]"] for arm in SEQ_ARMS]
        print(
            f"| {x['sequences']} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[2]:.2f} | {x['per-user tok/s']:.0f} | "
            f"{x['total tok/s']:.0f} | {rel(x[f'step vs 1 sequence [{SEQ_ARMS[0]}]'])} | "
            f"{rel(x[f'step vs 1 sequence [{SEQ_ARMS[1]}]'])} | {x['same tokens']} / {x['same tokens as ATen']} |"
        )


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\n## {r['config']} ({r['arch']}, {r['layers']} layers, hidden {r['hidden']}), threads={r['threads']}, "
        f"max_seq_len={r['max_seq_len']}, decoding after {r['context']} tokens"
    )
    print("| measurement | value |\n|---|---|")
    for k, v in r.items():
        if k.startswith(("engine", "greedy_stream", "eager", "compiled", "compile s")):
            unit = "" if isinstance(v, str) else (f"{v:.1f}" if "tok/s" in k or "compile s" in k else f"{v:.3f}")
            print(f"| {k} | {unit or v} |")
    print(f"| same greedy tokens, reference ops and ops.cpu | {r['same greedy tokens']} |")
    for kname in ("reference ops (dispatched)", "ops.cpu"):
        per = r[f"per-op ms [{kname}]"]
        print(f"\nper-op ms per step [{kname}, inference_mode]: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="tiny,small-v32")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--context", type=int, default=0, help="prompt tokens before decoding (0: 128 tiny, 512 small-v32)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--tiny-dir", default="")
    p.add_argument(
        "--json",
        default="",
        help="the JSON written: a FILE.json or a directory (default benchmarks/results/cpu-decode[-sequences].json)",
    )
    p.add_argument(
        "--sequences",
        default="",
        metavar="NS",
        help="only the several-sequences table: decode steps over n = NS sequences (comma list)",
    )
    a = p.parse_args()
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"python {platform.python_version()}"
    )
    results = []
    with contextlib.ExitStack() as stack:
        tiny_dir = Path(a.tiny_dir) if a.tiny_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for config in a.configs.split(","):
            for th in (int(t) for t in a.threads.split(",")):
                ctx_default = {"tiny": 128, "small-v32": 512}.get(config, 128)
                run = argparse.Namespace(**{**vars(a), "context": a.context or ctx_default})
                if a.sequences:
                    r = run_sequences(config, th, run, tiny_dir)
                    print_sequences(r)
                else:
                    r = run_config(config, th, run, tiny_dir)
                    print_table(r)
                results.append(r)
    bench = "decode-sequences" if a.sequences else "decode"
    rec = recorded("cpu", torch=torch.__version__, cpus=os.cpu_count())
    print(f"written: {write_json(result_path('cpu', bench, '.json', a.json or None), results, rec)}")


if __name__ == "__main__":
    main()
