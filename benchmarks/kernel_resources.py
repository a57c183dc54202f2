"""What the FP8 decode kernels cost an H200's SMs, read off their sm_90 builds, on any machine with Triton (no GPU).

Each launch config of the FP8 GEMV and ``moe_up`` that ``decode_speed.py --tune`` would time (the rows of its
``TUNING_FP8`` for ``FP8_GEMV_CFG``, ``FP8_TMA_CFG``, ``FP8_UP_CFG`` and ``FP8_UP_TMA_CFG``), register-fed and TMA-fed,
is compiled as the engine's own call would launch it (``triton_fp8.gemv_fp8`` / ``moe_up_fp8`` on CPU tensors of
the shapes below, Triton's launch replaced by a compile for sm_90 with Triton's own ``ptxas``), and its resources
printed from the cubin (``cuobjdump -res-usage``): registers per thread, stack (bytes a thread spills to local
memory: a config that spills is slow before it runs) and shared memory (the TMA-fed kernels' stages). Nothing is
run and nothing is timed: what it says is which configs are worth a device's time.

    python3 benchmarks/kernel_resources.py [--classes k1024,narrow] [--out DIR]

Shapes: one TP8 rank of full-size V3.2 (``k1024``: W_a with its bf16 tail, ``k2048``: W_o with the residual,
``small``: W_b, ``large``: the lm_head's rank slice; ``narrow``: the experts' rank slice, 2 of them), lite-v32
(``head``: its lm_head; ``small`` experts) and V3.2's whole experts (``large``). Writes ``cpu-kernel-resources.json``
under ``benchmarks/results/`` (``--out``: elsewhere).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from results_header import RESULTS_DIR, recorded, write_json  # noqa: E402

# GEMV class -> (N, K, what): the weight of that class in the rank's (or lite's) step
GEMV_SHAPES = {
    "k1024": (2240, 7168, "wa"),
    "k2048": (7168, 2048, "wo"),
    "small": (3072, 1536, "wb"),
    "mid": (4096, 1536, "wb"),
    "large": (16160, 7168, "head"),
    "head": (129280, 2048, "head"),
}
# moe_up class -> (D, I)
UP_SHAPES = {"narrow": (7168, 256), "small": (2048, 1408), "large": (7168, 2048)}


class _Sm90Driver:
    """The part of Triton's driver that compiling needs, answering for one H200 (device 0, sm_90)."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def _compiling(built: list) -> None:
    """Every Triton launch from now on compiles for sm_90 and records the kernel instead of running it."""
    import triton
    from triton.runtime import jit

    triton.runtime.driver.set_active(_Sm90Driver())
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append(kernel)
        return kernel

    jit.JITFunction.run = compile_only


def _resources(kernel, tool: Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", out))
    return dict(
        regs=int(fields["REG"]), stack=int(fields["STACK"]), local=int(fields["LOCAL"]), shared=kernel.metadata.shared
    )


def _weights(rows: int, cols: int, gn: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    return w, torch.ones(-(-rows // gn), cols // 128)


def _gemv(triton_fp8, cls: str, cfg, tma: bool) -> None:
    n, k, what = GEMV_SHAPES[cls]
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w, s = _weights(n, k, 1 if what in ("wa", "wb") else 128)
    kw: dict = {"tma": cfg} if tma else {"cfg": cfg}
    if what == "wa":
        triton_fp8.gemv_fp8(x, w, s, norm_w=x[0], tail=torch.zeros(64, k, dtype=torch.bfloat16), **kw)
    elif what == "wo":
        triton_fp8.gemv_fp8(x, w, s, residual=torch.zeros(1, n, dtype=torch.bfloat16), **kw)
    elif what == "wb":
        triton_fp8.gemv_fp8(x, w, s, norm_w=x[0], **kw)
    else:
        triton_fp8.gemv_fp8(x, w, s, out_f32=True, **kw)


def _moe_up(triton_fp8, cls: str, cfg, tma: bool) -> None:
    d, i = UP_SHAPES[cls]
    w13 = torch.zeros(2, 2 * i, d, dtype=torch.float8_e4m3fn)
    s13 = torch.ones(2, 2 * i // 128, d // 128)
    x = torch.zeros(1, d, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    kw: dict = {"tma": cfg} if tma else {"cfg": cfg}
    triton_fp8.moe_up_fp8(x, ids, w13, s13, norm_w=x[0], static=(1, 1), **kw)


def variants(classes: set[str] | None) -> list[tuple[str, str, object, bool]]:
    """(kernel, class, config, TMA-fed) of every config the tuning table names, the defaults first."""
    from decode_speed import TUNING_FP8

    from tilert.engines.tilert.ops import triton_fp8

    tables = {
        "FP8_GEMV_CFG": ("gemv", False),
        "FP8_TMA_CFG": ("gemv", True),
        "FP8_UP_CFG": ("moe_up", False),
        "FP8_UP_TMA_CFG": ("moe_up", True),
    }
    out: list[tuple[str, str, object, bool]] = []
    for table, (kernel, tma) in tables.items():
        defaults = getattr(triton_fp8, table)
        for cls, cfg in defaults.items():
            known = GEMV_SHAPES if kernel == "gemv" else UP_SHAPES
            if cls not in known or (classes and cls not in classes):
                continue
            values = [cfg]
            for _mod, attr, vals in TUNING_FP8:
                if attr == (table, cls):
                    values += [v for v in vals if v not in values]
            out += [(kernel, cls, v, tma) for v in values if v is not None]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default="", help="comma list of config classes (default: all)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    import triton

    from tilert.engines.tilert.ops import triton_fp8, triton_gemv, triton_pdl

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    triton_pdl.set_enabled(True)  # as on the H200: the PDL wait compiled in
    ready = triton_gemv.tma_ready  # as on an H200: these CPU tensors' rows are what decides
    triton_gemv.tma_ready = lambda w: (
        ready(w) or not (w.data_ptr() % 16 or any(st * w.element_size() % 16 for st in w.stride()[:-1]))
    )
    built: list = []
    _compiling(built)
    rows = []
    print(f"{'kernel':7s} {'class':7s} {'path':9s} {'config':20s} {'regs':>5s} {'stack':>6s} {'shared':>7s}")
    for kernel, cls, cfg, tma in variants({c for c in args.classes.split(",") if c} or None):
        built.clear()
        (_gemv if kernel == "gemv" else _moe_up)(triton_fp8, cls, cfg, tma)
        res = _resources(built[-1], tool)
        path = "tma" if tma else "registers"
        rows.append(dict(kernel=kernel, cls=cls, path=path, config=list(cfg), **res))
        flag = "  spills" if res["stack"] or res["local"] else ""
        print(
            f"{kernel:7s} {cls:7s} {path:9s} {str(cfg):20s} {res['regs']:5d} {res['stack']:6d} {res['shared']:7d}{flag}"
        )
    out = args.out / "cpu-kernel-resources.json"
    write_json(out, {"target": "sm_90", "rows": rows}, recorded("cpu", mode="kernel-resources", target="sm_90"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
