"""Kept-alive HTTP/1.1 connections to one server, on a plain asyncio protocol with httptools' parser, for the two
calls on every request's path: the prefill POST to vLLM (its answer read whole) and the decode node's stream (read
as it comes, :mod:`tilert.router.decode_stream`).

Through aiohttp, a POST and the reading of its answer run several dozen Python calls (the request's objects, a
writer task, the response's reader); here the request is one write of bytes made once, a socket read is one call
(``data_received``, the parsing in C) and a body chunk none (the parser appends it to a list). Those calls run once
per request after the process sat idle while vLLM worked, so each runs cold and costs many times its warm time:
fewer of them is what takes time off the first token. The other calls (health, reserve, release, the watch,
``/tokenize``) stay on aiohttp.

Reading pauses while more than ``high_water`` bytes wait for the reader (a slow client of a stream), as aiohttp's
reader does. A response read to its end on a connection the server keeps goes back to the pool, which drops
connections idle for ``idle_s`` (set below the server's own keep-alive) or closed by the server; any other is
closed (the server then stops: vLLM aborts a request whose connection closed, the decode node its stream).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import cast
from urllib.parse import urlparse

import httptools

__all__ = ["ConnectTimeout", "Connections", "Http1Connection", "StreamBroke", "header_lines"]


class StreamBroke(Exception):
    """The connection ended or broke before the response did, or the server answered outside HTTP/1.1."""


class ConnectTimeout(TimeoutError):
    """No connection within the connect timeout (nothing was sent)."""


def header_lines(headers: dict[str, str]) -> bytes:
    """``headers`` as request header lines; a name or value that could end a line is refused (``ValueError``)."""
    out = []
    for name, value in headers.items():
        if any(ch in name or ch in value for ch in "\r\n\0") or ":" in name or not name:
            raise ValueError(f"HTTP header {name!r}: a name or value that is not one header line")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


class Http1Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: the response being read on it (its head, its body bytes not yet taken) and the task
    waiting for more."""

    def __init__(self, high_water: int) -> None:
        self.high_water = high_water
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.head_done = False
        self.complete = False  # the response's body ended
        self.keep_alive = False
        self.error: BaseException | None = None  # the connection broke, or the bytes were not HTTP
        self.closed = False
        self.chunks: list[bytes] = []  # body bytes not yet taken (this list, never another: see on_body)
        # httptools calls on_body with each chunk's bytes: the list's own append, no Python frame per chunk
        self.on_body = self.chunks.append
        self._parser = httptools.HttpResponseParser(self)  # it looks its callbacks up once, here
        self.size = 0  # bytes received since the reader last took the body (with the chunks' framing)
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.idle_since = 0.0

    # ---- asyncio ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one without deriving from it

    def data_received(self, data: bytes) -> None:
        self.size += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = StreamBroke(f"the answer is not HTTP/1.1: {exc}")
            self.close()
        if self.size > self.high_water and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = StreamBroke(type(exc).__name__ if exc is not None else "the server closed the connection")
        self._wake()

    # ---- httptools ----------------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # ---- the reader's side ----------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until bytes, the response's end, or an error arrive."""
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def take(self) -> bytes:
        """Every body byte that arrived, reading resumed if it was paused."""
        chunks = self.chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.size = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def keep(self, rest: bytes) -> None:
        """``rest`` (bytes not yet used) back in front of what arrives next."""
        if rest:
            self.chunks.insert(0, rest)

    async def read_all(self) -> bytes:
        """The rest of the body, to its end. Raises :class:`StreamBroke`."""
        parts = []
        while True:
            if self.chunks:
                parts.append(self.take())
            if self.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            if self.error is not None:
                raise self.error
            await self.wait()

    @property
    def at_end(self) -> bool:
        """The response ended and its reader took all of it."""
        return self.complete and not self.chunks

    def begin(self, request: bytes) -> None:
        """Send ``request`` for a new response on this connection."""
        assert self.transport is not None
        self.status, self.head_done, self.complete, self.keep_alive = 0, False, False, False
        self.transport.write(request)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class Connections:
    """POSTs to one server over kept-alive connections (no cap on their number: the caller bounds its calls).

    ``url``: the server's root (``http://host:port``, ``https://`` with the system's certificate checks, a path
    prefixed to every call); ``headers``: sent with every request; ``idle_s``: a connection idle longer is closed,
    not reused; ``high_water``: body bytes waiting for the reader before reading pauses."""

    def __init__(
        self, url: str, headers: dict[str, str], connect_timeout_s: float, idle_s: float, high_water: int
    ) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.username is not None:
            raise ValueError(f"not an http(s) URL of a server (no credentials): {parsed.scheme}://{parsed.hostname}")
        self.host = parsed.hostname
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self._tls = ssl.create_default_context() if parsed.scheme == "https" else None
        self._prefix = parsed.path.rstrip("/")
        self.connect_timeout_s, self.idle_s, self.high_water = connect_timeout_s, idle_s, high_water
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        netloc += f":{parsed.port}" if parsed.port else ""
        self._fields = header_lines({"host": netloc, **headers})
        self._idle: collections.deque[Http1Connection] = collections.deque()  # the oldest first
        self._open: set[Http1Connection] = set()

    async def _connection(self) -> Http1Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the others age out
            # (bytes that came while it sat idle are no answer to anything: it is not reused)
            if not conn.closed and not conn.chunks and conn.error is None and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Http1Connection(self.high_water),
                    self.host,
                    self.port,
                    ssl=self._tls,
                    server_hostname=self.host if self._tls is not None else None,
                )
        except TimeoutError:
            raise ConnectTimeout(f"no connection in {self.connect_timeout_s:g} s") from None
        return conn

    async def post(self, path: str, body: bytes, headers: bytes = b"") -> Http1Connection:
        """POST ``body`` to ``path`` (``headers``: more header lines, :func:`header_lines`); the connection once the
        response's head came (``status``). Raises ``OSError``, :class:`ConnectTimeout` (no connection),
        :class:`StreamBroke`. The caller must :meth:`finish` it."""
        conn = await self._connection()
        self._open.add(conn)
        try:
            head = b"POST %s HTTP/1.1\r\n" % (self._prefix + path).encode("latin-1")
            conn.begin(head + self._fields + headers + b"content-length: %d\r\n\r\n" % len(body) + body)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            self._open.discard(conn)
            conn.close()
            raise
        return conn

    async def call(self, path: str, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
        """POST ``body`` to ``path``; the response's status and whole body. Raises as :meth:`post`; cancelled, the
        connection is closed (the server stops working on it)."""
        conn = await self.post(path, body, headers)
        try:
            return conn.status, await conn.read_all()
        finally:
            self.finish(conn)

    def finish(self, conn: Http1Connection) -> None:
        """The response is left: its connection back to the pool when it was read to its end, else closed."""
        self._open.discard(conn)
        now = time.monotonic()
        if conn.at_end and conn.keep_alive and not conn.closed:
            conn.idle_since = now
            self._idle.append(conn)
        else:
            conn.close()
        idle = self._idle  # those that aged out or the server closed, dropped (a burst's connections do not linger)
        while idle and (idle[0].closed or now - idle[0].idle_since >= self.idle_s):
            idle.popleft().close()

    def close(self) -> None:
        for conn in [*self._idle, *self._open]:
            conn.close()
        self._idle.clear()
        self._open.clear()
