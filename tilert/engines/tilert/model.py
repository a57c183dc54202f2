"""A gpt-fast-style decoder for DeepSeek-V3, DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``), batch 1.

One sequence, a static latent cache sized at load, positions as device tensors. The math follows
transformers 5.19's modeling files (``deepseek_v3``, ``deepseek_v32``, ``glm_moe_dsa``) so that logits
agree with them to rounding; attention is computed in the *absorbed* MLA form over the latent cache.

Notation (per layer): hidden ``D``, heads ``H``, nope ``P``, rope ``R``, value ``V``, latent ``L``
(``kv_lora_rank``), sequence capacity ``S`` (``max_seq_len``).

MLA, per token ``x`` (already RMS-normed by the layer):

- ``q = W_qb rms(W_qa x)`` (or ``W_q x`` without q_lora) viewed ``[H, P+R]`` -> ``q_nope, q_pe``.
- ``[c_kv | k_pe] = W_kva x``; ``c_kv = rms(c_kv)``; RoPE on ``q_pe`` and ``k_pe``.
- cache row ``= [c_kv | k_pe]`` (``L+R`` wide, rope dims in transformers' order, see ``layouts.py``).
- with ``W_kvb.view(H, P+V, L) = [W_UK; W_UV]``: ``q~_h = W_UK_h^T q_nope_h`` (``L`` wide), and
  ``s_h[t] = scale * [q~_h | q_pe_h] . cache[t]`` equals the naive ``q_nope_h.(W_UK_h c_kv[t]) + q_pe_h.k_pe[t]``.
- ``o~_h = sum_t softmax(s_h)[t] c_kv[t]`` (op ``tilert::mla_attention``), ``o_h = W_UV_h o~_h``, ``out = W_o o``.
- ``scale = (P+R)^-0.5 * mscale^2`` (YaRN's ``mscale_all_dim`` factor), never ``(L+R)^-0.5``.

DSA (V3.2, GLM-5): a per-layer lightning indexer picks ``index_topk`` cache rows per query and the
attention runs over those rows only (op ``tilert::mla_sparse_attention``):

- ``q_i = W_iq q_lat`` ``[Hi, Di]`` from the q_lora latent ``q_lat = rms(W_qa x)``;
  ``k_i = LayerNorm(W_ik x)`` ``[Di]``; both split ``[rope R | nope Di-R]`` and RoPE'd (half-split
  RoPE for V3.2, interleaved for GLM-5); ``k_i`` goes to the indexer cache ``[S, Di]``.
- ``w = W_w x * Hi^-0.5 * Di^-0.5`` (fp32); ``score[t] = sum_h w_h relu(q_i,h . k_i[t])`` (op ``tilert::indexer_topk``).
- GLM-5 ``indexer_types``: a ``"shared"`` layer has no indexer and reuses the previous full layer's top-k.

MoE (noaux_tc): ``s = sigmoid(W_g x)`` (fp32); choice scores ``s + bias``; groups ranked by the sum of
their top-2 choice scores, keep ``topk_group`` groups, pick ``top_k`` experts among them; weights
``s[e] / sum s[e] * routed_scaling_factor``; experts through ``tilert::moe_experts``; plus shared experts.

MTP (DeepSeek-V3 style, one module reused in a chain): for row ``i`` the module takes the main model's
final-norm hidden ``h_i`` and the next token ``t_{i+1}``:
``h' = W_eh [rms_e(embed(t_{i+1})) | rms_h(h_i)]`` -> one full decoder layer with its own latent cache
(row ``i``, rope position ``i``) -> ``logits = head(rms_s(h'))`` predicting ``t_{i+2}``. Chained drafts
feed the layer output ``h'`` (before ``shared_head.norm``) back in as ``h``. Rows of the MTP cache can be
invalid (a prompt whose MTP KV was not handed over): ``mtp_valid`` masks them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import ops


@dataclass
class ModelArgs:
    """Everything the decoder needs, parsed from an HF config (see ``weights.args_from_hf_config``)."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    mlp_layer_types: list[str]  # "dense" | "sparse" per layer
    rms_norm_eps: float
    attention_bias: bool
    rope_interleave: bool  # MLA rope pairs (2i, 2i+1) in the weights (DeepSeek) vs half-split
    softmax_scale: float  # (P+R)^-0.5 * mscale^2
    rope_inv_freq: list[float]
    rope_attention_scaling: float  # multiplies cos/sin (YaRN attention factor)
    tie_word_embeddings: bool = False
    # DSA
    dsa: bool = False
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope_interleave: bool = False
    indexer_types: list[str] = field(default_factory=list)  # "full" | "shared" per layer (DSA only)
    # MTP (at most one module is used; see weights.py)
    num_mtp_layers: int = 0
    mtp_moe: bool = True
    mtp_indexer: bool = False
    mtp_own_embed: bool = False
    mtp_own_head: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row, ``L + R`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_layers(self) -> list[int]:
        """Main-model layers that run their own indexer (and own an indexer cache slot)."""
        if not self.dsa:
            return []
        return [i for i in range(self.num_layers) if self.indexer_types[i] == "full"]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate ``x [..., R]`` by angles whose ``cos``/``sin`` broadcast to ``[..., R/2]``.

    Interleaved (DeepSeek weights): pairs ``(x_{2i}, x_{2i+1})``; half-split (rotate_half): pairs
    ``(x_i, x_{i+R/2})``. Either way the output is ``[x1 cos - x2 sin | x2 cos + x1 sin]``, i.e. the
    interleaved form comes out evens-first, exactly as transformers writes it.
    """
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    """RMSNorm through ``tilert::rms_norm``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts)."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """noaux_tc router: sigmoid scores + correction bias, group-limited top-k, normalised, scaled."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(args.n_routed_experts), requires_grad=False)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [n, D]`` -> ``(topk_ids int32 [n, k], topk_weights fp32 [n, k])``."""
        a = self.args
        n = x.shape[0]
        e, g = a.n_routed_experts, a.n_group
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(a.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask[:, :, None].expand(n, g, e // g).reshape(n, e)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        ids = choice.topk(a.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if a.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * a.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts (stacked ``w13 [E, 2I, D]`` gate-rows-first, ``w2 [E, D, I]``) + shared experts."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        e, d, i = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size
        self.gate = Router(args)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, d, i), requires_grad=False)
        self.shared_experts = MLP(d, i * args.n_shared_experts) if args.n_shared_experts else None

    def forward(self, x: Tensor) -> Tensor:
        ids, weights = self.gate(x)
        out = ops.moe_experts(x, ids, weights, self.w13, self.w2)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Indexer(nn.Module):
    """DSA lightning indexer (weights named as in transformers / DeepSeek checkpoints)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.q_lora_rank is not None, "the DSA indexer reads the q_lora latent"
        self.args = args
        hi, di = args.index_n_heads, args.index_head_dim
        self.wq_b = nn.Linear(args.q_lora_rank, hi * di, bias=False)
        self.wk = nn.Linear(args.hidden_size, di, bias=False)
        self.k_norm = nn.LayerNorm(di, eps=1e-6)
        self.weights_proj = nn.Linear(args.hidden_size, hi, bias=False)  # kept in fp32, as transformers does

    def forward(
        self, x: Tensor, q_lat: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor
    ) -> Tensor:
        """Write this step's indexer keys into ``k_cache [S, Di]`` and return top-k rows ``int32 [n, topk]``."""
        a = self.args
        n = x.shape[0]
        hi, di, r = a.index_n_heads, a.index_head_dim, a.qk_rope_head_dim
        q = self.wq_b(q_lat).view(n, hi, di)
        k = self.k_norm(self.wk(x))
        q = torch.cat([apply_rope(q[..., :r], cos[:, None], sin[:, None], a.indexer_rope_interleave), q[..., r:]], -1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin, a.indexer_rope_interleave), k[..., r:]], -1)
        k_cache.index_copy_(0, positions, k.to(k_cache.dtype))
        w = F.linear(x.to(self.weights_proj.weight.dtype), self.weights_proj.weight).float()
        w = w * (hi**-0.5 * di**-0.5)
        return ops.indexer_topk(q, w, k_cache, positions, a.index_topk)


class MLAttention(nn.Module):
    """Multi-head latent attention in the absorbed form over the latent cache (optionally DSA-sparse)."""

    def __init__(self, args: ModelArgs, has_indexer: bool) -> None:
        super().__init__()
        self.args = args
        d, h = args.hidden_size, args.num_heads
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * args.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(args.q_lora_rank, h * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, args.latent_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * args.v_head_dim, d, bias=args.attention_bias)
        self.indexer = Indexer(args) if has_indexer else None

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        index_cache: Tensor | None,
        shared_topk: Tensor | None,
        valid_rows: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """``x [n, D]`` at ``positions [n]`` -> ``(out [n, D], topk indices used or None)``.

        ``kv_cache [S, L+R]`` and ``index_cache [S, Di]`` are this layer's slices (written here).
        ``shared_topk``: a GLM-5 "shared" layer's top-k from the previous full layer. ``valid_rows``:
        bool ``[S]`` mask of usable cache rows (MTP layer), ``None`` = all rows up to the position.
        """
        a = self.args
        n = x.shape[0]
        h, p, r, lat = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        q_lat = None
        if a.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_lat = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_lat)
        q = q.view(n, h, a.qk_head_dim)
        q_nope, q_pe = q[..., :p], q[..., p:]

        ckv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(ckv[:, :lat])
        q_pe = apply_rope(q_pe, cos[:, None], sin[:, None], a.rope_interleave)
        k_pe = apply_rope(ckv[:, lat:], cos, sin, a.rope_interleave)
        kv_cache.index_copy_(0, positions, torch.cat([c_kv, k_pe], dim=-1).to(kv_cache.dtype))

        # Absorb W_UK into the query: q~_h = W_UK_h^T q_nope_h (per-head batched matmul).
        w_kvb = self.kv_b_proj.weight.view(h, p + a.v_head_dim, lat)
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_kvb[:, :p]).transpose(0, 1)  # [n, H, L]
        q_full = torch.cat([q_abs, q_pe], dim=-1).to(kv_cache.dtype)

        topk: Tensor | None = None
        if self.indexer is not None:
            assert index_cache is not None and q_lat is not None
            topk = self.indexer(x, q_lat, positions, cos, sin, index_cache)
        elif shared_topk is not None:
            topk = shared_topk
        if valid_rows is not None:
            if topk is None:  # dense attention restricted to valid rows: list every row
                s = kv_cache.shape[0]
                rows = torch.arange(s, device=x.device, dtype=torch.int32).expand(n, s)
                topk = torch.where(rows <= positions[:, None], rows, torch.full_like(rows, -1))
            safe = topk.long().clamp(min=0)
            topk = torch.where((topk >= 0) & valid_rows[safe], topk, torch.full_like(topk, -1))
        if topk is None:
            o_lat = ops.mla_attention(q_full, kv_cache, positions, a.softmax_scale, lat)
        else:
            o_lat = ops.mla_sparse_attention(q_full, kv_cache, topk, a.softmax_scale, lat)

        # o_h = W_UV_h o~_h, then o_proj.
        o = torch.bmm(o_lat.to(x.dtype).transpose(0, 1), w_kvb[:, p:].transpose(1, 2))  # [H, n, V]
        return self.o_proj(o.transpose(0, 1).reshape(n, h * a.v_head_dim)), topk


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(rms(h)); h += mlp(rms(h))``."""

    def __init__(self, args: ModelArgs, moe: bool, has_indexer: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = MLAttention(args, has_indexer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp: nn.Module = MoE(args) if moe else MLP(args.hidden_size, args.intermediate_size)

    def forward(
        self,
        h: Tensor,
        positions: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_cache: Tensor,
        index_cache: Tensor | None,
        shared_topk: Tensor | None = None,
        valid_rows: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        attn, topk = self.self_attn(
            self.input_layernorm(h), positions, cos, sin, kv_cache, index_cache, shared_topk, valid_rows
        )
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, topk


class SharedHead(nn.Module):
    """MTP output head: ``shared_head.norm`` and optionally its own ``shared_head.head``."""

    def __init__(self, args: ModelArgs, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    """One DeepSeek-V3-style multi-token-prediction module (checkpoint layer ``num_hidden_layers``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, d) if args.mtp_own_embed else None
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(args, args.mtp_own_head)
        self.block = DecoderLayer(args, moe=args.mtp_moe, has_indexer=args.mtp_indexer)


class Transformer(nn.Module):
    """The decoder plus its static caches (allocated by :meth:`setup_caches`)."""

    kv_cache: Tensor
    index_cache: Tensor
    mtp_kv_cache: Tensor
    mtp_index_cache: Tensor
    mtp_valid: Tensor
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        index_layers = set(args.index_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(args, moe=args.mlp_layer_types[i] == "sparse", has_indexer=i in index_layers)
            for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(args) for _ in range(args.num_mtp_layers))
        # layer -> slot in index_cache (only layers that run their own indexer)
        self.index_slot = {layer: slot for slot, layer in enumerate(args.index_layers)}
        self.max_seq_len = 0

    # ------------------------------------------------------------------------------------ setup

    @torch.no_grad()
    def setup_caches(self, max_seq_len: int, device: torch.device | str, dtype: torch.dtype) -> None:
        """Allocate the static caches (model dtype) and the RoPE tables for ``max_seq_len`` positions."""
        a = self.args
        self.max_seq_len = max_seq_len
        mk = dict(device=device, dtype=dtype)
        self.register_buffer("kv_cache", torch.zeros(a.num_layers, max_seq_len, a.latent_dim, **mk), persistent=False)
        self.register_buffer(
            "index_cache",
            torch.zeros(len(a.index_layers), max_seq_len, a.index_head_dim, **mk),
            persistent=False,
        )
        self.register_buffer(
            "mtp_kv_cache", torch.zeros(a.num_mtp_layers, max_seq_len, a.latent_dim, **mk), persistent=False
        )
        n_mtp_idx = a.num_mtp_layers if a.mtp_indexer else 0
        self.register_buffer(
            "mtp_index_cache", torch.zeros(n_mtp_idx, max_seq_len, a.index_head_dim, **mk), persistent=False
        )
        self.register_buffer(
            "mtp_valid", torch.zeros(max_seq_len, dtype=torch.bool, device=device), persistent=False
        )
        # transformers: freqs = pos * inv_freq in fp32, cos/sin times the attention factor, cast to x.dtype.
        inv_freq = torch.tensor(a.rope_inv_freq, dtype=torch.float32, device=device)
        freqs = torch.arange(max_seq_len, device=device).float()[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", (freqs.cos() * a.rope_attention_scaling).to(dtype), persistent=False)
        self.register_buffer("rope_sin", (freqs.sin() * a.rope_attention_scaling).to(dtype), persistent=False)

    # ---------------------------------------------------------------------------------- forward

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Main model: ``tokens int64 [n]`` at ``positions int64 [n]`` -> final-norm hidden ``[n, D]``.

        Writes the new tokens' latent (and indexer) rows into the caches.
        """
        h = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        topk: Tensor | None = None
        for i, layer in enumerate(self.layers):
            slot = self.index_slot.get(i)
            index_cache = self.index_cache[slot] if slot is not None else None
            shared = topk if (self.args.dsa and slot is None) else None
            h, new_topk = layer(h, positions, cos, sin, self.kv_cache[i], index_cache, shared)
            if new_topk is not None:
                topk = new_topk
        return self.norm(h)

    def logits(self, hidden: Tensor) -> Tensor:
        """``lm_head`` -> float32 logits ``[n, V]``."""
        return self.lm_head(hidden).float()

    def mtp_forward(self, tokens: Tensor, prev_hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """MTP rows at ``positions``: ``tokens`` are ``t_{i+1}``, ``prev_hidden`` is ``h_i`` (main final-norm
        output, or the previous draft's MTP output). Writes the MTP cache rows, marks them valid, and
        returns ``(h' [n, D] before shared_head.norm, logits fp32 [n, V])``.
        """
        m = self.mtp[0]
        embed = m.embed_tokens if m.embed_tokens is not None else self.embed_tokens
        x = torch.cat([m.enorm(embed(tokens)), m.hnorm(prev_hidden.to(self.rope_cos.dtype))], dim=-1)
        h = m.eh_proj(x)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        self.mtp_valid[positions] = True
        index_cache = self.mtp_index_cache[0] if self.args.mtp_indexer else None
        h, _ = m.block(h, positions, cos, sin, self.mtp_kv_cache[0], index_cache, None, self.mtp_valid)
        normed = m.shared_head.norm(h)
        head = m.shared_head.head if m.shared_head.head is not None else self.lm_head
        return h, head(normed).float()
