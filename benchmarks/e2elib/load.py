"""The router-overhead load client: the same request by the router's path (one streaming completion) and by the
direct one (the router's own calls made by the client: reserve, prefill, decode stream), timed from the client,
``concurrency`` at a time in a closed loop."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from tilert import auth
from tilert import contracts as c

PROMPT_WORDS = (
    "def fibonacci ( n ) : if n < 2 : return n return fibonacci ( n - 1 ) + fibonacci ( n - 2 ) "
    "class Stack : def push ( self , item ) : self . items . append ( item ) "
).split()


def overhead_prompt(words: int) -> str:
    """A prompt of ``words`` code-like words."""
    return " ".join(PROMPT_WORDS[i % len(PROMPT_WORDS)] for i in range(words))


@dataclass
class Sample:
    ttfb_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    events: int = 0  # SSE events that carried a choice (routed path)
    error: str | None = None


class LoadClient:
    """The two request paths of the overhead measurement, timed from the client."""

    def __init__(
        self, model: Path, secret: bytes, urls: dict[str, str], ctrl_port: int, prompt: str, tokens: int
    ) -> None:
        self.model, self.secret, self.urls, self.ctrl_port = str(model), secret, urls, ctrl_port
        self.prompt, self.tokens = prompt, tokens
        self.node_headers = {
            "authorization": "Bearer " + auth.node_api_token(secret),
            "content-type": "application/json",
        }
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits)

    async def aclose(self) -> None:
        await self.client.aclose()

    def path(self, mode: str) -> Callable[[], Awaitable[Sample]]:
        """``direct``, or a router's path by its name in ``urls``."""
        if mode == "direct":
            return self.direct
        return functools.partial(self.routed, self.urls[mode])

    async def routed(self, url: str) -> Sample:
        """One streaming completion through the router at ``url``: first SSE event, then the gaps between events."""
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        s = Sample()
        t0 = time.perf_counter()
        last = t0
        done = False
        try:
            async with self.client.stream("POST", url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return s
                buf = b""
                async for chunk in resp.aiter_raw():
                    now = time.perf_counter()
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        data = event.removeprefix(b"data: ")
                        if data == b"[DONE]":
                            done = True
                            continue
                        obj = orjson.loads(data)
                        if "error" in obj:
                            s.error = str(obj["error"])[:200]
                        elif obj.get("choices"):
                            s.events += 1
                            if s.ttfb_s is None:
                                s.ttfb_s = now - t0
                            else:
                                s.gaps_s.append(now - last)
                            last = now
                        elif obj.get("usage"):
                            s.tokens = int(obj["usage"]["completion_tokens"])
        except httpx.HTTPError as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        if s.error is None and (not done or s.tokens != self.tokens):
            s.error = f"incomplete stream: {s.tokens} of {self.tokens} tokens, [DONE] {'seen' if done else 'missing'}"
        return s

    async def direct(self) -> Sample:
        """The router's calls made by the client itself: reserve, prefill (timed to first byte), decode stream."""
        tid = uuid.uuid4().hex
        claim = c.Claim.signed(self.secret, tid, "127.0.0.1", self.ctrl_port)
        s = Sample()
        try:
            reserve = c.dump(c.ReserveRequest(tid, 60.0))
            resp = await self.client.post(
                self.urls["decode"] + "/v1/reserve", content=reserve, headers=self.node_headers
            )
            if resp.status_code != 200:
                s.error = f"reserve HTTP {resp.status_code}"
                return s
            body = {
                "model": self.model,
                "prompt": self.prompt,
                "temperature": 0,
                "ignore_eos": True,
                "max_tokens": 1,
                "stream": False,
                "return_token_ids": True,
                "kv_transfer_params": claim.to_params(),
            }
            t0 = time.perf_counter()
            async with self.client.stream("POST", self.urls["prefill"] + "/v1/completions", json=body) as pre:
                raw = b""
                async for chunk in pre.aiter_raw():
                    if s.ttfb_s is None:
                        s.ttfb_s = time.perf_counter() - t0
                    raw += chunk
            last = time.perf_counter()
            result = c.ClaimResult.from_params(orjson.loads(raw).get("kv_transfer_params"))
            if pre.status_code != 200 or result is None or result.first_token_id is None:
                s.error = f"prefill HTTP {pre.status_code} without a claim result"
                return s
            s.tokens = 1
            req = c.DecodeRequest(
                tid,
                result.first_token_id,
                int(result.prompt_tokens or 1),
                c.Sampling(max_tokens=self.tokens - 1, temperature=0.0, ignore_eos=True),
            )
            async with self.client.stream(
                "POST", self.urls["decode"] + "/v1/decode", content=c.dump(req), headers=self.node_headers
            ) as dec:
                if dec.status_code != 200:
                    s.error = f"decode HTTP {dec.status_code}"
                    return s
                buf = b""
                async for chunk in dec.aiter_raw():  # read as the SSE path reads, so both cost the client alike
                    now = time.perf_counter()
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        parsed = c.parse_line(line)
                        if isinstance(parsed, c.ErrorLine):
                            s.error = parsed.message
                            break
                        s.gaps_s.append(now - last)
                        last = now
                        s.tokens += len(parsed.token_ids)
            await self.client.post(
                self.urls["decode"] + "/v1/release", content=c.dump(c.ReleaseRequest(tid)), headers=self.node_headers
            )
        except (httpx.HTTPError, c.ContractError, ValueError) as exc:
            s.error = f"{type(exc).__name__}: {exc}"
        if s.error is None and s.tokens != self.tokens:
            s.error = f"incomplete: {s.tokens} of {self.tokens} tokens"
        return s


async def drive(one: Callable[[], Awaitable[Sample]], concurrency: int, total: int) -> tuple[list[Sample], float]:
    """``total`` requests, ``concurrency`` at a time (closed loop); returns the samples and the wall time."""
    samples: list[Sample] = []
    remaining = [total]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            samples.append(await one())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, q))


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """One run's p50 / p99 time to first byte and gaps between tokens (successful requests only), its errors and
    its token rate."""
    ok = [s for s in samples if s.error is None]
    ttfb = [s.ttfb_s * 1000 for s in ok if s.ttfb_s is not None]
    gaps = [g * 1000 for s in ok for g in s.gaps_s]
    errors = [s.error for s in samples if s.error is not None]
    return {
        "requests": len(samples),
        "errors": len(errors),
        "error_samples": errors[:3],
        "ttfb_p50_ms": _pct(ttfb, 50),
        "ttfb_p99_ms": _pct(ttfb, 99),
        "itl_p50_ms": _pct(gaps, 50),
        "itl_p99_ms": _pct(gaps, 99),
        "tokens_per_s": sum(s.tokens for s in ok) / wall_s if wall_s else None,
        "tokens_per_event": sum(s.tokens for s in ok) / events if (events := sum(s.events for s in ok)) else None,
        "wall_s": wall_s,
    }
