"""Reading HF checkpoints (config.json + *.safetensors, bf16/fp16/fp32) into :class:`model.Transformer`.

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
- then :func:`fuse_state_dict` builds the fused decode layout of ``model.py`` (``W_a``, ``W_b``, shared
  experts stacked after the routed ones, dense MLP as a one-slot MoE, rope rows permuted evens-first).

:func:`random_model` builds a model of the same layout from :class:`ModelArgs` alone (random weights,
created directly on the target device; benchmarks and kernel checks).

FP8 checkpoints (``weight_scale_inv`` tensors or a ``quantization_config``) are refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import layouts
from .model import ModelArgs, Transformer

SUPPORTED_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# Tensors transformers keeps in float32 whatever the model dtype.
_FP32_SUFFIXES = ("gate_bias",)  # e_score_correction_bias (fp32 in transformers too)
_MTP_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
_EXPERT_RE = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_RE = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


def load_hf_config(model_dir: Path) -> Any:
    """transformers' config object for ``model_dir`` (refuses unsupported archs and FP8)."""
    from transformers import AutoConfig

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("model_type") not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model_type {raw.get('model_type')!r}; supported: {SUPPORTED_ARCHS}")
    if raw.get("quantization_config"):
        raise ValueError("quantized (FP8) checkpoints are not supported by the tilert reference engine")
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


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_keys(model_dir: Path) -> set[str]:
    """All tensor names in the checkpoint."""
    keys: set[str] = set()
    for f in _checkpoint_files(model_dir):
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


def convert_state_dict(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Rename HF tensors and stack experts into ``w13``/``w2``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for hf_name, t in tensors.items():
        if hf_name.endswith("weight_scale_inv") or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("FP8 checkpoints are not supported by the tilert reference engine")
        name = _target_name(hf_name, args)
        if name is None:
            continue
        if (m := _EXPERT_RE.match(name)) is not None:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        elif (m := _FUSED_RE.match(name)) is not None:
            out[f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"] = t
        else:
            out[name] = t
    for mlp, per_expert in experts.items():
        ids = sorted(per_expert)
        if ids != list(range(len(ids))):
            raise ValueError(f"{mlp}: experts {ids} are not 0..E-1")
        out[f"{mlp}.w13"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]], dim=0) for e in ids]
        )
        out[f"{mlp}.w2"] = torch.stack([per_expert[e]["down_proj"] for e in ids])
    if "lm_head.weight" not in out and args.tie_word_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def _deinterleave_rows(w: torch.Tensor, start: int, rope: int, stride: int = 0, count: int = 1) -> torch.Tensor:
    """Permute, in ``count`` blocks of rows ``[start + j*stride, +rope)``, interleaved rope rows
    evens-first (so that half-split RoPE on the output equals interleaved RoPE on the original)."""
    w = w.clone()
    perm = layouts.rope_deinterleave_perm(rope).to(w.device)
    for j in range(count):
        lo = start + j * stride
        w[lo : lo + rope] = w[lo : lo + rope][perm]
    return w


def _fuse_layer(
    sd: dict[str, torch.Tensor], src: str, args: ModelArgs, moe: bool, has_indexer: bool
) -> dict[str, torch.Tensor]:
    """One decoder layer's HF-named tensors (prefix ``src``) -> the fused layout (same prefix)."""
    a = args
    h, p, r, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    at = src + "self_attn."
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        return sd.pop(at + name)

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
        wa += [wk, take("indexer.weights_proj.weight").to(wq.dtype)]
        if bias:
            bias += [torch.zeros(di + hi, dtype=bias[0].dtype)]
        out[at.replace("self_attn.", "attn.") + "index_k_norm"] = kn_w
        out[at.replace("self_attn.", "attn.") + "index_k_bias"] = kn_b
    pre = src + "attn."
    out[pre + "wa"] = torch.cat(wa, 0)
    if bias:
        out[pre + "wa_bias"] = torch.cat(bias, 0)
    if a.q_lora_rank is not None:
        wq_b_main = take("q_b_proj.weight")
        if a.rope_interleave:
            wq_b_main = _deinterleave_rows(wq_b_main, p, r, stride=p + r, count=h)
        out[pre + "q_norm"] = take("q_a_layernorm.weight")
        out[pre + "wb"] = torch.cat([wq_b_main] + ([wq_b] if has_indexer else []), 0)
    out[pre + "kv_norm"] = take("kv_a_layernorm.weight")
    out[pre + "wkv_b"] = take("kv_b_proj.weight")
    out[pre + "wo"] = take("o_proj.weight")
    if a.attention_bias:
        out[pre + "wo_bias"] = take("o_proj.bias")
    out[pre + "attn_norm"] = sd.pop(src + "input_layernorm.weight")

    mp = src + "mlp."
    out[mp + "ffn_norm"] = sd.pop(src + "post_attention_layernorm.weight")
    if moe:
        out[mp + "gate"] = sd.pop(mp + "gate.weight")
        out[mp + "gate_bias"] = sd.pop(mp + "gate.e_score_correction_bias")
        w13, w2 = sd.pop(mp + "w13"), sd.pop(mp + "w2")
        if a.n_shared_experts:
            i, s = a.moe_intermediate_size, a.n_shared_experts
            g = sd.pop(mp + "shared_experts.gate_proj.weight").view(s, i, -1)
            u = sd.pop(mp + "shared_experts.up_proj.weight").view(s, i, -1)
            d = sd.pop(mp + "shared_experts.down_proj.weight").view(-1, s, i).transpose(0, 1)
            w13 = torch.cat([w13, torch.cat([g, u], 1).to(w13.dtype)], 0)
            w2 = torch.cat([w2, d.to(w2.dtype)], 0)
        out[mp + "w13"], out[mp + "w2"] = w13, w2
    else:
        g, u, d = (sd.pop(mp + f"{k}.weight") for k in ("gate_proj", "up_proj", "down_proj"))
        out[mp + "w13"] = torch.cat([g, u], 0)[None]
        out[mp + "w2"] = d[None]
    return out


def fuse_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF-named (renamed by :func:`convert_state_dict`) tensors -> :class:`Transformer`'s fused layout."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {
        "embed": sd.pop("embed_tokens.weight"),
        "norm": sd.pop("norm.weight"),
        "lm_head": sd.pop("lm_head.weight"),
    }
    index_layers = set(args.index_layers)
    for i in range(args.num_layers):
        out.update(_fuse_layer(sd, f"layers.{i}.", args, args.mlp_layer_types[i] == "sparse", i in index_layers))
    if args.num_mtp_layers:
        out.update(_fuse_layer(sd, "mtp.0.block.", args, args.mtp_moe, args.mtp_indexer))
        for src, dst in (("enorm.weight", "enorm"), ("hnorm.weight", "hnorm"), ("eh_proj.weight", "eh_proj"),
                         ("shared_head.norm.weight", "head_norm"), ("embed_tokens.weight", "embed"),
                         ("shared_head.head.weight", "head")):
            if "mtp.0." + src in sd:
                out["mtp.0." + dst] = sd.pop("mtp.0." + src)
    leftover = [k for k in sd if not k.startswith("mtp.0.")]
    if leftover:
        raise ValueError(f"checkpoint tensors not used by the model: {leftover[:8]}")
    return out


def _finish(model: Transformer, sd: dict[str, torch.Tensor], device: torch.device | str, dtype: torch.dtype,
            max_seq_len: int, max_sequences: int = 1) -> Transformer:
    for k, t in sd.items():
        keep_fp32 = k.endswith(_FP32_SUFFIXES)
        sd[k] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing={missing} unexpected={unexpected}")
    model.eval()
    model.setup_caches(max_seq_len, device, dtype, max_sequences)
    return model


def load_model(
    model_dir: Path,
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int = 1,
    tp: tuple[int, int] = (0, 1),
) -> Transformer:
    """Read ``model_dir`` and return a ready :class:`Transformer` (weights in ``dtype``, caches allocated for
    ``max_sequences`` sequences of ``max_seq_len`` positions); ``tp = (rank, size)``: that rank's share of the
    model (``parallel.py``; the whole checkpoint is read, then sharded before it reaches the device)."""
    model_dir = Path(model_dir)
    cfg = load_hf_config(model_dir)
    keys = checkpoint_keys(model_dir)
    args = args_from_hf_config(cfg, keys)
    tensors: dict[str, torch.Tensor] = {}
    for f in _checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if _target_name(k, args) is not None:
                    tensors[k] = sf.get_tensor(k)
    sd = fuse_state_dict(convert_state_dict(tensors, args), args)
    if tp[1] > 1:
        from . import parallel

        sd, args = parallel.shard_state_dict(sd, args, *tp), parallel.local_args(args, *tp)
    with torch.device("meta"):
        model = Transformer(args)
    return _finish(model, sd, device, dtype, max_seq_len, max_sequences)


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
    for name, p in model.named_parameters():
        keep_fp32 = name.endswith(_FP32_SUFFIXES)
        t = torch.empty(p.shape, device=device, dtype=torch.float32 if keep_fp32 else dtype)
        leaf = name.rsplit(".", 1)[-1]
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
    return _finish(model, sd, device, dtype, max_seq_len, max_sequences)
