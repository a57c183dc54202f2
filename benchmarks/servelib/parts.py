"""The serving path's processes on loopback, one shared secret: the prefill stand-in (this benchmark's
``--serve-standin`` mode), the real decode node (``tilert decode``) and the real router (``tilert router``), their
commands made as ``tilert up`` makes them (:mod:`tilert.stack`), each supervised by :mod:`e2elib.procs`."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from e2elib.procs import Procs, wait_healthy

from tilert import stack
from tilert.netio import free_port


@dataclass(frozen=True)
class Layout:
    """What the parts are started with."""

    model: Path
    device: str  # the node's
    prefill_device: str  # the stand-in's
    dtype: str
    kv_layout: str
    transport: str
    transport_options: dict[str, object]
    max_model_len: int
    max_sequences: int
    drafts: int | None  # the node's --num-speculative-tokens (None: its default)
    accept_all_drafts: bool = False  # the node's --accept-all-drafts (benchmarks only)
    draft_head: str = "model"  # the node's --draft-head
    draft_vocab: int | None = None  # the node's --draft-vocab: token ids 0..draft_vocab - 1 (None: every token)


def stack_config(lay: Layout) -> stack.StackConfig:
    """``tilert up``'s configuration of this stack (its prefill is the stand-in, on ``prefill_port``)."""
    ports = {
        "port": free_port(),
        "prefill_port": free_port(),
        "ctrl_port": free_port(),
        "decode_http_port": free_port(),
    }
    return stack.StackConfig(
        model=lay.model,
        dtype=lay.dtype,
        max_model_len=lay.max_model_len,
        transport=lay.transport,
        engine_process=lay.device == "cpu",  # as tilert up on a CPU host: the node's HTTP loop off the engine's GIL
        **ports,
    ).validate()


def commands(lay: Layout, cfg: stack.StackConfig, script: Path) -> dict[str, list[str]]:
    standin = [
        sys.executable,
        str(script),
        "--serve-standin",
        str(cfg.prefill_port),
        "--model",
        str(lay.model),
        "--device",
        lay.prefill_device,
        "--dtype",
        lay.dtype,
        "--kv-layout",
        lay.kv_layout,
        "--max-model-len",
        str(lay.max_model_len),
        "--max-sequences",
        str(lay.max_sequences),
        "--transport",
        lay.transport,
        "--transport-options",
        json.dumps(lay.transport_options),
    ]
    decode = [*stack.decode_command(cfg), "--device", lay.device, "--max-sequences", str(lay.max_sequences)]
    if lay.drafts is not None:
        decode += ["--num-speculative-tokens", str(lay.drafts)]
    if lay.accept_all_drafts:
        decode += ["--accept-all-drafts"]
    if lay.draft_head != "model":
        decode += ["--draft-head", lay.draft_head]
    if lay.draft_vocab:
        vocab = Path(tempfile.gettempdir()) / f"tilert-draft-vocab-{lay.draft_vocab}.json"
        vocab.write_text(json.dumps(list(range(lay.draft_vocab))))
        decode += ["--draft-vocab", str(vocab)]
    return {"standin": standin, "decode": decode, "router": stack.router_command(cfg)}


def start(
    procs: Procs, lay: Layout, script: Path, secret_file: Path, timeout_s: float
) -> tuple[stack.StackConfig, dict]:
    """Every part started and answering ``/health``; the config and each part's URL."""
    cfg = stack_config(lay)
    env = _env(lay, script, secret_file)
    for name, cmd in commands(lay, cfg, script).items():
        procs.start(name, cmd, env)
    urls = _urls(cfg)
    wait_healthy(procs, urls, timeout_s)
    return cfg, urls


def restart_node(
    procs: Procs, lay: Layout, cfg: stack.StackConfig, script: Path, secret_file: Path, timeout_s: float
) -> None:
    """The decode node (and the router, which then finds it fresh) started again as ``lay`` says, on the same
    ports, beside the stand-in that keeps running."""
    env = _env(lay, script, secret_file)
    cmds = commands(lay, cfg, script)
    for name in ("router", "decode"):
        procs.stop(name)
    for name in ("decode", "router"):
        procs.start(name, cmds[name], env)
    urls = _urls(cfg)
    wait_healthy(procs, {name: urls[name] for name in ("decode", "router")}, timeout_s)


def _env(lay: Layout, script: Path, secret_file: Path) -> dict[str, str]:
    env = stack.child_env(secret_file)
    if lay.transport in ("nixl", "mooncake"):
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("MC_LOG_LEVEL", "WARNING")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(script.parent.parent), env.get("PYTHONPATH", "")) if p)
    return env


def _urls(cfg: stack.StackConfig) -> dict[str, str]:
    return {
        "standin": f"http://127.0.0.1:{cfg.prefill_port}",
        "decode": f"http://127.0.0.1:{cfg.decode_http_port}",
        "router": f"http://127.0.0.1:{cfg.port}",
    }
