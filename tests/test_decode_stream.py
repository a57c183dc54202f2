"""The router's reader of the decode node's NDJSON stream (``tilert.router.decode_stream``, through
``NodeClient.decode``) against a raw HTTP/1.1 server on loopback that cuts its bytes where a test says: lines across
chunks and reads, several lines in a chunk, a line without its newline at the end, a connection kept for the next
stream, a line too long, a connection that breaks mid-line, a relay that stops reading for a while."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tilert import contracts as c
from tilert.router.config import DecodeNodeSpec
from tilert.router.decode_stream import DECODE_LOST
from tilert.router.errors import RouterError
from tilert.router.node_client import NodeClient

pytestmark = pytest.mark.timeout(60)

SECRET = b"decode-stream-test-secret-0123456789"
REQUEST = c.DecodeRequest("t-1", 5, 3, c.Sampling(max_tokens=8))
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"

# what a server does with one request: writes to the writer (the request already read)
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def lines_of(*lines: c.TokenLine | c.ErrorLine) -> bytes:
    return b"".join(c.dump_line(line) for line in lines)


async def serve(answers: list[Answer]) -> tuple[asyncio.Server, list[int]]:
    """A server answering its requests in turn with ``answers``; the list it returns counts its connections."""
    connections = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        try:
            while answers:
                head = await reader.readuntil(b"\r\n\r\n")
                sizes = [h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                length = int(sizes[0])
                c.parse(c.DecodeRequest, await reader.readexactly(length))
                await answers.pop(0)(writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


async def read(client: NodeClient) -> list[c.TokenLine | c.ErrorLine]:
    async with client.decode(REQUEST) as lines:
        return [line async for line in lines]


def run(answers: list[Answer], body: Callable[[NodeClient], Awaitable[object]]) -> tuple[object, int]:
    """``body`` against a server of ``answers``; what it returned and the connections the server saw."""

    async def main() -> tuple[object, int]:
        server, connections = await serve(answers)
        client = NodeClient(DecodeNodeSpec("127.0.0.1", 1, server.sockets[0].getsockname()[1]), 2.0, 2.0, SECRET)
        try:
            return await body(client), connections[0]
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(main())


def test_lines_arrive_whole_however_the_bytes_are_cut() -> None:
    """Every token in order and the finish, whether a chunk holds several lines or a piece of one and a read several
    chunks or a piece of one; lines that arrived together come joined (one line of one choice)."""
    tokens = list(range(100, 140))
    body = lines_of(*(c.TokenLine([t]) for t in tokens[:-1]), c.TokenLine([tokens[-1]], "length"))

    async def cut(writer: asyncio.StreamWriter, sizes: tuple[int, ...], pause: bool) -> None:
        writer.write(HEAD)
        at, i = 0, 0
        while at < len(body):
            part = body[at : at + sizes[i % len(sizes)]]
            at, i = at + len(part), i + 1
            framed = chunk(part)
            for half in (framed[:3], framed[3:]) if pause else (framed,):  # a chunk's framing cut across reads
                writer.write(half)
                if pause:
                    await writer.drain()
                    await asyncio.sleep(0.002)
        writer.write(b"0\r\n\r\n")

    shapes = [((7,), True), ((1, 30, 2), True), ((len(body),), False), ((13, 500), False)]
    answers: list[Answer] = [lambda w, s=s, p=p: cut(w, s, p) for s, p in shapes]

    async def body_(client: NodeClient) -> list[list[c.TokenLine | c.ErrorLine]]:
        return [await read(client) for _ in shapes]

    got, connections = run(answers, body_)
    assert isinstance(got, list)
    for lines in got:
        assert [t for line in lines for t in line.token_ids] == tokens  # type: ignore[union-attr]
        assert [line.finish_reason for line in lines][-1] == "length"  # type: ignore[union-attr]
        assert all(line.finish_reason is None for line in lines[:-1])  # type: ignore[union-attr]
    assert len(got[2]) == 1  # all of it in one read: one line
    assert connections == 1  # each stream read to its end left the connection for the next


def test_the_last_line_may_come_without_its_newline_and_errors_pass_as_lines() -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD + chunk(lines_of(c.TokenLine([1, 2])) + c.dump(c.ErrorLine(500, "engine gone"))))
        writer.write(b"0\r\n\r\n")

    got, _ = run([answer], read)
    assert got == [c.TokenLine([1, 2]), c.ErrorLine(500, "engine gone")]


@pytest.mark.parametrize("fault", ["over-long", "outside the contract", "broke mid-line", "refused"])
def test_a_faulty_stream_is_the_relays_error(fault: str) -> None:
    async def answer(writer: asyncio.StreamWriter) -> None:
        if fault == "refused":
            reply = c.error_body("n=3, but the reservation was for n=1", 400)
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(reply), reply))
            return
        writer.write(HEAD + chunk(lines_of(c.TokenLine([1]))))
        await writer.drain()
        await asyncio.sleep(0.05)  # the good line read alone (a fault read with it fails the read, line and all)
        if fault == "over-long":
            for _ in range(c.MAX_LINE_BYTES // 4096 + 2):
                writer.write(chunk(b"7" * 4096))
        elif fault == "outside the contract":
            writer.write(chunk(b'{"type": "tokens", "token_ids": ["x"]}\n'))
        else:
            writer.write(chunk(b'{"type": "tok'))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.transport.abort()  # type: ignore[attr-defined]

    async def body(client: NodeClient) -> tuple[list[c.TokenLine | c.ErrorLine], RouterError | None]:
        got: list[c.TokenLine | c.ErrorLine] = []
        try:
            async with client.decode(REQUEST) as lines:
                async for line in lines:
                    got.append(line)
        except RouterError as exc:
            return got, exc
        return got, None

    result, _ = run([answer], body)
    assert isinstance(result, tuple)
    got, error = result
    assert error is not None
    if fault == "refused":
        assert (error.status, error.outcome, got) == (400, "decode_refused", [])
        assert "reservation was for n=1" in str(error)
        return
    assert got == [c.TokenLine([1])]  # what came whole before the fault is relayed
    expected = {"over-long": "over-long line", "outside the contract": "outside the contract"}
    assert error.status == 502
    assert error.outcome == ("decode_error" if fault in expected else DECODE_LOST)
    assert expected.get(fault, "decode stream broke") in str(error)


def test_an_unreachable_node_is_lost_at_once() -> None:
    async def main() -> RouterError:
        free = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = free.sockets[0].getsockname()[1]
        free.close()
        await free.wait_closed()
        client = NodeClient(DecodeNodeSpec("127.0.0.1", 1, port), 2.0, 2.0, SECRET)
        try:
            await read(client)
        except RouterError as exc:
            return exc
        finally:
            await client.aclose()
        raise AssertionError("no error")

    error = asyncio.run(main())
    assert (error.status, error.outcome) == (502, DECODE_LOST) and "unreachable" in str(error)


def test_a_relay_that_stops_reading_pauses_the_socket_and_loses_nothing() -> None:
    """While a relay behind a slow client leaves the lines unread, the reader stops taking bytes from the socket once
    a few lines' worth wait (the node's writes then wait, as they would for aiohttp's reader) and takes them again as
    the relay reads: every token arrives, in order."""
    tokens = [10_000 + i % 50_000 for i in range(300_000)]  # about 2 MB of lines

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        for at in range(0, len(tokens), 500):
            last = at + 500 >= len(tokens)
            writer.write(chunk(c.dump_line(c.TokenLine(tokens[at : at + 500], "length" if last else None))))
        writer.write(b"0\r\n\r\n")

    async def body(client: NodeClient) -> tuple[list[int], bool]:
        got: list[int] = []
        async with client.decode(REQUEST) as lines:
            got += (await lines.__anext__()).token_ids  # type: ignore[union-attr]
            await asyncio.sleep(0.5)  # a relay behind a slow client
            paused = lines._conn.paused  # type: ignore[attr-defined]
            async for line in lines:
                got += line.token_ids  # type: ignore[union-attr]
        return got, paused

    result, _ = run([answer], body)
    assert result == (tokens, True)
