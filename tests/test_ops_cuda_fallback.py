"""CPU-side checks of the CUDA op registration module (the Triton kernels themselves run on the GPU only,
through benchmarks/check_kernels.py).

- Importing the ops (or ``ops/cuda.py``) registers nothing and imports no Triton: the CUDA kernels are
  registered at start-up by ``ops.register_device_kernels()`` (``TileRTEngine.load`` on CUDA), once.
- Its wrappers send every input the fast kernels do not cover (float64, odd widths) to the reference
  kernels, so the ``tilert::*`` ops stay total on CUDA.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from tilert.engines.tilert.ops import cuda as cuda_ops
from tilert.engines.tilert.ops import reference as ref


def test_imports_without_gpu():
    assert isinstance(cuda_ops.AVAILABLE, bool)


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=True, timeout=300)


def test_import_registers_nothing():
    _run("""
        import sys
        import torch
        import tilert.engines.tilert.engine
        from tilert.engines.tilert import ops
        assert "tilert.engines.tilert.ops.cuda" not in sys.modules and "triton" not in sys.modules
        assert not torch._C._dispatch_has_kernel_for_dispatch_key("tilert::rms_norm", "CUDA")
        if not torch.cuda.is_available():
            assert ops.register_device_kernels() is False
    """)


def test_register_is_explicit_and_idempotent():
    """With Triton present (a stand-in module here), ``register()`` puts every kernel on the CUDA key, once."""
    _run("""
        import sys, types
        import torch
        from tilert.engines.tilert.ops import cuda
        sys.modules["triton"] = types.ModuleType("triton")
        cuda.AVAILABLE = True
        names = [f"tilert::{n}" for n in cuda._KERNELS]
        assert not any(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in names)
        assert cuda.register() is True and cuda.register() is True
        assert all(torch._C._dispatch_has_kernel_for_dispatch_key(n, "CUDA") for n in names)
    """)


def test_float64_falls_back_to_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 40, dtype=torch.float64, generator=g)
    kv = torch.randn(50, 40, dtype=torch.float64, generator=g)
    pos = torch.tensor([10, 11])
    out = cuda_ops._mla_attention_cuda(q, kv, pos, 0.1, 32)
    torch.testing.assert_close(out, ref.mla_attention(q, kv, pos, 0.1, 32), rtol=0, atol=0)
    idx = torch.tensor([[0, 3, -1, 7], [1, -1, -1, 2]], dtype=torch.int32)
    out = cuda_ops._mla_sparse_attention_cuda(q, kv, idx, 0.1, 32)
    torch.testing.assert_close(out, ref.mla_sparse_attention(q, kv, idx, 0.1, 32), rtol=0, atol=0)
    x = torch.randn(3, 16, dtype=torch.float64, generator=g)
    w = torch.randn(16, dtype=torch.float64, generator=g)
    torch.testing.assert_close(cuda_ops._rms_norm_cuda(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=0, atol=0)
    qi = torch.randn(1, 2, 8, dtype=torch.float64, generator=g)
    wi = torch.randn(1, 2, dtype=torch.float32, generator=g)
    kc = torch.randn(30, 8, dtype=torch.float64, generator=g)
    got = cuda_ops._indexer_topk_cuda(qi, wi, kc, torch.tensor([20]), 8)
    assert set(got[0].tolist()) == set(ref.indexer_topk(qi, wi, kc, torch.tensor([20]), 8)[0].tolist())
    w13 = torch.randn(4, 12, 16, dtype=torch.float64, generator=g)
    w2 = torch.randn(4, 16, 6, dtype=torch.float64, generator=g)
    ids = torch.tensor([[0, 2]], dtype=torch.int32)
    wts = torch.tensor([[0.3, 0.7]])
    torch.testing.assert_close(
        cuda_ops._moe_experts_cuda(x[:1], ids, wts, w13, w2), ref.moe_experts(x[:1], ids, wts, w13, w2), rtol=0, atol=0
    )


def test_fast_path_predicates():
    bf = torch.bfloat16
    q = torch.zeros(1, 16, 576, dtype=bf)
    kv = torch.zeros(8, 576, dtype=bf)
    assert cuda_ops._mla_ok(q, kv, 512)
    assert not cuda_ops._mla_ok(q.double(), kv.double(), 512)
    assert not cuda_ops._mla_ok(torch.zeros(1, 16, 600, dtype=bf), torch.zeros(8, 600, dtype=bf), 512)


def test_fp8_inputs_the_kernels_do_not_cover_fall_back_to_dequantisation():
    """Block-FP8 weights with float32 activations (no FP8 Triton path) reach the reference, which dequantises;
    the fast-path predicates accept bf16 activations with e4m3 weights and their scales (or 16-bit experts without
    any) and refuse a scale-less e4m3 weight."""
    from tilert.engines.tilert import fp8

    g = torch.Generator().manual_seed(0)
    q, s = fp8.quantize_blocks(torch.randn(200, 136, generator=g))
    scale = fp8.QTensor.from_checkpoint("w", q, s).compress(8, 8, "w")
    w = fp8.dequant(q, scale, torch.float32)
    x = torch.randn(2, 136, generator=g)
    torch.testing.assert_close(cuda_ops._gemv_cuda(x, q, None, 1e-6, None, False, scale), x @ w.T)
    h = torch.randn(2, 200, generator=g)
    want = h + x @ w.T
    cuda_ops._gemv_residual_cuda(h, x, q, h, scale)
    torch.testing.assert_close(h, want)
    assert cuda_ops._gemv_fp8_ok(x.bfloat16(), q, scale) and not cuda_ops._gemv_fp8_ok(x, q, scale)
    xb, e = x.bfloat16(), q[None]
    assert cuda_ops._moe_ok(xb, e, e, scale[None], scale[None])  # e4m3 experts with their scales
    assert not cuda_ops._moe_ok(xb, e, e, None, scale[None])  # one scale missing
    assert not cuda_ops._moe_ok(xb, e, e, None, None)  # e4m3 without scales
    assert cuda_ops._moe_ok(xb, e.bfloat16(), e.bfloat16(), None, None)  # 16-bit experts: the same kernels, no scales
    assert not cuda_ops._moe_ok(x, e.float(), e.float(), None, None)  # float32 activations: the reference
