"""The core oracle through every transport: a whole stack (stock vLLM prefill + connector, decode node,
router) started with ``tilert up --transport NAME`` for the real Mooncake and NIXL libraries (tcp is the
session stack's), each process separate, on loopback; router output == the same vLLM alone, token for
token, streaming and not, for prompts up to about 500 tokens."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import Stack, start_stack, stop_stack
from test_e2e_stack import MAX_TOKENS, _prompts, _router_call, _vllm_alone

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def transport_stack(request: pytest.FixtureRequest, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[Stack]:  # fmt: skip
    name = request.param
    log = tmp_path_factory.mktemp(f"stack-{name}") / "stack.log"
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    handle = start_stack(tiny_model, log, "--transport", name, env=env)
    handle.transport = name
    yield handle
    stop_stack(handle)
    assert handle.proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_router_tokens_equal_vllm_alone_through_each_transport(transport_stack: Stack, stream: bool) -> None:
    health = httpx.get(transport_stack.decode + "/health", timeout=10).json()
    assert health["transport"] == transport_stack.transport  # no silent fallback to another transport
    for kind, prompt in _prompts(transport_stack.model):
        want_ids, want_text, prompt_tokens = _vllm_alone(transport_stack, kind, prompt)
        got_ids, got_text, usage = _router_call(transport_stack.router, transport_stack.model, kind, prompt, stream)
        assert (got_ids, got_text) == (want_ids, want_text)
        assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == MAX_TOKENS
