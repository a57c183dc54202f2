"""One prefill pool, two decode pools, end to end over real HTTP (``tilert up --native``).

One stock vLLM prefill runs ``MultiConnector`` with ``TileRTConnector`` beside vLLM's own ``NixlConnector``;
the TileRT pool is our decode node, the native pool a second stock vLLM instance (NIXL over UCX on loopback).
The oracle: greedy tokens through either pool equal those of the prefill instance alone. Nothing is faked:
a busy TileRT node is made by reserving its slots through its real API, a dead native decode by SIGKILL.

The stack is started once for this module. The test that kills the native decode instance leaves the stack
spent; whichever test comes after it (in any order) gets a fresh stack.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil
import pytest
from support.oracle import MAX_TOKENS, POOL_HEADER, router_answer, source_text
from support.stack import TOOL_FLAGS, Stack, free_port, start_stack, stop_stack, wait_healthy
from support.waiting import wait_until
from tokenizers import Tokenizer

POOL = POOL_HEADER


class PoolsStack:
    """The module's ``tilert up --native`` stack, started on first use and again after a test spent it."""

    def __init__(self, model: Path, logs: Path) -> None:
        self.model, self.logs = model, logs
        self.stack: Stack | None = None
        self.spent = False
        self.starts = 0

    def get(self) -> Stack:
        if self.stack is not None and self.spent:
            stop_stack(self.stack)
            self.stack = None
        if self.stack is None:
            self.starts += 1
            ports = [str(free_port()) for _ in range(3)]
            log = self.logs / f"pools-{self.starts}.log"
            flags = ("--native-port", ports[0], "--prefill-side-port", ports[1], "--native-side-port", ports[2])
            self.stack = start_stack(self.model, log, "--native", *flags, *TOOL_FLAGS)
            self.spent = False
            assert self.stack.native is not None
        return self.stack

    def close(self) -> None:
        if self.stack is not None:
            stop_stack(self.stack)


@pytest.fixture(scope="module")
def pools_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolsStack]:
    holder = PoolsStack(tiny_model, tmp_path_factory.mktemp("logs"))
    yield holder
    holder.close()


@pytest.fixture
def pools(pools_stack: PoolsStack) -> Stack:
    """A whole stack: both pools serving."""
    return pools_stack.get()


@pytest.fixture
def pools_to_heal(pools_stack: PoolsStack) -> Iterator[Stack]:
    """A whole stack the test breaks and ``tilert up`` heals; replaced before any other test uses it unless it is
    whole again at the end of the test (both pools healthy)."""
    stack = pools_stack.get()
    yield stack
    try:
        whole = stack.proc.poll() is None and _router_health(stack)["status"] == "ok"
    except httpx.HTTPError:
        whole = False
    pools_stack.spent = not whole


def _router_health(stack: Stack) -> dict[str, Any]:
    return httpx.get(stack.router + "/health", timeout=10).json()  # type: ignore[no-any-return]


def _restarted(stack: Stack, name: str) -> None:
    """``tilert up`` said that ``name`` died and started it again, and the router says both pools are whole again."""
    wait_until(lambda: _router_health(stack)["status"] == "ok", 180, f"{name} back", interval_s=0.5)
    said = stack.log.read_text(errors="replace")
    assert f"tilert up: {name} exited with status -9; starting it again in 1 s" in said, said[-3000:]


@functools.cache
def _prompts(model: Path) -> list[tuple[str, Any]]:
    return [
        ("completion", "def add(a, b):"),
        ("completion", source_text(300, model, 3000)),
        (
            "chat",
            [
                {"role": "user", "content": source_text(120, model, 6000)},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": "import os"},
            ],
        ),
    ]


def _alone(stack: Stack, kind: str, prompt: Any, max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    """The prefill instance serving the request itself: the oracle."""
    key, path = ("messages", "/v1/chat/completions") if kind == "chat" else ("prompt", "/v1/completions")
    body = {
        "model": str(stack.model),
        key: prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    data = httpx.post(stack.prefill + path, json=body, timeout=120).json()
    assert data["kv_transfer_params"] is None, "a plain request must be left alone by both connectors"
    choice = data["choices"][0]
    return choice["token_ids"], choice["message"]["content"] if kind == "chat" else choice["text"]


_ORACLE: dict[tuple[str, str, str], tuple[list[int], str]] = {}


def _oracle(stack: Stack, kind: str, prompt: Any) -> tuple[list[int], str]:
    """:func:`_alone` asked once per stack and prompt: a greedy answer is the same every time it is asked alone."""
    key = (stack.prefill, kind, json.dumps(prompt))
    if key not in _ORACLE:
        _ORACLE[key] = _alone(stack, kind, prompt)
    return _ORACLE[key]


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_both_pools_token_identical_to_prefill_alone(pools: Stack, stream: bool) -> None:
    for kind, prompt in _prompts(pools.model):
        want_ids, want_text = _oracle(pools, kind, prompt)
        assert len(want_ids) == MAX_TOKENS
        for pool in ("tilert", "vllm"):
            ids, text, usage, served = router_answer(pools.router, pools.model, kind, prompt, stream, pool=pool)
            assert served == pool
            assert (ids, text) == (want_ids, want_text), (pool, kind)
            assert usage["completion_tokens"] == MAX_TOKENS
            assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    metrics = _metrics(pools.router)
    for pool in ("tilert", "vllm"):
        assert f'outcome="ok",pool="{pool}"' in metrics


@pytest.mark.stack
def test_marked_native_and_plain_requests_at_once(pools: Stack) -> None:
    """Marked (TileRT), native-P/D and plain requests share the prefill's batches; each gets vLLM's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [_prompts(pools.model)[i] for i in (0, 2)]
    solo = [_oracle(pools, kind, p) for kind, p in prompts]
    with ThreadPoolExecutor(max_workers=9) as ex:
        jobs = [
            (ex.submit(router_answer, pools.router, pools.model, kind, p, stream, pool=pool), i)
            for i, (kind, p) in enumerate(prompts)
            for pool, stream in (("tilert", True), ("vllm", False))
        ]
        jobs += [
            (ex.submit(router_answer, pools.router, pools.model, kind, p, True, pool="vllm"), i)
            for i, (kind, p) in enumerate(prompts)
        ]
        plain = [(ex.submit(_alone, pools, kind, p), i) for i, (kind, p) in enumerate(prompts)]
        for job, i in jobs:
            assert job.result()[:2] == solo[i]
        for job, i in plain:
            assert job.result() == solo[i]


@pytest.mark.stack
def test_what_the_tilert_pool_cannot_serve_goes_native(pools: Stack) -> None:
    """A field the TileRT pool does not serve (``spaces_between_special_tokens``: its detokenizer has no such
    switch): the native pool serves the request, its response saying why, with vLLM alone's tokens; asking for
    the TileRT pool by header gets the 400 naming the field."""
    body = {
        "model": str(pools.model),
        "prompt": "def add(a, b):",
        "max_tokens": 12,
        "temperature": 0,
        "spaces_between_special_tokens": False,
        "return_token_ids": True,
    }
    alone = httpx.post(pools.prefill + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    r = httpx.post(pools.router + "/v1/completions", json={**body, "stream": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers[POOL] == "vllm" and "'spaces_between_special_tokens'" in r.headers["x-tilert-pool-reason"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    ids = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids") or []]
    assert ids == alone["token_ids"]
    asked = httpx.post(pools.router + "/v1/completions", json=body, headers={POOL: "tilert"}, timeout=30)
    assert asked.status_code == 400 and asked.json()["error"]["param"] == "spaces_between_special_tokens"


@pytest.mark.stack
def test_bad_pool_header_is_refused(pools: Stack) -> None:
    body = {"model": str(pools.model), "prompt": "x", "max_tokens": 4}
    r = httpx.post(pools.router + "/v1/completions", json=body, headers={POOL: "fastest"}, timeout=30)
    assert r.status_code == 400
    assert "x-tilert-pool must be one of tilert, vllm" in r.json()["error"]["message"]


@contextmanager
def _routers(stack: Stack, *flags: tuple[str, ...]) -> Iterator[list[str]]:
    """More routers (``tilert router``, as a user starts it), one per tuple of ``flags``, in front of the same
    prefill and pools; started together, their URLs once all answer."""
    decode = urlparse(stack.decode)
    ctrl = int(httpx.get(stack.decode + "/health", timeout=10).json()["ctrl_port"])
    router_proc = next(p for p in psutil.Process(stack.proc.pid).children(recursive=True) if "router" in p.cmdline())
    env = {**os.environ, "TILERT_SECRET_FILE": router_proc.environ()["TILERT_SECRET_FILE"]}
    procs: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for own in flags:
            port = free_port()
            cmd = [
                *(sys.executable, "-m", "tilert.cli", "router", "--prefill-url", stack.prefill),
                *("--decode", f"{decode.hostname}:{ctrl}:{decode.port}", "--model", str(stack.model)),
                *("--port", str(port), "--native-url", str(stack.native), *own),
            ]
            procs.append((subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"))
        for proc, url in procs:
            wait_healthy(url, proc, 60)
        yield [url for _, url in procs]
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            proc.wait(timeout=30)


@contextmanager
def _tilert_node_full(stack: Stack) -> Iterator[None]:
    """Every slot of the TileRT decode node reserved through its own API (its secret is the stack's)."""
    from tilert.auth import load_secret, node_api_token

    router_proc = next(p for p in psutil.Process(stack.proc.pid).children(recursive=True) if "router" in p.cmdline())
    secret = load_secret(router_proc.environ()["TILERT_SECRET_FILE"])
    headers = {"authorization": "Bearer " + node_api_token(secret)}
    total = int(httpx.get(stack.decode + "/health", timeout=10).json()["slots_total"])
    ids = [f"test-hold-{i}" for i in range(total)]
    try:
        for tid in ids:
            r = httpx.post(stack.decode + "/v1/reserve", json={"transfer_id": tid, "lease_s": 120}, headers=headers)
            assert r.status_code == 200, r.text
        assert httpx.get(stack.decode + "/health", timeout=10).json()["slots_free"] == 0
        yield
    finally:
        for tid in ids:
            httpx.post(stack.decode + "/v1/release", json={"transfer_id": tid}, headers=headers, timeout=10)


@pytest.mark.stack
def test_routing_by_model_and_overflow_to_native(pools: Stack) -> None:
    """Router A: the model routes to the native pool, a header overrides it, and a TileRT request that finds
    no slot within 0.5 s completes on the native pool. Router B (no overflow): 429 with Retry-After."""
    kind, prompt = _prompts(pools.model)[0]
    want = _oracle(pools, kind, prompt)
    models = json.dumps({str(pools.model): "vllm"})
    flags_a = ("--pool-models", models, "--overflow-wait-s", "0.5", "--queue-timeout-s", "120")
    with _routers(pools, flags_a, ("--queue-timeout-s", "0.5")) as (a, b):
        ids, text, _, served = router_answer(a, pools.model, kind, prompt, True)
        assert (ids, text, served) == (*want, "vllm")
        ids, text, _, served = router_answer(a, pools.model, kind, prompt, False, pool="tilert")
        assert (ids, text, served) == (*want, "tilert")
        with _tilert_node_full(pools):
            for stream in (False, True):
                t0 = time.monotonic()
                ids, text, _, served = router_answer(a, pools.model, kind, prompt, stream, pool="tilert")
                assert (ids, text, served) == (*want, "vllm")
                assert time.monotonic() - t0 < 60  # it did not wait out the 120 s queue timeout
            body = {"model": str(pools.model), "prompt": prompt, "max_tokens": 8}
            t0 = time.monotonic()
            r = httpx.post(b + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert r.headers[POOL] == "tilert"
            assert time.monotonic() - t0 < 5
        metrics = _metrics(a)
        assert f'tilert:pool_overflows_total{{model_name="{pools.model}"}} 2.0' in metrics
        assert 'outcome="ok",pool="vllm"' in metrics
        assert 'outcome="queue_timeout",pool="tilert"' in _metrics(b)


def _vllm_series(url: str, prefix: str, label: str = "") -> float:
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix) and label in line)


def _vllm_running(url: str) -> float:
    return _vllm_series(url, "vllm:num_requests_running")


def _vllm_generated(url: str) -> float:
    return _vllm_series(url, "vllm:generation_tokens_total")


@pytest.mark.stack
def test_client_leaving_a_native_stream_aborts_the_native_decode(pools: Stack) -> None:
    """The router closes its connection to the native instance when the client leaves; vLLM aborts the request."""
    assert pools.native is not None
    generated = _vllm_generated(pools.native)
    body = {"model": str(pools.model), "prompt": "def main():", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", pools.router + "/v1/completions", json=body, headers={POOL: "vllm"}, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                assert _vllm_running(pools.native) >= 1
                break
    deadline = time.monotonic() + 30  # vLLM publishes its gauges with its periodic stats
    while _vllm_running(pools.native) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _vllm_running(pools.native) == 0
    assert _vllm_generated(pools.native) - generated < 1000, "the native decode ran on after the client left"
    assert 'outcome="client_disconnected",pool="vllm"' in _metrics(pools.router)


def _native_process(stack: Stack) -> psutil.Process:
    port = str(urlparse(str(stack.native)).port)
    return next(
        p for p in psutil.Process(stack.proc.pid).children() if "vllm" in " ".join(p.cmdline()) and port in p.cmdline()
    )


@pytest.mark.stack
def test_killing_native_decode_fails_its_stream_fast_and_spares_tilert(pools_to_heal: Stack) -> None:
    """The native decode instance dies (SIGKILL) with a native stream and a TileRT
    stream in flight. The native one ends with an error event right after the instance has exited and its last
    token is relayed (within 5 s of the kill: the tokens already buffered are relayed first); the TileRT one is
    untouched (the same tokens as the same request undisturbed, which the other tests tie to vLLM alone). Then
    ``tilert up`` starts the instance again and the native pool serves as before."""
    pools = pools_to_heal
    n_tilert = 1200  # long enough that the decode still runs when the test looks
    tilert_body = {
        "model": str(pools.model),
        "prompt": "def main():",
        "max_tokens": n_tilert,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    native = _native_process(pools)
    in_flight: list[dict[str, Any]] = []

    def tilert_stream(hold: threading.Event | None, started: threading.Event | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        with httpx.stream(
            "POST", pools.router + "/v1/completions", json=tilert_body, headers={POOL: "tilert"}, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3 and started is not None and hold is not None:
                        # the node's slots as the stream starts (read here, not after the main thread wakes: on a
                        # busy host the decode may have run to its end into the socket buffers by then)
                        in_flight.append(httpx.get(pools.decode + "/health", timeout=10).json())
                        started.set()
                        hold.wait(60)  # keep the stream open across the kill
        return events

    def token_ids(events: list[dict[str, Any]]) -> list[int]:
        return [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]

    undisturbed = token_ids(tilert_stream(None, None))
    assert len(undisturbed) == n_tilert
    results: dict[str, list[dict[str, Any]]] = {}
    started, killed = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: results.setdefault("tilert", tilert_stream(killed, started)))
    body = {"model": str(pools.model), "prompt": "class Foo:", "max_tokens": 1500, "temperature": 0, "stream": True}
    lines: list[tuple[float, str]] = []
    t_kill = 0.0
    t_gone: list[float] = []

    native_port = urlparse(str(pools.native)).port
    assert native_port is not None

    def watch_exit() -> None:
        """When the killed instance's sockets are closed: its port refuses connections. (Not when its main thread
        is a zombie: the other threads of a SIGKILLed process may take a second more to exit on a slow host, and
        its sockets stay open until the last one has, and the router and tilert up see the death only then.)"""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", native_port), timeout=0.5).close()
            except ConnectionRefusedError:
                break
            except OSError:
                pass
            time.sleep(0.005)
        t_gone.append(time.monotonic())

    watcher = threading.Thread(target=watch_exit, daemon=True)
    try:
        # The TileRT stream first, held open; then the native one, killed as soon as it streams. (Killed after a
        # pause of the reader instead, the native decode ran ahead into the socket buffers, and the client read
        # seconds of buffered tokens, or the whole completion, before the error.)
        worker.start()
        assert started.wait(60)
        health = in_flight[0]
        assert health["slots_free"] < health["slots_total"], "the TileRT decode must be in flight"
        with httpx.stream("POST", pools.router + "/v1/completions", json=body, headers={POOL: "vllm"}, timeout=60) as r:
            assert r.headers[POOL] == "vllm"
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append((time.monotonic(), line))
                if not t_kill and len(lines) == 3:  # the native decode streams
                    t_kill = time.monotonic()
                    os.killpg(native.pid, signal.SIGKILL)  # the instance and its engine process
                    watcher.start()
    finally:
        killed.set()
        if worker.is_alive() or worker.ident is not None:
            worker.join(120)
    assert t_kill, "the native stream ended before the kill"
    last_data = [line for _, line in lines if line.startswith("data: ")][-2:]
    assert last_data[-1] == "data: [DONE]"
    error = json.loads(last_data[0][6:])["error"]
    assert error["code"] == 502 and "native decode" in error["message"]
    # The error follows at once whichever comes later: the instance's sockets closing (a SIGKILLed vLLM is slow to
    # exit on a busy host, its sockets closing only with its last thread) or the last relayed token (tokens already
    # in the socket buffers when it died are relayed first).
    # The end is bounded from the kill at 5 s: far below any read timeout a router that missed the death would wait for.
    watcher.join(35)
    assert t_gone, "the killed native instance did not exit"
    i_err = max(i for i, (_, line) in enumerate(lines) if line == last_data[0])
    after_kill = sum(1 for t, _ in lines[:i_err] if t > t_kill)
    why = f"{after_kill} lines relayed after the kill; the instance's port closed {t_gone[0] - t_kill:.2f} s after it"
    assert lines[i_err][0] - max(lines[i_err - 1][0], t_gone[0]) < 1.0, why
    assert lines[-1][0] - t_kill < 5.0, why
    events = results["tilert"]
    assert not any("error" in e for e in events)
    assert token_ids(events) == undisturbed
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    # The stack keeps serving the TileRT pool; the native pool answers 503 at once.
    assert pools.proc.poll() is None
    kind, prompt = _prompts(pools.model)[0]
    assert router_answer(pools.router, pools.model, kind, prompt, True, pool="tilert")[:2] == _oracle(
        pools, kind, prompt
    )
    t0 = time.monotonic()
    r2 = httpx.post(
        pools.router + "/v1/completions",
        json={"model": str(pools.model), "prompt": "x", "max_tokens": 4},
        headers={POOL: "vllm"},
        timeout=30,
    )
    assert r2.status_code == 503 and time.monotonic() - t0 < 5
    assert _router_health(pools)["status"] == "degraded"
    _restarted(pools, "native")
    assert router_answer(pools.router, pools.model, kind, prompt, True, pool="vllm")[:2] == _oracle(pools, kind, prompt)


@pytest.mark.stack
def test_a_killed_decode_node_is_started_again_and_admitted(pools_to_heal: Stack) -> None:
    """The TileRT decode node dies (SIGKILL, its engine process with it): the native pool serves on while the
    router says ``degraded``, ``tilert up`` starts the node again, and the router admits it without a restart of
    anything else: the TileRT pool answers token for token as vLLM alone."""
    pools = pools_to_heal
    node = next(p for p in psutil.Process(pools.proc.pid).children() if "tilert.cli decode" in " ".join(p.cmdline()))
    os.killpg(node.pid, signal.SIGKILL)
    wait_until(lambda: _router_health(pools)["status"] == "degraded", 10, "the router sees the node gone")
    kind, prompt = _prompts(pools.model)[0]
    want = _oracle(pools, kind, prompt)
    assert router_answer(pools.router, pools.model, kind, prompt, True, pool="vllm")[:2] == want
    _restarted(pools, "decode")
    assert router_answer(pools.router, pools.model, kind, prompt, True, pool="tilert")[:2] == want


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
PARITY: dict[str, tuple[str, dict[str, Any]]] = {
    "penalties": ("completions", {"prompt": "def add(a, b):", "repetition_penalty": 1.3, "frequency_penalty": 0.5}),
    "logprobs": ("chat", {"messages": [{"role": "user", "content": "import os"}], "logprobs": True, "top_logprobs": 3}),
    "json_schema": (
        "chat",
        {
            "messages": [{"role": "user", "content": "JSON please."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        },
    ),
    "n": ("completions", {"prompt": "def add(a, b):", "n": 2, "temperature": 1.0, "seed": 5}),
    "tool_choice": (
        "chat",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "strict": True,
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                            "required": ["city"],
                            "additionalProperties": False,
                        },
                    },
                }
            ],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
}


@pytest.mark.stack
@pytest.mark.parametrize("case", sorted(PARITY))
def test_the_native_pool_serves_what_the_tilert_pool_serves(pools: Stack, case: str) -> None:
    """The requests the TileRT pool serves (penalties, logprobs, a JSON schema, n choices), asked of the native pool
    by header: served there, parsed by the OpenAI SDK's types, greedy ones with vLLM alone's answer."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    route, fields = PARITY[case]
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body = {"model": str(pools.model), "max_tokens": 16, "temperature": 0, "return_token_ids": True, **fields}
    if case == "tool_choice":  # compact JSON (whitespace-only tokens down), so the random model ends its call
        tok = Tokenizer.from_file(str(pools.model / "tokenizer.json"))
        spaces = [i for i in range(tok.get_vocab_size()) if tok.decode([i]) and not tok.decode([i]).strip()]
        body |= {"max_tokens": 80, "logit_bias": {str(i): -100 for i in spaces}}
    r = httpx.post(pools.router + path, json=body, headers={POOL: "vllm"}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers[POOL] == "vllm" and POOL + "-reason" not in r.headers
    answer = (ChatCompletion if route == "chat" else Completion).model_validate(r.json())
    if case == "n":
        assert [c.index for c in answer.choices] == [0, 1]
        return
    alone = httpx.post(pools.prefill + path, json=body, timeout=120).json()
    assert r.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    if case == "logprobs":
        ours = [(t.token, t.logprob) for t in answer.choices[0].logprobs.content]  # type: ignore[union-attr]
        theirs = [(t["token"], t["logprob"]) for t in alone["choices"][0]["logprobs"]["content"]]
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(ours, theirs, strict=True))
    if case == "tool_choice":
        call = answer.choices[0].message.tool_calls[0]  # type: ignore[union-attr,index]
        want = alone["choices"][0]["message"]["tool_calls"][0]["function"]
        assert (call.function.name, json.loads(call.function.arguments)) == (
            want["name"],
            json.loads(want["arguments"]),
        )
