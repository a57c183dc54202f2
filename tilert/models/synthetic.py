"""Synthetic block-FP8 checkpoints in DeepSeek's HF format, at any dimensions, written tensor by tensor.

:func:`write_fp8_checkpoint` writes what a published ``*-FP8`` checkpoint of a transformers config class
(``DeepseekV32Config``, ``GlmMoeDsaConfig``, ``DeepseekV3Config``) holds, with random values and no model ever
built: ``config.json`` (with ``quantization_config``), safetensors shards plus their
``model.safetensors.index.json``, e4m3 ``X.weight`` with float32 ``X.weight_scale_inv`` per 128x128 block for every
linear the published checkpoints quantise (:func:`tilert.models.quantize.is_quantized_linear`), the rest bf16 (the
router's correction bias float32), experts one by one in DeepSeek's naming, and an MTP layer
(``num_nextn_predict_layers=1``: ``model.layers.{N}`` shaped as the last layer, plus its ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``). ``tilert convert`` and the engine read it as they read the real one.

The values make a numerically sane model (finite logits of unit scale, a greedy stream of varied tokens), with
the statistics of the engine's own random models (``weights.random_model``): e4m3 values ``N(0, 1)`` whose block
scales carry ``fan_in^-0.5`` (times ``U(0.5, 1.5)``), bf16 matrices ``N(0, fan_in^-1)``, the embedding ``N(0, 1)``,
norms ``1 + 0.1 N(0, 1)``, biases small; but the projections that write into the residual stream (``o_proj``,
``down_proj``) are ``(2 * layers)^-0.5`` smaller, as GPT-2 initialises them: without that, a deep model's layers
drown the current token's embedding in what the context adds at every step, and greedy decoding settles on one
token. They are drawn on the GPU when there is one (then copied to the host and written), each shard by its own
thread with its own seeded generator: the same ``seed`` and shard split give the same bytes.

A tokenizer directory can be copied in (:func:`write_fp8_checkpoint`'s ``tokenizer``; its BOS / EOS ids go
into ``config.json``); :func:`write_tokenizer` trains a byte-level BPE of a model's vocabulary size locally.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from tilert.engines.tilert import fp8, st_io
from tilert.models.quantize import QUANTIZATION_CONFIG, is_quantized_linear
from tilert.models.tiny import train_tokenizer

CONFIG_CLASSES = ("DeepseekV32Config", "GlmMoeDsaConfig", "DeepseekV3Config")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
SHARD_BYTES = 1 << 30  # the shards' size, about (the published checkpoints' are a few GB)
# The linears whose output is added to the residual stream (drawn (2 * layers)^-0.5 times smaller: module docstring)
RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight")

Spec = tuple[torch.dtype, tuple[int, ...]]


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """``model``'s state dict (a meta-device model will do) with transformers' fused expert tensors
    (``mlp.experts.gate_up_proj`` / ``down_proj``) split into the per-expert ``gate_proj`` / ``up_proj`` /
    ``down_proj`` weights the released checkpoints hold."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            e, two_i, d = t.shape
            for j in range(e):
                for proj in ("gate_proj", "up_proj"):
                    shapes[name.replace("gate_up_proj", f"{j}.{proj}.weight")] = (two_i // 2, d)
        elif name.endswith("mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                shapes[name.replace("down_proj", f"{j}.down_proj.weight")] = tuple(t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def hf_config(config_class: str, overrides: dict[str, Any] | None = None) -> Any:
    """transformers' ``config_class`` (one of :data:`CONFIG_CLASSES`) with ``overrides``."""
    import transformers

    if config_class not in CONFIG_CLASSES:
        raise ValueError(f"unknown config class {config_class!r}; choose one of {', '.join(CONFIG_CLASSES)}")
    return getattr(transformers, config_class)(**(overrides or {}))


def checkpoint_specs(cfg: Any, mtp: bool = True) -> dict[str, Spec]:
    """Every tensor of the FP8 checkpoint of ``cfg`` (dtype and shape, HF names, file order): the model's
    tensors, then the MTP layer's when ``mtp``."""
    import transformers

    model_cls = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"))
    with torch.device("meta"):
        shapes = checkpoint_shapes(model_cls(cfg))
    n, d = cfg.num_hidden_layers, cfg.hidden_size
    if mtp:
        last, nxt = f"model.layers.{n - 1}.", f"model.layers.{n}."
        for name in [k for k in shapes if k.startswith(last)]:
            shapes[nxt + name[len(last) :]] = shapes[name]
        extra: dict[str, tuple[int, ...]] = {
            "enorm": (d,),
            "hnorm": (d,),
            "shared_head.norm": (d,),
            "eh_proj": (d, 2 * d),
        }
        for name, shape in extra.items():
            shapes[f"{nxt}{name}.weight"] = shape
    specs: dict[str, Spec] = {}
    for name, shape in shapes.items():
        if is_quantized_linear(name, torch.empty(shape, device="meta")):
            specs[name] = (fp8.E4M3, shape)
            specs[name + "_scale_inv"] = (torch.float32, (-(-shape[0] // fp8.BLOCK), -(-shape[1] // fp8.BLOCK)))
        else:
            specs[name] = (torch.float32 if name.endswith("correction_bias") else torch.bfloat16, shape)
    return specs


def _values(name: str, spec: Spec, fan_in: int, residual_gain: float, gen: torch.Generator) -> torch.Tensor:
    """One tensor's random values (module docstring), on the generator's device."""
    dtype, shape = spec
    dev = gen.device
    gain = residual_gain if name.removesuffix("_scale_inv").endswith(RESIDUAL_OUTPUTS) else 1.0
    if dtype == fp8.E4M3:
        return torch.randn(shape, generator=gen, device=dev).clamp_(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(dtype)
    if name.endswith("_scale_inv"):
        return torch.rand(shape, generator=gen, device=dev).add_(0.5).mul_(gain * fan_in**-0.5)
    t = torch.randn(shape, generator=gen, device=dev)
    if name.endswith("correction_bias"):
        t.mul_(0.01)
    elif name.endswith(".bias"):
        t.mul_(0.05)
    elif len(shape) == 1:
        t.mul_(0.1).add_(1.0)
    elif not name.endswith("embed_tokens.weight"):
        t.mul_(gain * shape[-1] ** -0.5)
    return t.to(dtype)


def _shards(specs: dict[str, Spec], files: int) -> list[list[str]]:
    """The names in file order split into ``files`` runs of about equal bytes (a weight beside its scale)."""
    size = {k: math.prod(s) * dt.itemsize for k, (dt, s) in specs.items()}
    target = sum(size.values()) / files
    out: list[list[str]] = [[]]
    acc = 0
    for name in specs:
        if acc >= target * len(out) and len(out) < files and not name.endswith("_scale_inv"):
            out.append([])
        out[-1].append(name)
        acc += size[name]
    return [s for s in out if s]


def _write_shard(path: Path, specs: dict[str, Spec], residual_gain: float, seed: int, device: str) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    w = st_io.ShardWriter(path, specs, sync=False)
    try:
        for name, spec in specs.items():
            weight = name.removesuffix("_scale_inv")
            fan_in = specs[weight][1][-1] if weight in specs else spec[1][-1]
            w.write(name, _values(name, spec, fan_in, residual_gain, gen).cpu())
    finally:
        w.close()


def tokenizer_vocab_size(tokenizer: Path) -> int:
    """Token ids the tokenizer in directory ``tokenizer`` can produce (its added tokens included)."""
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(Path(tokenizer) / "tokenizer.json")).get_vocab_size(with_added_tokens=True))


def _special_ids(tokenizer: Path) -> dict[str, int]:
    """``bos_token_id`` / ``eos_token_id`` of the tokenizer in directory ``tokenizer`` (those it names)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer / "tokenizer.json"))
    cfg = json.loads((tokenizer / "tokenizer_config.json").read_text())
    out: dict[str, int] = {}
    for key in ("bos", "eos"):
        text = cfg.get(f"{key}_token")
        text = text.get("content") if isinstance(text, dict) else text
        tid = tok.token_to_id(text) if isinstance(text, str) else None
        if tid is not None:
            out[f"{key}_token_id"] = tid
    return out


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def write_fp8_checkpoint(
    out: Path | str,
    config_class: str = "DeepseekV32Config",
    overrides: dict[str, Any] | None = None,
    *,
    mtp: bool = True,
    tokenizer: Path | str | None = None,
    seed: int = 0,
    device: str | None = None,
    files: int | None = None,
    workers: int | None = None,
) -> int:
    """Write the synthetic FP8 checkpoint of ``config_class`` with ``overrides`` (module docstring) to directory
    ``out`` (new or empty): ``files`` shards (default: about :data:`SHARD_BYTES` each), ``workers`` threads
    (default: one per shard, up to the CPUs and 8), values drawn on ``device`` (default: CUDA when available).
    ``tokenizer``: a directory whose tokenizer files are copied in; its vocabulary must fit the model's. Returns
    the checkpoint's size in bytes (its safetensors files)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    cfg = hf_config(config_class, overrides)
    raw: dict[str, Any] = {}
    tok_dir = None if tokenizer is None else Path(tokenizer)
    if tok_dir is not None:
        have = tokenizer_vocab_size(tok_dir)
        if have > cfg.vocab_size:
            raise ValueError(f"the tokenizer in {tok_dir} has {have} tokens, more than vocab_size {cfg.vocab_size}")
        raw.update(_special_ids(tok_dir))
    specs = checkpoint_specs(cfg, mtp)
    total = sum(math.prod(s) * dt.itemsize for dt, s in specs.values())
    shards = _shards(specs, files or max(1, round(total / SHARD_BYTES)))
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    raw = {**json.loads((out / "config.json").read_text()), **raw}
    raw.update(
        architectures=[config_class.replace("Config", "ForCausalLM")],
        quantization_config=dict(QUANTIZATION_CONFIG),
        num_nextn_predict_layers=int(mtp),
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        tilert_synthetic={"config_class": config_class, "seed": seed},
    )
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    if tok_dir is not None:
        for f in TOKENIZER_FILES:
            if (tok_dir / f).is_file():
                shutil.copy2(tok_dir / f, out / f)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {k: fname for fname, shard in zip(names, shards, strict=True) for k in shard}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    gain = (2 * cfg.num_hidden_layers) ** -0.5
    dev = device or default_device()
    workers = workers or min(len(shards), os.cpu_count() or 1, 8)
    with ThreadPoolExecutor(workers) as pool:
        jobs = [
            pool.submit(_write_shard, out / fname, {k: specs[k] for k in shard}, gain, seed * 100_003 + i, dev)
            for i, (fname, shard) in enumerate(zip(names, shards, strict=True))
        ]
        for job in jobs:
            job.result()
    return sum((out / f).stat().st_size for f in names)


def write_tokenizer(out_dir: Path | str, vocab_size: int) -> None:
    """A byte-level BPE of ``vocab_size`` tokens (or as many as the corpus gives; ``<s>`` and ``</s>`` first) on
    up to 40 MB of the Python standard library's sources, saved as a transformers tokenizer in ``out_dir``."""
    import sysconfig

    from transformers import PreTrainedTokenizerFast

    files, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(str(path))
        total += len(data)
        if total > 40e6:
            break
    tok = train_tokenizer(vocab_size, special_tokens=["<s>", "</s>"], files=files)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(out_dir))
