"""A stream that survives its decode node: the node serving a long greedy stream is killed (``SIGKILL``) mid-answer;
the router prefills the prompt and the tokens already sent again for the other node and goes on with the same
stream. The client sees a pause, not an error: the answer is vLLM alone's, token for token, and no gap between two
chunks reaches a second. The killed node, started again, is admitted by the router (nothing else restarted) and
serves again.

The session stack's prefill serves two new decode nodes (two sequences each) behind a router of their own.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI
from support.oracle import router_call, vllm_alone
from support.stack import Stack, decodes_served, free_port, start_logged, stop_procs, wait_healthy, without_decode
from support.waiting import wait_until

from tilert.stack import StackConfig, child_env, decode_command, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

PROMPT = "def survive(a, b):"
MAX_TOKENS = 1200
KILL_AFTER = 60  # tokens the client has before the serving node is killed


class Nodes:
    """Two decode nodes and a router over both; a node can be killed and started again on its own ports."""

    def __init__(self, stack: Stack, logs: Path) -> None:
        assert stack.secret_file is not None
        self.env = child_env(stack.secret_file)
        self.logs = logs
        base = StackConfig(model=stack.model, prefill_port=int(stack.prefill.rsplit(":", 1)[1]))
        self.configs = [replace(base, ctrl_port=free_port(), decode_http_port=free_port()) for _ in range(2)]
        self.urls = [f"http://127.0.0.1:{cfg.decode_http_port}" for cfg in self.configs]
        self.procs: list[subprocess.Popen[bytes]] = [self._node(i) for i in range(2)]
        port = free_port()
        cmd = without_decode(router_command(replace(base, port=port)))
        for cfg in self.configs:
            cmd += ["--decode", f"127.0.0.1:{cfg.ctrl_port}:{cfg.decode_http_port}"]
        self.router = f"http://127.0.0.1:{port}"
        self.router_proc = self._start(cmd, "router.log")
        for proc, url in zip(self.procs, self.urls, strict=True):
            wait_healthy(url, proc, 300)
        wait_healthy(self.router, self.router_proc, 120)

    def _start(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        return start_logged(cmd, self.env, self.logs / log)

    def _node(self, i: int) -> subprocess.Popen[bytes]:
        return self._start([*decode_command(self.configs[i]), "--max-sequences", "2"], f"node-{i}.log")

    def serving(self) -> int:
        """The node holding a slot now."""
        busy = [i for i, url in enumerate(self.urls) if _slots_in_use(url) > 0]
        assert len(busy) == 1, busy
        return busy[0]

    def kill(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait(30)

    def restart(self, i: int) -> None:
        self.procs[i] = self._node(i)
        wait_healthy(self.urls[i], self.procs[i], 300)

    def close(self) -> None:
        stop_procs([*self.procs, self.router_proc])


def _slots_in_use(node: str) -> int:
    health = httpx.get(node + "/health", timeout=10).json()
    return int(health["slots_total"] - health["slots_free"])


@pytest.fixture
def nodes(stack: Stack, tmp_path: Path) -> Iterator[Nodes]:
    made = Nodes(stack, tmp_path)
    try:
        yield made
    finally:
        made.close()


def _stream(router: str, model: Path, on_token: Any) -> tuple[list[int], list[float]]:
    """The streamed token ids and the arrival time of each chunk; ``on_token(n)`` after each chunk."""
    client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0)
    stream = client.completions.create(
        model=str(model),
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids: list[int] = []
    times: list[float] = []
    for chunk in stream:
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
        times.append(time.monotonic())
        on_token(len(ids))
    return ids, times


def test_killed_node_mid_stream_the_stream_goes_on_token_exact(stack: Stack, nodes: Nodes) -> None:
    want = vllm_alone(stack, "completion", PROMPT, {"max_tokens": MAX_TOKENS, "ignore_eos": True})[0]
    killed: list[int] = []

    def kill_once(n: int) -> None:
        if n >= KILL_AFTER and not killed:
            killed.append(nodes.serving())
            nodes.kill(killed[0])

    ids, times = _stream(nodes.router, stack.model, kill_once)
    assert killed, "the stream ended before a node was killed"
    assert ids == want, "the resumed stream is not vLLM alone's answer"
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"killed node {killed[0]} after {KILL_AFTER} tokens; longest gap {max(gaps) * 1000:.0f} ms")
    assert max(gaps) < 1.0
    survivor = 1 - killed[0]
    wait_until(lambda: _slots_in_use(nodes.urls[survivor]) == 0, 10, "the surviving node's slot free")
    metrics = httpx.get(nodes.router + "/metrics", timeout=10).text
    assert re.search(r'^tilert:decode_resumes_total\{.*reason="lost"\} 1\.0$', metrics, re.M), metrics[-2000:]

    # Started again, the node is admitted and serves: four requests at once need both nodes (two slots each).
    nodes.restart(killed[0])
    before = decodes_served(nodes.urls[killed[0]])
    wait_until(
        lambda: httpx.get(nodes.router + "/health", timeout=10).json()["status"] == "ok", 30, "the router admits it"
    )
    prompts = [f"def again_{i}(x):" for i in range(4)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda p: router_call(nodes.router, stack.model, "completion", p, True)[0], prompts))
    assert got == [vllm_alone(stack, "completion", p)[0] for p in prompts]
    assert decodes_served(nodes.urls[killed[0]]) > before, "the restarted node served nothing"


def test_a_resumed_stream_keeps_its_logprobs(stack: Stack, nodes: Nodes) -> None:
    """``logprobs`` on a stream whose node is killed: the tokens before come from the first node, the resumed one
    from the new prefill (asked for it as ids), the rest from the new node; all as vLLM alone's, within 1e-4."""
    body = {"model": str(stack.model), "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "logprobs": 3}
    want = httpx.post(stack.prefill + "/v1/completions", json={**body, "ignore_eos": True}, timeout=300).json()
    want_lp = want["choices"][0]["logprobs"]
    client = OpenAI(base_url=nodes.router + "/v1", api_key="unused", timeout=120, max_retries=0)
    stream = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    got: dict[str, list[Any]] = {key: [] for key in want_lp}
    killed: list[int] = []
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for key, values in choice.logprobs.model_dump().items():
                    got[key] += values or []
        if len(got["tokens"]) >= KILL_AFTER and not killed:
            killed.append(nodes.serving())
            nodes.kill(killed[0])
    assert killed, "the stream ended before a node was killed"
    metrics = httpx.get(nodes.router + "/metrics", timeout=10).text
    assert re.search(r'^tilert:decode_resumes_total\{.*reason="lost"\} 1\.0$', metrics, re.M), metrics[-2000:]
    assert got["tokens"] == want_lp["tokens"] and got["text_offset"] == want_lp["text_offset"]
    for name in ("token_logprobs", "top_logprobs"):
        for i, (a, b) in enumerate(zip(want_lp[name], got[name], strict=True)):
            values = (a, b) if name == "token_logprobs" else (list(a.values()), list(b.values()))
            assert name == "token_logprobs" or list(a) == list(b), (i, a, b)
            assert np.allclose(*values, rtol=0, atol=1e-4), (i, name, a, b)
