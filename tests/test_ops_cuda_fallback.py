"""CPU-side checks of the CUDA op registration module (the Triton kernels themselves run on the GPU only,
through benchmarks/check_kernels.py).

- ``ops/cuda.py`` imports without a GPU and without Triton (CI installs no Triton): nothing registered.
- Its wrappers send every input the fast kernels do not cover (float64, odd widths) to the reference
  kernels, so the ``tilert::*`` ops stay total on CUDA.
"""

from __future__ import annotations

import torch

from tilert.engines.tilert.ops import cuda as cuda_ops
from tilert.engines.tilert.ops import reference as ref


def test_imports_without_gpu():
    assert isinstance(cuda_ops.AVAILABLE, bool)


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
    torch.testing.assert_close(cuda_ops._moe_experts_cuda(x[:1], ids, wts, w13, w2),
                               ref.moe_experts(x[:1], ids, wts, w13, w2), rtol=0, atol=0)


def test_fast_path_predicates():
    bf = torch.bfloat16
    q = torch.zeros(1, 16, 576, dtype=bf)
    kv = torch.zeros(8, 576, dtype=bf)
    assert cuda_ops._mla_ok(q, kv, 512)
    assert not cuda_ops._mla_ok(q.double(), kv.double(), 512)
    assert not cuda_ops._mla_ok(torch.zeros(1, 16, 600, dtype=bf), torch.zeros(8, 600, dtype=bf), 512)
