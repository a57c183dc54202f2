"""Decode-request parameters and token sampling (greedy, temperature, min-p, top-k, top-p, vLLM's logits rules).

Greedy is ``argmax``, exactly what vLLM does at temperature 0, so streamed tokens can be compared
with vLLM's own output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tilert.contracts import LOGPROB_FLOOR, Grammar, Sampling, TokenLogprobs
from tilert.decode.grammar import Matcher
from tilert.engines.base import Capabilities
from tilert.engines.shaping import Shaping

# vLLM's _SAMPLING_EPS: a temperature below it is greedy (1e-300 would divide the logits into inf).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class DecodeParams:
    """A validated decode request with the model's defaults applied; ``max_tokens`` None: to the end of
    the context. The logits rules are :class:`~tilert.contracts.Sampling`'s (vLLM's); ``min_tokens`` counts the
    whole completion, prefill's first token included."""

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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    prompt_token_ids: tuple[int, ...] = ()
    grammar: Grammar | None = None
    n: int = 1  # choices decoded from the prompt (each an engine sequence of its own)
    logprobs: int | None = None  # each token's logprob and this many top ones (None: none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_logits(self) -> bool:
        """Whether each step's logits are needed (a rule shapes them, or the request asks for logprobs): no greedy
        fast path, no speculation."""
        return self.shapes_logits or self.logprobs is not None

    @property
    def shapes_logits(self) -> bool:
        """Whether a rule changes the logits before sampling: such a request needs each step's logits (no
        greedy fast path, no speculation)."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.min_tokens > 1
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or self.grammar is not None
            or (self.min_p > 0 and not self.greedy)
        )

    @staticmethod
    def of(
        transfer_id: str,
        s: Sampling,
        vocab_size: int,
        defaults: dict[str, Any] | None = None,
        first_token_id: int = 0,
        prompt_tokens: int = 1,
        prompt_token_ids: list[int] | None = None,
    ) -> DecodeParams:
        """``s`` checked for this model, with ``defaults`` applied (the reserve checks a request's sampling
        this way before its prompt exists); ``ValueError`` names what is wrong."""
        defaults = defaults or {}

        def pick(name: str, neutral: float) -> float:
            value = getattr(s, name)
            return float(defaults.get(name, neutral) if value is None else value)

        ids = {
            "stop_token_ids": s.stop_token_ids,
            "logit_bias": list(s.logit_bias),
            "allowed_token_ids": s.allowed_token_ids or [],
            "bad_words": [t for word in s.bad_words_token_ids for t in word],
            "prompt_token_ids": prompt_token_ids or [],
        }
        for name, values in ids.items():
            if any(t >= vocab_size for t in values):
                raise ValueError(f"{name} must be token ids below {vocab_size}")
        if prompt_token_ids is not None and len(prompt_token_ids) != prompt_tokens:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} ids for a prompt of {prompt_tokens}")
        temperature = pick("temperature", 1.0)
        repetition_penalty = pick("repetition_penalty", 1.0)
        return DecodeParams(
            transfer_id,
            first_token_id,
            prompt_tokens,
            s.max_tokens,
            0.0 if temperature < GREEDY_BELOW else temperature,
            min(max(pick("top_p", 1.0), 0.0), 1.0) or 1.0,
            max(int(pick("top_k", 0)), 0),
            s.seed,
            tuple(s.stop_token_ids),
            s.ignore_eos,
            min_p=pick("min_p", 0.0),
            repetition_penalty=repetition_penalty,
            frequency_penalty=pick("frequency_penalty", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            min_tokens=s.min_tokens,
            logit_bias=dict(s.logit_bias),
            allowed_token_ids=None if s.allowed_token_ids is None else tuple(s.allowed_token_ids),
            bad_words_token_ids=tuple(tuple(w) for w in s.bad_words_token_ids),
            prompt_token_ids=tuple(prompt_token_ids or ()) if repetition_penalty != 1.0 else (),
            grammar=s.grammar,
            n=s.n,
            logprobs=s.logprobs,
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


class LogitsRules:
    """vLLM's logits processing for one sequence, in vLLM's order (its V1 ``Sampler``): the allowed ids, the bad
    words, ``min_tokens``, ``logit_bias``, then the repetition, frequency and presence penalties; ``min_p``
    comes after the temperature (:class:`Sampler`). It tracks the completion's tokens (:meth:`observe`).

    The rules are a :class:`~tilert.engines.shaping.Shaping` (:attr:`shaping`, on the logits' device, made at the
    first step), which an engine can also apply inside its own steps (:attr:`device_ready`); only bad words of
    several tokens, which look back on the completion, stay here."""

    def __init__(self, params: DecodeParams, stop_ids: frozenset[int], output: list[int] | None = None) -> None:
        """``output``: the completion so far (by default prefill's first token)."""
        self.params = params
        self.stop_ids = sorted(stop_ids)  # masked while the completion is shorter than min_tokens
        self.output: list[int] = [params.first_token_id] if output is None else list(output)
        self._shaping: Shaping | None = None
        self._long_words = [w for w in params.bad_words_token_ids if len(w) > 1]

    @property
    def device_ready(self) -> bool:
        """Whether :attr:`shaping` holds every rule (no bad word of several tokens)."""
        return not self._long_words

    def shaping(self, vocab: int, device: torch.device | str) -> Shaping:
        """The rules as tensors on ``device``, at the completion's current state."""
        if self._shaping is not None and self._shaping.device != torch.device(device):
            self._shaping = self._shaping.clone_to(device)
        if self._shaping is None:
            p = self.params
            self._shaping = Shaping(
                vocab,
                device,
                bias=p.logit_bias,
                allowed_ids=p.allowed_token_ids,
                banned_ids=[w[0] for w in p.bad_words_token_ids if len(w) == 1],
                stop_ids=self.stop_ids,
                min_tokens=p.min_tokens,
                repetition_penalty=p.repetition_penalty,
                frequency_penalty=p.frequency_penalty,
                presence_penalty=p.presence_penalty,
                prompt_ids=p.prompt_token_ids,
                output_ids=self.output,
            )
        return self._shaping

    def observe(self, tokens: list[int]) -> None:
        self.output += tokens
        if self._shaping is not None:
            self._shaping.observe(tokens)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``[vocab]`` ``logits`` with the rules applied."""
        return self.apply_(logits.float().clone())

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """The rules applied in place to float32 ``[vocab]`` ``logits`` (returned)."""
        for word in self._long_words:
            prefix = len(word) - 1
            if prefix <= len(self.output) and self.output[-prefix:] == list(word[:-1]):
                logits[word[-1]] = float("-inf")
        self.shaping(logits.shape[-1], logits.device).apply_(logits)
        return logits


def gather_logprobs(logprobs: torch.Tensor, token: int, num: int) -> TokenLogprobs:
    """vLLM's ``Sampler.gather_logprobs`` for one row of log-probabilities ``[vocab]``: the ``token``'s, its rank
    (how many are at least as likely, itself included) and the ``num`` most likely (``torch.topk``), values below
    ``LOGPROB_FLOOR`` raised to it as vLLM's OpenAI layer shows them."""
    chosen = logprobs[token]
    rank = int((logprobs >= chosen).sum())
    top = torch.topk(logprobs, min(num, logprobs.numel()))
    return TokenLogprobs(
        max(float(chosen), LOGPROB_FLOOR),
        max(rank, 1),
        top.indices.tolist(),
        [max(v, LOGPROB_FLOOR) for v in top.values.tolist()],
    )


class Sampler:
    """One sequence's sampler: its grammar's mask (``matcher``), then :class:`LogitsRules`, then greedy or the
    temperature, ``min_p``, top-k and top-p. With ``params.logprobs`` set, each call also leaves the token's
    log-probabilities in :attr:`last_logprobs`: vLLM's raw logprobs (``logprobs_mode`` ``raw_logprobs``), the
    log-softmax of the logits as the grammar's mask left them, before the rules and the temperature.

    ``generator``: the sequence's random stream (by default a new one, seeded with ``params.seed``);
    ``completion``: the completion so far (by default prefill's first token; empty for a sampler that draws the
    first token itself)."""

    def __init__(
        self,
        params: DecodeParams,
        stop_ids: frozenset[int] = frozenset(),
        matcher: Matcher | None = None,
        generator: torch.Generator | None = None,
        completion: list[int] | None = None,
    ) -> None:
        self.params = params
        self.matcher = matcher
        shaped = params.shapes_logits or (completion is not None and len(completion) < params.min_tokens)
        self.rules = LogitsRules(params, stop_ids, completion) if shaped else None
        self.last_logprobs: TokenLogprobs | None = None
        self.generator = generator if generator is not None else seeded_generator(params.seed)

    def observe(self, tokens: list[int]) -> None:
        """The tokens the sequence emitted (what the penalties and bad words look back on)."""
        if self.rules is not None:
            self.rules.observe(tokens)
        if self.matcher is not None:
            self.matcher.accept(tokens)

    def __call__(self, logits: torch.Tensor) -> int:
        """One token id from float32 ``[vocab]`` logits."""
        p = self.params
        if self.matcher is not None or self.rules is not None:  # one copy, the rules applied to it in place
            logits = logits.float().clone() if self.matcher is None else logits.float().cpu().clone()
        if self.matcher is not None:
            self.matcher.mask(logits)
        raw = None if p.logprobs is None else torch.log_softmax(logits.float(), dim=-1)  # before the rules
        if self.rules is not None:
            self.rules.apply_(logits)
        token = self._draw(logits)
        if raw is not None:
            assert p.logprobs is not None
            self.last_logprobs = gather_logprobs(raw, token, p.logprobs)
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float().cpu() / p.temperature
        if p.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < probs.max() * p.min_p, float("-inf"))
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


def seeded_generator(seed: int | None) -> torch.Generator:
    """A sequence's random stream: seeded with ``seed`` (as 64 bits), or from the system's entropy when None."""
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
    else:
        generator.seed()
    return generator
