"""Router overhead: the real router (``tilert router``) between the stand-ins of :mod:`tilert.testing.standins`
(each served in a process of its own by ``e2e.py --standin``), driven by :mod:`e2elib.load` at each concurrency,
``direct`` and ``router`` interleaved."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from tokenizers import Tokenizer

from e2elib.conditions import settings
from e2elib.load import LoadClient, drive, overhead_prompt, summarize
from e2elib.probes import RouterProbe
from e2elib.procs import Procs, free_port, parse_cpus, wait_healthy
from e2elib.profiles import profile_table
from e2elib.profiles import summarize as summarize_profile
from e2elib.tables import fmt, overhead_table
from tilert import contracts as c
from tilert.auth import SECRET_ENV, generate_secret, load_secret
from tilert.testing.standins import DecodeStandin, NodeBehaviour, PrefillStandin, Script, printable_ids

E2E = Path(__file__).resolve().parents[1] / "e2e.py"
STANDIN_MAX_SEQ_LEN = 1 << 20
GAP_PATH = "/standin/gap"  # the decode stand-in's gap, set between runs
PROFILED = (  # the profile begins at SIGUSR1 (after the warm-up); its stats are written as the router stops
    "import cProfile, runpy, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # uvicorn raises it again once it has stopped\n"
    "p = cProfile.Profile(time.process_time)  # CPU time: the machine is shared\n"
    "signal.signal(signal.SIGUSR1, lambda *_: p.enable())\n"
    "try:\n"
    "    runpy.run_module('tilert.cli', run_name='__main__')\n"
    "finally:\n"
    "    p.disable()\n"
    "    p.dump_stats({out!r})\n"
)  # the decode stand-in's context: no prompt of the benchmark reaches it


def serve_standin(args: argparse.Namespace) -> int:
    """``e2e.py --standin prefill|decode``: one stand-in on ``--port`` (the secret from the environment); its script
    is tokens of ``--model``'s tokenizer that each make one SSE event through the router. The decode stand-in joins
    the lines that queue while its stream writes, as the node does (at ``--gap-ms 0`` it answers at once), and keeps
    idle connections as long as the node does."""
    secret = load_secret()
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    script = Script(tokenizer, printable_ids(tokenizer))
    keep_alive = 5  # vLLM's (uvicorn's default)
    app: Any
    if args.standin == "prefill":
        app = PrefillStandin(script, secret, str(args.model)).app
    else:
        behaviour = NodeBehaviour(
            slots=args.standin_slots,
            token_gap_s=args.gap_ms[0] / 1000.0,
            max_seq_len=STANDIN_MAX_SEQ_LEN,
            join_behind=True,
        )
        node = DecodeStandin(script, secret, behaviour)

        async def set_gap(request: Request) -> Response:  # the next gap of --gap-ms, between runs
            node.token_gap_s = float((await request.json())["gap_ms"]) / 1000.0
            return Response(status_code=204)

        app = Starlette(routes=[Route(GAP_PATH, set_gap, methods=["POST"]), Mount("/", node.app)])
        keep_alive = int(c.NODE_KEEPALIVE_S)
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=keep_alive,
    )
    return 0


def _router_command(
    args: argparse.Namespace, ports: dict[str, int], port: int, model: Path, profile: Path | None
) -> list[str]:
    """``tilert router`` between the stand-ins (under cProfile into ``profile`` when given)."""
    if profile is not None:  # the stats written as the router stops (cProfile's own -m would not)
        head = ["-c", PROFILED.format(out=str(profile))]
    else:
        head = ["-m", "tilert.cli"]
    return [
        sys.executable,
        *head,
        "router",
        "--prefill-url",
        f"http://127.0.0.1:{ports['prefill']}",
        "--decode",
        f"127.0.0.1:{ports['ctrl']}:{ports['decode']}",
        "--model",
        str(model),
        "--port",
        str(port),
        "--max-queue",
        str(max(256, 2 * max(args.concurrency))),
    ]


def _profile_path(args: argparse.Namespace, mode: str) -> Path | None:
    """Where router ``mode``'s profile goes with ``--router-profile DIR`` (None: not profiled)."""
    return (args.router_profile / f"{mode}.pstats").resolve() if args.router_profile else None


def _profiles(args: argparse.Namespace, procs: Procs, rows: list[dict[str, Any]], routers: list[str]) -> str:
    """Stop each profiled router (its stats are written as it stops) and sum its profile by part
    (:mod:`e2elib.profiles`), per token and request of the measured runs; the markdown table of them."""
    found: dict[str, dict[str, Any]] = {}
    for mode in routers:
        path = _profile_path(args, mode)
        if path is None:
            continue
        procs.stop(mode, grace_s=60.0)
        tokens = sum(r.get("router_tokens") or 0 for r in rows if r["mode"] == mode)
        requests = sum(r.get("router_requests") or 0 for r in rows if r["mode"] == mode)
        found[mode] = summarize_profile(path, tokens, requests)
    args.profiles = found
    return profile_table(found) if found else ""


def _start(args: argparse.Namespace, procs: Procs, model: Path, secret: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The stand-ins and the router(s): ``router`` from this checkout, ``baseline`` from ``--baseline-router``'s (its
    ``tilert`` first on the path), each pinned to ``--router-cpus``. Returns the ports and each server's command."""
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port(), "ctrl": free_port()}
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")},
        SECRET_ENV: secret,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    me = [sys.executable, str(E2E), "--model", str(model)]
    decode_args = ["--gap-ms", str(args.gap_ms[0]), "--standin-slots", str(args.standin_slots)]
    commands = {
        "standin-prefill": me + ["--standin", "prefill", "--port", str(ports["prefill"])],
        "standin-decode": me + ["--standin", "decode", "--port", str(ports["decode"]), *decode_args],
        "router": _router_command(args, ports, ports["router"], model, _profile_path(args, "router")),
    }
    router_env = dict(env)
    if args.router_log_level:
        router_env["TILERT_LOG_LEVEL"] = args.router_log_level
    envs = {"router": router_env}
    if args.baseline_router:
        ports["baseline"] = free_port()
        commands["baseline"] = _router_command(args, ports, ports["baseline"], model, _profile_path(args, "baseline"))
        envs["baseline"] = {**router_env, "PYTHONPATH": str(args.baseline_router.resolve())}
    for name, cmd in commands.items():
        cpus = parse_cpus(args.router_cpus) if name in ("router", "baseline") else None
        procs.start(name, cmd, envs.get(name, env), cpus=cpus)
    return ports, {n: " ".join(cmd) for n, cmd in commands.items()}


def run_overhead(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    secret = generate_secret()
    ports, commands = _start(args, procs, model, secret)
    routers = [m for m in ("router", "baseline") if m in ports]
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("prefill", "decode", *routers)}
    health = {"standin-prefill": urls["prefill"], "standin-decode": urls["decode"], **{m: urls[m] for m in routers}}
    wait_healthy(procs, health, args.startup_timeout_s)
    prompt = overhead_prompt(args.overhead_prompt_words)
    modes = routers if args.skip_direct else ["direct", *routers]
    rows: list[dict[str, Any]] = []

    async def measure() -> None:
        client = LoadClient(model, secret.encode(), urls, ports["ctrl"], prompt, args.overhead_tokens)
        try:
            for mode in modes:  # warm every path (connections, caches)
                await drive(client.path(mode), 4, 8)
            for mode in routers:  # the profiles begin now
                if _profile_path(args, mode) is not None:
                    os.kill(procs.procs[mode].pid, signal.SIGUSR1)
            for gap in args.gap_ms:
                await client.client.post(urls["decode"] + GAP_PATH, json={"gap_ms": gap})
                for r in range(args.rounds):
                    for c in args.concurrency:
                        total = args.overhead_requests or max(64, 2 * c)
                        for mode in modes if r % 2 == 0 else modes[::-1]:
                            rows.append(await _one_run(args, client, procs, mode, urls, (gap, r, c), total))
        finally:
            await client.aclose()

    asyncio.run(measure())
    cond["loadavg_end"] = os.getloadavg()
    table = overhead_table(rows, args.concurrency, args.gap_ms, modes)
    profiled = _profiles(args, procs, rows, routers)
    if profiled:
        table += "\n\nWhere each router's CPU time went in the runs above (cProfile, process CPU time; each part's own "
        table += "time; the profiler's own cost inflates the many small calls):\n\n" + profiled
    return {
        "mode": "router-overhead",
        "conditions": cond,
        "settings": settings(args),
        "servers": {n: {"command": cmd} for n, cmd in commands.items()},
        "runs": rows,
        "profiles": getattr(args, "profiles", {}),
        "table": table,
    }


async def _one_run(
    args: argparse.Namespace,
    client: LoadClient,
    procs: Procs,
    mode: str,
    urls: dict[str, str],
    at: tuple[float, int, int],
    total: int,
) -> dict[str, Any]:
    """One run of ``total`` requests by one path, ``at`` (the stand-in's gap, the round, the streams at once); its
    row."""
    gap, r, c = at
    probe = RouterProbe(urls[mode], procs.procs[mode].pid) if mode != "direct" else None
    cpu0 = time.process_time()
    samples, wall = await drive(client.path(mode), c, total)
    row = {"mode": mode, "gap_ms": gap, "concurrency": c, "round": r, **summarize(samples, wall)}
    row["client_cpu_ms_per_request"] = 1000 * (time.process_time() - cpu0) / max(1, len(samples))
    row["nominal_tokens_per_s"] = c * 1000.0 / gap if gap else None
    if probe is not None:
        row.update(probe.finish())
        # the router's CPU time over the run's wall time (1: its core was the bottleneck), and the tokens it would
        # relay in one CPU second at this run's CPU time per token
        row["router_cpu_share"] = row["router_cpu_s"] / wall if wall else None
        per_token = row.get("router_cpu_us_per_token")
        row["router_tokens_per_cpu_s"] = 1e6 / per_token if per_token else None
    print(
        f"  gap {gap:g} ms round {r} streams={c:<4} {mode:<8} TTFB p50 {fmt(row['ttfb_p50_ms'], 2)} ms p99 "
        f"{fmt(row['ttfb_p99_ms'], 2)} ms  ITL p50 {fmt(row['itl_p50_ms'], 2)} ms p99 "
        f"{fmt(row['itl_p99_ms'], 2)} ms  tok/s {fmt(row['tokens_per_s'], 0)}  tokens/event "
        f"{fmt(row['tokens_per_event'], 2)}  router CPU/token {fmt(row.get('router_cpu_us_per_token'), 1)} us "
        f"(CPU share {fmt(row.get('router_cpu_share'), 2)})  "
        f"errors {row['errors']}  ({wall:.1f} s)",
        flush=True,
    )
    procs.check()
    return row
