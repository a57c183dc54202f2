"""Block-FP8 checks for ``check_kernels.py`` (``--only fp8,fp8engine``): each FP8 kernel against the reference
(which dequantises exactly, then runs the bf16 math), and the FP8 engine of each family against transformers on
the dequantised checkpoint.

    python3 benchmarks/check_kernels.py --only fp8,fp8engine                    (H200)
    TRITON_INTERPRET=1 python benchmarks/check_kernels.py --only fp8,fp8engine --small --device cpu --dtype float16

(On the CPU, ``fp8engine`` is :func:`check_fp8_engine_interpreted`: the FP8 engine through the CUDA op wrappers
and the interpreted Triton kernels.)
"""

from __future__ import annotations

import torch

from tilert.engines.tilert import fp8
from tilert.engines.tilert.ops import reference as ref
from tilert.engines.tilert.ops import triton_fp8, triton_fused, triton_gemv, triton_mla


def _q(rows: int, cols: int, dev, leaf: str = "wo", scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random weight quantised like DeepSeek's checkpoints, in the engine layout of ``leaf``."""
    w = torch.randn(rows, cols) * scale * torch.exp(torch.randn(rows, 1))  # rows of different magnitudes
    q, s = fp8.quantize_blocks(w)
    qt = fp8.QTensor.from_checkpoint(leaf, q, s)
    return q.to(dev), qt.compress(*fp8.scale_groups(leaf, (rows, cols)), leaf).to(dev)


def _stack(n: int, rows: int, cols: int, dev, leaf: str) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [_q(rows, cols, dev, leaf, cols**-0.5) for _ in range(n)]
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def _each_alone(fn, rows: tuple, *args, **kw) -> torch.Tensor:
    """``fn`` on each token alone (one row of each of ``rows``, then ``args`` / ``kw``), concatenated: the other side
    of a batch-invariance check."""
    return torch.cat([fn(*(t[r : r + 1] for t in rows), *args, **kw) for r in range(rows[0].shape[0])])


def _check_gemv_way(dev, rnd, report, way: str, nt, n, k, leaf, kw: dict, loop_cfg, tail: bool) -> None:
    """One way of reading an FP8 GEMV's weight (``kw``: ``gemv_fp8``'s launch arguments) at one shape: against the
    reference (W_a's bf16 tail rows too when ``tail``), n tokens against each alone (bit for bit), W_o with the
    residual, and against the register-fed loop at ``loop_cfg`` (FP8_PRE_BYTES = 0: fp32 reassociation only)."""
    x = rnd(nt, k, dev=dev)
    g = rnd(k, dev=dev, scale=0.2) + 1
    w, s = _q(n, k, dev, leaf, k**-0.5)
    t = rnd(16, k, dev=dev, scale=k**-0.5) if tail else None
    tag = f"{way} {leaf} n={nt} N={n} K={k}"
    got = triton_fp8.gemv_fp8(x, w, s, norm_w=g, tail=t, **kw)
    report(f"fp8 gemv {tag}", got, ref.gemv(x, w, g, 1e-6, None, False, s, tail=t))
    alone = _each_alone(triton_fp8.gemv_fp8, (x,), w, s, norm_w=g, tail=t, **kw)
    report(f"fp8 gemv batch invariance {tag}", got, alone, tol=1e-30)
    if leaf == "wo":
        h0 = rnd(nt, n, dev=dev)
        h1, h2 = h0.clone(), h0.clone()
        triton_fp8.gemv_fp8(x, w, s, residual=h1, **kw)
        ref.gemv_residual(h2, x, w, h2, s)
        report(f"fp8 gemv +residual {tag}", h1, h2)
    keep = triton_fp8.FP8_PRE_BYTES
    triton_fp8.FP8_PRE_BYTES = 0
    try:
        loop = triton_fp8.gemv_fp8(x, w, s, norm_w=g, tail=t, cfg=loop_cfg)
    finally:
        triton_fp8.FP8_PRE_BYTES = keep
    report(f"fp8 gemv == register-fed loop (fp32 reassociation) {tag}", got, loop, tol=1e-2)


def check_fp8_kernels(dev, small, report, rnd, dtype) -> None:
    # GEMVs: (tokens, N, K, leaf): W_a / W_b (one scale per row), W_o, lm_head-sized, at V3.2 and lite dims.
    shapes = [
        (1, 2240, 7168, "wa"),
        (1, 32768, 1536, "wb"),
        (4, 3072, 1536, "wb"),  # a dense step's W_b at V3.2 / lite dims: the query rows only
        (1, 7168, 16384, "wo"),
        (3, 2240, 7168, "wa"),
        (1, 2048, 2048, "wo"),
        (4, 2176, 2048, "wa"),
    ]
    if small:
        shapes = [(1, 40, 96, "wa"), (3, 200, 256, "wo"), (1, 384, 128, "wb")]
    for nt, n, k, leaf in shapes:
        x = rnd(nt, k, dev=dev)
        g = rnd(k, dev=dev, scale=0.2) + 1
        w, s = _q(n, k, dev, leaf, k**-0.5)
        tag = f"{leaf} n={nt} N={n} K={k} groups={fp8.groups(w, s)}"
        report(
            f"fp8 gemv+rmsnorm {tag}", triton_fp8.gemv_fp8(x, w, s, norm_w=g), ref.gemv(x, w, g, 1e-6, None, False, s)
        )
        report(
            f"fp8 gemv fp32 out {tag}",
            triton_fp8.gemv_fp8(x, w, s, out_f32=True),
            ref.gemv(x, w, None, 1e-6, None, True, s),
        )
        if leaf == "wo":
            h0 = rnd(nt, n, dev=dev)
            h1, h2 = h0.clone(), h0.clone()
            triton_fp8.gemv_fp8(x, w, s, residual=h1)
            ref.gemv_residual(h2, x, w, h2, s)
            report(f"fp8 gemv+residual {tag}", h1, h2)
    # The GEMV with all of K requested before the PDL wait (_gemv_fp8_rows_pre: NK = 1..4 tiles, x read once)
    # and W_a's bf16 tail rows: against the reference, n tokens against each alone (bit for bit), and against
    # the loop path of the same tile (FP8_PRE_BYTES = 0). Lite dims (the defaults: W_b, W_a + tail, W_o) and
    # explicit tiles for NK = 2..4.
    pre = [
        (3, 5120, 1536, "wb", None),
        (3, 2240, 2048, "wa", None),
        (2, 2048, 2048, "wo", None),
        (2, 2048, 2048, "wo", (2, 512, 4)),
        (3, 1024, 1536, "wb", (4, 1024, 4)),
        (3, 2304, 7168, "wa", (2, 2048, 8)),  # W_a at V3.2 dims in 3.5 tiles, the last one partial
        (1, 2304, 7168, "wa", (1, 2048, 4)),
        (3, 2304, 7168, "wa", (4, 4096, 8)),  # 1.75 tiles
        (1, 2304, 7168, "wa", (8, 4096, 8)),  # 128 weight bytes a thread a tile: the loop, not the prefetch
    ]
    if small:
        pre = [
            (3, 40, 96, "wa", (8, 32, 4)),
            (2, 24, 128, "wb", (4, 32, 4)),
            (2, 24, 80, "wo", (2, 32, 4)),
            (2, 40, 128, "wa", None),
            (2, 40, 112, "wa", (2, 32, 4)),  # 3.5 tiles
            (3, 40, 112, "wa", (4, 64, 8)),  # 1.75 tiles
        ]
    for nt, n, k, leaf, cfg in pre:
        name = f"prefetched cfg={cfg or triton_fp8.gemv_fp8_config(n, k)}"
        _check_gemv_way(dev, rnd, report, name, nt, n, k, leaf, {"cfg": cfg}, cfg, tail=True)
    # The TMA-fed GEMV (FP8_TMA_CFG, _gemv_fp8_rows_tma: tiles NS - 1 ahead in shared memory, rows and columns past
    # the weight zero-filled) at the rank's shapes (W_a + its tail, W_b, W_o + residual) and lite's: against the
    # reference, n tokens against each alone (bit for bit), and against the register-fed loop of the same tile.
    tma = [
        (3, 2240, 7168, "wa", (8, 512, 4, 4)),
        (1, 2240, 7168, "wa", (16, 256, 6, 4)),
        (2, 4096, 1536, "wb", (16, 512, 3, 8)),
        (2, 7168, 2048, "wo", (8, 512, 4, 4)),
        (1, 2048, 2048, "wo", (4, 1024, 2, 4)),
        (2, 7168, 2048, "wo", (8, 512, 8, 4)),  # more stages than K tiles
    ]
    if small:
        tma = [
            (3, 40, 96, "wa", (8, 32, 3, 4)),
            (2, 24, 80, "wo", (8, 32, 2, 4)),
            (2, 36, 112, "wb", (16, 64, 4, 4)),
            (2, 24, 80, "wo", (8, 32, 6, 4)),  # more stages than K tiles
        ]
    for nt, n, k, leaf, cfg4 in tma:
        loop = (cfg4[0], cfg4[1], cfg4[3])
        _check_gemv_way(dev, rnd, report, f"tma={cfg4}", nt, n, k, leaf, {"tma": cfg4}, loop, tail=leaf == "wa")
    # MoE: (experts, I, D, tokens); the real V3.2 expert dims with fewer experts (memory), lite dims, and a TP8
    # rank's slice of V3.2's / GLM-5's experts (I = 256: the "narrow" configs).
    moe = [(16, 2048, 7168, 1), (16, 2048, 7168, 4), (66, 1408, 2048, 1), (16, 256, 7168, 1), (16, 256, 6144, 3)]
    if small:
        moe = [(6, 96, 128, 1), (6, 160, 200, 3), (5, 80, 208, 2)]  # D = 200: rows the TMA cannot read
    for e, i, d, nt in moe:
        w13, s13 = _stack(e, 2 * i, d, dev, "w13")
        w2, s2 = _stack(e, d, i, dev, "w2")
        h = rnd(nt, d, dev=dev)
        g = rnd(d, dev=dev, scale=0.2) + 1
        ids = torch.stack([torch.randperm(e - 1)[:3] for _ in range(nt)]).to(dev, torch.int32)
        ids = torch.cat([ids, torch.full((nt, 1), e - 1, dtype=torch.int32, device=dev)], 1)  # a "shared" slot
        wts = torch.rand(nt, 4, device=dev)
        tag = f"E={e} I={i} D={d} n={nt}"
        x = ref.rms_norm(h, g, 1e-6)
        act = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g)
        got = triton_fp8.moe_down_fp8(act, ids, wts, w2, s2)
        report(f"fp8 moe_up (norm fused) {tag}", got, ref.moe_experts(x, ids, wts, w13, w2, s13, s2), tol=2e-2)
        # the same against the reference in fp32 (the kernels accumulate in fp32; the bf16 reference rounds)
        exact = ref.moe_experts(x.float(), ids, wts, w13, w2, s13, s2)
        report(f"fp8 moe_up (norm fused) vs fp32 reference {tag}", got, exact, tol=2e-2)
        h1, h2 = h.clone(), h.clone()
        act = triton_fp8.moe_up_fp8(h1, ids, w13, s13, norm_w=g)
        triton_fp8.moe_down_fp8(act, ids, wts, w2, s2, residual=h1)
        ref.moe_residual(h2, g, 1e-6, ids, wts, w13, w2, s13, s2)
        # The same experts as the check above, added into the residual stream: the same tolerance. (At 1e-2 this
        # line sat at 0.9-1.1e-2 on random inputs, before and after the 2026-11-30 kernel rework: the bf16
        # reference itself is ~5e-3 from exact fp32 math on these inputs.)
        report(f"fp8 moe residual {tag}", h1, h2, tol=2e-2)
        # moe_down's launch configs, split over slot groups (fp32 partials summed by the last program of a row
        # block) or not: each against the reference, run twice (the counters must be left zeroed; the result
        # the same bit for bit whatever order the programs finish in), and each token of n as if alone.
        want = ref.moe_experts(x, ids, wts, w13, w2, s13, s2)
        act = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g)
        a0 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g)
        report(
            f"fp8 moe_up, the last slot static (no wait on the router) == as read from ids {tag}",
            triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, static=(3, e - 1)),
            a0,
            tol=1e-30,
        )
        for ucfg in ((16, 256, 4, 2), (8, 512, 4, 4), (16, 32, 4, 3)):  # moe_up split over D (partials summed)
            a1 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, cfg=ucfg)
            a2 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, cfg=ucfg)
            report(f"fp8 moe_up cfg={ucfg} {tag}", triton_fp8.moe_down_fp8(a1, ids, wts, w2, s2), want, tol=2e-2)
            report(f"fp8 moe_up cfg={ucfg} twice: bit-identical {tag}", a2, a1, tol=1e-30)
            if nt > 1:
                alone = _each_alone(triton_fp8.moe_up_fp8, (h, ids), w13, s13, norm_w=g, cfg=ucfg)
                report(f"fp8 moe_up cfg={ucfg} batch invariance {tag}", a1, alone, tol=1e-30)
        # moe_up fed by the TMA (FP8_UP_TMA_CFG): against the reference through moe_down, against the register-fed
        # kernel of the same tile, the static (shared) slot and the statistics computed early (the engine's call),
        # twice bit-identical, each token as if alone (rows it cannot read: the register-fed kernel, checked above).
        for tcfg in (
            ((8, 512, 4, 4), (16, 256, 6, 4), (8, 1024, 3, 8), (8, 1024, 8, 4))
            if not small
            else ((8, 32, 3, 4), (16, 64, 2, 4), (8, 64, 6, 4))
        ):
            if not triton_gemv.tma_ready(w13):
                break
            t1 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, tma=tcfg)
            tag_t = f"tma={tcfg} {tag}"
            report(f"fp8 moe_up {tag_t}", triton_fp8.moe_down_fp8(t1, ids, wts, w2, s2), want, tol=2e-2)
            reg = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, cfg=(tcfg[0], tcfg[1], tcfg[3], 1))
            report(f"fp8 moe_up tma == register-fed (fp32 reassociation) {tag_t}", t1, reg, tol=1e-2)
            t2 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, tma=tcfg, static=(3, e - 1))
            report(f"fp8 moe_up tma, the last slot static == as read from ids {tag_t}", t2, t1, tol=1e-30)
            keep = triton_fp8.UP_RSTD_EARLY
            triton_fp8.UP_RSTD_EARLY = not keep
            try:
                t3 = triton_fp8.moe_up_fp8(h, ids, w13, s13, norm_w=g, tma=tcfg, static=(3, e - 1))
            finally:
                triton_fp8.UP_RSTD_EARLY = keep
            report(f"fp8 moe_up tma, statistics early or not: bit-identical {tag_t}", t3, t1, tol=1e-30)
            if nt > 1:
                alone = _each_alone(triton_fp8.moe_up_fp8, (h, ids), w13, s13, norm_w=g, tma=tcfg)
                report(f"fp8 moe_up tma batch invariance {tag_t}", t1, alone, tol=1e-30)
        for cfg in (
            (16, 1, 512, 4, True),
            (4, 4, 512, 8, False),
            (8, 2, 1024, 8, True),
            (32, 1, 512, 8, True),
            (64, 1, 256, 8, True),
        ):
            y1 = triton_fp8.moe_down_fp8(act, ids, wts, w2, s2, cfg=cfg)
            y2 = triton_fp8.moe_down_fp8(act, ids, wts, w2, s2, cfg=cfg)
            report(f"fp8 moe_down cfg={cfg} {tag}", y1, want, tol=2e-2)
            report(f"fp8 moe_down cfg={cfg} twice: bit-identical {tag}", y2, y1, tol=1e-30)
            if nt > 1:
                alone = torch.cat(
                    [
                        triton_fp8.moe_down_fp8(act[r : r + 1], ids[r : r + 1], wts[r : r + 1], w2, s2, cfg=cfg)
                        for r in range(nt)
                    ]
                )
                report(f"fp8 moe_down cfg={cfg} batch invariance {tag}", y1, alone, tol=1e-30)
    # MLA projections: W_UK absorption (in mla_prep) and W_UV (mla_uv) from an FP8 kv_b.
    if small:
        shapes = [(2, 3, 32, 128, 16, 32, 32, 32, 64)]
    else:  # V3.2's 128 heads, then one TP8 rank of GLM-5 (nope width 192, value width 256)
        shapes = [(128, 64, 1536, 512, 64, 128, 128, 128, 4096), (8, 32, 2048, 512, 64, 192, 256, 128, 4096)]
    for H, Hi, QL, L, R, P, V, DI, S in shapes:
        for n in (1, 3):
            a = rnd(n, QL + L + R + DI + Hi, dev=dev)
            b = rnd(n, H * (P + R) + Hi * DI, dev=dev)
            kvb, kvs = _q(H * (P + V), L, dev, "wkv_b", L**-0.5)
            pos = torch.arange(S - 10, S - 10 + n, device=dev)
            inv = 1.0 / (10000 ** (torch.arange(0, R, 2, device=dev).float() / R))
            ang = torch.arange(S, device=dev).float()[:, None] * inv[None, :]
            cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
            kvn = rnd(L, dev=dev, scale=0.2) + 1
            ikw, ikb = rnd(DI, dev=dev, scale=0.2) + 1, rnd(DI, dev=dev, scale=0.1)
            kv, ik = rnd(S, L + R, dev=dev), rnd(S, DI, dev=dev)
            q_out = torch.full((n, H, L + R), float("nan"), device=dev, dtype=dtype)
            iq = torch.full((n, Hi, DI), float("nan"), device=dev, dtype=dtype)
            iw = torch.full((n, Hi), float("nan"), device=dev, dtype=torch.float32)
            scale = Hi**-0.5 * DI**-0.5
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
                kv.clone(),
                ik.clone(),
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
                iw_scale=scale,
                kv_b_scale=kvs,
            )
            want, _, _ = ref.mla_prep(
                a,
                b,
                pos,
                kvb,
                cos.to(dtype),
                sin.to(dtype),
                kvn,
                kv.clone(),
                ikw,
                ikb,
                ik.clone(),
                H,
                P,
                QL,
                Hi,
                1e-6,
                scale,
                kvs,
            )
            report(f"fp8 mla_prep q (W_UK absorb, kv_b e4m3) H={H} P={P} n={n}", q_out, want)
            o_lat = rnd(n, H, L, dev=dev)
            report(
                f"fp8 mla_uv H={H} P={P} V={V} n={n}",
                triton_fused.mla_uv(o_lat, kvb, P=P, V=V, kv_b_scale=kvs),
                ref.mla_uv(o_lat, kvb, P, kvs),
            )
            # attention merged straight through the FP8 W_UV (mla_attention_uv's kernel)
            qa = torch.randn(n, H, L + R, device=dev).to(dtype)
            kva = torch.randn(S, L + R, device=dev).to(dtype)
            report(
                f"fp8 mla_attention_uv (dense, kv_b e4m3) H={H} P={P} V={V} n={n}",
                triton_mla.mla_decode(qa, kva, pos, None, 0.05, L, uv=(kvb, P, V, kvs)),
                ref.mla_attention_uv(qa, kva, pos, None, 0.05, L, None, kvb, P, kvs),
            )


def check_fp8_engine(dev, small, report) -> None:
    """Each family's tiny checkpoint quantised like DeepSeek's (``tilert.models.quantize``): the CPU engine (fp32,
    reference ops, exact dequantisation) against transformers on the dequantised checkpoint at 1e-4, and the CUDA
    engine (bf16 activations, e4m3 weights read by the Triton kernels, CUDA graphs) against that CPU engine at
    5e-2 with the CUDA run's routing / top-k choices replayed (as check_engine_families does for bf16)."""
    import tempfile
    from pathlib import Path

    from check_kernels import decisions_pinned, decisions_recorded
    from transformers import AutoModelForCausalLM

    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.models.quantize import dequantize_checkpoint, quantize_checkpoint
    from tilert.models.tiny import ARCHS, build_tiny_model

    T = 80
    for arch in ARCHS:
        with tempfile.TemporaryDirectory() as d:
            extra = {"qk_rope_head_dim": 32} | ({} if arch == "deepseek_v3" else {"index_n_heads": 8})
            src = build_tiny_model(arch, Path(d) / "src", seed=5, **extra)
            q = quantize_checkpoint(src, Path(d) / "fp8")
            deq = dequantize_checkpoint(q, Path(d) / "deq")
            tf32 = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
            eng = TileRTEngine.load(q, device=str(dev), dtype=torch.bfloat16, max_seq_len=256)
            cpu = TileRTEngine.load(q, device="cpu", dtype=torch.float32, max_seq_len=256)
        w13 = dict(eng.model.named_parameters())["layers.1.mlp.w13"]
        report(
            f"{arch}: FP8 engine holds e4m3 experts ({w13.dtype})",
            torch.ones(1),
            torch.ones(1) * (w13.dtype == fp8.E4M3),
            tol=1e-9,
        )
        ids = torch.randint(8, tf32.config.vocab_size, (T + 4,))
        with torch.no_grad():
            want = tf32(input_ids=ids[None]).logits[0].float()
        report(
            f"{arch}: FP8 engine fp32 CPU vs transformers on the dequantised checkpoint, prefill",
            cpu.forward(ids[:T], 0),
            want[:T],
            tol=1e-4,
        )
        steps = [("prefill (eager)", ids[:T], 0)] + [
            (f"decode n=1 (graph) pos {T + j}", ids[T + j : T + j + 1], T + j) for j in range(4)
        ]
        for label, tok, p0 in steps:
            got = eng.forward(tok.to(dev), p0).clone()
            eng.use_graphs = False
            with decisions_recorded() as rec:
                eng.forward(tok.to(dev), p0)
            eng.use_graphs = True
            with decisions_pinned(rec):
                ref32 = cpu.forward(tok, p0)
            report(f"{arch}: FP8 engine bf16 CUDA {label} vs FP8 fp32 CPU (CUDA's choices)", got, ref32, tol=5e-2)
        _check_l2_plan(arch, eng, ids[T : T + 1].to(dev), T, report)
        del tf32, eng, cpu
        torch.cuda.empty_cache()


def _check_l2_plan(arch, eng, tok, pos, report) -> None:
    """Every L2 prefetch site on (``triton_prefetch.ALL_SITES``) and the experts' loads evict-first: the graph
    step's logits bit for bit those without (a cache hint may change the time, never the result)."""
    from tilert.engines.tilert.ops import triton_prefetch

    plan = triton_prefetch.SITES, triton_prefetch.MOE_EVICT_FIRST
    try:
        eng._graphs.clear()
        triton_prefetch.SITES, triton_prefetch.MOE_EVICT_FIRST = (), False
        base = eng.forward(tok, pos).clone()
        eng._graphs.clear()
        triton_prefetch.SITES, triton_prefetch.MOE_EVICT_FIRST = triton_prefetch.ALL_SITES, True
        hinted = eng.forward(tok, pos).clone()
    finally:
        triton_prefetch.SITES, triton_prefetch.MOE_EVICT_FIRST = plan
        eng._graphs.clear()
    report(f"{arch}: FP8 engine graph step with every L2 prefetch site, bit for bit", hinted, base, tol=1e-9)


def check_fp8_engine_interpreted(dev, small, report) -> None:
    """Without a GPU (``TRITON_INTERPRET=1 ... --only fp8engine --device cpu --dtype float16``, a few minutes): a
    tiny FP8 deepseek_v32 model decoding token by token through the CUDA op wrappers (``ops/cuda.py``) and so
    through the FP8 Triton kernels, interpreted on CPU tensors in float16, against the fp32 CPU engine (the
    reference ops dequantise exactly). Checks the wiring of scales from the model through the wrappers."""
    import tempfile
    import types
    from pathlib import Path

    from tilert.engines.tilert.ops import cuda
    from tilert.engines.tilert.weights import load_model
    from tilert.models.quantize import quantize_checkpoint
    from tilert.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as d:
        src = build_tiny_model("deepseek_v32", Path(d) / "src", seed=5, num_hidden_layers=2)
        q = quantize_checkpoint(src, Path(d) / "fp8")
        want_model = load_model(q, device="cpu", dtype=torch.float32, max_seq_len=64)
        model = load_model(q, device="cpu", dtype=torch.float16, max_seq_len=64)
    calls: dict[str, int] = {}
    table = types.SimpleNamespace()
    for name, fn in cuda._KERNELS.items():

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **k)

        setattr(table, name, counted)
    model.use_kernels(table)
    ids = torch.randint(8, model.args.vocab_size, (4,))
    with torch.no_grad():
        want = want_model.logits(want_model(ids, torch.arange(4), use_indexer=False))
        got = torch.cat([model.logits(model(ids[i : i + 1], torch.tensor([i]), use_indexer=False)) for i in range(4)])
    report(
        f"deepseek_v32 FP8 engine through the CUDA wrappers (interpreted, fp16) vs fp32 CPU {calls}",
        got,
        want,
        tol=2e-2,
    )
