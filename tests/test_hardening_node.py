"""Nothing a client sends can kill, block or steer a decode node: fuzzing its HTTP API and its control
port with random, truncated, oversized and type-confused input, against a real ``tilert decode``
process on loopback (real engine, real TCP transport).

After every batch of inputs the node must still answer ``/health``, hold no slot, and its memory must
stay bounded. The specific frames and requests that killed or blocked a node before are replayed by
name.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.stack import free_port, wait_healthy

from tilert import auth
from tilert import contracts as c

pytestmark = pytest.mark.timeout(300)

SECRET = "fuzz-secret-" + "0123456789abcdef" * 2
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    http: str
    ctrl_port: int
    headers: dict[str, str]

    def health(self) -> dict[str, object]:
        assert self.proc.poll() is None, f"decode node exited with {self.proc.returncode}"
        resp = httpx.get(self.http + "/health", timeout=10)
        assert resp.status_code == 200
        return resp.json()  # type: ignore[no-any-return]

    def assert_intact(self) -> None:
        health = self.health()
        assert health["slots_free"] == health["slots_total"], health

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)


@contextmanager
def _decode_node(model: Path, log: Path) -> Iterator[Node]:
    """A real ``tilert decode`` on loopback, SIGTERMed on the way out."""
    ctrl, http = free_port(), free_port()
    env = {**os.environ, auth.SECRET_ENV: SECRET}
    env.pop(auth.SECRET_FILE_ENV, None)
    cmd = [sys.executable, "-m", "tilert.cli", "decode", "--model", str(model)]
    cmd += f"--ctrl-port {ctrl} --http-port {http} --slots 2 --max-seq-len 256".split()
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=err)
    try:
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, proc, 120, log)
        token = auth.node_api_token(SECRET.encode())
        yield Node(proc, url, ctrl, {"authorization": f"Bearer {token}", "content-type": "application/json"})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def node(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    """The node the module's tests share: none of them stops it. Its teardown is a check: whatever the tests sent
    it, in whichever order, the node still serves and holds no slot."""
    with _decode_node(tiny_model, tmp_path_factory.mktemp("fuzz") / "decode.log") as handle:
        yield handle
        handle.assert_intact()


def _control(node: Node, data: bytes, read_s: float = 0.3) -> bytes:
    """Send raw bytes to the control port and read what comes back within ``read_s``."""
    with socket.create_connection(("127.0.0.1", node.ctrl_port), timeout=5) as sock:
        try:
            sock.sendall(data)
        except OSError:
            return b""
        sock.settimeout(read_s)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except (TimeoutError, OSError):
            pass
        return got


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _hello() -> bytes:
    return c.encode(c.Hello.signed(SECRET.encode(), "tcp", "fuzzer"))


# ---- the inputs that killed a node before -----------------------------------------------------------------
@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x00\x00\x011",  # a 1-byte frame holding the JSON number 1
        _frame(b'{"type":"hello","version":2,"transport":"tcp","sender_id":"x","auth":["a"]}'),
        _frame(b"[]"),
        _frame(b'{"type": 7}'),
        b"\xff\xff\xff\xff" + b"x" * 100,  # a length far past the frame cap
        b"\x00\x00\x10",  # a truncated header
    ],
)
def test_malformed_frames_before_hello_do_not_stop_the_node(node: Node, data: bytes) -> None:
    reply = _control(node, data)
    if len(reply) > 4:
        assert isinstance(c.decode(reply[4:]), c.Reject)
    node.assert_intact()


@pytest.mark.parametrize(
    "body",
    [
        b'{"type":"offer","transfer_id":"t1","num_tokens":3,"layouts":[]}',
        b'{"type":"abort","transfer_id":["a","b"],"reason":"x"}',
        b'{"type":"done","transfer_id":"t1","nbytes":"12"}',
        b'{"type":"offer","transfer_id":"t1","num_tokens":3,"layouts":{"mla":{"kind":"mla_dense"}}}',
        b'{"type":"accept","transfer_id":"t1","target":{}}',
        b"not json at all",
    ],
)
def test_type_confused_frames_after_hello_are_rejected(node: Node, body: bytes) -> None:
    reply = _control(node, _hello() + _frame(body))
    assert isinstance(c.decode(reply[4 : 4 + struct.unpack(">I", reply[:4])[0]]), c.HelloAck)
    node.assert_intact()


def test_unsigned_hello_is_refused(node: Node) -> None:
    hello = c.Hello(c.PROTOCOL_VERSION, "tcp", "intruder", auth.hello_token(b"another secret of 32 bytes!!!!!!", "x"))
    reply = _control(node, c.encode(hello))
    msg = c.decode(reply[4:])
    assert isinstance(msg, c.Reject) and "secret" in msg.reason


def test_silent_and_idle_connections_are_bounded(node: Node) -> None:
    """Connections that say nothing are closed after the hello timeout; a flood of them is refused at
    the cap, and the node keeps serving meanwhile."""
    socks = [socket.create_connection(("127.0.0.1", node.ctrl_port), timeout=5) for _ in range(80)]
    try:
        node.assert_intact()
        reply = _control(node, _hello(), read_s=0.5)  # past the cap: closed at once, or served
        assert reply == b"" or isinstance(c.decode(reply[4:]), c.HelloAck)
    finally:
        for s in socks:
            s.close()
    node.assert_intact()


# ---- the HTTP API --------------------------------------------------------------------------------
def test_api_refuses_a_client_without_the_secret(node: Node) -> None:
    """Nobody without the deployment's secret can reserve, decode or release a slot, or watch the node."""
    for path, body in (
        ("/v1/reserve", {"transfer_id": "a"}),
        ("/v1/release", {"transfer_id": "a"}),
        ("/v1/decode", {"transfer_id": "a", "first_token_id": 1, "prompt_tokens": 3}),
    ):
        for headers in ({}, {"authorization": "Bearer " + auth.node_api_token(b"not the secret, but 32 bytes!!")}):
            resp = httpx.post(node.http + path, json=body, headers=headers, timeout=5)
            assert resp.status_code == 401 and "token" in resp.json()["error"]["message"]
        resp = httpx.get(node.http + "/v1/watch", headers=headers, timeout=5)
        assert resp.status_code == 401 and "token" in resp.json()["error"]["message"]
    node.assert_intact()


def test_release_before_reserve_refuses_the_late_reserve(node: Node) -> None:
    """A router that gave up on a reserve releases the id; the reserve arriving later must not take a slot."""
    rel = httpx.post(node.http + "/v1/release", json={"transfer_id": "late-1"}, headers=node.headers, timeout=5)
    assert rel.status_code == 200 and rel.json() == {"released": False}
    res = httpx.post(node.http + "/v1/reserve", json={"transfer_id": "late-1"}, headers=node.headers, timeout=5)
    assert res.status_code == 409
    node.assert_intact()


def test_reserve_is_idempotent_and_checks_the_sampling_first(node: Node) -> None:
    """A repeated reserve (a router retrying after a dropped connection) gets the same slot and holds no
    second one; sampling the node cannot honour is refused at reserve (nothing held, the id spent)."""
    url, h = node.http + "/v1/reserve", node.headers
    first = httpx.post(url, json={"transfer_id": "again-1", "sampling": {"max_tokens": 4}}, headers=h, timeout=5)
    again = httpx.post(url, json={"transfer_id": "again-1"}, headers=h, timeout=5)
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert first.json()["max_seq_len"] == node.health()["max_seq_len"]
    assert node.health()["slots_free"] == int(node.health()["slots_total"]) - 1  # type: ignore[call-overload]
    httpx.post(node.http + "/v1/release", json={"transfer_id": "again-1"}, headers=h, timeout=5)
    bad = httpx.post(url, json={"transfer_id": "bad-stop", "sampling": {"stop_token_ids": [1 << 30]}}, headers=h)
    assert bad.status_code == 422 and "stop_token_ids" in bad.json()["error"]["message"]
    assert httpx.post(url, json={"transfer_id": "bad-stop"}, headers=h, timeout=5).status_code == 409
    node.assert_intact()


def test_a_reserve_of_n_choices_holds_n_slots_and_more_than_the_node_decodes_is_refused(node: Node) -> None:
    """``n`` choices decode as ``n`` sequences: the reserve holds ``n`` slots, an ``n`` above what the node decodes at
    once (here its 2 slots) is refused at reserve with the reason, and a decode must ask the ``n`` it reserved."""
    url, h = node.http + "/v1/reserve", node.headers
    cap = node.health()["max_choices"]
    assert cap == 2  # --slots 2, under the engine's sequences
    over = httpx.post(url, json={"transfer_id": "n-over", "sampling": {"n": 3}}, headers=h, timeout=5)
    assert over.status_code == 422 and "n must be at most 2" in over.json()["error"]["message"]
    two = httpx.post(url, json={"transfer_id": "n-two", "sampling": {"n": 2, "temperature": 1.0}}, headers=h)
    assert two.status_code == 200 and node.health()["slots_free"] == 0
    full = httpx.post(url, json={"transfer_id": "n-one"}, headers=h, timeout=5)
    assert full.status_code == 429
    body = {"transfer_id": "n-two", "first_token_id": 1, "prompt_tokens": 3}  # n=1 for a reservation of 2
    wrong = httpx.post(node.http + "/v1/decode", json=body, headers=h, timeout=5)
    assert wrong.status_code == 400 and "reservation was for n=2" in wrong.json()["error"]["message"]
    node.assert_intact()  # the refused decode released its reservation: both slots back


def test_errors_name_no_internal_ids_and_bound_leases(node: Node) -> None:
    tid = "secret-transfer-id-123"
    resp = httpx.post(
        node.http + "/v1/decode",
        headers=node.headers,
        timeout=5,
        json={"transfer_id": tid, "first_token_id": 1, "prompt_tokens": 3},
    )
    assert resp.status_code == 404 and tid not in resp.text
    resp = httpx.post(node.http + "/v1/reserve", json={"transfer_id": "x", "lease_s": 1e9}, headers=node.headers)
    assert resp.status_code == 400
    for path in ("/nope", "/v1/cancel"):
        resp = httpx.post(node.http + path, headers=node.headers, timeout=5)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == 404
    node.assert_intact()


def test_oversized_body_is_413(node: Node) -> None:
    """A release past the API limit; a reserve (which may carry a grammar and a logit bias) past its larger one."""
    for path, limit in (("/v1/release", c.MAX_API_BODY_BYTES), ("/v1/reserve", c.MAX_DECODE_BODY_BYTES)):
        big = b'{"transfer_id": "' + b"a" * (limit + 10) + b'"}'
        resp = httpx.post(node.http + path, content=big, headers=node.headers, timeout=30)
        assert resp.status_code == 413, path
    node.assert_intact()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
field_names = st.sampled_from(["transfer_id", "lease_s", "first_token_id", "prompt_tokens", "sampling", "x"])
sampling_names = st.sampled_from(
    ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "x"]
)
bodies = st.dictionaries(
    field_names, json_values | st.dictionaries(sampling_names, json_values, max_size=6), max_size=6
)


@FUZZ
@given(
    path=st.sampled_from(["/v1/reserve", "/v1/release", "/v1/decode"]),
    body=bodies,
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_fuzz_http_api(node: Node, path: str, body: dict[str, object], raw: bytes | None) -> None:
    content = raw if raw is not None else json.dumps(body).encode()  # (stdlib: also ints past 64 bits)
    with httpx.Client(timeout=10) as client:
        resp = client.post(node.http + path, content=content, headers=node.headers)
        assert resp.status_code < 500, resp.text
        if resp.status_code >= 400:
            assert c.parse(c.ErrorBody, resp.content).error.code == resp.status_code
        if path == "/v1/reserve" and resp.status_code == 200:
            tid = resp.json()["transfer_id"]
            client.post(node.http + "/v1/release", json={"transfer_id": tid}, headers=node.headers)
        if path == "/v1/decode" and resp.status_code == 200:
            assert b'"type":"error"' in resp.content  # nothing was ever transferred for it


frame_types = st.sampled_from(["hello", "hello_ack", "offer", "accept", "done", "abort", "ack", "reject", "zzz"])
frame_fields = st.sampled_from(
    [
        "transfer_id",
        "num_tokens",
        "layouts",
        "nbytes",
        "reason",
        "target",
        "version",
        "transport",
        "sender_id",
        "auth",
        "x",
    ]
)


@FUZZ
@given(
    kind=frame_types,
    fields=st.dictionaries(frame_fields, json_values, max_size=6),
    after_hello=st.booleans(),
    cut=st.integers(0, 64),
    mode=st.sampled_from(["whole", "truncated", "raw"]),
    raw=st.binary(max_size=96),
)
def test_fuzz_control_port(
    node: Node, kind: str, fields: dict[str, object], after_hello: bool, cut: int, mode: str, raw: bytes
) -> None:
    frame = _frame(json.dumps({"type": kind, **fields}).encode())
    data = {"whole": frame, "truncated": frame[: max(0, len(frame) - 1 - cut)], "raw": raw}[mode]
    reply = _control(node, (_hello() if after_hello else b"") + data, read_s=0.05)
    assert len(reply) <= 4 * c.MAX_FRAME_BYTES
    assert node.proc.poll() is None


def _data_port(node: Node) -> int:
    """The TCP transport's listening port (the one that is neither the control nor the HTTP port)."""
    http_port = int(node.http.rsplit(":", 1)[1])
    ports = {
        conn.laddr.port
        for conn in psutil.Process(node.proc.pid).net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    } - {node.ctrl_port, http_port}
    assert len(ports) == 1, ports
    return ports.pop()


@FUZZ
@given(
    key=st.binary(min_size=16, max_size=16),
    offset=st.integers(0, 2**64 - 1),
    nbytes=st.integers(0, 2**64 - 1),
    tail=st.binary(max_size=64),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_fuzz_data_port(node: Node, key: bytes, offset: int, nbytes: int, tail: bytes, raw: bytes | None) -> None:
    """Writes without a live grant (random keys, offsets, lengths, garbage) are refused; the node serves on."""
    data = raw if raw is not None else struct.pack(">16sQQ", key, offset, nbytes) + tail
    with socket.create_connection(("127.0.0.1", _data_port(node)), timeout=5) as sock:
        sock.sendall(data)
        sock.settimeout(0.05)
        try:
            reply = sock.recv(16)
        except (TimeoutError, OSError):
            reply = b""
    assert reply in (b"", b"\x00")  # refused, or still waiting for a header: never "written"
    assert node.proc.poll() is None


def test_after_fuzzing_the_node_is_whole_and_memory_is_bounded(node: Node) -> None:
    """400 malformed inputs: still serving, no slot held, memory within bounds."""
    before = node.rss()
    for _ in range(200):
        _control(node, _hello() + _frame(b'{"type":"offer","transfer_id":"m","num_tokens":1,"layouts":[]}'), 0.0)
        httpx.post(node.http + "/v1/reserve", content=b"[" * 5000, headers=node.headers, timeout=5)
    node.assert_intact()
    assert node.rss() - before < 64 << 20, "memory grew by more than 64 MiB over 400 malformed inputs"


def test_the_watch_beats_until_the_node_stops(tiny_model: Path, tmp_path: Path) -> None:
    """The watch stream (``GET /v1/watch``) beats with the node's id, at once and every ``NODE_BEAT_S``; a SIGTERM
    ends it, so the node's graceful shutdown (uvicorn waits for every open response) is not held by the routers
    watching it. On a node of its own: it stops the node."""
    with _decode_node(tiny_model, tmp_path / "decode.log") as node:
        _watch_until_stopped(node)


def _watch_until_stopped(node: Node) -> None:
    node_id = node.health()["node_id"]
    with httpx.stream("GET", node.http + "/v1/watch", headers=node.headers, timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
        lines = resp.iter_lines()
        t0 = time.monotonic()
        beats = [c.parse(c.NodeBeat, next(lines)) for _ in range(2)]
        assert [b.node_id for b in beats] == [node_id] * 2
        assert 0.5 * c.NODE_BEAT_S < time.monotonic() - t0 < 3 * c.NODE_BEAT_S
        node.proc.terminate()
        deadline = time.monotonic() + 10
        for line in lines:  # the stream ends (a beat may still come first)
            assert time.monotonic() < deadline, "the watch stream outlived the node's SIGTERM by 10 s"
            assert c.parse(c.NodeBeat, line).node_id == node_id
    node.proc.wait(timeout=10)
