"""What the decode kernels that stream weights cost an H200's SMs, read off their sm_90 builds, on any machine with
Triton (no GPU).

Each launch config of the GEMV, ``moe_up`` and ``moe_down``, block-FP8 and bf16, that ``decode_speed.py --tune`` would
time (the defaults and the one-knob rows of its ``TUNING_FP8`` / ``TUNING`` for the register-fed configs and the
TMA-fed ones: ``triton_fp8.FP8_GEMV_CFG`` / ``FP8_TMA_CFG`` / ``FP8_UP_CFG`` / ``FP8_UP_TMA_CFG`` / ``FP8_DOWN_CFG``,
``triton_gemv``'s class configs / ``TMA_CFG``, ``triton_fp8.BF16_UP_CFG`` / ``BF16_UP_TMA_CFG`` / ``BF16_DOWN_CFG``)
is compiled as the engine's own call would launch it (the ops' host functions on CPU tensors of the shapes below,
Triton's launch replaced by a compile for sm_90 with Triton's own ``ptxas``), and its resources printed from the cubin
(``cuobjdump -res-usage``): registers per thread, stack (bytes a thread spills to local memory: a config that spills
is slow before it runs) and shared memory (the TMA-fed kernels' stages). Nothing is run and nothing is timed: what it
says is which configs are worth a device's time.

    python3 benchmarks/kernel_resources.py [--classes k1024,narrow] [--out DIR]

Shapes, FP8: one TP8 rank of full-size V3.2 (``k1024``: W_a with its bf16 tail, ``k2048``: W_o with the residual,
``small``: W_b, ``large``: the lm_head's rank slice; ``narrow``: the experts' rank slice), lite-v32 (``head``: its
lm_head; ``small`` experts) and V3.2's whole experts (``large``); bf16: lite-v32's (``k1024`` W_a, ``small`` W_b,
``head``, ``wide`` experts) and a TP2 rank's V3.2 experts (``narrow``). Writes ``cpu-kernel-resources.json`` under
``benchmarks/results/`` (``--out``: elsewhere).
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

# FP8 GEMV class -> (N, K, what): the weight of that class in the rank's (or lite's) step
GEMV_SHAPES = {
    "k1024": (2240, 7168, "wa"),
    "k2048": (7168, 2048, "wo"),
    "small": (3072, 1536, "wb"),
    "mid": (4096, 1536, "wb"),
    "large": (16160, 7168, "head"),
    "head": (129280, 2048, "head"),
}
# FP8 expert class (moe_up, moe_down) -> (D, I)
UP_SHAPES = {"narrow": (7168, 256), "small": (2048, 1408), "large": (7168, 2048)}
# bf16 (lite-v32 bf16, layer-v32 bf16 and its TP2 rank): GEMV class -> (N, K, what); expert class -> (D, I)
BF16_GEMV_SHAPES = {
    "k1024": (2240, 2048, "wa"),
    "small": (3072, 1536, "wb"),
    "mid": (4096, 1536, "wb"),
    "large": (16160, 7168, "head"),
    "head": (129280, 2048, "head"),
}
BF16_UP_SHAPES = {"small": (2048, 1408), "large": (7168, 1024)}


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


def _gemv_fp8(ops, cls: str, kw: dict) -> None:
    n, k, what = GEMV_SHAPES[cls]
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w, s = _weights(n, k, 1 if what in ("wa", "wb") else 128)
    if what == "wa":
        ops.gemv_fp8(x, w, s, norm_w=x[0], tail=torch.zeros(64, k, dtype=torch.bfloat16), **kw)
    elif what == "wo":
        ops.gemv_fp8(x, w, s, residual=torch.zeros(1, n, dtype=torch.bfloat16), **kw)
    elif what == "wb":
        ops.gemv_fp8(x, w, s, norm_w=x[0], **kw)
    else:
        ops.gemv_fp8(x, w, s, out_f32=True, **kw)


def _moe_up_fp8(ops, cls: str, kw: dict) -> None:
    d, i = UP_SHAPES[cls]
    w13 = torch.zeros(2, 2 * i, d, dtype=torch.float8_e4m3fn)
    s13 = torch.ones(2, 2 * i // 128, d // 128)
    x = torch.zeros(1, d, dtype=torch.bfloat16)
    ops.moe_up_fp8(x, torch.zeros(1, 2, dtype=torch.int32), w13, s13, norm_w=x[0], static=(1, 1), **kw)


def _gemv_bf16(ops, cls: str, kw: dict) -> None:
    n, k, what = BF16_GEMV_SHAPES[cls]
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    if what == "head":
        ops.gemv(x, w, out_f32=True, **kw)
    else:
        ops.gemv(x, w, norm_w=x[0], **kw)


def _moe_up_bf16(ops, cls: str, kw: dict) -> None:
    d, i = BF16_UP_SHAPES[cls]
    x = torch.zeros(1, d, dtype=torch.bfloat16)
    w13 = torch.zeros(2, 2 * i, d, dtype=torch.bfloat16)
    ops.moe_up_fp8(x, torch.zeros(1, 2, dtype=torch.int32), w13, None, norm_w=x[0], static=(1, 1), **kw)


def _moe_down(ops, d: int, i: int, w2: torch.Tensor, s2: torch.Tensor | None, kw: dict) -> None:
    act = torch.zeros(1, 2, i, dtype=torch.bfloat16)
    ids, wts = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2)
    ops.moe_down_fp8(act, ids, wts, w2, s2, residual=torch.zeros(1, d, dtype=torch.bfloat16), **kw)


def _moe_down_fp8(ops, cls: str, kw: dict) -> None:
    d, i = UP_SHAPES[cls]
    w2 = torch.zeros(2, d, i, dtype=torch.float8_e4m3fn)
    _moe_down(ops, d, i, w2, torch.ones(2, d // 128, i // 128), kw)


def _moe_down_bf16(ops, cls: str, kw: dict) -> None:
    d, i = BF16_UP_SHAPES[cls]
    _moe_down(ops, d, i, torch.zeros(2, d, i, dtype=torch.bfloat16), None, kw)


# (kernel, ops module, its register-fed configs by class: a dict attribute, or class -> module attribute; its
# TMA-fed configs' dict, or None; the call at a class's shape; the tuning table that names variants)
KERNELS = (
    ("gemv fp8", "triton_fp8", "FP8_GEMV_CFG", "FP8_TMA_CFG", _gemv_fp8, "TUNING_FP8"),
    ("moe_up fp8", "triton_fp8", "FP8_UP_CFG", "FP8_UP_TMA_CFG", _moe_up_fp8, "TUNING_FP8"),
    ("moe_down fp8", "triton_fp8", "FP8_DOWN_CFG", None, _moe_down_fp8, "TUNING_FP8"),
    ("gemv bf16", "triton_gemv", "CLASS_CFG", "TMA_CFG", _gemv_bf16, "TUNING"),
    ("moe_up bf16", "triton_fp8", "BF16_UP_CFG", "BF16_UP_TMA_CFG", _moe_up_bf16, "TUNING"),
    ("moe_down bf16", "triton_fp8", "BF16_DOWN_CFG", None, _moe_down_bf16, "TUNING"),
)
SHAPES = {
    _gemv_fp8: GEMV_SHAPES,
    _moe_up_fp8: UP_SHAPES,
    _moe_down_fp8: UP_SHAPES,
    _gemv_bf16: BF16_GEMV_SHAPES,
    _moe_up_bf16: BF16_UP_SHAPES,
    _moe_down_bf16: BF16_UP_SHAPES,
}


def _named(table, knob) -> list:
    """The values the tuning ``table`` gives ``knob`` (an attribute, or (dict, key)) in its one-knob rows."""
    return [v for _mod, attr, vals in table if attr == knob for v in vals]


def variants(classes: set[str] | None) -> list[tuple[str, object, str, object, str]]:
    """(kernel, call, class, config, path) of every config the tuning tables name, each default first."""
    import importlib

    import decode_speed

    out: list[tuple[str, object, str, object, str]] = []
    for kernel, mod_name, reg, tma, call, table_name in KERNELS:
        mod = importlib.import_module(f"tilert.engines.tilert.ops.{mod_name}")
        table = getattr(decode_speed, table_name)
        for cls in SHAPES[call]:
            if classes and cls not in classes:
                continue
            regs = getattr(mod, reg)
            if cls in regs:  # register-fed: the class's config, then the table's
                attr = regs[cls] if isinstance(regs[cls], str) else None
                default = getattr(mod, attr) if attr else regs[cls]
                named = _named(table, attr if attr else (reg, cls))
                out += [(kernel, call, cls, v, "registers") for v in dict.fromkeys([default, *named])]
            tmas = getattr(mod, tma) if tma else {}
            if cls in tmas:
                named = _named(table, (tma, cls))
                out += [(kernel, call, cls, v, "tma") for v in dict.fromkeys([tmas[cls], *named]) if v is not None]
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
    triton_gemv.tma_ready = triton_gemv.tma_addressable  # as on an H200: the rows decide
    built: list = []
    _compiling(built)
    rows = []
    print(f"{'kernel':13s} {'class':7s} {'path':9s} {'config':20s} {'regs':>5s} {'stack':>6s} {'shared':>7s}")
    for kernel, call, cls, cfg, path in variants({c for c in args.classes.split(",") if c} or None):
        built.clear()
        ops = triton_gemv if kernel == "gemv bf16" else triton_fp8
        call(ops, cls, {"tma" if path == "tma" else "cfg": cfg})
        res = _resources(built[-1], tool)
        rows.append(dict(kernel=kernel, cls=cls, path=path, config=list(cfg), **res))
        flag = "  spills" if res["stack"] or res["local"] else ""
        cost = f"{res['regs']:5d} {res['stack']:6d} {res['shared']:7d}{flag}"
        print(f"{kernel:13s} {cls:7s} {path:9s} {str(cfg):20s} {cost}")
    out = args.out / "cpu-kernel-resources.json"
    write_json(out, {"target": "sm_90", "rows": rows}, recorded("cpu", mode="kernel-resources", target="sm_90"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
