"""The decode loop: inject the handed-off prompt state, then step, sample and emit token by token.

Runs on a worker thread (the engine blocks); ``emit`` hands each step's tokens to the event loop
as soon as they exist, so nothing is batched on a timer. ``cancel`` is checked between steps.

The fast path comes from the engine's declared :class:`~tilert.engines.base.Capabilities`: greedy requests
on an engine with ``mtp`` decode speculatively (``num_draft`` drafts per step, verified by the main model),
which yields exactly the plain greedy tokens, several per step; other greedy requests use
``greedy_stream`` when the engine declares ``pipelined_greedy``. Sampled requests (temperature > 0) decode
one token per step from the logits: MTP is switched off for them.

:func:`run_decode` owns token-level stopping (EOS, ``stop_token_ids``, ``max_tokens``, the end of the
engine's cache, cancellation) and says why it stopped (:class:`Finish`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from tilert.decode.sampling import DecodeParams, Sampler
from tilert.engines.base import DecodeEngine, KVLayout

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True)
class Finish:
    """Why :func:`run_decode` stopped.

    ``reason``: ``"stop"`` (an EOS token or one of ``stop_token_ids`` was emitted, as the last token),
    ``"length"`` (``max_tokens`` emitted, or the engine's cache is full) or ``"cancelled"``.
    ``stop_token_id``: the token when it stopped on one of ``stop_token_ids``; None when it stopped on EOS
    (a token that is both EOS and a stop id counts as EOS, as vLLM reports it) and for length / cancelled.
    """

    reason: FinishReason
    stop_token_id: int | None = None


def run_decode(
    engine: DecodeEngine,
    state: dict[str, torch.Tensor],
    layouts: dict[str, KVLayout],
    num_tokens: int,
    params: DecodeParams,
    eos_token_ids: frozenset[int],
    emit: Callable[[list[int], Finish | None], None],
    cancel: threading.Event,
    num_draft: int = 0,
) -> Finish:
    """Decode after a prompt of ``num_tokens`` tokens (KV ``state``), starting from ``params.first_token_id``
    (already emitted by prefill, fed at position ``num_tokens``); ``emit`` every new token, the stop token
    included, as ``emit(ids, None)``, the last batch as ``emit(ids, finish)`` (so the stream's last line
    says which token ended it). A finish with nothing left to emit (cancelled, an engine whose stream
    ended early) is only returned.

    ``params.max_tokens`` bounds the new tokens; None: until the engine's cache is full (its
    ``Capabilities.max_seq_len``; the last step runs at position ``max_seq_len - 1``). Either way the end of
    the cache finishes with ``"length"``.
    """
    caps = engine.capabilities()
    room = caps.max_seq_len - num_tokens if caps.max_seq_len > 0 else None  # steps the cache has left
    if params.max_tokens is None:
        if room is None:
            raise ValueError(f"the {engine.name} engine declares no max_seq_len: max_tokens is required")
        limit = room
    else:
        limit = params.max_tokens if room is None else min(params.max_tokens, room)
    engine.inject(state, layouts, num_tokens)
    eos: frozenset[int] = frozenset() if params.ignore_eos else eos_token_ids
    stop_ids = frozenset(params.stop_token_ids)
    speculate = params.greedy and num_draft > 0 and caps.mtp
    sampler = Sampler(params)
    token, pos = params.first_token_id, num_tokens
    # Plain greedy on an engine that pipelines it (the next step runs while this token is emitted).
    stream: Iterator[int] | None = None
    if params.greedy and not speculate and caps.pipelined_greedy and limit > 0:
        stream = engine.greedy_stream(token, pos, limit)
    produced = 0
    while produced < limit:
        if cancel.is_set():
            return Finish("cancelled")
        if stream is not None:
            nxt = next(stream, None)
            if nxt is None:  # the engine ended the stream early: its cache is full
                return Finish("length")
            new = [nxt]
        elif speculate:
            new = engine.speculative_greedy_step(token, pos, num_draft).tokens
        else:
            logits = engine.forward(torch.tensor([token], dtype=torch.long), pos)
            new = [sampler(logits[-1])]
        new = new[: limit - produced]
        for i, t in enumerate(new):
            if t in eos or t in stop_ids:
                finish = Finish("stop", None if t in eos else t)
                emit(new[: i + 1], finish)
                return finish
        produced += len(new)
        if produced >= limit:
            emit(new, Finish("length"))
            return Finish("length")
        emit(new, None)
        pos += len(new)
        token = new[-1]
    return Finish("length")
