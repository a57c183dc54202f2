"""The floor of a decode step built as a chain of kernels (GPU): the time one TP8 rank of full-size V3.2 would
take if every one of its kernels were the simplest possible weight stream.

Each kernel of the chain reads its share of a layer's weight bytes (e4m3 bytes as the rank's kernels read them:
W_a, W_b, MLA prep, attention split and merge, W_o, router, MoE up, MoE down), one contiguous chunk of ``--chunks``
bytes per program, requested in one load; then it waits for its predecessor (programmatic dependent launch, as
the engine's kernels), reads one value the predecessor wrote and writes one of its own (the next kernel's
dependency). 61 layers of them are captured in one CUDA graph, each kernel with weights of its own (no L2 reuse),
and timed as the engine's step is. The plain rows do no arithmetic beyond a byte sum: what that chain takes above its
bytes over the copy bandwidth is the cost of streaming in kernels of these sizes and of the boundaries between
them. The GEMV rows add a GEMV tile's arithmetic and, one at a time, the engine's GEMVs' other reads, so that each
one's cost is measured against that floor.

    python3 benchmarks/chain_floor.py [--out DIR] [--chunks 16384,32768,65536] [--layers 61] [--only groups,...]

Rows (``--only`` picks parts): ``groups``, the layer profile at each chunk size (PDL with the weight requested
before the wait, PDL with it after, no PDL) and the same bytes in 6, 3 and 1 kernels a layer; ``words``, the layer
profile reading int32 words (no byte unpacking) and as torch's own ``torch.sum`` kernels; ``gemv``, the layer
profile doing a split-K GEMV's arithmetic on each program's tile (e4m3 rows of a K tile times bf16 activations, one
partial sum a row written); ``sizes``, chains of pieces of one size (1 ... 33 MB, as bytes and as GEMV tiles): what
a kernel of that size streams at; ``looped``, the layer profile as grids of a few programs an SM looping with two
chunks in flight; ``whole``, the step's bytes in one launch (bytes, words, ``torch.sum``): what one streaming kernel
reaches with no boundaries; ``persistent``, the whole chain as one persistent launch (one or two programs an SM, a
grid barrier between the phases, each phase's first chunk requested before the barrier); ``boundaries``, the
boundaries alone (a chain of the engine's number of kernels reading no weights). Writes
``benchmarks/results/<machine>-chain-floor.json`` (``h100-chain-floor``, ``h200-chain-floor``), starting with
``results_header``'s ``"recorded"``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402

# One layer of one TP8 rank of full-size V3.2, block-FP8 (MB per kernel, in chain order; weights and scales, the
# attention's cache rows at 1K and W_UV): the kernels the engine runs a layer.
RANK_LAYER_MB = {
    "W_a": 16.9,
    "W_b": 4.8,
    "mla_prep": 1.0,
    "attn_split": 1.2,
    "attn_merge": 1.0,
    "W_o": 14.7,
    "router": 3.7,
    "moe_up": 33.0,
    "moe_down": 16.5,
}
# The same bytes in fewer, larger kernels a layer (adjacent kernels' weights merged): what each boundary costs.
GROUPINGS = {
    "9 a layer (the engine)": [[k] for k in RANK_LAYER_MB],
    "6 a layer": [
        ["W_a"],
        ["W_b", "mla_prep"],
        ["attn_split", "attn_merge"],
        ["W_o"],
        ["router", "moe_up"],
        ["moe_down"],
    ],
    "3 a layer": [["W_a", "W_b", "mla_prep"], ["attn_split", "attn_merge", "W_o"], ["router", "moe_up", "moe_down"]],
    "1 a layer": [list(RANK_LAYER_MB)],
}
XN = 128  # values of the predecessor's output each kernel reads (one per program, modulo)


try:  # the GPU's kernels (the CI's environment has no Triton: --help still runs there)
    import triton
    import triton.language as tl

    from tilert.engines.tilert.ops import triton_pdl
    from tilert.engines.tilert.ops.triton_pdl import pdl_begin
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _stream(
        w_ptr,
        x_ptr,
        y_ptr,
        nbytes,
        CH: tl.constexpr,
        NX: tl.constexpr,
        PRE: tl.constexpr,
        XOR: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # XOR: the chunk folded by xor (int32 words: one instruction an element, no overflow) rather than summed
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * CH + tl.arange(0, CH)
        if PRE:
            w = tl.load(w_ptr + offs, mask=offs < nbytes, other=0)
            pdl_begin(PDL)
        else:
            pdl_begin(PDL)
            w = tl.load(w_ptr + offs, mask=offs < nbytes, other=0)
        x = tl.load(x_ptr + pid % NX)
        if XOR:
            v = tl.xor_sum(w, 0)
        else:
            v = tl.sum(w.to(tl.int32), 0)
        tl.store(y_ptr + pid, v.to(tl.float32) + x)

    @triton.jit
    def _gemv_tile(
        w, x_ptr, g_ptr, s, rstd, k0, R: tl.constexpr, KT: tl.constexpr, SCALE: tl.constexpr, NORM: tl.constexpr
    ):
        x = tl.load(x_ptr + k0 + tl.arange(0, KT)).to(tl.float32)
        if NORM:
            g = tl.load(g_ptr + k0 + tl.arange(0, KT)).to(tl.float32)
            x = (x * rstd * g).to(tl.bfloat16).to(tl.float32)
        p = w.to(tl.float32) * x[None, :]
        if SCALE:
            return tl.sum(tl.sum(tl.reshape(p, [R, KT // 128, 128]), 2) * s, 1)
        else:
            return tl.sum(p, 1)

    @triton.jit
    def _stream_gemv(
        w_ptr,
        x_ptr,
        s_ptr,
        g_ptr,
        y_ptr,
        nbytes,
        R: tl.constexpr,
        KT: tl.constexpr,
        SCALE: tl.constexpr,
        NORM: tl.constexpr,
        RSTD: tl.constexpr,
        KX: tl.constexpr,
        LOOP: tl.constexpr,
        ROWK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # A split-K GEMV's work on LOOP consecutive [R, KT] e4m3 tiles (the first requested before the PDL wait,
        # each later one after the previous one's arithmetic), times bf16 activations (the predecessor's output),
        # R fp32 partial sums written. SCALE: per-row scales of each 128-column group (a static buffer); NORM: the
        # activations times the RMSNorm's weight and rstd, rounded to bf16; RSTD > 0: rstd from KX activations read
        # RSTD at a time after the wait. ROWK 0: a program's tiles are one contiguous block (a layout packed by
        # tile); ROWK > 0: the bytes are a row-major matrix of ROWK columns, a tile R rows of KT at that stride.
        pid = tl.program_id(0)
        if ROWK > 0:
            KB: tl.constexpr = ROWK // (KT * LOOP)  # programs along a row block
            tile = tl.arange(0, R)[:, None] * ROWK + tl.arange(0, KT)[None, :]
            base = (pid // KB).to(tl.int64) * (R * ROWK) + (pid % KB) * (KT * LOOP)
            step = KT
        else:
            tile = tl.arange(0, R)[:, None] * KT + tl.arange(0, KT)[None, :]
            base = pid.to(tl.int64) * (R * KT * LOOP)
            step = R * KT
        w = tl.load(w_ptr + base + tile, mask=base + tile < nbytes, other=0.0)
        s = 1.0
        if SCALE:
            s = tl.load(s_ptr + tl.arange(0, R)[:, None] * (KT // 128) + tl.arange(0, KT // 128)[None, :])
        pdl_begin(PDL)
        rstd = 1.0
        if RSTD > 0:
            ss = tl.zeros([RSTD], dtype=tl.float32)
            for k0 in range(0, KX, RSTD):
                v = tl.load(x_ptr + k0 + tl.arange(0, RSTD)).to(tl.float32)
                ss += v * v
            rstd = tl.rsqrt(tl.sum(ss, 0) / KX + 1e-6)
        acc = _gemv_tile(w, x_ptr, g_ptr, s, rstd, 0, R, KT, SCALE, NORM)
        for j in range(1, LOOP):
            off = base + j * step
            w = tl.load(w_ptr + off + tile, mask=off + tile < nbytes, other=0.0)
            acc += _gemv_tile(w, x_ptr, g_ptr, s, rstd, j * KT, R, KT, SCALE, NORM)
        tl.store(y_ptr + pid * R + tl.arange(0, R), acc)

    @triton.jit
    def _stream_loop(w_ptr, x_ptr, y_ptr, nbytes, CH: tl.constexpr, NX: tl.constexpr, PDL: tl.constexpr):
        # A grid of a few programs an SM, each looping over chunks pid, pid + G, ... two chunks a step (two loads
        # in flight), its first two requested before the PDL wait.
        pid = tl.program_id(0)
        step = tl.num_programs(0).to(tl.int64) * CH
        offs = tl.arange(0, CH)
        p = pid.to(tl.int64) * CH
        wa = tl.load(w_ptr + p + offs, mask=p + offs < nbytes, other=0)
        wb = tl.load(w_ptr + p + step + offs, mask=p + step + offs < nbytes, other=0)
        pdl_begin(PDL)
        acc = tl.sum(wa.to(tl.int32), 0) + tl.sum(wb.to(tl.int32), 0)
        for c in range(p + 2 * step, nbytes, 2 * step):
            wa = tl.load(w_ptr + c + offs, mask=c + offs < nbytes, other=0)
            wb = tl.load(w_ptr + c + step + offs, mask=c + step + offs < nbytes, other=0)
            acc += tl.sum(wa.to(tl.int32), 0) + tl.sum(wb.to(tl.int32), 0)
        x = tl.load(x_ptr + pid % NX)
        tl.store(y_ptr + pid, acc.to(tl.float32) + x)

    @triton.jit
    def _persistent(w_ptr, seg_ptr, n_phases, x_ptr, cnt_ptr, G: tl.constexpr, CH: tl.constexpr, SPIN: tl.constexpr):
        # The whole step in one launch of G resident programs: phase ph streams bytes seg[ph]..seg[ph + 1] (chunk
        # pid, pid + G, ...), writes one value, and waits at a grid barrier (one counter, counting arrivals) before
        # reading another program's value of that phase. The next phase's first chunk is requested before the
        # barrier (static bytes). SPIN bounds every wait: a grid that is not all resident ends (each wait that gave
        # up counted in cnt[1]), wrong, not hung.
        pid = tl.program_id(0)
        offs = tl.arange(0, CH)
        # the bounds are 16-byte multiples (piece_bytes): said, so that the masked loads stay vectorised
        lo = tl.multiple_of(tl.load(seg_ptr), 16)
        hi = tl.multiple_of(tl.load(seg_ptr + 1), 16)
        p0 = lo + pid * CH
        w = tl.load(w_ptr + p0 + offs, mask=p0 + offs < hi, other=0)
        xp = 0.0
        for ph in range(0, n_phases):
            lo = tl.multiple_of(tl.load(seg_ptr + ph), 16)
            hi = tl.multiple_of(tl.load(seg_ptr + ph + 1), 16)
            acc = tl.sum(w.to(tl.int32), 0)
            for c in range(lo + (pid + G) * CH, hi, G * CH):
                v = tl.load(w_ptr + c + offs, mask=c + offs < hi, other=0)
                acc += tl.sum(v.to(tl.int32), 0)
            nhi = tl.multiple_of(tl.load(seg_ptr + ph + 2), 16)
            pn = hi + pid * CH
            w = tl.load(w_ptr + pn + offs, mask=pn + offs < nhi, other=0)
            tl.store(x_ptr + (ph % 2) * G + pid, acc.to(tl.float32) + xp)
            tl.debug_barrier()
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            target = (ph + 1) * G
            seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            it = 0
            while (seen < target) & (it < SPIN):
                seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
                it += 1
            if seen < target:
                tl.atomic_add(cnt_ptr + 1, 1, sem="relaxed", scope="gpu")
            xp = tl.load(x_ptr + (ph % 2) * G + (pid + 1) % G, cache_modifier=".cg")


def persistent_step(w: torch.Tensor, seg: torch.Tensor, x: torch.Tensor, cnt: torch.Tensor, g: int, chunk: int) -> None:
    """The whole chain as one persistent launch of ``g`` programs (``seg``: int64 phase bounds, multiples of 16, two
    past the last phase: ``seg[-1] == seg[-2]``); ``cnt`` (int32 ``[2]``: arrivals, waits given up) zeroed first."""
    cnt.zero_()
    warps = max(1, min(8, chunk // 4096))
    _persistent[(g,)](w, seg, seg.numel() - 2, x, cnt, G=g, CH=chunk, SPIN=1 << 16, num_warps=warps)


KX = 8192  # activations a GEMV row (bf16; a K tile's activations are read from its start)


class GemvParts(NamedTuple):
    """A GEMV tile's reads beyond its weights and activations, each on or off (the ``gemv`` rows add them one at a
    time, so that each one's cost is measured)."""

    kt: int  # K tile: bf16 activations a tile
    scale: bool = False  # per-row scales, one a 128-column group, applied to the group sums
    norm: bool = False  # the RMSNorm's weight times the activations and rstd, rounded to bf16
    rstd: int = 0  # the RMSNorm's statistics over KX activations read this many at a time (0: none)
    loop: int = 1  # K tiles a program, each requested after the previous one's arithmetic
    rowk: int = 0  # 0: a program's tiles contiguous (packed by tile); else a row-major matrix of this many columns


_STATICS: dict = {}


def statics(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV rows' scales ``[64, 16]`` (fp32) and RMSNorm weight ``[KX]`` (bf16): static, shared by every
    kernel (made before any capture: ``time_chain`` asks first)."""
    if dev not in _STATICS:
        gen = torch.Generator(device=dev).manual_seed(0)
        s = torch.rand(64, 16, device=dev, generator=gen) * 0.01 + 0.005
        g = (torch.rand(KX, device=dev, generator=gen) + 0.5).to(torch.bfloat16)
        _STATICS[dev] = (s, g)
    return _STATICS[dev]


def kw_pdl(pdl: bool) -> dict:
    return triton_pdl.kw() if pdl else {"PDL": False, "launch_pdl": False}


def launch(
    w: torch.Tensor,
    x: torch.Tensor,
    y: torch.Tensor,
    chunk: int,
    pre: bool,
    pdl: bool,
    loop: int = 0,
    words: bool = False,
    gemv: GemvParts | None = None,
) -> None:
    """One kernel of the chain: ``y[p] = sum(w's chunk p) + x[p % XN]``; ``loop`` > 0: at most ``loop`` programs,
    each summing every ``loop``-th chunk from its own (``y[p]``: the sum of those). ``chunk`` counts bytes;
    ``words``: the bytes read as int32 words and folded by xor (a quarter of the elements, no byte unpacking);
    ``gemv``: each program's chunk as e4m3 rows of a ``gemv.kt``-wide K tile times that many bf16 activations (``x``'s
    bytes), one fp32 partial sum a row written (a split-K GEMV's arithmetic), with the engine's GEMVs' other reads
    that ``gemv`` turns on (a program then covers ``gemv.loop`` chunks)."""
    warps = max(1, min(8, chunk // 4096))
    if gemv is not None:
        p = gemv
        n = w.numel()
        s, g = statics(w.device)
        if p.rowk:
            assert p.rowk % (p.kt * p.loop) == 0, p
            progs = triton.cdiv(n, chunk // p.kt * p.rowk) * (p.rowk // (p.kt * p.loop))
        else:
            progs = max(1, triton.cdiv(n, chunk * p.loop))
        _stream_gemv[(progs,)](
            w.view(torch.float8_e4m3fn),
            x.view(torch.bfloat16),
            s,
            g,
            y,
            n,
            R=chunk // p.kt,
            KT=p.kt,
            SCALE=p.scale,
            NORM=p.norm,
            RSTD=p.rstd,
            KX=KX,
            LOOP=p.loop,
            ROWK=p.rowk,
            num_warps=warps,
            **kw_pdl(pdl),
        )
        return
    if words:
        w, chunk = w.view(torch.int32), chunk // 4
    n = w.numel()
    kw = kw_pdl(pdl)
    progs = max(1, triton.cdiv(n, chunk))
    if loop:
        _stream_loop[(min(progs, loop),)](w, x, y, n, CH=chunk, NX=XN, num_warps=warps, **kw)
    else:
        _stream[(progs,)](w, x, y, n, CH=chunk, NX=XN, PRE=pre, XOR=words, num_warps=warps, **kw)


def piece_bytes(mb: float) -> int:
    """The bytes of a piece of ``mb`` MB, a multiple of 16: the kernels' masks are then constant over 16-byte groups
    and their loads vectorised (a piece of any other size makes Triton load it byte by byte), and a piece reads as
    int32 words too."""
    return max(16, int(mb * (1 << 20)) // 16 * 16)


def build_chain(layers: int, mbs: list[float], dev: torch.device) -> list[torch.Tensor]:
    """One weight buffer per kernel of the chain (random bytes, so no page is shared or compressed), each of
    ``piece_bytes``."""
    return [
        torch.randint(0, 256, (piece_bytes(mb),), dtype=torch.uint8, device=dev) for _ in range(layers) for mb in mbs
    ]


def time_chain(
    weights,
    chunk: int,
    pre: bool,
    pdl: bool,
    dev: torch.device,
    loop: int = 0,
    words: bool = False,
    gemv: GemvParts | None = None,
) -> float:
    """Seconds per run of the whole chain, captured in a graph (``micro.graph_time``)."""
    from micro import graph_time

    statics(dev)
    progs = max(w.numel() for w in weights) // max(chunk, 1) + 2
    rows = chunk // gemv.kt if gemv is not None else 1  # values a program writes
    bufs = [torch.zeros(max(progs * rows, XN, KX), device=dev) for _ in range(2)]

    def chain() -> None:
        for k, w in enumerate(weights):
            launch(w, bufs[k % 2], bufs[(k + 1) % 2], chunk, pre, pdl, loop, words, gemv)

    return graph_time([chain])


def time_torch_sums(weights, dev: torch.device) -> float:
    """Seconds per chain of torch's own reductions (``torch.sum`` of each buffer as int32 words): the library's
    streaming kernel at the same sizes, for comparison."""
    from micro import graph_time

    outs = [torch.zeros((), dtype=torch.int64, device=dev) for _ in weights]
    words = [w.view(torch.int32) for w in weights]

    def chain() -> None:
        for w, o in zip(words, outs, strict=True):
            torch.sum(w, dim=0, dtype=torch.int64, out=o)

    return graph_time([chain])


def check(dev: torch.device) -> None:
    """One kernel against torch: each program's byte sum plus the predecessor's value it reads."""
    w = torch.randint(0, 256, (100_000,), dtype=torch.uint8, device=dev)
    x = torch.randn(XN, device=dev)
    for chunk in (16384, 65536):
        y = torch.zeros(8, device=dev)
        launch(w, x, y, chunk, True, True)
        progs = -(-w.numel() // chunk)
        want = torch.stack([w[p * chunk : (p + 1) * chunk].long().sum().float() + x[p % XN] for p in range(progs)])
        assert torch.allclose(y[:progs], want), (chunk, y[:progs], want)
    y = torch.zeros(8, device=dev)
    launch(w[:99_984], x, y, 16384, True, True, words=True)
    iw = w[:99_984].view(torch.int32)
    xors = [np.bitwise_xor.reduce(iw[p * 4096 : (p + 1) * 4096].numpy(force=True)) for p in range(7)]
    want = torch.tensor(xors, dtype=torch.int32, device=dev).float() + x[:7]
    assert torch.allclose(y[:7], want), (y[:7], want)
    xb = torch.randn(1024, device=dev, dtype=torch.bfloat16)  # x's bytes: the GEMV tile's activations
    y = torch.zeros(7 * 16, device=dev)
    wf = w[:99_984] & 0x77  # no NaN patterns (0x7F, 0xFF)
    launch(wf, xb.view(torch.float32), y, 16384, True, True, gemv=GemvParts(1024))
    e = wf.view(torch.float8_e4m3fn).float()
    e = torch.cat([e, e.new_zeros(7 * 16384 - e.numel())]).view(7 * 16, 1024)
    want = e @ xb.float()
    assert torch.allclose(y, want, rtol=1e-3, atol=1e-2), (y, want)
    xk = torch.randn(KX, device=dev, dtype=torch.bfloat16)
    for parts in (
        GemvParts(512, True, True, 2048, 2),
        GemvParts(256, True, False, 0, 3),
        GemvParts(1024, False, True),
        GemvParts(512, True, False, 0, 2, rowk=3072),
        GemvParts(256, False, False, 0, 1, rowk=768),
    ):
        y = torch.zeros(64 * 16, device=dev)
        launch(wf[:65_536], xk.view(torch.float32), y, 8192, True, True, gemv=parts)
        want = gemv_parts_ref(wf[:65_536], xk, 8192, parts)
        err = ((y[: want.numel()] - want).norm() / want.norm()).item()  # bf16 rounding of the normed x: loose
        assert err < 1e-2, (parts, err)
    chunk, loop = 4096, 3  # 25 chunks over 3 programs: program p sums chunks p, p + 3, ...
    y = torch.zeros(8, device=dev)
    launch(w, x, y, chunk, True, True, loop)
    parts = w.long().split(chunk)
    want = torch.stack([sum(c.sum() for c in parts[p::loop]).float() + x[p] for p in range(loop)])
    assert torch.allclose(y[:loop], want), (y[:loop], want)


def gemv_parts_ref(w: torch.Tensor, x: torch.Tensor, chunk: int, p: GemvParts) -> torch.Tensor:
    """What ``_stream_gemv`` writes for bytes ``w``, activations ``x`` (bf16, KX of them) and ``chunk`` bytes a tile."""
    s, g = statics(w.device)
    rows, span = chunk // p.kt, chunk * p.loop
    e = w.view(torch.float8_e4m3fn).float()
    if p.rowk:  # [row blocks, rows, K] -> [row blocks, programs along K, rows, loop, kt] -> program order
        blocks = -(-w.numel() // (rows * p.rowk))
        e = torch.cat([e, e.new_zeros(blocks * rows * p.rowk - e.numel())])
        e = (
            e.view(blocks, rows, p.rowk // (p.kt * p.loop), p.loop, p.kt)
            .permute(0, 2, 3, 1, 4)
            .reshape(-1, p.loop, rows, p.kt)
        )
    else:
        progs = -(-w.numel() // span)
        e = torch.cat([e, e.new_zeros(progs * span - e.numel())]).view(progs, p.loop, rows, p.kt)
    progs = e.shape[0]
    rstd = torch.rsqrt(x[:KX].float().square().mean() + 1e-6) if p.rstd else torch.tensor(1.0, device=w.device)
    sc = s.flatten()[: rows * (p.kt // 128)].view(rows, p.kt // 128)
    out = torch.zeros(progs, rows, device=w.device)
    for j in range(p.loop):
        xx = x[j * p.kt : (j + 1) * p.kt].float()
        if p.norm:
            xx = (xx * rstd * g[j * p.kt : (j + 1) * p.kt].float()).bfloat16().float()
        prod = e[:, j] * xx
        out += (prod.view(progs, rows, -1, 128).sum(-1) * sc).sum(-1) if p.scale else prod.sum(-1)
    return out.flatten()


def check_persistent(dev: torch.device) -> None:
    """One program through three phases: its last value is the sum of every byte (each phase adds its own)."""
    w = torch.randint(0, 256, (50_000,), dtype=torch.uint8, device=dev)
    seg = torch.tensor([0, 10_000, 10_016, 50_000, 50_000], dtype=torch.int64, device=dev)
    x = torch.zeros(2, device=dev)
    cnt = torch.zeros(2, dtype=torch.int32, device=dev)
    persistent_step(w, seg, x, cnt, 1, 16384)
    assert x[0].item() == float(w.long().sum().item()), (x, w.long().sum())
    assert cnt.tolist() == [3, 0], cnt


def time_persistent(weights: torch.Tensor, seg: torch.Tensor, g: int, chunk: int, dev: torch.device) -> float:
    """Seconds per one-launch step, captured in a graph (``micro.graph_time``); raises when its barriers did not
    hold."""
    from micro import graph_time

    x = torch.zeros(2 * g, device=dev)
    cnt = torch.zeros(2, dtype=torch.int32, device=dev)
    persistent_step(weights, seg, x, cnt, g, chunk)
    torch.cuda.synchronize()
    if cnt[1].item():
        raise RuntimeError(f"{cnt[1].item()} barrier waits gave up: the grid of {g} was not all resident")
    return graph_time([lambda: persistent_step(weights, seg, x, cnt, g, chunk)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="a directory (or FILE.json) for the JSON (default: the current result)")
    ap.add_argument("--chunks", default="16384,32768,65536", help="bytes a program reads (powers of two)")
    ap.add_argument("--layers", type=int, default=61)
    parts = ("groups", "words", "gemv", "parts", "layout", "sizes", "looped", "whole", "persistent", "boundaries")
    ap.add_argument("--only", default=",".join(parts), help=f"which rows, of: {','.join(parts)}")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if only - set(parts):
        ap.error(f"--only: unknown {sorted(only - set(parts))}; known: {','.join(parts)}")
    dev = torch.device("cuda")
    from decode_speed import copy_bandwidth

    check(dev)
    check_persistent(dev)
    bw = copy_bandwidth()
    mbs = list(RANK_LAYER_MB.values())
    total = a.layers * sum(mbs) * (1 << 20)
    ideal = total / bw
    name = torch.cuda.get_device_name()
    print(f"GPU {name}  copy bandwidth {bw / 1e12:.2f} TB/s  {a.layers} layers", flush=True)
    print(f"bytes {total / 1e9:.3f} GB a step: {ideal * 1e3:.3f} ms at the copy bandwidth", flush=True)
    rows = []

    def row(label: str, kernels: int, nbytes: float, chunk: int, pre: bool, pdl: bool, t: float) -> None:
        r = dict(
            chain=label,
            kernels=kernels,
            gb=round(nbytes / 1e9, 4),
            chunk=chunk,
            weights_before_wait=pre,
            pdl=pdl,
            ms_per_step=round(t * 1e3, 4),
            us_per_kernel=round(t * 1e6 / kernels, 3),
            tb_s=round(nbytes / t / 1e12, 3),
            pct_copy_bw=round(100 * nbytes / t / bw, 1),
        )
        rows.append(r)
        print(
            f"{label:<24} {kernels:>5} kernels  chunk {chunk:>6}  pre {pre!s:<5}  pdl {pdl!s:<5}  "
            f"{r['ms_per_step']:8.3f} ms  {r['us_per_kernel']:7.2f} us/kernel  {r['tb_s']:5.2f} TB/s  "
            f"{r['pct_copy_bw']:5.1f}% of copy",
            flush=True,
        )

    def timed(label: str, weights: list[torch.Tensor], nbytes: float, chunk: int = 16384, **kw: object) -> None:
        """A row of ``weights``' chain, each kernel's weight requested before its PDL wait."""
        row(label, len(weights), nbytes, chunk, True, True, time_chain(weights, chunk, True, True, dev, **kw))

    chunks = [int(c) for c in a.chunks.split(",")]
    for label, groups in GROUPINGS.items() if "groups" in only else ():
        mb = [sum(RANK_LAYER_MB[k] for k in g) for g in groups]
        weights = build_chain(a.layers, mb, dev)
        modes = ((True, True), (False, True), (False, False)) if len(groups) == len(RANK_LAYER_MB) else ((True, True),)
        for chunk in chunks:
            for pre, pdl in modes:
                row(label, len(weights), total, chunk, pre, pdl, time_chain(weights, chunk, pre, pdl, dev))
        del weights
        torch.cuda.empty_cache()
    # the layer profile's chain, for the parts that time it
    weights = build_chain(a.layers, mbs, dev) if only & {"words", "gemv", "parts", "looped"} else []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if "words" in only:  # the engine's 9 kernels a layer reading int32 words (no byte unpacking), and torch's sums
        for chunk in chunks:
            timed("9 a layer, int32 words", weights, total, chunk, words=True)
        row("9 a layer, torch.sum", len(weights), total, 0, False, False, time_torch_sums(weights, dev))
    if "gemv" in only:  # the 9 kernels doing a split-K GEMV's arithmetic on their tiles (K tile of 512 ... 2048)
        for chunk in (8192, 16384, 32768):
            for kt in (512, 1024, 2048):
                timed(f"9 a layer, GEMV tiles {kt}", weights, total, chunk, gemv=GemvParts(kt))
    # 16 MB pieces (W_a's size), for the parts and layout rows
    mb16 = build_chain(32, [16.0] * 8, dev) if only & {"parts", "layout"} else []
    mb16_bytes = sum(w.numel() for w in mb16)
    if "parts" in only:  # the GEMV tile with the engine's other reads added one at a time, then together
        variants = {
            "GEMV 512": GemvParts(512),
            "+ scales": GemvParts(512, scale=True),
            "+ norm weight": GemvParts(512, norm=True),
            "+ rstd, 2048 a read": GemvParts(512, rstd=2048),
            "+ rstd, 8192 a read": GemvParts(512, rstd=8192),
            "+ 2 tiles a program": GemvParts(512, loop=2),
            "all, rstd 2048": GemvParts(512, True, True, 2048, 2),
            "all, rstd 8192": GemvParts(512, True, True, 8192, 2),
            "all, rstd 8192, 1 tile": GemvParts(512, True, True, 8192, 1),
        }
        for label, parts in variants.items():
            timed(f"9 a layer, {label}", weights, total, gemv=parts)
        for label in ("GEMV 512", "+ rstd, 2048 a read", "all, rstd 2048", "all, rstd 8192", "all, rstd 8192, 1 tile"):
            timed(f"16 MB pieces, {label}", mb16, mb16_bytes, gemv=variants[label])
    if "layout" in only:  # 16 MB pieces as row-major [rows, K] matrices against the same tiles packed contiguous
        for label, parts, k in (
            ("32 x 512", GemvParts(512), 7168),
            ("32 x 512, all reads", GemvParts(512, True, True, 8192), 7168),
            ("16 x 1024", GemvParts(1024), 7168),
            ("64 x 256", GemvParts(256), 7168),
            ("4 x 4096", GemvParts(4096), 8192),
            ("4 x 4096, 2 a program, all reads", GemvParts(4096, True, True, 2048, 2), 8192),
        ):
            for rowk in (0, k):
                name = f"16 MB, {label}, " + (f"rows of {k}" if rowk else "packed")
                timed(name, mb16, mb16_bytes, gemv=parts._replace(rowk=rowk))
    del mb16
    if "sizes" in only:  # chains of one piece size: what one kernel of that size streams at (the engine's GEMVs)
        for mb in (1.0, 4.0, 8.0, 16.0, 33.0):
            same = build_chain(max(64, int(4096 / mb)) // 8, [mb] * 8, dev)
            nb = sum(w.numel() for w in same)
            for gemv in (None, GemvParts(1024)):
                timed(f"{mb:g} MB pieces" + (", GEMV tiles" if gemv else ""), same, nb, gemv=gemv)
            del same
            torch.cuda.empty_cache()
    if "looped" in only:  # the 9 kernels as grids of a few programs an SM, each looping with two chunks in flight
        for per_sm in (2, 4, 8):
            for chunk in (8192, 16384):
                timed(f"looped, {per_sm}/SM", weights, total, chunk, loop=sms * per_sm)
    del weights
    torch.cuda.empty_cache()
    if only & {"whole", "persistent"}:  # the step's bytes in one buffer, the pieces' bounds in it
        sizes = [piece_bytes(mb) for _ in range(a.layers) for mb in RANK_LAYER_MB.values()]
        bounds = [0, *itertools.accumulate(sizes)]
        seg = torch.tensor([*bounds, bounds[-1]], dtype=torch.int64, device=dev)
        flat = torch.randint(0, 256, (bounds[-1],), dtype=torch.uint8, device=dev)
        if "whole" in only:  # the step's bytes in one launch: what a single streaming kernel reaches, no boundaries
            for chunk in chunks:
                for words in (False, True):
                    timed("one launch" + (", int32 words" if words else ""), [flat], flat.numel(), chunk, words=words)
            row("one launch, torch.sum", 1, flat.numel(), 0, False, False, time_torch_sums([flat], dev))
            if "gemv" in only:
                for kt in (512, 1024):
                    timed(f"one launch, GEMV tiles {kt}", [flat], flat.numel(), gemv=GemvParts(kt))
        for per_sm in (1, 2) if "persistent" in only else ():
            for chunk in chunks:
                try:
                    t = time_persistent(flat, seg, sms * per_sm, chunk, dev)
                except RuntimeError as exc:  # two programs an SM may not fit: say so, keep the other rows
                    print(f"persistent, {per_sm}/SM, chunk {chunk}: {exc}", flush=True)
                    continue
                row(f"persistent, {per_sm}/SM", len(sizes), total, chunk, True, False, t)
        del flat
        torch.cuda.empty_cache()
    n_k = a.layers * len(RANK_LAYER_MB)
    for progs in (132, 528) if "boundaries" in only else ():
        empty = [torch.empty(progs * 16, dtype=torch.uint8, device=dev) for _ in range(n_k)]
        timed(f"boundaries, {progs} progs", empty, 0.0, 16)
    machine = machine_kind()
    out = dict(
        gpu=name,
        copy_bw_tb_s=round(bw / 1e12, 3),
        layers=a.layers,
        layer_mb=RANK_LAYER_MB,
        ideal_ms=round(ideal * 1e3, 4),
        rows=rows,
    )
    path = write_json(result_path(machine, "chain-floor", ".json", a.out), out, recorded(machine))
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
