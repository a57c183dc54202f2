"""The CPU engine's row-invariant native kernels (``native/rows.c``): built on first use with the machine's C
compiler, loaded with :mod:`ctypes`, called by :mod:`.cpu` for steps of up to ``cpu.ROWWISE_MAX`` rows.

Why native code: a decode step over ``n`` sequences must give each row exactly the bits it gets alone. CPU BLAS
does not (MKL's sgemm rounds one row, 2-3 rows and 4+ rows differently), so the ATen path computes ``n`` one-row
products, reading every weight ``n`` times, and loops over rows elsewhere. The kernels here compute every output
with one fixed floating-point chain and read each weight once for all rows; every sequence's attention, the
router and the experts (each chosen expert once over the rows that chose it) are one call each. They also replace
most of a step's small ATen calls (microseconds each, more than a tiny model's arithmetic). Measured side by side:
``benchmarks/cpu_decode_speed.py --sequences`` (the native and ATen arms interleaved).

Why not a ``torch.utils.cpp_extension``: it compiles torch's headers (a minute, and ninja); this file needs none,
compiles in about a second, and is called through plain pointers (``Tensor.data_ptr``). Every wrapper checks the
shapes, strides and cache rows the C code will touch before calling it.

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -ffp-contract=off`` into ``$TILERT_CACHE_DIR`` (default
``~/.cache/tilert``; a private temp directory where home is read-only), named by a hash of the source, the flags
and the CPU's flags, written atomically (several processes may build at once). No compiler, a failed build, or
``TILERT_CPU_NATIVE=0``: :func:`kernels` is None (with a warning) and :mod:`.cpu` keeps its ATen path, which is
row-invariant too, only slower. The choice is made once per process, so every step of an engine computes the
same way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import Tensor

log = structlog.get_logger("tilert.ops.native")

SOURCE = Path(__file__).with_name("native") / "rows.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared")

_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {  # rows.c's functions: argument types, return type
    "tl_linear": ([_I64] * 4 + [_PTR, _I64, _I64] * 3, None),
    "tl_linear_kn": ([_I64] * 4 + [_PTR, _I64, _I64] * 3, None),
    "tl_mla_attend": ([_I64] * 4 + [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _F32, _PTR], _INT),
    "tl_rms_norm": ([_I64, _I64, _PTR, _I64, _PTR, _F32, _PTR], None),
    "tl_moe_route": ([_I64] * 3 + [_PTR] * 3 + [_I64] * 3 + [_F32, _INT, _I64, _PTR, _PTR], _INT),
    "tl_moe_experts": ([_I64] * 5 + [_PTR] * 6, _INT),
    "tl_mla_prep": ([_I64] * 7 + [_PTR, _I64, _PTR, _I64, _PTR, _I64] + [_PTR] * 4 + [_F32, _PTR, _PTR], _INT),
}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    """``$TILERT_CACHE_DIR``, else ``~/.cache/tilert``, else (a read-only home) a private directory in the temp
    directory: this process loads code from there, so it must be this user's alone (mode 0700, owned)."""
    first = Path(os.environ.get("TILERT_CACHE_DIR") or Path.home() / ".cache" / "tilert")
    try:
        first.mkdir(parents=True, exist_ok=True)
        if os.access(first, os.W_OK):
            return first
    except OSError:
        pass
    private = Path(tempfile.gettempdir()) / f"tilert-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    st = private.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{private} is not this user's private directory")
    return private


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([src, " ".join(FLAGS).encode(), cc.encode(), _cpu_flags().encode(), platform.machine().encode()])
    ).hexdigest()[:16]
    cache = _cache_dir()
    lib = cache / f"rows-{key}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _require(ok: bool, what: str) -> None:
    """The C code trusts its sizes: a call that does not fit is refused here, not run."""
    if not ok:
        raise ValueError(f"native kernel refused: {what}")


def _f32(*ts: Tensor) -> None:
    for t in ts:  # a plain loop: this runs some 40 times a decode step
        if t.dtype != torch.float32 or not t.is_cpu:
            raise ValueError("native kernel refused: float32 CPU tensors only")


class Kernels:
    """The loaded library; every method takes float32 CPU tensors whose last dimension is contiguous."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        self._lib = lib

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """``x [G, n, K] @ w[G, N, K]^T -> [G, n, N]`` (or ``x [n, K] @ w[N, K]^T -> [n, N]``); any strides but the
        last."""
        _require(
            w.dim() == x.dim() in (2, 3) and w.shape[:-2] == x.shape[:-2] and w.shape[-1] == x.shape[-1],
            "linear: x [G, n, K], w [G, N, K] (or without G)",
        )
        return self._product(self._lib.tl_linear, x, w, w.shape[-2])

    def linear_kn(self, x: Tensor, w: Tensor) -> Tensor:
        """``x [G, n, K] @ w[G, K, N] -> [G, n, N]`` (``w``'s rows of ``N`` contiguous)."""
        _require(
            x.dim() == 3 and w.dim() == 3 and w.shape[:2] == (x.shape[0], x.shape[2]),
            "linear_kn: x [G, n, K], w [G, K, N]",
        )
        return self._product(self._lib.tl_linear_kn, x, w, w.shape[2])

    @staticmethod
    def _product(fn: Any, x: Tensor, w: Tensor, N: int) -> Tensor:
        """``fn`` (``tl_linear`` / ``tl_linear_kn``) over ``x [G, n, K]`` (or ``[n, K]``, a G of 1 without the views
        of one: the common case) and ``w``, into a new ``[G, n, N]`` (``[n, N]``)."""
        _f32(x, w)
        xs, ws = x.stride(), w.stride()
        _require(xs[-1] == 1 and ws[-1] == 1, "products need rows of K contiguous")
        if x.dim() == 2:
            (n, K), G, (xg, xr), (wg, wj) = x.shape, 1, (0, xs[0]), (0, ws[0])
            y = x.new_empty(n, N)
        else:
            (G, n, K), (xg, xr, _), (wg, wj, _) = x.shape, xs, ws
            y = x.new_empty(G, n, N)
        fn(G, n, N, K, x.data_ptr(), xg, xr, w.data_ptr(), wg, wj, y.data_ptr(), n * N, N)
        return y

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """RMSNorm of each row of ``x [n, D]`` (rows of ``D`` contiguous) with ``w [D]``: a new ``[n, D]``."""
        n, D = x.shape
        _f32(x, w)
        _require(x.stride(1) == 1 and w.is_contiguous() and w.shape == (D,), "rms_norm: x [n, D], w [D]")
        y = x.new_empty(n, D)
        self._lib.tl_rms_norm(n, D, x.data_ptr(), x.stride(0), w.data_ptr(), eps, y.data_ptr())
        return y

    def moe_route(
        self,
        x: Tensor,
        gate: Tensor,
        bias: Tensor,
        top_k: int,
        n_group: int,
        topk_group: int,
        route_scale: float,
        norm_topk: bool,
        n_shared: int,
    ) -> tuple[Tensor, Tensor]:
        """The router of each row of ``x [n, D]`` (normed): ids int32 and weights ``[n, top_k + n_shared]``."""
        n, D = x.shape
        E = gate.shape[0]
        _f32(x, gate, bias)
        _require(gate.shape == (E, D) and bias.shape == (E,), "router: gate [E, D], bias [E]")
        x, gate, bias = x.contiguous(), gate.contiguous(), bias.contiguous()
        ids = torch.empty(n, top_k + n_shared, dtype=torch.int32)
        wts = x.new_empty(n, top_k + n_shared)
        if (
            self._lib.tl_moe_route(
                n,
                D,
                E,
                x.data_ptr(),
                gate.data_ptr(),
                bias.data_ptr(),
                top_k,
                n_group,
                topk_group,
                route_scale,
                int(norm_topk),
                n_shared,
                ids.data_ptr(),
                wts.data_ptr(),
            )
            != 0
        ):
            raise ValueError(f"tl_moe_route: {E} experts in {n_group} groups, top {top_k} of {topk_group} groups")
        return ids, wts

    def moe_experts(self, x: Tensor, ids: Tensor, wts: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        """``sum_j wts[:, j] * expert_{ids[:, j]}(x)`` per row, slots in order (id -1 skipped): ``[n, D]``."""
        n, D = x.shape
        E, two_i, _ = w13.shape
        k = ids.shape[1]
        _f32(x, wts, w13, w2)
        _require(
            w13.shape == (E, two_i, D) and w2.shape == (E, D, two_i // 2) and ids.shape == wts.shape == (n, k),
            "experts: x [n, D], w13 [E, 2I, D], w2 [E, D, I], ids / weights [n, k]",
        )
        x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
        ids, wts = ids.to(torch.int32).contiguous(), wts.contiguous()
        out = x.new_empty(n, D)
        if (
            self._lib.tl_moe_experts(
                n,
                D,
                two_i // 2,
                k,
                E,
                x.data_ptr(),
                ids.data_ptr(),
                wts.data_ptr(),
                w13.data_ptr(),
                w2.data_ptr(),
                out.data_ptr(),
            )
            != 0
        ):
            raise ValueError(f"tl_moe_experts: an expert id outside 0..{E - 1}, or out of memory")
        return out

    def mla_prep(
        self,
        a: Tensor,
        b: Tensor,
        rows: Tensor,
        kv_b: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv_norm: Tensor,
        kv_cache: Tensor,
        num_heads: int,
        nope_dim: int,
        kv_offset: int,
        eps: float,
    ) -> Tensor:
        """Dense MLA's preparation (``reference.mla_prep`` without an indexer): writes each token's cache row
        ``[rms(c_kv) | rope(k_pe)]`` at ``rows`` and returns ``q_full [n, H, L + R]``."""
        n = a.shape[0]
        lat = kv_norm.shape[0]
        width = kv_cache.shape[1]
        r = width - lat
        v = kv_b.shape[0] // num_heads - nope_dim
        _f32(a, b, kv_b, cos, sin, kv_norm, kv_cache)
        ok = (
            a.stride(1) == b.stride(1) == 1
            and kv_b.is_contiguous()
            and cos.is_contiguous()
            and sin.is_contiguous()
            and kv_cache.is_contiguous()
            and kv_norm.is_contiguous()
            and r > 0
            and r % 2 == 0
            and cos.shape == sin.shape == (cos.shape[0], r // 2)
            and kv_b.shape == (num_heads * (nope_dim + v), lat)
            and b.shape[1] >= num_heads * (nope_dim + r)
            and a.shape[1] >= kv_offset + width
            and rows.shape == (n,)
        )
        _require(ok, "mla_prep: the shapes of a, b, kv_b, cos / sin and the cache")
        rows = rows.to(torch.int64).contiguous()
        q_full = a.new_empty(n, num_heads, width)
        if (
            self._lib.tl_mla_prep(
                n,
                num_heads,
                nope_dim,
                r,
                v,
                lat,
                kv_offset,
                a.data_ptr(),
                a.stride(0),
                b.data_ptr(),
                b.stride(0),
                rows.data_ptr(),
                min(kv_cache.shape[0], cos.shape[0]),
                kv_b.data_ptr(),
                cos.data_ptr(),
                sin.data_ptr(),
                kv_norm.data_ptr(),
                eps,
                kv_cache.data_ptr(),
                q_full.data_ptr(),
            )
            != 0
        ):
            raise IndexError(f"mla_prep: a row outside the cache of {kv_cache.shape[0]} rows")
        return q_full

    def mla_attend(
        self, q: Tensor, kv: Tensor, positions: Tensor, row_start: Tensor | None, scale: float, lat: int
    ) -> Tensor | None:
        """Query ``i`` of ``q [n, H, D]`` over cache rows ``row_start..positions[i]`` of ``kv [S, D]`` (``row_start``
        int64 ``[1]`` or ``[n]``, None: row 0; softmax of the scaled scores), the first ``lat`` columns:
        ``[n, H, lat]``. None when a query has no row (its start beyond its position: the caller's case)."""
        n, H, D = q.shape
        q = q.contiguous()
        pos = positions.reshape(-1).contiguous()
        start = None if row_start is None else row_start.reshape(-1).contiguous()
        _f32(q, kv)
        starts_ok = start is None or (start.dtype == torch.int64 and start.numel() in (1, n))
        _require(
            kv.dim() == 2
            and kv.shape[1] == D
            and kv.stride() == (D, 1)
            and 0 < lat <= D
            and starts_ok
            and pos.dtype == torch.int64
            and pos.shape == (n,),
            "mla_attend: q [n, H, D], cache [S, D] contiguous, positions / row_start int64",
        )
        out = q.new_empty(n, H, lat)
        rc = self._lib.tl_mla_attend(
            n,
            H,
            D,
            lat,
            q.data_ptr(),
            kv.data_ptr(),
            kv.shape[0],
            pos.data_ptr(),
            None if start is None else start.data_ptr(),
            0 if start is None else start.numel(),
            scale,
            out.data_ptr(),
        )
        if rc == -2:
            raise IndexError(f"mla_attend: a position or row_start outside the cache of {kv.shape[0]} rows")
        if rc == -1:
            raise MemoryError("tl_mla_attend: out of memory for the scores")
        return None if rc == 1 else out


@functools.cache
def kernels() -> Kernels | None:
    """The native kernels, built on the first call; None where they cannot be (see the module docstring)."""
    if os.environ.get("TILERT_CPU_NATIVE", "1") == "0":
        return None
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        log.warning("cpu_native_unavailable", reason="no C compiler (set CC)")
        return None
    try:
        return Kernels(_build(cc))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = exc.stderr.decode(errors="replace")[-500:] if isinstance(exc, subprocess.CalledProcessError) else ""
        log.warning("cpu_native_unavailable", reason=str(exc), compiler_output=detail)
        return None
