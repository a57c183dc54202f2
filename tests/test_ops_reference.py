"""The ``tilert::*`` reference ops against naive formulations (float64 where exactness is claimed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilert.engines.tilert import ops
from tilert.engines.tilert.ops import reference

D64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rms_norm_matches_formula() -> None:
    g = _gen(0)
    x = torch.randn(5, 3, 24, generator=g, dtype=D64)
    w = torch.randn(24, generator=g, dtype=D64)
    want = w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), want, rtol=1e-12, atol=1e-12)
    xb = x.to(torch.bfloat16)
    out = ops.rms_norm(xb, w.to(torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=3e-2, atol=3e-2)


def _naive_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    w_kvb: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Expand keys/values per head (``k = W_UK c``, ``v = W_UV c``) and attend: ``[n, H, V]``."""
    p = q_nope.shape[-1]
    k_nope = torch.einsum("hpl,tl->htp", w_kvb[:, :p], c_kv)
    v = torch.einsum("hvl,tl->htv", w_kvb[:, p:], c_kv)
    s = (torch.einsum("nhp,htp->nht", q_nope, k_nope) + torch.einsum("nhr,tr->nht", q_pe, k_pe)) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("nht,htv->nhv", s.softmax(-1), v)


def _mla_problem(seed: int, n: int = 4, h: int = 3, p: int = 24, r: int = 16, v: int = 40, lat: int = 40, s: int = 29):
    g = _gen(seed)
    q_nope = torch.randn(n, h, p, generator=g, dtype=D64)
    q_pe = torch.randn(n, h, r, generator=g, dtype=D64)
    c_kv = torch.randn(s, lat, generator=g, dtype=D64)
    k_pe = torch.randn(s, r, generator=g, dtype=D64)
    w_kvb = torch.randn(h, p + v, lat, generator=g, dtype=D64) * 0.3
    q_abs = torch.einsum("nhp,hpl->nhl", q_nope, w_kvb[:, :p])
    q = torch.cat([q_abs, q_pe], -1)
    cache = torch.cat([c_kv, k_pe], -1)
    return q_nope, q_pe, c_kv, k_pe, w_kvb, q, cache


def test_absorbed_mla_equals_naive_float64() -> None:
    q_nope, q_pe, c_kv, k_pe, w_kvb, q, cache = _mla_problem(1)
    p, lat = q_nope.shape[-1], c_kv.shape[-1]
    positions = torch.tensor([0, 7, 20, 28])
    scale = 0.123
    o_lat = ops.mla_attention(q, cache, positions, scale, lat)
    o = torch.einsum("nhl,hvl->nhv", o_lat, w_kvb[:, p:])
    mask = torch.arange(cache.shape[0])[None, :] <= positions[:, None]
    want = _naive_mla(q_nope, q_pe, c_kv, k_pe, w_kvb, mask, scale)
    assert (o - want).abs().max().item() < 1e-12


def test_sparse_attention_with_all_rows_equals_dense() -> None:
    *_, q, cache = _mla_problem(2)
    lat = 40
    positions = torch.tensor([3, 11, 12, 28])
    s = cache.shape[0]
    g = _gen(3)
    idx = torch.full((4, s + 5), -1, dtype=torch.int32)  # extra -1 slots, shuffled order
    for i, pos in enumerate(positions.tolist()):
        rows = torch.randperm(pos + 1, generator=g)
        slots = torch.randperm(s + 5, generator=g)[: pos + 1]
        idx[i, slots] = rows.to(torch.int32)
    dense = ops.mla_attention(q, cache, positions, 0.2, lat)
    sparse = ops.mla_sparse_attention(q, cache, idx, 0.2, lat)
    assert (dense - sparse).abs().max().item() < 1e-12


def test_sparse_attention_subset_matches_naive() -> None:
    q_nope, q_pe, c_kv, k_pe, w_kvb, q, cache = _mla_problem(4)
    p, lat = q_nope.shape[-1], c_kv.shape[-1]
    idx = torch.tensor([[5, -1, 2, 9], [-1, -1, -1, -1], [0, 1, 2, 3], [28, 3, -1, 17]], dtype=torch.int32)
    mask = torch.zeros(4, cache.shape[0], dtype=torch.bool)
    for i in range(4):
        for j in idx[i].tolist():
            if j >= 0:
                mask[i, j] = True
    o = torch.einsum("nhl,hvl->nhv", ops.mla_sparse_attention(q, cache, idx, 0.3, lat), w_kvb[:, p:])
    want = _naive_mla(q_nope, q_pe, c_kv, k_pe, w_kvb, mask, 0.3)
    keep = [0, 2, 3]
    assert (o[keep] - want[keep]).abs().max().item() < 1e-12
    assert o[1].abs().max().item() == 0.0  # no valid index -> zeros


def test_indexer_topk_matches_naive() -> None:
    g = _gen(5)
    n, hi, di, s, topk = 5, 2, 32, 30, 6
    q = torch.randn(n, hi, di, generator=g, dtype=D64)
    w = torch.randn(n, hi, generator=g, dtype=D64).float()
    k = torch.randn(s, di, generator=g, dtype=D64)
    positions = torch.tensor([0, 3, 5, 17, 29])
    got = ops.indexer_topk(q, w, k, positions, topk)
    assert got.dtype == torch.int32 and got.shape == (n, topk)
    for i, pos in enumerate(positions.tolist()):
        score = [sum(float(w[i, h]) * max(float(q[i, h] @ k[t]), 0.0) for h in range(hi)) for t in range(pos + 1)]
        # ReLU makes exact-zero ties common: compare the selected *scores*, which is tie-insensitive.
        want = sorted(score, reverse=True)[:topk]
        have = [x for x in got[i].tolist() if x >= 0]
        assert len(set(have)) == len(have) == len(want)
        assert all(0 <= t <= pos for t in have)
        got_scores = sorted((score[t] for t in have), reverse=True)
        assert max(abs(a - b) for a, b in zip(got_scores, want, strict=True)) < 1e-9
        assert got[i].tolist().count(-1) == topk - min(topk, pos + 1)


def test_indexer_topk_pads_when_cache_smaller_than_topk() -> None:
    q = torch.randn(2, 2, 8)
    k = torch.randn(4, 8)
    got = ops.indexer_topk(q, torch.ones(2, 2), k, torch.tensor([1, 3]), 6)
    assert got.shape == (2, 6)
    assert sorted(x for x in got[0].tolist() if x >= 0) == [0, 1]
    assert sorted(x for x in got[1].tolist() if x >= 0) == [0, 1, 2, 3]


def _naive_moe(x, ids, weights, w13, w2):
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            gu = w13[e] @ x[i]
            out[i] += float(weights[i, j]) * (w2[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def test_moe_experts_both_paths_match_naive() -> None:
    g = _gen(6)
    e, d, inter, k = 6, 12, 5, 2
    w13 = torch.randn(e, 2 * inter, d, generator=g, dtype=D64)
    w2 = torch.randn(e, d, inter, generator=g, dtype=D64)
    for n in (1, 3, 9):  # n*k <= E (gather path) and > E (per-expert loop)
        x = torch.randn(n, d, generator=g, dtype=D64)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(torch.int32)
        wts = torch.rand(n, k, generator=g).float()
        got = ops.moe_experts(x, ids, wts, w13, w2)
        want = _naive_moe(x, ids, wts.double(), w13, w2)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # weights are fp32


def test_ops_registered_with_fake_kernels() -> None:
    """Schema and fake (meta) kernels are consistent, so torch.compile can trace the ops."""
    g = _gen(7)
    cache = torch.randn(10, 12, generator=g)
    q = torch.randn(2, 3, 12, generator=g)
    pos = torch.tensor([4, 9])
    cases = [
        (ops.rms_norm, (torch.randn(3, 8, generator=g), torch.randn(8, generator=g), 1e-6)),
        (ops.mla_attention, (q, cache, pos, 0.5, 8)),
        (ops.mla_sparse_attention, (q, cache, torch.tensor([[0, 3, -1], [9, 1, 2]], dtype=torch.int32), 0.5, 8)),
        (ops.indexer_topk, (torch.randn(2, 2, 12, generator=g), torch.rand(2, 2), cache, pos, 4)),
        (
            ops.moe_experts,
            (
                torch.randn(2, 6, generator=g),
                torch.tensor([[0, 2], [1, 3]], dtype=torch.int32),
                torch.rand(2, 2),
                torch.randn(4, 8, 6, generator=g),
                torch.randn(4, 6, 4, generator=g),
            ),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert torch.equal(op(*args), getattr(reference, op._name.split("::")[-1])(*args))


def test_fused_ops_registered_with_fake_kernels() -> None:
    """The fused decode-layer ops: schema (incl. declared mutations) and fake kernels are consistent."""
    g = _gen(8)
    n, d, h, p, r, v, lat, hi, di, ql = 2, 16, 2, 8, 4, 8, 8, 2, 8, 6
    x = torch.randn(n, d, generator=g)
    a = torch.randn(n, ql + lat + r + di + hi, generator=g)
    b = torch.randn(n, h * (p + r) + hi * di, generator=g)
    cos, sin = torch.randn(10, r // 2, generator=g), torch.randn(10, r // 2, generator=g)
    pos = torch.tensor([3, 7])
    cases = [
        (ops.gemv, (x, torch.randn(5, d, generator=g), torch.rand(d, generator=g), 1e-6, None, True)),
        (ops.gemv_residual, (x.clone(), torch.randn(n, 5, generator=g), torch.randn(d, 5, generator=g), None)),
        (
            ops.moe_block,
            (
                x.clone(),
                torch.rand(d, generator=g),
                1e-6,
                torch.randn(8, d, generator=g),
                torch.rand(8),
                2,
                4,
                2,
                2.5,
                True,
                1,
                torch.randn(9, 6, d, generator=g),
                torch.randn(9, d, 3, generator=g),
            ),
        ),
        (
            ops.moe_residual,
            (
                x.clone(),
                torch.rand(d, generator=g),
                1e-6,
                torch.tensor([[0, 2], [1, 3]], dtype=torch.int32),
                torch.rand(n, 2),
                torch.randn(4, 6, d, generator=g),
                torch.randn(4, d, 3, generator=g),
            ),
        ),
        (
            ops.mla_prep,
            (
                a,
                b,
                pos,
                torch.randn(h * (p + v), lat, generator=g),
                cos,
                sin,
                torch.rand(lat),
                torch.zeros(10, lat + r),
                torch.rand(di),
                torch.rand(di),
                torch.zeros(10, di),
                h,
                p,
                ql,
                hi,
                1e-6,
                0.1,
            ),
        ),
        (
            ops.mla_prep,
            (
                a[:, : ql + lat + r],
                b[:, : h * (p + r)],
                pos,
                torch.randn(h * (p + v), lat, generator=g),
                cos,
                sin,
                torch.rand(lat),
                torch.zeros(10, lat + r),
                None,
                None,
                None,
                h,
                p,
                ql,
                0,
                1e-6,
                1.0,
            ),
        ),
        (ops.mla_uv, (torch.randn(n, h, lat, generator=g), torch.randn(h * (p + v), lat, generator=g), p)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_router_shared_slots_and_moe_residual() -> None:
    """Shared experts stacked after the routed ones (weight 1) equal the separate shared MLP."""
    g = _gen(9)
    n, d, e, inter, s = 3, 12, 8, 5, 2
    h = torch.randn(n, d, generator=g, dtype=D64)
    norm = torch.rand(d, generator=g, dtype=D64) + 0.5
    ids, wts = reference.router(
        h, norm, 1e-6, torch.randn(e, d, generator=g, dtype=D64), torch.rand(e, dtype=D64) * 0.1, 2, 4, 2, 2.5, True, s
    )
    assert ids.shape == (n, 2 + s) and (ids[:, 2:] == torch.tensor([e, e + 1])).all() and (wts[:, 2:] == 1).all()
    torch.testing.assert_close(wts[:, :2].sum(-1), torch.full((n,), 2.5, dtype=torch.float32))
    w13 = torch.randn(e + s, 2 * inter, d, generator=g, dtype=D64)
    w2 = torch.randn(e + s, d, inter, generator=g, dtype=D64)
    got = h.clone()
    ops.moe_residual(got, norm, 1e-6, ids, wts, w13, w2)
    x = reference.rms_norm(h, norm, 1e-6)
    want = h + _naive_moe(x, ids[:, :2], wts[:, :2].double(), w13, w2)
    gate = torch.cat([w13[e + j, :inter] for j in range(s)])  # the shared MLP of width s*inter
    up = torch.cat([w13[e + j, inter:] for j in range(s)])
    down = torch.cat([w2[e + j] for j in range(s)], dim=1)
    want = want + (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------- CPU kernels (ops.cpu)


def _close32(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_cpu_kernels_agree_with_the_reference() -> None:
    """Every ``ops.cpu`` kernel equals the reference op up to float32 rounding: decode (n=1, over the rows up to
    its position only) and batches (n=3, causal), with and without ``row_start``, with and without an indexer,
    dense MLP and routed experts; float64 inputs go to the reference math (over the rows up to the last position
    for attention and the indexer: equal to 1e-12)."""
    from tilert.engines.tilert.ops import cpu

    g = _gen(11)
    f32 = torch.float32
    for dt in (f32, D64):

        def rnd(*shape: int, dt: torch.dtype = dt) -> torch.Tensor:
            return torch.randn(*shape, generator=g, dtype=dt)

        close = _close32 if dt == f32 else (lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12))
        d, h, p, r, v, lat, hi, di, ql, S = 16, 3, 8, 4, 8, 8, 2, 8, 6, 24
        x = rnd(3, d)
        w, nw = rnd(5, d), rnd(d).abs() + 0.5
        close(cpu.rms_norm(x, nw, 1e-6), reference.rms_norm(x, nw, 1e-6))
        close(cpu.gemv(x, w, nw, 1e-6), reference.gemv(x, w, nw, 1e-6))
        bias = rnd(5)
        close(cpu.gemv(x, w, None, 1e-6, bias, True), reference.gemv(x, w, None, 1e-6, bias, True))
        for n, pos in ((1, torch.tensor([13])), (3, torch.tensor([5, 6, 7]))):
            a = rnd(n, ql + lat + r + di + hi)
            b = rnd(n, h * (p + r) + hi * di)
            kvb = rnd(h * (p + v), lat)
            cos, sin = rnd(S, r // 2), rnd(S, r // 2)
            kvn, inw, inb = rnd(lat).abs() + 0.5, rnd(di).abs() + 0.5, rnd(di)
            for with_index in (True, False):
                c1, c2 = rnd(S, lat + r), None
                c2 = c1.clone()
                i1 = rnd(S, di) if with_index else None
                i2 = i1.clone() if i1 is not None else None
                aa = a if with_index else a[:, : ql + lat + r]
                bb = b if with_index else b[:, : h * (p + r)]
                args = (kvb, cos, sin, kvn)
                idx1 = (inw, inb, i1) if with_index else (None, None, None)
                idx2 = (inw, inb, i2) if with_index else (None, None, None)
                got = cpu.mla_prep(aa, bb, pos, *args, c1, *idx1, h, p, ql, hi, 1e-6, 0.25)
                want = reference.mla_prep(aa, bb, pos, *args, c2, *idx2, h, p, ql, hi, 1e-6, 0.25)
                for x1, x2 in zip(got, want, strict=True):
                    close(x1, x2)
                close(c1, c2)
                if i1 is not None and i2 is not None:
                    close(i1, i2)
            q = rnd(n, h, lat + r)
            cache = rnd(S, lat + r)
            for start in (None, torch.tensor([2]), torch.tensor([1, 3, 0][:n])):
                close(
                    cpu.mla_attention(q, cache, pos, 0.3, lat, start),
                    reference.mla_attention(q, cache, pos, 0.3, lat, start),
                )
            iq, iw, kc = rnd(n, hi, di), rnd(n, hi).float(), rnd(S, di)
            score = torch.einsum("nh,nht->nt", iw.to(dt), torch.einsum("nhd,td->nht", iq, kc).relu())
            for start in (None, torch.tensor([2])):
                got_i = cpu.indexer_topk(iq, iw, kc, pos, 4, start)
                want_i = reference.indexer_topk(iq, iw, kc, pos, 4, start)
                for i in range(n):  # the same top scores (ties, e.g. zeros, may pick different rows)
                    lo = 0 if start is None else int(start)
                    assert all(lo <= t <= int(pos[i]) for t in got_i[i].tolist())
                    close(score[i, got_i[i].long()].sort().values, score[i, want_i[i].long()].sort().values)
        # experts: a dense MLP (one expert) and routed experts, one token and several
        w13, w2 = rnd(6, 2 * 5, d), rnd(6, d, 5)
        for n in (1, 3):
            hh = rnd(n, d)
            h1, h2 = hh.clone(), hh.clone()
            gate, gbias = rnd(4, d), torch.rand(4, generator=g).to(dt)
            ids, wts = reference.router(hh, nw, 1e-6, gate, gbias, 2, 2, 1, 2.5, True, 2)
            got_r = cpu.moe_block(h1, nw, 1e-6, gate, gbias, 2, 2, 1, 2.5, True, 2, w13, w2)
            want_r = reference.moe_block(h2, nw, 1e-6, gate, gbias, 2, 2, 1, 2.5, True, 2, w13, w2)
            got_o, want_o = got_r[0].argsort(-1), want_r[0].argsort(-1)  # the same experts, in any slot order
            assert torch.equal(got_r[0].gather(1, got_o), want_r[0].gather(1, want_o))
            close(got_r[1].gather(1, got_o), want_r[1].gather(1, want_o).to(got_r[1].dtype))
            close(h1, h2)
            close(cpu.moe_experts(hh, ids, wts, w13, w2), reference.moe_experts(hh, ids, wts, w13, w2))
            h1, h2 = hh.clone(), hh.clone()
            ones = torch.ones(n, 1)
            zeros = torch.zeros(n, 1, dtype=torch.int32)
            cpu.moe_residual(h1, nw, 1e-6, zeros, ones, w13[:1], w2[:1])
            reference.moe_residual(h2, nw, 1e-6, zeros, ones, w13[:1], w2[:1])
            close(h1, h2)


def test_cpu_router_and_experts_give_each_row_what_it_gets_alone() -> None:
    """Row invariance of the CPU kernels' element-wise parts, at widths that are not a multiple of ATen's SIMD
    block (8 expert scores; 40 and 96 intermediate units of a dense MLP, which runs over all rows at once): ATen
    rounds a tensor's last partial block with scalar code, so the router's sigmoid over the contiguous scores of
    several rows gave a row other bits than alone (on an AVX2 host about one row in four); the SwiGLU's silu reads
    a strided half, which ATen walks row by row. Float32, 1..5 rows, each row bit for bit."""
    from tilert.engines.tilert.ops import cpu

    g = _gen(7)
    d, e = 64, 8
    for inter in (40, 96):  # the dense MLP (one expert, id 0, weight 1): one SwiGLU over every row
        w13, w2 = torch.randn(1, 2 * inter, d, generator=g) * 0.1, torch.randn(1, d, inter, generator=g) * 0.1
        x = torch.randn(5, d, generator=g)
        for n in range(1, 6):
            ones, zeros = torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.int32)
            out = cpu.moe_experts(x[:n], zeros, ones, w13, w2)
            for i in range(n):
                alone = cpu.moe_experts(x[i : i + 1], zeros[:1], ones[:1], w13, w2)
                assert torch.equal(out[i], alone[0]), (inter, n, i)
    gate, bias = torch.randn(e, d, generator=g), torch.randn(e, generator=g) * 0.1
    norm = torch.ones(d)
    for trial, (top_k, norm_topk) in enumerate([(8, False)] * 4 + [(2, True)] * 4):  # top 8 of 8: every score shows
        h = torch.randn(5, d, generator=g)
        for n in range(2, 6):
            ids, weights = cpu.router(h[:n], norm, 1e-6, gate, bias, top_k, 1, 1, 2.5, norm_topk, 1)
            for i in range(n):
                ids1, weights1 = cpu.router(h[i : i + 1], norm, 1e-6, gate, bias, top_k, 1, 1, 2.5, norm_topk, 1)
                assert torch.equal(ids[i], ids1[0]) and torch.equal(weights[i], weights1[0]), (trial, n, i)
