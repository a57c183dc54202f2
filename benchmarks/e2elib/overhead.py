"""Router overhead: the real router (``tilert router``) between the stand-ins of :mod:`tilert.testing.standins`
(each served in a process of its own by ``e2e.py --standin``), driven by :mod:`e2elib.load` at each concurrency,
``direct`` and ``router`` interleaved."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from tokenizers import Tokenizer

from e2elib.conditions import settings
from e2elib.load import LoadClient, drive, overhead_prompt, summarize
from e2elib.probes import RouterProbe
from e2elib.procs import Procs, free_port, parse_cpus, wait_healthy
from e2elib.tables import fmt, overhead_table
from tilert.auth import SECRET_ENV, generate_secret, load_secret
from tilert.testing.standins import DecodeStandin, NodeBehaviour, PrefillStandin, Script, printable_ids

E2E = Path(__file__).resolve().parents[1] / "e2e.py"
STANDIN_MAX_SEQ_LEN = 1 << 20  # the decode stand-in's context: no prompt of the benchmark reaches it


def serve_standin(args: argparse.Namespace) -> int:
    """``e2e.py --standin prefill|decode``: one stand-in on ``--port`` (the secret from the environment); its script
    is tokens of ``--model``'s tokenizer that each make one SSE event through the router."""
    secret = load_secret()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    script = Script(tokenizer, printable_ids(tokenizer))
    if args.standin == "prefill":
        app = PrefillStandin(script, secret, str(args.model)).app
    else:
        behaviour = NodeBehaviour(
            slots=args.standin_slots, token_gap_s=args.gap_ms / 1000.0, max_seq_len=STANDIN_MAX_SEQ_LEN
        )
        app = DecodeStandin(script, secret, behaviour).app
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, backlog=4096)
    return 0


def run_overhead(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    secret = generate_secret()
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port(), "ctrl": free_port()}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")},
        SECRET_ENV: secret,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    me = [sys.executable, str(E2E), "--model", str(model)]
    commands = {
        "standin-prefill": me + ["--standin", "prefill", "--port", str(ports["prefill"])],
        "standin-decode": me
        + [
            "--standin",
            "decode",
            "--port",
            str(ports["decode"]),
            "--gap-ms",
            str(args.gap_ms),
            "--standin-slots",
            str(args.standin_slots),
        ],
        "router": [
            sys.executable,
            "-m",
            "tilert.cli",
            "router",
            "--prefill-url",
            f"http://127.0.0.1:{ports['prefill']}",
            "--decode",
            f"127.0.0.1:{ports['ctrl']}:{ports['decode']}",
            "--model",
            str(model),
            "--port",
            str(ports["router"]),
            "--max-queue",
            str(max(256, 2 * max(args.concurrency))),
        ],
    }
    router_env = dict(env)
    if args.router_log_level:
        router_env["TILERT_LOG_LEVEL"] = args.router_log_level
    for name, cmd in commands.items():
        cpus = parse_cpus(args.router_cpus) if name == "router" else None
        procs.start(name, cmd, router_env if name == "router" else env, cpus=cpus)
    urls = {
        "prefill": f"http://127.0.0.1:{ports['prefill']}",
        "decode": f"http://127.0.0.1:{ports['decode']}",
        "router": f"http://127.0.0.1:{ports['router']}",
    }
    health = {"standin-prefill": urls["prefill"], "standin-decode": urls["decode"], "router": urls["router"]}
    wait_healthy(procs, health, args.startup_timeout_s)
    prompt = overhead_prompt(args.overhead_prompt_words)
    router_pid = procs.procs["router"].pid
    rows: list[dict[str, Any]] = []

    async def measure() -> None:
        client = LoadClient(model, secret.encode(), urls, ports["ctrl"], prompt, args.overhead_tokens)
        try:
            for mode in ("direct", "router"):  # warm both paths (connections, caches)
                await drive(getattr(client, "routed" if mode == "router" else "direct"), 4, 8)
            for r in range(args.rounds):
                for c in args.concurrency:
                    total = args.overhead_requests or max(64, 2 * c)
                    modes = ("direct", "router") if r % 2 == 0 else ("router", "direct")
                    for mode in modes:
                        probe = RouterProbe(urls["router"], router_pid) if mode == "router" else None
                        cpu0 = time.process_time()
                        samples, wall = await drive(client.routed if mode == "router" else client.direct, c, total)
                        row = {"mode": mode, "concurrency": c, "round": r, **summarize(samples, wall)}
                        row["client_cpu_ms_per_request"] = 1000 * (time.process_time() - cpu0) / max(1, len(samples))
                        row["nominal_tokens_per_s"] = c * 1000.0 / args.gap_ms if args.gap_ms else None
                        if probe is not None:
                            row.update(probe.finish())
                        rows.append(row)
                        print(
                            f"  round {r} streams={c:<4} {mode:<6} TTFB p50 {fmt(row['ttfb_p50_ms'], 2)} ms p99 "
                            f"{fmt(row['ttfb_p99_ms'], 2)} ms  ITL p50 {fmt(row['itl_p50_ms'], 2)} ms p99 "
                            f"{fmt(row['itl_p99_ms'], 2)} ms  errors {row['errors']}  ({wall:.1f} s)",
                            flush=True,
                        )
                        procs.check()
        finally:
            await client.aclose()

    asyncio.run(measure())
    cond["loadavg_end"] = os.getloadavg()
    table = overhead_table(rows, args.concurrency, args.gap_ms)
    return {
        "mode": "router-overhead",
        "conditions": cond,
        "settings": settings(args),
        "servers": {n: {"command": c} for n, c in commands.items()},
        "runs": rows,
        "table": table,
    }
