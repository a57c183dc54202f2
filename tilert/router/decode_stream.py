"""The decode node's NDJSON stream (``POST /v1/decode``), read as it comes on a kept-alive HTTP/1.1 connection of
:mod:`tilert.router.http1`.

The stream is on every relayed token's path. Read through aiohttp, each of the node's lines (one HTTP chunk) cost
about eight Python calls of its stream reader before the relay saw it; here a socket read is one call and a chunk
none. The relay takes every complete line that arrived since it last asked, decoded in one call
(``contracts.parse_lines``) with the token lines of a choice joined (``contracts.join_runs``), so a relay that fell
behind catches up in one event; a line cut across chunks or reads waits for its end.

Reading pauses while more than :data:`HIGH_WATER` bytes wait for the relay (a slow client). A stream left before its
end closes its connection (the node then stops decoding); one read to its end goes back to the node's pool.
"""

from __future__ import annotations

import collections

from tilert import contracts as c
from tilert.router.errors import RouterError
from tilert.router.http1 import Http1Connection, StreamBroke

DECODE_LOST = "decode_lost"  # the outcome of a decode stream that broke or could not be opened (the node is gone)
HIGH_WATER = 4 * c.MAX_LINE_BYTES  # bytes waiting for the relay before reading pauses


class DecodeLines:
    """The lines of one decode stream (an async iterator), the token lines that arrived together joined."""

    def __init__(self, conn: Http1Connection) -> None:
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
