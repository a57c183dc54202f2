"""The end-to-end targets and how each is started: the stack as ``tilert up`` starts and places it, plain vLLM
alone (twice: its default OpenMP threads and one), the stack's prefill vLLM answering by itself."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from e2elib.procs import Procs, parse_cpus
from tilert import stack
from tilert.cpus import allowed_cpus, parse_cpu_list
from tilert.netio import free_port

KV_CACHE_BYTES = 134_217_728  # each vLLM's KV cache
MAX_MODEL_LEN = 2048
TARGETS = ("router", "vllm", "vllm1", "prefill")
TARGET_LABELS = {
    "router": "tilert router (prefill vLLM + decode node)",
    "vllm": "vLLM alone (compiled, in-process executor)",
    "vllm1": "vLLM alone (compiled, in-process executor, one OpenMP thread: OMP_NUM_THREADS=1)",
    "prefill": "the stack's prefill vLLM answering by itself (eager unless --prefill-compiled)",
}


@dataclass
class Target:
    name: str
    url: str
    processes: list[str]
    vllm_url: str  # the vLLM that computes this target's first tokens (the router's: the stack's prefill)


# vLLM alone runs its model in the engine-core process (the in-process executor, the default on one GPU), not in
# the worker process its CPU platform picks: that worker spins on ``sched_yield`` for a second after every step
# (``shm_broadcast.SpinCondition``), taking CPU time from the other processes. ``tilert up`` runs the stack's prefill
# so too on a CPU host (``--no-prefill-in-process``: the worker). Both need ``stack.IN_PROCESS_EXECUTOR_ENV``.


def vllm_alone_command(model: Path, port: int, dtype: str) -> list[str]:
    """Plain vLLM in its fastest CPU configuration: compiled (no --enforce-eager), native RoPE for MLA, the model
    in the engine-core process (its environment needs ``stack.IN_PROCESS_EXECUTOR_ENV``)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--compilation-config",
        json.dumps(stack.CPU_PREFILL_COMPILATION_CONFIG),
        "--distributed-executor-backend",
        "uni",
    ]


def start_servers(
    args: argparse.Namespace, procs: Procs, model: Path
) -> tuple[dict[str, Target], dict[str, Any], dict[str, str]]:
    """Start what the targets need, at once; returns the targets, what was started how, and each server's URL."""
    targets = args.targets
    started: dict[str, Any] = {}
    out: dict[str, Target] = {}
    health: dict[str, str] = {}
    need_stack = "router" in targets or "prefill" in targets
    if need_stack:
        cfg = stack.StackConfig(
            model=model,
            port=free_port(),
            prefill_port=free_port(),
            ctrl_port=free_port(),
            decode_http_port=free_port(),
            dtype=args.dtype,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_bytes=KV_CACHE_BYTES,
            prefill_compiled=args.prefill_compiled,
            prefill_in_process=args.prefill_in_process,
            engine_process=args.engine_process,
            engine_cpus=_stack_engine_cpus(args),
        )
        rest = set(stack.cpu_plan(cfg).rest) if args.stack_pin else set()  # as tilert up --engine-cpus
        secret_file = stack.write_secret_file()
        args._cleanup.append(lambda: shutil.rmtree(secret_file.parent, ignore_errors=True))
        base = stack.child_env(secret_file)
        names = ["prefill", "decode", "router"] if "router" in targets else ["prefill"]
        commands = {
            "prefill": stack.prefill_command(cfg),
            "decode": stack.decode_command(cfg),
            "router": stack.router_command(cfg),
        }
        envs = {
            "prefill": {
                **base,
                **stack.prefill_env(cfg),
                **({"VLLM_CPU_OMP_THREADS_BIND": args.prefill_cpus} if args.prefill_cpus else {}),
            },
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
            started[name] = {
                "command": commands[name],
                "cpus": sorted(cpus) if cpus else None,
                "env": {
                    k: v
                    for k, v in envs[name].items()
                    if k.startswith(("VLLM_CPU", "VLLM_ENABLE", "OMP_", "TILERT_DECODE", "TILERT_LOG"))
                },
            }
        urls = stack.Stack(cfg).urls
        health.update({n: urls[n] for n in names})
        if "router" in targets:
            out["router"] = Target("router", urls["router"], names, urls["prefill"])
        if "prefill" in targets:
            out["prefill"] = Target("prefill", urls["prefill"], ["prefill"], urls["prefill"])
    # vLLM alone twice over: its defaults, and one OpenMP thread. In-process, vLLM 0.32 neither sizes nor binds its
    # model's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND only binds a worker process's), so the compiled kernels take
    # one thread per CPU; which of the two serves a user faster depends on the load, so both are measured.
    for name, own in (("vllm", {}), ("vllm1", {"OMP_NUM_THREADS": "1"})):
        if name not in targets:
            continue
        port = free_port()
        cmd = vllm_alone_command(model, port, args.dtype)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("TILERT_SECRET", "OMP_NUM_THREADS"))},
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **stack.IN_PROCESS_EXECUTOR_ENV,
            **own,
        }
        # --stack-pin: vLLM's processes kept off --vllm-cpus (the CPU the stack gives its engine alone).
        rest_vllm = set(allowed_cpus() - parse_cpu_list(args.vllm_cpus)) if args.stack_pin else set()
        procs.start(name, cmd, env, cpus=rest_vllm or None)
        started[name] = {
            "command": cmd,
            "cpus": sorted(rest_vllm) or None,
            "env": {**stack.IN_PROCESS_EXECUTOR_ENV, **own},
        }
        out[name] = Target(name, f"http://127.0.0.1:{port}", [name], f"http://127.0.0.1:{port}")
        health[name] = out[name].url
    return out, started, health


def _stack_engine_cpus(args: argparse.Namespace) -> str | None:
    """The stack's ``engine_cpus`` (``tilert up --engine-cpus``): ``--stack-pin`` gives ``--decode-cpus`` (default:
    the last CPU) to the engine alone; no ``--decode-cpus``: tilert up's default placement; otherwise the stack
    pins nothing and :func:`_decode_env` pins the engine thread alone."""
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
    body = {
        "model": str(model),
        "prompt": "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
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
