"""Router unit tests: real HTTP on loopback, the real openai client against the router.

The prefill and decode servers here are the stand-ins of :mod:`tilert.testing.standins` (the benchmarks' too),
run in-process: they speak the router's prefill leg (``max_tokens=1`` + TileRT ``kv_transfer_params``) and the
decode node's HTTP API (reserve / release / decode NDJSON / watch / health) on the types of ``tilert.contracts``,
and each test sets the faults it needs. The real vLLM and the real decode node are tested elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
import openai
import orjson
import pytest
import uvicorn
from support.stack import free_port

from tilert import contracts as c
from tilert.router import ConfigError, RouterConfig, build_app, load_config, parse_decode_spec
from tilert.router.config import DecodeNodeSpec
from tilert.testing.standins import Script, Standins

pytestmark = pytest.mark.timeout(60)

MODEL_TEXT = "Hello there! def foo(bar): return bar * 2  # done"
SECRET = b"router-unit-test-secret-0123456789"


# ----------------------------------------------------------------------------------------------
# Fixtures: tokenizer model dir, loopback servers, the stand-ins
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tokenizer files as transformers' ``save_pretrained`` writes them (without importing transformers)."""
    from tilert.models.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("tiny_tok")
    tok = train_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "eos_token_id": tok.token_to_id("<|eos|>"),
                "bos_token_id": tok.token_to_id("<|bos|>"),
                "model_type": "tiny",
            }
        )
    )
    return out


class _Server:
    def __init__(self, app: Any, lifespan: Literal["auto", "on", "off"] = "auto") -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        cfg = uvicorn.Config(app, log_level="warning", lifespan=lifespan, timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.sock.close()


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="module")
def standins(model_dir: Path) -> Iterator[tuple[Standins, _Server, _Server]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    assert eos is not None
    world = Standins.build(Script(tok, tok.encode(MODEL_TEXT).ids + [eos], eos), SECRET, "tiny")
    prefill = _Server(world.prefill.app, lifespan="off").start()
    decode = _Server(world.node.app, lifespan="off").start()
    yield world, prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture
def world(standins: tuple[Standins, _Server, _Server]) -> Standins:
    standins[0].reset()
    return standins[0]


@dataclass
class RouterHandle:
    port: int
    config: RouterConfig

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=15)


@pytest.fixture
def make_router(standins: tuple[Standins, _Server, _Server], model_dir: Path) -> Iterator[Callable[..., RouterHandle]]:
    _, prefill, decode = standins
    started: list[_Server] = []

    def make(**overrides: Any) -> RouterHandle:
        nodes = overrides.pop("decode_nodes", [DecodeNodeSpec("127.0.0.1", 1, decode.port)])
        cfg = RouterConfig(
            prefill_urls=overrides.pop("prefill_urls", [f"http://127.0.0.1:{prefill.port}"]),
            decode_nodes=nodes,
            model_dir=str(model_dir),
            served_model_name="tiny",
            health_interval_s=0.5,
            secret=SECRET,
            **overrides,
        )
        server = _Server(build_app(cfg), lifespan="on").start()
        started.append(server)
        return RouterHandle(server.port, cfg)

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def router(make_router: Callable[..., RouterHandle]) -> RouterHandle:
    return make_router()


def _slots_in_use(router: RouterHandle) -> int:
    data = httpx.get(router.url + "/health", timeout=5).json()
    return sum(n["router_in_use"] for n in data["decode"])


def _expected(world: Standins) -> tuple[str, list[int]]:
    return world.script.text(world.script.ids[:-1]), list(world.script.ids)


# ----------------------------------------------------------------------------------------------
# Happy paths
# ----------------------------------------------------------------------------------------------
def test_chat_streaming_text_token_ids_usage(router: RouterHandle, world: Standins) -> None:
    text, ids = _expected(world)
    stream = router.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    got_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == text
    assert got_ids == ids
    assert finishes == ["stop"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    prompt_tokens = len(world.script.tokenizer.encode("hi").ids)
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.total_tokens == prompt_tokens + len(ids)
    # The decode node got the rest of the budget and the claim went to vLLM with a router-minted id.
    assert world.node.decode_bodies[0]["sampling"]["max_tokens"] == 99
    assert world.node.decode_bodies[0]["first_token_id"] == ids[0]
    kv = world.prefill.bodies[0]["kv_transfer_params"]
    assert kv["tilert_host"] == "127.0.0.1" and kv["tilert_ctrl_port"] == 1 and len(kv["tilert_transfer_id"]) == 32
    assert _wait_for(lambda: _slots_in_use(router) == 0)
    assert not world.node.reservations
    assert world.node.releases == []  # the node freed the slot as its stream ended: no release call was needed


def test_chat_non_streaming(router: RouterHandle, world: Standins) -> None:
    text, ids = _expected(world)
    world.node.tokens_per_line = 3  # MTP-style multi-token lines
    resp = router.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_completion_tokens=64,
        extra_body={"return_token_ids": True},
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.content == text
    assert resp.choices[0].finish_reason == "stop"
    assert (resp.choices[0].model_extra or {})["token_ids"] == ids
    assert resp.usage is not None and resp.usage.completion_tokens == len(ids)
    assert "max_completion_tokens" not in world.prefill.bodies[0]


def test_completions_streaming_and_length(router: RouterHandle, world: Standins) -> None:
    client = router.client()
    ids = world.script.ids
    stream = client.completions.create(
        model="tiny", prompt="def f():", max_tokens=5, stream=True, extra_body={"return_token_ids": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == world.script.text(ids[:5])
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    got = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert got == ids[:5]

    resp = client.completions.create(model="tiny", prompt="def f():", max_tokens=300)
    assert resp.object == "text_completion"
    assert resp.choices[0].text == world.script.text(ids[:-1])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == len(ids)
    assert _wait_for(lambda: _slots_in_use(router) == 0)


def test_completion_of_a_long_prompt_of_token_ids(router: RouterHandle, world: Standins) -> None:
    """A 1K-token prompt of ids reaches the prefill as those ids, counts as them in the usage, and the stream (whose
    detokenizer primes from the prompt's tail after the first chunk) is the script's text; the OpenAI SDK sends the
    ids through ``extra_body`` as they are."""
    ids = (world.script.ids[:-1] * 200)[:1024]
    stream = router.client().completions.create(
        model="tiny",
        prompt="",
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt": ids},
    )
    chunks = list(stream)
    assert world.prefill.bodies[-1]["prompt"] == ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == world.script.text(world.script.ids[:-1])
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (1024, len(world.script.ids))


def test_router_side_stop_string_spanning_tokens(router: RouterHandle, world: Standins) -> None:
    full = world.script.text(world.script.ids[:-1])
    stop = "return bar"
    expected = full[: full.index(stop)]
    stream = router.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=100,
        stream=True,
        stop=[stop],
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    resp = router.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=100,
        stop=stop,
    )
    # router-side stop: the decode stream was closed (the node stops) and the slot freed before the answer ended
    assert not world.node.reservations and world.node.closed_streams and world.node.releases
    assert resp.choices[0].message.content == expected
    assert (resp.choices[0].model_extra or {}).get("stop_reason") == stop
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


def test_first_token_stop_answered_from_prefill(router: RouterHandle, world: Standins) -> None:
    world.script.ids = [world.script.eos_id]
    client = router.client()
    resp = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}], max_tokens=50)
    assert not world.node.reservations  # released before the answer's last byte
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == ""
    assert resp.usage is not None and resp.usage.completion_tokens == 1
    chunks = list(client.completions.create(model="tiny", prompt="q", max_tokens=50, stream=True))
    assert chunks[-1].choices[0].finish_reason == "stop"
    # max_tokens=1 also ends at the prefill.
    world.reset()
    resp2 = client.completions.create(model="tiny", prompt="q", max_tokens=1)
    assert resp2.choices[0].finish_reason == "length"
    assert resp2.choices[0].text == world.script.text(world.script.ids[:1])
    assert world.node.decode_calls == []
    assert len(world.node.releases) >= 1
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


# ----------------------------------------------------------------------------------------------
# Admission
# ----------------------------------------------------------------------------------------------
def _stream_in_thread(router: RouterHandle, prompt: str, results: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            stream = router.client().completions.create(model="tiny", prompt=prompt, max_tokens=4, stream=True)
            results[prompt] = "".join(c.choices[0].text for c in stream)
        except Exception as exc:  # noqa: BLE001
            results[prompt] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_full_then_queue_timeout_429_retry_after(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    world.node.slots = 1
    world.node.hold = True
    router = make_router(queue_timeout_s=0.3, retry_after_s=2)
    results: dict[str, Any] = {}
    t = _stream_in_thread(router, "holder", results)
    assert _wait_for(lambda: len(world.node.decode_calls) == 1)
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 3}, timeout=5)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "2"
    assert "decode slot" in r.json()["error"]["message"]
    world.node.hold = False
    t.join(10)
    assert isinstance(results["holder"], str)


def test_queue_full_429_at_once(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    world.node.slots = 1
    world.node.hold = True
    router = make_router(queue_timeout_s=5, max_queue=0)
    results: dict[str, Any] = {}
    t = _stream_in_thread(router, "holder", results)
    assert _wait_for(lambda: len(world.node.decode_calls) == 1)
    t0 = time.monotonic()
    with pytest.raises(openai.RateLimitError):
        router.client().completions.create(model="tiny", prompt="x", max_tokens=3)
    assert time.monotonic() - t0 < 2
    world.node.hold = False
    t.join(10)


def test_fifo_order(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    world.node.slots = 1
    world.node.hold = True
    router = make_router(queue_timeout_s=20)
    results: dict[str, Any] = {}
    threads = [_stream_in_thread(router, "A", results)]
    assert _wait_for(lambda: len(world.node.decode_calls) == 1)
    for name in ("B", "C", "D"):
        threads.append(_stream_in_thread(router, name, results))
        depth = ord(name) - ord("A")
        assert _wait_for(lambda d=depth: httpx.get(router.url + "/health", timeout=5).json()["queue_depth"] == d)
    world.node.hold = False
    for t in threads:
        t.join(20)
    order = [world.prefill.prompts[tid] for tid in world.node.decode_calls]
    assert order == ["A", "B", "C", "D"]
    assert all(isinstance(v, str) for v in results.values())


def test_no_healthy_node_503(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()
    router = make_router(decode_nodes=[DecodeNodeSpec("127.0.0.1", 1, port)])
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert r.status_code == 503
    h = httpx.get(router.url + "/health", timeout=5)
    assert h.status_code == 503 and h.json()["decode"][0]["ok"] is False


# ----------------------------------------------------------------------------------------------
# Refusals and upstream errors
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra",
    [
        {"n": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 3},
        {"presence_penalty": 2.5},
        {"frequency_penalty": "1.0"},
        {"logit_bias": {"five": 10}},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"response_format": {"type": "xml"}},
        {"guided_json": {"type": "object"}},
        {"min_tokens": 3, "max_tokens": 2},
        {"max_tokens": 0},
        {"max_tokens": "5"},
        {"stop": [1, 2]},
    ],
)
def test_unsupported_options_400(router: RouterHandle, world: Standins, extra: dict[str, Any]) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=5)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert world.prefill.bodies == []


def test_completions_only_refusals_and_bad_json(router: RouterHandle, world: Standins) -> None:
    for extra in ({"echo": 1}, {"best_of": 3}, {"logprobs": 21}, {"prompt_logprobs": -2}, {"prompt": ["a", "b"]}):
        r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **extra}, timeout=5)
        assert r.status_code == 400, (extra, r.text)
    r = httpx.post(
        router.url + "/v1/completions", content=b"{not json", timeout=5, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        router.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    assert world.prefill.bodies == []


def test_vllm_4xx_propagated(router: RouterHandle, world: Standins) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        router.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "The model `nope` does not exist." in str(err.value)
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)
    assert world.node.releases  # the reservation was released


def test_prefill_5xx_is_502(router: RouterHandle, world: Standins) -> None:
    world.prefill.mode = "http_500"
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"]
    assert _wait_for(lambda: not world.node.reservations)


def test_a_bug_in_the_router_is_a_500_and_frees_the_slot(
    router: RouterHandle, world: Standins, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake: a router bug after the prefill (no real part can be made to raise there) is the client's 500 with
    the exception's type, the decode slot is freed, and the router serves on."""
    from tilert.router.flow import RequestFlow

    def broken(self: RequestFlow, pre: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(RequestFlow, "shape", broken)
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True}, timeout=5)
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal router error: RuntimeError"
    assert _wait_for(lambda: not world.node.reservations) and _slots_in_use(router) == 0
    monkeypatch.undo()
    text, _ = _expected(world)
    out = router.client().completions.create(model="tiny", prompt="x", max_tokens=64)
    assert out.choices[0].text == text


def test_a_dead_prefill_instance_is_passed_over_and_taken_out(
    make_router: Callable[..., RouterHandle], world: Standins, standins: tuple[Standins, _Server, _Server]
) -> None:
    """Beside a live prefill, an instance nobody listens on costs no request an error: each call it fails runs again
    on the live one, until its breaker takes it out. Alone, it is a 502 until then, and a 503 at once after."""
    dead = f"http://127.0.0.1:{free_port()}"
    live = f"http://127.0.0.1:{standins[1].port}"
    router = make_router(prefill_urls=[dead, live], prefill_breaker_failures=2)
    text, _ = _expected(world)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50}
    for _ in range(6):
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=5)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
    prefill = {p["url"]: p for p in httpx.get(router.url + "/health", timeout=5).json()["prefill"]}
    assert prefill[dead]["state"] == "open" and prefill[dead]["requests"] == 2 and prefill[live]["requests"] == 6
    alone = make_router(prefill_urls=[dead], prefill_breaker_failures=1, prefill_breaker_open_s=30)
    first = httpx.post(alone.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert first.status_code == 502 and "unreachable" in first.json()["error"]["message"]
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "x"}), ("/tokenize", {"prompt": "x"})):
        t0 = time.monotonic()
        r = httpx.post(alone.url + path, json=body, timeout=5)
        assert r.status_code == 503 and time.monotonic() - t0 < 1.0, r.text
        assert "no prefill instance is available" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 30
    assert httpx.get(alone.url + "/health", timeout=5).json()["status"] == "unavailable"
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == _slots_in_use(alone) == 0)


def test_missing_kv_transfer_params_502(router: RouterHandle, world: Standins) -> None:
    world.prefill.mode = "no_kv"
    r = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True},
        timeout=5,
    )
    assert r.status_code == 502
    assert "kv_transfer_params" in r.json()["error"]["message"]
    assert world.node.decode_calls == []
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


def _sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


def test_decode_error_mid_stream_error_event_then_done(router: RouterHandle, world: Standins) -> None:
    world.node.error_after = 2
    r = httpx.post(
        router.url + "/v1/chat/completions",
        timeout=10,
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 50},
    )
    assert r.status_code == 200
    events = _sse_events(r.text)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert "injected decode failure" in last["error"]["message"]
    content = [json.loads(e) for e in events[:-2]]
    # The first token from prefill, then the two from decode: an event each, or one when they arrive together.
    assert len(content) in (2, 3)
    # The openai client surfaces it as an APIError.
    with pytest.raises(openai.APIError):
        list(
            router.client().chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=50
            )
        )
    # Non-streaming: a plain 502.
    r2 = httpx.post(router.url + "/v1/completions", timeout=10, json={"model": "tiny", "prompt": "x", "max_tokens": 50})
    assert r2.status_code == 502
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


def test_a_node_gone_silent_is_lost_and_a_prefill_aimed_at_it_fails_fast(
    make_router: Callable[..., RouterHandle], world: Standins
) -> None:
    """A hung node (its watch stream open, its beats stopped; a real node dies faster: its stream closes, as
    ``test_e2e_transports``' peer-killed test shows) is lost after node_silence_s: the prefill aimed at it is
    cancelled, the request moves on (no node left: 503 at once, not when the prefill returns), the slot it
    reserved there is released, and the node comes back once it beats again."""
    router = make_router(node_silence_s=1.5)
    world.prefill.delay_s = 8.0
    t0 = time.monotonic()
    world.node.watch_silent = True
    r = httpx.post(router.url + "/v1/completions", timeout=15, json={"model": "tiny", "prompt": "x", "max_tokens": 9})
    elapsed = time.monotonic() - t0
    assert r.status_code == 503 and "no healthy decode node" in r.json()["error"]["message"], r.text
    assert elapsed < 1.5 + 2.0, elapsed  # the silence limit, then at once (the prefill would take 8 s)
    assert world.node.decode_calls == [] and world.node.releases and not world.node.reservations
    node = httpx.get(router.url + "/health", timeout=5).json()["decode"][0]
    assert not node["ok"] and "watch stream is not open" in node["error"], node  # its /health alone is not enough
    world.node.watch_silent, world.prefill.delay_s = False, 0.0
    assert _wait_for(lambda: httpx.get(router.url + "/health", timeout=5).json()["status"] == "ok", timeout=10)
    text, _ = _expected(world)
    out = router.client().completions.create(model="tiny", prompt="x", max_tokens=100)
    assert out.choices[0].text == text


def test_a_transfer_the_node_reports_failed_ends_the_request_before_the_prefill_returns(
    router: RouterHandle, world: Standins
) -> None:
    """The node says on its watch stream that the request's transfer failed: the client gets the node's reason at
    once (the prefill, 8 s here, is cancelled), the decode is never asked for, and the slot is released."""
    world.prefill.delay_s, world.node.fail_transfers = 8.0, "injected: the sender aborted"
    t0 = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", timeout=15, json={"model": "tiny", "prompt": "x", "max_tokens": 9})
    assert r.status_code == 502 and r.json()["error"]["message"] == "KV transfer failed: injected: the sender aborted"
    assert time.monotonic() - t0 < 2.0
    assert world.node.decode_calls == []
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'outcome="transfer_failed"' in metrics


def test_decode_refusal_4xx(router: RouterHandle, world: Standins) -> None:
    world.node.decode_refusal = (400, "top_k too large")
    r = httpx.post(router.url + "/v1/completions", timeout=10, json={"model": "tiny", "prompt": "x", "max_tokens": 9})
    assert r.status_code == 400 and "top_k too large" in r.json()["error"]["message"]
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


@pytest.mark.parametrize("stall", ["before the first line", "between lines"])
def test_a_silent_decode_stream_ends_in_the_error_event_of_its_timeout(
    make_router: Callable[..., RouterHandle], world: Standins, stall: str
) -> None:
    """The node sends nothing before its first line (``transfer_timeout_s``) or stops between lines
    (``decode_idle_timeout_s``): after prefill's token the client gets the 504 naming the wait, no sooner than the
    limit, and the slot is released (which cancels the decode there)."""
    router = make_router(transfer_timeout_s=0.6, decode_idle_timeout_s=0.4, decode_resumes=0)
    if stall == "before the first line":
        world.node.hold = True
        limit, what = 0.6, "waiting for the KV transfer and first decode step"
    else:
        world.node.hang_after = 2
        limit, what = 0.4, "between decode tokens"
    body = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True, "return_token_ids": True}
    t0 = time.monotonic()
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as resp:
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    elapsed = time.monotonic() - t0
    assert resp.status_code == 200 and events[-1] == "[DONE]"
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 504 and error["message"] == f"decode node sent nothing for {limit:g} s ({what})"
    ids = [t for event in events[:-2] for choice in orjson.loads(event)["choices"] for t in choice["token_ids"]]
    assert len(ids) == (1 if stall == "before the first line" else 3)  # prefill's token (and 2 decoded ones)
    assert limit <= elapsed < limit + 2.0
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)
    assert world.node.cancels, "the release cancels the decode on the node"


def test_client_disconnect_cancels_decode_and_releases(router: RouterHandle, world: Standins) -> None:
    world.node.hang_after = 1
    with httpx.Client(timeout=10) as client:
        with client.stream(
            "POST",
            router.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 50},
        ) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: "):
                    got += 1
                if got == 2:  # the prefill token and one decode token
                    break
            tid = world.node.decode_calls[0]
    assert _wait_for(lambda: tid in world.node.closed_streams, timeout=5)  # closing the stream stops the decode
    assert _wait_for(lambda: tid in world.node.releases and not world.node.reservations, timeout=5)
    assert _wait_for(lambda: _slots_in_use(router) == 0)
    metrics = httpx.get(router.url + "/metrics", timeout=5).text
    assert 'outcome="client_disconnected"' in metrics


# ----------------------------------------------------------------------------------------------
# Surface: request id, models, auth, metrics, health, config
# ----------------------------------------------------------------------------------------------
def test_request_id_echo_and_mint(router: RouterHandle, world: Standins) -> None:
    r = httpx.post(
        router.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 2},
        headers={"X-Request-Id": "abc-123"},
        timeout=5,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    r2 = httpx.get(router.url + "/v1/models", timeout=5)
    assert len(r2.headers["x-request-id"]) == 32
    r3 = httpx.post(
        router.url + "/v1/completions", json={"n": 3, "prompt": "x"}, headers={"X-Request-Id": "e-1"}, timeout=5
    )
    assert r3.status_code == 400 and r3.headers["x-request-id"] == "e-1"
    # a stream's head passes the middleware (its id, its pool) and its body goes to the server past it, whole
    body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, headers={"X-Request-Id": "s-1"}) as r4:
        events = [line for line in r4.iter_lines() if line.startswith("data: ")]
    assert r4.status_code == 200 and r4.headers["x-request-id"] == "s-1" and r4.headers["x-tilert-pool"] == "tilert"
    assert events[-1] == "data: [DONE]" and sum(len(json.loads(e[6:])["choices"]) for e in events[:-1]) >= 4


def test_models_health_metrics(router: RouterHandle, world: Standins) -> None:
    models = router.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(router.url + "/health", timeout=5)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["decode"][0]["slots_total"] == 2
    router.client().completions.create(model="tiny", prompt="x", max_tokens=3, stream=True).close()
    list(router.client().completions.create(model="tiny", prompt="x", max_tokens=3, stream=True))
    text = httpx.get(router.url + "/metrics", timeout=5).text
    for name in (
        "tilert:time_to_first_token_seconds",
        "tilert:inter_token_latency_seconds",
        "tilert:num_requests_waiting",
        "tilert:e2e_request_latency_seconds",
        "tilert:requests_total",
    ):
        assert f"{name}" in text and 'model_name="tiny"' in text


def test_auth_when_api_key_set(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    router = make_router(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        router.client("wrong").models.list()
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
    assert r.status_code == 401
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    resp = router.client("s3cret").completions.create(model="tiny", prompt="x", max_tokens=2)
    assert resp.choices[0].finish_reason == "length"


def test_parse_decode_spec_and_config(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_SECRET", SECRET.decode())
    assert parse_decode_spec("10.0.0.2:5556:5557") == DecodeNodeSpec("10.0.0.2", 5556, 5557)
    assert parse_decode_spec("[::1]:5556:5557").host == "::1"
    for bad in ("host:5556", "host:x:5557", ":1:2", "h:0:5557", "h:5556:5556", "::1:5556:5557", ""):
        with pytest.raises(ConfigError):
            parse_decode_spec(bad)
    cfg_file = tmp_path / "router.toml"
    cfg_file.write_text(
        f'prefill_url = "http://127.0.0.1:8000"\nmodel_dir = "{model_dir}"\nport = 23333\n'
        'decode = ["127.0.0.1:5556:5557"]\n\n[[decode_nodes]]\nhost = "x"\nctrl_port = 1\nhttp_port = 2\n'
    )
    cfg = load_config(cfg_file)
    assert cfg.served_model_name == str(model_dir)
    assert [n.name for n in cfg.decode_nodes] == ["127.0.0.1:5556:5557"]
    cfg_file.write_text(f'prefill_url = "http://h:1"\nmodel_dir = "{model_dir}"\nbogus = 1\n')
    with pytest.raises(ConfigError, match="unknown"):
        load_config(cfg_file)
    cfg_file.write_text('prefill_url = "http://h:1"\nmodel_dir = "/nonexistent"\ndecode = ["h:1:2"]\n')
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(cfg_file)
    with pytest.raises(ConfigError, match="not valid TOML"):
        cfg_file.write_text("prefill_url = ")
        load_config(cfg_file)
    example = Path(__file__).resolve().parents[1] / "config" / "router.example.toml"
    text = example.read_text().replace('"models/tiny-deepseek-v3"', f'"{model_dir}"')
    cfg_file.write_text(text)
    assert load_config(cfg_file).decode_nodes


def test_env_app_refuses_start_without_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILERT_ROUTER_CONFIG", raising=False)
    app = build_app()

    async def main() -> None:
        with pytest.raises(RuntimeError, match="TILERT_ROUTER_CONFIG"):
            async with app.router.lifespan_context(app):
                pass

    anyio.run(main)


def test_stop_token_ids_and_split_utf8(router: RouterHandle, world: Standins) -> None:
    text_ids = world.script.tokenizer.encode("ok naïve 世界 ✓ end").ids
    world.script.ids = text_ids + [world.script.eos_id]
    stream = router.client().completions.create(model="tiny", prompt="u", max_tokens=64, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "ok naïve 世界 ✓ end"
    # A stop token id ends the request: its id counts and is returned, its text is not.
    stop_id = text_ids[3]
    resp = router.client().completions.create(
        model="tiny", prompt="u", max_tokens=64, extra_body={"stop_token_ids": [stop_id], "return_token_ids": True}
    )
    assert resp.choices[0].finish_reason == "stop"
    assert (resp.choices[0].model_extra or {})["stop_reason"] == stop_id
    assert (resp.choices[0].model_extra or {})["token_ids"] == text_ids[:4]
    assert resp.choices[0].text == world.script.text(text_ids[:3])
    assert world.node.decode_bodies[-1]["sampling"]["stop_token_ids"] == [stop_id]


def test_node_full_elsewhere_waits_then_proceeds(make_router: Callable[..., RouterHandle], world: Standins) -> None:
    world.node.slots = 1
    router = make_router(queue_timeout_s=10)
    world.node.reservations["someone-else"] = 0  # a slot held by another router: our view says free
    results: dict[str, Any] = {}
    t = _stream_in_thread(router, "patient", results)
    assert _wait_for(lambda: httpx.get(router.url + "/health", timeout=5).json()["queue_depth"] == 1)
    # The reserve runs alongside the prefill: a prefill may have started for the refused reserve (it was
    # cancelled), but nothing decodes without a reservation.
    assert world.node.decode_calls == []
    with world.node.lock:
        world.node.reservations.pop("someone-else")
    t.join(10)
    assert isinstance(results["patient"], str) and results["patient"]
    tids = [c.Claim.from_params(b["kv_transfer_params"]).transfer_id for b in world.prefill.bodies]  # type: ignore[union-attr]
    assert world.node.decode_calls == [tids[-1]] and len(set(tids)) == len(tids)  # each attempt under a new transfer id


def test_disconnect_while_queued_or_prefilling_leaks_nothing(
    make_router: Callable[..., RouterHandle], world: Standins
) -> None:
    world.node.slots = 1
    world.node.hold = True
    router = make_router(queue_timeout_s=20)
    results: dict[str, Any] = {}
    holder = _stream_in_thread(router, "holder", results)
    assert _wait_for(lambda: len(world.node.decode_calls) == 1)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while queued
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "q"}, timeout=0.3)
    assert _wait_for(lambda: httpx.get(router.url + "/health", timeout=5).json()["queue_depth"] == 0)
    world.node.hold = False
    holder.join(10)
    world.prefill.delay_s = 2.0
    with pytest.raises(httpx.ReadTimeout):  # the client gives up during prefill
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "p"}, timeout=0.5)
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0, timeout=5)
    assert world.node.decode_calls == [world.node.decode_calls[0]]  # nothing decoded for the abandoned requests


def test_context_limit_is_the_nodes_to_decide(router: RouterHandle, world: Standins) -> None:
    """The router asks for no max_tokens of its own when the client set none (the node runs to the end of the
    context), and relays the node's context-length refusal as the 400 it is, before any byte was sent: with a
    context the prompt does not fit, the router waits for the node's answer before it streams."""
    router.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a b"}])
    assert world.node.decode_bodies[-1]["sampling"]["max_tokens"] is None
    world.node.decode_refusal, world.node.max_seq_len = (400, "top_k too large"), 2
    with pytest.raises(openai.BadRequestError, match="top_k too large"):
        router.client().chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a b"}], stream=True
        )
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


def test_stream_starts_before_the_decode_node_answers(router: RouterHandle, world: Standins) -> None:
    """The node checked the sampling with the reserve and its context holds the request: prefill's token is
    streamed while the decode request is still unanswered (the stand-in answers it only after the client has
    read that first event; a router that waited for the node would stall here until the gate's timeout)."""
    world.node.gate = gate = threading.Event()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 5, "stream": True}
    with httpx.Client(timeout=20) as client, client.stream("POST", router.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert not gate.is_set() and world.node.decode_calls == []
        assert orjson.loads(first.removeprefix("data: "))["choices"][0]["index"] == 0
        gate.set()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(world.node.decode_calls) == 1
    sampling = world.node.reserve_bodies[-1]["sampling"]
    assert sampling["max_tokens"] == 4 and sampling == world.node.decode_bodies[-1]["sampling"]
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


@pytest.mark.parametrize(("node_status", "client_status"), [(501, 501), (422, 400)])
def test_sampling_refused_at_reserve_is_the_clients_error(
    router: RouterHandle, world: Standins, node_status: int, client_status: int
) -> None:
    """A node that cannot honour the sampling (501) or finds it wrong for its model (422, the client's 400)
    refuses the reserve: the client gets that before any byte (the prefill is cancelled or its answer dropped),
    and no slot stays held. (A plain 400 from the reserve is the router's own fault, its lease or its body: that
    takes the node out of the pool as before.)"""
    world.node.reserve_refusal = (node_status, "the stand-in engine cannot honour top_k")
    with pytest.raises(openai.APIStatusError) as refused:
        list(
            router.client().completions.create(
                model="tiny", prompt="x", max_tokens=5, stream=True, extra_body={"top_k": 3}
            )
        )
    assert refused.value.status_code == client_status and "cannot honour top_k" in str(refused.value)
    assert world.node.decode_calls == []
    assert _wait_for(lambda: not world.node.reservations and _slots_in_use(router) == 0)


def test_node_client_repeats_an_idempotent_call_once_over_a_fresh_connection() -> None:
    """A kept-alive connection the node closed while it sat idle fails the next call sent down it. The real node
    closes idle connections only after NODE_KEEPALIVE_S, and the race with a reuse cannot be made on demand, so a
    raw socket server stands in: it drops the first connection after reading the request, unanswered, then
    answers the reserve properly. The client sends it once more and gets the slot; a second drop is an error."""
    from tilert.router.node_client import NodeClient, NodeUnreachable

    async def main(drops: int) -> tuple[int, int | str]:
        seen = [0]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            sizes = [line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")]
            length = int(sizes[0])
            body = c.parse(c.ReserveRequest, await reader.readexactly(length))
            seen[0] += 1
            if seen[0] <= drops:
                writer.close()
                return
            reply = c.dump(c.ReserveResponse(body.transfer_id, 0, 4096))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(reply), reply)
            )
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = NodeClient(DecodeNodeSpec("127.0.0.1", 1, port), 2.0, 2.0, b"k" * 32)
        try:
            try:
                got: int | str = (await client.reserve("t-1", 10.0)).slot
            except NodeUnreachable as exc:
                got = str(exc)
        finally:
            await client.aclose()
            server.close()
        return seen[0], got

    assert asyncio.run(main(drops=1)) == (2, 0)
    seen, got = asyncio.run(main(drops=2))
    assert seen == 2 and "reserve failed" in str(got)


def test_a_node_granting_shorter_leases_than_the_router_asks_is_unhealthy(
    make_router: Callable[..., RouterHandle], world: Standins
) -> None:
    """A router whose lease exceeds what a node grants would have every reserve refused: the node is reported
    unhealthy with the reason (on /health) and requests get a 503 instead of a stream of refusals."""
    world.node.max_lease_s = 30.0
    router = make_router()  # its default lease: prefill + transfer timeouts + 30 s
    node = httpx.get(router.url + "/health", timeout=5).json()["decode"][0]
    assert not node["ok"] and f"at most 30 s, this router asks {router.config.lease_s:g} s" in node["error"]
    world.node.max_lease_s = router.config.lease_s
    assert _wait_for(lambda: httpx.get(router.url + "/health", timeout=5).json()["decode"][0]["ok"])
