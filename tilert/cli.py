"""The ``tilert`` command: ``tiny-model``, ``decode``, ``router``, ``up``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tilert.logs import configure


def _tiny_model(args: argparse.Namespace) -> int:
    from tilert.models.tiny import build_tiny_model

    out = build_tiny_model(args.arch, args.out, seed=args.seed)
    print(out)
    return 0


def _decode(args: argparse.Namespace) -> int:
    from tilert.decode.server import DecodeConfig, serve

    problems = [
        f"{what} ({value})"
        for what, value, ok in (
            ("--model must hold a config.json", args.model, (Path(args.model) / "config.json").is_file()),
            ("--slots must be >= 1", args.slots, args.slots >= 1),
            ("--max-seq-len must be >= 2", args.max_seq_len, args.max_seq_len >= 2),
            ("--num-speculative-tokens must be in 0..8", args.num_speculative_tokens, 0 <= args.num_speculative_tokens <= 8),
            ("--lease-s must be > 0", args.lease_s, args.lease_s > 0),
            ("--transfer-timeout-s must be > 0", args.transfer_timeout_s, args.transfer_timeout_s > 0),
            ("--ctrl-port and --http-port must differ", args.ctrl_port, args.ctrl_port != args.http_port),
        )
        if not ok
    ]
    if problems:
        raise SystemExit("tilert decode: " + "; ".join(problems))
    try:
        options = json.loads(args.transport_options) if args.transport_options else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--transport-options is not JSON: {exc}") from None
    serve(
        DecodeConfig(
            model=Path(args.model), engine=args.engine, transport=args.transport, transport_options=options,
            host=args.host, ctrl_port=args.ctrl_port, http_port=args.http_port, device=args.device,
            dtype=args.dtype, max_seq_len=args.max_seq_len, num_slots=args.slots, lease_s=args.lease_s,
            transfer_timeout_s=args.transfer_timeout_s, num_speculative_tokens=args.num_speculative_tokens,
        )
    )  # fmt: skip
    return 0


def _router(args: argparse.Namespace) -> int:
    from tilert.router.app import serve
    from tilert.router.config import ConfigError, RouterConfig, parse_decode_spec

    try:
        config = RouterConfig(
            prefill_url=args.prefill_url,
            decode_nodes=[parse_decode_spec(spec) for spec in args.decode],
            model_dir=args.model,
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            max_model_len=args.max_model_len,
            queue_timeout_s=args.queue_timeout_s,
            max_queue=args.max_queue,
        ).validate()
    except ConfigError as exc:
        raise SystemExit(f"tilert router: {exc}") from None
    serve(config, log_level="warning")
    return 0


def _up(args: argparse.Namespace) -> int:
    from tilert.stack import StackConfig, run

    return run(
        StackConfig(
            model=Path(args.model), port=args.port, prefill_port=args.prefill_port, ctrl_port=args.ctrl_port,
            decode_http_port=args.decode_http_port, host=args.host, dtype=args.dtype,
            max_model_len=args.max_model_len, engine=args.engine, transport=args.transport,
        )
    )  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tilert", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="write a seeded tiny random checkpoint + tokenizer")
    tiny.add_argument("--arch", required=True, choices=["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
    tiny.add_argument("--out", required=True, type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny_model)

    dec = sub.add_parser("decode", help="run a decode node")
    dec.add_argument("--model", required=True)
    dec.add_argument("--engine", default="tilert")
    dec.add_argument("--transport", default="tcp")
    dec.add_argument("--transport-options", default="", help="JSON object passed to the transport")
    dec.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    dec.add_argument("--ctrl-port", type=int, default=5556)
    dec.add_argument("--http-port", type=int, default=5557)
    dec.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    dec.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    dec.add_argument("--max-seq-len", type=int, default=4096)
    dec.add_argument("--slots", type=int, default=2, help="receive buffers: transfers overlap the running decode")
    dec.add_argument("--lease-s", type=float, default=30.0)
    dec.add_argument("--transfer-timeout-s", type=float, default=15.0)
    dec.add_argument(
        "--num-speculative-tokens", type=int, default=1,
        help="MTP drafts per step for greedy requests when the checkpoint has an MTP layer (0: off; on the "
        "H200 one draft pays once more than ~0.9 tokens per step are accepted, see benchmarks/results)",
    )  # fmt: skip
    dec.set_defaults(func=_decode)

    rt = sub.add_parser("router", help="run the OpenAI-compatible router")
    rt.add_argument("--prefill-url", required=True)
    rt.add_argument("--decode", action="append", required=True, metavar="HOST:CTRL:HTTP")
    rt.add_argument("--model", required=True)
    rt.add_argument("--served-model-name", default=None)
    rt.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    rt.add_argument("--port", type=int, default=23333)
    rt.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    rt.add_argument("--max-model-len", type=int, default=None, help="refuse prompt + max_tokens beyond this")
    rt.add_argument("--queue-timeout-s", type=float, default=30.0, help="FIFO wait for a slot before 429")
    rt.add_argument("--max-queue", type=int, default=256, help="requests waiting beyond this get 429 at once")
    rt.set_defaults(func=_router)

    up = sub.add_parser("up", help="prefill (stock vLLM) + decode + router on this machine")
    up.add_argument("--model", required=True)
    up.add_argument("--port", type=int, default=8000, help="router port")
    up.add_argument("--prefill-port", type=int, default=8100)
    up.add_argument("--ctrl-port", type=int, default=5556)
    up.add_argument("--decode-http-port", type=int, default=5557)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--dtype", default="float32", help="float32 (CPU default) or bfloat16")
    up.add_argument("--max-model-len", type=int, default=2048)
    up.add_argument("--engine", default="tilert")
    up.add_argument("--transport", default="tcp")
    up.set_defaults(func=_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    configure()
    args = parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
