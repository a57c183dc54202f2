"""The streaming clients: the OpenAI SDK's ``AsyncOpenAI`` against the router, ``users`` streams at once, each a
greedy request (``temperature`` 0, ``ignore_eos``, ``max_tokens`` = the tokens asked, ``return_token_ids``) timed
at the client: each chunk that carries token ids, when it arrived and which ids. Each user streams from a process of
its own (:class:`Clients`), all starting at one instant, so that parsing the SDK's chunks never slows another
user's stream: the client's speed is not what is measured."""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing as mp
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from openai import AsyncOpenAI


@dataclass
class Stream:
    """One request as the client saw it."""

    user: int
    request_id: str
    start: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # per chunk carrying tokens
    counts: list[int] = field(default_factory=list)  # the tokens of each of those chunks
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.start

    @property
    def decode_s(self) -> float:
        """First token to last."""
        return self.arrivals[-1] - self.arrivals[0]

    def tokens_between(self, t0: float, t1: float) -> int:
        """Tokens whose chunk arrived in ``(t0, t1]``."""
        return sum(n for t, n in zip(self.arrivals, self.counts, strict=True) if t0 < t <= t1)

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    def summary(self) -> dict[str, Any]:
        """What the result file keeps of the stream."""
        return {
            "user": self.user,
            "request_id": self.request_id,
            "ttft_ms": 1000 * self.ttft_s if self.arrivals else None,
            "tokens_per_s": (len(self.token_ids) - 1) / self.decode_s if len(self.arrivals) > 1 else None,
            "tokens": len(self.token_ids),
            "chunks": len(self.arrivals),
            "error": self.error,
        }


def request_body(api: str, prompt: list[int], text: str) -> dict[str, Any]:
    """The prompt part of a request: token ids for ``completions``, the prompt's text as one user message for
    ``chat`` (the prefill tokenizes it through the chat template)."""
    if api == "chat":
        return {"messages": [{"role": "user", "content": text}]}
    return {"prompt": prompt}


async def stream_one(
    client: AsyncOpenAI, api: str, model: str, body: dict[str, Any], tokens: int, user: int, request_id: str
) -> Stream:
    s = Stream(user, request_id)
    extra = {"ignore_eos": True, "return_token_ids": True}
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "extra_body": extra,
        "extra_headers": {"x-request-id": request_id},
    }
    s.start = time.perf_counter()
    try:
        if api == "chat":
            stream: Any = await client.chat.completions.create(messages=body["messages"], **common)
        else:
            # The ids in extra_body, which the SDK sends as it is: as ``prompt`` it walks every id through its request
            # types before sending (client CPU linear in the prompt), and the time to first token would measure the
            # client more than the serving path.
            common["extra_body"] = {**extra, "prompt": body["prompt"]}
            stream = await client.completions.create(prompt="", **common)
        async with stream:  # closed here, in this loop: not left to the collector once the loop has stopped
            async for chunk in stream:
                now = time.perf_counter()
                if not chunk.choices:
                    continue
                ids = getattr(chunk.choices[0], "token_ids", None)
                if ids:
                    s.arrivals.append(now)
                    s.counts.append(len(ids))
                    s.token_ids.extend(ids)
    except Exception as exc:  # noqa: BLE001 - a failed stream is a result to report, not a crash
        s.error = f"{type(exc).__name__}: {exc}"[:300]
    if s.error is None and len(s.token_ids) != tokens:
        s.error = f"{len(s.token_ids)} of {tokens} tokens streamed"
    return s


class _Process:
    """What a client process keeps from one request to the next: its event loop and its client of each router (its
    connection kept alive, as a user's client keeps it: a new one would put a TCP connection in every first token)."""

    loop: asyncio.AbstractEventLoop | None = None
    clients: dict[str, AsyncOpenAI] = {}  # noqa: RUF012 - one process's state


def _user(
    base_url: str, api: str, model: str, body: dict[str, Any], tokens: int, user: int, rid: str, at: float
) -> Stream:
    """One user's stream in a client process, sent at wall-clock time ``at``."""

    async def go() -> Stream:
        client = _Process.clients.get(base_url)
        if client is None:
            client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600.0)
            _Process.clients[base_url] = client
        await asyncio.sleep(max(0.0, at - time.time()))
        return await stream_one(client, api, model, body, tokens, user, rid)

    if _Process.loop is None:
        _Process.loop = asyncio.new_event_loop()
        atexit.register(_close_clients)
    return _Process.loop.run_until_complete(go())


def _close_clients() -> None:
    """The process's clients closed in their own loop as it exits (their connections' tasks end there, not in the
    collector after the loop is gone)."""

    async def close_all() -> None:
        await asyncio.gather(*(c.close() for c in _Process.clients.values()))

    loop = _Process.loop
    if loop is not None and not loop.is_closed():
        loop.run_until_complete(close_all())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


class Clients:
    """A process per user (spawned once, kept for every row)."""

    def __init__(self, users: int) -> None:
        self.pool = ProcessPoolExecutor(max_workers=users, mp_context=mp.get_context("spawn"))
        list(self.pool.map(time.sleep, [0.0] * users))  # the processes started before the first row

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def run_users(
        self, base_url: str, api: str, model: str, bodies: list[dict[str, Any]], tokens: int, users: int, tag: str
    ) -> list[Stream]:
        """``users`` streams at once, user ``u`` sending ``bodies[u]``; request ids ``{tag}-u{u}``."""
        at = time.time() + 0.2  # every process has its client ready by then
        futures = [
            self.pool.submit(_user, base_url, api, model, bodies[u], tokens, u, f"{tag}-u{u}", at) for u in range(users)
        ]
        return [f.result() for f in futures]


def steady_tok_s(streams: list[Stream]) -> float | None:
    """The median user's tok/s while every stream decodes: from the last stream's first decode chunk (every prefill
    and transfer done) to the first stream's last chunk. None when the streams never decode all at once."""
    if not streams or any(len(s.arrivals) < 3 for s in streams):
        return None
    t0, t1 = max(s.arrivals[1] for s in streams), min(s.arrivals[-1] for s in streams)
    if t1 <= t0:
        return None
    return med([s.tokens_between(t0, t1) / (t1 - t0) for s in streams])


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
