"""The published TileRT x vLLM commands, verbatim, as thin aliases of tilert's own (the one place they live).

=====================================================================  ==========================================
published                                                              here
=====================================================================  ==========================================
``python -m tilert.models.preprocess.weight_converter --model_type T   ``tilert convert --model-dir D --out S``
--model_dir D --save_dir S``                                           (``T`` checked against ``D``'s config)
``python -m tilert.pd_vllm.decode_server --engine tilert --model M     ``tilert decode --engine tilert --model W
--model-weights-dir W [--with-mtp] --max-seq-len N --kv-cache-dtype    --max-seq-len N --ctrl-port C --http-port
fp8 --ctrl-port C --http-port H``                                      H --num-speculative-tokens 1`` (0
                                                                       without ``--with-mtp``: MTP off)
``python -m tilert.pd_vllm.pd_router --vllm-url U --decode H:C:P       ``tilert router --prefill-url U --decode
--model-path D --port P``                                              H:C:P --model D --port P``
``"kv_connector_module_path": "tilert.pd_vllm.prefill_connector"``     ``tilert.connector.TileRTConnector``
=====================================================================  ==========================================

Flags that have no meaning here are accepted with a warning that says what happens instead
(``--kv-cache-dtype fp8``: the engine keeps its latent cache in the model dtype and converts vLLM's
``fp8_ds_mla`` handoff on arrival); a value that cannot be honoured is refused with the reason (exit 2), e.g.
a ``--model`` / ``--model_type`` / ``tilert_model`` naming another family than the checkpoint. Any further flag
is passed through to the tilert command (``--host``, ``--secret-file``, ``--tp``, ...). Like every tilert
process, the three need the deployment's shared secret (``$TILERT_SECRET_FILE`` or ``$TILERT_SECRET``) and bind
loopback unless given ``--host``.

The connector's published ``kv_connector_extra_config`` keys (:func:`check_connector_extra`): ``tilert_model``
is checked against the model vLLM serves; ``tilert_max_seq_len`` against vLLM's ``max_model_len`` (a warning
when vLLM accepts longer prompts than the decode node holds); ``tilert_host`` / ``tilert_ctrl_port`` are
accepted, but the decode node of each request is the one the router names in its signed claim.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from tilert import cli
from tilert.settings import NODE_CTRL_PORT, NODE_HTTP_PORT, ROUTER_PORT

log = structlog.get_logger("tilert.pd_vllm")

# Published model names (and the obvious spellings) -> config.json model_type.
MODEL_NAMES: dict[str, str] = {
    "glm5": "glm_moe_dsa",
    "glm-5": "glm_moe_dsa",
    "glm5.1": "glm_moe_dsa",
    "glm-5.1": "glm_moe_dsa",
    "glm_moe_dsa": "glm_moe_dsa",
    "deepseek-v3.2": "deepseek_v32",
    "deepseek_v32": "deepseek_v32",
    "dsv32": "deepseek_v32",
    "deepseek-v3": "deepseek_v3",
    "deepseek_v3": "deepseek_v3",
    "dsv3": "deepseek_v3",
}
# The published kv_connector_extra_config keys; every other key is the connector's own (ConnectorSettings).
PUBLISHED_EXTRA_KEYS = ("tilert_host", "tilert_ctrl_port", "tilert_model", "tilert_max_seq_len")


class AliasError(ValueError):
    """A published flag value this deployment cannot honour (the message says why)."""


def model_type_of(name: str, what: str) -> str:
    """The config.json ``model_type`` a published model name stands for (refuses an unknown name)."""
    key = name.strip().lower()
    if key not in MODEL_NAMES:
        raise AliasError(f"{what} {name!r} is not a supported model; use one of {', '.join(sorted(MODEL_NAMES))}")
    return MODEL_NAMES[key]


def check_family(name: str, what: str, model_dir: Path) -> None:
    """Refuse a published model name that is not the family of the checkpoint in ``model_dir``."""
    want = model_type_of(name, what)
    try:
        have = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise AliasError(f"{model_dir}: no readable config.json ({exc})") from None
    if have != want:
        raise AliasError(f"{what} {name!r} means model_type {want!r}, but {model_dir} holds a {have!r} model")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


# --------------------------------------------------------------------------------------------- commands


def weight_converter_args(argv: list[str]) -> list[str]:
    """``weight_converter`` flags -> ``tilert convert`` arguments."""
    ap = argparse.ArgumentParser(prog="python -m tilert.models.preprocess.weight_converter", allow_abbrev=False)
    ap.add_argument("--model_type", required=True, help="glm-5, deepseek-v3.2, deepseek-v3")
    ap.add_argument("--model_dir", required=True, type=Path, help="HF checkpoint")
    ap.add_argument("--save_dir", required=True, type=Path, help="output directory")
    ns, rest = ap.parse_known_args(argv)
    check_family(ns.model_type, "--model_type", ns.model_dir)
    return ["convert", "--model-dir", str(ns.model_dir), "--out", str(ns.save_dir), *rest]


def decode_server_args(argv: list[str]) -> list[str]:
    """``decode_server`` flags -> ``tilert decode`` arguments."""
    ap = argparse.ArgumentParser(prog="python -m tilert.pd_vllm.decode_server", allow_abbrev=False)
    ap.add_argument("--engine", default="tilert")
    ap.add_argument("--model", required=True, help="model family: glm5, deepseek-v3.2, deepseek-v3")
    ap.add_argument("--model-weights-dir", required=True, type=Path, help="converted (or HF) weights")
    ap.add_argument("--with-mtp", action="store_true", help="MTP speculative decoding (off without it)")
    ap.add_argument("--max-seq-len", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--ctrl-port", type=int, default=NODE_CTRL_PORT)
    ap.add_argument("--http-port", type=int, default=NODE_HTTP_PORT)
    ns, rest = ap.parse_known_args(argv)
    check_family(ns.model, "--model", ns.model_weights_dir)
    if ns.kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_ds_mla"):
        _warn(
            f"--kv-cache-dtype {ns.kv_cache_dtype}: the decode engine keeps its latent cache in the model dtype; "
            "vLLM's fp8_ds_mla handoff is still accepted and converted on arrival"
        )
    elif ns.kv_cache_dtype not in ("auto", "bf16", "bfloat16", "float32", "fp32"):
        raise AliasError(f"--kv-cache-dtype {ns.kv_cache_dtype!r} is not supported (fp8, auto, bfloat16)")
    out = [
        "decode",
        "--engine",
        ns.engine,
        "--model",
        str(ns.model_weights_dir),
        "--ctrl-port",
        str(ns.ctrl_port),
        "--http-port",
        str(ns.http_port),
    ]
    if ns.max_seq_len is not None:
        out += ["--max-seq-len", str(ns.max_seq_len)]
    out += ["--num-speculative-tokens", "1" if ns.with_mtp else "0"]  # the node refuses 1 without an MTP layer
    if "--host" not in rest:
        _warn("binding 127.0.0.1: add --host ADDRESS for a prefill node on another machine")
    return out + rest


def pd_router_args(argv: list[str]) -> list[str]:
    """``pd_router`` flags -> ``tilert router`` arguments."""
    ap = argparse.ArgumentParser(prog="python -m tilert.pd_vllm.pd_router", allow_abbrev=False)
    ap.add_argument("--vllm-url", required=True, help="the vLLM prefill server")
    ap.add_argument("--decode", action="append", required=True, metavar="HOST:CTRL:HTTP")
    ap.add_argument("--model-path", required=True, help="checkpoint with the tokenizer")
    ap.add_argument("--port", type=int, default=ROUTER_PORT)
    ns, rest = ap.parse_known_args(argv)
    out = [
        "router",
        "--prefill-url",
        ns.vllm_url.rstrip("/").removesuffix("/v1"),
        "--model",
        ns.model_path,
        "--port",
        str(ns.port),
    ]
    for d in ns.decode:
        out += ["--decode", d]
    if "--host" not in rest:
        _warn("binding 127.0.0.1: add --host ADDRESS to serve clients on other machines")
    return out + rest


def run_alias(translate: Callable[[list[str]], list[str]], argv: list[str] | None = None) -> int:
    """Translate the published flags and run the tilert command; a refused value exits 2 with its reason."""
    try:
        args = translate(list(sys.argv[1:] if argv is None else argv))
    except AliasError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return cli.main(args)


# ------------------------------------------------------------------------------------------- connector


def check_connector_extra(extra: Mapping[str, Any], model_type: str, max_model_len: int) -> list[str]:
    """Check the published ``kv_connector_extra_config`` keys against what vLLM serves; returns warnings,
    raises :class:`AliasError` for a value that cannot be honoured."""
    warnings: list[str] = []
    if "tilert_model" in extra:
        want = model_type_of(str(extra["tilert_model"]), "tilert_model")
        if want != model_type:
            raise AliasError(
                f"tilert_model {extra['tilert_model']!r} means model_type {want!r}, but vLLM serves a "
                f"{model_type!r} model"
            )
    if "tilert_max_seq_len" in extra:
        try:
            limit = int(extra["tilert_max_seq_len"])
        except (TypeError, ValueError):
            raise AliasError(f"tilert_max_seq_len must be an integer ({extra['tilert_max_seq_len']!r})") from None
        if limit < 2:
            raise AliasError(f"tilert_max_seq_len must be >= 2 ({limit})")
        if max_model_len > limit:
            warnings.append(
                f"vLLM accepts prompts of up to {max_model_len} tokens but tilert_max_seq_len is "
                f"{limit}: the decode node refuses longer ones"
            )
    if "tilert_host" in extra or "tilert_ctrl_port" in extra:
        warnings.append(
            "tilert_host / tilert_ctrl_port are accepted; each request goes to the decode node the "
            "router names in its signed claim"
        )
    return warnings


def connector_extra(extra: Mapping[str, Any]) -> dict[str, Any]:
    """``extra`` without the published keys (checked by :func:`check_connector_extra`): what the connector reads
    as its :class:`~tilert.contracts.ConnectorSettings`, where any other unknown key is refused."""
    return {k: v for k, v in extra.items() if k not in PUBLISHED_EXTRA_KEYS}
