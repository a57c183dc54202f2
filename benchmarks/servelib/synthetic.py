"""``gpu_serving.py --synthetic NAME``: a named configuration (``engine_configs.SYNTHETIC``) written as a synthetic
block-FP8 HF checkpoint with its MTP layer (:func:`tilert.models.synthetic.write_fp8_checkpoint`, the values drawn
on the node's GPU when it has one), then converted by the real ``tilert convert`` in a subprocess; the benchmark
serves the converted directory as it serves ``--model``. Each step's seconds are printed as it ends and go into the
result's conditions.

The tokenizer: the directory given (its vocabulary must fit the model's; tiny-v32 takes its size as vocabulary),
else one trained here: the tiny models' for tiny-v32 (seconds), a byte-level BPE of the model's vocabulary for
lite-v32 (minutes: pass a trained one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine_configs import SYNTHETIC, TINY_V32, hf_overrides

from tilert.models.synthetic import tokenizer_vocab_size, write_fp8_checkpoint, write_tokenizer
from tilert.models.tiny import save_tiny_tokenizer


def _tokenizer(name: str, given: Path | None, root: Path, vocab: int) -> Path:
    if given is not None:
        return given
    out = root / "tokenizer"
    t0 = time.monotonic()
    if SYNTHETIC[name] is TINY_V32:
        save_tiny_tokenizer(out)
    else:
        print(f"training a {vocab}-token tokenizer (minutes; --tokenizer DIR takes a trained one)", flush=True)
        write_tokenizer(out, vocab)
    print(f"  tokenizer trained: {time.monotonic() - t0:.1f} s", flush=True)
    return out


def _gb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*.safetensors")) / 1e9


def build(name: str, root: Path, tokenizer: Path | None, device: str) -> tuple[Path, dict[str, Any]]:
    """Write configuration ``name``'s checkpoint to ``root/hf`` and convert it to ``root/converted``: that
    directory and what the result records of the two steps."""
    args = SYNTHETIC[name]
    tok = _tokenizer(name, tokenizer, root, args.vocab_size)
    if args is TINY_V32:
        args = replace(args, vocab_size=tokenizer_vocab_size(tok))
    hf, out = root / "hf", root / "converted"
    gen_device = device if device.startswith("cuda") else "cpu"
    print(f"writing the synthetic {name} checkpoint to {hf} (values drawn on {gen_device})", flush=True)
    t0 = time.monotonic()
    size = write_fp8_checkpoint(hf, "DeepseekV32Config", hf_overrides(args), tokenizer=tok, device=gen_device)
    write_s = time.monotonic() - t0
    print(f"  written: {size / 1e9:.3f} GB in {write_s:.1f} s ({size / 1e9 / write_s:.3f} GB/s)", flush=True)
    repo = Path(__file__).resolve().parent.parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "tilert.cli", "convert", "--model-dir", str(hf), "--out", str(out), "--quiet"]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    convert_s = time.monotonic() - t0
    converted_gb = _gb(out)
    print(
        f"  converted: {converted_gb:.3f} GB in {convert_s:.1f} s ({size / 1e9 / convert_s:.3f} GB/s read)", flush=True
    )
    return out, {
        "name": name,
        "config_class": "DeepseekV32Config",
        "overrides": hf_overrides(args),
        "tokenizer": str(tok),
        "generated_on": gen_device,
        "checkpoint_gb": round(size / 1e9, 3),
        "write_s": round(write_s, 2),
        "convert_s": round(convert_s, 2),
        "converted_gb": round(converted_gb, 3),
        "convert_command": cmd,
    }
