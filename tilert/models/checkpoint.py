"""Facts read from a checkpoint directory that more than one process needs (router and decode node)."""

from __future__ import annotations

import json
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


def sampling_defaults(model_dir: Path | str) -> dict[str, Any]:
    """The model's own sampling defaults (generation_config.json), applied when a request leaves them unset."""
    config = read_json(Path(model_dir) / "generation_config.json")
    return {k: config[k] for k in ("temperature", "top_p", "top_k") if config.get(k) is not None}
