"""Block-FP8 copies of bf16/fp32 checkpoints, quantised the way DeepSeek's FP8 checkpoints are, and their
dequantised twins (what transformers runs as the reference of an FP8 checkpoint).

:func:`quantize_checkpoint` turns every linear that DeepSeek-V3 / V3.2 and GLM-5 ship in FP8 (see
``tilert/engines/tilert/fp8.py``; embeddings, ``lm_head``, norms, the router, ``indexer.weights_proj``,
``eh_proj`` and ``shared_head`` stay as they are) into an e4m3 ``X.weight`` plus ``X.weight_scale_inv``
(``s = amax / 448`` per 128x128 block), and adds ``quantization_config`` to ``config.json``.
:func:`dequantize_checkpoint` writes ``float(q) * s`` back (float32 by default) without the
``quantization_config``: the same real weights as plain tensors. Both read and write tensor by tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tilert.engines.tilert import fp8

QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [fp8.BLOCK, fp8.BLOCK],
}


def is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    """Whether DeepSeek's FP8 checkpoints store this tensor in e4m3 (a 2-D linear weight not kept in bf16)."""
    return name.endswith(".weight") and t.dim() == 2 and not name.endswith(fp8.BF16_LINEARS)


def _copy_side_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)


def quantize_checkpoint(src: Path | str, out: Path | str) -> Path:
    """Write the block-FP8 version of checkpoint ``src`` to ``out`` (one safetensors file per source file)."""
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("quantization_config"):
        raise ValueError(f"{src} is already quantised")
    _copy_side_files(src, out)
    for f in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                t = sf.get_tensor(name)
                if is_quantized_linear(name, t):
                    q, s = fp8.quantize_blocks(t)
                    tensors[name], tensors[name + "_scale_inv"] = q, s
                else:
                    tensors[name] = t.contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def dequantize_checkpoint(src: Path | str, out: Path | str, dtype: torch.dtype = torch.float32) -> Path:
    """Write FP8 checkpoint ``src``'s real weights (``float(q) * scale_inv`` per block, in ``dtype``) to ``out``."""
    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    fp8.check_quantization_config(cfg.get("quantization_config"))
    _copy_side_files(src, out)
    for f in sorted(src.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            for name in names:
                if name.endswith(fp8.CKPT_SCALE_SUFFIX):
                    continue
                t = sf.get_tensor(name)
                if t.dtype in fp8.FP8_DTYPES:
                    t = fp8.dequantize_blocks(t, sf.get_tensor(name + "_scale_inv"), dtype)
                tensors[name] = t.contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
