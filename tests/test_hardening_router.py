"""The router and the prefill node against hostile but fair clients, on the session's real stack
(stock vLLM prefill with the connector, a real decode node, the router).

Every problem found by trying the stack as such a client is replayed here: deep JSON, numerically
degenerate sampling, client-supplied ``kv_transfer_params`` (through the router, and straight to vLLM),
plain-text 404/405, prompt text in logs; then a fuzzer over every router endpoint.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import openai
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.stack import Stack
from support.waiting import wait_until

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]


def _chat(stack: Stack, body: dict[str, Any], **kw: Any) -> httpx.Response:
    full = {"model": str(stack.model), "messages": [{"role": "user", "content": "def main():"}]} | body
    return httpx.post(stack.router + "/v1/chat/completions", content=orjson.dumps(full), timeout=120, **kw)


def _log_lines(stack: Stack) -> list[str]:
    return stack.process_log("router").splitlines()


def _assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == status
    return err  # type: ignore[no-any-return]


@pytest.mark.parametrize("depth", [33, 300, 1000])
def test_deeply_nested_json_is_400(stack: Stack, depth: int) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "vllm_xargs": ' + b"[" * depth
    raw += b"]" * depth + b"}"
    resp = httpx.post(stack.router + "/v1/chat/completions", content=raw, timeout=30)
    _assert_openai_error(resp, 400)


@pytest.mark.parametrize(
    "sampling", [{"temperature": 1e-300}, {"temperature": 0.5, "top_p": 1e-46}, {"temperature": 5e-324, "top_k": 1}]
)
def test_degenerate_sampling_is_served_like_vllm(stack: Stack, sampling: dict[str, Any]) -> None:
    """A tiny temperature is greedy (vLLM's rule), a tiny top_p keeps the top token: same answer as greedy."""
    greedy = _chat(stack, {"max_tokens": 8, "temperature": 0})
    resp = _chat(stack, {"max_tokens": 8, **sampling})
    assert greedy.status_code == 200 and resp.status_code == 200, resp.text
    got, want = resp.json()["choices"][0], greedy.json()["choices"][0]
    if sampling.get("top_p") is None:
        assert got["message"]["content"] == want["message"]["content"]


def test_client_kv_transfer_params_are_refused_by_the_router(stack: Stack) -> None:
    err = _assert_openai_error(_chat(stack, {"kv_transfer_params": {"tilert_host": "10.0.0.1"}}), 400)
    assert err["param"] == "kv_transfer_params"


def test_a_client_cannot_make_prefill_connect_anywhere(stack: Stack) -> None:
    """``tilert_*`` keys sent straight to vLLM without the deployment's signature are ignored: vLLM serves
    the request as a plain one and nothing connects to the address the client named."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    arrived: list[object] = []

    def watch() -> None:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                arrived.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=watch)
    thread.start()
    forged = {
        "tilert_host": "127.0.0.1",
        "tilert_ctrl_port": port,
        "tilert_transfer_id": "forged-1",
        "tilert_auth": "0" * 64,
    }
    for claim in (forged, {k: v for k, v in forged.items() if k != "tilert_auth"}):
        body = {"model": str(stack.model), "prompt": "import os", "max_tokens": 1, "kv_transfer_params": claim}
        resp = httpx.post(stack.prefill + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert "tilert_first_token_id" not in orjson.dumps(resp.json().get("kv_transfer_params")).decode()
    thread.join()
    listener.close()
    assert not arrived, "the prefill node connected to a client-named address"


def test_unknown_paths_and_methods_answer_in_openai_shape(stack: Stack) -> None:
    _assert_openai_error(httpx.get(stack.router + "/v1/nope", timeout=10), 404)
    _assert_openai_error(httpx.get(stack.router + "/v1/chat/completions", timeout=10), 405)


def test_no_prompt_text_in_logs(stack: Stack) -> None:
    """vLLM's validation errors quote the prompt: the client sees them, no log line does."""
    marker = "PROMPT-MARKER-7f3a9c"
    quoted = [
        resp
        for bad in (
            [{"role": "user", "content": [{"type": "bogus_part", "text": marker}]}],
            [{"role": "user", "content": marker, "name": {"x": marker}}],
            [{"role": "user", "content": [{"type": "text", "text": marker, "bogus": marker}]}],
        )
        if (resp := _chat(stack, {"messages": bad, "max_tokens": 4})).status_code == 400 and marker in resp.text
    ]
    assert quoted, "no request made vLLM quote the prompt back: the test would prove nothing"
    resp = _chat(stack, {"messages": [{"role": "user", "content": marker}], "max_tokens": 2})
    assert resp.status_code == 200
    rid = resp.headers["x-request-id"]  # on every log line of the request; its last one is request_done
    wait_until(
        lambda: any("request_done" in line and rid in line for line in _log_lines(stack)),
        30,
        "the router's request_done line of the request",
    )
    router_lines = [line for line in _log_lines(stack) if "transfer_id=" in line or "request_" in line]
    assert router_lines and not [line for line in router_lines if marker in line]


def test_without_max_tokens_a_request_runs_to_the_end_of_the_context(stack: Stack) -> None:
    """vLLM's rule for chat: no max_tokens means until EOS or the context is full (not a fixed default);
    a completions request without one stops after 16 tokens, as vLLM's does."""
    client = openai.OpenAI(base_url=stack.router + "/v1", api_key="none", max_retries=0, timeout=300)
    out = client.chat.completions.create(
        model=str(stack.model),
        temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": "x = 1\n" * 200}],
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 2048 - out.usage.prompt_tokens > 256
    short = client.completions.create(
        model=str(stack.model), prompt="x = 1", temperature=0, extra_body={"ignore_eos": True}
    )
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 16


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=10,
)
openai_fields = st.sampled_from(
    [
        "model",
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "stream_options",
        "stop",
        "stop_token_ids",
        "n",
        "seed",
        "logprobs",
        "kv_transfer_params",
        "ignore_eos",
        "x",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/v1/x"]),
    method=st.sampled_from(["POST", "GET", "PUT"]),
    body=st.dictionaries(openai_fields, json_values, max_size=6),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_fuzz_router_endpoints(stack: Stack, path: str, method: str, body: dict[str, Any], raw: bytes | None) -> None:
    """No 5xx for a client's mistake, every error in OpenAI's shape, and the router keeps serving."""
    content = raw if raw is not None else json.dumps(body).encode()  # (stdlib: also ints past 64 bits)
    if raw is None and "max_tokens" not in body:
        content = json.dumps({**body, "max_tokens": 2}).encode()
    resp = httpx.request(method, stack.router + path, content=content, timeout=120)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert resp.json()["error"]["code"] == resp.status_code


def test_after_fuzzing_every_slot_is_free(stack: Stack) -> None:
    health = httpx.get(stack.router + "/health", timeout=10).json()
    node = health["decode"][0]
    assert node["ok"] and node["router_in_use"] == 0 and node["slots_free"] == node["slots_total"], health
