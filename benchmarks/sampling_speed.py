"""Per-user decode speed of greedy requests with logits rules and structured outputs on the TileRT pool, one GPU.

    python3 benchmarks/sampling_speed.py --tokenizer DIR --out $OUT      (H200; writes h200-sampling-speed.json)

The decode node's own loop (``tilert.decode.generate``: :class:`SequenceRun` and ``decode_alone``, the path a request
alone on its node takes) over the engine (``TileRTEngine``, lite-v32 with block-FP8 weights, random weights and
caches, CUDA graphs) at a 1K context, for one request of each kind, side by side in one run:

- ``plain``: no rule (the engine's pipelined ``greedy_stream``), the reference speed;
- ``penalties``: repetition 1.1 (over the prompt's 1K ids too), frequency 0.5, presence 0.5;
- ``bias``: 64 entries of ``logit_bias`` and ``min_tokens``;
- ``json``: a JSON schema compiled by xgrammar (``tilert.decode.grammar``) with the tokenizer in ``--tokenizer``
  (a byte-level BPE of the model's vocabulary size, trained locally: ``--train-tokenizer``);
- ``json+penalties``.

Each ruled request runs twice: on the engine's shaped stream (the rules and the grammar's mask inside its captured
steps, ``shaped_greedy_stream``) and on the per-step path (``engine.forward`` then the host's sampler), which is also
the correctness reference: both must give the same tokens. Rows: ``case``, ``path``, ``tokens``, ``tok_s``,
``pct_of_plain``, ``same_tokens``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import check_kernels  # noqa: E402
import torch
from engine_configs import config_args  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402

from tilert.contracts import Grammar, Sampling  # noqa: E402
from tilert.decode.generate import SequenceRun, decode_alone  # noqa: E402
from tilert.decode.grammar import Grammars  # noqa: E402
from tilert.decode.sampling import DecodeParams  # noqa: E402
from tilert.models.synthetic import write_tokenizer  # noqa: E402

SCHEMA = '{"type": "array", "items": {"type": "integer"}, "minItems": 400}'


def run_one(engine, params, eos, ctx, grammars, fast: bool) -> tuple[list[int], float]:
    """One request decoded alone from position ``ctx``: its tokens and seconds (fast: the node's own loop; else one
    ``forward`` a step and the host's sampler)."""
    out: list[int] = []
    run = SequenceRun(engine, params, eos, ctx, lambda ids, _f: out.extend(ids), threading.Event(), 0, grammars)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if fast:
        decode_alone(engine, run, 0)
    else:
        while not run.check_cancel():
            logits = engine.forward(torch.tensor([run.token]), run.pos)
            if run.accept([run.sample(logits[-1])]) is not None:
                break
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer directory (made there by --train-tokenizer)")
    ap.add_argument("--train-tokenizer", action="store_true", help="train the tokenizer into --tokenizer first")
    ap.add_argument("--config", default="lite-v32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    opts = ap.parse_args()
    from dataclasses import replace

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.engines.tilert.weights import random_model

    args = replace(config_args(opts.config), fp8=True)
    if opts.train_tokenizer:
        t0 = time.time()
        write_tokenizer(opts.tokenizer, args.vocab_size)
        print(f"tokenizer trained in {time.time() - t0:.0f} s", flush=True)
    register_device_kernels()
    dev, ctx = torch.device("cuda"), opts.context
    model = random_model(args, device=dev, dtype=torch.bfloat16, max_seq_len=ctx + opts.tokens + 16, seed=0)
    model.kv_cache.normal_()
    model.index_cache.normal_()
    engine = TileRTEngine(model, dev, torch.bfloat16, ctx + opts.tokens + 16)
    grammars = Grammars(opts.tokenizer, engine.vocab_size)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(opts.tokenizer)
    open_bracket = tokenizer.convert_tokens_to_ids("[")
    eos = frozenset({tokenizer.eos_token_id})
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.vocab_size, (ctx,), generator=gen).tolist()
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    bias = {int(t): 3.0 for t in torch.randint(0, engine.vocab_size, (64,), generator=gen)}
    cases = {
        "plain": ({}, 77),
        "penalties": (penalties, 77),
        "bias": ({"logit_bias": bias, "min_tokens": 32}, 77),
        "json": ({"grammar": Grammar(kind="json", spec=SCHEMA)}, open_bracket),
        "json+penalties": ({**penalties, "grammar": Grammar(kind="json", spec=SCHEMA)}, open_bracket),
    }
    kernel_ok = check_kernels.check_shaping(dev, vocab=engine.vocab_size)
    print(f"rules kernel == CPU reference (bit for bit): {kernel_ok}", flush=True)
    rows, speeds = [], {}
    for case, (fields, first) in cases.items():
        s = Sampling(max_tokens=opts.tokens, temperature=0.0, ignore_eos=not fields.get("grammar"), **fields)
        params = DecodeParams.of("bench", s, engine.vocab_size, None, first, ctx, prompt)
        paths = ["fast"] if case == "plain" else ["fast", "per-step"]
        tokens: dict[str, list[int]] = {}
        for path in paths:
            run_one(engine, params, eos, ctx, grammars, path == "fast")  # graphs captured, grammar compiled
            times = []
            for _ in range(opts.reps):
                tokens[path], sec = run_one(engine, params, eos, ctx, grammars, path == "fast")
                times.append(sec)
            tok_s = len(tokens[path]) / statistics.median(times)
            speeds[(case, path)] = tok_s
            rows.append({"case": case, "path": path, "tokens": len(tokens[path]), "tok_s": round(tok_s, 1)})
        if "per-step" in tokens:
            for r in rows[-2:]:
                r["same_tokens"] = tokens["fast"] == tokens["per-step"]
    for r in rows:
        r["pct_of_plain"] = round(100 * r["tok_s"] / speeds[("plain", "fast")], 1)
    print(f"\n{'case':<16} {'path':<9} {'tokens':>6} {'tok/s':>8} {'% plain':>8}  same tokens")
    for r in rows:
        print(
            f"{r['case']:<16} {r['path']:<9} {r['tokens']:>6} {r['tok_s']:>8.1f} {r['pct_of_plain']:>7.1f}%  "
            f"{r.get('same_tokens', '')}"
        )
    machine = machine_kind()
    rec = recorded(
        machine,
        config=f"{opts.config} fp8, random weights",
        context=ctx,
        tokens=opts.tokens,
        gpu=torch.cuda.get_device_name(),
        rules_kernel_exact=kernel_ok,
        torch=torch.__version__,
    )
    print("wrote", write_json(result_path(machine, "sampling-speed", ".json", opts.out), rows, rec))
    if not kernel_ok or not all(r.get("same_tokens", True) for r in rows):
        sys.exit("the shaped stream and the per-step path disagree")


if __name__ == "__main__":
    main()
