"""Decode-request parameters and token sampling (greedy, temperature, top-k, top-p).

Greedy is ``argmax``, exactly what vLLM does at temperature 0, so streamed tokens can be compared
with vLLM's own output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tilert.contracts import Sampling
from tilert.engines.base import Capabilities

# vLLM's _SAMPLING_EPS: a temperature below it is greedy (1e-300 would divide the logits into inf).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class DecodeParams:
    """A validated decode request with the model's defaults applied; ``max_tokens`` None: to the end of
    the context."""

    transfer_id: str
    first_token_id: int
    prompt_tokens: int
    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @staticmethod
    def of(
        transfer_id: str,
        s: Sampling,
        vocab_size: int,
        defaults: dict[str, Any] | None = None,
        first_token_id: int = 0,
        prompt_tokens: int = 1,
    ) -> DecodeParams:
        """``s`` checked for this model, with ``defaults`` applied (the reserve checks a request's sampling
        this way before its prompt exists); ``ValueError`` names what is wrong."""
        defaults = defaults or {}
        if any(t >= vocab_size for t in s.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids below {vocab_size}")
        temperature = float(defaults.get("temperature", 1.0) if s.temperature is None else s.temperature)
        top_p = float(defaults.get("top_p", 1.0) if s.top_p is None else s.top_p)
        top_k = int(defaults.get("top_k", 0) if s.top_k is None else s.top_k)
        return DecodeParams(
            transfer_id,
            first_token_id,
            prompt_tokens,
            s.max_tokens,
            0.0 if temperature < GREEDY_BELOW else temperature,
            min(max(top_p, 0.0), 1.0) or 1.0,
            max(top_k, 0),
            s.seed,
            tuple(s.stop_token_ids),
            s.ignore_eos,
        )

    def unsupported(self, caps: Capabilities) -> str | None:
        """The first sampling option this engine cannot honour (the server answers 501), if any."""
        if not self.greedy and not caps.temperature:
            return "temperature > 0"
        if self.top_p < 1 and not caps.top_p:
            return "top_p"
        if self.top_k > 0 and not caps.top_k:
            return "top_k"
        return None


class Sampler:
    def __init__(self, params: DecodeParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed & 0xFFFF_FFFF_FFFF_FFFF)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from float32 ``[vocab]`` logits."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < p.top_p
            keep[0] = True  # however small top_p is, the most likely token stays
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
