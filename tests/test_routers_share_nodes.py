"""Two routers over the same two decode nodes and the same prefill, no store shared between the routers: the nodes'
own reservations keep them from double-booking a slot.

The session stack's prefill and decode node (eight sequences) are joined by a second node that holds two, and two
more routers that both list both nodes; a bounded load through both routers at once oversubscribes the small node,
so the routers' own counts disagree with what the node has left and its reserve refuses them. Every answer must
be vLLM alone's, token for token (a slot booked twice would mix two prompts' KV), every slot free afterwards, and
each node must have served.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.oracle import router_call, vllm_alone
from support.stack import Stack, decodes_served, free_port, start_logged, stop_procs, wait_healthy, without_decode
from support.waiting import wait_until

from tilert.stack import StackConfig, child_env, decode_command, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

ROUTERS = 2
REQUESTS = 12  # through both routers at once: more than the small node's two sequences, fewer than all slots


@contextlib.contextmanager
def _processes(stack: Stack, logs: Path) -> Iterator[tuple[list[str], list[str]]]:
    """(both routers' URLs, both nodes' URLs): a second decode node and two routers over both nodes."""
    assert stack.secret_file is not None
    node_a = httpx.get(stack.decode + "/health", timeout=10).json()
    base = StackConfig(model=stack.model, prefill_port=int(stack.prefill.rsplit(":", 1)[1]))
    small = replace(base, ctrl_port=free_port(), decode_http_port=free_port())
    nodes = [f"127.0.0.1:{node_a['ctrl_port']}:{stack.decode.rsplit(':', 1)[1]}"]
    nodes.append(f"127.0.0.1:{small.ctrl_port}:{small.decode_http_port}")
    env = child_env(stack.secret_file)
    procs: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        cmd = [*decode_command(small), "--max-sequences", "2"]
        procs.append((start_logged(cmd, env, logs / "node-b.log"), f"http://127.0.0.1:{small.decode_http_port}", logs))
        routers = []
        for i in range(ROUTERS):
            port = free_port()
            cmd = router_command(replace(base, port=port))
            cmd = without_decode(cmd) + [arg for node in nodes for arg in ("--decode", node)]
            routers.append(f"http://127.0.0.1:{port}")
            procs.append((start_logged(cmd, env, logs / f"router-{i}.log"), routers[-1], logs))
        for proc, url, _ in procs:
            wait_healthy(url, proc, 300)
        yield routers, [stack.decode, procs[0][1]]
    finally:
        stop_procs([proc for proc, _, _ in procs])


def test_two_routers_over_two_nodes_never_double_book(stack: Stack, tmp_path: Path) -> None:
    prompts: list[tuple[str, Any]] = [("completion", f"def function_{i}(a, b):") for i in range(REQUESTS)]
    want = [vllm_alone(stack, kind, prompt)[:2] for kind, prompt in prompts]
    with _processes(stack, tmp_path) as (routers, nodes):
        before = [decodes_served(node) for node in nodes]
        with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
            futures = [
                pool.submit(router_call, routers[i % ROUTERS], stack.model, kind, prompt, i % 2 == 0)
                for i, (kind, prompt) in enumerate(prompts)
            ]
            got = [f.result()[:2] for f in futures]
        assert got == want

        def all_free() -> bool:
            health = [httpx.get(node + "/health", timeout=10).json() for node in nodes]
            return all(h["slots_free"] == h["slots_total"] for h in health)

        wait_until(all_free, 10, "every slot of both nodes free", interval_s=0.1)
        served = [decodes_served(node) - b for node, b in zip(nodes, before, strict=True)]
        refused = (tmp_path / "node-b.log").read_text().count('"POST /v1/reserve HTTP/1.1" 429')
        print(f"requests served per node: {dict(zip(nodes, served, strict=True))}; reserves node B refused: {refused}")
        assert sum(served) == REQUESTS and all(n > 0 for n in served), served
