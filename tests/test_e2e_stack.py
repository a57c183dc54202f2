"""The core oracle, end to end over real HTTP: stock vLLM prefill + TileRTConnector + our decode node,
streamed through the router with the real OpenAI client, must give exactly the tokens that the same
vLLM generates alone (greedy, float32)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import orjson
import pytest
from openai import OpenAI
from support.oracle import MAX_TOKENS, prompts, request_body, router_call, vllm_alone
from support.stack import Stack, free_port, wait_healthy
from support.waiting import wait_until
from transformers import AutoTokenizer

from tilert.models.tiny import EOS_TRIGGER_PROMPT


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("index", range(8))
def test_router_tokens_equal_vllm_alone(stack: Stack, index: int, stream: bool) -> None:
    kind, prompt = prompts(stack.model)[index]
    want_ids, want_text, prompt_tokens = vllm_alone(stack, kind, prompt)
    assert len(want_ids) == MAX_TOKENS
    got_ids, got_text, usage = router_call(stack.router, stack.model, kind, prompt, stream)
    assert got_ids == want_ids
    assert got_text == want_text
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == prompt_tokens + MAX_TOKENS


def _decode_health(stack: Stack) -> dict[str, Any]:
    return httpx.get(stack.decode + "/health", timeout=10).json()


@pytest.mark.stack
def test_unmarked_request_is_left_alone(stack: Stack) -> None:
    """No ``tilert_host`` mark: vLLM answers normally, the connector returns nothing and ships nothing."""
    before = _decode_health(stack)["transfers_received"]
    ids, text, _ = vllm_alone(stack, "completion", "class Foo:")  # asserts kv_transfer_params is None
    assert len(ids) == MAX_TOKENS and text
    assert _decode_health(stack)["transfers_received"] == before


@pytest.mark.stack
def test_marked_request_with_bad_fields_is_not_claimed(stack: Stack) -> None:
    body = request_body("completion", "x = 1", stack.model) | {
        "max_tokens": 1,
        "kv_transfer_params": {"tilert_host": "127.0.0.1", "tilert_ctrl_port": "not-a-port", "tilert_transfer_id": "t"},
    }
    data = httpx.post(stack.prefill + "/v1/completions", json=body, timeout=60).json()
    kv = data["kv_transfer_params"]
    assert "tilert_first_token_id" not in kv and "tilert_ctrl_port" in kv["tilert_error"]


@pytest.mark.stack
def test_max_tokens_one_is_answered_from_prefill(stack: Stack) -> None:
    health = _decode_health(stack)
    want_ids, _, _ = vllm_alone(stack, "completion", "def add(a, b):")
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    resp = client.completions.create(
        model=str(stack.model),
        prompt="def add(a, b):",
        max_tokens=1,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert resp.choices[0].model_extra["token_ids"] == want_ids[:1]
    assert resp.choices[0].finish_reason == "length"
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == health["decodes_completed"]


@pytest.mark.stack
def test_first_token_stop_is_answered_from_prefill(stack: Stack) -> None:
    """The first sampled token ends the request (here: it is a stop token): no decode, slot freed."""
    want_ids, _, _ = vllm_alone(stack, "completion", "Hello")
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    before = _decode_health(stack)
    resp = client.completions.create(
        model=str(stack.model),
        prompt="Hello",
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [want_ids[0]]},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["token_ids"] == want_ids[:1]
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == before["decodes_completed"]


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_first_token_eos_is_answered_from_prefill(stack: Stack, stream: bool) -> None:
    """The tiny model is built so that EOS is the greedy first token after ``EOS_TRIGGER_PROMPT``."""
    want_ids, want_text, _ = vllm_alone(stack, "completion", EOS_TRIGGER_PROMPT)
    eos = AutoTokenizer.from_pretrained(stack.model).eos_token_id
    assert want_ids == [eos]
    before = _decode_health(stack)
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    resp = client.completions.create(
        model=str(stack.model),
        prompt=EOS_TRIGGER_PROMPT,
        max_tokens=16,
        temperature=0,
        stream=stream,
        extra_body={"return_token_ids": True},
    )
    chunks = [resp] if not stream else list(resp)
    finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    ids = [t for chunk in chunks for c in chunk.choices for t in ((c.model_extra or {}).get("token_ids") or [])]
    text = "".join(c.text or "" for chunk in chunks for c in chunk.choices)
    assert finish == ["stop"] and ids == [eos] and text == want_text
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == before["decodes_completed"]


@pytest.mark.stack
def test_client_disconnect_cancels_decode_and_frees_slot(stack: Stack) -> None:
    """A client that leaves mid-stream must not keep the decode node busy for the rest of max_tokens."""
    body = {"model": str(stack.model), "prompt": "def main():", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", stack.router + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 3:  # mid-stream, the connection still open: the decode holds its slot
                    busy = _decode_health(stack)
                    assert busy["slots_free"] < busy["slots_total"]
                if events >= 4:
                    break

    def all_free() -> bool:
        health = _decode_health(stack)
        return bool(health["slots_free"] == health["slots_total"])

    wait_until(all_free, 5, "every decode slot free after the client left", interval_s=0.1)


@pytest.mark.stack
def test_uvicorn_app_configured_by_file(stack: Stack, tmp_path: Path) -> None:
    """``TILERT_ROUTER_CONFIG=file uvicorn tilert.router:app``, in front of the same prefill and decode node, its
    logs set up from the file (JSON here): every line of the process one JSON object with one timestamp format,
    uvicorn's own lines included, the request's lines and its access line carrying its request id, and no access
    line for a health check or a metrics scrape."""
    decode = urlparse(stack.decode)
    health = httpx.get(stack.decode + "/health", timeout=10).json()
    ctrl = int(health["ctrl_port"])
    config = tmp_path / "router.toml"
    config.write_text(
        f'prefill_url = "{stack.prefill}"\nmodel_dir = "{stack.model}"\n'
        f'decode = ["{decode.hostname}:{ctrl}:{decode.port}"]\nlog_format = "json"\n'
    )
    port = free_port()
    assert stack.secret_file is not None  # the secret `tilert up` was given for its stack
    env = {**os.environ, "TILERT_ROUTER_CONFIG": str(config), "TILERT_SECRET_FILE": str(stack.secret_file)}
    cmd = [sys.executable, "-m", "uvicorn", "tilert.router:app", "--host", "127.0.0.1", "--port", str(port)]
    err = tmp_path / "router.err"
    with open(err, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60)
        prompt = [{"role": "user", "content": "Write a function that reverses a list."}]
        want_ids, want_text, _ = vllm_alone(stack, "chat", prompt)
        got_ids, got_text, _ = router_call(url, stack.model, "chat", prompt, True)
        assert (got_ids, got_text) == (want_ids, want_text)
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lines = [orjson.loads(line) for line in err.read_text().splitlines()]  # every line JSON
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", line["timestamp"]) for line in lines)
    done = [line for line in lines if line["event"] == "request_done"]
    assert len(done) == 1 and done[0]["outcome"] == "ok", lines
    access = [line for line in lines if line.get("logger") == "tilert.access"]
    assert [line["request_id"] for line in access] == [done[0]["request_id"]], access
    assert any(line.get("logger") == "uvicorn.error" for line in lines), lines  # uvicorn's own, same format
    assert not [line for line in access if "/health" in line["event"] or "/metrics" in line["event"]]


@pytest.mark.stack
def test_marked_and_unmarked_requests_in_one_batch(stack: Stack) -> None:
    """Unmarked traffic sharing vLLM's forward batches with marked traffic is untouched, and vice versa."""
    prompts = [("completion", "def add(a, b):"), ("chat", [{"role": "user", "content": "import os"}])]
    solo = [vllm_alone(stack, kind, p)[:2] for kind, p in prompts]
    before = _decode_health(stack)["transfers_received"]
    with ThreadPoolExecutor(max_workers=6) as pool:
        unmarked = [pool.submit(vllm_alone, stack, kind, p) for kind, p in prompts * 2]
        marked = [pool.submit(router_call, stack.router, stack.model, kind, p, True) for kind, p in prompts]
        got_unmarked = [f.result()[:2] for f in unmarked]
        got_marked = [f.result()[:2] for f in marked]
    assert got_unmarked == solo * 2
    assert got_marked == solo
    assert _decode_health(stack)["transfers_received"] == before + len(prompts)


@pytest.mark.stack
def test_access_logs_leave_out_what_is_polled(stack: Stack) -> None:
    """The node's and the router's access logs have a line for each request and none for the paths polled all the
    time: the router's watch stream of the node, health checks, metrics scrapes."""
    for url in (stack.router, stack.decode):
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/metrics", timeout=10).status_code == 200
    router_call(stack.router, stack.model, "completion", "def add(a, b):", False)
    wait_until(lambda: '"POST /v1/reserve' in stack.process_log("decode"), 10, "the node's access line of a reserve")
    for name in ("router", "decode"):
        access = [line for line in stack.process_log(name).splitlines() if "tilert.access" in line]
        assert access, name
        polled = [
            line for line in access if any(f'"GET {path}' in line for path in ("/health", "/metrics", "/v1/watch"))
        ]
        assert not polled, polled
