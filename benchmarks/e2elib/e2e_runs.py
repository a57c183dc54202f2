"""End to end: ``vllm bench serve`` (through ``benchmarks/vllm_bench.py``) against every target at every
concurrency, in interleaved rounds; each run's statistics from the JSON bench saves, the probes' means beside them,
and the median over rounds."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2elib.conditions import settings
from e2elib.probes import VLLM_SERIES, RouterProbe, VllmProbe
from e2elib.procs import Procs, wait_healthy
from e2elib.tables import e2e_tables, fmt, median
from e2elib.targets import TARGETS, Target, agreement_check, start_servers

LAUNCHER = Path(__file__).resolve().parents[1] / "vllm_bench.py"
BENCH_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "output_throughput",
    "request_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)
BURST_S = 0.0005  # a token that reaches the client within 0.5 ms of the previous one came in the same burst
ROUTER_KEYS = (
    "router_queue_ms",
    "router_prefill_ms",
    "router_transfer_wait_ms",
    "router_ttft_ms",
    "router_cpu_ms_per_request",
    "router_cpu_us_per_token",
)
VLLM_KEYS = tuple("vllm_" + name for name in VLLM_SERIES)


def bench_command(
    args: argparse.Namespace,
    target: Target,
    model: Path,
    concurrency: int,
    num_prompts: int,
    result_dir: Path,
    filename: str,
) -> list[str]:
    endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    return [
        sys.executable,
        str(LAUNCHER),
        "bench",
        "serve",
        "--backend",
        args.backend,
        "--base-url",
        target.url,
        "--endpoint",
        endpoint,
        "--model",
        str(model),
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(args.seed),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--num-warmups",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        filename,
        "--label",
        target.name,
        "--disable-tqdm",
    ]


def run_bench(
    args: argparse.Namespace, procs: Procs, target: Target, model: Path, concurrency: int, round_no: int, raw_dir: Path
) -> dict[str, Any]:
    num_prompts = args.num_prompts or max(8, 4 * concurrency)
    filename = f"{target.name}-c{concurrency}-r{round_no}.json"
    cmd = bench_command(args, target, model, concurrency, num_prompts, raw_dir, filename)
    name = f"bench-{target.name}-c{concurrency}-r{round_no}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    probe = RouterProbe(target.url, procs.procs["router"].pid) if target.name == "router" else None
    inside = VllmProbe(target.vllm_url)
    procs.start(name, cmd, env)
    proc = procs.procs[name]
    try:
        code = proc.wait(timeout=args.bench_timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    tail = procs.tail(name)
    procs.stop(name)
    path = raw_dir / filename
    if code != 0 or not path.exists():
        raise RuntimeError(
            f"vllm bench serve against {target.name} at concurrency {concurrency} "
            f"{'timed out' if code is None else f'exited {code}'}; log {procs.logs[name]}:\n{tail}"
        )
    data = json.loads(path.read_text())
    row: dict[str, Any] = {
        "target": target.name,
        "concurrency": concurrency,
        "round": round_no,
        "num_prompts": num_prompts,
        "raw": str(path),
    }
    row.update({k: data.get(k) for k in BENCH_KEYS})
    errors = [e for e in data.get("errors", []) if e]
    row["error_samples"] = errors[:3]
    gaps = [g for itl in data.get("itls") or [] for g in itl]
    row["burst_share"] = sum(1 for g in gaps if g < BURST_S) / len(gaps) if gaps else None
    mean_out = (row["total_output_tokens"] or 0) / row["completed"] if row.get("completed") else None
    e2el = row.get("median_e2el_ms")
    row["e2e_tok_s_per_user"] = 1000.0 * mean_out / e2el if mean_out and e2el else None
    row.update(inside.finish())  # (bench's ready-check and warm-up requests are in these means too)
    if probe is not None:
        row.update(probe.finish())
    for t in target.processes:  # a server that died during the run makes the run meaningless
        procs.check([t])
    return row


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (target, concurrency): the median over rounds of each bench statistic; tok/s from the median TPOT."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["target"], row["concurrency"]), []).append(row)
    agg: dict[tuple[str, int], dict[str, Any]] = {}
    for key, group in groups.items():
        a: dict[str, Any] = {
            k: median([r.get(k) for r in group])
            for k in BENCH_KEYS + ROUTER_KEYS + VLLM_KEYS + ("burst_share", "e2e_tok_s_per_user")
        }
        a["failed"] = sum(int(r.get("failed") or 0) for r in group)
        a["completed"] = sum(int(r.get("completed") or 0) for r in group)
        a["rounds"] = len(group)
        tpot = a.get("median_tpot_ms")
        a["tok_s_per_user"] = 1000.0 / tpot if tpot else None
        tpots = [1000.0 / r["median_tpot_ms"] for r in group if r.get("median_tpot_ms")]
        a["tok_s_per_user_range"] = (min(tpots), max(tpots)) if tpots else None
        agg[key] = a
    return agg


def run_e2e(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    raw_dir = args.log_dir / "bench"
    raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"starting {', '.join(args.targets)} (logs in {args.log_dir})", flush=True)
    targets, started, health = start_servers(args, procs, model)
    startup = wait_healthy(procs, health, args.startup_timeout_s)
    agreement = agreement_check(targets, model)
    print(
        "agreement (greedy, 32 tokens, vs "
        + agreement["reference"]
        + "): "
        + ", ".join(f"{n} {v}" for n, v in agreement["agree"].items()),
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    order = [t for t in TARGETS if t in targets]
    for r in range(args.rounds):
        for c in args.concurrency:
            rot = order[r % len(order) :] + order[: r % len(order)]
            for t in rot:
                t0 = time.monotonic()
                row = run_bench(args, procs, targets[t], model, c, r, raw_dir)
                row["order"] = rot.index(t)
                row["load_before"] = os.getloadavg()[0]
                rows.append(row)
                print(
                    f"  round {r} C={c:<3} {t:<8} TTFT p50 {fmt(row['median_ttft_ms'])} ms  TPOT p50 "
                    f"{fmt(row['median_tpot_ms'], 2)} ms  ITL p50 {fmt(row['median_itl_ms'], 2)} ms  "
                    f"failed {row['failed']}  ({time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
    agg = aggregate(rows)
    table = e2e_tables(agg, order, args.concurrency)
    cond["loadavg_end"] = os.getloadavg()
    return {
        "mode": "e2e",
        "conditions": cond,
        "settings": settings(args),
        "servers": started,
        "startup_s": startup,
        "agreement": agreement,
        "runs": rows,
        "summary": [{"target": t, "concurrency": c, **a} for (t, c), a in agg.items()],
        "table": table,
    }
