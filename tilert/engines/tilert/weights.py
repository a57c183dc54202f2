"""Reading HF checkpoints (config.json + *.safetensors: bf16/fp16/fp32, or block-FP8) into :class:`model.Transformer`
(a directory written by ``tilert convert`` is read by :mod:`.converted` instead, through :func:`load_model`).

Config parsing goes through transformers' own config classes (``AutoConfig``), so the engine reads
exactly what transformers reads (e.g. ``rope_scaling`` standardised into ``rope_parameters``) and the
RoPE frequencies / YaRN attention factor come from transformers' ``ROPE_INIT_FUNCTIONS``.

Name mapping (HF -> engine module):

- ``model.embed_tokens``, ``model.norm``, ``lm_head`` -> ``embed_tokens``, ``norm``, ``lm_head``
  (``lm_head`` falls back to the embedding when ``tie_word_embeddings``).
- ``model.layers.{i}.X`` (``i < num_hidden_layers``) -> ``layers.{i}.X``.
- ``model.layers.{N}.{embed_tokens,enorm,hnorm,eh_proj,shared_head.*}`` -> ``mtp.0.*``; the MTP layer's
  decoder-layer weights ``model.layers.{N}.X`` -> ``mtp.0.block.X`` (``N = num_hidden_layers``).
- experts, either per expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (DeepSeek / transformers'
  saved format) or fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` -> stacked
  ``mlp.w13 [E, 2I, D]`` (gate rows first) and ``mlp.w2 [E, D, I]``.
- then :func:`fused_groups` builds the fused decode layout of ``model.py`` (``W_a``, ``W_b``, shared
  experts stacked after the routed ones, dense MLP as a one-slot MoE, rope rows permuted evens-first), one
  group (top-level tensor, layer, MTP module) at a time, the experts as :class:`ExpertStack` s read slot by
  slot: the one definition of the layout, used whole here (:func:`fuse_state_dict`) and streamed by the
  converter.

:func:`random_model` builds a model of the same layout from :class:`ModelArgs` alone (random weights,
created directly on the target device; benchmarks and kernel checks).

Block-FP8 checkpoints (``quantization_config`` quant_method fp8, 128x128 blocks; ``fp8.py``) load as FP8: each
e4m3 ``X.weight`` is paired with its ``X.weight_scale_inv`` into an :class:`fp8.QTensor` (per-row scales), fused
exactly like a plain weight (the same concatenations and row permutations apply to both), then stored as the
engine's e4m3 weight plus its grouped scale (``fp8.scale_groups``). No dequantised copy is made; an FP8 tensor
the engine keeps in bf16 (e.g. an FP8 ``eh_proj``) is dequantised on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import converted, fp8, layouts, sharding
from .fp8 import QTensor
from .model import FP32_SUFFIXES, ModelArgs, Transformer, finish_model

SUPPORTED_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
_MTP_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
_FUSED_RE = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def load_hf_config(model_dir: Path) -> Any:
    """transformers' config object for ``model_dir`` (refuses unsupported archs and FP8)."""
    from transformers import AutoConfig

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("model_type") not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {raw.get('model_type')!r}; supported: {SUPPORTED_ARCHS}")
    if raw.get("quantization_config") is not None:
        fp8.check_quantization_config(raw["quantization_config"])
    return AutoConfig.from_pretrained(str(model_dir))


def _rope(cfg: Any) -> tuple[list[float], float, float]:
    """``(inv_freq, cos/sin attention factor, softmax scale)`` as transformers computes them."""
    params = dict(cfg.rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    dim = cfg.qk_rope_head_dim
    if rope_type == "default":
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        attention_scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ("yarn", "linear", "llama3"):
            raise ValueError(f"rope_type {rope_type!r} is not supported (dynamic rope needs per-step tables)")
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, device=torch.device("cpu"))
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    # transformers' yarn_apply_mscale: scale *= mscale(factor, mscale_all_dim)^2 for non-default rope.
    if rope_type != "default":
        mscale_all_dim = params.get("mscale_all_dim", 0)
        factor = params["factor"]
        if mscale_all_dim and factor > 1:
            import math

            m = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return inv_freq.float().tolist(), float(attention_scaling), float(scale)


def args_from_hf_config(cfg: Any, keys: set[str] | None = None) -> ModelArgs:
    """Build :class:`ModelArgs` from a transformers config; ``keys`` (checkpoint tensor names) decide
    whether an MTP layer is present and what it contains."""
    arch = cfg.model_type
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg.hidden_act!r} not supported (silu only)")
    n = cfg.num_hidden_layers
    mlp_types = getattr(cfg, "mlp_layer_types", None)
    if mlp_types is None:
        k = cfg.first_k_dense_replace or 0
        mlp_types = ["dense"] * min(k, n) + ["sparse"] * max(n - k, 0)
    inv_freq, attention_scaling, scale = _rope(cfg)
    dsa = arch in ("deepseek_v32", "glm_moe_dsa")
    if dsa and cfg.q_lora_rank is None:
        raise ValueError("DSA models need q_lora_rank (the indexer reads the q_lora latent)")
    indexer_types: list[str] = []
    if dsa:
        indexer_types = list(getattr(cfg, "indexer_types", None) or ["full"] * n)
        if indexer_types[0] != "full":
            raise ValueError("the first DSA layer must run its own indexer")
    args = ModelArgs(
        arch=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size,
        num_layers=n,
        num_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts or 0,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        norm_topk_prob=bool(cfg.norm_topk_prob),
        routed_scaling_factor=float(cfg.routed_scaling_factor),
        mlp_layer_types=list(mlp_types),
        rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=bool(getattr(cfg, "attention_bias", False)),
        # transformers: V3 honours config.rope_interleave; V3.2 and GLM-5 always interleave in MLA.
        rope_interleave=bool(getattr(cfg, "rope_interleave", True)) if arch == "deepseek_v3" else True,
        softmax_scale=scale,
        rope_inv_freq=inv_freq,
        rope_attention_scaling=attention_scaling,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        dsa=dsa,
        index_n_heads=getattr(cfg, "index_n_heads", 0) if dsa else 0,
        index_head_dim=getattr(cfg, "index_head_dim", 0) if dsa else 0,
        index_topk=getattr(cfg, "index_topk", 0) if dsa else 0,
        indexer_rope_interleave=arch == "glm_moe_dsa",
        indexer_types=indexer_types,
        fp8=getattr(cfg, "quantization_config", None) is not None,
    )
    # num_nextn_predict_layers (num_mtp_layers in transformers' V3 config); when the config does not say
    # (transformers' V3.2 / GLM-5 configs drop it), the checkpoint's tensors decide.
    want_mtp = getattr(cfg, "num_nextn_predict_layers", None)
    if want_mtp is None:
        want_mtp = getattr(cfg, "num_mtp_layers", None)
    if keys is not None and (want_mtp is None or want_mtp > 0):
        prefix = f"model.layers.{n}."
        mtp_keys = {k[len(prefix) :] for k in keys if k.startswith(prefix)}
        if "eh_proj.weight" in mtp_keys:
            args.num_mtp_layers = 1  # one module, reused in a chain (extra modules are ignored)
            args.mtp_moe = "mlp.gate.weight" in mtp_keys
            args.mtp_indexer = "self_attn.indexer.wq_b.weight" in mtp_keys
            args.mtp_own_embed = "embed_tokens.weight" in mtp_keys
            args.mtp_own_head = "shared_head.head.weight" in mtp_keys
    return args


def checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_keys(model_dir: Path) -> set[str]:
    """All tensor names in the checkpoint."""
    keys: set[str] = set()
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            keys.update(sf.keys())
    return keys


def _target_name(hf_name: str, args: ModelArgs) -> str | None:
    """HF tensor name -> engine state-dict name (``None`` = skip)."""
    if "rotary_emb" in hf_name:
        return None
    if hf_name == "lm_head.weight":
        return "lm_head.weight"
    if not hf_name.startswith("model."):
        raise ValueError(f"unexpected tensor {hf_name!r}")
    name = hf_name[len("model.") :]
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if m is None:
        return name
    layer, rest = int(m.group(1)), m.group(2)
    if layer < args.num_layers:
        return f"layers.{layer}.{rest}"
    if layer == args.num_layers and args.num_mtp_layers:
        return f"mtp.0.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.0.block.{rest}"
    return None  # further MTP modules (unused)


def pair_fp8(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, Any]:
    """Each e4m3 ``X.weight`` with its ``X.weight_scale_inv`` as one :class:`fp8.QTensor` (FP8 checkpoints);
    refuses FP8 tensors without a quantization_config, an FP8 weight without its scale and a scale without its
    weight, naming the tensor."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if name.endswith(fp8.CKPT_SCALE_SUFFIX):
            if name[: -len("_scale_inv")] not in tensors:
                raise ValueError(f"{name}: a weight_scale_inv without its weight")
            continue
        if t.dtype in fp8.FP8_DTYPES:
            if not args.fp8:
                raise ValueError(f"{name} is {t.dtype} but config.json has no quantization_config")
            scale = tensors.get(name + "_scale_inv")
            if scale is None:
                raise ValueError(f"{name} is FP8 but {name}_scale_inv is missing")
            out[name] = QTensor.from_checkpoint(name, t, scale)
        else:
            out[name] = t
    return out


def engine_name(hf_name: str, args: ModelArgs) -> str | None:
    """HF tensor name -> the name the fusion reads it under (``None`` = unused): :func:`_target_name`, with
    transformers' fused expert tensors as stacked ``mlp.w13`` / ``mlp.w2``."""
    name = _target_name(hf_name, args)
    if name is not None and (m := _FUSED_RE.match(name)) is not None:
        return f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
    return name


def convert_state_dict(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, Any]:
    """Rename HF tensors (:func:`engine_name`; FP8 weights paired with their scales as :class:`fp8.QTensor`)."""
    out: dict[str, Any] = {}
    for hf_name, t in pair_fp8(tensors, args).items():
        name = engine_name(hf_name, args)
        if name is not None:
            out[name] = t
    if "lm_head.weight" not in out and args.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


@dataclass
class ExpertStack:
    """A stacked expert weight (``w13 [slots, 2I, D]`` or ``w2 [slots, D, I]``) given slot by slot: each slot is
    read from the checkpoint only when called, so the converter streams a layer's experts one at a time."""

    slots: list[Callable[[], Any]]

    def materialize(self) -> Any:
        return fp8.stack([slot() for slot in self.slots])


def _expert_stacks(sd: MutableMapping[str, Any], mp: str, args: ModelArgs) -> tuple[ExpertStack, ExpertStack]:
    """``(w13, w2)`` of a routed MoE (prefix ``mp`` = ``...mlp.``): routed experts ``0..E-1`` then the shared MLP
    split into ``S`` experts of width ``I``."""
    w13: list[Callable[[], Any]] = []
    w2: list[Callable[[], Any]] = []
    if mp + "w13" in sd:  # transformers' fused expert tensors
        cache: dict[str, Any] = {}

        def stacked(key: str) -> Any:
            if key not in cache:
                cache[key] = _need(sd, mp + key)
            return cache[key]

        def fused_slot(key: str, e: int) -> Any:
            return _rows(stacked(key), lambda t: t[e])

        w13 += [partial(fused_slot, "w13", e) for e in range(args.n_routed_experts)]
        w2 += [partial(fused_slot, "w2", e) for e in range(args.n_routed_experts)]
    else:
        pat = re.compile(re.escape(mp) + r"experts\.(\d+)\.gate_proj\.weight$")
        ids = sorted(int(m.group(1)) for k in sd.keys() if (m := pat.match(k)))
        if ids != list(range(args.n_routed_experts)):
            raise ValueError(
                f"{mp}experts: found experts {ids[:8]}{'...' if len(ids) > 8 else ''} "
                f"({len(ids)}), expected 0..{args.n_routed_experts - 1}"
            )

        def gate_up(ex: str) -> Any:
            return fp8.cat_rows([_need(sd, ex + "gate_proj.weight"), _need(sd, ex + "up_proj.weight")], ex[:-1])

        w13 += [partial(gate_up, f"{mp}experts.{e}.") for e in ids]
        w2 += [partial(_need, sd, f"{mp}experts.{e}.down_proj.weight") for e in ids]
    s, i = args.n_shared_experts, args.moe_intermediate_size
    shared: dict[str, Any] = {}

    def split_shared() -> dict[str, Any]:
        if not shared:
            g = _rows(_need(sd, mp + "shared_experts.gate_proj.weight"), lambda t: t.view(s, i, -1))
            u = _rows(_need(sd, mp + "shared_experts.up_proj.weight"), lambda t: t.view(s, i, -1))
            d = _need(sd, mp + "shared_experts.down_proj.weight")
            shared["w13"] = fp8.cat_rows([g, u], mp + "shared_experts")
            shared["w2"] = d.split_cols(s) if isinstance(d, QTensor) else d.view(-1, s, i).transpose(0, 1)
        return shared

    def shared_slot(key: str, j: int) -> Any:
        return _rows(split_shared()[key], lambda t: t[j])

    w13 += [partial(shared_slot, "w13", j) for j in range(s)]
    w2 += [partial(shared_slot, "w2", j) for j in range(s)]
    return ExpertStack(w13), ExpertStack(w2)


def _rows(t: Any, fn: Any) -> Any:
    """A row operation on a plain tensor, or on an :class:`fp8.QTensor` (its weight and per-row scale alike)."""
    return t.map_rows(fn) if isinstance(t, QTensor) else fn(t)


def _deinterleave_rows(w: Any, start: int, rope: int, stride: int = 0, count: int = 1) -> Any:
    """Permute, in ``count`` blocks of rows ``[start + j*stride, +rope)``, interleaved rope rows
    evens-first (so that half-split RoPE on the output equals interleaved RoPE on the original)."""
    if isinstance(w, QTensor):
        return w.map_rows(lambda t: _deinterleave_rows(t, start, rope, stride, count))
    w = w.clone()
    perm = layouts.rope_deinterleave_perm(rope).to(w.device)
    for j in range(count):
        lo = start + j * stride
        w[lo : lo + rope] = w[lo : lo + rope][perm]
    return w


def _fuse_layer(
    sd: MutableMapping[str, Any], src: str, args: ModelArgs, moe: bool, has_indexer: bool
) -> dict[str, Any]:
    """One decoder layer's HF-named tensors (prefix ``src``) -> the fused layout (same prefix); the experts as
    :class:`ExpertStack` s."""
    a = args
    h, p, r, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    at = src + "self_attn."
    out: dict[str, Any] = {}

    def take(name: str) -> Any:
        return _need(sd, at + name)

    q_name = "q_a_proj" if a.q_lora_rank is not None else "q_proj"
    wq = take(f"{q_name}.weight")
    wkv = take("kv_a_proj_with_mqa.weight")
    bias = [take(f"{q_name}.bias"), take("kv_a_proj_with_mqa.bias")] if a.attention_bias else []
    if a.rope_interleave:  # k_pe rows (and q_pe rows, below) evens-first
        wkv = _deinterleave_rows(wkv, lat, r)
        if bias:
            bias[1] = _deinterleave_rows(bias[1], lat, r)
    if a.q_lora_rank is None and a.rope_interleave:
        wq = _deinterleave_rows(wq, p, r, stride=p + r, count=h)
        if bias:
            bias[0] = _deinterleave_rows(bias[0], p, r, stride=p + r, count=h)
    wa = [wq, wkv]
    if has_indexer:
        di, hi = a.index_head_dim, a.index_n_heads
        wk, kn_w, kn_b = take("indexer.wk.weight"), take("indexer.k_norm.weight"), take("indexer.k_norm.bias")
        wq_b = take("indexer.wq_b.weight")
        if a.indexer_rope_interleave:
            wk, kn_w, kn_b = (_deinterleave_rows(t, 0, r) for t in (wk, kn_w, kn_b))
            wq_b = _deinterleave_rows(wq_b, 0, r, stride=di, count=hi)
        wproj = take("indexer.weights_proj.weight")
        if a.fp8:  # bf16 in FP8 checkpoints: kept apart (fp8.py)
            out[src + "attn.index_wproj"] = wproj
            wa += [wk]
        else:
            wa += [wk, wproj.to(wq.dtype)]
        if bias:
            bias += [torch.zeros(di + (0 if a.fp8 else hi), dtype=bias[0].dtype)]
        out[at.replace("self_attn.", "attn.") + "index_k_norm"] = kn_w
        out[at.replace("self_attn.", "attn.") + "index_k_bias"] = kn_b
    pre = src + "attn."
    out[pre + "wa"] = fp8.cat_rows(wa, pre + "wa")
    if bias:
        out[pre + "wa_bias"] = torch.cat(bias, 0)
    if a.q_lora_rank is not None:
        wq_b_main = take("q_b_proj.weight")
        if a.rope_interleave:
            wq_b_main = _deinterleave_rows(wq_b_main, p, r, stride=p + r, count=h)
        out[pre + "q_norm"] = take("q_a_layernorm.weight")
        out[pre + "wb"] = fp8.cat_rows([wq_b_main] + ([wq_b] if has_indexer else []), pre + "wb")
    out[pre + "kv_norm"] = take("kv_a_layernorm.weight")
    out[pre + "wkv_b"] = take("kv_b_proj.weight")
    out[pre + "wo"] = take("o_proj.weight")
    if a.attention_bias:
        out[pre + "wo_bias"] = take("o_proj.bias")
    out[pre + "attn_norm"] = _need(sd, src + "input_layernorm.weight")

    mp = src + "mlp."
    out[mp + "ffn_norm"] = _need(sd, src + "post_attention_layernorm.weight")
    if moe:
        out[mp + "gate"] = _need(sd, mp + "gate.weight")
        out[mp + "gate_bias"] = _need(sd, mp + "gate.e_score_correction_bias")
        out[mp + "w13"], out[mp + "w2"] = _expert_stacks(sd, mp, a)
    else:  # a dense MLP: one slot
        names = [mp + f"{k}.weight" for k in ("gate_proj", "up_proj", "down_proj")]
        out[mp + "w13"] = ExpertStack([lambda: fp8.cat_rows([_need(sd, n) for n in names[:2]], mp + "w13")])
        out[mp + "w2"] = ExpertStack([lambda: _need(sd, names[2])])
    return out


def store_fp8(sd: dict[str, Any], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Fused :class:`fp8.QTensor` s -> e4m3 ``X`` + grouped ``X_scale`` (``fp8.scale_groups``); an FP8 tensor the
    engine keeps in bf16 is dequantised (float32). In an FP8 model every fused weight must be FP8."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        leaf = name.rsplit(".", 1)[-1]
        if args.fp8 and leaf in fp8.FUSED_LEAVES and not isinstance(t, QTensor):
            raise ValueError(
                f"{name}: the checkpoint is FP8 but this weight is {t.dtype} (expected e4m3 with "
                "weight_scale_inv, as DeepSeek's FP8 checkpoints store it)"
            )
        if not isinstance(t, QTensor):
            out[name] = t
        elif leaf in fp8.FUSED_LEAVES:
            out[name] = t.weight.contiguous()
            out[name + fp8.SCALE_SUFFIX] = t.compress(*fp8.scale_groups(leaf, tuple(t.shape)), name)
        else:
            out[name] = fp8.dequant(t.weight, t.scale, torch.float32)  # per-row scale: groups (1, gk)
    return out


def _need(sd: MutableMapping[str, Any], name: str) -> Any:
    """``sd.pop(name)``; a tensor the model needs but the checkpoint lacks is refused by name."""
    if name not in sd:
        raise ValueError(f"checkpoint tensor {name!r} is missing")
    return sd.pop(name)


def fused_groups(sd: MutableMapping[str, Any], args: ModelArgs) -> Iterator[dict[str, Any]]:
    """Renamed tensors (:func:`convert_state_dict`, or the converter's lazy checkpoint) -> the fused layout of
    :class:`Transformer`, one group at a time (the top-level tensors, each layer, the MTP module); tensors are
    popped from ``sd`` as they are used (experts when their :class:`ExpertStack` slot is called), and what is left
    at the end is refused. The consumer finishes a group before asking for the next."""

    def pop(name: str) -> Any:
        return _need(sd, name)

    # one group each: the embedding and the head are the largest tensors, never both in memory at once
    yield {"embed": pop("embed_tokens.weight")}
    yield {"norm": pop("norm.weight")}
    yield {"lm_head": pop("lm_head.weight")}
    index_layers = set(args.index_layers)
    for i in range(args.num_layers):
        yield _fuse_layer(sd, f"layers.{i}.", args, args.mlp_layer_types[i] == "sparse", i in index_layers)
    if args.num_mtp_layers:
        out = _fuse_layer(sd, "mtp.0.block.", args, args.mtp_moe, args.mtp_indexer)
        for src, dst in (
            ("enorm.weight", "enorm"),
            ("hnorm.weight", "hnorm"),
            ("eh_proj.weight", "eh_proj"),
            ("shared_head.norm.weight", "head_norm"),
            ("embed_tokens.weight", "embed"),
            ("shared_head.head.weight", "head"),
        ):
            if "mtp.0." + src in sd:
                out["mtp.0." + dst] = sd.pop("mtp.0." + src)
        yield out
    leftover = [k for k in sd.keys() if not k.startswith("mtp.0.")]
    if leftover:
        raise ValueError(f"checkpoint tensors not used by the model: {leftover[:8]}")


def fuse_state_dict(sd: dict[str, Any], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF-named (renamed by :func:`convert_state_dict`) tensors -> :class:`Transformer`'s fused layout."""
    out: dict[str, Any] = {}
    for group in fused_groups(dict(sd), args):
        out.update({k: v.materialize() if isinstance(v, ExpertStack) else v for k, v in group.items()})
    return store_fp8(out, args)


def load_model(
    model_dir: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int = 1,
    tp: tuple[int, int] = (0, 1),
) -> Transformer:
    """Read ``model_dir`` (an HF checkpoint, or a directory written by ``tilert convert``) and return a ready
    :class:`Transformer` (weights in ``dtype``, FP8 weights kept e4m3; caches allocated for ``max_sequences``
    sequences of ``max_seq_len`` positions); ``tp = (rank, size)``: that rank's share of the model
    (``sharding.py``; of an HF checkpoint the whole is read, then sharded before it reaches the device; a directory
    converted with ``--tp size`` gives the rank its own shard)."""
    model_dir = Path(model_dir)
    if converted.is_converted(model_dir):  # with tp: this rank's shard of a directory converted with --tp
        return converted.load_converted(
            model_dir, device=device, dtype=dtype, max_seq_len=max_seq_len, max_sequences=max_sequences, tp=tp
        )
    cfg = load_hf_config(model_dir)
    keys = checkpoint_keys(model_dir)
    args = args_from_hf_config(cfg, keys)
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if _target_name(k, args) is not None:
                    tensors[k] = sf.get_tensor(k)
    sd = fuse_state_dict(convert_state_dict(tensors, args), args)
    if tp[1] > 1:
        sd, args = sharding.shard_state_dict(sd, args, *tp), sharding.local_args(args, *tp)
    with torch.device("meta"):
        model = Transformer(args)
    return finish_model(model, sd, device, dtype, max_seq_len, max_sequences)


@torch.no_grad()
def random_model(
    args: ModelArgs,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    seed: int = 0,
    max_sequences: int = 1,
) -> Transformer:
    """A :class:`Transformer` with random weights, created directly on ``device`` in the fused layout.

    Matrices ``~ N(0, fan_in^-1)`` (the embedding ``N(0, 1)``), norm weights ``1 + 0.1 N(0, 1)``, the indexer
    key-norm bias and the router bias small; caches zeroed. No checkpoint is read.
    """
    with torch.device("meta"):
        model = Transformer(args)
    gen = torch.Generator(device=device).manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        keep_fp32 = name.endswith(FP32_SUFFIXES + (fp8.SCALE_SUFFIX,))
        t = torch.empty(p.shape, device=device, dtype=torch.float32 if keep_fp32 else dtype)
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype == fp8.E4M3:  # FP8 weights: N(0, 1) in e4m3 (their scale carries fan_in^-0.5)
            sd[name] = t.normal_(0.0, 1.0, generator=gen).to(fp8.E4M3)
            continue
        if leaf.endswith(fp8.SCALE_SUFFIX):
            fan_in = params[name[: -len(fp8.SCALE_SUFFIX)]].shape[-1]
            sd[name] = t.uniform_(0.5, 1.5, generator=gen).mul_(fan_in**-0.5)
            continue
        if leaf in ("gate_bias",):
            t.normal_(0.0, 0.01, generator=gen)
        elif leaf in ("index_k_bias", "wa_bias", "wo_bias"):
            t.normal_(0.0, 0.05, generator=gen)
        elif p.dim() == 1:
            t.normal_(1.0, 0.1, generator=gen)
        elif leaf == "embed":
            t.normal_(0.0, 1.0, generator=gen)
        else:
            t.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        sd[name] = t
    return finish_model(model, sd, device, dtype, max_seq_len, max_sequences)
