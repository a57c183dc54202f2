"""Every custom Triton kernel of the decode fast path against its reference, on fresh random bf16 inputs.

On the H200:   python3 benchmarks/check_kernels.py            (real DeepSeek-V3.2 / lite shapes)
On a CPU box:  TRITON_INTERPRET=1 python benchmarks/check_kernels.py --small --device cpu

Prints one line per check (max abs error, relative L2 error ||out-ref||/||ref||, PASS/FAIL) and exits 1 on
any failure. Outputs are poisoned (NaN) before each kernel run so unwritten elements fail.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import torch.nn.functional as F

from tilert.engines.tilert.ops import reference as ref  # noqa: E402
from tilert.engines.tilert.ops import (  # noqa: E402
    triton_fp8,
    triton_fused,
    triton_gemv,
    triton_mla,
    triton_moe,
    triton_topk,
    workspace,
)

sys.path.insert(0, os.path.dirname(__file__))
import check_fp8  # noqa: E402  (block-FP8 checks: --only fp8,fp8engine)

RESULTS: list[tuple[str, float, float, bool]] = []
TOL = 1e-2


def report(name, out, expect, tol=TOL):
    out = out.float().cpu()
    expect = expect.float().cpu()
    finite = bool(torch.isfinite(out).all())
    err = (out - expect).abs()
    mx = float(err.max()) if err.numel() else 0.0
    rel = float(err.norm() / expect.norm().clamp_min(1e-30)) if err.numel() else 0.0
    ok = finite and rel < tol
    RESULTS.append((name, mx, rel, ok))
    print(
        f"{'PASS' if ok else 'FAIL'}  {name:<58} max_abs={mx:.3e} rel_l2={rel:.3e}{'' if finite else ' NONFINITE'}",
        flush=True,
    )


DTYPE = torch.bfloat16


def rnd(*shape, dev, scale=1.0, dtype=None):
    dtype = dtype or DTYPE
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dtype)


def poison(t):
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.fill_(-7)
    return t


def check_gemv(dev, small):
    shapes = [(1, 2256, 2048), (1, 5120, 1536), (1, 2048, 2048), (4, 2256, 2048), (1, 2304, 7168), (2, 1000, 700)]
    if small:
        shapes = [(1, 40, 96), (3, 40, 96), (1, 64, 512 + 64)]
    for nt, N, K in shapes:
        x = rnd(nt, K, dev=dev)
        w = rnd(N, K, dev=dev, scale=K**-0.5)
        g = rnd(K, dev=dev, scale=0.2) + 1
        out = poison(torch.empty(nt, N, device=dev, dtype=DTYPE))
        triton_gemv.gemv(x, w, out=out)
        report(f"gemv n={nt} N={N} K={K}", out, x.float() @ w.float().T)
        xn = ref.rms_norm(x, g, 1e-6)
        out = poison(torch.empty(nt, N, device=dev, dtype=DTYPE))
        triton_gemv.gemv(x, w, norm_w=g, eps=1e-6, out=out)
        report(f"gemv+rmsnorm n={nt} N={N} K={K}", out, xn.float() @ w.float().T)
        r0 = rnd(nt, N, dev=dev)
        r = r0.clone()
        triton_gemv.gemv(x, w, residual=r)
        report(f"gemv+residual n={nt} N={N} K={K}", r, r0.float() + (x.float() @ w.float().T))
        part = poison(torch.empty(4, nt, N, device=dev, dtype=torch.float32))
        triton_gemv.gemv(x, w, norm_w=g, split_k=4, out=part)
        report(f"gemv+rmsnorm split_k=4 fp32 n={nt} N={N} K={K}", part.sum(0), xn.float() @ w.float().T)
    # The TMA-fed GEMV (triton_gemv.TMA_CFG): against the reference with RMSNorm and residual, each token as if
    # alone (bit for bit), and against the register-fed kernel of the same tile; rows / columns past the weight
    # zero-filled (N and K not multiples of the tile).
    tma = [
        (3, 2256, 2048, (8, 256, 4, 4)),
        (1, 5120, 1536, (16, 256, 3, 8)),
        (2, 1000, 704, (8, 512, 4, 4)),
        (1, 2304, 2048, (4, 1024, 6, 4)),  # more stages than K tiles
    ]
    if small:
        tma = [(3, 40, 96, (8, 32, 3, 4)), (2, 36, 112, (16, 64, 2, 4)), (2, 36, 112, (8, 64, 5, 4))]
    for nt, N, K, cfg4 in tma:
        x = rnd(nt, K, dev=dev)
        w = rnd(N, K, dev=dev, scale=K**-0.5)
        g = rnd(K, dev=dev, scale=0.2) + 1
        xn = ref.rms_norm(x, g, 1e-6)
        tag = f"n={nt} N={N} K={K} tma={cfg4}"
        got = triton_gemv.gemv(x, w, norm_w=g, eps=1e-6, tma=cfg4)
        report(f"gemv+rmsnorm {tag}", got, xn.float() @ w.float().T)
        alone = torch.cat([triton_gemv.gemv(x[r : r + 1], w, norm_w=g, eps=1e-6, tma=cfg4) for r in range(nt)])
        report(f"gemv tma batch invariance {tag}", got, alone, tol=1e-30)
        reg = triton_gemv.gemv(x, w, norm_w=g, eps=1e-6, cfg=(cfg4[0], cfg4[1], cfg4[3], 1))
        report(f"gemv tma == register-fed (fp32 reassociation) {tag}", got, reg, tol=1e-2)
        r0 = rnd(nt, N, dev=dev)
        r = r0.clone()
        triton_gemv.gemv(x, w, residual=r, tma=cfg4)
        report(f"gemv+residual {tag}", r, r0.float() + (x.float() @ w.float().T))
    for shape in ([1, 2048], [4, 7168], [3, 512]) if not small else ([1, 96], [3, 40]):
        x = rnd(*shape, dev=dev)
        g = rnd(shape[-1], dev=dev, scale=0.2) + 1
        out = poison(torch.empty_like(x))
        triton_gemv.rms_norm(x, g, 1e-6, out=out)
        report(f"rms_norm {shape}", out, ref.rms_norm(x, g, 1e-6), tol=5e-3)


def decode_poisoned(*args, **kw):
    """``triton_mla.mla_decode`` over split-partial workspaces filled with NaN (a first call makes the ones it
    uses): a merge that reads a partial no split wrote shows as NaN."""
    triton_mla.mla_decode(*args, **kw)
    for key, t in workspace.BUFFERS.items():
        if key[0] == "mla_o":
            t.fill_(float("nan"))
    return triton_mla.mla_decode(*args, **kw)


def check_mla(dev, small):
    L, R = (512, 64) if not small else (64, 16)
    cases = (
        [(1, 16, 4096), (4, 16, 4096), (1, 128, 3000), (2, 128, 40000)] if not small else [(1, 16, 300), (3, 20, 200)]
    )
    for n, H, S in cases:
        kv = rnd(S, L + R, dev=dev)
        q = rnd(n, H, L + R, dev=dev)
        scale = (128 + 64) ** -0.5
        p0 = int(torch.randint(0, S - n, (1,)))
        for pos0 in (p0, 0, S - n):
            pos = torch.arange(pos0, pos0 + n, device=dev, dtype=torch.int64)
            out = poison(torch.empty(n, H, L, device=dev, dtype=DTYPE))
            decode_poisoned(q, kv, pos, None, scale, L, out=out)
            report(f"mla dense n={n} H={H} S={S} pos0={pos0}", out, ref.mla_attention(q, kv, pos, scale, L))
        start = torch.tensor([p0 // 2], device=dev)  # the MTP layer's first valid row
        pos = torch.arange(p0, p0 + n, device=dev, dtype=torch.int64)
        out = poison(torch.empty(n, H, L, device=dev, dtype=DTYPE))
        triton_mla.mla_decode(q, kv, pos, None, scale, L, out=out, row_start=start)
        report(f"mla dense rows {p0 // 2}..pos n={n} H={H} S={S}", out, ref.mla_attention(q, kv, pos, scale, L, start))
        # several sequences in one cache (rows b*S/4 ..): each query over its own rows start[i]..pos[i]
        starts = torch.tensor([(i % 4) * (S // 4) for i in range(n)], device=dev)
        pos = starts + torch.randint(0, S // 4, (n,), device=dev)
        out = poison(torch.empty(n, H, L, device=dev, dtype=DTYPE))
        triton_mla.mla_decode(q, kv, pos, None, scale, L, out=out, row_start=starts)
        report(
            f"mla dense per-query rows start[i]..pos[i] n={n} H={H} S={S}",
            out,
            ref.mla_attention(q, kv, pos, scale, L, starts),
        )
        topk = 2048 if not small else 64
        idx = torch.stack([torch.randperm(S, device=dev)[:topk] for _ in range(n)]).to(torch.int32)
        idx[:, -topk // 3 :] = -1
        out = poison(torch.empty(n, H, L, device=dev, dtype=DTYPE))
        triton_mla.mla_decode(q, kv, None, idx, scale, L, out=out)
        report(f"mla sparse n={n} H={H} S={S} topk={topk}", out, ref.mla_sparse_attention(q, kv, idx, scale, L))
    for slice_l in (0, 16 if small else 32):  # the merge by blocks of W_UV's rows, and by slices of the latent
        check_mla_uv(dev, small, L, R, slice_l)


def check_mla_uv(dev, small, L, R, slice_l):
    """The dense merge + W_UV (``slice_l``: triton_mla.UV_SLICE_L, 0 the merge by blocks of W_UV's rows) against the
    reference, each query alone against the batch bit for bit; block-FP8 W_UV too."""
    saved_slice = dict(triton_mla.UV_SLICE_L)
    triton_mla.UV_SLICE_L.update(dense=slice_l, sparse=slice_l)
    sl = f" (latent slices of {slice_l})" if slice_l else ""
    try:
        _check_mla_uv(dev, small, L, R, sl)
    finally:
        triton_mla.UV_SLICE_L.update(saved_slice)


def _check_mla_uv(dev, small, L, R, sl):
    # merge + W_UV at split counts that are not powers of two (UV_TAIL: a power-of-two tile, then the rest; 65: of
    # 64 + 2 rows, 32 of them empty splits) and at 16 cache rows a split (DENSE_CAP_ROWS below 32: 16-row tiles)
    H, S, P_ = (16, 1040, 128) if not small else (4, 300, 16)
    kv = rnd(S, L + R, dev=dev)
    q = rnd(2, H, L + R, dev=dev)
    kvb = rnd(H * 2 * P_, L, dev=dev, scale=L**-0.5)
    uv = (kvb, P_, P_, None)
    scale = (128 + 64) ** -0.5
    pos = torch.tensor([S - 16, S // 3], device=dev)
    want = ref.mla_uv(ref.mla_attention(q, kv, pos, scale, L).to(DTYPE), kvb, P_)
    for ns in (128, 100, 65, 33, 17, 5, None):  # 128, 100: the loop over live splits (a long cache's graph)
        got = decode_poisoned(q, kv, pos, None, scale, L, num_splits=ns, uv=uv)
        report(f"mla dense + W_UV{sl} splits={ns or 'default'} H={H} S={S}", got, want)
        alone = [
            decode_poisoned(q[j : j + 1], kv, pos[j : j + 1], None, scale, L, num_splits=ns, uv=uv)
            for j in range(q.shape[0])
        ]
        same = all(torch.equal(got[j : j + 1], a) for j, a in enumerate(alone))
        RESULTS.append((f"mla dense + W_UV{sl} splits={ns} each query alone == batched", 0.0, 0.0, same))
        print(
            f"{'PASS' if same else 'FAIL'}  mla dense + W_UV{sl} splits={ns or 'default'}: each query alone == batched "
            "(bit for bit)",
            flush=True,
        )
    # a long cache's graph at short contexts, the merge by W_UV's rows: each query's live splits read in one request
    # (UV_LIVE_ONE_READ) or, past a smaller bound, one query of the batch in one request and the other by the loop;
    # the last bound reads the longer query's splits past it in the second tile (UV_TAIL: 33 as 32 + 4, 9 as 8 + 2)
    saved_live = triton_mla.UV_LIVE_ONE_READ
    try:
        for live_read in ((0, 64, 16, 32) if not small else (0, 64, 4, 8)) if not sl else ():
            triton_mla.UV_LIVE_ONE_READ = live_read
            got = decode_poisoned(q, kv, pos, None, scale, L, num_splits=128, uv=uv)
            report(f"mla dense + W_UV{sl} splits=128 live splits read at once up to {live_read}", got, want)
            alone = [
                decode_poisoned(q[j : j + 1], kv, pos[j : j + 1], None, scale, L, num_splits=128, uv=uv)[0]
                for j in range(2)
            ]
            bitwise(
                f"batch invariance: mla dense + W_UV{sl} splits=128 live splits read at once up to {live_read}",
                got,
                alone,
            )
    finally:
        triton_mla.UV_LIVE_ONE_READ = saved_live
    # a bound on the rows a dense query reads (a DSA model's dense steps, below its top-k): fewer splits, each merge
    # reading only its query's live splits, counted from its rows (every other partial poisoned: a read shows)
    # (splits sized by the bound or by the cache: triton_mla.SPLITS_BY_MAX_ROWS, both checked)
    short = torch.tensor([40, 7], device=dev)
    by_rows_default = triton_mla.SPLITS_BY_MAX_ROWS
    try:
        for rs, bound, by_rows in itertools.product(
            (None, torch.tensor([3, 0], device=dev)), (64, 2048 if not small else 256), (False, True)
        ):
            triton_mla.SPLITS_BY_MAX_ROWS = by_rows
            want_s = ref.mla_uv(ref.mla_attention(q, kv, short, scale, L, rs).to(DTYPE), kvb, P_)
            tag = (
                f"max_rows={bound} row_start={'per query' if rs is not None else 'none'} "
                f"splits by {'the bound' if by_rows else 'the cache'} H={H} S={S}"
            )
            got = decode_poisoned(q, kv, short, None, scale, L, uv=uv, row_start=rs, max_rows=bound)
            report(f"mla dense + W_UV{sl} {tag}", got, want_s)
            alone = [
                decode_poisoned(
                    q[j : j + 1],
                    kv,
                    short[j : j + 1],
                    None,
                    scale,
                    L,
                    uv=uv,
                    row_start=rs[j : j + 1] if rs is not None else None,
                    max_rows=bound,
                )
                for j in range(q.shape[0])
            ]
            bitwise(f"batch invariance: mla dense + W_UV{sl} {tag}", got, [a[0] for a in alone])
    finally:
        triton_mla.SPLITS_BY_MAX_ROWS = by_rows_default
    # block-FP8 W_UV (e4m3 rows, a scale per 128 x 128 block; 16 x 16 on the small shapes)
    g = 16 if small else 128
    kv8 = kvb.float().to(torch.float8_e4m3fn)
    kvs = torch.rand(kvb.shape[0] // g, L // g, device=dev) + 0.5
    deq = (kv8.float() * kvs.repeat_interleave(g, 0).repeat_interleave(g, 1)).to(DTYPE)
    want8 = ref.mla_uv(ref.mla_attention(q, kv, pos, scale, L).to(DTYPE), deq, P_)
    for ns in (128, 33, None):
        got = decode_poisoned(q, kv, pos, None, scale, L, num_splits=ns, uv=(kv8, P_, P_, kvs))
        report(f"mla dense + FP8 W_UV{sl} splits={ns or 'default'} H={H} S={S}", got, want8)
    # sparse (the DSA regime): a merge reads every split (each written, rows or not), the batch against each alone
    topk = 64 if small else 1024
    idx = torch.stack([torch.randperm(S, device=dev)[:topk] for _ in range(q.shape[0])]).to(torch.int32)
    idx[:, -topk // 3 :] = -1
    want_sp = ref.mla_uv(ref.mla_sparse_attention(q, kv, idx, scale, L).to(DTYPE), kvb, P_)
    got = decode_poisoned(q, kv, None, idx, scale, L, uv=uv)
    report(f"mla sparse + W_UV{sl} topk={topk} H={H} S={S}", got, want_sp)
    alone = [decode_poisoned(q[j : j + 1], kv, None, idx[j : j + 1], scale, L, uv=uv)[0] for j in range(q.shape[0])]
    bitwise(f"batch invariance: mla sparse + W_UV{sl} topk={topk}", got, alone)
    saved = triton_mla.DENSE_CAP_ROWS["one"]
    try:
        triton_mla.DENSE_CAP_ROWS["one"] = 16
        report(
            f"mla dense + W_UV{sl} 16 rows a split H={H} S={S}",
            triton_mla.mla_decode(q, kv, pos, None, scale, L, uv=uv),
            want,
        )
        if not sl:  # without W_UV: one merge only
            report(
                f"mla dense 16 rows a split H={H} S={S}",
                triton_mla.mla_decode(q, kv, pos, None, scale, L),
                ref.mla_attention(q, kv, pos, scale, L),
            )
    finally:
        triton_mla.DENSE_CAP_ROWS["one"] = saved


def check_indexer(dev, small):
    cases = [(1, 16, 128, 40000, 2048), (4, 64, 128, 9000, 2048), (1, 16, 128, 1500, 2048)]
    if small:
        cases = [(1, 4, 32, 300, 64), (2, 5, 32, 50, 64)]
    for n, Hi, Di, S, topk in cases:
        q = rnd(n, Hi, Di, dev=dev)
        k = rnd(S, Di, dev=dev)
        w = torch.randn(n, Hi, device=dev) * (Hi**-0.5) * (Di**-0.5)
        pos = torch.arange(S - n - 5, S - 5, device=dev) if S > topk else torch.arange(S // 2, S // 2 + n, device=dev)
        sc = triton_mla.indexer_scores(q, w, k, pos)
        # reference scores
        logits = torch.einsum("nhd,td->nht", q.float(), k.float()).relu()
        rs = torch.einsum("nh,nht->nt", w, logits)
        valid = torch.arange(S, device=dev)[None, :] <= pos[:, None]
        rs = rs.masked_fill(~valid, float("-inf"))
        fin = torch.isfinite(rs)
        same_mask = bool((torch.isfinite(sc) == fin).all())
        report(
            f"indexer scores n={n} Hi={Hi} S={S}{'' if same_mask else ' MASK-MISMATCH'}",
            torch.where(fin, sc, 0.0) if same_mask else sc,
            torch.where(fin, rs, 0.0),
        )
        got = triton_mla.indexer_topk(q, w, k, pos, topk)
        alone = triton_topk.topk(sc, pos, topk)
        same = torch.equal(got, alone)
        RESULTS.append((f"indexer_topk fused == topk on its scores n={n} S={S}", 0.0, 0.0, same))
        print(
            f"{'PASS' if same else 'FAIL'}  indexer top-k (pass 1 fused into the scores) == radix top-k on the same "
            f"scores, n={n} S={S}",
            flush=True,
        )
        want = ref.indexer_topk(q, w, k, pos, topk)
        worst = 1.0
        for i in range(n):
            a = set(got[i].tolist()) - {-1}
            b = set(want[i].tolist()) - {-1}
            worst = min(worst, len(a & b) / max(1, len(b)))
            # selected-score mass must match the true top-k mass
        mass_got = torch.where(got >= 0, rs.gather(1, got.clamp(min=0).long()), 0.0).sum()
        mass_ref = torch.where(want >= 0, rs.gather(1, want.clamp(min=0).long()), 0.0).sum()
        ok = worst >= 0.98 and abs(float(mass_got - mass_ref)) <= 1e-3 * abs(float(mass_ref)) + 1e-6
        ok = ok and int((got >= 0).sum()) == int((want >= 0).sum())
        RESULTS.append((f"indexer topk overlap n={n} S={S}", 1 - worst, 0.0, ok))
        print(
            f"{'PASS' if ok else 'FAIL'}  indexer topk n={n} Hi={Hi} S={S} topk={topk}: overlap={worst:.4f} "
            f"mass {float(mass_got):.4f} vs {float(mass_ref):.4f}",
            flush=True,
        )
        # several sequences in one cache: query i selects among its own rows start[i]..pos[i] only
        seg = S // 2
        starts = torch.tensor([(i % 2) * seg for i in range(n)], device=dev)
        spos = starts + torch.tensor([seg - 1 - i for i in range(n)], device=dev)
        got = triton_mla.indexer_topk(q, w, k, spos, topk, row_start=starts)
        want = ref.indexer_topk(q, w, k, spos, topk, starts)
        rs2 = torch.einsum("nh,nht->nt", w, logits)
        inside = all(set(got[i].tolist()) - {-1} <= set(range(int(starts[i]), int(spos[i]) + 1)) for i in range(n))
        mass_got = torch.where(got >= 0, rs2.gather(1, got.clamp(min=0).long()), 0.0).sum()
        mass_ref = torch.where(want >= 0, rs2.gather(1, want.clamp(min=0).long()), 0.0).sum()
        ok = inside and abs(float(mass_got - mass_ref)) <= 1e-3 * abs(float(mass_ref)) + 1e-6
        ok = ok and int((got >= 0).sum()) == int((want >= 0).sum())
        RESULTS.append((f"indexer topk per-query rows n={n} S={S}", 0.0, 0.0, ok))
        print(
            f"{'PASS' if ok else 'FAIL'}  indexer topk over per-query rows start[i]..pos[i] n={n} S={S}: "
            f"inside={inside} mass {float(mass_got):.4f} vs {float(mass_ref):.4f}",
            flush=True,
        )


def verdict(key, ok, text):
    """A check without an error figure: recorded under ``key``, printed as ``text``."""
    RESULTS.append((key, 0.0, 0.0, ok))
    print(f"{'PASS' if ok else 'FAIL'}  {text}", flush=True)


def bitwise(name, batched, alone):
    verdict(
        name, all(torch.equal(a, b) for a, b in zip(batched, alone, strict=False)) and len(batched) == len(alone), name
    )


def check_batch_invariance(dev, small):
    """Each decode kernel computes a token of a verify batch (n = 2..4) bit for bit as it computes that
    token alone (n = 1): what makes MTP speculative greedy reproduce plain greedy exactly."""
    N, K = (2256, 2048) if not small else (40, 96)
    w = rnd(N, K, dev=dev, scale=K**-0.5)
    g = rnd(K, dev=dev, scale=0.2) + 1
    for n in (2, 3, 4):
        x = rnd(n, K, dev=dev)
        bitwise(
            f"batch invariance: gemv+rmsnorm n={n}",
            triton_gemv.gemv(x, w, norm_w=g),
            [triton_gemv.gemv(x[i : i + 1], w, norm_w=g)[0] for i in range(n)],
        )
        bitwise(
            f"batch invariance: gemv split_k fp32 n={n}",
            triton_gemv.gemv(x, w, split_k=8).transpose(0, 1),
            [triton_gemv.gemv(x[i : i + 1], w, split_k=8)[:, 0] for i in range(n)],
        )
        r = rnd(n, N, dev=dev)
        rb = r.clone()
        triton_gemv.gemv(x, w, residual=rb)
        alone = []
        for i in range(n):
            ri = r[i : i + 1].clone()
            triton_gemv.gemv(x[i : i + 1], w, residual=ri)
            alone.append(ri[0])
        bitwise(f"batch invariance: gemv+residual n={n}", rb, alone)
    L, R, H, S = (512, 64, 16, 4096) if not small else (64, 16, 4, 300)
    kv = rnd(S, L + R, dev=dev)
    q = rnd(4, H, L + R, dev=dev)
    pos = torch.arange(S - 10, S - 6, device=dev)
    bitwise(
        "batch invariance: mla dense n=4",
        triton_mla.mla_decode(q, kv, pos, None, 0.07, L),
        [triton_mla.mla_decode(q[i : i + 1], kv, pos[i : i + 1], None, 0.07, L)[0] for i in range(4)],
    )
    kvb = rnd(H * (128 if not small else 32), L, dev=dev, scale=L**-0.5)
    P_ = 64 if not small else 16
    uv = (kvb, P_, kvb.shape[0] // H - P_, None)
    bitwise(
        "batch invariance: mla dense + W_UV n=4",
        triton_mla.mla_decode(q, kv, pos, None, 0.07, L, uv=uv),
        [triton_mla.mla_decode(q[i : i + 1], kv, pos[i : i + 1], None, 0.07, L, uv=uv)[0] for i in range(4)],
    )
    idx = torch.stack([torch.randperm(S, device=dev)[: S // 2] for _ in range(4)]).to(torch.int32)
    bitwise(
        "batch invariance: mla sparse n=4",
        triton_mla.mla_decode(q, kv, None, idx, 0.07, L),
        [triton_mla.mla_decode(q[i : i + 1], kv, None, idx[i : i + 1], 0.07, L)[0] for i in range(4)],
    )
    Hi, Di = (16, 128) if not small else (4, 32)
    qi = rnd(4, Hi, Di, dev=dev)
    wi = torch.randn(4, Hi, device=dev)
    k = rnd(S, Di, dev=dev)
    topk = S // 2
    bitwise(
        "batch invariance: indexer top-k n=4",
        triton_mla.indexer_topk(qi, wi, k, pos, topk),
        [triton_mla.indexer_topk(qi[i : i + 1], wi[i : i + 1], k, pos[i : i + 1], topk)[0] for i in range(4)],
    )
    # rows of different sequences (one cache, per-query first rows): each as alone
    starts = torch.tensor([0, S // 4, S // 2, 3 * S // 4], device=dev)
    spos = starts + torch.tensor([S // 4 - 1, 10, S // 8, S // 5], device=dev)
    bitwise(
        "batch invariance: mla dense, 4 sequences",
        triton_mla.mla_decode(q, kv, spos, None, 0.07, L, row_start=starts),
        [
            triton_mla.mla_decode(q[i : i + 1], kv, spos[i : i + 1], None, 0.07, L, row_start=starts[i : i + 1])[0]
            for i in range(4)
        ],
    )
    bitwise(
        "batch invariance: indexer top-k, 4 sequences",
        triton_mla.indexer_topk(qi, wi, k, spos, S // 8, row_start=starts),
        [
            triton_mla.indexer_topk(
                qi[i : i + 1], wi[i : i + 1], k, spos[i : i + 1], S // 8, row_start=starts[i : i + 1]
            )[0]
            for i in range(4)
        ],
    )


def topk_exact(sc, pos, k, got):
    """``got`` is the exact top-k of each row (all selected >= the k-th largest, none missing, no duplicates),
    in the documented order (keys > T by index, then the lowest-index ties), -1 padded for short rows."""
    for i in range(sc.shape[0]):
        tot = min(int(pos[i]) + 1, sc.shape[1])
        g = got[i].tolist()
        if tot <= k:
            if g != list(range(tot)) + [-1] * (k - tot):
                return False
            continue
        v = sc[i, :tot].double().cpu()
        thr = torch.topk(v, k).values[-1]
        gt = (v > thr).nonzero().flatten().tolist()
        eq = (v == thr).nonzero().flatten().tolist()
        if g != gt + eq[: k - len(gt)]:
            return False
    return True


def check_topk(dev, small):
    """The radix top-k alone on arbitrary fp32 scores: random, heavy ties, negatives and -inf, short rows,
    rows shorter than k, n = 1..16 queries; twice in a row (the histograms must be left zeroed)."""
    cases = [
        (1, 32784, 2048, "randn"),
        (4, 9000, 2048, "randn"),
        (16, 32784, 2048, "randn"),
        (3, 40000, 2048, "ties"),
        (2, 20000, 2048, "neg-inf"),
        (2, 1500, 2048, "randn"),
    ]
    if small:
        cases = [(1, 3000, 256, "randn"), (3, 2000, 300, "ties"), (2, 2000, 300, "neg-inf"), (2, 100, 256, "randn")]
    for n, S, k, kind in cases:
        if kind == "ties":
            sc = torch.randint(0, 7, (n, S), device=dev).float()
        else:
            sc = torch.randn(n, S, device=dev)
        if kind == "neg-inf":
            sc = -sc.abs() * 1e-3
            sc[:, 5:50] = float("-inf")
        pos = torch.randint(max(0, S - 3 * k), S, (n,), device=dev)
        pos[0] = S - 1
        ok = True
        for _rep in range(2):
            got = triton_topk.topk(sc, pos, k)
            ok = ok and topk_exact(sc, pos, k, got)
        ws = triton_topk.workspace(n, S, k, sc.device)
        zeroed = not (ws.fine.any() or ws.coarse.any())
        RESULTS.append((f"radix topk n={n} S={S} k={k} {kind}", 0.0, 0.0, ok and zeroed))
        print(
            f"{'PASS' if ok and zeroed else 'FAIL'}  radix top-k n={n} S={S} k={k} {kind}: exact set, deterministic "
            f"order, twice{'' if zeroed else '; histograms NOT left zeroed'}",
            flush=True,
        )


def check_shaping(dev, small=False, vocab=129280) -> bool:
    """The shaped stream's rules kernel (``ops.triton_shaping``) bit for bit against ``Shaping.apply_`` on the CPU,
    on random logits, bias, masks, counts and bitmask."""
    from tilert.engines.shaping import Shaping
    from tilert.engines.tilert.ops import triton_shaping

    vocab = 4099 if small else vocab
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3000,), generator=gen).tolist()
    rules = Shaping(
        vocab,
        bias={t: float(b) for t, b in zip(ids[:500], torch.randn(500, generator=gen).tolist(), strict=True)},
        banned_ids=ids[500:600],
        stop_ids=ids[600:610],
        min_tokens=5,
        repetition_penalty=1.3,
        frequency_penalty=0.7,
        presence_penalty=0.3,
        prompt_ids=ids[1000:2000],
        output_ids=ids[2000:2003],
    )
    bitmask = torch.randint(-(2**31), 2**31 - 1, ((vocab + 31) // 32,), generator=gen, dtype=torch.int32)
    logits = torch.randn(vocab, generator=gen) * 8
    want = logits.clone()
    rules.apply_(want, every_rule=True, bitmask=bitmask)
    got = logits.to(dev)
    triton_shaping.shape_logits_(got, rules.clone_to(dev), bitmask.to(dev))
    bitwise(
        f"logits rules kernel (penalties, bias, min_tokens, bitmask) V={vocab} == CPU reference", [got.cpu()], [want]
    )
    return RESULTS[-1][3]


def torch_route(logits, bias, top_k, n_group, topk_group, scale):
    scores = logits.sigmoid()
    choice = scores + bias
    E = logits.shape[-1]
    if n_group > 1:
        gs = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(-1)
        gidx = gs.topk(topk_group, dim=-1)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
        smask = gmask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
        choice = choice.masked_fill(smask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * scale
    return ids, w


def _check_moe_16bit(x, g, ids, wts, w13, w2, r0, want_n, small, tag):
    """The expert kernels (``triton_fp8``'s, given no scales) on these 16-bit experts, as the engine runs them: the
    RMSNorm fused, added into a residual, against the reference; the shared slots started without the router's
    wait equal to read from ids; ``moe_up`` split over D; ``moe_down`` split over slots or not; each twice bit for
    bit (the split counters left zeroed) and each token as if alone."""
    n, kk = ids.shape
    want = r0.float() + want_n.float()
    r = r0.clone()
    act = triton_fp8.moe_up_fp8(x, ids, w13, None, norm_w=g)
    triton_fp8.moe_down_fp8(act, ids, wts, w2, None, residual=r)
    report(f"moe norm+residual {tag}", r, want)
    static = triton_fp8.moe_up_fp8(x, ids, w13, None, norm_w=g, static=(kk - 1, int(ids[0, -1])))
    report(f"moe_up, the last slot static == as read from ids {tag}", static, act, tol=1e-30)
    ups = ((8, 512, 4, 1), (16, 256, 4, 2), (4, 1024, 4, 1)) if not small else ((8, 32, 4, 1), (4, 16, 4, 3))
    downs = (
        ((16, 1, 512, 4, True), (4, 4, 512, 8, False), (32, 1, 256, 8, True))
        if not small
        else ((4, 1, 16, 4, True), (8, 2, 32, 4, False))
    )
    for ucfg, dcfg in itertools.zip_longest(ups, downs, fillvalue=None):
        a1 = act if ucfg is None else triton_fp8.moe_up_fp8(x, ids, w13, None, norm_w=g, cfg=ucfg)
        ys = []
        for _ in range(2):
            y = r0.clone()
            triton_fp8.moe_down_fp8(a1, ids, wts, w2, None, residual=y, cfg=dcfg)
            ys.append(y)
        cfgs = f"up={ucfg} down={dcfg} {tag}"
        report(f"moe {cfgs}", ys[0], want)
        report(f"moe twice: bit-identical {cfgs}", ys[1], ys[0], tol=1e-30)
        if n > 1:
            alone = []
            for i in range(n):
                ai = triton_fp8.moe_up_fp8(x[i : i + 1], ids[i : i + 1], w13, None, norm_w=g, cfg=ucfg)
                yi = r0[i : i + 1].clone()
                triton_fp8.moe_down_fp8(ai, ids[i : i + 1], wts[i : i + 1], w2, None, residual=yi, cfg=dcfg)
                alone.append(yi)
            report(f"moe batch invariance {cfgs}", ys[0], torch.cat(alone), tol=1e-30)


def check_moe(dev, small):
    cases = [
        (1, 64, 6, 2, 2048, 1408),
        (4, 64, 6, 2, 2048, 1408),
        (1, 24, 8, 1, 7168, 2048),
        (1, 1, 1, 0, 2048, 11264),
        (2, 24, 8, 1, 7168, 1024),
    ]  # the last: a TP2 rank's half-width V3.2 experts (moe "narrow" configs)
    if small:
        cases = [(1, 8, 2, 1, 64, 48), (3, 8, 2, 1, 64, 48)]
    for n, E, k, ns, D, inter in cases:
        w13 = rnd(E + ns, 2 * inter, D, dev=dev, scale=D**-0.5)
        w2 = rnd(E + ns, D, inter, dev=dev, scale=inter**-0.5)
        x = rnd(n, D, dev=dev)
        g = rnd(D, dev=dev, scale=0.2) + 1
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(n)])
        ids = torch.cat([ids, (E + torch.arange(ns, device=dev)).expand(n, ns)], 1).to(torch.int32)
        wts = torch.rand(n, k + ns, device=dev)
        want = ref.moe_experts(x, ids, wts, w13, w2)
        got = triton_fp8.moe_down_fp8(triton_fp8.moe_up_fp8(x, ids, w13, None), ids, wts, w2, None)
        report(f"moe_experts n={n} E={E}+{ns} k={k} D={D} I={inter}", got, want)
        r0 = rnd(n, D, dev=dev)
        want_n = ref.moe_experts(ref.rms_norm(x, g, 1e-6), ids, wts, w13, w2)
        _check_moe_16bit(x, g, ids, wts, w13, w2, r0, want_n, small, f"n={n} E={E}+{ns} D={D} I={inter}")
        # moe_up fed by the TMA (triton_fp8.BF16_UP_TMA_CFG): against the reference, the register-fed kernel of the
        # same tile, and each token as if alone (bit for bit)
        for tcfg in (
            ((8, 512, 4, 4), (16, 256, 6, 8), (8, 1024, 6, 4))
            if not small
            else ((8, 32, 3, 4), (16, 16, 2, 4), (8, 32, 4, 4))
        ):
            if inter % tcfg[0] or not triton_gemv.tma_ready(w13):
                continue
            tag = f"n={n} E={E} D={D} I={inter} tma={tcfg}"
            t1 = triton_fp8.moe_up_fp8(x, ids, w13, None, norm_w=g, tma=tcfg)
            report(f"moe_up tma {tag}", triton_fp8.moe_down_fp8(t1, ids, wts, w2, None), want_n)
            reg = triton_fp8.moe_up_fp8(x, ids, w13, None, norm_w=g, cfg=(tcfg[0], tcfg[1], tcfg[3], 1))
            report(f"moe_up tma == register-fed (fp32 reassociation) {tag}", t1, reg, tol=1e-2)
            if n > 1:
                alone = torch.cat(
                    [
                        triton_fp8.moe_up_fp8(x[r : r + 1], ids[r : r + 1], w13, None, norm_w=g, tma=tcfg)
                        for r in range(n)
                    ]
                )
                report(f"moe_up tma batch invariance {tag}", t1, alone, tol=1e-30)
    # router
    routes = [(1, 64, 6, 1, 1), (4, 256, 8, 8, 4), (1, 256, 8, 8, 4), (2, 8, 2, 2, 1), (1, 64, 1, 1, 1)]
    for n, E, k, G, TG in routes if not small else [(2, 16, 4, 4, 2), (2, 8, 2, 2, 1)]:
        logits = torch.randn(n, E, device=dev) * 2
        bias = torch.randn(E, device=dev) * 0.1
        part = torch.stack([logits * 0.25] * 4)
        ids, wts = triton_moe.router_select(
            part, bias, top_k=k, n_group=G, topk_group=TG, route_scale=2.5, norm_topk=True, n_shared_slots=2
        )
        rid, rw = torch_route(logits, bias, k, G, TG, 2.5)
        o1 = ids[:, :k].long().sort(-1)
        o2 = rid.sort(-1)
        same = bool((o1.values == o2.values).all())
        wsorted = wts[:, :k].gather(1, o1.indices)
        rwsorted = rw.gather(1, o2.indices)
        shared_ok = bool((ids[:, k:] == torch.tensor([E, E + 1], device=dev, dtype=torch.int32)).all()) and bool(
            (wts[:, k:] == 1).all()
        )
        err = float((wsorted - rwsorted).abs().max())
        ok = same and shared_ok and err < 1e-4
        RESULTS.append((f"router E={E}", err, 0.0, ok))
        print(
            f"{'PASS' if ok else 'FAIL'}  router_select n={n} E={E} k={k} groups={G}/{TG}: ids_equal={same} "
            f"max_w_err={err:.2e} shared_ok={shared_ok}",
            flush=True,
        )
        # the fused router (gate GEMV + selection in one launch) == the GEMV then router_select, bit for bit;
        # twice (its counters must be left zeroed), and each token of n as if alone
        D = 2048 if not small else 96
        x = rnd(n, D, dev=dev)
        gw = rnd(E, D, dev=dev, scale=D**-0.5)
        nw = rnd(D, dev=dev, scale=0.2) + 1
        kw = dict(top_k=k, n_group=G, topk_group=TG, route_scale=2.5, norm_topk=True, n_shared_slots=2)
        part = triton_gemv.gemv(x, gw, norm_w=nw, eps=1e-6, split_k=8)
        ids0, wts0 = triton_moe.router_select(part, bias, **kw)
        same_tile = triton_gemv.gemv_config(E, D, n)[:3] + (8,)  # the GEMV's own tile and warps
        fused = [triton_moe.router(x, gw, bias, norm_w=nw, eps=1e-6, cfg=same_tile, **kw) for _ in range(2)]
        ok = all(bool(torch.equal(a, b)) for f in fused for a, b in zip(f, (ids0, wts0), strict=True))
        # the default launch (its own warps: other fp32 roundings of the logits): the same choices, weights to
        # rounding; run twice and each token alone, bit for bit
        dflt = [triton_moe.router(x, gw, bias, norm_w=nw, eps=1e-6, **kw) for _ in range(2)]
        alone = [triton_moe.router(x[r : r + 1], gw, bias, norm_w=nw, eps=1e-6, **kw) for r in range(n)]
        ok = ok and bool(torch.equal(dflt[0][0], ids0)) and float((dflt[0][1] - wts0).abs().max()) < 1e-5
        ok = ok and all(bool(torch.equal(a, b)) for a, b in zip(dflt[0], dflt[1], strict=True))
        ok = ok and bool(torch.equal(torch.cat([a[0] for a in alone]), dflt[0][0]))
        ok = ok and bool(torch.equal(torch.cat([a[1] for a in alone]), dflt[0][1]))
        RESULTS.append((f"fused router E={E}", 0.0, 0.0, ok))
        print(
            f"{'PASS' if ok else 'FAIL'}  fused router n={n} E={E} k={k} groups={G}/{TG} == gemv + router_select "
            "(bit for bit at the GEMV's tile; the default launch: same ids, twice and each token alone)",
            flush=True,
        )


def rope_ref(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h].float(), x[..., h:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def check_prep(dev, small):
    if small:
        shapes = [(2, 3, 32, 128, 16, 32, 32, 32, 64), (2, 3, 32, 128, 16, 48, 64, 32, 64)]
    else:  # V3.2's heads, then one TP8 rank of GLM-5 (nope width 192: not a power of two, value width 256)
        shapes = [(16, 16, 1536, 512, 64, 128, 128, 128, 4096), (8, 32, 2048, 512, 64, 192, 256, 128, 4096)]
    for shape in shapes:
        _check_prep_shape(dev, *shape)


def _check_prep_shape(dev, H, Hi, QL, L, R, P, V, DI, S):
    for n in (1, 3):
        a = rnd(n, QL + L + R + DI + Hi, dev=dev)
        b = rnd(n, H * (P + R) + Hi * DI, dev=dev)
        kvb = rnd(H * (P + V), L, dev=dev, scale=L**-0.5)
        pos = torch.arange(S - 10, S - 10 + n, device=dev)
        inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=dev).float() / R))
        ang = torch.arange(S, device=dev).float()[:, None] * inv[None, :]
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        kvn = rnd(L, dev=dev, scale=0.2) + 1
        ikw = rnd(DI, dev=dev, scale=0.2) + 1
        ikb = rnd(DI, dev=dev, scale=0.1)
        q_out = poison(torch.empty(n, H, L + R, device=dev, dtype=DTYPE))
        kv = rnd(S, L + R, dev=dev)
        ik = rnd(S, DI, dev=dev)
        iq = poison(torch.empty(n, Hi, DI, device=dev, dtype=DTYPE))
        iw = poison(torch.empty(n, Hi, device=dev, dtype=torch.float32))
        kv0, ik0 = kv.clone(), ik.clone()
        iw_scale = Hi**-0.5 * DI**-0.5
        triton_fused.mla_prep(
            a,
            b,
            pos,
            kvb,
            cos,
            sin,
            kvn,
            ikw,
            ikb,
            q_out,
            kv,
            ik,
            iq,
            iw,
            H=H,
            Hi=Hi,
            QL=QL,
            L=L,
            R=R,
            P=P,
            V=V,
            DI=DI,
            eps=1e-6,
            iw_scale=iw_scale,
        )
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        qb = b[:, : H * (P + R)].view(n, H, P + R)
        W = kvb.view(H, P + V, L)
        q_abs = torch.einsum("nhp,hpl->nhl", qb[..., :P].float(), W[:, :P].float())
        want_q = torch.cat([q_abs, rope_ref(qb[..., P:], c, s)], -1)
        report(f"mla_prep P={P} q (absorb+rope) n={n}", q_out, want_q)
        ckv = ref.rms_norm(a[:, QL : QL + L], kvn, 1e-6)
        kpe = rope_ref(a[:, QL + L : QL + L + R], cos[pos], sin[pos])
        want_kv = kv0.clone()
        want_kv[pos] = torch.cat([ckv.float(), kpe], -1).to(kv.dtype)
        report(f"mla_prep P={P} kv-cache rows n={n}", kv, want_kv)
        kk = F.layer_norm(a[:, QL + L + R : QL + L + R + DI].float(), (DI,), ikw.float(), ikb.float(), 1e-6)
        kk = kk.to(DTYPE)
        want_ik = ik0.clone()
        want_ik[pos] = torch.cat([rope_ref(kk[:, :R], cos[pos], sin[pos]), kk[:, R:].float()], -1).to(ik.dtype)
        report(f"mla_prep P={P} indexer-cache rows n={n}", ik, want_ik)
        report(f"mla_prep P={P} indexer weights n={n}", iw, a[:, QL + L + R + DI :].float() * iw_scale)
        iqr = b[:, H * (P + R) :].view(n, Hi, DI)
        want_iq = torch.cat([rope_ref(iqr[..., :R], c, s), iqr[..., R:].float()], -1)
        report(f"mla_prep P={P} indexer q (rope) n={n}", iq, want_iq)
        o_lat = rnd(n, H, L, dev=dev)
        got = triton_fused.mla_uv(o_lat, kvb, P=P, V=V)
        want = torch.einsum("nhl,hvl->nhv", o_lat.float(), W[:, P:].float()).reshape(n, H * V)
        report(f"mla_uv P={P} V={V} n={n}", got, want)


def check_registered(dev):
    """The tilert::* ops dispatch to the CUDA kernels and agree with the reference."""
    import tilert.engines.tilert.ops as ops

    if not ops.register_device_kernels():
        raise RuntimeError("the Triton CUDA kernels could not be registered (no CUDA or no Triton)")

    q = rnd(1, 16, 576, dev=dev)
    kv = rnd(5000, 576, dev=dev)
    pos = torch.tensor([4321], device=dev)
    report(
        "op tilert::mla_attention (cuda)",
        ops.mla_attention(q, kv, pos, 0.1, 512),
        ref.mla_attention(q, kv, pos, 0.1, 512),
    )
    idx = torch.randperm(5000, device=dev)[:2048].to(torch.int32)[None]
    report(
        "op tilert::mla_sparse_attention (cuda)",
        ops.mla_sparse_attention(q, kv, idx, 0.1, 512),
        ref.mla_sparse_attention(q, kv, idx, 0.1, 512),
    )
    # attention straight through W_UV (one merging kernel): dense, dense from a first row, sparse; n = 1 and 3
    kvb = rnd(16 * 256, 512, dev=dev, scale=512**-0.5)
    q3 = rnd(3, 16, 576, dev=dev)
    pos3 = torch.tensor([4321, 17, 2500], device=dev)
    start3 = torch.tensor([0, 3, 1000], device=dev)
    idx3 = torch.stack([torch.randperm(5000, device=dev)[:2048] for _ in range(3)]).to(torch.int32)
    for qq, pp, ii, rs, tag in (
        (q, pos, None, None, "dense n=1"),
        (q3, pos3, None, start3, "dense rows n=3"),
        (q, None, idx, None, "sparse n=1"),
        (q3, None, idx3, None, "sparse n=3"),
    ):
        report(
            f"op tilert::mla_attention_uv {tag} (cuda)",
            ops.mla_attention_uv(qq, kv, pp, ii, 0.1, 512, rs, kvb, 128),
            ref.mla_attention_uv(qq, kv, pp, ii, 0.1, 512, rs, kvb, 128),
        )
    x = rnd(2, 2048, dev=dev)
    g = rnd(2048, dev=dev) + 1
    report("op tilert::rms_norm (cuda)", ops.rms_norm(x, g, 1e-6), ref.rms_norm(x, g, 1e-6), tol=5e-3)
    w13 = rnd(10, 2 * 256, 2048, dev=dev, scale=0.02)
    w2 = rnd(10, 2048, 256, dev=dev, scale=0.05)
    ids = torch.tensor([[1, 5, 7]], device=dev, dtype=torch.int32)
    wts = torch.rand(1, 3, device=dev)
    report(
        "op tilert::moe_experts (cuda)",
        ops.moe_experts(x[:1], ids, wts, w13, w2),
        ref.moe_experts(x[:1], ids, wts, w13, w2),
    )
    # fused decode-layer ops, lite-v32 shapes
    w = rnd(2256, 2048, dev=dev, scale=2048**-0.5)
    for n in (1, 3):
        xn = x[:1].repeat(n, 1) if n > 1 else x[:1]
        report(f"op tilert::gemv+norm n={n} (cuda)", ops.gemv(xn, w, g, 1e-6), ref.gemv(xn, w, g, 1e-6))
        hh = rnd(n, 2048, dev=dev)
        o = rnd(n, 2048, dev=dev)
        h1, h2 = hh.clone(), hh.clone()
        ops.gemv_residual(h1, o, w[:2048], h1)
        ref.gemv_residual(h2, o, w[:2048], h2)
        report(f"op tilert::gemv_residual n={n} (cuda)", h1, h2)
        for base in (hh, None):  # a tensor-parallel rank's share: into a buffer apart, with / without the residual
            o1, o2 = torch.full_like(hh, float("nan")), torch.full_like(hh, float("nan"))
            ops.gemv_residual(o1, o, w[:2048], base)
            ref.gemv_residual(o2, o, w[:2048], base)
            report(f"op tilert::gemv_residual apart, residual {base is not None} n={n} (cuda)", o1, o2)
        gate = rnd(64, 2048, dev=dev, scale=2048**-0.5)
        bias = 0.01 * torch.randn(64, device=dev)
        ids_r, wts_r = ref.router(hh, g, 1e-6, gate, bias, 6, 1, 1, 1.0, True, 2)
        w13b = rnd(66, 2 * 1408, 2048, dev=dev, scale=2048**-0.5)
        w2b = rnd(66, 2048, 1408, dev=dev, scale=1408**-0.5)
        h1, h2 = hh.clone(), hh.clone()
        ops.moe_residual(h1, g, 1e-6, ids_r, wts_r, w13b, w2b)
        ref.moe_residual(h2, g, 1e-6, ids_r, wts_r, w13b, w2b)
        report(f"op tilert::moe_residual n={n} (cuda)", h1, h2)
        for base in (hh, None):  # a tensor-parallel rank's share, as for gemv_residual
            o1, o2 = torch.full_like(hh, float("nan")), torch.full_like(hh, float("nan"))
            ops.moe_partial(o1, hh, g, 1e-6, ids_r, wts_r, w13b, w2b, base)
            ref.moe_partial(o2, hh, g, 1e-6, ids_r, wts_r, w13b, w2b, base)
            report(f"op tilert::moe_partial apart, residual {base is not None} n={n} (cuda)", o1, o2)
        h1, h2 = hh.clone(), hh.clone()
        ids_b, wts_b = ops.moe_block(h1, g, 1e-6, gate, bias, 6, 1, 1, 1.0, True, 2, w13b, w2b)
        same = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(ids_b, ids_r, strict=False))
        report(
            f"op tilert::moe_block n={n} ids identical={same} (cuda): sorted routing weights",
            wts_b.sort(-1).values,
            wts_r.sort(-1).values,
            tol=1e-2 if same else -1,
        )
        ref.moe_residual(h2, g, 1e-6, ids_b, wts_b, w13b, w2b)
        report(f"op tilert::moe_block n={n} (cuda): h", h1, h2)
        H, P, R, V, L, QL, Hi, DI = 16, 128, 64, 128, 512, 1536, 16, 128
        a_ = rnd(n, QL + L + R + DI + Hi, dev=dev)
        b_ = rnd(n, H * (P + R) + Hi * DI, dev=dev)
        kvb = rnd(H * (P + V), L, dev=dev, scale=L**-0.5)
        ang = torch.arange(4096, device=dev).float()[:, None] * (1e-2 * torch.rand(R // 2, device=dev))[None]
        cs, sn = ang.cos().to(DTYPE), ang.sin().to(DTYPE)
        kvn, ikw, ikb = rnd(L, dev=dev) + 1, rnd(DI, dev=dev) + 1, 0.05 * rnd(DI, dev=dev)
        pos_ = torch.randperm(4096, device=dev)[:n]
        kc1, kc2 = rnd(4096, L + R, dev=dev), None
        ic1 = rnd(4096, DI, dev=dev)
        kc2, ic2 = kc1.clone(), ic1.clone()
        got = ops.mla_prep(a_, b_, pos_, kvb, cs, sn, kvn, kc1, ikw, ikb, ic1, H, P, QL, Hi, 1e-6, 0.01)
        want = ref.mla_prep(a_, b_, pos_, kvb, cs, sn, kvn, kc2, ikw, ikb, ic2, H, P, QL, Hi, 1e-6, 0.01)
        for nm, x1, x2 in zip(("q", "index_q", "index_w"), got, want, strict=True):
            report(f"op tilert::mla_prep n={n} (cuda): {nm}", x1, x2)
        report(f"op tilert::mla_prep n={n} (cuda): kv rows", kc1[pos_], kc2[pos_])
        report(f"op tilert::mla_prep n={n} (cuda): index rows", ic1[pos_], ic2[pos_])
        # a dense step: W_a without the indexer's head weights, W_b without its queries (Hi = 0), the key row still
        kc3, ic3 = kc2.index_fill(0, pos_, float("nan")), ic2.index_fill(0, pos_, float("nan"))  # rows to be written
        a3, b3 = a_[:, : QL + L + R + DI].contiguous(), b_[:, : H * (P + R)].contiguous()
        q3, iq3, iw3 = ops.mla_prep(a3, b3, pos_, kvb, cs, sn, kvn, kc3, ikw, ikb, ic3, H, P, QL, 0, 1e-6, 0.01)
        empty = iq3.shape == (n, 0, DI) and iw3.shape == (n, 0)
        report(
            f"op tilert::mla_prep n={n} dense, no index q (cuda): q, empty={empty}",
            q3,
            want[0],
            tol=TOL if empty else -1,
        )
        report(f"op tilert::mla_prep n={n} dense, no index q (cuda): kv rows", kc3[pos_], kc2[pos_])
        report(f"op tilert::mla_prep n={n} dense, no index q (cuda): index rows", ic3[pos_], ic2[pos_])
        ol = rnd(n, H, L, dev=dev)
        report(f"op tilert::mla_uv n={n} (cuda)", ops.mla_uv(ol, kvb, P), ref.mla_uv(ol, kvb, P))


class decisions_recorded:
    """Records the model's discrete choices during one forward: the routing each ``tilert::moe_block``
    used (expert ids + weights) and each ``tilert::indexer_topk`` row set."""

    def __enter__(self):
        from tilert.engines.tilert import ops

        self.ops, self.orig = ops, (ops.moe_block, ops.indexer_topk)
        self.routes, self.topk = [], []

        def moe_block(*a, **k):
            ids, w = self.orig[0](*a, **k)
            self.routes.append((ids.cpu(), w.cpu()))
            return ids, w

        def topk(*a, **k):
            idx = self.orig[1](*a, **k)
            self.topk.append(idx.cpu())
            return idx

        ops.moe_block, ops.indexer_topk = moe_block, topk
        return self

    def __exit__(self, *exc):
        self.ops.moe_block, self.ops.indexer_topk = self.orig


class decisions_pinned:
    """Replays recorded choices in another forward (same layers in the same order; reference ops) and
    counts how many of them differ from the choices that forward would have made itself."""

    def __init__(self, rec: decisions_recorded) -> None:
        self.rec = rec

    def __enter__(self):
        from tilert.engines.tilert import ops

        self.ops, self.orig = ops, (ops.moe_block, ops.indexer_topk)
        routes, tops = iter(self.rec.routes), iter(self.rec.topk)
        self.n_route = self.n_route_diff = self.n_rows = self.n_rows_diff = 0

        def moe_block(
            h,
            norm_weight,
            eps,
            gate_weight,
            bias,
            top_k,
            n_group,
            topk_group,
            route_scale,
            norm_topk,
            n_shared,
            w13,
            w2,
            s13=None,
            s2=None,
        ):
            own, _ = ref.router(
                h, norm_weight, eps, gate_weight, bias, top_k, n_group, topk_group, route_scale, norm_topk, n_shared
            )
            ids, w = (t.to(h.device) for t in next(routes))
            for r_own, r in zip(own.tolist(), ids.tolist(), strict=False):
                self.n_route += 1
                self.n_route_diff += set(r_own) != set(r)
            ref.moe_residual(h, norm_weight, eps, ids, w, w13, w2, s13, s2)
            return ids, w

        def topk(*a, **k):
            own = self.orig[1](*a, **k)
            idx = next(tops)
            for r_own, r in zip(own.tolist(), idx.tolist(), strict=False):
                self.n_rows += len(r)
                self.n_rows_diff += len(set(r_own) ^ set(r)) // 2
            return idx.to(own.device)

        ops.moe_block, ops.indexer_topk = moe_block, topk
        return self

    def __exit__(self, *exc):
        self.ops.moe_block, self.ops.indexer_topk = self.orig

    def __str__(self) -> str:
        return f"expert sets {self.n_route_diff}/{self.n_route}, top-k rows {self.n_rows_diff}/{self.n_rows}"


def check_engine_model(dev, small):
    """The engine (one model: CUDA ops in a CUDA graph, bf16) vs the same engine with the reference ops on
    the CPU in fp32, on the same random weights (lite-v32 / layer-v32 layer dims, few layers) and the same
    random cache rows; decode n=1 in the dense regime (pos < index_topk) and DSA regime, n=3 verify.

    MoE routing and DSA top-k membership are discrete: bf16 rounding near a tie flips them, and one flipped
    expert moves the logits by several percent. So the limit (3e-2) applies to the fp32 reference run with
    the GPU's choices (recorded in an eager run of the same step); how many choices differ from the
    reference's own, and the unpinned error next to that of the reference ops in bf16, are printed."""
    sys.path.insert(0, os.path.dirname(__file__))
    import engine_configs as ec

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.model import Transformer, finish_model
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.engines.tilert.weights import random_model

    register_device_kernels()
    S = 3000
    from dataclasses import replace

    layer1 = replace(ec.small(ec.LAYER_V32, 1), n_routed_experts=32)  # 32 experts: keeps the fp32 CPU copy small
    for name, args in (("lite-v32-3L", ec.small(ec.LITE_V32, 3)), ("layer-v32-1L-32e", layer1)):
        cpu = random_model(args, device="cpu", dtype=torch.float32, max_seq_len=S, seed=1)
        sd = {k: v.clone() for k, v in cpu.state_dict().items()}
        with torch.device("meta"):
            gm = Transformer(args)
        gm = finish_model(gm, sd, dev, torch.bfloat16, S)
        g = torch.Generator().manual_seed(2)
        cpu.kv_cache.copy_(torch.randn(cpu.kv_cache.shape, generator=g))
        cpu.index_cache.copy_(torch.randn(cpu.index_cache.shape, generator=g))
        gm.kv_cache.copy_(cpu.kv_cache.to(torch.bfloat16))  # the same (bf16-representable) rows
        gm.index_cache.copy_(cpu.index_cache.to(torch.bfloat16))
        cpu.kv_cache.copy_(gm.kv_cache.float().cpu())
        cpu.index_cache.copy_(gm.index_cache.float().cpu())
        with torch.device("meta"):
            c16 = Transformer(args)
        c16 = finish_model(c16, sd, torch.device("cpu"), torch.bfloat16, S)
        c16.kv_cache.copy_(gm.kv_cache.cpu())
        c16.index_cache.copy_(gm.index_cache.cpu())
        e_cpu = TileRTEngine(cpu, torch.device("cpu"), torch.float32, S)
        e_c16 = TileRTEngine(c16, torch.device("cpu"), torch.bfloat16, S)
        e_gpu = TileRTEngine(gm, dev, torch.bfloat16, S)
        assert e_gpu.use_graphs or dev.type == "cpu"
        for n, p0 in ((1, 100), (1, 101), (1, 2500), (1, 2501), (3, 2502)):
            tok = torch.randint(0, args.vocab_size, (n,))
            with torch.no_grad():
                want = e_cpu.forward(tok, p0)
                noisy = e_c16.forward(tok, p0)
                got = e_gpu.forward(tok.to(dev), p0)
                e_gpu.use_graphs = False
                with decisions_recorded() as rec:  # the same step eagerly (== the graph, checked below)
                    e_gpu.forward(tok.to(dev), p0)
                e_gpu.use_graphs = True
                with decisions_pinned(rec) as diff:  # the fp32 reference making the GPU's discrete choices
                    pinned = e_cpu.forward(tok, p0)
            mode = "DSA" if p0 + n > args.index_topk else "dense"
            report(
                f"engine {name} graph bf16 vs ref fp32 (GPU's routing/top-k): n={n} pos={p0} {mode} logits",
                got,
                pinned,
                tol=3e-2,
            )
            err = float((got.float().cpu() - want).norm() / want.norm())
            noise = float((noisy.float() - want).norm() / want.norm())
            print(
                f"      decisions differing from the fp32 reference's own: {diff}; without pinning: engine err "
                f"{err:.1e}, the bf16 reference ops' err {noise:.1e}",
                flush=True,
            )
            agree = float((got.argmax(-1).cpu() == want.argmax(-1)).float().mean())
            print(
                f"      top-1 agreement {agree:.2f}; graphs captured: "
                f"{sorted(k for k, v in e_gpu._graphs.items() if v)}",
                flush=True,
            )
            report(
                f"engine {name} n={n} pos={p0}: written kv rows",
                gm.kv_cache[:, p0 : p0 + n],
                cpu.kv_cache[:, p0 : p0 + n],
                tol=3e-2,
            )
        # graph replay reproduces eager, and the same step twice is bitwise identical
        tok = torch.randint(0, args.vocab_size, (1,), device=dev)
        with torch.no_grad():
            r1 = e_gpu.forward(tok, 2600)
            r2 = e_gpu.forward(tok, 2600)
            e_gpu.use_graphs = False
            r3 = e_gpu.forward(tok, 2600)
            e_gpu.use_graphs = True
        report(f"engine {name}: same graph step twice bitwise", r2, r1, tol=1e-9)
        toks = torch.randint(0, args.vocab_size, (3,), device=dev)
        with torch.no_grad():
            for p0 in (1000, 2700) if dev.type == "cuda" else ():  # dense and DSA (torch on CPU: not invariant)
                batched = e_gpu.forward(toks, p0)
                alone = [e_gpu.forward(toks[j : j + 1], p0 + j)[0] for j in range(3)]
                bitwise(f"engine {name}: n=3 verify logits == three n=1 steps, bit for bit, pos {p0}", batched, alone)
        report(f"engine {name}: CUDA graph replay vs eager", r3, r1, tol=1e-6)
        del cpu, gm, c16, e_cpu, e_c16, e_gpu
        torch.cuda.empty_cache()


def check_engine_families(dev, small):
    """Each family's tiny checkpoint (``tilert tiny-model``: deepseek_v3, deepseek_v32, glm_moe_dsa; DSA top-k
    64, so an 80-token prompt runs the indexer) on CUDA in bf16 against transformers on the same weights.

    Two links: the engine's reference ops in fp32 (CPU) == transformers fp32 at 1e-4, unpinned; and the CUDA
    engine in bf16 (prefill eager, decode n=1 and n=3 verify through its graphs) == that fp32 reference at
    5e-2 with the CUDA run's routing / top-k choices replayed in it (this tiny random model's bf16 arithmetic
    flips them: transformers' own bf16 run misses its fp32 one by 1e-1 in prefill). Printed too: how many
    choices differ, and the unpinned error next to transformers' own bf16 error."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.models.tiny import ARCHS, build_tiny_model

    register_device_kernels()  # TileRTEngine.load registers them too
    T = 80
    for arch in ARCHS:
        with tempfile.TemporaryDirectory() as d:
            # 8 indexer heads: exact-zero indexer scores (all heads' dots negative, ~2^-heads per key) then
            # rarely tie on the top-k boundary, where torch.topk's choice is arbitrary (tests/ note this too)
            # rope 32 (< the indexer's 64): the fused mla_prep kernel's shapes (64 == 64 takes its fallback)
            extra = {"qk_rope_head_dim": 32} | ({} if arch == "deepseek_v3" else {"index_n_heads": 8})
            path = build_tiny_model(arch, Path(d) / arch, seed=5, **extra)
            tf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            tf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(dev).eval()
            eng = TileRTEngine.load(path, device=str(dev), dtype=torch.bfloat16, max_seq_len=256)
            cpu = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=256)
        ids = torch.randint(8, tf32.config.vocab_size, (T + 4,))
        with torch.no_grad():
            want = tf32(input_ids=ids[None]).logits[0].float()
            noisy = tf16(input_ids=ids[None].to(dev)).logits[0].float().cpu()
            report(
                f"{arch}: engine reference ops fp32 CPU vs transformers fp32, prefill",
                cpu.forward(ids[:T], 0),
                want[:T],
                tol=1e-4,
            )
            steps = (
                [("prefill (eager)", ids[:T], 0)]
                + [(f"decode n=1 (graph) pos {T + j}", ids[T + j : T + j + 1], T + j) for j in range(4)]
                + [("verify n=3 (graph)", ids[T + 1 : T + 4], T + 1)]
            )
            for label, tok, p0 in steps:
                got = eng.forward(tok.to(dev), p0).clone()
                eng.use_graphs = False
                with decisions_recorded() as rec:
                    eager = eng.forward(tok.to(dev), p0)
                eng.use_graphs = True
                with decisions_pinned(rec) as diff:
                    ref32 = cpu.forward(tok, p0)
                same = torch.equal(got, eager)
                report(
                    f"{arch}: engine bf16 CUDA {label} vs fp32 reference (CUDA's choices)"
                    f"{'' if same else ' GRAPH!=EAGER'}",
                    got,
                    ref32,
                    tol=5e-2 if same else -1,
                )
                n = tok.shape[0]
                err = float((got.float().cpu() - want[p0 : p0 + n]).norm() / want[p0 : p0 + n].norm())
                tf_err = float((noisy[p0 : p0 + n] - want[p0 : p0 + n]).norm() / want[p0 : p0 + n].norm())
                print(
                    f"      choices differing from the reference's own: {diff}; vs transformers fp32 unpinned: engine "
                    f"{err:.1e}, transformers bf16 {tf_err:.1e}",
                    flush=True,
                )
        del tf32, tf16, eng, cpu
        torch.cuda.empty_cache()


def check_batch_stream(eng, model, toks, pos, topk, steps=8):
    """``greedy_batch_stream`` (pipelined graph steps while the rows share an attention regime, step by step
    across the dense -> DSA boundary, ending where a cache ends) gives every step's tokens as successive
    ``decode_step_greedy`` calls from the same caches."""
    saved = model.kv_cache.clone(), model.index_cache.clone()
    cases = (
        ([0, 2], [pos[0], pos[2]]),  # dense rows
        ([1, 3], [pos[1], pos[3]]),  # DSA rows, sequence 3 meets the end of its cache
        ([2, 0, 1], [topk - 3, 20, pos[1]]),  # mixed, then all DSA
        ([0, 2], [topk - 3, 30]),  # dense, then one row crosses into the DSA regime
    )
    for seqs, ps in cases:
        tk = [toks[s] for s in seqs]
        want, t, p = [], tk, ps
        for _ in range(min(steps, eng.max_seq_len - max(ps))):
            t = eng.decode_step_greedy(t, p, seqs)
            p = [x + 1 for x in p]
            want.append(t)
        model.kv_cache.copy_(saved[0])
        model.index_cache.copy_(saved[1])
        got = list(eng.greedy_batch_stream(tk, ps, seqs, steps))
        model.kv_cache.copy_(saved[0])
        model.index_cache.copy_(saved[1])
        ok = got == want
        RESULTS.append((f"greedy_batch_stream {seqs} at {ps}", 0.0, 0.0, ok))
        print(
            f"{'PASS' if ok else 'FAIL'}  greedy_batch_stream, sequences {seqs} at {ps} == {len(want)} "
            "decode_step_greedy steps",
            flush=True,
        )


def check_engine_multiseq(dev, small, flat=None):
    """Several sequences in one engine (4 slots, one cache): ``decode_step`` over any subset and order of them,
    dense and DSA rows in one call, equals ``forward()`` of each row alone, bit for bit (the graphs of n = 1..4
    rows: the GEMV / MoE kernels treat rows independently, the MLA and indexer kernels read each row's own
    sequence rows); ``decode_step_greedy`` is its argmax; and each sequence equals a one-sequence engine holding
    the same rows (same weights; a tolerance, since the MLA split count follows the cache size)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from dataclasses import replace

    import engine_configs as ec

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.engines.tilert.weights import random_model

    register_device_kernels()
    B = 4
    if small:
        args = replace(
            ec.small(ec.LITE_V32, 2, vocab=4096),
            index_topk=64,
            hidden_size=256,
            n_routed_experts=8,
            moe_intermediate_size=128,
            intermediate_size=256,
        )
        S = 200
    else:
        args, S = ec.small(ec.LITE_V32, 3), 3000
    topk = args.index_topk
    pos = [topk // 2, topk + 100, 10, S - 5]  # sequences 0, 2 decode dense, 1, 3 DSA
    mb = random_model(args, device=dev, dtype=DTYPE, max_seq_len=S, seed=4, max_sequences=B)
    g = torch.Generator(device=dev).manual_seed(5)
    mb.kv_cache.normal_(generator=g)
    mb.index_cache.normal_(generator=g)
    eng = TileRTEngine(mb, dev, DTYPE, S)
    if flat is not None:  # (the CPU interpreter harness: Triton kernels on CPU tensors through the flat path)
        eng.flat = flat
    toks = torch.randint(0, args.vocab_size, (B,)).tolist()
    rows = {}
    with torch.no_grad():
        for seqs in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 0], [1], [3, 2, 1]):
            tk, ps = [toks[s] for s in seqs], [pos[s] for s in seqs]
            batch = eng.decode_step(tk, ps, seqs).clone()
            greedy = eng.decode_step_greedy(tk, ps, seqs)
            alone = [eng.forward(torch.tensor([tk[i]], device=dev), ps[i], s)[0].clone() for i, s in enumerate(seqs)]
            bitwise(f"engine decode_step, sequences {seqs} at {ps} == forward() of each alone", batch, alone)
            ok = greedy == batch.argmax(-1).tolist()
            RESULTS.append((f"decode_step_greedy {seqs}", 0.0, 0.0, ok))
            print(
                f"{'PASS' if ok else 'FAIL'}  decode_step_greedy == argmax of decode_step, sequences {seqs}", flush=True
            )
            rows.update({s: batch[i] for i, s in enumerate(seqs)})
        print(f"      graphs captured: {sorted(k for k, v in eng._graphs.items() if v)}", flush=True)
        check_batch_stream(eng, mb, toks, pos, topk)
        m1 = random_model(args, device=dev, dtype=DTYPE, max_seq_len=S, seed=4)
        e1 = TileRTEngine(m1, dev, DTYPE, S)
        for b in range(B):
            m1.kv_cache.copy_(mb.kv_cache[:, b * S : (b + 1) * S])
            m1.index_cache.copy_(mb.index_cache[:, b * S : (b + 1) * S])
            one = e1.forward(torch.tensor([toks[b]], device=dev), pos[b])[0]
            report(
                f"engine sequence {b} of 4 at pos {pos[b]} vs a one-sequence engine, same rows", rows[b], one, tol=1e-2
            )
    del mb, m1, eng, e1
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def check_engine_mtp(dev, small):
    """MTP speculative greedy on the GPU (catch-up + draft chain + verify in one CUDA graph per shape) emits
    exactly the engine's plain greedy tokens, K = 1, 2, 3, in the dense and the DSA regime (index_topk
    lowered to 64 so the DSA path runs at short contexts); the graph equals the same function run eagerly.
    The pipelined greedy_stream (argmax and next position inside its graph) emits them too; the speculative stream
    (steps launched ahead from state on the device) gives, with every draft taken, the steps called one by one,
    across the dense / DSA boundary and when stopped and continued step by step. Twice: an engine
    of one sequence, and sequence 2 of an engine holding 3 (flat rows, each token's first row as a graph input)
    while sequences 0 and 1 hold other prompts."""
    for n_seq, seq in ((1, 0), (3, 2)):
        _check_engine_mtp(dev, small, n_seq, seq)  # its engine and model are freed on return
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _check_engine_mtp(dev, small, n_seq, seq):
    sys.path.insert(0, os.path.dirname(__file__))
    from dataclasses import replace

    import engine_configs as ec

    from tilert.engines.tilert.engine import TileRTEngine, speculative_generate
    from tilert.engines.tilert.ops import register_device_kernels
    from tilert.engines.tilert.weights import random_model

    register_device_kernels()  # a no-op off CUDA (the CPU interpreter run checks the reference ops here)
    S = 512
    args = replace(ec.small(ec.LITE_V32, 2, vocab=4096), num_mtp_layers=1, index_topk=64)
    if small:
        args = replace(args, hidden_size=256, n_routed_experts=8, moe_intermediate_size=128, intermediate_size=256)
    model = random_model(args, device=dev, dtype=DTYPE, max_seq_len=S, seed=3, max_sequences=n_seq)
    eng = TileRTEngine(model, dev, DTYPE, S)
    tag = "" if n_seq == 1 else f" (sequence {seq} of {n_seq})"
    prompt = torch.randint(0, args.vocab_size, (40,), device=dev)
    for other in range(n_seq):  # the other sequences hold other prompts
        if other != seq:
            eng.forward(torch.randint(0, args.vocab_size, (100,), device=dev), 0, seq=other)

    def greedy(first, start, n):
        out, tok = [], first
        for i in range(n):
            tok = int(eng.forward(torch.tensor([tok], device=dev), start + i, seq=seq)[-1].argmax())
            out.append(tok)
        return out

    def steps_all_accepted(first, start, k, streamed):
        # every draft taken: the stream's steps (run ahead on the device) against steps called one by one
        out, tok, pos = [], first, start
        stream = eng.speculative_stream(first, start, k, seq=seq, accept_all=True)
        while len(out) < streamed:
            out.append(next(stream))
            tok, pos = out[-1].tokens[-1], pos + len(out[-1].tokens)
        stream.close()
        while len(out) < 10:
            out.append(eng.speculative_greedy_step(tok, pos, k, seq=seq, accept_all=True))
            tok, pos = out[-1].tokens[-1], pos + len(out[-1].tokens)
        return out

    gen = 48
    with torch.no_grad():
        for start in (40, 200):  # dense (positions < 64 at the first steps) and DSA regimes
            ids = torch.cat([prompt, prompt.repeat(4)])[:start]
            first = int(eng.forward(ids, 0, seq=seq)[-1].argmax())
            plain = greedy(first, start, gen)
            for k in (1, 2, 3):
                eng.forward(ids, 0, seq=seq)
                got, drafted, accepted = speculative_generate(eng, first, start, gen, num_draft=k, seq=seq)
                ok = got == plain
                if not ok:
                    j = next(i for i, (a, b) in enumerate(zip(got, plain, strict=False)) if a != b)
                    print(f"      first difference at token {j}: spec {got[j]} vs plain {plain[j]}", flush=True)
                verdict(
                    f"mtp K={k} start={start}{tag}",
                    ok,
                    f"MTP speculative greedy == plain greedy, K={k}, from pos {start}, {gen} tokens (drafted "
                    f"{drafted}, accepted {accepted}){tag}; spec graphs "
                    f"{sorted(k_ for k_, v in eng._spec_graphs.items() if v)}",
                )
            for k in (1, 3):
                eng.forward(ids, 0, seq=seq)
                want = steps_all_accepted(first, start, k, 0)
                eng.forward(ids, 0, seq=seq)
                got = steps_all_accepted(first, start, k, 8)
                verdict(
                    f"mtp stream accept_all K={k} start={start}{tag}",
                    got == want,
                    f"MTP speculative_stream, every draft taken, == the steps one by one, K={k}, from pos {start}, 8 "
                    f"steps streamed, 2 after; stream graphs {sorted(eng._spec_run_graphs)}{tag}",
                )
            first = int(eng.forward(ids, 0, seq=seq)[-1].argmax())
            stream = list(eng.greedy_stream(first, start, gen, seq=seq))
            eng.forward(ids, 0, seq=seq)
            part = eng.greedy_stream(first, start, gen, seq=seq)
            head = [next(part) for _ in range(gen // 2)]
            part.close()
            resumed = head + greedy(head[-1], start + gen // 2, gen - gen // 2)
            verdict(
                f"greedy_stream start={start}{tag}",
                stream == plain and resumed == plain,
                f"pipelined greedy_stream == plain greedy from pos {start}, {gen} tokens; stopped half-way and "
                f"continued with forward(): same{tag}",
            )
        if eng.use_graphs:  # the captured step vs the same function eagerly, same inputs and state
            key, step = next((k_, v) for k_, v in eng._spec_graphs.items() if v)
            d1, g1 = (t.clone() for t in step.replay())
            d2, g2 = eng._draft_verify(*step.inputs, num_draft=key[0], use_indexer=key[2])
            verdict(
                f"mtp graph == eager{tag}",
                torch.equal(d1, d2) and torch.equal(g1, g2),
                f"MTP draft+verify graph {key} == eager: drafts {d1.tolist()} greedy {g1.tolist()}{tag}",
            )
        if n_seq == 1:  # (drops the speculative graphs, captured again with the FP8 copy)
            _check_fp8_draft_head(eng, dev, prompt, seq, gen, greedy)


def _check_fp8_draft_head(eng, dev, prompt, seq, gen, greedy):
    """``--draft-head fp8``: the drafts' head logits (the e4m3 copy through the device's FP8 GEMV, RMSNorm fused)
    against the reference's, and MTP greedy with those drafts still plain greedy's tokens; the same with the drafts
    limited to half the vocabulary (``--draft-vocab``: the head's rows of those ids, the draft mapped back inside the
    step's graph)."""
    from tilert.engines.tilert import ops
    from tilert.engines.tilert.engine import speculative_generate
    from tilert.engines.tilert.ops import reference

    eng.use_draft_head("fp8")
    try:
        m, mtp = eng.model, eng.model.mtp[0]
        h = torch.randn(2, m.args.hidden_size, device=dev, dtype=DTYPE)
        eps = m.args.rms_norm_eps
        got = ops.gemv(h, mtp.draft_head, mtp.head_norm, eps, None, True, mtp.draft_head_scale)
        want = reference.gemv(
            h.cpu().float(),
            mtp.draft_head.cpu(),
            mtp.head_norm.cpu().float(),
            eps,
            None,
            True,
            mtp.draft_head_scale.cpu(),
        )
        report("mtp fp8 draft head logits", got.float().cpu(), want)
        half = range(0, m.args.vocab_size, 2)
        for vocab, what in ((None, "the block-FP8 head copy"), (half, "its rows of the even token ids")):
            eng.use_draft_head("fp8", vocab)
            for start in (40, 200):
                ids = torch.cat([prompt, prompt.repeat(4)])[:start]
                first = int(eng.forward(ids, 0, seq=seq)[-1].argmax())
                plain = greedy(first, start, gen)
                eng.forward(ids, 0, seq=seq)
                got_t, drafted, accepted = speculative_generate(eng, first, start, gen, num_draft=3, seq=seq)
                verdict(
                    f"mtp fp8 draft head{' (half the vocabulary)' if vocab else ''} K=3 start={start}",
                    got_t == plain,
                    f"MTP drafting from {what} == plain greedy, K=3, from pos {start}, {gen} tokens (drafted "
                    f"{drafted}, accepted {accepted})",
                )
    finally:
        eng.use_draft_head("model")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--seed", type=int, default=None, help="torch's seed for the random inputs (default: a fresh one)")
    ap.add_argument("--dtype", default="bfloat16", help="float16 for the CPU interpreter (its bf16 dot is broken)")
    args = ap.parse_args()
    global DTYPE
    DTYPE = getattr(torch, args.dtype)
    # The CPU engines here are fp32 references whose routing / top-k choices the checks pin by patching the
    # dispatched ops (decisions_pinned): keep them on the dispatched reference ops, not ops.cpu.
    os.environ["TILERT_CPU_FAST"] = "0"
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed} (--seed {seed} repeats these inputs)", flush=True)
    torch.manual_seed(seed)
    dev = torch.device(args.device)
    checks = {
        "gemv": check_gemv,
        "mla": check_mla,
        "indexer": check_indexer,
        "topk": check_topk,
        "batch": check_batch_invariance,
        "moe": check_moe,
        "prep": check_prep,
        "shaping": check_shaping,
        "fp8": lambda d, small: check_fp8.check_fp8_kernels(d, small, report, rnd, DTYPE),
    }
    if dev.type == "cuda":
        checks["model"] = check_engine_model
        checks["families"] = check_engine_families
        checks["multiseq"] = check_engine_multiseq
        checks["fp8engine"] = lambda d, small: check_fp8.check_fp8_engine(d, small, report)
    else:
        checks["fp8engine"] = lambda d, small: check_fp8.check_fp8_engine_interpreted(d, small, report)
    checks["mtp"] = check_engine_mtp
    for name, fn in checks.items():
        if args.only and name not in args.only.split(","):
            continue
        try:
            fn(dev, args.small)
        except Exception as exc:  # report and continue with the other checks
            import traceback

            traceback.print_exc()
            RESULTS.append((f"{name} CRASHED: {exc!r}"[:120], math.nan, math.nan, False))
            print(f"FAIL  {name} crashed: {exc!r}", flush=True)
    if dev.type == "cuda" and (not args.only or "ops" in args.only):
        try:
            check_registered(dev)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            RESULTS.append((f"registered ops CRASHED: {exc!r}"[:120], math.nan, math.nan, False))
    n_fail = sum(1 for r in RESULTS if not r[3])
    print(f"\nkernel checks: {len(RESULTS) - n_fail}/{len(RESULTS)} PASS")
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
