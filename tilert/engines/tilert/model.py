"""A gpt-fast-style decoder for DeepSeek-V3, DeepSeek-V3.2 and GLM-5 (``glm_moe_dsa``).

Static latent caches sized at load for ``max_sequences`` sequences of ``max_seq_len`` positions each, held one
after the other (sequence ``b`` in cache rows ``b*S .. b*S+S-1``); positions as device tensors. The math follows
transformers 5.19's modeling files (``deepseek_v3``, ``deepseek_v32``, ``glm_moe_dsa``) so that logits
agree with them to rounding; attention is computed in the *absorbed* MLA form over the latent cache.
Every heavy step is one ``tilert::*`` op (``ops/__init__.py``): plain PyTorch on CPU (exact), fused
Triton kernels on CUDA (``ops/cuda.py``, registered at start-up by ``ops.register_device_kernels()``), so
one model serves both; on CUDA the engine replays the whole decode step as one CUDA graph (``fast.py``). On
CPU the engine points the model at :mod:`.ops.cpu` (:meth:`Transformer.use_kernels`): the same math called
directly, without the dispatcher, over only the cache rows a step reads.

Addressing several sequences: either *flat rows* (CUDA: ``positions`` are cache rows ``b*S + p``, the RoPE
tables repeat every ``S`` rows so row ``b*S + p`` rotates as position ``p``, and ``row_start`` gives each
token's first row ``b*S``: one CUDA graph serves tokens of any sequences), or *one sequence's view*
(``seq=b``: the caches are sliced to its rows and ``positions`` are its own; the CPU path).

Notation (per layer): hidden ``D``, heads ``H``, nope ``P``, rope ``R``, value ``V``, latent ``L``
(``kv_lora_rank``), q latent ``Q`` (``q_lora_rank``), indexer heads/dim ``Hi``/``Di``, capacity ``S``.

Weight layout (fused at load by ``weights.py``; names below are this module's parameters):

- ``attn.wa [Q + L + R + Di + Hi, D] = [q_a_proj | kv_a_proj_with_mqa | indexer.wk | indexer.weights_proj]``
  applied to ``rms(h)`` in one GEMV (``input_layernorm`` fused in). Without q_lora ``q_proj`` takes the
  place of ``q_a_proj``; layers without an indexer drop its two blocks.
- ``attn.wb [H(P+R) + Hi Di, Q] = [q_b_proj | indexer.wq_b]`` applied to ``rms(q_a)`` (``q_a_layernorm``
  fused in).
- ``attn.wkv_b = kv_b_proj [H(P+V), L]`` read in place as ``[W_UK; W_UV]`` per head; ``attn.wo = o_proj``.
- ``mlp.w13 [E+S, 2I, D]`` (gate rows first), ``mlp.w2 [E+S, D, I]``: routed experts ``0..E-1`` then the
  shared MLP split into ``S`` experts of width ``I`` (``sum_s down_s(silu(gate_s x) up_s x)`` is the
  shared MLP exactly), routed with weight 1. A dense MLP is a one-slot MoE (``w13 [1, 2I', D]``).
- Block-FP8 models (``ModelArgs.fp8``): ``wa``, ``wb``, ``wkv_b``, ``wo``, ``w13``, ``w2`` are e4m3 with a float32
  scale each (``wa_scale``, ...; layout and how the scales follow the fusion in ``fp8.py``), passed to the ops
  beside the weight; ``W_a`` then leaves out the bf16 ``indexer.weights_proj``, kept as ``attn.index_wproj``
  (read as ``W_a``'s plain tail rows in the same GEMV, ``tilert::gemv``'s ``tail``, so ``a`` keeps its layout).
- RoPE: DeepSeek's interleaved rope dims are permuted evens-first in the producing weight rows at load,
  after which the interleaved rotation *is* the half-split one (``reference.apply_rope_half``); the cache
  rows come out in transformers' order either way (see ``layouts.py``).

MLA, per token (``x = rms(h)``): ``a = W_a x``, ``b = W_b rms(q_a)``, then ``tilert::mla_prep``:

- ``q = b[:H(P+R)]`` viewed ``[H, P+R]`` -> ``q_nope, q_pe``; with ``[W_UK; W_UV] = W_kvb.view(H, P+V, L)``,
  ``q~_h = W_UK_h^T q_nope_h`` (``L`` wide); the attention query is ``[q~_h | rope(q_pe_h)]``.
- cache row ``[rms(c_kv) | rope(k_pe)]`` written at the position; ``s_h[t] = scale * q_h . cache[t]``
  equals the naive ``q_nope_h.(W_UK_h c_kv[t]) + q_pe_h.k_pe[t]``.
- ``o~_h = sum_t softmax(s_h)[t] c_kv[t]`` and ``o_h = W_UV_h o~_h`` (``tilert::mla_attention_uv``: the
  composition of ``mla_attention`` / ``mla_sparse_attention`` and ``mla_uv``), ``h += W_o o``
  (``tilert::gemv_residual``).
- ``scale = (P+R)^-0.5 * mscale^2`` (YaRN's ``mscale_all_dim`` factor), never ``(L+R)^-0.5``.

DSA (V3.2, GLM-5): the lightning indexer picks ``index_topk`` cache rows per query and attention runs
over those rows only: ``q_i = W_iq q_lat`` ``[Hi, Di]``, ``k_i = LayerNorm(W_ik x)``, both RoPE'd on their
first ``R`` dims (``k_i`` cached); ``w = W_w x * Hi^-0.5 * Di^-0.5`` (fp32);
``score[t] = sum_h w_h relu(q_i,h . k_i[t])`` (``tilert::indexer_topk``). While every query position is
``< index_topk`` the top-k is every row, so the step runs dense MLA instead (same result; the indexer keys
are still cached, and the rows of ``W_a`` / ``W_b`` that only score rows, the head weights and queries, are not
read: ``ModelArgs.wa_step_rows``). GLM-5 ``indexer_types``: a ``"shared"`` layer reuses the previous full layer's top-k.

MoE (noaux_tc routing inside ``tilert::moe_block``): ``s = sigmoid(W_g x)`` (fp32); choice scores ``s + bias``; groups
ranked by the sum of their top-2 choice scores, keep ``topk_group`` groups, pick ``top_k`` experts among
them; weights ``s[e] / sum s[e] * routed_scaling_factor``; then the shared slots. ``tilert::moe_residual``
computes ``h += sum_j w_j W2_j (silu(G_j x) * U_j x)`` with ``x = rms(h)``.

MTP (DeepSeek-V3 style, one module reused in a chain): for row ``i`` the module takes the main model's
final-norm hidden ``h_i`` and the next token ``t_{i+1}``:
``h' = W_eh [rms_e(embed(t_{i+1})) | rms_h(h_i)]`` -> one full decoder layer with its own latent cache
(row ``i``, rope position ``i``) -> ``logits = head(rms_s(h'))`` predicting ``t_{i+2}``. Chained drafts
feed the layer output ``h'`` (before ``shared_head.norm``) back in as ``h``. The module's attention is
dense over its valid rows ``valid_from..i`` (rows before ``valid_from``, e.g. of a prompt whose MTP KV was
not handed over, are skipped); its indexer keys, if any, are still written.

Tensor parallelism over ``N`` ranks (``sharding.py`` shards the weights, ``parallel.py`` holds the collectives,
``Transformer.use_group``; every rank runs this same code with rank-local :class:`ModelArgs`):

- attention: each rank holds ``H/N`` heads (its rows of ``q_b`` and ``kv_b``, its columns of ``o_proj``).
  ``W_a`` (``q_a``, ``kv_a``), the latent cache and the DSA indexer (weights and key cache) are replicated:
  MLA has one latent KV head that every query head reads, and the indexer's top-k needs every indexer head.
  ``h += W_o o`` becomes: the ``W_o`` kernel writes ``h + partial`` (rank 0) or its partial alone (the others)
  into the rank's all-reduce buffer (``Group.partial``), then one all-reduce sums them into ``h``
  (``o_proj``'s bias lives on rank 0 only).
- MoE: the router runs on every rank (replicated gate); every expert (routed, shared, dense MLP) is split along
  its intermediate width, so each rank runs the one-GPU MoE kernels over all the chosen slots at ``I/N``; each
  rank's share of ``mlp(rms(h))`` is written and all-reduced into ``h`` as attention's ``W_o``.
- ``lm_head`` (and the MTP head) is vocabulary-parallel: each rank computes ``V/N`` logits, all-gathered.
  Embeddings, norms and the MTP ``eh_proj`` are replicated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fp8, ops, parallel

Ahead = tuple[tuple[str, Tensor], ...]
"""Weights a later kernel reads, each with the name of its site, for the kernels to bring into cache early
(``tilert::l2_prefetch``)."""


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
    rope_interleave: bool  # MLA rope pairs (2i, 2i+1) in the checkpoint (permuted evens-first at load)
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
    # Tensor parallelism (``sharding.py``): this rank of ``tp_size``; the args are then rank-local
    # (``num_heads``, ``intermediate_size`` and ``moe_intermediate_size`` are this rank's share; see the module
    # docstring).
    tp_rank: int = 0
    tp_size: int = 1
    # Block-FP8 weights (fp8.py): the fused projections and experts are e4m3 with float32 scales.
    fp8: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent cache row, ``L + R`` (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def q_width(self) -> int:
        """Width of the query block of ``W_b`` (or ``W_a`` without q_lora), ``H (P+R)``."""
        return self.num_heads * self.qk_head_dim

    @property
    def index_layers(self) -> list[int]:
        """Main-model layers that run their own indexer (and own an indexer cache slot)."""
        if not self.dsa:
            return []
        return [i for i in range(self.num_layers) if self.indexer_types[i] == "full"]

    def wa_rows(self, has_indexer: bool) -> int:
        """Rows of the fused ``W_a``: ``[q_a or q | kv_a | idx_wk | idx_weights_proj]``."""
        q = self.q_lora_rank if self.q_lora_rank is not None else self.q_width
        # FP8: the bf16 weights_proj rows are kept apart (attn.index_wproj), see fp8.py.
        idx = self.index_head_dim + (0 if self.fp8 else self.index_n_heads) if has_indexer else 0
        return q + self.latent_dim + idx

    def wb_rows(self, has_indexer: bool) -> int:
        """Rows of the fused ``W_b = [q_b | idx_wq_b]`` (q_lora models only)."""
        return self.q_width + (self.index_n_heads * self.index_head_dim if has_indexer else 0)

    def wa_step_rows(self, has_indexer: bool, sparse: bool) -> int:
        """Rows of ``W_a`` a step reads. The indexer's head weights (``weights_proj``) only score rows for the top-k,
        so a dense step (every row attended) leaves them out; its key is still computed (the cache keeps it)."""
        skip = self.index_n_heads if has_indexer and not sparse and not self.fp8 else 0
        return self.wa_rows(has_indexer) - skip

    def wb_step_rows(self, has_indexer: bool, sparse: bool) -> int:
        """Rows of ``W_b`` a step reads: the indexer's queries only on a sparse step (see :meth:`wa_step_rows`)."""
        return self.wb_rows(has_indexer and sparse)


# Tensors transformers keeps in float32 whatever the model dtype.
FP32_SUFFIXES = ("gate_bias",)  # e_score_correction_bias (fp32 in transformers too)


def _param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _linear(args: ModelArgs, leaf: str, *shape: int) -> tuple[nn.Parameter, nn.Parameter | None]:
    """A fused weight of ``shape``: plain (scale ``None``), or e4m3 with its float32 scale when ``args.fp8``."""
    if not args.fp8:
        return _param(*shape), None
    return _param(*shape, dtype=fp8.E4M3), _param(*fp8.scale_shape(leaf, shape), dtype=torch.float32)


class MLAttention(nn.Module):
    """Multi-head latent attention in the absorbed form over the latent cache (optionally DSA-sparse).

    The layer's ``input_layernorm`` weight lives here as ``attn_norm`` (it is fused into ``W_a``).
    """

    k: Any = ops  # the kernel table: the dispatched ``tilert::*`` ops, or ``ops.cpu`` (Transformer.use_kernels)
    tp: Any = parallel.ONE_RANK  # the tensor-parallel group's collectives (Transformer.use_group)

    def __init__(self, args: ModelArgs, has_indexer: bool) -> None:
        super().__init__()
        self.args = args
        self.has_indexer = has_indexer
        d, h, lat = args.hidden_size, args.num_heads, args.kv_lora_rank
        self.attn_norm = _param(d)
        self.wa, self.wa_scale = _linear(args, "wa", args.wa_rows(has_indexer), d)
        self.wa_bias = _param(args.wa_rows(has_indexer)) if args.attention_bias else None
        self.index_wproj = _param(args.index_n_heads, d) if args.fp8 and has_indexer else None
        self.wb_scale: nn.Parameter | None = None
        if args.q_lora_rank is not None:
            self.q_norm = _param(args.q_lora_rank)
            self.wb, self.wb_scale = _linear(args, "wb", args.wb_rows(has_indexer), args.q_lora_rank)
        self.kv_norm = _param(lat)
        self.wkv_b, self.wkv_b_scale = _linear(args, "wkv_b", h * (args.qk_nope_head_dim + args.v_head_dim), lat)
        self.wo, self.wo_scale = _linear(args, "wo", d, h * args.v_head_dim)
        self.wo_bias = _param(d) if args.attention_bias else None
        if has_indexer:
            self.index_k_norm = _param(args.index_head_dim)
            self.index_k_bias = _param(args.index_head_dim)

    def forward(
        self,
        h: Tensor,
        positions: Tensor,
        rope: tuple[Tensor, Tensor],
        kv_cache: Tensor,
        index_cache: Tensor | None,
        topk: Tensor | None,
        use_indexer: bool,
        row_start: Tensor | None = None,
        ahead: Callable[[], Ahead] = lambda: (),
        dense_rows: int = 0,
    ) -> Tensor | None:
        """``h += attn(rms(h))`` in place, for ``h [n, D]`` at cache rows ``positions [n]``.

        ``kv_cache [S, L+R]`` / ``index_cache [S, Di]`` are this layer's slices (rows written here).
        ``use_indexer``: run the DSA top-k (else dense MLA; the caller guarantees every query position is
        ``< index_topk``, where the top-k is every row). ``topk``: a GLM-5 "shared" layer's rows from the
        previous full layer. ``row_start`` (int64 ``[1]`` or ``[n]``): each token's first usable cache row
        (its sequence's first row, or the MTP layer's first valid row; a device tensor, so one CUDA graph
        serves every value). ``ahead``: weights read after this attention, brought into cache with
        ``W_o`` once the projections are done. ``dense_rows``: the most rows a dense query reads (0: any number),
        which the device kernels size their work by. Returns the top-k rows this layer attended to (``None`` when
        dense).
        """
        a = self.args
        k = self.k
        qa = a.q_lora_rank if a.q_lora_rank is not None else a.q_width
        # a = [q_a | c_kv | k_pe | idx_k | idx_w] = W_a rms(h);  b = [q | idx_q] = W_b rms(q_a).
        # FP8: the bf16 indexer head weights (index_wproj) are W_a's plain tail rows (a keeps its layout).
        # A dense step reads neither idx_w nor idx_q (ModelArgs.wa_step_rows): those rows are not computed.
        scores = self.has_indexer and use_indexer
        n_a, n_b = a.wa_step_rows(self.has_indexer, use_indexer), a.wb_step_rows(self.has_indexer, use_indexer)
        wa = k.gemv(
            h,
            _head_rows(self.wa, n_a),
            self.attn_norm,
            a.rms_norm_eps,
            _head_rows(self.wa_bias, n_a),
            scale=_head_rows(self.wa_scale, n_a),
            tail=self.index_wproj if scores else None,
        )
        if a.q_lora_rank is not None:
            b = k.gemv(wa[:, :qa], _head_rows(self.wb, n_b), self.q_norm, 1e-6, scale=_head_rows(self.wb_scale, n_b))
        else:
            b = wa
        _prefetch(k, h, lambda: _site("wo", self.wo, self.wo_scale) + ahead())  # read after the attention core
        index_scale = (a.index_n_heads**-0.5 * a.index_head_dim**-0.5) if self.has_indexer else 1.0
        q, index_q, index_w = k.mla_prep(
            wa,
            b,
            positions,
            self.wkv_b,
            rope[0],
            rope[1],
            self.kv_norm,
            kv_cache,
            self.index_k_norm if self.has_indexer else None,
            self.index_k_bias if self.has_indexer else None,
            index_cache,
            a.num_heads,
            a.qk_nope_head_dim,
            qa,
            a.index_n_heads if scores else 0,  # a dense step: the indexer's key only (its cache row)
            1e-6,
            index_scale,
            self.wkv_b_scale,
        )

        lat = a.kv_lora_rank
        if self.has_indexer and use_indexer:
            topk = k.indexer_topk(index_q, index_w, index_cache, positions, a.index_topk, row_start)
        if topk is None or not use_indexer:
            topk = None
        # o = [W_UV_h o~_h]_h with o~ the attention output (dense over row_start..positions, or over the top-k
        # rows), one op; then h += W_o o (several ranks: each rank's share, rank 0's with h, all-reduced).
        o = k.mla_attention_uv(
            q,
            kv_cache,
            positions if topk is None else None,
            topk,
            a.softmax_scale,
            lat,
            row_start if topk is None else None,
            self.wkv_b,
            a.qk_nope_head_dim,
            self.wkv_b_scale,
            dense_rows,
        )
        out, base = self.tp.partial(h)
        if self.wo_bias is not None:
            ops.reference.write_residual(out, k.gemv(o, self.wo, None, 0.0, self.wo_bias, scale=self.wo_scale), base)
        else:
            k.gemv_residual(out, o, self.wo, base, self.wo_scale)
        self.tp.reduce_into(h, out)
        return topk

    def weights_ahead(self) -> Ahead:
        """This attention's first weights (``W_a``, ``W_b``), for the layer before to bring into cache."""
        wb = (self.wb, self.wb_scale) if self.args.q_lora_rank is not None else ()
        return _site("wa_next", self.wa, self.wa_scale, self.index_wproj, *wb)


class MoE(nn.Module):
    """Routed + shared experts stacked in ``w13``/``w2`` (module docstring), with their router.

    ``routed=False`` builds the dense MLP as a one-slot MoE (no router, the single slot has weight 1).
    The layer's ``post_attention_layernorm`` weight lives here as ``ffn_norm``.
    """

    k: Any = ops  # the kernel table (see MLAttention.k)
    tp: Any = parallel.ONE_RANK  # (see MLAttention.tp)

    def __init__(self, args: ModelArgs, routed: bool) -> None:
        super().__init__()
        self.args = args
        d = args.hidden_size
        self.ffn_norm = _param(d)
        self.routed = routed
        if routed:
            i, e = args.moe_intermediate_size, args.n_routed_experts
            self.gate = _param(e, d)
            self.gate_bias = _param(e, dtype=torch.float32)  # e_score_correction_bias, kept in fp32
            slots = e + args.n_shared_experts
        else:
            i, slots = args.intermediate_size, 1
        self.w13, self.w13_scale = _linear(args, "w13", slots, 2 * i, d)
        self.w2, self.w2_scale = _linear(args, "w2", slots, d, i)

    def forward(self, h: Tensor) -> None:
        """``h += mlp(rms(h))`` in place."""
        a = self.args
        n = h.shape[0]
        if a.tp_size > 1:
            self._forward_parallel(h)
        elif self.routed:
            self.k.moe_block(
                h,
                self.ffn_norm,
                a.rms_norm_eps,
                self.gate,
                self.gate_bias,
                a.num_experts_per_tok,
                a.n_group,
                a.topk_group,
                a.routed_scaling_factor,
                a.norm_topk_prob,
                a.n_shared_experts,
                self.w13,
                self.w2,
                self.w13_scale,
                self.w2_scale,
            )
        else:
            ids, weights = _one_slot(n, h.device)
            self.k.moe_residual(
                h, self.ffn_norm, a.rms_norm_eps, ids, weights, self.w13, self.w2, self.w13_scale, self.w2_scale
            )

    def gate_ahead(self) -> Ahead:
        """The router's gate, for the attention before to bring into cache."""
        return _site("gate", self.gate) if self.routed else ()

    def shared_ahead(self) -> Ahead:
        """The shared experts' weights (the last slots), for the kernels before the router to bring into cache."""
        if not (self.routed and self.args.n_shared_experts):
            return ()
        e = self.args.n_routed_experts
        return _site("shared", *(t[e:] for t in (self.w13, self.w13_scale, self.w2, self.w2_scale) if t is not None))

    def _forward_parallel(self, h: Tensor) -> None:
        """Several ranks: the one-GPU MoE over this rank's slice of every expert's width, written as ``h`` plus
        the share (rank 0) or the share alone (the others), then all-reduced into ``h`` (as attention's ``W_o``)."""
        a, k, eps = self.args, self.k, self.args.rms_norm_eps
        n = h.shape[0]
        if self.routed:
            ids, weights = k.router(
                h,
                self.ffn_norm,
                eps,
                self.gate,
                self.gate_bias,
                a.num_experts_per_tok,
                a.n_group,
                a.topk_group,
                a.routed_scaling_factor,
                a.norm_topk_prob,
                a.n_shared_experts,
            )
        else:
            ids, weights = _one_slot(n, h.device)
        out, base = self.tp.partial(h)  # the experts read rms(h) before the share is written (out may be h)
        k.moe_partial(out, h, self.ffn_norm, eps, ids, weights, self.w13, self.w2, base, self.w13_scale, self.w2_scale)
        self.tp.reduce_into(h, out)


@overload
def _head_rows(t: Tensor, n: int) -> Tensor: ...
@overload
def _head_rows(t: Tensor | None, n: int) -> Tensor | None: ...
def _head_rows(t: Tensor | None, n: int) -> Tensor | None:
    """The first ``n`` rows of ``t`` (``t`` itself when that is all of it: no view made on a step that reads every
    row), or None."""
    return t if t is None or t.shape[0] == n else t[:n]


def _site(site: str, *tensors: Tensor | None) -> Ahead:
    """``tensors`` (the ``None`` ones left out) named as ``site``."""
    return tuple((site, t) for t in tensors if t is not None)


def _captured(x: Tensor) -> bool:
    """Whether ``x``'s step is being captured as a CUDA graph (the decode steps)."""
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _prefetch(k: Any, x: Tensor, ahead: Callable[[], Ahead]) -> None:
    """Ask the kernels ``k`` to bring ``ahead()``'s weights into the device's cache (a hint, no result), in a
    captured step only (``x``: its activations): the steps that stream every weight for a few tokens. Eager runs
    (prompts, warm-ups) and the CPU engine's steps build nothing."""
    if not _captured(x):
        return
    if tensors := ahead():
        k.l2_prefetch([t for _, t in tensors], ",".join(site for site, _ in tensors))


def _one_slot(n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The routing of a dense MLP (a one-slot MoE): slot 0, weight 1, for each of ``n`` tokens."""
    return (torch.zeros(n, 1, dtype=torch.int32, device=device), torch.ones(n, 1, dtype=torch.float32, device=device))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(rms(h)); h += mlp(rms(h))`` (both in place, norms fused in)."""

    def __init__(self, args: ModelArgs, moe: bool, has_indexer: bool) -> None:
        super().__init__()
        self.attn = MLAttention(args, has_indexer)
        self.mlp = MoE(args, routed=moe)

    def forward(
        self,
        h: Tensor,
        positions: Tensor,
        rope: tuple[Tensor, Tensor],
        kv_cache: Tensor,
        index_cache: Tensor | None,
        topk: Tensor | None,
        use_indexer: bool,
        row_start: Tensor | None = None,
        next_layer: DecoderLayer | None = None,
        dense_rows: int = 0,
    ) -> Tensor | None:
        """The block; ``next_layer``'s first weights are brought into cache before the MLP (``dense_rows``: as
        :class:`MLAttention`'s)."""
        mlp = self.mlp
        topk = self.attn(
            h, positions, rope, kv_cache, index_cache, topk, use_indexer, row_start, mlp.gate_ahead, dense_rows
        )
        _prefetch(mlp.k, h, lambda: mlp.shared_ahead() + (next_layer.attn.weights_ahead() if next_layer else ()))
        mlp(h)
        return topk


class MTPLayer(nn.Module):
    """One DeepSeek-V3-style multi-token-prediction module (checkpoint layer ``num_hidden_layers``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        d = args.hidden_size
        self.embed = _param(args.vocab_size, d) if args.mtp_own_embed else None
        self.enorm = _param(d)
        self.hnorm = _param(d)
        self.eh_proj = _param(d, 2 * d)
        self.head_norm = _param(d)  # shared_head.norm
        self.head = _param(args.vocab_size // args.tp_size, d) if args.mtp_own_head else None  # shared_head.head
        self.block = DecoderLayer(args, moe=args.mtp_moe, has_indexer=args.mtp_indexer)
        # the head the drafts read when it is not the model's (Transformer.set_draft_head): its rows (e4m3 with its
        # scales, or as the head), and the token id of each row when they are a subset of the vocabulary
        self.draft_head: Tensor | None = None
        self.draft_head_scale: Tensor | None = None
        self.draft_vocab: Tensor | None = None


class Transformer(nn.Module):
    """The decoder plus its static caches (allocated by :meth:`setup_caches`)."""

    k: Any = ops  # the kernel table of the final norm and lm_head (see use_kernels)
    tp: Any = parallel.ONE_RANK  # (see MLAttention.tp)

    kv_cache: Tensor
    index_cache: Tensor
    mtp_kv_cache: Tensor
    mtp_index_cache: Tensor
    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = _param(args.vocab_size, args.hidden_size)
        index_layers = set(args.index_layers)
        self.layers = nn.ModuleList(
            DecoderLayer(args, moe=args.mlp_layer_types[i] == "sparse", has_indexer=i in index_layers)
            for i in range(args.num_layers)
        )
        self.norm = _param(args.hidden_size)
        self.lm_head = _param(args.vocab_size // args.tp_size, args.hidden_size)  # this rank's vocabulary rows
        self.mtp = nn.ModuleList(MTPLayer(args) for _ in range(args.num_mtp_layers))
        # layer -> slot in index_cache (only layers that run their own indexer)
        self.index_slot = {layer: slot for slot, layer in enumerate(args.index_layers)}
        self.max_seq_len = 0  # positions per sequence (S)
        self.max_sequences = 1  # sequences the caches hold (B)

    def use_kernels(self, kernels: Any) -> None:
        """Compute with ``kernels`` (a namespace with every ``tilert::*`` op's signature): :mod:`.ops` (the
        dispatched custom ops, the default) or :mod:`.ops.cpu` (the CPU kernels called directly)."""
        for mod in self.modules():
            if isinstance(mod, (MLAttention, MoE, Transformer)):
                mod.k = kernels

    def use_group(self, group: Any) -> None:
        """Compute as one rank of ``group`` (a :class:`parallel.Group` whose size is ``args.tp_size``)."""
        if group.size != self.args.tp_size or group.rank != self.args.tp_rank:
            raise ValueError(
                f"rank {group.rank} of {group.size} cannot run a model sharded for rank "
                f"{self.args.tp_rank} of {self.args.tp_size}"
            )
        for mod in self.modules():
            if isinstance(mod, (MLAttention, MoE, Transformer)):
                mod.tp = group

    # ------------------------------------------------------------------------------------ setup

    @torch.no_grad()
    def setup_caches(
        self, max_seq_len: int, device: torch.device | str, dtype: torch.dtype, max_sequences: int = 1
    ) -> None:
        """Allocate the static caches (model dtype) for ``max_sequences`` sequences of ``max_seq_len`` positions,
        one after the other (``[layers, max_sequences * max_seq_len, width]``), and the RoPE tables (one row
        per cache row: row ``b*S + p`` holds position ``p``'s rotation)."""
        a = self.args
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1 ({max_sequences})")
        self.max_seq_len = max_seq_len
        self.max_sequences = max_sequences
        rows = max_sequences * max_seq_len

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, device=device, dtype=dtype)

        self.register_buffer("kv_cache", zeros(a.num_layers, rows, a.latent_dim), persistent=False)
        self.register_buffer("index_cache", zeros(len(a.index_layers), rows, a.index_head_dim), persistent=False)
        self.register_buffer("mtp_kv_cache", zeros(a.num_mtp_layers, rows, a.latent_dim), persistent=False)
        n_mtp_idx = a.num_mtp_layers if a.mtp_indexer else 0
        self.register_buffer("mtp_index_cache", zeros(n_mtp_idx, rows, a.index_head_dim), persistent=False)
        # transformers: freqs = pos * inv_freq in fp32, cos/sin times the attention factor, cast to x.dtype.
        inv_freq = torch.tensor(a.rope_inv_freq, dtype=torch.float32, device=device)
        pos = torch.arange(rows, device=device) % max_seq_len
        freqs = pos.float()[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", (freqs.cos() * a.rope_attention_scaling).to(dtype), persistent=False)
        self.register_buffer("rope_sin", (freqs.sin() * a.rope_attention_scaling).to(dtype), persistent=False)

    # ---------------------------------------------------------------------------------- forward

    def _rows(self, cache: Tensor, seq: int | None) -> Tensor:
        """``cache [layers, B*S, W]``, or only sequence ``seq``'s rows ``[layers, S, W]`` (a view)."""
        if seq is None:
            return cache
        lo = seq * self.max_seq_len
        return cache[:, lo : lo + self.max_seq_len]

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        use_indexer: bool = True,
        row_start: Tensor | None = None,
        seq: int | None = None,
    ) -> Tensor:
        """Main model: ``tokens int64 [n]`` at ``positions int64 [n]`` -> final-norm hidden ``[n, D]``.

        Writes the new tokens' latent (and indexer) rows into the caches. ``use_indexer=False`` runs dense
        MLA in every layer; only valid while every position is ``< index_topk`` (then identical).
        Flat rows (``seq=None``): ``positions`` are cache rows and ``row_start`` (int64 ``[n]``) each token's
        first row (its sequence's; ``None``: row 0). ``seq=b``: the caches are sequence ``b``'s rows only and
        ``positions`` its own positions (module docstring).
        """
        use_indexer = use_indexer and self.args.dsa
        # dense below the top-k (a DSA model's short context): no query reads more than index_topk rows
        dense_rows = self.args.index_topk if self.args.dsa and not use_indexer else 0
        kv, idx = self._rows(self.kv_cache, seq), self._rows(self.index_cache, seq)
        h = F.embedding(tokens, self.embed)
        rope = (self.rope_cos, self.rope_sin)
        topk: Tensor | None = None
        layers = cast(list[DecoderLayer], list(self.layers))
        for i, layer in enumerate(layers):
            slot = self.index_slot.get(i)
            index_cache = idx[slot] if slot is not None else None
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            topk = layer(h, positions, rope, kv[i], index_cache, topk, use_indexer, row_start, nxt, dense_rows)
        return self.k.rms_norm(h, self.norm, self.args.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        """``lm_head`` -> float32 logits ``[n, V]`` (several ranks: each rank's ``V/N`` columns, all-gathered)."""
        return self.tp.all_gather(self.k.gemv(hidden, self.lm_head, fp32_out=True))

    def mtp_forward(
        self, tokens: Tensor, prev_hidden: Tensor, positions: Tensor, valid_from: Tensor, seq: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """MTP rows at ``positions``: ``tokens`` are ``t_{i+1}``, ``prev_hidden`` is ``h_i`` (main final-norm
        output, or the previous draft's MTP output). Writes the MTP cache rows and attends over rows
        ``valid_from..i`` (``valid_from``: int64 ``[1]`` on the model's device); returns
        ``(h' [n, D] before shared_head.norm, logits fp32 [n, V])`` (``V``: the draft head's rows, see
        :meth:`set_draft_head`; :meth:`draft_tokens` reads them). Rows are addressed as in :meth:`forward` (flat, or
        sequence ``seq``'s own).
        """
        a = self.args
        k = self.k
        m = cast(MTPLayer, self.mtp[0])  # nn.ModuleList items are typed as plain Modules
        eps = a.rms_norm_eps
        embed = m.embed if m.embed is not None else self.embed
        e = k.rms_norm(F.embedding(tokens, embed), m.enorm, eps)
        x = torch.cat([e, k.rms_norm(prev_hidden.to(e.dtype), m.hnorm, eps)], dim=-1)
        h = k.gemv(x, m.eh_proj)
        index_cache = self._rows(self.mtp_index_cache, seq)[0] if a.mtp_indexer else None
        rope = (self.rope_cos, self.rope_sin)
        m.block(h, positions, rope, self._rows(self.mtp_kv_cache, seq)[0], index_cache, None, False, valid_from)
        head = m.draft_head if m.draft_head is not None else self._mtp_head(m)
        return h, self.tp.all_gather(k.gemv(h, head, m.head_norm, eps, fp32_out=True, scale=m.draft_head_scale))

    def _mtp_head(self, m: MTPLayer) -> Tensor:
        """The MTP module's own vocabulary head (``shared_head.head``), or the model's when it shares it."""
        return m.head if m.head is not None else self.lm_head

    def draft_tokens(self, logits: Tensor) -> Tensor:
        """The draft of the last row of :meth:`mtp_forward`'s ``logits``: int64 ``[1]``, a token id."""
        best = logits[-1:].argmax(-1)
        vocab = cast(MTPLayer, self.mtp[0]).draft_vocab
        return best if vocab is None else vocab[best]

    def set_draft_head(self, fp8_copy: bool, vocab: Tensor | None = None) -> None:
        """What the MTP drafts read as their head from now on, made here on the head's device (one rank's model):
        ``vocab`` (int64 token ids, on the head's device) a subset of the vocabulary, the only tokens drafts may
        propose (the head's rows of those ids, in that order); ``fp8_copy``: a block-FP8 copy of those rows (half the
        bytes a draft reads of a bf16 head). Neither: the model's head. The verify step keeps the model's head, so the
        tokens decoded are the same; a draft the copy or the subset changes is rejected like any other."""
        m = cast(MTPLayer, self.mtp[0])
        head = self._mtp_head(m).detach()
        rows = head if vocab is None else head.index_select(0, vocab)  # (a copy: contiguous)
        m.draft_head, m.draft_head_scale, m.draft_vocab = None, None, vocab
        if fp8_copy:
            m.draft_head, m.draft_head_scale = fp8.quantize_tiled(rows)
        elif vocab is not None:
            m.draft_head = rows


def finish_model(
    model: Transformer,
    sd: dict[str, Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int = 1,
) -> Transformer:
    """Load ``sd`` (the fused layout of ``model``'s args) into ``model`` (built on the meta device): weights on
    ``device`` in ``dtype`` (block-FP8 weights stay e4m3, their scales and :data:`FP32_SUFFIXES` float32), then
    the caches for ``max_sequences`` sequences of ``max_seq_len`` positions. Refuses a state dict that does not
    match the model, naming the tensors."""
    for k, t in sd.items():
        keep_fp32 = k.endswith(FP32_SUFFIXES + (fp8.SCALE_SUFFIX,))
        keep = t.dtype in fp8.FP8_DTYPES
        sd[k] = t.to(device=device, dtype=t.dtype if keep else torch.float32 if keep_fp32 else dtype).contiguous()
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing={missing} unexpected={unexpected}")
    model.eval()
    model.setup_caches(max_seq_len, device, dtype, max_sequences)
    return model
