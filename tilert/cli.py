"""The ``tilert`` command: ``tiny-model``, ``convert``, ``draft-vocab``, ``decode``, ``router``, ``up``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tilert.decode.config import DecodeConfig, load_decode_config
from tilert.logs import LogConfig, configure
from tilert.plugins import PluginError
from tilert.router.config import CONFIG_ENV, RouterConfig, load_router_config
from tilert.settings import (
    ConfigError,
    add_config_arguments,
    build_config,
    cli_values,
    env_values,
    merge_values,
)
from tilert.stack import StackConfig, load_stack_config, run


def _own_logs(args: argparse.Namespace) -> None:
    """The log settings of a command that has no config class of its own (:class:`LogConfig`)."""
    config = build_config(LogConfig, merge_values(LogConfig, [env_values(LogConfig), cli_values(LogConfig, args)]))
    configure(config.log_level, config.log_format)


def _tiny_model(args: argparse.Namespace) -> int:
    _own_logs(args)
    from tilert.models.tiny import build_tiny_model  # lazy: torch, and the command's implementation

    out = build_tiny_model(args.arch, args.out, seed=args.seed)
    print(out)
    return 0


def _convert(args: argparse.Namespace) -> int:
    _own_logs(args)
    from tilert.engines.tilert.convert import convert  # lazy: torch, and the command's implementation

    try:
        out = convert(args.model_dir, args.out, tp=args.tp, progress=not args.quiet)
    except (ValueError, OSError) as exc:  # a checkpoint or destination it cannot convert: say why, exit 2
        print(f"tilert convert: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _draft_vocab(args: argparse.Namespace) -> int:
    _own_logs(args)
    from tilert.models.draft_vocab import write_draft_vocab  # lazy: the tokenizer, and the command's implementation

    try:
        ids, tokens = write_draft_vocab(args.model, args.inputs, args.top, args.out)
    except (ValueError, OSError) as exc:  # inputs or a checkpoint it cannot read: say why, exit 2
        print(f"tilert draft-vocab: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: the {ids} most frequent of {tokens} tokens counted")
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
    configure(config.log_level, config.log_format)
    if config.tp > 1:  # one process per rank; this one serves as rank 0
        from tilert.decode.tp import serve_tp  # lazy: the command's implementation (torch, the engine)

        serve_tp(config)
    else:
        from tilert.decode.server import serve  # lazy: the command's implementation (torch, the engine)

        serve(config)
    return 0


def _router(args: argparse.Namespace) -> int:
    config = router_config(args)
    configure(config.log_level, config.log_format)
    from tilert.router.app import serve  # lazy: the command's implementation (Starlette, uvicorn)

    serve(config)
    return 0


def up_config(args: argparse.Namespace) -> StackConfig:
    """``tilert up``'s config: its flags over ``TILERT_UP_*`` over the defaults (raises ConfigError)."""
    return load_stack_config(cli_values(StackConfig, args))


def _up(args: argparse.Namespace) -> int:
    config = up_config(args)
    configure(config.log_level, config.log_format)
    return run(config)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tilert", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    tiny = sub.add_parser("tiny-model", help="write a seeded tiny random checkpoint + tokenizer")
    tiny.add_argument("--arch", required=True, choices=["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
    tiny.add_argument("--out", required=True, type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    add_config_arguments(tiny, LogConfig)
    tiny.set_defaults(func=_tiny_model)

    conv = sub.add_parser(
        "convert",
        help="convert an HF checkpoint (bf16 or block-FP8) to the decode engine's fused layout",
        allow_abbrev=False,
        description="Stream an HF checkpoint tensor by tensor into the engine's fused layout (shards + "
        "tilert_manifest.json); the decode node loads the result memory-mapped.",
    )
    conv.add_argument("--model-dir", required=True, type=Path, help="HF checkpoint (config.json + *.safetensors)")
    conv.add_argument("--out", required=True, type=Path, help="output directory (new or empty)")
    conv.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: one shard set per rank, what `tilert decode --tp N` loads",
    )
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config_arguments(conv, LogConfig)
    conv.set_defaults(func=_convert)

    dv = sub.add_parser(
        "draft-vocab",
        help="count the token ids of text from your traffic: the list `tilert decode --draft-vocab` takes",
        allow_abbrev=False,
        description="Tokenize text with the checkpoint's tokenizer and write the most frequent token ids (a JSON "
        "list, most frequent first): the only tokens a node given `--draft-vocab` lets its MTP drafts propose. "
        "Inputs: plain text files, or JSON Lines (*.jsonl) whose prompt / completion / text / messages[].content "
        "strings are counted.",
    )
    dv.add_argument("--model", required=True, type=Path, help="the checkpoint (config.json + tokenizer.json)")
    dv.add_argument("--top", type=int, default=32768, help="token ids to keep (default 32768)")
    dv.add_argument("--out", required=True, type=Path, help="the JSON file to write")
    dv.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text or *.jsonl files")
    add_config_arguments(dv, LogConfig)
    dv.set_defaults(func=_draft_vocab)

    dec = sub.add_parser(
        "decode",
        help="run a decode node",
        allow_abbrev=False,
        description="Run a decode node. Precedence: flag > TILERT_DECODE_<OPTION> environment variable > default.",
    )
    add_config_arguments(dec, DecodeConfig)
    dec.set_defaults(func=_decode)

    rt = sub.add_parser(
        "router",
        help="run the OpenAI-compatible router",
        allow_abbrev=False,
        description="Run the router. Precedence: flag > TILERT_ROUTER_<OPTION> environment variable > TOML "
        "file (--config) > default.",
    )
    rt.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help=f"router TOML file (see config/router.example.toml) [env {CONFIG_ENV}]",
    )
    add_config_arguments(rt, RouterConfig)
    rt.set_defaults(func=_router)

    up = sub.add_parser(
        "up",
        help="prefill (stock vLLM) + decode + router on this machine",
        allow_abbrev=False,
        description="Start stock vLLM (prefill), a decode node and the router on this machine, supervised. "
        "Precedence: flag > TILERT_UP_<OPTION> environment variable > default. The router's slot lease and the "
        "decode node's longest lease are set together.",
    )
    add_config_arguments(up, StackConfig)
    up.set_defaults(func=_up)
    return ap


def main(argv: list[str] | None = None) -> int:
    configure()  # until the command has read its own log settings
    args = parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, PluginError) as exc:  # a setting (or plugin) it cannot start with: say which, exit 2
        print(f"tilert {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
