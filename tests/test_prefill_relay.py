"""``POST /tokenize`` and ``/detokenize`` on the router are vLLM's own, relayed to the prefill vLLM over real HTTP:
the same answers as vLLM gives alone, its refusals with its status, and a clear 502 in the router's error shape when
the prefill server is down."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.stack import Stack, free_port
from support.waiting import wait_until

from tilert.router.config import API_KEY_ENV


def _both(stack: Stack, path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
    """``body`` POSTed to the router's ``path`` and to the prefill vLLM's."""
    via = httpx.post(stack.router + path, json=body, timeout=60)
    alone = httpx.post(stack.prefill + path, json=body, timeout=60)
    return via, alone


@pytest.mark.stack
def test_tokenize_and_detokenize_equal_vllm_alone(stack: Stack) -> None:
    model = str(stack.model)
    for body in (
        {"model": model, "prompt": "def add(a, b):\n    return a + b", "add_special_tokens": False},
        {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "add_generation_prompt": True},
    ):
        via, alone = _both(stack, "/tokenize", body)
        assert via.status_code == alone.status_code == 200, via.text
        assert via.json() == alone.json() and via.json()["tokens"]
        assert via.headers["x-request-id"]
        back, back_alone = _both(stack, "/detokenize", {"model": model, "tokens": via.json()["tokens"]})
        assert back.status_code == 200 and back.json() == back_alone.json()
        if "prompt" in body:
            assert back.json()["prompt"] == body["prompt"]
    refused, refused_alone = _both(stack, "/detokenize", {"model": model, "tokens": "not a list"})
    assert refused.status_code == refused_alone.status_code and 400 <= refused.status_code < 500
    assert refused.json() == refused_alone.json()


def test_tokenize_without_a_prefill_server_is_a_502_with_the_reason(tiny_model: Path) -> None:
    """A router whose prefill server is not there (nothing listens on its port) answers 502 in its error shape.
    Like vLLM's own, the two paths need no API key where ``/v1`` does (``vllm bench serve`` probes them without)."""
    port, dead = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env["TILERT_SECRET"] = "0123456789abcdef0123456789abcdef"
    env[API_KEY_ENV] = "client-key"
    cmd = [sys.executable, "-m", "tilert.cli", "router", "--prefill-url", f"http://127.0.0.1:{dead}"]
    cmd += ["--decode", f"127.0.0.1:{free_port()}:{free_port()}", "--model", str(tiny_model), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def answering() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else proc.returncode
        try:
            return httpx.get(url + "/health", timeout=2).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    try:
        wait_until(answering, 120, "the router answering", interval_s=0.2)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        for path in ("/tokenize", "/detokenize"):
            resp = httpx.post(url + path, json={"prompt": "x", "tokens": [1]}, timeout=30)
            assert resp.status_code == 502, resp.text
            error = resp.json()["error"]
            assert error["code"] == 502 and error["type"] == "BadGatewayError"
            assert error["message"].startswith(f"prefill server unreachable for {path}"), error
    finally:
        proc.terminate()
        proc.wait(timeout=30)
