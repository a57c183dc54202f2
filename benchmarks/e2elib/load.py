"""The router-overhead load client: the same request by the router's path (one streaming completion) and by the
direct one (the router's own calls made by the client: reserve, prefill, decode stream), timed from the client,
``concurrency`` at a time in a closed loop.

The router's path has three clients (``CLIENTS``), alike in what they time and check: ``httpx`` (async), ``aiohttp``,
and ``raw``: asyncio streams over kept-alive connections, the request's bytes built once, the chunked SSE body
parsed by hand (the cheapest per event, so that the client is not what caps a run). The direct path is httpx's."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np
import orjson

from tilert import auth
from tilert import contracts as c

CLIENTS = ("httpx", "aiohttp", "raw")  # the router path's load clients
KEEP_ALIVE_S = 4.0  # the raw client's idle connections are not reused after this (uvicorn closes them after 5 s)

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


class _Events:
    """A routed answer's SSE events as they arrive, into its :class:`Sample`: the first event with a choice, the gaps
    between events (those of one read share its time), errors, the usage's token count and ``[DONE]``."""

    def __init__(self, tokens: int) -> None:
        self.sample, self.tokens = Sample(), tokens
        self.t0 = self.last = time.perf_counter()
        self.done = False
        self._buf = b""

    def feed(self, chunk: bytes, now: float) -> None:
        """Body bytes read at ``now``."""
        buf = self._buf + chunk if self._buf else chunk
        if b"\n\n" not in buf:
            self._buf = buf
            return
        *events, self._buf = buf.split(b"\n\n")
        s = self.sample
        for event in events:
            data = event.removeprefix(b"data: ")
            if data == b"[DONE]":
                self.done = True
                continue
            obj = orjson.loads(data)
            if "error" in obj:
                s.error = str(obj["error"])[:200]
            elif obj.get("choices"):
                s.events += 1
                if s.ttfb_s is None:
                    s.ttfb_s = now - self.t0
                else:
                    s.gaps_s.append(now - self.last)
                self.last = now
            elif obj.get("usage"):
                s.tokens = int(obj["usage"]["completion_tokens"])

    def finish(self, error: str | None = None) -> Sample:
        s = self.sample
        s.error = s.error or error
        if s.error is None and (not self.done or s.tokens != self.tokens):
            state = "seen" if self.done else "missing"
            s.error = f"incomplete stream: {s.tokens} of {self.tokens} tokens, [DONE] {state}"
        return s


class LoadClient:
    """The two request paths of the overhead measurement, timed from the client; ``kind``: the router path's client
    (one of ``CLIENTS``)."""

    def __init__(
        self,
        model: Path | str,
        secret: bytes,
        urls: dict[str, str],
        ctrl_port: int,
        prompt: str,
        tokens: int,
        kind: str = "httpx",
    ) -> None:
        if kind not in CLIENTS:
            raise ValueError(f"the load client is one of {', '.join(CLIENTS)}, not {kind!r}")
        self.model, self.secret, self.urls, self.ctrl_port = str(model), secret, urls, ctrl_port
        self.prompt, self.tokens, self.kind = prompt, tokens, kind
        self.node_headers = {
            "authorization": "Bearer " + auth.node_api_token(secret),
            "content-type": "application/json",
        }
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits)
        self.body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._aiohttp: aiohttp.ClientSession | None = None
        self._raw = {url: _RawRoute(url, json.dumps(self.body).encode()) for url in urls.values()}

    async def aclose(self) -> None:
        await self.client.aclose()
        if self._aiohttp is not None:
            await self._aiohttp.close()
        for route in self._raw.values():
            route.close()

    def path(self, mode: str) -> Callable[[], Awaitable[Sample]]:
        """``direct``, or a router's path by its name in ``urls``."""
        if mode == "direct":
            return self.direct
        routed = {"httpx": self.routed_httpx, "aiohttp": self.routed_aiohttp, "raw": self.routed_raw}[self.kind]
        return functools.partial(routed, self.urls[mode])

    async def routed_httpx(self, url: str) -> Sample:
        """One streaming completion through the router at ``url``: first SSE event, then the gaps between events."""
        ev = _Events(self.tokens)
        try:
            async with self.client.stream("POST", url + "/v1/completions", json=self.body) as resp:
                if resp.status_code != 200:
                    return ev.finish(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                async for chunk in resp.aiter_raw():
                    ev.feed(chunk, time.perf_counter())
        except httpx.HTTPError as exc:
            return ev.finish(f"{type(exc).__name__}: {exc}")
        return ev.finish()

    async def routed_aiohttp(self, url: str) -> Sample:
        """As :meth:`routed_httpx`, by aiohttp."""
        if self._aiohttp is None:
            connector = aiohttp.TCPConnector(limit=0)
            self._aiohttp = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120.0))
        ev = _Events(self.tokens)
        try:
            async with self._aiohttp.post(url + "/v1/completions", json=self.body) as resp:
                if resp.status != 200:
                    return ev.finish(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
                async for chunk in resp.content.iter_any():
                    ev.feed(chunk, time.perf_counter())
        except (aiohttp.ClientError, TimeoutError) as exc:
            return ev.finish(f"{type(exc).__name__}: {exc}")
        return ev.finish()

    async def routed_raw(self, url: str) -> Sample:
        """As :meth:`routed_httpx`, over asyncio streams (:class:`_RawRoute`)."""
        ev = _Events(self.tokens)
        try:
            await self._raw[url].stream(ev)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            return ev.finish(f"{type(exc).__name__}: {exc}")
        return ev.finish()

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


class _RawRoute:
    """The streaming completion to one router over asyncio streams: kept-alive connections, the request's bytes built
    once (every request of a run is the same), the response's head read up to its blank line and its chunked body
    parsed by hand."""

    def __init__(self, url: str, body: bytes) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        )
        self.request = head.encode() + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []  # (..., idle since)

    def close(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        self.idle.clear()

    async def _send(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """The request sent and its response's head read, on a kept-alive connection if one is idle (once more on a
        fresh one if the server had closed it: uvicorn drops those idle for ``timeout_keep_alive``, 5 s)."""
        while self.idle:
            reader, writer, since = self.idle.pop()
            if time.monotonic() - since > KEEP_ALIVE_S:
                writer.close()
                continue
            writer.write(self.request)
            try:
                return reader, writer, await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(self.request)
        return reader, writer, await reader.readuntil(b"\r\n\r\n")

    async def stream(self, ev: _Events) -> None:
        reader, writer, head = await self._send()
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        if b"transfer-encoding: chunked" not in lower:
            sized = lower.split(b"content-length:", 1)
            body = await reader.readexactly(int(sized[1].split(b"\r\n", 1)[0]) if len(sized) == 2 else 0)
            writer.close()
            ev.sample.error = f"HTTP {status}: {body[:200]!r}"
            return
        buf, pos = b"", 0
        while True:
            data = await reader.read(1 << 16)
            if not data:
                writer.close()
                raise ConnectionError("the router closed the stream")
            now = time.perf_counter()
            buf = buf[pos:] + data if pos < len(buf) else data
            pos, payload, ended = _dechunk(buf)
            if payload:
                ev.feed(payload, now)
            if ended:
                break
        if status != 200:
            ev.sample.error = ev.sample.error or f"HTTP {status}"
        if pos == len(buf) and b"connection: close" not in lower:
            self.idle.append((reader, writer, time.monotonic()))
        else:
            writer.close()


def _dechunk(buf: bytes) -> tuple[int, bytes, bool]:
    """The complete chunks at the start of ``buf`` (HTTP/1.1 chunked coding): where they end, their payload, and
    whether the last (empty) chunk was among them."""
    pos, parts = 0, []
    while True:
        nl = buf.find(b"\r\n", pos)
        if nl < 0:
            return pos, b"".join(parts), False
        size = int(buf[pos:nl].split(b";", 1)[0], 16)
        end = nl + 2 + size + 2
        if size == 0:  # no trailers: the body ends with an empty line after the last chunk
            if len(buf) < nl + 4:
                return pos, b"".join(parts), False
            return nl + 4, b"".join(parts), True
        if len(buf) < end:
            return pos, b"".join(parts), False
        parts.append(buf[nl + 2 : end - 2])
        pos = end


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
