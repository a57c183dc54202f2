"""The router's prefill POST (``tilert.router.prefill.post_prefill`` on ``tilert.router.http1``'s kept-alive
connections) against a raw HTTP/1.1 server on loopback that answers as a test says: the request's bytes as vLLM
reads them, answers cut across reads, chunked, a connection kept or closed, a connection that breaks, a server that
never answers, a call cancelled (the server must see its connection close: vLLM then aborts the request), a server
that is not there, and HTTPS with a certificate the client trusts."""

from __future__ import annotations

import asyncio
import datetime
import functools
import ipaddress
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest

from tilert.router.errors import RouterError
from tilert.router.http1 import Connections, header_lines
from tilert.router.prefill import InstanceFailed, PrefillClient, post_prefill, prefill_client
from tilert.router.validation import build_plan

pytestmark = pytest.mark.timeout(60)

PLAN = build_plan("completions", orjson.dumps({"model": "m", "prompt": [5, 6, 7], "max_tokens": 8}))
CLAIM = {"tilert_claim": "c-1"}
ANSWER = orjson.dumps({"id": "cmpl-1", "choices": [{"index": 0, "text": "x", "token_ids": [9]}], "pad": "p" * 3000})

# what a server does with one request: given its head and body, writes to the writer
Answer = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[None]]


def whole(status: int = 200, body: bytes = ANSWER, extra: bytes = b"") -> Answer:
    """An answer with a content-length, written in pieces of 700 bytes (several reads on the client)."""

    async def write(head: bytes, got: bytes, writer: asyncio.StreamWriter) -> None:
        data = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s" % (
            status,
            extra,
            len(body),
            body,
        )
        for i in range(0, len(data), 700):
            writer.write(data[i : i + 700])
            await writer.drain()
            await asyncio.sleep(0.002)

    return write


async def chunked(head: bytes, got: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
    for i in range(0, len(ANSWER), 1000):
        part = ANSWER[i : i + 1000]
        writer.write(b"%x\r\n%s\r\n" % (len(part), part))
        await writer.drain()
    writer.write(b"0\r\n\r\n")


async def broken(head: bytes, got: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(ANSWER), ANSWER[:100]))
    await writer.drain()
    raise ConnectionResetError  # the server's end of the connection closes mid-body


def silent(server: Server) -> Answer:
    """No answer: waits until the client closes the connection, and tells ``server``."""

    async def wait(head: bytes, got: bytes, writer: asyncio.StreamWriter) -> None:
        reader = server.readers[-1]
        if await reader.read(1) == b"":
            server.closed_by_client.set()

    return wait


class Server:
    """A loopback server answering its requests in turn; what it saw: the requests' heads and bodies, the
    connections it accepted and how many of them the client closed."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = answers
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.readers: list[asyncio.StreamReader] = []
        self.port = 0  # once started by serving()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.readers.append(reader)
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                sizes = [h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                body = await reader.readexactly(int(sizes[0]))
                self.requests.append((head, body))
                await self.answers.pop(0)(head, body, writer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def start(self, tls: ssl.SSLContext | None = None) -> asyncio.Server:
        return await asyncio.start_server(self.handle, "127.0.0.1", 0, ssl=tls)


def run(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """``test`` run on an event loop of its own (pytest's fixtures passed through)."""

    @functools.wraps(test)
    def sync(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return sync


def _port(server: asyncio.Server) -> int:
    return int(server.sockets[0].getsockname()[1])


def client_of(url: str, timeout_s: float = 10.0, api_key: str | None = "k-123") -> PrefillClient:
    return prefill_client(url, timeout_s=timeout_s, connect_timeout_s=2.0, api_key=api_key)


@asynccontextmanager
async def serving(srv: Server, path: str = "", **kw: Any) -> AsyncIterator[PrefillClient]:
    """``srv`` started on loopback (its port in ``srv.port``) and a client of it (``client_of``'s ``kw``), both
    closed after."""
    server = await srv.start()
    srv.port = _port(server)
    client = client_of(f"http://127.0.0.1:{srv.port}{path}", **kw)
    try:
        yield client
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


async def call(client: PrefillClient, request_id: str = "r-1") -> dict[str, Any]:
    return await post_prefill(client, PLAN, CLAIM, request_id=request_id)


@run
async def test_the_request_is_vllms_and_a_kept_connection_serves_the_next_call() -> None:
    srv = Server([whole(), chunked, whole()])
    async with serving(srv, "/prefix/") as client:
        for rid in ("r-1", "r-2", "r-3"):
            assert await call(client, rid) == orjson.loads(ANSWER)
    assert srv.connections == 1  # kept alive across the three calls, chunked or not
    head, body = srv.requests[0]
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "POST /prefix/v1/completions HTTP/1.1"
    fields = dict(line.split(": ", 1) for line in lines[1:] if line)
    assert fields["host"] == f"127.0.0.1:{srv.port}"
    assert fields["authorization"] == "Bearer k-123"
    assert fields["x-request-id"] == "r-1"
    assert fields["content-type"] == "application/json"
    assert orjson.loads(body) == PLAN.prefill_body(CLAIM)
    assert [
        dict(x.split(": ", 1) for x in h.decode().split("\r\n")[1:] if x)["x-request-id"] for h, _ in srv.requests
    ] == [
        "r-1",
        "r-2",
        "r-3",
    ]


@run
async def test_a_connection_the_server_closes_is_not_reused() -> None:
    srv = Server([whole(extra=b"connection: close\r\n"), whole()])
    async with serving(srv, api_key=None) as client:
        await call(client)
        await call(client)
    assert srv.connections == 2
    assert b"authorization" not in srv.requests[0][0].lower()


@run
async def test_vllms_4xx_reaches_the_client_and_its_5xx_is_the_instances_failure() -> None:
    refusal = orjson.dumps({"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}})
    async with serving(Server([whole(400, refusal), whole(500, b"oops")])) as client:
        with pytest.raises(RouterError) as got:
            await call(client)
        assert got.value.status == 400 and "prompt too long" in got.value.message and got.value.body == refusal
        with pytest.raises(InstanceFailed) as failed:
            await call(client)
        assert failed.value.status == 502 and failed.value.retry


@run
async def test_a_broken_connection_and_an_absent_server_fail_the_instance_for_a_retry() -> None:
    srv = Server([broken])
    async with serving(srv) as client:
        with pytest.raises(InstanceFailed) as got:
            await call(client)
        assert (got.value.status, got.value.retry) == (502, True), got.value.message
        assert got.value.message.startswith("prefill server unreachable")
    gone = client_of(f"http://127.0.0.1:{srv.port}")  # nothing listens there now
    try:
        with pytest.raises(InstanceFailed) as got:
            await call(gone)
        assert (got.value.status, got.value.retry) == (502, True)
    finally:
        await gone.aclose()


@run
async def test_a_server_that_never_answers_times_out_without_a_retry() -> None:
    srv = Server([])
    srv.answers.append(silent(srv))
    async with serving(srv, timeout_s=0.3) as client:
        with pytest.raises(InstanceFailed) as got:
            await call(client)
        assert (got.value.status, got.value.retry, got.value.message) == (504, False, "prefill timed out")
        # the timed-out call's connection was closed, not kept: the server saw it go
        await asyncio.wait_for(srv.closed_by_client.wait(), 5)


@run
async def test_a_cancelled_call_closes_its_connection() -> None:
    srv = Server([])
    srv.answers.append(silent(srv))
    async with serving(srv) as client:
        task = asyncio.ensure_future(call(client))
        for _ in range(200):
            if srv.requests:
                break
            await asyncio.sleep(0.01)
        assert srv.requests, "the request never reached the server"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(srv.closed_by_client.wait(), 5)


@run
async def test_connections_left_idle_past_their_time_are_closed_and_dropped() -> None:
    srv = Server([whole() for _ in range(9)])
    server = await srv.start()
    conns = Connections(f"http://127.0.0.1:{_port(server)}", {}, connect_timeout_s=2.0, idle_s=0.5, high_water=1 << 20)
    try:
        got = await asyncio.gather(*(conns.call("/p", b"{}") for _ in range(3)))  # a burst: three connections
        assert [status for status, _ in got] == [200] * 3 and srv.connections == 3
        burst = list(conns._idle)
        for _ in range(5):  # one call at a time after it, each on the most recently used connection
            await asyncio.sleep(0.15)
            assert (await conns.call("/p", b"{}"))[0] == 200
        assert srv.connections == 3
        assert list(conns._idle) == [burst[-1]]  # the two left idle since the burst: closed and dropped
        assert all(c.closed for c in burst[:-1]) and not burst[-1].closed
        await asyncio.sleep(0.6)
        assert (await conns.call("/p", b"{}"))[0] == 200 and srv.connections == 4  # the aged one is not reused
    finally:
        conns.close()
        server.close()


@run
async def test_a_connection_that_got_bytes_while_idle_is_not_reused() -> None:
    async def then_stray(head: bytes, got: bytes, writer: asyncio.StreamWriter) -> None:
        await whole()(head, got, writer)
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstray")  # an answer to nothing

    srv = Server([then_stray, whole()])
    async with serving(srv) as client:
        await call(client)
        await asyncio.sleep(0.2)
        assert await call(client) == orjson.loads(ANSWER)
        assert srv.connections == 2


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@run
async def test_https_checks_the_servers_certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    srv = Server([whole(), whole()])
    server = await srv.start(tls)
    url = f"https://127.0.0.1:{_port(server)}"
    untrusting = client_of(url)  # the system's roots: the self-signed certificate is refused
    try:
        with pytest.raises(InstanceFailed) as got:
            await call(untrusting)
        assert got.value.status == 502 and "SSL" in got.value.message, got.value.message
    finally:
        await untrusting.aclose()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # now a root the client trusts
    trusting = client_of(url)
    try:
        assert await call(trusting) == orjson.loads(ANSWER)
    finally:
        await trusting.aclose()
        server.close()


def test_a_header_that_could_end_its_line_is_refused() -> None:
    assert header_lines({"x-request-id": "r-1"}) == b"x-request-id: r-1\r\n"
    for bad in ({"x-request-id": "r\r\nevil: 1"}, {"x-a\n": "v"}, {"x:a": "v"}, {"": "v"}):
        with pytest.raises(ValueError):
            header_lines(bad)
