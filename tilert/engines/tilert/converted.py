"""Directories written by ``tilert convert`` (``convert.py``), as the engine reads them: the manifest, then each
rank's shards memory-mapped and checked against the model they describe.

The manifest (:data:`MANIFEST`) records the converter version, :data:`LAYOUT_VERSION` (bumped whenever
``weights.py`` changes the fused layout), the source's hash, the weights' dtypes, the tensor-parallel degree and
the :class:`ModelArgs`; :func:`load_converted` refuses a directory whose manifest, layout version, files, tensor
names or shapes do not match, naming what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import sharding, st_io
from .model import ModelArgs, Transformer, finish_model

LAYOUT_VERSION = 1
MANIFEST = "tilert_manifest.json"
FORMAT = "tilert-converted"


def is_converted(model_dir: Path) -> bool:
    return (Path(model_dir) / MANIFEST).exists()


def read_manifest(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ValueError(f"{path}: not a tilert converted-weights manifest (format {m.get('format')!r})")
    missing = [k for k in ("converter_version", "layout_version", "tp", "args", "ranks") if k not in m]
    if missing:
        raise ValueError(f"{path}: manifest lacks {missing}")
    if m.get("layout_version") != LAYOUT_VERSION:
        raise ValueError(
            f"{path}: layout version {m.get('layout_version')!r}, this engine reads version "
            f"{LAYOUT_VERSION}: convert the checkpoint again with this tilert"
        )
    return m


def load_converted(
    model_dir: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int = 1,
    tp: tuple[int, int] = (0, 1),
) -> Transformer:
    """A ready :class:`Transformer` from a converted directory (shards memory-mapped), after checking the manifest
    against the model it describes and every shard against the manifest; ``tp = (rank, size)``: that rank's
    shard of a directory converted with ``--tp size``."""
    model_dir = Path(model_dir)
    m = read_manifest(model_dir)
    rank, size = tp
    made = m.get("tp", 1)
    if made != size:
        raise ValueError(
            f"{model_dir} was converted for {made} tensor-parallel rank(s), this engine runs {size}: "
            f"convert the checkpoint again with --tp {size}"
            if size > 1
            else f"{model_dir} was converted with --tp {made}: its per-rank shards are for the "
            "tensor-parallel engine; convert without --tp to serve on one device"
        )
    try:
        args = ModelArgs(**m["args"])
    except TypeError as exc:
        raise ValueError(f"{model_dir / MANIFEST}: model arguments do not match this engine ({exc})") from None
    if size > 1:
        args = sharding.local_args(args, rank, size)
    with torch.device("meta"):
        model = Transformer(args)
    want = {k: p for k, p in model.named_parameters()}
    try:
        listed: dict[str, Any] = m["ranks"][rank]["tensors"]
        model_dir = model_dir / m["ranks"][rank]["dir"]
    except (IndexError, KeyError, TypeError):
        raise ValueError(f"{model_dir / MANIFEST}: no tensor list for rank {rank}") from None
    missing = [k for k in want if k not in listed]
    if missing:
        raise ValueError(f"{model_dir}: missing tensor(s) {missing[:8]} (the manifest does not list them)")
    extra = [k for k in listed if k not in want]
    if extra:
        raise ValueError(f"{model_dir}: unexpected tensor(s) {extra[:8]} for this model")
    for k, p in want.items():
        if tuple(listed[k]["shape"]) != tuple(p.shape):
            raise ValueError(f"{model_dir}: tensor {k} has shape {listed[k]['shape']}, the model needs {list(p.shape)}")
    sd: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for k, info in listed.items():
        by_file.setdefault(info["file"], []).append(k)
    for fname, names in by_file.items():
        path = model_dir / fname
        if not path.exists():
            raise ValueError(f"{model_dir}: shard {fname} is missing (holds {names[:4]}...)")
        st_io.read_header(path)  # a truncated or corrupt shard is refused here, naming it
        with safe_open(str(path), framework="pt") as f:
            have = set(f.keys())
            for k in names:
                if k not in have:
                    raise ValueError(f"{path}: missing tensor {k}")
                t = f.get_tensor(k)
                if tuple(t.shape) != tuple(listed[k]["shape"]):
                    raise ValueError(
                        f"{path}: tensor {k} has shape {list(t.shape)}, the manifest says {listed[k]['shape']}"
                    )
                sd[k] = t
    return finish_model(model, sd, device, dtype, max_seq_len, max_sequences)
