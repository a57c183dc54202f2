"""The decode loop: inject the handed-off prompt state, then step, sample and emit token by token.

Runs on a worker thread (the engine blocks); ``emit`` hands each step's tokens to the event loop
as soon as they exist, so nothing is batched on a timer. ``cancel`` is checked between steps.

The fast path comes from the engine's declared :class:`~tilert.engines.base.Capabilities`: greedy requests
on an engine with ``mtp`` decode speculatively (``speculative_stream``: ``num_draft`` drafts per step, verified by
the main model), which yields exactly the plain greedy tokens, several per step; other greedy requests use
``greedy_stream`` when the engine declares ``pipelined_greedy``. Greedy requests whose logits a rule changes
(penalties, bias, ``min_tokens``, one-token bad words, a grammar) use the engine's ``shaped_greedy_stream``, which
applies the rules inside its own steps. Sampled requests (temperature > 0), bad words of several tokens and requests
that ask for each token's log-probabilities decode one token per step from the logits and the host's sampler. MTP
serves plain greedy requests only.

:class:`SequenceRun` owns token-level stopping for one sequence (EOS, ``stop_token_ids``, ``max_tokens``,
the end of the engine's cache, cancellation) and says why it stopped (:class:`Finish`); :func:`run_decode`
drives one sequence alone, :mod:`tilert.decode.batch` several at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from tilert.contracts import TokenLogprobs
from tilert.decode.grammar import Grammars
from tilert.decode.sampling import DecodeParams, Sampler
from tilert.engines.base import DecodeEngine, KVLayout

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class SpecCounts:
    """A decode's speculative steps, as vLLM counts them: steps that drafted (``drafts``), the tokens they drafted
    (``draft_tokens``) and, per draft position, how many steps had it accepted (``accepted_per_pos[i]``: the
    steps whose first ``i + 1`` drafts were accepted)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_per_pos)

    def step(self, drafted: int, accepted: int) -> SpecCounts:
        """These counts and one step that drafted ``drafted`` tokens and had ``accepted`` of them accepted."""
        if drafted <= 0:
            return self
        return self + SpecCounts(1, drafted, (1,) * accepted)

    def __add__(self, other: SpecCounts) -> SpecCounts:
        a, b = self.accepted_per_pos, other.accepted_per_pos
        n = max(len(a), len(b))
        per_pos = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n))
        return SpecCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens, per_pos)


@dataclass(frozen=True)
class Finish:
    """Why decoding stopped.

    ``reason``: ``"stop"`` (an EOS token or one of ``stop_token_ids`` was emitted, as the last token),
    ``"length"`` (``max_tokens`` emitted, or the engine's cache is full) or ``"cancelled"``.
    ``stop_token_id``: the token when it stopped on one of ``stop_token_ids``; None when it stopped on EOS
    (a token that is both EOS and a stop id counts as EOS, as vLLM reports it) and for length / cancelled.
    """

    reason: FinishReason
    stop_token_id: int | None = None
    spec: SpecCounts | None = None  # a job's (DecodeBatch's done): its speculative steps, when it took any


class Emit(Protocol):
    """Where a sequence's tokens go: ``emit(ids, finish)``, and ``emit(ids, finish, logprobs)`` (one entry a token)
    for a request that asks for log-probabilities."""

    def __call__(
        self, ids: list[int], finish: Finish | None, logprobs: list[TokenLogprobs] | None = None, /
    ) -> None: ...


class SequenceRun:
    """One sequence's decode after its prompt of ``num_tokens`` tokens was injected into engine sequence
    ``seq``: the next input (``token`` at ``pos``), its sampler and its stop rules.

    ``emit`` gets every new token, the stop token included, as ``emit(ids, None)``, the last batch as
    ``emit(ids, finish)`` (so the stream's last line says which token ended it); a finish with nothing left
    to emit (cancelled) is only returned.
    """

    def __init__(
        self,
        engine: DecodeEngine,
        params: DecodeParams,
        eos_token_ids: frozenset[int],
        num_tokens: int,
        emit: Emit,
        cancel: threading.Event,
        seq: int = 0,
        grammars: Grammars | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        """``generator``: the sequence's random stream when it began before the run (a choice that drew its own
        first token); by default the sampler's own, seeded with ``params.seed``."""
        caps = engine.capabilities()
        room = caps.max_seq_len - num_tokens if caps.max_seq_len > 0 else None  # steps the cache has left
        limits = [n for n in (params.max_tokens, room) if n is not None]
        if not limits:
            raise ValueError(f"the {engine.name} engine declares no max_seq_len: max_tokens is required")
        self.limit: int = min(limits)
        self.params, self.emit, self.cancel, self.seq = params, emit, cancel, seq
        self.eos: frozenset[int] = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids)
        matcher = None
        if params.grammar is not None:
            if grammars is None:
                raise ValueError("this decode has no grammar compiler: structured outputs cannot be served")
            matcher = grammars.matcher(params.grammar, self.eos | self.stop_ids)
            matcher.accept([params.first_token_id])  # prefill's token, sampled under the same grammar
        self.sampler = Sampler(params, self.eos | self.stop_ids, matcher, generator)
        self.token, self.pos, self.produced = params.first_token_id, num_tokens, 0
        self._logprobs: list[TokenLogprobs] = []  # of the tokens sampled and not yet emitted
        self.spec = SpecCounts()  # its speculative steps
        self.finish: Finish | None = None if self.limit > 0 else Finish("length")

    @property
    def done(self) -> bool:
        return self.finish is not None

    def check_cancel(self) -> bool:
        if self.finish is None and self.cancel.is_set():
            self.finish = Finish("cancelled")
        return self.done

    def sample(self, logits: torch.Tensor) -> int:
        token = self.sampler(logits)
        if self.sampler.last_logprobs is not None:
            self._logprobs.append(self.sampler.last_logprobs)
        return token

    def accept(self, new: list[int]) -> Finish | None:
        """Take a step's tokens: emit them (cut at the limit or at a stop token); the finish, if any."""
        new = new[: self.limit - self.produced]
        self.sampler.observe(new)
        for i, t in enumerate(new):
            if t in self.eos or t in self.stop_ids:
                self.finish = Finish("stop", None if t in self.eos else t)
                self._emit(new[: i + 1], self.finish)
                return self.finish
        self.produced += len(new)
        if self.produced >= self.limit:
            self.finish = Finish("length")
            self._emit(new, self.finish)
            return self.finish
        self._emit(new, None)
        self.pos += len(new)
        self.token = new[-1]
        return None

    def _emit(self, ids: list[int], finish: Finish | None) -> None:
        """``ids`` to ``emit``, with the logprobs of the tokens sampled since the last emit when asked."""
        if self.params.logprobs is None:
            self.emit(ids, finish)
            return
        logprobs, self._logprobs = self._logprobs[: len(ids)], []
        self.emit(ids, finish, logprobs)


def run_decode(
    engine: DecodeEngine,
    state: dict[str, torch.Tensor],
    layouts: dict[str, KVLayout],
    num_tokens: int,
    params: DecodeParams,
    eos_token_ids: frozenset[int],
    emit: Emit,
    cancel: threading.Event,
    num_draft: int = 0,
) -> Finish:
    """Decode one sequence alone (engine sequence 0) on the engine's fastest path for it.

    ``params.max_tokens`` bounds the new tokens; None: until the engine's cache is full (its
    ``Capabilities.max_seq_len``). Either way the end of the cache finishes with ``"length"``.
    """
    run = SequenceRun(engine, params, eos_token_ids, num_tokens, emit, cancel)
    engine.inject(state, layouts, num_tokens)
    decode_alone(engine, run, num_draft)
    assert run.finish is not None
    return run.finish


def decode_alone(
    engine: DecodeEngine,
    run: SequenceRun,
    num_draft: int,
    yield_to: Callable[[], bool] = lambda: False,
    accept_all_drafts: bool = False,
) -> None:
    """Step ``run`` alone on its fast path until it finishes, or ``yield_to()`` says another sequence should
    join (the run then continues later from ``run.token`` at ``run.pos``). ``accept_all_drafts``: the MTP steps
    accept every draft (benchmarks only: see :meth:`DecodeEngine.speculative_greedy_step`)."""
    steps = _fast_steps(engine, run, num_draft, accept_all_drafts)
    try:
        while not run.check_cancel() and not yield_to():
            new = next(steps, None)
            if new is None:  # the engine ended its stream early: its cache is full
                run.finish = Finish("length")
                return
            run.accept(new)
    finally:
        steps.close()


def _fast_steps(
    engine: DecodeEngine, run: SequenceRun, num_draft: int, accept_all_drafts: bool = False
) -> Generator[list[int], None, None]:
    """The new tokens of each step of ``run`` decoded alone, on the fastest path the engine declares."""
    caps, p = engine.capabilities(), run.params
    plain_greedy = p.greedy and not p.needs_logits  # no rule to apply to the logits: the engine's argmax
    if plain_greedy and num_draft > 0 and caps.mtp:
        # The engine may run the next step while this one's tokens are emitted.
        for step in engine.speculative_stream(run.token, run.pos, num_draft, run.seq, accept_all_drafts):
            run.spec = run.spec.step(step.num_drafted, step.num_accepted)
            yield step.tokens
    elif plain_greedy and caps.pipelined_greedy:
        # The next step runs while this token is emitted (the engine pipelines them).
        for token in engine.greedy_stream(run.token, run.pos, run.limit - run.produced, seq=run.seq):
            yield [token]
    elif p.greedy and p.logprobs is None and (rules := run.sampler.rules) is not None and rules.device_ready:
        # The engine applies the rules (and the grammar's mask) inside its own steps.
        shaping = rules.shaping(engine.vocab_size, "cpu")
        matcher = run.sampler.matcher
        next_mask = matcher.next_bitmask if matcher is not None else None
        left = run.limit - run.produced
        for token in engine.shaped_greedy_stream(run.token, run.pos, left, shaping, next_mask, seq=run.seq):
            yield [token]
    else:
        while True:
            logits = engine.forward(torch.tensor([run.token], dtype=torch.long), run.pos, seq=run.seq)
            yield [run.sample(logits[-1])]
