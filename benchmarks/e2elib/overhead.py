"""Router overhead: the real router (``tilert router``) between the stand-ins of :mod:`tilert.testing.standins`
(each served in a process of its own by ``e2e.py --standin``), driven by :mod:`e2elib.load` in the client processes
of :mod:`e2elib.clients` at each concurrency, ``direct`` and ``router`` interleaved. Each run records the CPU share
of the router, of the busiest client process and of each stand-in: the one near 1 is what capped the run."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from tokenizers import Tokenizer

from e2elib.clients import ClientProcs, ClientSpec
from e2elib.conditions import settings
from e2elib.load import overhead_prompt, summarize
from e2elib.probes import RouterProbe
from e2elib.procs import Procs, parse_cpus, process_cpu_s, wait_healthy
from e2elib.profiles import profile_table
from e2elib.profiles import summarize as summarize_profile
from e2elib.tables import fmt, overhead_table
from tilert import contracts as c
from tilert.auth import SECRET_ENV, generate_secret, load_secret
from tilert.netio import free_port
from tilert.testing.standins import (
    DecodeStandin,
    NodeBehaviour,
    PrefillBehaviour,
    PrefillStandin,
    Script,
    printable_ids,
)

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
        app = PrefillStandin(script, secret, str(args.model), PrefillBehaviour(delay_s=args.prefill_ms / 1000.0)).app
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


def _decode_names(args: argparse.Namespace) -> list[str]:
    """The decode stand-ins' names (``--standin-decode-procs``): ``decode``, ``decode-1``, ..."""
    return ["decode", *(f"decode-{i}" for i in range(1, max(1, args.standin_decode_procs)))]


def _router_command(
    args: argparse.Namespace, ports: dict[str, int], port: int, model: Path, profile: Path | None
) -> list[str]:
    """``tilert router`` between the stand-ins, every decode stand-in a node of its pool (under cProfile into
    ``profile`` when given)."""
    if profile is not None:  # the stats written as the router stops (cProfile's own -m would not)
        head = ["-c", PROFILED.format(out=str(profile))]
    else:
        head = ["-m", "tilert.cli"]
    nodes = [arg for d in _decode_names(args) for arg in ("--decode", f"127.0.0.1:{ports['ctrl-' + d]}:{ports[d]}")]
    return [
        sys.executable,
        *head,
        "router",
        "--prefill-url",
        f"http://127.0.0.1:{ports['prefill']}",
        *nodes,
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
    ``tilert`` first on the path), each pinned to ``--router-cpus``; each stand-in on a CPU of ``--standin-cpus`` in
    turn (the decode stand-ins first, then the prefill). Returns the ports and each server's command."""
    decodes = _decode_names(args)
    if args.router_profile:
        args.router_profile.mkdir(parents=True, exist_ok=True)
    ports = {name: free_port() for name in ("prefill", "router", *decodes, *(f"ctrl-{d}" for d in decodes))}
    ports["ctrl"] = ports["ctrl-decode"]  # the first node's, as the direct path claims for it
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")},
        SECRET_ENV: secret,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    me = [sys.executable, str(E2E), "--model", str(model)]
    decode_args = ["--gap-ms", str(args.gap_ms[0]), "--standin-slots", str(args.standin_slots)]
    commands = {f"standin-{d}": me + ["--standin", "decode", "--port", str(ports[d]), *decode_args] for d in decodes}
    commands["standin-prefill"] = me + ["--standin", "prefill", "--port", str(ports["prefill"])]
    commands["router"] = _router_command(args, ports, ports["router"], model, _profile_path(args, "router"))
    router_env = dict(env)
    if args.router_log_level:
        router_env["TILERT_LOG_LEVEL"] = args.router_log_level
    envs = {"router": router_env}
    if args.baseline_router:
        ports["baseline"] = free_port()
        commands["baseline"] = _router_command(args, ports, ports["baseline"], model, _profile_path(args, "baseline"))
        envs["baseline"] = {**router_env, "PYTHONPATH": str(args.baseline_router.resolve())}
    standin_cpus = sorted(parse_cpus(args.standin_cpus) or ())
    for i, (name, cmd) in enumerate(commands.items()):  # the stand-ins come first, in the order above
        cpus = parse_cpus(args.router_cpus) if name in ("router", "baseline") else None
        if name.startswith("standin-") and standin_cpus:
            cpus = {standin_cpus[i % len(standin_cpus)]}
        procs.start(name, cmd, envs.get(name, env), cpus=cpus)
    return ports, {n: " ".join(cmd) for n, cmd in commands.items()}


def _check_cpus(args: argparse.Namespace) -> None:
    """Every CPU the placement options name is one this process may run on (else the children fail to start)."""
    allowed = os.sched_getaffinity(0)
    for option in ("router_cpus", "standin_cpus", "client_cpus"):
        wanted = parse_cpus(getattr(args, option)) or set()
        if not wanted <= allowed:
            flag = "--" + option.replace("_", "-")
            raise RuntimeError(
                f"{flag} names CPUs {sorted(wanted - allowed)} outside this machine's usable CPUs {sorted(allowed)}"
            )


def run_overhead(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    _check_cpus(args)
    secret = generate_secret()
    ports, commands = _start(args, procs, model, secret)
    routers = [m for m in ("router", "baseline") if m in ports]
    decodes = _decode_names(args)
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ("prefill", *decodes, *routers)}
    health = {f"standin-{n}": urls[n] for n in ("prefill", *decodes)} | {m: urls[m] for m in routers}
    wait_healthy(procs, health, args.startup_timeout_s)
    prompt = overhead_prompt(args.overhead_prompt_words)
    modes = routers if args.skip_direct else ["direct", *routers]
    rows: list[dict[str, Any]] = []
    spec = ClientSpec(str(model), secret.encode(), urls, ports["ctrl"], prompt, args.overhead_tokens, args.client)
    client_cpus = sorted(parse_cpus(args.client_cpus) or ()) or None
    with ClientProcs(spec, args.client_procs, client_cpus) as clients:
        for mode in modes:  # warm every path (connections, caches) in every client process
            clients.run(mode, 4 * clients.count, 8 * clients.count)
        for mode in routers:  # the profiles begin now
            if _profile_path(args, mode) is not None:
                os.kill(procs.procs[mode].pid, signal.SIGUSR1)
        for gap in args.gap_ms:
            for d in decodes:
                httpx.post(urls[d] + GAP_PATH, json={"gap_ms": gap}, timeout=10.0).raise_for_status()
            for r in range(args.rounds):
                for c in args.concurrency:
                    total = args.overhead_requests or max(64, 2 * c)
                    for mode in modes if r % 2 == 0 else modes[::-1]:
                        rows.append(_one_run(args, clients, procs, mode, urls, (gap, r, c), total))
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


def _one_run(
    args: argparse.Namespace,
    clients: ClientProcs,
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
    standins = {name: proc.pid for name, proc in procs.procs.items() if name.startswith("standin-")}
    standin_cpu0 = {name: process_cpu_s(pid) for name, pid in standins.items()}
    run = clients.run(mode, c, total)
    samples, wall = run.samples, run.wall_s
    row = {"mode": mode, "gap_ms": gap, "concurrency": c, "round": r, **summarize(samples, wall)}
    row["client_procs"] = len(run.cpu_s)
    row["client_cpu_ms_per_request"] = 1000 * sum(run.cpu_s) / max(1, len(samples))
    row["client_cpu_share_max"] = max(run.cpu_share)  # the busiest client process's
    shares = {name: (process_cpu_s(pid) - standin_cpu0[name]) / wall if wall else 0.0 for name, pid in standins.items()}
    row["standin_cpu_shares"] = shares  # each stand-in's CPU time over the run's wall time
    row["standin_prefill_cpu_share"] = shares.pop("standin-prefill")
    row["standin_decode_cpu_share"] = max(shares.values())  # the busiest decode stand-in's
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
        f"(CPU share {fmt(row.get('router_cpu_share'), 2)})  CPU share: busiest client "
        f"{fmt(row['client_cpu_share_max'], 2)}, decode stand-in {fmt(row['standin_decode_cpu_share'], 2)}  "
        f"errors {row['errors']}  ({wall:.1f} s)",
        flush=True,
    )
    procs.check()
    return row
