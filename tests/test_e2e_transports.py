"""The core oracle through every transport: a whole stack (stock vLLM prefill + connector, decode node, router) started
with ``tilert up --transport NAME`` for the real Mooncake and NIXL libraries (tcp is the session stack's), each
process separate, on loopback; router output == the same vLLM alone, token for token, streaming and not, for prompts
up to about 500 tokens.

Fail fast through each transport, at the router, with the real OpenAI client: handshake refused, extraction error,
transport error, peer gone (the decode node killed mid-transfer) and timeout each reach the client as a terminal
error in under a second (the node tells the router on its watch stream, or the stream closes, while vLLM still
computes the prefill), and afterwards the connector's staging pool is whole again on vLLM's own ``/metrics``
(``tilert:staging_pool_used_bytes`` 0, no transfer in flight) and every receive slot is free on the decode node's
``/health``. The three stacks are this module's (tcp: the session stack), one vLLM each, started together with every
spare node and router the selected tests use (each start-up is mostly one process importing: started side by side
they overlap). Handshake refused and peer gone use other decode nodes + routers on the same vLLM (a node of a
2-layer model refuses the offer of the 3-layer KV for real; a node the test can kill without stopping ``tilert
up``). Extraction error, transport error and timeout are armed for one transfer through the connector's test-only
fault hook (:mod:`tilert.connector.faults`): the real parts cannot produce them on demand; everything after the
fault is real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.oracle import MAX_TOKENS, prompts, router_call, source_text, vllm_alone
from support.stack import (
    Launch,
    Stack,
    free_port,
    launch_stack,
    stop_launch,
    stop_procs,
    stop_stack,
    stop_stack_checked,
    wait_healthy,
)
from support.waiting import wait_until

from tilert.connector import faults
from tilert.stack import StackConfig, child_env, decode_command, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]

FAIL_LIMIT_S = 1.0  # from the failure to the client's terminal error
SANITY_S = 30.0  # from the request to the client's error (the failure comes first, inside the prefill)


@dataclass
class Spare:
    """Another decode node and a router in front of it, on a stack's vLLM and secret."""

    node: subprocess.Popen[bytes]
    router: subprocess.Popen[bytes]
    decode_url: str
    router_url: str
    ctrl_port: int
    logs: Path
    again: Callable[[], Spare]  # the same spare launched anew, on other ports


BIND_TRIES = 3  # launches of a spare whose port another process bound first (picked free, bound a moment later)


def _launch_spare(model: Path, node_model: Path, transport: str, secret: Path, prefill_port: int, logs: Path) -> Spare:
    """The node (serving ``node_model``) and its router started; :func:`_wait_spare` waits for both."""
    cfg = StackConfig(
        model=model,
        port=free_port(),
        prefill_port=prefill_port,
        ctrl_port=free_port(),
        decode_http_port=free_port(),
        transport=transport,
    )
    env = {**child_env(secret), "UCX_NET_DEVICES": "lo"}
    with open(logs / "node.log", "w") as node_log, open(logs / "router.log", "w") as router_log:
        node = subprocess.Popen(
            decode_command(replace(cfg, model=node_model)), env=env, stdout=node_log, stderr=subprocess.STDOUT
        )
        router = subprocess.Popen(router_command(cfg), env=env, stdout=router_log, stderr=subprocess.STDOUT)
    return Spare(
        node,
        router,
        f"http://127.0.0.1:{cfg.decode_http_port}",
        f"http://127.0.0.1:{cfg.port}",
        cfg.ctrl_port,
        logs,
        lambda: _launch_spare(model, node_model, transport, secret, prefill_port, logs),
    )


def _wait_spare(spare: Spare) -> Spare:
    """``spare`` healthy, or the same spare launched again when one of its processes died because another process
    bound its port first (at most ``BIND_TRIES`` launches; any other death fails at once)."""
    for _ in range(BIND_TRIES - 1):
        try:
            _wait_healthy_spare(spare)
            return spare
        except AssertionError as exc:
            if "Address already in use" not in str(exc):
                raise
            _stop_spare(spare)
            spare = spare.again()
    _wait_healthy_spare(spare)
    return spare


def _wait_healthy_spare(spare: Spare) -> None:
    wait_healthy(spare.decode_url, spare.node, 300, spare.logs / "node.log")
    wait_healthy(spare.router_url, spare.router, 300, spare.logs / "router.log")


def _stop_spare(spare: Spare) -> None:
    stop_procs([spare.router, spare.node])


@dataclass
class Rig:
    """One transport's parts: its stack (tcp: the session's) and the spares on that stack's vLLM the tests use:
    ``spare``, a node of the stack's own model for a test to kill; ``refusing``, a node whose model has 2 layers
    where the stack's has 3 (it refuses the offer of vLLM's 3-layer KV)."""

    stack: Stack
    spare: Spare | None = None
    refusing: Spare | None = None


SPARES = ("spare", "refusing_spare")


def _wanted(request: pytest.FixtureRequest) -> dict[str, set[str]]:
    """The transports this run's tests of this module use (``-k`` may select a few), each with the spares its tests
    use."""
    wanted: dict[str, set[str]] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is not request.module or callspec is None:
            continue
        if "transport_stack" in callspec.params:
            uses = wanted.setdefault(callspec.params["transport_stack"], set())
            uses.update(name for name in SPARES if name in getattr(item, "fixturenames", ()))
    return wanted


@pytest.fixture(scope="module")
def rigs(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Rig]]:
    """Every transport's stack and spares the selected tests use, all started at once, since each start-up is mostly
    one process importing: ``tilert up --transport NAME`` for mooncake and nixl (tcp: the session stack), stopped at
    the module's end by SIGINT and checked (status 0, no process left)."""
    from tilert.models.tiny import build_tiny_model

    wanted = _wanted(request)
    root = tmp_path_factory.mktemp("transports")
    launches: dict[str, Launch] = {}
    stacks: dict[str, Stack] = {}
    spares: dict[tuple[str, str], Spare] = {}
    two_layers = None
    if any("refusing_spare" in uses for uses in wanted.values()):
        two_layers = build_tiny_model("deepseek_v3", root / "two-layers", seed=0, num_hidden_layers=2)

    def launch_spares(name: str, secret: Path, prefill_port: int) -> None:
        for kind in sorted(wanted[name]):
            logs = root / f"{kind}-{name}"
            logs.mkdir()
            node_model = two_layers if kind == "refusing_spare" else tiny_model
            assert node_model is not None
            spares[name, kind] = _launch_spare(tiny_model, node_model, name, secret, prefill_port, logs)

    try:
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "VLLM_CPU_OMP_THREADS_BIND": "1"}
        for name in sorted(wanted.keys() - {"tcp"}):
            (root / name).mkdir()
            launches[name] = launch_stack(tiny_model, root / name / "stack.log", "--transport", name, env=env)
            launch_spares(name, launches[name].secret_file, launches[name].prefill_port)
        if "tcp" in wanted:  # the session stack (its oracle is test_e2e_stack's)
            stacks["tcp"] = request.getfixturevalue("stack")
            assert stacks["tcp"].secret_file is not None
            launch_spares("tcp", stacks["tcp"].secret_file, int(stacks["tcp"].prefill.rsplit(":", 1)[1]))
        for name, launch in launches.items():
            stacks[name] = launch.wait()
            stacks[name].transport = name
        for key, spare in spares.items():
            spares[key] = _wait_spare(spare)
    except BaseException:
        for spare in spares.values():
            _stop_spare(spare)
        for name, launch in launches.items():
            if name in stacks:
                stop_stack(stacks[name])
            else:
                stop_launch(launch)
        raise
    try:
        yield {
            name: Rig(stacks[name], spares.get((name, "spare")), spares.get((name, "refusing_spare")))
            for name in wanted
        }
    finally:
        for spare in spares.values():
            _stop_spare(spare)
    failed: list[BaseException] = []
    for name in launches:
        try:
            stop_stack_checked(stacks[name])  # SIGINT: status 0, no process left
        except BaseException as exc:  # noqa: BLE001 - every stack is stopped, then the first failure raised
            failed.append(exc)
    if failed:
        raise failed[0]


@pytest.fixture(scope="module", params=["tcp", "mooncake", "nixl"])
def transport_stack(request: pytest.FixtureRequest, rigs: dict[str, Rig]) -> Stack:
    return rigs[request.param].stack


@pytest.fixture(autouse=True)
def _disarmed(transport_stack: Stack) -> Iterator[None]:
    """A fault a failed test armed, and no transfer took, must not strike the next test's transfer."""
    yield
    if transport_stack.fault_dir is not None:
        (transport_stack.fault_dir / "next").unlink(missing_ok=True)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_router_tokens_equal_vllm_alone_through_each_transport(transport_stack: Stack, stream: bool) -> None:
    if transport_stack.transport == "tcp":
        pytest.skip("tcp: the session stack's oracle is tests/test_e2e_stack.py")
    health = httpx.get(transport_stack.decode + "/health", timeout=10).json()
    assert health["transport"] == transport_stack.transport  # no silent fallback to another transport
    for kind, prompt in prompts(transport_stack.model):
        want_ids, want_text, prompt_tokens = vllm_alone(transport_stack, kind, prompt)
        got_ids, got_text, usage = router_call(transport_stack.router, transport_stack.model, kind, prompt, stream)
        assert (got_ids, got_text) == (want_ids, want_text)
        assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == MAX_TOKENS


# ---- fail fast at the router, per transport -----------------------------------------------------------


@pytest.fixture(scope="module")
def spare(transport_stack: Stack, rigs: dict[str, Rig]) -> Spare:
    """A node of the stack's own model, for the test to kill."""
    handle = rigs[transport_stack.transport].spare
    assert handle is not None
    return handle


@pytest.fixture(scope="module")
def refusing_spare(transport_stack: Stack, rigs: dict[str, Rig]) -> Spare:
    """A node whose model has 2 layers where the stack's has 3: it refuses the offer of vLLM's 3-layer KV."""
    handle = rigs[transport_stack.transport].refusing
    assert handle is not None
    return handle


def _fails_fast(router: str, model: Path, prompt: str, limit_s: float) -> tuple[openai.APIStatusError, float]:
    """One completion through ``router`` with the real OpenAI client: a terminal error (no retry) within
    ``limit_s`` of the request, and when it came (``time.time()``, comparable with the fault hook's)."""
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", timeout=30, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=str(model), prompt=prompt, max_tokens=8, temperature=0)
    elapsed = time.monotonic() - t0
    assert elapsed < limit_s, f"the client's error came {elapsed:.2f}s after the request: {exc.value}"
    assert exc.value.status_code >= 500 or exc.value.status_code == 400, exc.value
    return exc.value, time.time()


def _after_fault(stack: Stack, error_at: float, fired_after_s: float = 0.0) -> float:
    """Seconds from the moment the armed fault struck (plus ``fired_after_s``) to the client's error."""
    assert stack.fault_dir is not None
    struck = faults.struck_at(stack.fault_dir)
    assert struck is not None, "the armed fault never struck"
    since = error_at - (struck + fired_after_s)
    assert since < FAIL_LIMIT_S, f"the client's error came {since:.2f}s after the failure"
    return since


def _staging_pool(prefill: str) -> dict[str, float]:
    """The connector's staging pool as vLLM's ``/metrics`` shows it (``tilert:staging_*`` gauges)."""
    text = httpx.get(prefill + "/metrics", timeout=10).text
    return {
        family.name.removeprefix("tilert:staging_"): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("tilert:staging_")
        for sample in family.samples
    }


def _pools_whole(prefill: str, decode: str | None, limit_s: float = 10.0) -> None:
    """Until the staging pool is whole on vLLM's /metrics and every receive slot is free on the node's /health.

    A freed extent reaches the gauges through vLLM's next engine step (the worker reports it, the scheduler
    accounts it, the stats travel to the API server): on a loaded 2-core host with NIXL's progress threads polling,
    seconds after the client's error. How fast the error comes is asserted apart (``FAIL_LIMIT_S``); here only that
    every extent and slot comes back."""
    deadline = time.monotonic() + limit_s
    while True:
        pool = _staging_pool(prefill)
        health = httpx.get(decode + "/health", timeout=10).json() if decode else None
        pool_ok = pool.get("pool_capacity_bytes", 0) > 0 and pool.get("pool_used_bytes") == 0
        pool_ok = pool_ok and pool.get("transfers_in_flight") == 0
        slots_ok = health is None or health["slots_free"] == health["slots_total"]
        if pool_ok and slots_ok:
            return
        assert time.monotonic() < deadline, f"pools not whole after {limit_s}s: staging {pool}, node {health}"
        time.sleep(0.05)


def _prompt(stack: Stack, n: int = 100) -> str:
    return source_text(n, stack.model, offset=1200)


def _ended_on_the_nodes_report(router: str) -> float:
    """Requests the router ended when the node reported their transfer failed on its watch stream (before the
    prefill returned), from the router's ``tilert:requests_total{outcome="transfer_failed"}``. (A fault that
    strikes near the end of a short prefill may lose that race: the decode request then fails with the same
    reason, so only the timeout test, whose forward stalls 0.2 s past the abort, counts on it.)"""
    text = httpx.get(router + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tilert:requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") == "transfer_failed"
    )


@pytest.mark.parametrize("fault", ["extraction_error", "transport_error"])
def test_fault_in_the_transfer_reaches_the_client_at_once(transport_stack: Stack, fault: str) -> None:
    assert transport_stack.fault_dir is not None
    faults.arm(transport_stack.fault_dir, fault)
    err, error_at = _fails_fast(transport_stack.router, transport_stack.model, _prompt(transport_stack), SANITY_S)
    assert f"injected {fault.replace('_', ' ')}" in str(err.body), err.body  # the prefill side's reason
    _after_fault(transport_stack, error_at)
    _pools_whole(transport_stack.prefill, transport_stack.decode)
    assert not (transport_stack.fault_dir / "next").exists()  # that transfer took it


def test_timeout_reaches_the_client_at_once(transport_stack: Stack) -> None:
    """The forward stalls past the sender's wait for the next layer: abort, then a terminal error."""
    assert transport_stack.fault_dir is not None
    faults.arm(transport_stack.fault_dir, "timeout")
    before = _ended_on_the_nodes_report(transport_stack.router)
    err, error_at = _fails_fast(transport_stack.router, transport_stack.model, _prompt(transport_stack), SANITY_S)
    assert f"no layer was staged within {faults.TIMEOUT_S:g}s" in str(err.body), err.body
    _after_fault(transport_stack, error_at, fired_after_s=faults.TIMEOUT_S)  # from the timeout firing
    assert _ended_on_the_nodes_report(transport_stack.router) == before + 1  # during the stall, not after it
    _pools_whole(transport_stack.prefill, transport_stack.decode)


def test_handshake_refused_reaches_the_client_at_once(transport_stack: Stack, refusing_spare: Spare) -> None:
    """The node refuses the offer (its engine cannot take the layouts): a real refusal at the handshake."""
    failed_before = _transfers_failed(refusing_spare.decode_url)
    err, _ = _fails_fast(refusing_spare.router_url, transport_stack.model, _prompt(transport_stack), FAIL_LIMIT_S)
    assert "mla layout has 3 layers, model has 2" in str(err.body), err.body  # the node's own reason
    _pools_whole(transport_stack.prefill, refusing_spare.decode_url)
    assert _transfers_failed(refusing_spare.decode_url) == failed_before + 1


def _control_connected(node: psutil.Process, ctrl_port: int) -> bool:
    """Whether a sender holds a connection to ``node``'s control port."""
    return any(
        conn.status == psutil.CONN_ESTABLISHED and conn.laddr and conn.laddr.port == ctrl_port
        for conn in node.net_connections(kind="tcp")
    )


def _transfers_failed(decode: str) -> float:
    text = httpx.get(decode + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tilert:kv_transfers_failed"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def test_peer_killed_mid_transfer_reaches_the_client_at_once(transport_stack: Stack, spare: Spare) -> None:
    """The forward stalls after staging its first layer, the prefill's sender connected to the node; the node is
    killed inside the stall. The router sees its watch stream close and moves the request at once, without
    waiting for the prefill to come back (no node left: 503)."""
    assert transport_stack.fault_dir is not None
    fault_dir = transport_stack.fault_dir
    faults.arm(fault_dir, "stall")
    outcome: list[Any] = []

    def call() -> None:
        try:
            prompt = _prompt(transport_stack, 40)
            outcome.append(_fails_fast(spare.router_url, transport_stack.model, prompt, SANITY_S))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    struck = wait_until(lambda: faults.struck_at(fault_dir), SANITY_S, "the stall to strike", interval_s=0.002)
    node = psutil.Process(spare.node.pid)
    wait_until(lambda: _control_connected(node, spare.ctrl_port), faults.STALL_S, "the sender to reach the node")
    os.kill(spare.node.pid, signal.SIGKILL)
    killed_at = time.time()
    spare.node.wait(10)
    caller.join(SANITY_S)
    assert outcome and isinstance(outcome[0], tuple), outcome
    err, error_at = outcome[0]
    assert err.status_code == 503 and "no healthy decode node" in str(err.body), err.body  # moved, not waited
    assert killed_at < struck + faults.STALL_S, "the node was killed after the stall: not mid-transfer"
    since = error_at - killed_at
    assert since < FAIL_LIMIT_S, f"the client's error came {since:.2f}s after the kill"
    _pools_whole(transport_stack.prefill, transport_stack.decode)
