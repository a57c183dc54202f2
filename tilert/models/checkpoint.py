"""Facts read from a checkpoint directory that more than one process needs (router and decode node)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; ``{}`` when the file is missing or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_token_ids(model_dir: Path | str, token_to_id: Any = None) -> frozenset[int]:
    """Every token id that ends generation: ``eos_token_id`` of config.json and generation_config.json,
    plus the tokenizer's ``eos_token`` (resolved with ``token_to_id``, or the model's tokenizer.json)."""
    d = Path(model_dir)
    eos = _ids(read_json(d / "config.json").get("eos_token_id"))
    eos |= _ids(read_json(d / "generation_config.json").get("eos_token_id"))
    eos_tok = read_json(d / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    if isinstance(eos_tok, str):
        if token_to_id is None and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            token_to_id = Tokenizer.from_file(str(d / "tokenizer.json")).token_to_id
        tid = token_to_id(eos_tok) if token_to_id is not None else None
        if tid is not None:
            eos.add(tid)
    return frozenset(eos)


# What vLLM takes from generation_config.json when a request leaves it unset.
SAMPLING_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def sampling_defaults(model_dir: Path | str) -> dict[str, Any]:
    """The model's own sampling defaults (generation_config.json), applied when a request leaves them unset."""
    config = read_json(Path(model_dir) / "generation_config.json")
    return {k: config[k] for k in SAMPLING_DEFAULTS if config.get(k) is not None}


def context_length(model_dir: Path | str) -> int | None:
    """The longest sequence the checkpoint's positions cover: ``max_position_embeddings`` of its config.json
    (None when it does not say)."""
    value = read_json(Path(model_dir) / "config.json").get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def context_problem(model_dir: Path | str, length: object, what: str) -> str | None:
    """Why ``length`` positions (the setting ``what``) do not fit the checkpoint's context, or None when they do."""
    limit = context_length(model_dir)
    if limit is None or not isinstance(length, int) or isinstance(length, bool) or length <= limit:
        return None
    config = Path(model_dir) / "config.json"
    return f"{what} {length} exceeds the checkpoint's context: max_position_embeddings is {limit} in {config}"


_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a file's JSON header
MTP_LAYERS_KEY = "num_nextn_predict_layers"  # transformers' V3 config calls it num_mtp_layers


def mtp_layers(model_dir: Path | str) -> int | None:
    """MTP modules in the checkpoint: ``num_nextn_predict_layers`` (or ``num_mtp_layers``) of its config.json;
    when the config does not say (transformers' V3.2 / GLM-5 configs drop it), whether its HF tensors hold the
    module (``model.layers.{num_hidden_layers}.eh_proj.weight``). None: neither tells."""
    d = Path(model_dir)
    config = read_json(d / "config.json")
    for key in (MTP_LAYERS_KEY, "num_mtp_layers"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    names = tensor_names(d)
    if not any(n.startswith("model.") for n in names):
        return None
    return int(f"model.layers.{config.get('num_hidden_layers')}.eh_proj.weight" in names)


def tensor_names(model_dir: Path) -> set[str]:
    """The tensor names of a safetensors checkpoint, from its index or the files' headers (no tensor is read)."""
    index = read_json(model_dir / "model.safetensors.index.json").get("weight_map")
    if isinstance(index, dict):
        return set(index)
    names: set[str] = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size)) if size <= _MAX_HEADER_BYTES else None
        except (OSError, ValueError, struct.error):
            continue
        if isinstance(header, dict):
            names.update(k for k in header if k != "__metadata__")
    return names
