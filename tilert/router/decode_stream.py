"""The decode node's NDJSON stream (``POST /v1/decode``), read on a plain asyncio protocol with httptools' HTTP/1.1
parser, over kept-alive connections of one node.

The stream is on every relayed token's path. Read through aiohttp, each of the node's lines (one HTTP chunk) cost
about eight Python calls of its stream reader before the relay saw it; here a socket read is one call
(``data_received``, the parser in C) and a chunk one more (``on_body``, which keeps the bytes). The relay takes
every complete line that arrived since it last asked, decoded in one call (``contracts.parse_lines``) with the token
lines of a choice joined (``contracts.join_runs``), so a relay that fell behind catches up in one event; a line cut
across chunks or reads waits for its end. The node's other calls (reserve, release, health, watch) stay on aiohttp.

Reading pauses while more than ``_HIGH_WATER`` bytes wait for the relay (a slow client), as aiohttp's reader does.
A stream left before its end closes its connection (the node then stops decoding); one read to its end goes back to
the pool, which drops connections idle for ``idle_s`` (before the node's own keep-alive ends) or closed by the node.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import cast

import httptools

from tilert import contracts as c
from tilert.router.errors import RouterError

DECODE_LOST = "decode_lost"  # the outcome of a decode stream that broke or could not be opened (the node is gone)
_HIGH_WATER = 4 * c.MAX_LINE_BYTES  # bytes waiting for the relay before reading pauses


class StreamBroke(Exception):
    """The connection ended or broke before the response did, or the node answered outside HTTP/1.1."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to the node: the response being read on it (its head, its body bytes not yet taken)
    and the task waiting for more."""

    def __init__(self) -> None:
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
        self.size = 0  # bytes received since the relay last took the body (with the chunks' framing)
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
            self.error = StreamBroke(f"the node's answer is not HTTP/1.1: {exc}")
            self.close()
        if self.size > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.error is None:
            self.error = StreamBroke(type(exc).__name__ if exc is not None else "the node closed the connection")
        self._wake()

    # ---- httptools ----------------------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # ---- the relay's side -----------------------------------------------------------------------------

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
        """``rest`` (a line not yet ended) back in front of what arrives next."""
        if rest:
            self.chunks.insert(0, rest)

    def begin(self, request: bytes) -> None:
        """Send ``request`` for a new response on this connection."""
        assert self.transport is not None
        self.status, self.head_done, self.complete, self.keep_alive = 0, False, False, False
        self.transport.write(request)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class DecodeLines:
    """The lines of one decode stream (an async iterator), the token lines that arrived together joined."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._ready: collections.deque[c.TokenLine | c.ErrorLine] = collections.deque()

    def __aiter__(self) -> DecodeLines:
        return self

    async def __anext__(self) -> c.TokenLine | c.ErrorLine:
        """The next line; the stream's faults as :class:`~tilert.router.errors.RouterError` (502)."""
        if self._ready:
            return self._ready.popleft()
        try:
            return await self._next()
        except c.ContractError as exc:
            raise RouterError(
                502, f"decode node sent a line outside the contract: {exc}", outcome="decode_error"
            ) from None
        except StreamBroke as exc:
            raise RouterError(502, f"decode stream broke: {exc}", outcome=DECODE_LOST) from None

    async def _next(self) -> c.TokenLine | c.ErrorLine:
        conn = self._conn
        while True:
            if conn.chunks:
                data = conn.take()
                end = data.rfind(b"\n") + 1  # past the last complete line
                rest = data[end:]
                if len(rest) > c.MAX_LINE_BYTES:
                    raise RouterError(502, "decode node sent an over-long line", outcome="decode_error")
                if end:
                    conn.keep(rest)
                    lines = c.join_runs(c.parse_lines(data[:end] if rest else data))
                    if lines:
                        self._ready.extend(lines[1:])
                        return lines[0]
                    continue
                if conn.complete:  # the last line, without its newline
                    if rest.strip():
                        return c.parse_line(rest)
                    raise StopAsyncIteration
                conn.keep(rest)
            elif conn.complete:
                raise StopAsyncIteration
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def read_all(self) -> bytes:
        """The whole body (of a refusal)."""
        conn, parts = self._conn, []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            if conn.complete:
                return b"".join(parts)
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    @property
    def at_eof(self) -> bool:
        """The response ended and the relay took all of it."""
        return self._conn.complete and not self._conn.chunks and not self._ready


class DecodeConnections:
    """Decode streams to one node over kept-alive connections (no cap on their number: the pool gate bounds the
    streams). ``headers``: sent with every request; ``idle_s``: a connection idle longer is closed, not reused."""

    def __init__(self, host: str, port: int, headers: dict[str, str], connect_timeout_s: float, idle_s: float) -> None:
        self.host, self.port = host, port
        self.connect_timeout_s, self.idle_s = connect_timeout_s, idle_s
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"POST /v1/decode HTTP/1.1\r\nhost: {netloc}\r\n{fields}content-length: ".encode("latin-1")
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def _connection(self) -> _Connection:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the others age out
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        return conn

    async def open(self, body: bytes) -> tuple[int, DecodeLines]:
        """POST ``body`` to ``/v1/decode``; the response's status and its lines once its head came. Raises
        ``OSError`` / ``TimeoutError`` (no connection), :class:`StreamBroke`. The caller must :meth:`finish` it."""
        conn = await self._connection()
        self._open.add(conn)
        try:
            conn.begin(self._head + b"%d\r\n\r\n" % len(body) + body)
            while not conn.head_done:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            self._open.discard(conn)
            conn.close()
            raise
        return conn.status, DecodeLines(conn)

    def finish(self, lines: DecodeLines) -> None:
        """The stream is left: its connection back to the pool when it was read to its end, else closed (the node
        then stops decoding)."""
        conn = lines._conn
        self._open.discard(conn)
        if lines.at_eof and conn.keep_alive and not conn.closed:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in [*self._idle, *self._open]:
            conn.close()
        self._idle.clear()
        self._open.clear()
