"""The core oracle, end to end over real HTTP: stock vLLM prefill + TileRTConnector + our decode node,
streamed through the router with the real OpenAI client, must give exactly the tokens that the same
vLLM generates alone (greedy, float32)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

MAX_TOKENS = 32


def _source_text(n_tokens: int, model: Path, offset: int = 0) -> str:
    """About ``n_tokens`` tokens of real Python source (the stdlib is always on disk)."""
    tok = AutoTokenizer.from_pretrained(model)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[offset:]
    ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tok.decode(ids)


def _prompts(model: Path) -> list[tuple[str, Any]]:
    """(kind, prompt-or-messages): short, ~100 tokens (several 16-token blocks), ~500 tokens."""
    return [
        ("completion", "def add(a, b):"),
        ("completion", "Hello"),
        ("completion", _source_text(100, model)),
        ("completion", _source_text(500, model, offset=3000)),
        ("chat", [{"role": "user", "content": "Write a function that reverses a list."}]),
        ("chat", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "import os"}]),
        ("chat", [{"role": "user", "content": _source_text(120, model, offset=500)}]),
        (
            "chat",
            [
                {"role": "user", "content": _source_text(250, model, offset=6000)},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": _source_text(230, model, offset=9000)},
            ],
        ),
    ]


def _body(kind: str, prompt: Any, model: Path) -> dict[str, Any]:
    key = "messages" if kind == "chat" else "prompt"
    return {"model": str(model), key: prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}


def _vllm_alone(stack: Any, kind: str, prompt: Any) -> tuple[list[int], str, int]:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = httpx.post(stack.prefill + path, json=_body(kind, prompt, stack.model), timeout=120)
    r.raise_for_status()
    data = r.json()
    assert data["kv_transfer_params"] is None, "an unmarked request must not be claimed by the connector"
    choice = data["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return choice["token_ids"], text, data["usage"]["prompt_tokens"]


def _router_call(
    router: str, model: Path, kind: str, prompt: Any, stream: bool
) -> tuple[list[int], str, dict[str, int]]:
    client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0)
    kwargs: dict[str, Any] = {
        "model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0,
        "extra_body": {"return_token_ids": True},
    }  # fmt: skip
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    if kind == "chat":
        resp = client.chat.completions.create(messages=prompt, stream=stream, **kwargs)
    else:
        resp = client.completions.create(prompt=prompt, stream=stream, **kwargs)
    if not stream:
        choice = resp.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return list(choice.model_extra["token_ids"]), text or "", resp.usage.model_dump()
    ids: list[int] = []
    parts: list[str] = []
    usage: dict[str, int] = {}
    for chunk in resp:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
            piece = choice.delta.content if kind == "chat" else choice.text
            parts.append(piece or "")
    return ids, "".join(parts), usage


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("index", range(8))
def test_router_tokens_equal_vllm_alone(stack: Any, index: int, stream: bool) -> None:
    kind, prompt = _prompts(stack.model)[index]
    want_ids, want_text, prompt_tokens = _vllm_alone(stack, kind, prompt)
    assert len(want_ids) == MAX_TOKENS
    got_ids, got_text, usage = _router_call(stack.router, stack.model, kind, prompt, stream)
    assert got_ids == want_ids
    assert got_text == want_text
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == prompt_tokens + MAX_TOKENS


def _decode_health(stack: Any) -> dict[str, Any]:
    return httpx.get(stack.decode + "/health", timeout=10).json()


@pytest.mark.stack
def test_unmarked_request_is_left_alone(stack: Any) -> None:
    """No ``tilert_host`` mark: vLLM answers normally, the connector returns nothing and ships nothing."""
    before = _decode_health(stack)["transfers_received"]
    ids, text, _ = _vllm_alone(stack, "completion", "class Foo:")  # asserts kv_transfer_params is None
    assert len(ids) == MAX_TOKENS and text
    assert _decode_health(stack)["transfers_received"] == before


@pytest.mark.stack
def test_marked_request_with_bad_fields_is_not_claimed(stack: Any) -> None:
    body = _body("completion", "x = 1", stack.model) | {
        "max_tokens": 1,
        "kv_transfer_params": {"tilert_host": "127.0.0.1", "tilert_ctrl_port": "not-a-port", "tilert_transfer_id": "t"},
    }
    data = httpx.post(stack.prefill + "/v1/completions", json=body, timeout=60).json()
    kv = data["kv_transfer_params"]
    assert "tilert_first_token_id" not in kv and "tilert_ctrl_port" in kv["tilert_error"]


@pytest.mark.stack
def test_max_tokens_one_is_answered_from_prefill(stack: Any) -> None:
    health = _decode_health(stack)
    want_ids, _, _ = _vllm_alone(stack, "completion", "def add(a, b):")
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    resp = client.completions.create(
        model=str(stack.model), prompt="def add(a, b):", max_tokens=1, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert resp.choices[0].model_extra["token_ids"] == want_ids[:1]
    assert resp.choices[0].finish_reason == "length"
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == health["decodes_completed"]


@pytest.mark.stack
def test_first_token_stop_is_answered_from_prefill(stack: Any) -> None:
    """The first sampled token ends the request (here: it is a stop token): no decode, slot freed."""
    want_ids, _, _ = _vllm_alone(stack, "completion", "Hello")
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    before = _decode_health(stack)
    resp = client.completions.create(
        model=str(stack.model), prompt="Hello", max_tokens=16, temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [want_ids[0]]},
    )  # fmt: skip
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].model_extra["token_ids"] == want_ids[:1]
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == before["decodes_completed"]


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_first_token_eos_is_answered_from_prefill(stack: Any, stream: bool) -> None:
    """The tiny model is built so that EOS is the greedy first token after ``EOS_TRIGGER_PROMPT``."""
    from tilert.models.tiny import EOS_TRIGGER_PROMPT

    want_ids, want_text, _ = _vllm_alone(stack, "completion", EOS_TRIGGER_PROMPT)
    eos = AutoTokenizer.from_pretrained(stack.model).eos_token_id
    assert want_ids == [eos]
    before = _decode_health(stack)
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    resp = client.completions.create(
        model=str(stack.model), prompt=EOS_TRIGGER_PROMPT, max_tokens=16, temperature=0, stream=stream,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = [resp] if not stream else list(resp)
    finish = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    ids = [t for chunk in chunks for c in chunk.choices for t in ((c.model_extra or {}).get("token_ids") or [])]
    text = "".join(c.text or "" for chunk in chunks for c in chunk.choices)
    assert finish == ["stop"] and ids == [eos] and text == want_text
    after = _decode_health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["decodes_completed"] == before["decodes_completed"]


@pytest.mark.stack
def test_client_disconnect_cancels_decode_and_frees_slot(stack: Any) -> None:
    """A client that leaves mid-stream must not keep the decode node busy for the rest of max_tokens."""
    import time

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
    deadline = time.monotonic() + 5
    health = _decode_health(stack)
    while health["slots_free"] < health["slots_total"] and time.monotonic() < deadline:
        time.sleep(0.1)
        health = _decode_health(stack)
    assert health["slots_free"] == health["slots_total"]


@pytest.mark.stack
def test_uvicorn_app_configured_by_file(stack: Any, tmp_path: Path) -> None:
    """``TILERT_ROUTER_CONFIG=file uvicorn tilert.router:app``, in front of the same prefill and decode node."""
    import os
    import subprocess
    import sys
    from urllib.parse import urlparse

    import psutil
    from conftest import free_port, wait_healthy

    decode = urlparse(stack.decode)
    health = httpx.get(stack.decode + "/health", timeout=10).json()
    ctrl = int(health["ctrl_port"])
    config = tmp_path / "router.toml"
    config.write_text(
        f'prefill_url = "{stack.prefill}"\nmodel_dir = "{stack.model}"\n'
        f'decode = ["{decode.hostname}:{ctrl}:{decode.port}"]\n'
    )
    port = free_port()
    router_proc = next(p for p in psutil.Process(stack.proc.pid).children(recursive=True)
                       if "router" in p.cmdline())  # fmt: skip
    secret_file = router_proc.environ()["TILERT_SECRET_FILE"]  # the secret `tilert up` made for its stack
    env = {**os.environ, "TILERT_ROUTER_CONFIG": str(config), "TILERT_SECRET_FILE": secret_file}
    cmd = [sys.executable, "-m", "uvicorn", "tilert.router:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 60)
        prompt = [{"role": "user", "content": "Write a function that reverses a list."}]
        want_ids, want_text, _ = _vllm_alone(stack, "chat", prompt)
        got_ids, got_text, _ = _router_call(url, stack.model, "chat", prompt, True)
        assert (got_ids, got_text) == (want_ids, want_text)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.stack
def test_marked_and_unmarked_requests_in_one_batch(stack: Any) -> None:
    """Unmarked traffic sharing vLLM's forward batches with marked traffic is untouched, and vice versa."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [("completion", "def add(a, b):"), ("chat", [{"role": "user", "content": "import os"}])]
    solo = [_vllm_alone(stack, kind, p)[:2] for kind, p in prompts]
    before = _decode_health(stack)["transfers_received"]
    with ThreadPoolExecutor(max_workers=6) as pool:
        unmarked = [pool.submit(_vllm_alone, stack, kind, p) for kind, p in prompts * 2]
        marked = [pool.submit(_router_call, stack.router, stack.model, kind, p, True) for kind, p in prompts]
        got_unmarked = [f.result()[:2] for f in unmarked]
        got_marked = [f.result()[:2] for f in marked]
    assert got_unmarked == solo * 2
    assert got_marked == solo
    assert _decode_health(stack)["transfers_received"] == before + len(prompts)
