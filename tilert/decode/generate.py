"""The decode loop: inject the handed-off prompt state, then step, sample and emit token by token.

Runs on a worker thread (the engine blocks); ``emit`` hands each step's tokens to the event loop
as soon as they exist, so nothing is batched on a timer. ``cancel`` is checked between steps.
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
) -> str:
    """Returns the finish reason: ``"stop"``, ``"length"`` or ``"cancelled"``."""
    engine.inject(state, layouts, num_tokens)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    sampler = Sampler(params)
    token, pos = params.first_token_id, num_tokens
    produced = 0
    while produced < params.max_tokens:
        if cancel.is_set():
            return "cancelled"
        logits = engine.forward(torch.tensor([token], dtype=torch.long), pos)
        token = sampler(logits[-1])
        pos += 1
        produced += 1
        emit([token])
        if token in stops:
            return "stop"
    return "length"
