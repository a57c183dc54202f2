"""``tilert convert``: an HF checkpoint -> the engine's fused layout on disk, streamed tensor by tensor.

The source is read one tensor at a time (:class:`LazyCheckpoint`, :mod:`.st_io`): the fusion of ``weights.py``
(:func:`weights.fused_groups`, the one definition of the layout) pops tensors from it as it needs them, one group
at a time (the embedding, the final norm, the head, each layer, the MTP module), and every group is written to its
own shard before the next is read. A layer's experts are streamed one expert at a time (``ExpertStack``), so peak
memory is a layer's attention weights plus a few of the largest tensors, whatever the model size.

Output directory::

    tilert_manifest.json        provenance + every tensor's file, shape and dtype (per rank)
    config.json, tokenizer...   copied from the source (the decode node and router read them)
    [rank{r}/]NNN-group.safetensors

The manifest (``converted.py``, which also reads these directories back) records the converter version, the
layout version, the SHA-256 of the source's ``config.json`` + safetensors index (or headers), the weights' dtypes
and the :class:`ModelArgs`. The decode node (``weights.load_model`` -> ``converted.load_converted``) memory-maps
the shards and refuses a directory whose manifest, layout version, files, tensor names or shapes do not match,
naming what is wrong.

Tensor parallelism (``--tp N``): each rank's shard holds exactly what the tensor-parallel engine gives that rank
(``sharding.shard``, the engine's one rule: every expert split along its width, attention heads in ranges of
``H/N``, the vocabulary of ``lm_head`` in ranges of ``V/N``, the rest replicated; block-FP8 weights with their
scales, on whole 128x128 blocks only), and ``tilert decode --tp N`` loads rank ``r``'s shard directly. The ranks'
shards of a group are written side by side, each expert read once and split as it streams, so memory stays
bounded as without ``--tp``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch

from . import fp8, sharding, st_io, weights
from .converted import FORMAT, LAYOUT_VERSION, MANIFEST
from .fp8 import QTensor
from .model import ModelArgs

CONVERTER_VERSION = "1.0"


# ------------------------------------------------------------------------------------------- the source side


class LazyCheckpoint(MutableMapping[str, Any]):
    """An HF checkpoint directory as the mapping the fusion reads (engine names, see ``weights.engine_name``):
    a tensor is read from disk when it is popped (FP8 weights with their ``weight_scale_inv``, as
    :class:`fp8.QTensor`). ``on_read(nbytes)`` is called for every tensor read (the progress bar)."""

    def __init__(self, model_dir: Path, args: ModelArgs, on_read: Any = None) -> None:
        self.args = args
        self.on_read = on_read
        entries: dict[str, st_io.Entry] = {}
        for f in weights.checkpoint_files(model_dir):
            for name, e in st_io.read_header(f).items():
                if name in entries:
                    raise ValueError(f"tensor {name} is in both {entries[name].file.name} and {f.name}")
                entries[name] = e
        self.entries = entries
        self.total_bytes = sum(e.nbytes for e in entries.values())
        self._names: dict[str, str] = {}  # engine name -> HF name (still unread)
        for hf, e in entries.items():
            if hf.endswith(fp8.CKPT_SCALE_SUFFIX):
                if hf[: -len("_scale_inv")] not in entries:
                    raise ValueError(f"{hf}: a weight_scale_inv without its weight")
                continue
            if e.dtype in fp8.FP8_DTYPES and not args.fp8:
                raise ValueError(f"{hf} is {e.dtype} but config.json has no quantization_config")
            target = weights.engine_name(hf, args)
            if target is not None:
                self._names[target] = hf
        if "lm_head.weight" not in self._names and args.tie_word_embeddings:
            self._names["lm_head.weight"] = self._names["embed_tokens.weight"]

    def _read(self, hf: str) -> torch.Tensor:
        e = self.entries[hf]
        t = st_io.read_tensor(e)
        if self.on_read is not None:
            self.on_read(e.nbytes)
        return t

    def __getitem__(self, name: str) -> Any:
        hf = self._names[name]
        t = self._read(hf)
        if t.dtype not in fp8.FP8_DTYPES:
            return t
        if hf + "_scale_inv" not in self.entries:
            raise ValueError(f"{hf} is FP8 but {hf}_scale_inv is missing")
        return QTensor.from_checkpoint(hf, t, self._read(hf + "_scale_inv"))

    def __delitem__(self, name: str) -> None:
        del self._names[name]

    def __setitem__(self, name: str, value: Any) -> None:
        raise TypeError("a LazyCheckpoint is read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


def source_hash(model_dir: Path) -> str:
    """SHA-256 of the source's ``config.json`` and its safetensors index (the files' headers without one)."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        h.update(index.read_bytes())
    else:
        for f in weights.checkpoint_files(model_dir):
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                h.update(f.name.encode() + fh.read(n))
    return h.hexdigest()


# --------------------------------------------------------------------------------------- tensor parallelism


def check_tp(tp: int, args: ModelArgs) -> None:
    """The engine's own check (``sharding.check_degree``): what it cannot shard is not converted for it."""
    sharding.check_degree(args, tp)


# ------------------------------------------------------------------------------------------------ progress


class Progress:
    """Tensors and bytes read: tqdm when installed, else one line rewritten on stderr."""

    def __init__(self, total_bytes: int, total_tensors: int, enabled: bool = True) -> None:
        self.total, self.done, self.tensors, self.total_tensors = total_bytes, 0, 0, total_tensors
        self.enabled = enabled
        self._bar: Any = None
        self._last = 0.0
        if enabled:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]

                self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="convert", file=sys.stderr)
            except ImportError:
                self._bar = None

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        self.tensors += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(nbytes)
            self._bar.set_postfix_str(f"{self.tensors}/{self.total_tensors} tensors", refresh=False)
        elif time.monotonic() - self._last > 0.5 or self.done >= self.total:
            self._last = time.monotonic()
            print(
                f"\rconvert: {self.tensors}/{self.total_tensors} tensors, {self.done / 2**30:.2f}/"
                f"{self.total / 2**30:.2f} GiB",
                end="",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


# ------------------------------------------------------------------------------------------------ converting


def _write_group(paths: list[Path], group: dict[str, Any], args: ModelArgs) -> list[dict[str, dict[str, Any]]]:
    """Write one fused group to one shard per rank (``paths[r]``; one path: no tensor parallelism), experts
    streamed slot by slot (each read once, then split per rank); returns each rank's manifest entries."""
    tp = len(paths)

    def share(name: str, t: Any, r: int) -> Any:
        return t if tp == 1 else sharding.shard(name, t, args, r, tp)

    stacks = {k: v for k, v in group.items() if isinstance(v, weights.ExpertStack)}
    plain = [
        weights.store_fp8({k: share(k, v, r) for k, v in group.items() if k not in stacks}, args) for r in range(tp)
    ]

    def stored(name: str, slot: Any) -> list[dict[str, torch.Tensor]]:
        """One expert as each rank stores it."""
        return [weights.store_fp8({name: share(name, slot, r)}, args) for r in range(tp)]

    first = {k: stored(k, v.slots[0]()) for k, v in stacks.items()}  # slot 0: the stacked shapes
    specs: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]] = []
    for r in range(tp):
        spec = {k: (t.dtype, tuple(t.shape)) for k, t in plain[r].items()}
        for name, stack in stacks.items():
            for k, t in first[name][r].items():
                spec[k] = (t.dtype, (len(stack.slots), *t.shape))
        specs.append(spec)
    meta = {"format": "pt", "tilert_layout_version": str(LAYOUT_VERSION)}
    writers = [st_io.ShardWriter(path, spec, meta) for path, spec in zip(paths, specs, strict=True)]
    try:
        for r, w in enumerate(writers):
            for k, t in plain[r].items():
                w.write(k, t)
        for name, stack in stacks.items():
            for j in range(len(stack.slots)):
                parts = first[name] if j == 0 else stored(name, stack.slots[j]())
                for r, w in enumerate(writers):
                    for k, t in parts[r].items():
                        dtype, shape = specs[r][k]
                        if t.dtype != dtype or tuple(t.shape) != shape[1:]:
                            raise ValueError(
                                f"{k}: expert slot {j} is {t.dtype} {tuple(t.shape)}, slot 0 is {dtype} {shape[1:]}"
                            )
                        w.write(k, t, offset=j * t.numel() * t.element_size())
    finally:
        for w in writers:
            w.close()
    return [
        {
            k: {"file": path.name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
            for k, (dtype, shape) in spec.items()
        }
        for path, spec in zip(paths, specs, strict=True)
    ]


def convert(model_dir: Path | str, out: Path | str, tp: int = 1, progress: bool = True) -> Path:
    """Convert HF checkpoint ``model_dir`` into ``out`` (see the module docstring); returns ``out``."""
    model_dir, out = Path(model_dir), Path(out)
    cfg = weights.load_hf_config(model_dir)
    args = weights.args_from_hf_config(cfg, weights.checkpoint_keys(model_dir))
    check_tp(tp, args)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():  # config, tokenizer, generation config: the decode node and router read them
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    rank_dirs = [out] if tp == 1 else [out / f"rank{r}" for r in range(tp)]
    for d in rank_dirs:
        d.mkdir(exist_ok=True)
    src_hash = source_hash(model_dir)
    lazy = LazyCheckpoint(model_dir, args)
    bar = Progress(lazy.total_bytes, len(lazy.entries), enabled=progress)
    lazy.on_read = bar
    tensors: list[dict[str, dict[str, Any]]] = [{} for _ in range(tp)]
    try:
        for g, group in enumerate(weights.fused_groups(lazy, args)):
            label = next(iter(group)).split(".")[:2]
            fname = f"{g:04d}-{'.'.join(label)}.safetensors"
            for r, entries in enumerate(_write_group([d / fname for d in rank_dirs], group, args)):
                tensors[r].update(entries)
    finally:
        bar.close()
    dtypes = sorted({t["dtype"] for rank in tensors for t in rank.values()})
    manifest = {
        "format": FORMAT,
        "converter_version": CONVERTER_VERSION,
        "layout_version": LAYOUT_VERSION,
        "source": {"model_dir": str(model_dir.resolve()), "config_index_sha256": src_hash},
        "fp8": args.fp8,
        "dtypes": dtypes,
        "tp": tp,
        "tp_rule": "sharding.py: experts split along their width; heads H/tp; lm_head V/tp; rest replicated",
        "args": dataclasses.asdict(args),
        "ranks": [
            {"dir": d.relative_to(out).as_posix() or ".", "tensors": t} for d, t in zip(rank_dirs, tensors, strict=True)
        ],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out
