"""A greedy sequence's logits rules as tensors: what a step applies to its logits before the argmax.

The rules are vLLM's (its V1 sampler's logits processors, and the structured-output bitmask), in a form an engine
can run on its device and inside a captured step: one additive ``bias`` row (``logit_bias``, ``-inf`` outside the
allowed ids and on one-token bad words), the stop ids masked while the completion is shorter than ``min_tokens``,
the repetition, frequency and presence penalties over the completion's token counts (the repetition penalty over
the prompt's ids too), and a grammar's token bitmask. Every part is exact when neutral (``+ 0``, ``* 1``), so a
captured step applies all of them whatever the request sets.

The caller (the decode loop) builds a :class:`Shaping` and feeds it each emitted token (:meth:`Shaping.observe`);
an engine that pipelines its steps keeps a copy on its device (:meth:`Shaping.copy_from`), advanced by the step
itself (:meth:`Shaping.observe_`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import torch

__all__ = ["NextMask", "Shaping", "apply_bitmask_"]

_TENSORS = ("bias", "stop_mask", "prompt_mask", "counts", "produced", "min_tokens", "penalties")

# The grammar's bitmask of a sequence's next token (int32, 32 tokens a word, on the host; None: every token allowed),
# asked once per step after the previous token was observed.
NextMask = Callable[[], torch.Tensor | None]


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``-inf`` in place on the ``[vocab]`` ``logits`` whose bit in ``bitmask`` (int32 words, bit ``i % 32`` of word
    ``i // 32``, as xgrammar fills it) is clear."""
    index = torch.arange(logits.shape[-1], device=logits.device)
    bits = (bitmask.view(-1)[index >> 5] >> (index & 31)) & 1
    return logits.masked_fill_(bits == 0, float("-inf"))


class Shaping:
    """One sequence's rules (see the module's docstring), on ``device``.

    ``produced``: the completion's length so far (prefill's first token counts, as vLLM counts ``min_tokens``);
    ``output_ids``: its tokens (the penalties' counts start from them).
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        bias: Mapping[int, float] | None = None,
        allowed_ids: Iterable[int] | None = None,
        banned_ids: Iterable[int] = (),
        stop_ids: Iterable[int] = (),
        min_tokens: int = 0,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        prompt_ids: Iterable[int] = (),
        output_ids: Iterable[int] = (),
    ) -> None:
        dev = torch.device(device)
        self.vocab_size, self.device = vocab_size, dev
        self.bias = torch.zeros(vocab_size, dtype=torch.float32, device=dev)
        if allowed_ids is not None:
            outside = torch.ones(vocab_size, dtype=torch.bool, device=dev)
            outside[list(allowed_ids)] = False
            self.bias.masked_fill_(outside, float("-inf"))
        self.bias[list(banned_ids)] = float("-inf")
        if bias:
            self.bias[list(bias)] += torch.tensor(list(bias.values()), dtype=torch.float32, device=dev)
        self.stop_mask = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        self.stop_mask[list(stop_ids)] = True
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=dev)
        if repetition_penalty != 1.0:
            self.prompt_mask[list(prompt_ids)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=dev)
        outputs = list(output_ids)
        if outputs:
            self.counts.index_add_(0, torch.tensor(outputs, device=dev), torch.ones(len(outputs), device=dev))
        self.produced = torch.tensor(len(outputs), dtype=torch.int64, device=dev)
        self.min_tokens = torch.tensor(min_tokens, dtype=torch.int64, device=dev)
        self.penalties = torch.tensor(
            [repetition_penalty, frequency_penalty, presence_penalty], dtype=torch.float32, device=dev
        )
        # What a host step may skip (a captured step applies everything: each part is exact when neutral).
        self._has_bias = bool(bias) or allowed_ids is not None or bool(list(banned_ids))
        self._has_min = min_tokens > 0 and bool(self.stop_mask.any())
        self._has_penalties = (repetition_penalty, frequency_penalty, presence_penalty) != (1.0, 0.0, 0.0)

    def apply_(self, logits: torch.Tensor, *, every_rule: bool = False, bitmask: torch.Tensor | None = None) -> None:
        """The rules applied in place to float32 ``[vocab]`` ``logits`` (on this shaping's device), in vLLM's order:
        the grammar's ``bitmask``, the bias row, ``min_tokens``, then the penalties. ``every_rule``: apply the
        neutral ones too (a captured step, whose operations cannot depend on the request)."""
        if bitmask is not None:
            apply_bitmask_(logits, bitmask)
        if every_rule or self._has_bias:
            logits += self.bias
        if every_rule or self._has_min:
            logits.masked_fill_(self.stop_mask & (self.produced < self.min_tokens), float("-inf"))
        if every_rule or self._has_penalties:
            repetition, frequency, presence = self.penalties[0], self.penalties[1], self.penalties[2]
            seen = self.counts > 0
            penalty = torch.where(self.prompt_mask | seen, repetition, 1.0)
            logits *= torch.where(logits > 0, 1.0 / penalty, penalty)
            logits -= frequency * self.counts
            logits -= presence * seen.float()

    def observe(self, tokens: list[int]) -> None:
        """The completion's next tokens, from the host."""
        if tokens:
            self.observe_(torch.tensor(tokens, dtype=torch.int64, device=self.device))

    def observe_(self, tokens: torch.Tensor) -> None:
        """The completion's next tokens (int64 ``[n]`` on this device): device operations only (capturable)."""
        self.counts.index_add_(0, tokens, torch.ones_like(tokens, dtype=torch.float32))
        self.produced += tokens.numel()

    def clone_to(self, device: torch.device | str) -> Shaping:
        """A copy of these rules and their state on ``device``."""
        twin = copy.copy(self)
        twin.device = torch.device(device)
        for name in _TENSORS:
            setattr(twin, name, getattr(self, name).to(twin.device, copy=True))
        return twin

    def copy_from(self, other: Shaping) -> None:
        """Take ``other``'s rules and state into this one's tensors (an engine's static copy, on its device)."""
        for name in _TENSORS:
            getattr(self, name).copy_(getattr(other, name))
