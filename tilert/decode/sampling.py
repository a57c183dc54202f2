"""Decode-request parameters and token sampling (greedy, temperature, top-k, top-p).

Greedy is ``argmax``, exactly what vLLM does at temperature 0, so streamed tokens can be compared
with vLLM's own output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tilert.engines.base import Capabilities


@dataclass(frozen=True)
class DecodeParams:
    transfer_id: str
    first_token_id: int
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @staticmethod
    def parse(body: Any, vocab_size: int, defaults: dict[str, Any] | None = None) -> "DecodeParams":
        """Validate a ``/v1/decode`` body; ``ValueError`` names the first bad field.

        Sampling fields left null take ``defaults`` (the model's ``generation_config.json``), as vLLM does.
        """
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")

        defaults = defaults or {}

        def integer(name: str, default: int | None = None, lo: int | None = None) -> int | None:
            value = body.get(name)
            value = defaults.get(name, default) if value is None else value
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or (lo is not None and value < lo):
                raise ValueError(f"{name} must be an integer{'' if lo is None else f' >= {lo}'}")
            return value

        def number(name: str, default: float) -> float:
            value = body.get(name)
            if value is None:
                return float(defaults.get(name, default))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number")
            return float(value)

        tid = body.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            raise ValueError("transfer_id must be a non-empty string")
        first = integer("first_token_id", lo=0)
        if first is None or first >= vocab_size:
            raise ValueError(f"first_token_id must be a token id below {vocab_size}")
        prompt = integer("prompt_tokens", lo=1)
        max_tokens = integer("max_tokens", lo=0)
        if prompt is None or max_tokens is None:
            raise ValueError("prompt_tokens and max_tokens are required")
        temperature, top_p = number("temperature", 1.0), number("top_p", 1.0)
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        top_k = integer("top_k", 0, lo=-1) or 0
        stop = body.get("stop_token_ids") or []
        if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            raise ValueError("stop_token_ids must be a list of integers")
        ignore_eos = body.get("ignore_eos") or False
        if not isinstance(ignore_eos, bool):
            raise ValueError("ignore_eos must be a boolean")
        return DecodeParams(
            tid, first, prompt, max_tokens, temperature, top_p, max(top_k, 0), integer("seed"), tuple(stop), ignore_eos
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
            self.generator.manual_seed(params.seed)
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
            sorted_probs = sorted_probs * keep
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
