"""The CPU engine's native kernels (``ops/native/rows.c``): built here with the machine's compiler, each kernel
agrees with the reference math, and gives every row exactly the bits it gets alone, whatever its company and its
place among the rows (the property a decode step over several sequences rests on). Shapes are chosen off the
kernels' blocks (8 lanes, 8 outputs, 8 cache rows) so the tails are exercised."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tilert.engines.tilert.ops import native, reference

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the CPU engine uses ATen only")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kernels() -> native.Kernels:
    nk = native.kernels()
    assert nk is not None, "a C compiler is present but the native kernels did not build (see the warning log)"
    return nk


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=3e-5, atol=3e-5)


def _each_row_alone(rows: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor], n: int) -> None:
    """``run`` over ``n`` rows gives row ``i`` what ``run`` of row ``i`` alone gives, and what it gives with the
    rows reversed (another place, other neighbours)."""
    out = run(rows[:n])
    rev = run(rows[:n].flip(0))
    for i in range(n):
        alone = run(rows[i : i + 1])[0]
        assert torch.equal(out[i], alone), (n, i)
        assert torch.equal(rev[n - 1 - i], alone), (n, i)


def test_linear_products_match_reference_and_every_row_alone() -> None:
    nk = _kernels()
    g = _gen(0)
    for n_out, k in ((1, 13), (7, 64), (8, 100), (17, 256), (33, 8)):
        w = torch.randn(n_out, k, generator=g)
        x = torch.randn(5, k, generator=g)
        _close(nk.linear(x, w), x @ w.t())
        for n in range(1, 6):
            _each_row_alone(x, lambda rows, w=w: nk.linear(rows, w), n)
    # grouped, strided: per head W_UV rows inside kv_b (mla_uv), x a transposed view
    h, lat, p, v = 3, 24, 5, 7
    kv_b = torch.randn(h * (p + v), lat, generator=g)
    o_lat = torch.randn(4, h, lat, generator=g)
    got = nk.linear(o_lat.transpose(0, 1), kv_b.view(h, -1, lat)[:, p:]).transpose(0, 1).reshape(4, -1)
    _close(got, reference.mla_uv(o_lat, kv_b, p))
    # x @ W with W's rows contiguous (q_abs), grouped by head
    w_kn = torch.randn(h, 11, 37, generator=g)
    xq = torch.randn(h, 4, 11, generator=g)
    _close(nk.linear_kn(xq, w_kn), torch.bmm(xq, w_kn))
    for n in range(1, 5):
        _each_row_alone(xq.transpose(0, 1), lambda rows: nk.linear_kn(rows.transpose(0, 1), w_kn).transpose(0, 1), n)


def test_rms_norm_matches_reference_and_every_row_alone() -> None:
    nk = _kernels()
    g = _gen(1)
    for d in (7, 256, 100):
        x, w = torch.randn(5, d, generator=g), torch.rand(d, generator=g) + 0.5
        _close(nk.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
        for n in range(1, 6):
            _each_row_alone(x, lambda rows, w=w: nk.rms_norm(rows, w, 1e-6), n)


def test_attention_over_each_querys_own_rows() -> None:
    """Each query over its own rows ``lo..hi-1`` (lengths across the 8-row block, a new maximum late in the rows:
    the online softmax's rescale) equals the reference's masked softmax, and does not depend on the others.
    A latent width of 40: the output's 32-float register slices and the scalar tail after them."""
    nk = _kernels()
    g = _gen(2)
    H, lat, r, S = 3, 40, 4, 40
    kv = torch.randn(S, lat + r, generator=g)
    kv[33] *= 6.0  # a row with large scores after the first blocks
    q = torch.randn(5, H, lat + r, generator=g)
    lo = torch.tensor([0, 3, 8, 30, 12])
    pos = torch.tensor([0, 10, 16, 39, 35])

    def attend(rows: slice) -> torch.Tensor:
        out = nk.mla_attend(q[rows], kv, pos[rows], lo[rows], 0.3, lat)
        assert out is not None
        return out

    got = attend(slice(0, 5))
    for i in range(5):
        want = reference.mla_attention(q[i : i + 1], kv, pos[i : i + 1], 0.3, lat, lo[i : i + 1])
        _close(got[i : i + 1], want)
    for n in range(1, 6):
        out = attend(slice(0, n))
        for i in range(n):
            assert torch.equal(out[i], attend(slice(i, i + 1))[0]), (n, i)
    # one start for every query, or none (row 0); a start beyond a position: no rows, the caller's case
    _close(
        nk.mla_attend(q[1:], kv, pos[1:], lo[1:2], 0.3, lat),  # type: ignore[arg-type]
        reference.mla_attention(q[1:], kv, pos[1:], 0.3, lat, lo[1:2]),
    )
    _close(nk.mla_attend(q, kv, pos, None, 0.3, lat), reference.mla_attention(q, kv, pos, 0.3, lat))  # type: ignore[arg-type]
    assert nk.mla_attend(q[:1], kv, pos[:1], torch.tensor([5]), 0.3, lat) is None


def test_mla_prep_matches_reference_and_every_row_alone() -> None:
    """Dense MLA's preparation: the query (absorbed, RoPE'd) and the cache rows it writes equal the reference's;
    each token's bits do not depend on the others; a row outside the cache is refused before any write."""
    nk = _kernels()
    g = _gen(5)
    h, p, v, r, lat, ql, S = 3, 8, 6, 4, 16, 5, 30
    a = torch.randn(5, ql + lat + r + 3, generator=g)  # + 3: columns the kernel must not read as its own
    b = torch.randn(5, h * (p + r) + 2, generator=g)
    kv_b, cos, sin = torch.randn(h * (p + v), lat, generator=g), torch.randn(S, r // 2), torch.randn(S, r // 2)
    kvn = torch.rand(lat, generator=g) + 0.5
    rows = torch.tensor([4, 9, 0, 29, 17])
    c1, c2 = torch.zeros(S, lat + r), torch.zeros(S, lat + r)
    got = nk.mla_prep(a, b, rows, kv_b, cos, sin, kvn, c1, h, p, ql, 1e-6)
    want = reference.mla_prep(a, b, rows, kv_b, cos, sin, kvn, c2, None, None, None, h, p, ql, 0, 1e-6, 1.0)[0]
    _close(got, want)
    _close(c1, c2)

    def prep(i: torch.Tensor) -> torch.Tensor:  # the tokens i, into a fresh cache
        return nk.mla_prep(a[i], b[i], rows[i], kv_b, cos, sin, kvn, torch.zeros(S, lat + r), h, p, ql, 1e-6)

    for n in range(1, 6):
        _each_row_alone(torch.arange(5), prep, n)
    with pytest.raises(IndexError, match="outside the cache"):
        nk.mla_prep(a[:1], b[:1], torch.tensor([S]), kv_b, cos, sin, kvn, c1, h, p, ql, 1e-6)
    with pytest.raises(IndexError, match="outside the cache"):
        nk.mla_attend(torch.randn(1, h, lat + r), c1, torch.tensor([S]), None, 0.3, lat)
    with pytest.raises(IndexError, match="outside the cache"):
        nk.mla_attend(torch.randn(1, h, lat + r), c1, torch.tensor([3]), torch.tensor([-1]), 0.3, lat)


def test_router_picks_the_reference_experts() -> None:
    """Group-limited (2 of 4 groups) and plain top-k, normalised or not, shared experts appended: the same experts
    as the reference (slot order is free: the experts' sum rounds by it only) with the same weights."""
    nk = _kernels()
    g = _gen(3)
    d, e = 48, 16
    gate, bias = torch.randn(e, d, generator=g), torch.randn(e, generator=g) * 0.1
    ones = torch.ones(d)
    for top_k, n_group, topk_group, norm in ((4, 4, 2, True), (3, 1, 1, False), (2, 8, 3, True)):
        h = torch.randn(6, d, generator=g)
        x = reference.rms_norm(h, ones, 1e-6)  # the router's input: the layer's normed hidden state
        ids, wts = nk.moe_route(x, gate, bias, top_k, n_group, topk_group, 2.5, norm, 2)
        want_ids, want_wts = reference.router(h, ones, 1e-6, gate, bias, top_k, n_group, topk_group, 2.5, norm, 2)
        for i in range(6):
            got_o, want_o = ids[i].argsort(), want_ids[i].argsort()
            assert torch.equal(ids[i][got_o], want_ids[i][want_o].to(torch.int32))
            _close(wts[i][got_o], want_wts[i][want_o])
        cfg = (top_k, n_group, topk_group, 2.5, norm, 2)

        def route(rows: torch.Tensor, cfg: tuple[int, int, int, float, bool, int] = cfg) -> torch.Tensor:
            r_ids, r_wts = nk.moe_route(rows, gate, bias, *cfg)
            return torch.cat([r_ids.float(), r_wts], 1)

        for n in range(1, 7):
            _each_row_alone(x, route, n)
    with pytest.raises(ValueError, match="groups"):
        nk.moe_route(x, gate, bias, 2, 3, 1, 1.0, True, 0)  # 16 experts do not split into 3 groups


def test_experts_match_reference_and_every_row_alone() -> None:
    """Several rows sharing some experts, a skipped slot (id -1), a dense MLP (one expert): the reference's values,
    each row alone's bits; an id beyond the experts is refused."""
    nk = _kernels()
    g = _gen(4)
    d, inter, e = 40, 12, 5
    w13, w2 = torch.randn(e, 2 * inter, d, generator=g) * 0.2, torch.randn(e, d, inter, generator=g) * 0.2
    x = torch.randn(5, d, generator=g)
    ids = torch.tensor([[0, 3, 4], [3, 0, 4], [1, -1, 4], [2, 3, 4], [0, 1, 4]], dtype=torch.int32)
    wts = torch.rand(5, 3, generator=g)
    _close(nk.moe_experts(x, ids, wts, w13, w2), reference.moe_experts(x, ids, wts, w13, w2))
    for n in range(1, 6):
        out = nk.moe_experts(x[:n], ids[:n], wts[:n], w13, w2)
        for i in range(n):
            assert torch.equal(out[i], nk.moe_experts(x[i : i + 1], ids[i : i + 1], wts[i : i + 1], w13, w2)[0])
    one = torch.zeros(5, 1, dtype=torch.int32), torch.ones(5, 1)
    _close(nk.moe_experts(x, *one, w13[:1], w2[:1]), reference.moe_experts(x, *one, w13[:1], w2[:1]))
    with pytest.raises(ValueError, match="expert id"):
        nk.moe_experts(x, torch.full((5, 1), e, dtype=torch.int32), torch.ones(5, 1), w13, w2)


def test_no_native_kernels_when_switched_off_or_the_build_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``TILERT_CPU_NATIVE=0``, or a compiler that fails: no kernels (the CPU engine keeps its ATen path), a
    warning, no exception; a working build lands in ``TILERT_CACHE_DIR``."""
    from tilert.engines.tilert.ops import cpu

    try:
        native.kernels.cache_clear()
        monkeypatch.setenv("TILERT_CPU_NATIVE", "0")
        assert native.kernels() is None
        native.kernels.cache_clear()
        monkeypatch.delenv("TILERT_CPU_NATIVE")
        monkeypatch.setenv("TILERT_CACHE_DIR", str(tmp_path))
        monkeypatch.setenv("CC", "false")  # found on PATH, exits 1
        assert native.kernels() is None
        x, w = torch.randn(3, 16), torch.randn(5, 16)
        _close(cpu.gemv(x, w), x @ w.t())  # the ATen path
        native.kernels.cache_clear()
        monkeypatch.delenv("CC")
        built = native.kernels()
        assert built is not None and built.path.parent == tmp_path
    finally:
        native.kernels.cache_clear()


def test_calls_that_do_not_fit_are_refused_before_the_c_code_runs() -> None:
    """The C code trusts its sizes: another dtype, a shape that does not match, a cache row outside the cache are
    refused with a ValueError / IndexError, not run (an out-of-bounds read or write would corrupt the process)."""
    nk = _kernels()
    x, w = torch.randn(2, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match="float32"):
        nk.linear(x.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="linear"):
        nk.linear(x, torch.randn(4, 15))
    with pytest.raises(ValueError, match="rms_norm"):
        nk.rms_norm(x, torch.ones(15), 1e-6)
    with pytest.raises(ValueError, match="experts"):
        nk.moe_experts(
            x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), torch.randn(3, 8, 16), torch.randn(3, 16, 5)
        )  # w2's width 5 is not w13's 8 / 2
    with pytest.raises(ValueError, match="mla_attend"):
        nk.mla_attend(torch.randn(1, 2, 16), torch.randn(10, 16), torch.tensor([4]), None, 0.3, 17)
