"""The engine's own tokens and speed on the same checkpoint and device, in the stand-in's process.

- Tokens: for each prompt, the first token (the argmax of the engine's prefill) and the greedy continuation from the
  prompt's KV as the prefill's paged cache holds it (:meth:`PagedCaches.held_state` through the engine's
  ``inject``: what the decode node receives; lossless for the dense latent, fp8 for ``fp8_ds_mla`` and the DSA
  indexer's keys, as vLLM keeps them), and from the engine's own prefill cache (nothing quantised).
- Speed, per user: alone, ``greedy_stream`` (and the node's own path for a sequence alone: MTP speculative steps when
  the checkpoint has an MTP layer and the node drafts); for ``k`` users, ``greedy_batch_stream`` over ``k``
  sequences, one token each per step (the node's path with company). Each timed once after an untimed run (CUDA:
  graph captures).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from servelib.paged import PagedCaches
from tilert.contracts import KVLayout


def _prefill(caches: PagedCaches, ids: list[int], seq: int) -> int:
    logits = caches.engine.forward(torch.tensor(ids), 0, seq=seq)
    return int(logits[-1].argmax())


def _timed_stream(caches: PagedCaches, ids: list[int], first: int, tokens: int) -> tuple[list[int], float]:
    engine = caches.engine
    engine_sync(engine)
    t0 = time.perf_counter()
    out = list(engine.greedy_stream(first, len(ids), tokens - 1))
    return [first, *out], time.perf_counter() - t0


def engine_sync(engine: Any) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def prompt_tokens(caches: PagedCaches, lays: dict[str, KVLayout], ids: list[int], tokens: int) -> dict[str, Any]:
    """The engine's ``tokens`` greedy tokens for ``ids``: ``handed`` (from the prompt's KV as the paged cache holds
    it) and ``own`` (the engine's own prefill cache), the ``greedy_stream`` time of the ``handed`` run, and how far
    the handed-off KV, back in the engine, lies from its own (``latent_max_err``, ``indexer_max_err``: 0 where the
    layout is lossless, the dense latent)."""
    engine, m, n = caches.engine, caches.engine.model, len(ids)
    first = _prefill(caches, ids, 0)
    own, _ = _timed_stream(caches, ids, first, tokens)
    _prefill(caches, ids, 0)
    mine = (m.kv_cache[:, :n].float().clone(), m.index_cache[:, :n].float().clone())
    engine.inject(caches.held_state(n), lays, n, seq=0)
    errors = [
        float((after[:, :n].float() - before).abs().amax()) if before.numel() else 0.0
        for after, before in zip((m.kv_cache, m.index_cache), mine, strict=True)
    ]
    handed, seconds = _timed_stream(caches, ids, first, tokens)
    return {
        "prompt_tokens": n,
        "handed": handed,
        "own": own,
        "stream_s": seconds,
        "latent_max_err": errors[0],
        "indexer_max_err": errors[1],
    }


def _speculative(
    caches: PagedCaches, lays: dict[str, KVLayout], ids: list[int], tokens: int, drafts: int, accept_all: bool
) -> tuple[float, list[int], float]:
    """``tokens - 1`` tokens after an injected prompt through MTP speculative steps (``speculative_stream``: the
    node's path for a greedy sequence alone; ``accept_all``: every draft accepted, as ``tilert decode
    --accept-all-drafts``): the seconds they took, the tokens (prefill's first, then the steps', cut at
    ``tokens``) and the tokens per step."""
    engine, n = caches.engine, len(ids)
    first = _prefill(caches, ids, 0)
    engine.inject(caches.held_state(n), lays, n, seq=0, last_token_id=ids[-1])
    engine_sync(engine)
    t0 = time.perf_counter()
    out, steps = [first], 0
    stream = engine.speculative_stream(first, n, drafts, accept_all=accept_all)
    while len(out) < tokens:
        out += next(stream).tokens
        steps += 1
    seconds = time.perf_counter() - t0
    stream.close()
    return seconds, out[:tokens], (len(out) - 1) / steps


def _batch(caches: PagedCaches, lays: dict[str, KVLayout], prompts: list[list[int]], steps: int) -> tuple[list, float]:
    """``steps`` steps of ``greedy_batch_stream`` over one sequence per prompt (each injected as the node receives it):
    every sequence's tokens and the seconds the steps took."""
    engine = caches.engine
    tokens, positions = [], []
    for s, ids in enumerate(prompts):
        tokens.append(_prefill(caches, ids, s))
        engine.inject(caches.held_state(len(ids), s), lays, len(ids), seq=s)
        positions.append(len(ids))
    seqs = list(range(len(prompts)))
    out = [[t] for t in tokens]
    engine_sync(engine)
    t0 = time.perf_counter()
    for step in engine.greedy_batch_stream(tokens, positions, seqs, steps):
        for s, t in enumerate(step):
            out[s].append(t)
    return out, time.perf_counter() - t0


def engine_speed(
    caches: PagedCaches,
    lays: dict[str, KVLayout],
    prompts: list[list[int]],
    alone: list[dict[str, Any]],
    users: list[int],
    drafts: int,
    accept_all: bool = False,
    draft_head: str = "model",
    draft_vocab: int | None = None,
) -> dict[int, dict[str, Any]]:
    """Per number of users: the engine's per-user tok/s on the node's path (``tok_s``, ``path``); alone also plain
    ``greedy_stream``'s (``stream_tok_s``) and, with MTP, the tokens per speculative step (``tokens_per_step``),
    the first prompt's tokens on that path (``tokens``) and, unless every draft is accepted, whether they are those
    of the plain stream (``spec_same_as_stream``); with company
    whether each sequence's tokens are those it gets alone (``batch_same``, against ``alone``: :func:`prompt_tokens`
    of each prompt, run before: the untimed first run). ``draft_head`` / ``draft_vocab``: what the drafts' head
    reads, as the node's ``--draft-head`` / ``--draft-vocab`` (token ids ``0..draft_vocab - 1``)."""
    engine = caches.engine
    tokens = len(alone[0]["handed"])
    out: dict[int, dict[str, Any]] = {}
    for k in users:
        if k == 1:
            stream_tok_s = (tokens - 1) / prompt_tokens(caches, lays, prompts[0], tokens)["stream_s"]
            row: dict[str, Any] = {"path": "greedy_stream", "tok_s": stream_tok_s, "stream_tok_s": stream_tok_s}
            if engine.supports_mtp and drafts > 0:
                engine.use_draft_head(draft_head, range(draft_vocab) if draft_vocab else None)
                try:
                    _speculative(caches, lays, prompts[0], tokens, drafts, accept_all)
                    seconds, spec, per_step = _speculative(caches, lays, prompts[0], tokens, drafts, accept_all)
                finally:
                    engine.use_draft_head()
                row["tok_s"] = (tokens - 1) / seconds
                row["tokens_per_step"] = per_step
                how = ", every draft accepted" if accept_all else ""
                how += ", drafts from a block-FP8 head" if draft_head == "fp8" else ""
                how += f", drafts among the first {draft_vocab} tokens" if draft_vocab else ""
                row["path"] = f"speculative_stream (MTP, {drafts} draft{'s' if drafts > 1 else ''}{how})"
                # the node's tokens on that path: with fp8 pages the prompt's last row, recomputed to draft from
                # the first step, is no longer the fp8 row the plain stream reads, so greedy's may differ
                row["tokens"] = spec
                if not accept_all:
                    row["spec_same_as_stream"] = spec == alone[0]["handed"]
            out[k] = row
            continue
        _batch(caches, lays, prompts[:k], min(tokens - 1, 4))
        got, seconds = _batch(caches, lays, prompts[:k], tokens - 1)
        same = all(got[s] == alone[s]["handed"] for s in range(k))
        out[k] = {"path": f"greedy_batch_stream x {k}", "tok_s": (tokens - 1) / seconds, "batch_same": same}
    return out
