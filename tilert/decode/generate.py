"""The decode loop: inject the handed-off prompt state, then step, sample and emit token by token.

Runs on a worker thread (the engine blocks); ``emit`` hands each step's tokens to the event loop
as soon as they exist, so nothing is batched on a timer. ``cancel`` is checked between steps.

Greedy requests on an engine with an MTP module decode speculatively (``num_draft`` drafts per step,
verified by the main model), which yields exactly the plain greedy tokens, several per step; other greedy
requests use the engine's pipelined ``greedy_stream`` when it has one. Sampled requests (temperature > 0)
decode one token per step from the logits: MTP is switched off for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tilert.decode.sampling import DecodeParams, Sampler
from tilert.engines.base import DecodeEngine, KVLayout


def run_decode(
    engine: DecodeEngine,
    state: dict[str, torch.Tensor],
    layouts: dict[str, KVLayout],
    num_tokens: int,
    params: DecodeParams,
    eos_token_ids: frozenset[int],
    emit: Callable[[list[int]], None],
    cancel: threading.Event,
    num_draft: int = 0,
) -> str:
    """Returns the finish reason: ``"stop"``, ``"length"`` or ``"cancelled"``."""
    engine.inject(state, layouts, num_tokens)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    speculate = params.greedy and num_draft > 0 and bool(getattr(engine, "supports_mtp", False))
    sampler = Sampler(params)
    token, pos = params.first_token_id, num_tokens
    # Plain greedy on an engine that pipelines it (the next step runs while this token is emitted).
    stream = None
    if params.greedy and not speculate and hasattr(engine, "greedy_stream"):
        stream = engine.greedy_stream(token, pos, params.max_tokens)
    produced = 0
    while produced < params.max_tokens:
        if cancel.is_set():
            return "cancelled"
        if stream is not None:
            nxt = next(stream, None)
            if nxt is None:  # the engine's cache is full
                return "length"
            new = [nxt]
        elif speculate:
            step = engine.speculative_greedy_step(token, pos, num_draft)  # type: ignore[attr-defined]
            new = step.tokens
        else:
            logits = engine.forward(torch.tensor([token], dtype=torch.long), pos)
            new = [sampler(logits[-1])]
        new = new[: params.max_tokens - produced]
        for i, t in enumerate(new):
            if t in stops:
                emit(new[: i + 1])
                return "stop"
        emit(new)
        produced += len(new)
        pos += len(new)
        token = new[-1]
    return "length"
