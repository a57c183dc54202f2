"""A minimal DeepSeek-V3.2-shaped decoder built only from the fused Triton kernels (benchmark model).

This is *not* the engine's model: it is the layout and kernel sequence the fast path needs, used to measure
what batch-1 decode can reach on one GPU and to check that the fused sequence computes the same function
as a plain PyTorch formulation of the same layer (``reference_forward``). Weights are random, created on the
GPU directly in the fused layout:

per layer: ``W_a = [q_a | kv_a | idx_wk | idx_weights_proj]`` (one GEMV on rms(h)), ``W_b = [q_b | idx_wq_b]``
(one GEMV on rms(q_a)), ``kv_b`` (W_UK / W_UV read in place), ``W_o``, router ``[E, D]`` + bias, and the
routed experts with the shared experts stacked after them (``w13 [E+S, 2I, D]``, ``w2 [E+S, D, I]``, S shared
slots of width I). A dense layer is a one-slot "MoE".

Kernels per MoE layer and token count (dense regime / sparse regime): gemv(W_a) + gemv(W_b) + mla_prep +
[indexer scores + topk] + mla split + combine + mla_uv + gemv(W_o)+residual + router gemv + select + moe_up +
moe_down+residual = 12 (+2..3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from tilert.engines.tilert.ops import triton_fused, triton_gemv, triton_mla, triton_moe


@dataclass
class Cfg:
    name: str
    hidden: int = 2048
    layers: int = 27
    heads: int = 16
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128
    experts: int = 64
    top_k: int = 6
    n_shared: int = 2  # shared experts, each of width moe_inter
    moe_inter: int = 1408
    dense_layers: int = 1
    dense_inter: int = 11264
    vocab: int = 129280
    idx_heads: int = 16
    idx_dim: int = 128
    idx_topk: int = 2048
    n_group: int = 1
    topk_group: int = 1
    route_scale: float = 1.0
    eps: float = 1e-6

    @property
    def slots(self) -> int:
        return self.top_k + self.n_shared


LITE_V32 = Cfg("lite-v32")
LAYER_V32 = Cfg("layer-v32", hidden=7168, layers=4, heads=128, q_lora=1536, experts=256, top_k=8, n_shared=1,
                moe_inter=2048, dense_layers=0, dense_inter=18432, idx_heads=64, n_group=8, topk_group=4,
                route_scale=2.5)


DTYPE = torch.bfloat16  # float16 only for CPU-interpreter smoke tests (its bf16 dot is broken)


def _w(*shape, fan_in, device):
    t = torch.empty(*shape, device=device, dtype=DTYPE)
    return t.normal_(0.0, fan_in ** -0.5)


def _norm_w(n, device):
    return (1.0 + 0.1 * torch.randn(n, device=device)).to(DTYPE)


class FusedDecoder:
    def __init__(self, cfg: Cfg, max_seq: int, device="cuda", mtp: bool = False):
        self.cfg = c = cfg
        self.max_seq = max_seq
        self.dev = dev = torch.device(device)
        D, H = c.hidden, c.heads
        self.n_a = c.q_lora + c.kv_lora + c.rope + c.idx_dim + c.idx_heads
        self.n_b = H * (c.nope + c.rope) + c.idx_heads * c.idx_dim
        self.scale = (c.nope + c.rope) ** -0.5
        self.layers = [self._make_layer(i < c.dense_layers) for i in range(c.layers)]
        self.embed = _w(c.vocab, D, fan_in=1.0, device=dev)
        self.final_norm = _norm_w(D, dev)
        self.lm_head = _w(c.vocab, D, fan_in=D, device=dev)
        n_layers_cache = c.layers + (1 if mtp else 0)
        self.kv = torch.randn(n_layers_cache, max_seq, c.kv_lora + c.rope, device=dev).to(DTYPE)
        self.ik = torch.randn(n_layers_cache, max_seq, c.idx_dim, device=dev).to(DTYPE)
        inv = 1.0 / (10000 ** (torch.arange(0, c.rope, 2, device=dev).float() / c.rope))
        ang = torch.arange(max_seq, device=dev).float()[:, None] * inv[None, :]
        self.cos, self.sin = ang.cos().contiguous(), ang.sin().contiguous()
        self.mtp = None
        if mtp:
            self.mtp = dict(layer=self._make_layer(False), enorm=_norm_w(D, dev), hnorm=_norm_w(D, dev),
                            eh=_w(D, 2 * D, fan_in=2 * D, device=dev), norm=_norm_w(D, dev))
        self._bufs: dict = {}

    def _make_layer(self, dense: bool):
        c, dev = self.cfg, self.dev
        D, H = c.hidden, c.heads
        L = dict(
            dense=dense,
            attn_norm=_norm_w(D, dev),
            W_a=_w(self.n_a, D, fan_in=D, device=dev),
            q_norm=_norm_w(c.q_lora, dev),
            kv_norm=_norm_w(c.kv_lora, dev),
            ik_w=_norm_w(c.idx_dim, dev),
            ik_b=(0.05 * torch.randn(c.idx_dim, device=dev)).to(DTYPE),
            W_b=_w(self.n_b, c.q_lora, fan_in=c.q_lora, device=dev),
            kv_b=_w(H * (c.nope + c.v), c.kv_lora, fan_in=c.kv_lora, device=dev),
            W_o=_w(D, H * c.v, fan_in=H * c.v, device=dev),
            ffn_norm=_norm_w(D, dev),
        )
        if dense:
            L["w13"] = _w(1, 2 * c.dense_inter, D, fan_in=D, device=dev)
            L["w2"] = _w(1, D, c.dense_inter, fan_in=c.dense_inter, device=dev)
        else:
            S = c.n_shared
            L["gate"] = _w(c.experts, D, fan_in=D, device=dev)
            L["bias"] = 0.01 * torch.randn(c.experts, device=dev)
            L["w13"] = _w(c.experts + S, 2 * c.moe_inter, D, fan_in=D, device=dev)
            L["w2"] = _w(c.experts + S, D, c.moe_inter, fan_in=c.moe_inter, device=dev)
        return L

    # ------------------------------------------------------------------ buffers (static per n)
    def bufs(self, n: int, key: str = "main"):
        b = self._bufs.get((key, n))
        if b is not None:
            return b
        c, dev = self.cfg, self.dev
        bf = dict(device=dev, dtype=DTYPE)
        b = dict(
            h=torch.zeros(n, c.hidden, **bf),
            a=torch.zeros(n, self.n_a, **bf),
            b=torch.zeros(n, self.n_b, **bf),
            q=torch.zeros(n, c.heads, c.kv_lora + c.rope, **bf),
            iq=torch.zeros(n, c.idx_heads, c.idx_dim, **bf),
            iw=torch.zeros(n, c.idx_heads, device=dev, dtype=torch.float32),
            olat=torch.zeros(n, c.heads, c.kv_lora, **bf),
            o=torch.zeros(n, c.heads * c.v, **bf),
            part=torch.zeros(8, n, c.experts, device=dev, dtype=torch.float32),
            ids=torch.zeros(n, c.slots, device=dev, dtype=torch.int32),
            wts=torch.zeros(n, c.slots, device=dev, dtype=torch.float32),
            act=torch.zeros(n, c.slots, c.moe_inter, **bf),
            dact=torch.zeros(n, 1, c.dense_inter, **bf),
            dids=torch.zeros(n, 1, device=dev, dtype=torch.int32),
            dwts=torch.ones(n, 1, device=dev, dtype=torch.float32),
            scores=torch.zeros(n, self.max_seq, device=dev, dtype=torch.float32),
            logits=torch.zeros(n, c.vocab, device=dev, dtype=torch.float32),
            eh_in=torch.zeros(n, 2 * c.hidden, **bf),
        )
        self._bufs[(key, n)] = b
        return b

    # ------------------------------------------------------------------ fused forward
    def layer_forward(self, L, li, pos, b, sparse: bool, parts):
        c = self.cfg
        n = pos.shape[0]
        h = b["h"]
        if "proj" in parts:
            triton_gemv.gemv(h, L["W_a"], norm_w=L["attn_norm"], eps=c.eps, out=b["a"])
            triton_gemv.gemv(b["a"][:, : c.q_lora], L["W_b"], norm_w=L["q_norm"], eps=c.eps, out=b["b"])
            triton_fused.mla_prep(
                b["a"], b["b"], pos, L["kv_b"], self.cos, self.sin, L["kv_norm"], L["ik_w"], L["ik_b"],
                b["q"], self.kv[li], self.ik[li], b["iq"], b["iw"], H=c.heads, Hi=c.idx_heads, QL=c.q_lora,
                L=c.kv_lora, R=c.rope, P=c.nope, V=c.v, DI=c.idx_dim, eps=c.eps,
                iw_scale=c.idx_heads ** -0.5 * c.idx_dim ** -0.5)
        if sparse:
            if "indexer" in parts:
                b["idx"] = triton_mla.indexer_topk(b["iq"], b["iw"], self.ik[li], pos, c.idx_topk,
                                                   scores_out=b["scores"])
            elif "idx" not in b:
                b["idx"] = torch.randint(0, self.max_seq, (n, c.idx_topk), device=self.dev, dtype=torch.int32)
            if "attn" in parts:
                triton_mla.mla_decode(b["q"], self.kv[li], None, b["idx"], self.scale, c.kv_lora, out=b["olat"])
        elif "attn" in parts:
            triton_mla.mla_decode(b["q"], self.kv[li], pos, None, self.scale, c.kv_lora, out=b["olat"])
        if "proj" in parts:
            triton_fused.mla_uv(b["olat"], L["kv_b"], P=c.nope, V=c.v, out=b["o"])
            triton_gemv.gemv(b["o"], L["W_o"], residual=h)
        if "moe" in parts:
            if L["dense"]:
                act = triton_moe.moe_up(h, b["dids"], L["w13"], norm_w=L["ffn_norm"], eps=c.eps, out=b["dact"])
                triton_moe.moe_down(act, b["dids"], b["dwts"], L["w2"], residual=h)
            else:
                sk = b["part"].shape[0]
                triton_gemv.gemv(h, L["gate"], norm_w=L["ffn_norm"], eps=c.eps, split_k=sk, out=b["part"])
                triton_moe.router_select(b["part"], L["bias"], top_k=c.top_k, n_group=c.n_group,
                                         topk_group=c.topk_group, route_scale=c.route_scale,
                                         n_shared_slots=c.n_shared, ids_out=b["ids"], wts_out=b["wts"])
                act = triton_moe.moe_up(h, b["ids"], L["w13"], norm_w=L["ffn_norm"], eps=c.eps, out=b["act"])
                triton_moe.moe_down(act, b["ids"], b["wts"], L["w2"], residual=h)

    def forward(self, tokens, pos, sparse: bool, parts=("proj", "attn", "indexer", "moe", "head")):
        """Main model over ``tokens [n]`` at ``pos [n]`` -> fp32 logits ``[n, V]`` (static buffer)."""
        c = self.cfg
        b = self.bufs(tokens.shape[0])
        if "head" in parts:
            torch.index_select(self.embed, 0, tokens, out=b["h"])
        for li, L in enumerate(self.layers):
            self.layer_forward(L, li, pos, b, sparse, parts)
        if "head" in parts:
            triton_gemv.gemv(b["h"], self.lm_head, norm_w=self.final_norm, eps=c.eps, out=b["logits"], out_f32=True)
        return b["logits"]

    def mtp_forward(self, tokens, prev_h, pos, sparse: bool):
        """One MTP module step: eh_proj([enorm(embed t) | hnorm(h)]) -> decoder layer -> norm -> lm_head."""
        c, m = self.cfg, self.mtp
        n = tokens.shape[0]
        b = self.bufs(n, "mtp")
        D = c.hidden
        e = self.embed.index_select(0, tokens)
        triton_gemv.rms_norm(e, m["enorm"], c.eps, out=b["eh_in"][:, :D])
        triton_gemv.rms_norm(prev_h, m["hnorm"], c.eps, out=b["eh_in"][:, D:])
        triton_gemv.gemv(b["eh_in"], m["eh"], out=b["h"])
        self.layer_forward(m["layer"], c.layers, pos, b, sparse, ("proj", "attn", "indexer", "moe"))
        triton_gemv.gemv(b["h"], self.lm_head, norm_w=m["norm"], eps=c.eps, out=b["logits"], out_f32=True)
        return b["h"], b["logits"]

    def draft_chain(self, token, h, pos0, k: int, sparse: bool):
        """k chained MTP drafts entirely on the device (argmax feeds the next step): drafts int64 [k]."""
        drafts = []
        tok = token
        for j in range(k):
            h, logits = self.mtp_forward(tok, h, pos0 + j, sparse)
            tok = logits.argmax(-1)
            drafts.append(tok)
        return torch.cat(drafts)

    # ------------------------------------------------------------------ bytes per token
    def bytes_per_token(self, ctx: int, sparse: bool, n_layers=None) -> dict:
        c = self.cfg
        el = 2
        per_attn = sum(self.layers[-1][k].numel() for k in ("W_a", "W_b", "kv_b", "W_o")) * el
        moe_l = self.layers[-1]
        routed_slot = (moe_l["w13"][0].numel() + moe_l["w2"][0].numel()) * el
        moe = (c.slots * routed_slot + moe_l["gate"].numel() * el) if not moe_l["dense"] else 0
        dense = (self.layers[0]["w13"].numel() + self.layers[0]["w2"].numel()) * el if c.dense_layers else 0
        n_moe = c.layers - c.dense_layers
        weights = c.layers * per_attn + n_moe * moe + c.dense_layers * dense
        head = c.hidden * el + c.vocab * c.hidden * el
        if sparse:
            kv = c.layers * (min(ctx, c.idx_topk) * (c.kv_lora + c.rope) * el + ctx * c.idx_dim * el)
        else:
            kv = c.layers * ctx * (c.kv_lora + c.rope) * el
        return dict(weights=weights, head=head, kv=kv, total=weights + head + kv)

    # ------------------------------------------------------------------ plain PyTorch reference
    @torch.no_grad()
    def reference_forward(self, tokens, pos, kv, ik):
        """Same function in unfused PyTorch (separate caches ``kv``/``ik``); fp32 logits."""
        c = self.cfg
        n = tokens.shape[0]
        H, P, R, V, Lr = c.heads, c.nope, c.rope, c.v, c.kv_lora

        def rms(x, w):
            xf = x.float()
            return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + c.eps)).to(x.dtype))

        def rope(x, cs, sn):
            h2 = x.shape[-1] // 2
            x1, x2 = x[..., :h2].float(), x[..., h2:].float()
            return torch.cat([x1 * cs - x2 * sn, x2 * cs + x1 * sn], -1)

        cs, sn = self.cos[pos], self.sin[pos]
        h = self.embed[tokens]
        for li, L in enumerate(self.layers):
            x = rms(h, L["attn_norm"])
            a = x @ L["W_a"].T
            q_lat = rms(a[:, : c.q_lora], L["q_norm"])
            bb = q_lat @ L["W_b"].T
            q = bb[:, : H * (P + R)].view(n, H, P + R)
            W = L["kv_b"].view(H, P + V, Lr)
            q_abs = torch.einsum("nhp,hpl->nhl", q[..., :P].float(), W[:, :P].float())
            q_full = torch.cat([q_abs, rope(q[..., P:], cs[:, None], sn[:, None])], -1).to(DTYPE)
            ckv = rms(a[:, c.q_lora: c.q_lora + Lr], L["kv_norm"])
            kpe = rope(a[:, c.q_lora + Lr: c.q_lora + Lr + R], cs, sn)
            kv[li].index_copy_(0, pos, torch.cat([ckv.float(), kpe], -1).to(DTYPE))
            o0 = c.q_lora + Lr + R
            kk = F.layer_norm(a[:, o0: o0 + c.idx_dim].float(), (c.idx_dim,), L["ik_w"].float(), L["ik_b"].float(),
                              c.eps).to(DTYPE)
            kk = torch.cat([rope(kk[:, :R], cs, sn), kk[:, R:].float()], -1).to(DTYPE)
            ik[li].index_copy_(0, pos, kk)
            iw = a[:, o0 + c.idx_dim:].float() * (c.idx_heads ** -0.5 * c.idx_dim ** -0.5)
            iq = bb[:, H * (P + R):].view(n, c.idx_heads, c.idx_dim)
            iq = torch.cat([rope(iq[..., :R], cs[:, None], sn[:, None]), iq[..., R:].float()], -1).to(DTYPE)
            if int(pos.max()) + 1 > c.idx_topk:
                from tilert.engines.tilert.ops import reference as ref
                idx = ref.indexer_topk(iq, iw, ik[li], pos, c.idx_topk)
                from tilert.engines.tilert.ops.reference import mla_sparse_attention
                olat = mla_sparse_attention(q_full, kv[li], idx, self.scale, Lr)
            else:
                from tilert.engines.tilert.ops.reference import mla_attention
                olat = mla_attention(q_full, kv[li], pos, self.scale, Lr)
            o = torch.einsum("nhl,hvl->nhv", olat.float(), W[:, P:].float()).to(DTYPE).reshape(n, H * V)
            h = h + (o @ L["W_o"].T)
            x = rms(h, L["ffn_norm"])
            if L["dense"]:
                I = c.dense_inter
                gu = x @ L["w13"][0].T
                out = (F.silu(gu[:, :I]) * gu[:, I:]) @ L["w2"][0].T
            else:
                logits = x.float() @ L["gate"].float().T
                scores = logits.sigmoid()
                choice = scores + L["bias"]
                E = c.experts
                if c.n_group > 1:
                    gs = choice.view(n, c.n_group, E // c.n_group).topk(2, -1)[0].sum(-1)
                    gi = gs.topk(c.topk_group, -1)[1]
                    gm = torch.zeros_like(gs).scatter_(1, gi, 1.0)
                    choice = choice.masked_fill(gm[:, :, None].expand(n, c.n_group, E // c.n_group).reshape(n, E) == 0,
                                                float("-inf"))
                ids = choice.topk(c.top_k, -1)[1]
                w = scores.gather(1, ids)
                w = w / (w.sum(-1, keepdim=True) + 1e-20) * c.route_scale
                ids = torch.cat([ids, (E + torch.arange(c.n_shared, device=self.dev)).expand(n, -1)], 1)
                w = torch.cat([w, torch.ones(n, c.n_shared, device=self.dev)], 1)
                from tilert.engines.tilert.ops.reference import moe_experts
                out = moe_experts(x, ids.to(torch.int32), w, L["w13"], L["w2"])
            h = h + out
        return (rms(h, self.final_norm) @ self.lm_head.T).float()


def small_cfg(cfg: Cfg, layers: int = 3) -> Cfg:
    """Same layer dims, fewer layers (correctness runs)."""
    return replace(cfg, name=cfg.name + f"-{layers}L", layers=layers, dense_layers=min(cfg.dense_layers, 1))
