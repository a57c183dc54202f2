"""A greedy step's logits rules and its advance in two Triton kernels (CUDA), for the engine's shaped stream.

:func:`shape_logits_` is :meth:`tilert.engines.shaping.Shaping.apply_` with ``every_rule`` (its reference: the same
float32 operations in the same order, each rounded as PyTorch rounds it: IEEE division, no fused multiply-add), in
one pass over the vocabulary instead of some twenty elementwise kernels. :func:`advance_` takes the argmax token:
it counts it into the rules' state and makes it the next step's input at the next cache row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tilert.engines.shaping import Shaping

BLOCK = 4096


@triton.jit
def _shape_kernel(
    logits, bias, stop_mask, prompt_mask, counts, produced, min_tokens, penalties, bits, V, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < V
    x = tl.load(logits + i, mask=ok)
    word = tl.load(bits + (i >> 5), mask=ok)
    x = tl.where(((word >> (i & 31)) & 1) == 0, float("-inf"), x)
    x = x + tl.load(bias + i, mask=ok)
    stop = tl.load(stop_mask + i, mask=ok) != 0
    x = tl.where(stop & (tl.load(produced) < tl.load(min_tokens)), float("-inf"), x)
    repetition, frequency, presence = tl.load(penalties), tl.load(penalties + 1), tl.load(penalties + 2)
    count = tl.load(counts + i, mask=ok)
    seen = count > 0
    penalty = tl.where((tl.load(prompt_mask + i, mask=ok) != 0) | seen, repetition, 1.0)
    x = x * tl.where(x > 0, tl.math.div_rn(1.0, penalty), penalty)
    x = x - frequency * count
    x = x - presence * seen.to(tl.float32)
    tl.store(logits + i, x, mask=ok)


@triton.jit
def _advance_kernel(chosen, counts, produced, token, row):
    t = tl.load(chosen)
    tl.store(counts + t, tl.load(counts + t) + 1.0)
    tl.store(produced, tl.load(produced) + 1)
    tl.store(token, t)
    tl.store(row, tl.load(row) + 1)


def shape_logits_(logits: torch.Tensor, rules: Shaping, bitmask: torch.Tensor) -> None:
    """``rules.apply_(logits, every_rule=True, bitmask=bitmask)`` in place on float32 ``[vocab]`` ``logits``."""
    V = logits.shape[-1]
    _shape_kernel[(triton.cdiv(V, BLOCK),)](
        logits,
        rules.bias,
        rules.stop_mask,
        rules.prompt_mask,
        rules.counts,
        rules.produced,
        rules.min_tokens,
        rules.penalties,
        bitmask,
        V,
        BLOCK=BLOCK,
        enable_fp_fusion=False,
    )


def advance_(chosen: torch.Tensor, rules: Shaping, token: torch.Tensor, row: torch.Tensor) -> None:
    """``rules.observe_(chosen)``, ``token.copy_(chosen)`` and ``row += 1`` (``chosen``, ``token``, ``row``: int64
    ``[1]``)."""
    _advance_kernel[(1,)](chosen, rules.counts, rules.produced, token, row)
