"""Admission counts what a decode node decodes at once: more concurrent long streams than the node's sequences, behind
a router whose transfer timeout is shorter than one of those streams. A request beyond the node's sequences waits in
the router's queue (no byte sent), never inside the node with its first token out and its decode stream silent until
the router's transfer timeout answers it with an error mid-stream: every stream is vLLM alone's answer, token for
token.

The session stack's prefill serves a decode node of two sequences behind a router of its own (transfer timeout
1.5 s, no resumes: a stalled stream is the client's error at once).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from support.oracle import vllm_alone
from support.stack import Stack, free_port, start_logged, stop_procs, wait_healthy

from tilert.stack import StackConfig, child_env, decode_command, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

SEQUENCES = 2
STREAMS = 4  # more than the node decodes at once (and than its slots were before: sequences + 1)
TRANSFER_TIMEOUT_S = 1.5  # far above a transfer's time here, far below a stream's
PROMPT = "def admitted(a, b):"
MAX_TOKENS = 2000  # each stream outlasts the transfer timeout (checked below); the stack's context is 2048


@dataclass
class Served:
    node: str
    router: str
    procs: list[subprocess.Popen[bytes]]


@pytest.fixture
def served(stack: Stack, tmp_path: Path) -> Iterator[Served]:
    assert stack.secret_file is not None
    env = child_env(stack.secret_file)
    base = StackConfig(model=stack.model, prefill_port=int(stack.prefill.rsplit(":", 1)[1]))
    cfg = replace(base, ctrl_port=free_port(), decode_http_port=free_port(), port=free_port())
    node_cmd = [*decode_command(cfg), "--max-sequences", str(SEQUENCES)]
    router_cmd = [
        *router_command(cfg),
        *("--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--decode-resumes", "0", "--queue-timeout-s", "300"),
    ]
    procs = [start_logged(node_cmd, env, tmp_path / "node.log")]
    try:
        procs.append(start_logged(router_cmd, env, tmp_path / "router.log"))
        node, router = f"http://127.0.0.1:{cfg.decode_http_port}", f"http://127.0.0.1:{cfg.port}"
        wait_healthy(node, procs[0], 300, tmp_path / "node.log")
        wait_healthy(router, procs[1], 120, tmp_path / "router.log")
        yield Served(node, router, procs)
    finally:
        stop_procs(procs)


def _stream(router: str, model: Path) -> tuple[list[int], float, float]:
    """The streamed token ids, when the first chunk came and when the stream ended (monotonic seconds)."""
    client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=300, max_retries=0)
    stream = client.completions.create(
        model=str(model),
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ids: list[int] = []
    first = 0.0
    for chunk in stream:  # an error event mid-stream raises here
        first = first or time.monotonic()
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
    return ids, first, time.monotonic()


def test_streams_beyond_the_nodes_sequences_wait_in_the_router_queue(stack: Stack, served: Served) -> None:
    health = httpx.get(served.node + "/health", timeout=10).json()
    assert health["slots_total"] == SEQUENCES, "a node grants as many reservations as it decodes at once"
    want = vllm_alone(stack, "completion", PROMPT, {"max_tokens": MAX_TOKENS, "ignore_eos": True})[0]

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=STREAMS) as pool:
        answers = list(pool.map(lambda _: _stream(served.router, stack.model), range(STREAMS)))
    for ids, _, _ in answers:
        assert ids == want, "a stream is not vLLM alone's answer"
    ends = sorted(end for _, _, end in answers)
    assert ends[SEQUENCES - 1] - start > TRANSFER_TIMEOUT_S, "the streams must outlast the transfer timeout"
    # The streams beyond the node's sequences began (their first chunk) only once one before them had ended.
    firsts = sorted(first for _, first, _ in answers)
    assert firsts[SEQUENCES] >= ends[0] - 1.0, (firsts, ends)
    metrics = httpx.get(served.router + "/metrics", timeout=10).text
    waited = float(re.search(r"^tilert:request_queue_time_seconds_sum\{.*\} (\S+)$", metrics, re.M)[1])  # type: ignore[index]
    assert waited > TRANSFER_TIMEOUT_S, "the streams beyond the node's sequences waited in the router's queue"
