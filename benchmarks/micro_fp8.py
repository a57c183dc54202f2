"""FP8 kernel timings at the lite / V3.2 shapes (H200): the kernels of ``ops/triton_fp8.py`` at several launch
configs, and against a baseline kernel file when one lies beside this script as ``_fp8_old.py`` (not kept in the
repo: any other version of the file, e.g. ``git show REV:tilert/engines/tilert/ops/triton_fp8.py >
benchmarks/_fp8_old.py``), in CUDA graphs of PDL-chained calls rotating over weight copies (> L2). Prints one line
per (kernel, shape, variant).

    python3 benchmarks/micro_fp8.py [--out DIR] [--only gemv,up,down] [--rank]

``--rank``: the shapes of one TP8 rank of full-size V3.2 / GLM-5 instead, each launch config first checked
against the dequantising reference (its relative error is part of the variant's label); the GEMVs and ``moe_up``
also fed by the TMA (variants labelled ``tma (rows, K tile, stages, warps)``).

Writes ``benchmarks/results/<machine>-micro-fp8.json`` (``h200-micro-fp8``; under ``--out DIR`` or at
``--out FILE.json`` when given), starting with ``results_header``'s ``"recorded"`` (date, commit, machine,
command).
"""

# Every closure made in a loop here is called (captured in a CUDA graph) within the iteration that makes it.
# ruff: noqa: B023

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch
from micro import copies, graph_time  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402

from tilert.engines.tilert.ops import triton_fp8, triton_gemv  # noqa: E402

try:
    import _fp8_old as old  # noqa: E402
except ImportError:
    old = None

DEV = torch.device("cuda")
E4M3 = torch.float8_e4m3fn
ROWS: list = []


def q(*shape):
    return torch.randn(*shape, device=DEV).clamp_(-8, 8).to(E4M3)


def sc(*shape):
    return torch.empty(*shape, device=DEV).uniform_(0.5, 1.5).mul_(0.01)


def line(kind, shape, variant, t, nbytes):
    r = dict(kind=kind, shape=shape, variant=str(variant), us=t * 1e6, tbs=nbytes / t / 1e12)
    ROWS.append(r)
    print(f"{kind:<5} {shape:<26} {str(variant):<22} {r['us']:8.2f} us {r['tbs']:6.2f} TB/s", flush=True)


def bench(kind, shape, variant, fns, nbytes):
    try:
        line(kind, shape, variant, graph_time(fns), nbytes)
    except Exception as exc:
        print(f"{kind:<5} {shape:<26} {str(variant):<22} failed {exc!r}"[:200], flush=True)


def gemvs():
    # name, N, K, row-group (1: per-row scales), tail rows, residual, new-variants
    shapes = [
        ("lite wa+tail", 2240, 2048, 1, 16, False),
        ("lite wb", 5120, 1536, 1, 0, False),
        ("lite wo", 2048, 2048, 128, 0, True),
        ("v32 wa+tail", 2240, 7168, 1, 64, False),
        ("v32 wb", 32768, 1536, 1, 0, False),
        ("v32 wo", 7168, 16384, 128, 0, True),
    ]
    small = [(2, 2048, 4), (4, 1024, 4), (2, 1024, 4), (8, 1024, 4), (8, 512, 4), (4, 2048, 8)]
    large = [(8, 1024, 4), (8, 512, 4), (16, 512, 8), (16, 1024, 8), (4, 1024, 4), (16, 256, 4), (8, 2048, 8)]
    for name, N, K, gn, nt, res in shapes:
        nb = N * K + 4 * (N // gn) * (K // 128) + 2 * nt * K
        c = copies(nb)
        ws = [
            (q(N, K), sc(N // gn, K // 128), torch.randn(max(nt, 1), K, device=DEV).to(torch.bfloat16))
            for _ in range(c)
        ]
        x = torch.randn(1, K, device=DEV).to(torch.bfloat16)
        g = torch.ones(K, device=DEV, dtype=torch.bfloat16)
        h = torch.zeros(1, N, device=DEV, dtype=torch.bfloat16)
        tl_ = (lambda t: t) if nt else (lambda t: None)
        for cfg in small if K * N < (48 << 20) else large:
            if res:
                fns = [lambda w=w, s=s, cfg=cfg: triton_fp8.gemv_fp8(x, w, s, residual=h, cfg=cfg) for w, s, _ in ws]
            else:
                fns = [
                    lambda w=w, s=s, t=t, cfg=cfg: triton_fp8.gemv_fp8(x, w, s, norm_w=g, tail=tl_(t), cfg=cfg)
                    for w, s, t in ws
                ]
            bench("gemv", name, cfg, fns, nb)
        if old is not None:
            if res:
                fns = [lambda w=w, s=s: old.gemv_fp8(x, w, s, residual=h) for w, s, _ in ws]
            elif nt:
                fns = [
                    lambda w=w, s=s, t=t: torch.cat(
                        [old.gemv_fp8(x, w, s, norm_w=g), triton_gemv.gemv(x, t, norm_w=g)], -1
                    )
                    for w, s, t in ws
                ]
            else:
                fns = [lambda w=w, s=s: old.gemv_fp8(x, w, s, norm_w=g) for w, s, _ in ws]
            bench("gemv", name, "old" + ("+gemv+cat" if nt else ""), fns, nb)
        del ws
        torch.cuda.empty_cache()
    # bf16 reference rate in the same harness
    N, K = 7168, 16384
    ws = [torch.randn(N, K, device=DEV).to(torch.bfloat16) for _ in range(copies(N * K * 2))]
    x = torch.randn(1, K, device=DEV).to(torch.bfloat16)
    h = torch.zeros(1, N, device=DEV, dtype=torch.bfloat16)
    bench(
        "gemv", "v32 wo bf16", "bf16 LARGE_CFG", [lambda w=w: triton_gemv.gemv(x, w, residual=h) for w in ws], N * K * 2
    )
    del ws
    torch.cuda.empty_cache()


def moes(only):
    shapes = [("lite", 64, 8, 2048, 1408), ("v32", 32, 9, 7168, 2048)]
    ups = [
        (16, 256, 4, 1),
        (16, 256, 4, 2),
        (8, 256, 4, 2),
        (16, 512, 8, 2),
        (16, 256, 4, 4),
        (8, 512, 4, 2),
        (8, 1024, 4, 1),
        (8, 1024, 4, 2),
        (8, 512, 4, 1),
    ]
    downs = {
        "lite": [
            (4, 4, 512, 8, False),
            (16, 1, 512, 4, True),
            (8, 1, 1024, 4, True),
            (16, 2, 512, 8, True),
            (32, 1, 512, 8, True),
            (8, 1, 2048, 8, True),
            (4, 1, 2048, 4, True),
            (16, 1, 256, 4, True),
        ],
        "v32": [
            (8, 1, 1024, 8, False),
            (4, 1, 1024, 4, False),
            (16, 1, 1024, 8, True),
            (8, 2, 1024, 8, True),
            (8, 1, 1024, 4, True),
        ],
    }
    for name, E, KK, D, I in shapes:  # noqa: E741  (I: the MoE intermediate size)
        w13, s13 = q(E, 2 * I, D), sc(E, 2 * I // 128, D // 128)
        w2, s2 = q(E, D, I), sc(E, D // 128, I // 128)
        x = torch.randn(1, D, device=DEV).to(torch.bfloat16)
        g = torch.ones(D, device=DEV, dtype=torch.bfloat16)
        sets = [
            (torch.randperm(E, device=DEV)[:KK].int()[None].contiguous(), torch.rand(1, KK, device=DEV))
            for _ in range(8)
        ]
        act = triton_fp8.moe_up_fp8(x, sets[0][0], w13, s13, norm_w=g)
        h = torch.zeros(1, D, device=DEV, dtype=torch.bfloat16)
        nb_up, nb_dn = KK * 2 * I * D, KK * I * D
        if "up" in only:
            for cfg in ups:
                bench(
                    "up",
                    name,
                    cfg,
                    [
                        lambda ids=ids, cfg=cfg: triton_fp8.moe_up_fp8(x, ids, w13, s13, norm_w=g, cfg=cfg)
                        for ids, _ in sets
                    ],
                    nb_up,
                )
            if old is not None:
                bench(
                    "up",
                    name,
                    "old",
                    [lambda ids=ids: old.moe_up_fp8(x, ids, w13, s13, norm_w=g) for ids, _ in sets],
                    nb_up,
                )
        if "down" in only:
            for cfg in downs[name]:
                bench(
                    "down",
                    name,
                    cfg,
                    [
                        lambda ids=ids, wts=wts, cfg=cfg: triton_fp8.moe_down_fp8(
                            act, ids, wts, w2, s2, residual=h, cfg=cfg
                        )
                        for ids, wts in sets
                    ],
                    nb_dn,
                )
            if old is not None:
                bench(
                    "down",
                    name,
                    "old",
                    [lambda ids=ids, wts=wts: old.moe_down_fp8(act, ids, wts, w2, s2, residual=h) for ids, wts in sets],
                    nb_dn,
                )
        w13 = w2 = None
        torch.cuda.empty_cache()


def _rel(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _launch(cfg) -> dict:
    """A variant's launch arguments: None the class default, ``("tma", c)`` the TMA-fed kernel at c, else a
    register-fed config."""
    if isinstance(cfg, tuple) and cfg and cfg[0] == "tma":
        return {"tma": cfg[1]}
    return {"cfg": cfg}


def _label(cfg, err: float) -> str:
    name = "default" if cfg is None else f"tma {cfg[1]}" if cfg[0] == "tma" else str(cfg)
    return f"{name} e={err:.1e}{' BAD' if not err < 2e-2 else ''}"


def rank_shapes(only):
    """The TP8 ranks' FP8 kernels (V3.2, GLM-5: W_a + tail, W_b, W_o, the experts at width 256) at each launch
    config: each checked against the dequantising reference on fresh inputs (rel. L2 error printed; "BAD" over
    2e-2), then timed."""
    from tilert.engines.tilert.ops import reference as ref

    gemv_shapes = [  # name, N, K, row group, tail rows, residual
        ("v32r wa+tail", 2240, 7168, 1, 64, False),
        ("v32r wb", 11264, 1536, 1, 0, False),
        ("v32r wo", 7168, 2048, 128, 0, True),
        ("glm5r wa+tail", 2752, 6144, 1, 32, False),
        ("glm5r wb", 6144, 2048, 1, 0, False),
    ]
    gemv_cfgs = {
        7168: [(2, 2048, 4), (1, 2048, 4), (2, 2048, 8), (4, 4096, 8), (2, 8192, 8), (4, 1024, 4), (8, 1024, 8)],
        1536: [(8, 512, 4), (4, 512, 4), (16, 512, 8), (8, 512, 8), (4, 1024, 4)],
        2048: [(4, 2048, 8), (2, 2048, 4), (4, 1024, 4), (8, 1024, 8)],
    }
    gemv_cfgs[6144] = gemv_cfgs[7168]
    # the TMA-fed kernel's (rows, K tile, stages, warps), labelled "tma ..."
    gemv_tma = {
        7168: [(8, 512, 4, 4), (8, 512, 8, 4), (8, 1024, 6, 4), (16, 256, 8, 4), (4, 1024, 8, 4), (16, 512, 6, 8)],
        1536: [(8, 512, 4, 4), (16, 512, 4, 8), (8, 256, 6, 4)],
        2048: [(8, 512, 4, 4), (8, 512, 8, 4), (16, 512, 4, 8), (4, 1024, 6, 4)],
    }
    gemv_tma[6144] = gemv_tma[7168]
    for name, N, K, gn, nt, res in gemv_shapes if "gemv" in only else []:
        nb = N * K + 4 * (N // gn) * (K // 128) + 2 * nt * K
        c = copies(nb)
        ws = [
            (q(N, K), sc(N // gn, K // 128), torch.randn(max(nt, 1), K, device=DEV).to(torch.bfloat16) * 0.05)
            for _ in range(c)
        ]
        x = torch.randn(1, K, device=DEV).to(torch.bfloat16)
        g = (torch.rand(K, device=DEV) + 0.5).to(torch.bfloat16)
        h = torch.randn(1, N, device=DEV).to(torch.bfloat16)
        tl_ = (lambda t: t) if nt else (lambda t: None)
        for cfg in [None, *gemv_cfgs[K], *(("tma", c) for c in gemv_tma[K])]:
            kw = _launch(cfg)
            w, s, t = ws[0]
            xx = torch.randn(1, K, device=DEV).to(torch.bfloat16)
            if res:  # checked on a zero residual: the output's own rounding, not the residual's, is compared
                h1, h2 = torch.zeros_like(h), torch.zeros_like(h)
                triton_fp8.gemv_fp8(xx, w, s, residual=h1, **kw)
                triton_fp8.gemv_fp8(xx, w, s, residual=h1, **kw)
                ref.gemv_residual(h2, xx, w, h2, s)
                ref.gemv_residual(h2, xx, w, h2, s)
                err = _rel(h1, h2)
                fns = [lambda w=w, s=s, kw=kw: triton_fp8.gemv_fp8(x, w, s, residual=h, **kw) for w, s, _ in ws]
            else:
                got = triton_fp8.gemv_fp8(xx, w, s, norm_w=g, tail=tl_(t), **kw)
                got = triton_fp8.gemv_fp8(xx, w, s, norm_w=g, tail=tl_(t), **kw)
                err = _rel(got, ref.gemv(xx, w, g, 1e-6, None, False, s, tail=tl_(t)))
                fns = [
                    lambda w=w, s=s, t=t, kw=kw: triton_fp8.gemv_fp8(x, w, s, norm_w=g, tail=tl_(t), **kw)
                    for w, s, t in ws
                ]
            bench("gemv", name, _label(cfg, err), fns, nb)
        del ws
        torch.cuda.empty_cache()
    ups = [
        None,
        (8, 1024, 4, 1),
        (8, 1024, 4, 7),
        (8, 1024, 4, 4),
        (8, 512, 4, 7),
        (16, 1024, 8, 7),
        (16, 512, 4, 7),
        (4, 1024, 4, 7),
        (8, 2048, 8, 4),
        (16, 1024, 8, 4),
        (8, 1024, 4, 2),
        (16, 2048, 8, 4),
        (4, 2048, 4, 4),
        *(("tma", c) for c in ((8, 512, 4, 4), (8, 512, 8, 4), (8, 1024, 3, 8), (16, 256, 6, 4), (16, 512, 4, 8))),
    ]
    downs = [
        None,
        (16, 1, 1024, 8, True),
        (32, 1, 256, 4, True),
        (64, 1, 256, 4, True),
        (64, 1, 256, 8, True),
        (128, 1, 256, 8, True),
        (32, 2, 256, 4, True),
        (64, 2, 256, 8, True),
        (16, 16, 256, 8, False),
        (32, 4, 256, 8, True),
        (16, 4, 256, 4, True),
        (128, 2, 256, 8, True),
        (32, 16, 256, 8, False),
    ]
    for name, E, KK, D, I in [("v32r", 64, 9, 7168, 256), ("glm5r", 64, 9, 6144, 256)]:  # noqa: E741
        w13, s13 = q(E, 2 * I, D), sc(E, 2 * I // 128, D // 128)
        w2, s2 = q(E, D, I), sc(E, D // 128, I // 128)
        x = torch.randn(1, D, device=DEV).to(torch.bfloat16)
        g = (torch.rand(D, device=DEV) + 0.5).to(torch.bfloat16)
        sets = [
            (torch.randperm(E, device=DEV)[:KK].int()[None].contiguous(), torch.rand(1, KK, device=DEV))
            for _ in range(7)
        ]
        xr = ref.rms_norm(x, g, 1e-6)
        act0 = triton_fp8.moe_up_fp8(x, sets[0][0], w13, s13, norm_w=g)
        want = ref.moe_experts(xr, sets[0][0], sets[0][1], w13, w2, s13, s2)
        h = torch.zeros(1, D, device=DEV, dtype=torch.bfloat16)
        nb_up, nb_dn = KK * 2 * I * D, KK * I * D
        for cfg in ups if "up" in only else []:
            kw = _launch(cfg)
            a1 = triton_fp8.moe_up_fp8(x, sets[0][0], w13, s13, norm_w=g, **kw)
            a1 = triton_fp8.moe_up_fp8(x, sets[0][0], w13, s13, norm_w=g, **kw)
            err = _rel(triton_fp8.moe_down_fp8(a1, sets[0][0], sets[0][1], w2, s2), want)
            fns = [lambda ids=ids, kw=kw: triton_fp8.moe_up_fp8(x, ids, w13, s13, norm_w=g, **kw) for ids, _ in sets]
            bench("up", name, _label(cfg, err), fns, nb_up)
        for cfg in downs if "down" in only else []:
            triton_fp8.moe_down_fp8(act0, sets[0][0], sets[0][1], w2, s2, cfg=cfg)
            err = _rel(triton_fp8.moe_down_fp8(act0, sets[0][0], sets[0][1], w2, s2, cfg=cfg), want)
            label = f"{cfg or 'default'} e={err:.1e}{' BAD' if not err < 2e-2 else ''}"
            fns = [
                lambda ids=ids, wts=wts, cfg=cfg: triton_fp8.moe_down_fp8(act0, ids, wts, w2, s2, residual=h, cfg=cfg)
                for ids, wts in sets
            ]
            bench("down", name, label, fns, nb_dn)
        w13 = w2 = None
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="a directory (or FILE.json) for the JSON (default: the current result)")
    ap.add_argument("--only", default="gemv,up,down")
    ap.add_argument("--rank", action="store_true", help="the TP8 ranks' shapes (V3.2, GLM-5), each config checked")
    a = ap.parse_args()
    only = a.only.split(",")
    if a.rank:
        rank_shapes(only)
    else:
        if "gemv" in only:
            gemvs()
        if "up" in only or "down" in only:
            moes(only)
    machine = machine_kind(gpus=1)
    print(f"written: {write_json(result_path(machine, 'micro-fp8', '.json', a.out), ROWS, recorded(machine))}")
    best: dict = {}
    for r in ROWS:
        k = (r["kind"], r["shape"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    print("\nbest per (kernel, shape):")
    for (kind, shape), r in best.items():
        o = next((x for x in ROWS if (x["kind"], x["shape"]) == (kind, shape) and x["variant"].startswith("old")), None)
        print(
            f"  {kind:<5} {shape:<26} {r['variant']:<22} {r['us']:8.2f} us {r['tbs']:5.2f} TB/s"
            + (f"   (old {o['us']:.2f} us)" if o else "")
        )


if __name__ == "__main__":
    main()
