"""Two routers over two decode nodes and two stock vLLM prefill instances, and a prefill instance that is down and
comes back.

The session stack's prefill and decode node are joined by a second vLLM prefill instance (the same command ``tilert
up`` starts it with, its connector copying in batches: ``STAGE_BATCH_BYTES``), a second decode node, and two routers
that list both instances and both nodes, one choosing the least loaded instance, the other by prompt prefix. A
bounded load through both routers at once must answer what vLLM alone answers, token for token, leave no decode slot
held, and reach both prefill instances (counted by the routers and by each vLLM's own metrics).

The breaker test gives a third router a prefill instance on a port nobody listens on: its requests are retried on
the other instance (no client sees an error) until its circuit breaker takes it out; then the port is served, and
the router probes it and lets it back in. Serving that port is a plain loopback TCP relay to the second vLLM
instance (starting one more vLLM on a port chosen in advance would cost as long again as this whole module): the
instance the router lets back in, and whose answers are checked, is the real vLLM behind it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.oracle import router_call, vllm_alone
from support.stack import Stack, free_port, wait_healthy, with_connector_settings
from support.waiting import wait_until

from tilert.stack import StackConfig, child_env, decode_command, prefill_command, prefill_env, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

REQUESTS = 12  # through both routers at once
POLICIES = ("least_loaded", "prefix_hash")


@dataclass
class World:
    routers: list[str]
    nodes: list[str]  # their HTTP roots
    specs: list[str]  # host:ctrl:http, as a router is told
    prefills: list[str]
    breaker_router: str  # over the session's prefill and down_port, which nobody listens on yet
    down_port: int
    base: StackConfig
    env: dict[str, str]
    logs: Path


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _router(base: StackConfig, prefills: list[str], nodes: list[str], *extra: str) -> tuple[list[str], str]:
    """``tilert router``'s command over ``prefills`` and ``nodes`` on a free port, and its URL."""
    port = free_port()
    cmd = router_command(replace(base, port=port))
    out: list[str] = []
    args = iter(cmd)
    for arg in args:
        if arg in ("--decode", "--prefill-url"):
            next(args)
        else:
            out.append(arg)
    out += [a for url in prefills for a in ("--prefill-url", url)]
    out += [a for node in nodes for a in ("--decode", node)]
    return [*out, *extra], f"http://127.0.0.1:{port}"


# The second instance's connector copies a request's KV in batches (on CPU each layer goes as it completes by
# default): the short completions here (about 10 tokens) at wait_for_save, after the forward, the chats (their system
# prompt) a layer at a time during it. Its answers, checked like the first instance's, show both against real vLLM.
STAGE_BATCH_BYTES = 100_000


@pytest.fixture(scope="module")
def world(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A second vLLM prefill instance, a second decode node, two routers over both of each (one per policy)."""
    assert stack.secret_file is not None
    logs = tmp_path_factory.mktemp("prefill-instances")
    node_a = httpx.get(stack.decode + "/health", timeout=10).json()
    base = StackConfig(model=stack.model, prefill_port=free_port(), ctrl_port=free_port(), decode_http_port=free_port())
    env = child_env(stack.secret_file)
    nodes = [f"127.0.0.1:{node_a['ctrl_port']}:{stack.decode.rsplit(':', 1)[1]}"]
    nodes.append(f"127.0.0.1:{base.ctrl_port}:{base.decode_http_port}")
    prefills = [stack.prefill, f"http://127.0.0.1:{base.prefill_port}"]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        prefill = _start(
            with_connector_settings(prefill_command(base), tilert_stage_batch_bytes=STAGE_BATCH_BYTES),
            {**env, **prefill_env(base)},
            logs / "prefill-2.log",
        )
        procs.append(prefill)
        node = _start([*decode_command(base), "--max-sequences", "4"], env, logs / "node-b.log")
        procs.append(node)
        routers = []
        for i, policy in enumerate(POLICIES):
            cmd, url = _router(base, prefills, nodes, "--prefill-policy", policy)
            procs.append(_start(cmd, env, logs / f"router-{i}.log"))
            routers.append(url)
        down_port = free_port()
        breaker = ("--prefill-breaker-failures", "2", "--prefill-breaker-open-s", "1")
        cmd, url = _router(base, [stack.prefill, f"http://127.0.0.1:{down_port}"], nodes[:1], *breaker)
        procs.append(_start(cmd, env, logs / "router-breaker.log"))
        routers.append(url)
        wait_healthy(prefills[1], prefill, 300, logs / "prefill-2.log")
        wait_healthy(f"http://127.0.0.1:{base.decode_http_port}", node, 300, logs / "node-b.log")
        for proc, url in zip(procs[2:], routers, strict=True):
            wait_healthy(url, proc, 120)  # the breaker router: degraded (one instance answers) is still 200
        node_urls = [stack.decode, f"http://127.0.0.1:{base.decode_http_port}"]
        yield World(routers[:2], node_urls, nodes, prefills, routers[2], down_port, base, env, logs)
    finally:
        _stop(procs)


def _vllm_served(prefill: str) -> float:
    """Requests the vLLM instance has finished (its own ``vllm:request_success_total``)."""
    text = httpx.get(prefill + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{.*\} (\S+)$", text, re.M))


def _instances(router: str) -> dict[str, dict[str, Any]]:
    """The router's prefill instances as its /health shows them, by URL."""
    return {p["url"]: p for p in httpx.get(router + "/health", timeout=10).json()["prefill"]}


def _all_slots_free(nodes: list[str]) -> bool:
    health = [httpx.get(node + "/health", timeout=10).json() for node in nodes]
    return all(h["slots_free"] == h["slots_total"] for h in health)


def test_two_routers_two_nodes_two_prefill_instances_token_exact(stack: Stack, world: World) -> None:
    prompts: list[tuple[str, Any]] = [("completion", f"def function_{i}(a, b):") for i in range(REQUESTS - 2)]
    system = {"role": "system", "content": "You answer in Python. " * 16}  # past prefill_prefix_chars
    prompts += [("chat", [system, {"role": "user", "content": f"Sort list {i}."}]) for i in range(2)]
    want = [vllm_alone(stack, kind, prompt)[:2] for kind, prompt in prompts]
    vllm_before = [_vllm_served(p) for p in world.prefills]
    with ThreadPoolExecutor(max_workers=REQUESTS) as pool:
        futures = [
            pool.submit(router_call, world.routers[i % 2], stack.model, kind, prompt, i % 3 == 0)
            for i, (kind, prompt) in enumerate(prompts)
        ]
        got = [f.result()[:2] for f in futures]
    assert got == want
    wait_until(lambda: _all_slots_free(world.nodes), 10, "every slot of both nodes free", interval_s=0.1)
    per_router = {router: _instances(router) for router in world.routers}
    counts = {url: sum(r[url]["requests"] for r in per_router.values()) for url in world.prefills}
    served = [_vllm_served(p) - b for p, b in zip(world.prefills, vllm_before, strict=True)]
    print(f"prefill requests per instance (routers' count): {counts}; vLLM's own: {served}")
    assert all(p["in_flight"] == 0 and p["state"] == "closed" for r in per_router.values() for p in r.values())
    assert sum(counts.values()) == REQUESTS and all(n > 0 for n in counts.values()), counts
    assert all(n > 0 for n in served), served
    # prefix_hash: the chat requests share their first characters (the system prompt): one instance served both
    sticky = world.routers[1]
    before = {url: p["requests"] for url, p in _instances(sticky).items()}
    for i in range(3):
        messages = [system, {"role": "user", "content": f"Reverse list {i}."}]
        assert router_call(sticky, stack.model, "chat", messages, False)[:2] == vllm_alone(stack, "chat", messages)[:2]
    moved = {url: p["requests"] - before[url] for url, p in _instances(sticky).items()}
    assert sorted(moved.values()) == [0, 3], moved


class Relay:
    """A loopback TCP relay: ``port`` forwards every connection to ``target_port`` while it runs."""

    def __init__(self, port: int, target_port: int) -> None:
        self.port, self.target_port = port, target_port
        self._server = socket.create_server(("127.0.0.1", port))
        self._conns: list[socket.socket] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            upstream.settimeout(None)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stopped = True
        self._server.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.close()
        self._thread.join(5)


def test_a_prefill_instance_down_is_taken_out_and_let_back_in(stack: Stack, world: World) -> None:
    router, down = world.breaker_router, f"http://127.0.0.1:{world.down_port}"
    prompts = [f"class Thing{i}:" for i in range(4)]
    want = {p: vllm_alone(stack, "completion", p)[:2] for p in prompts}
    for i, prompt in enumerate(prompts):  # no client sees the down instance
        assert router_call(router, stack.model, "completion", prompt, i % 2 == 0)[:2] == want[prompt]
    seen = _instances(router)[down]
    assert seen["state"] == "open" and not seen["ok"] and seen["failures_in_a_row"] == 2, seen
    assert httpx.get(router + "/health", timeout=10).json()["status"] == "degraded"
    metrics = httpx.get(router + "/metrics", timeout=10).text
    assert re.search(r"^tilert:prefill_retries_total\{[^}]*\} 2\.0$", metrics, re.M), metrics
    state = rf'^tilert:prefill_instance_state\{{instance="{down}",[^}}]*state="open"\}} 1\.0$'
    assert re.search(state, metrics, re.M), metrics
    relay = Relay(world.down_port, int(world.prefills[1].rsplit(":", 1)[1]))  # the instance is up again
    try:

        def back() -> bool:
            prompt = prompts[0]
            assert router_call(router, stack.model, "completion", prompt, False)[:2] == want[prompt]
            return _instances(router)[down]["state"] == "closed"

        t0 = time.monotonic()
        wait_until(back, 30, "the instance let back in", interval_s=0.2)
        print(f"instance let back in {time.monotonic() - t0:.1f} s after it was up again")
        before = _instances(router)[down]["requests"]
        with ThreadPoolExecutor(max_workers=4) as pool:
            got = list(pool.map(lambda p: router_call(router, stack.model, "completion", p, True)[:2], prompts))
        assert got == [want[p] for p in prompts]
        after = _instances(router)
        assert after[down]["requests"] > before and after[down]["state"] == "closed"
        assert httpx.get(router + "/health", timeout=10).json()["status"] == "ok"
        wait_until(lambda: _all_slots_free(world.nodes), 10, "every slot free", interval_s=0.1)
    finally:
        relay.close()
