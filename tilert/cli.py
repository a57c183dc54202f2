"""The ``tilert`` command: ``tiny-model``, ``convert``, ``decode``, ``router``, ``up``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tilert.decode.config import DecodeConfig, load_decode_config
from tilert.logs import configure
from tilert.plugins import PluginError
from tilert.router.config import (
    CONFIG_ENV,
    ConfigError,
    RouterConfig,
    add_config_arguments,
    cli_values,
    load_router_config,
)


def _tiny_model(args: argparse.Namespace) -> int:
    from tilert.models.tiny import build_tiny_model

    out = build_tiny_model(args.arch, args.out, seed=args.seed)
    print(out)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from tilert.engines.tilert.convert import convert

    try:
        out = convert(args.model_dir, args.out, tp=args.tp, progress=not args.quiet)
    except (ValueError, OSError) as exc:  # a checkpoint or destination it cannot convert: say why, exit 2
        print(f"tilert convert: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def decode_config(args: argparse.Namespace) -> DecodeConfig:
    """``tilert decode``'s config: its flags over ``TILERT_DECODE_*`` over the defaults (raises ConfigError)."""
    return load_decode_config(cli_values(DecodeConfig, args))


def router_config(args: argparse.Namespace) -> RouterConfig:
    """``tilert router``'s config: flags > ``TILERT_ROUTER_*`` > TOML (``--config`` / ``$TILERT_ROUTER_CONFIG``)
    > defaults (raises ConfigError)."""
    toml_path = args.config or os.environ.get(CONFIG_ENV) or None
    return load_router_config(cli_values(RouterConfig, args), toml_path=toml_path)


def _decode(args: argparse.Namespace) -> int:
    config = decode_config(args)
    from tilert.decode.server import serve

    serve(config)
    return 0


def _router(args: argparse.Namespace) -> int:
    config = router_config(args)
    from tilert.router.app import serve

    serve(config, log_level="warning")
    return 0


def _up(args: argparse.Namespace) -> int:
    from tilert.stack import StackConfig, run

    return run(
        StackConfig(
            model=Path(args.model), port=args.port, prefill_port=args.prefill_port, ctrl_port=args.ctrl_port,
            decode_http_port=args.decode_http_port, host=args.host, dtype=args.dtype,
            max_model_len=args.max_model_len, engine=args.engine, transport=args.transport,
            reserve_lease_s=args.reserve_lease_s, secret_file=args.secret_file, prefill_compiled=args.prefill_compiled,
            prefill_in_process=args.prefill_in_process, engine_process=args.engine_process,
            engine_cpus=args.engine_cpus, native=args.native,
            native_engine=args.native_engine,
            native_port=args.native_port, prefill_side_port=args.prefill_side_port,
            native_side_port=args.native_side_port, overflow_wait_s=args.overflow_wait_s,
        )
    )  # fmt: skip


class _SecretFlag(argparse.Action):
    """A flag that would put a secret on the command line (``ps`` shows it to every user): refused."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        self.advice = str(kwargs.pop("advice"))
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: object, values: object, option: str | None = None
    ) -> None:
        parser.error(f"{option} is not accepted: secrets never go on a command line; {self.advice}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tilert", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="write a seeded tiny random checkpoint + tokenizer")
    tiny.add_argument("--arch", required=True, choices=["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
    tiny.add_argument("--out", required=True, type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny_model)

    conv = sub.add_parser(
        "convert", help="convert an HF checkpoint (bf16 or block-FP8) to the decode engine's fused layout",
        allow_abbrev=False,
        description="Stream an HF checkpoint tensor by tensor into the engine's fused layout (shards + "
        "tilert_manifest.json); the decode node loads the result memory-mapped.",
    )  # fmt: skip
    conv.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint (config.json + *.safetensors)")
    conv.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    conv.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel ranks: one shard set per rank, what `tilert decode --tp N` loads")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)

    dec = sub.add_parser(
        "decode", help="run a decode node", allow_abbrev=False,
        description="Run a decode node. Every option also reads TILERT_DECODE_<OPTION> from the environment "
        "(the flag wins); the shared secret comes from --secret-file, $TILERT_SECRET_FILE or $TILERT_SECRET.",
    )  # fmt: skip
    add_config_arguments(dec, DecodeConfig)
    dec.set_defaults(func=_decode)

    rt = sub.add_parser(
        "router", help="run the OpenAI-compatible router", allow_abbrev=False,
        description="Run the router. Precedence: flag > TILERT_ROUTER_<OPTION> environment variable > TOML "
        "file (--config) > default. The client API key comes from --api-key-file, $TILERT_ROUTER_API_KEY_FILE "
        "or $TILERT_ROUTER_API_KEY; the shared secret from --secret-file, $TILERT_SECRET_FILE or $TILERT_SECRET.",
    )  # fmt: skip
    rt.add_argument(
        "--config", default=None, metavar="TOML",
        help="router TOML file (see config/router.example.toml) [env TILERT_ROUTER_CONFIG]",
    )  # fmt: skip
    add_config_arguments(rt, RouterConfig)
    rt.add_argument(
        "--api-key",
        action=_SecretFlag,
        advice="use --api-key-file PATH, $TILERT_ROUTER_API_KEY_FILE or $TILERT_ROUTER_API_KEY",
    )
    rt.add_argument("--prefill-api-key", action=_SecretFlag,
                    advice="use --prefill-api-key-file PATH, $TILERT_ROUTER_PREFILL_API_KEY_FILE or "
                    "$TILERT_ROUTER_PREFILL_API_KEY")  # fmt: skip
    for p in (rt, dec):
        p.add_argument(
            "--secret", action=_SecretFlag, advice="use --secret-file PATH, $TILERT_SECRET_FILE or $TILERT_SECRET"
        )
    rt.set_defaults(func=_router)

    up = sub.add_parser("up", help="prefill (stock vLLM) + decode + router on this machine", allow_abbrev=False)
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
    up.add_argument(
        "--reserve-lease-s", type=float, default=None,
        help="the router's decode slot lease (default: its prefill + transfer timeouts + 30 s); the decode "
        "node's --max-lease-s follows it",
    )  # fmt: skip
    up.add_argument(
        "--native", action="store_true",
        help="also the native decode pool: the prefill runs MultiConnector (TileRTConnector beside vLLM's "
        "NixlConnector) and a stock vLLM decode instance serves requests the router sends the native way",
    )  # fmt: skip
    up.add_argument("--native-engine", default="vllm", help="the native pool's engine plugin (native mode)")
    up.add_argument("--native-port", type=int, default=8200, help="the native vLLM decode instance's port")
    up.add_argument("--prefill-side-port", type=int, default=5600, help="the prefill's NIXL side channel (native)")
    up.add_argument("--native-side-port", type=int, default=5601, help="the native decode's NIXL side channel")
    up.add_argument(
        "--overflow-wait-s", type=float, default=None,
        help="native mode: a TileRT-pool request with no free slot after this wait goes to the native pool "
        "(unset: it waits up to the router's queue timeout, then 429)",
    )  # fmt: skip
    up.add_argument(
        "--secret-file", type=Path, default=None,
        help="use this deployment secret (a file only you can read) instead of a fresh one, so that more "
        "decode nodes and routers can join the stack; it is left in place at exit",
    )  # fmt: skip
    up.add_argument(
        "--prefill-compiled", action="store_true",
        help="run the prefill vLLM compiled (its default) instead of --enforce-eager: a longer start, a faster "
        "prefill (on the CPU demo about 5 ms less time to first token)",
    )  # fmt: skip
    up.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=None,
        help="run the decode node's engine in a process of its own (tilert decode --engine-process); default: so "
        "on a CPU host (one user decoded 1.29x vLLM alone's speed against 1.10x, "
        "benchmarks/results/cpu-e2e-2026-12-01.md)",
    )  # fmt: skip
    up.add_argument(
        "--engine-cpus", default=None, metavar="LIST",
        help="CPUs given to the decode engine's worker thread alone ('1', '2-3'): the prefill (its OMP threads "
        "too), the router and the node's own loops are kept off them (one user's fastest decode, a slower first "
        "token). Default on a CPU host: the engine's thread on the last CPU, the prefill's OMP threads on the "
        "others, the rest unpinned; 'none': nothing pinned",
    )  # fmt: skip
    up.add_argument(
        "--prefill-in-process", action=argparse.BooleanOptionalAction, default=None,
        help="run the prefill vLLM's model in its engine-core process (--distributed-executor-backend uni) instead "
        "of a worker process that spins on a CPU core after every step; default: so on a CPU host outside "
        "--native (on the CPU demo four users' TPOT 6.8 against 10.0 ms, "
        "benchmarks/results/cpu-e2e-2026-12-02-inproc.md)",
    )  # fmt: skip
    up.set_defaults(func=_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    configure()
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, PluginError) as exc:  # a setting (or plugin) it cannot start with: say which, exit 2
        print(f"tilert {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
