"""The three parts on three hosts: the router, the stock vLLM prefill and the decode node each in a Linux network
namespace of its own (:mod:`support.netns`: private addresses joined by a bridge, no route anywhere else), started
as docs/deployment.md's "On several hosts" starts them, for each transport (tcp, the real Mooncake, the real NIXL).

Each part is told only the others' addresses: the router gets the prefill's URL and the decode node's address, the
decode node binds every interface of its host and advertises its own address (``--advertise-host``), the prefill's
connector dials whatever each claim names. A few greedy prompts through the router, with the real OpenAI client from
the router's host, equal the same vLLM alone token for token, and the decode host's interface counted at least the
prompts' KV bytes arriving: the KV crossed from one namespace to the other over the link.

UCX moves bytes between two processes of one kernel through shared memory even across network namespaces, which
two hosts never share: the nixl parts run with ``UCX_TLS=tcp``, as two hosts without RDMA NICs would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import netns
from support.oracle import MAX_TOKENS, router_call, source_text, vllm_alone
from support.stack import STARTUP_TIMEOUT_S, wait_healthy, with_connector_settings

from tilert.models.checkpoint import read_json
from tilert.stack import StackConfig, child_env, decode_command, prefill_command, prefill_env, write_secret_file

pytestmark = [pytest.mark.stack, pytest.mark.timeout(600)]

HOSTS = ("router", "prefill", "decode")
PORTS = {"router": 8000, "prefill": 8100, "ctrl": 5556, "http": 5557}  # the defaults: each host has its own ports
KV_CACHE_BYTES = 32 << 20
TRANSPORT_ENV = {"nixl": {"UCX_TLS": "tcp"}}  # see the module's docstring


@dataclass
class Hosts:
    lan: netns.Lan
    transport: str
    model: Path
    prefill: str
    decode: str
    router: str
    started_s: float


def _transports(request: pytest.FixtureRequest) -> list[str]:
    """The transports this run's tests of this module use (``-k`` may select a few)."""
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None and "hosts" in callspec.params:
            wanted.add(str(callspec.params["hosts"]))
    return sorted(wanted)


def _start_parts(lan: netns.Lan, transport: str, model: Path, secret: Path, logs: Path) -> Callable[[], None]:
    """The three parts started, each on its host, for ``transport``; returns the wait for all three to answer."""
    r, p, d = (lan.addr(h) for h in HOSTS)
    cfg = StackConfig(model=model, transport=transport, kv_cache_bytes=KV_CACHE_BYTES)
    base = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env = {**child_env(secret, base), **TRANSPORT_ENV.get(transport, {})}
    prefill_cmd = _with_sender_address(prefill_command(replace(cfg, host=p)), transport, p)
    decode_cmd = decode_command(replace(cfg, host="0.0.0.0", advertise_host=d))
    assert decode_cmd[decode_cmd.index("--advertise-host") + 1] == d
    router_cmd = [
        *(sys.executable, "-m", "tilert.cli", "router", "--model", str(model)),
        *("--prefill-url", f"http://{p}:{PORTS['prefill']}", "--decode", f"{d}:{PORTS['ctrl']}:{PORTS['http']}"),
        *("--host", r, "--port", str(PORTS["router"])),
    ]
    procs = {
        "prefill": lan.popen("prefill", prefill_cmd, {**env, **prefill_env(cfg)}, logs / "prefill.log"),
        "decode": lan.popen("decode", decode_cmd, env, logs / "decode.log"),
        "router": lan.popen("router", router_cmd, env, logs / "router.log"),
    }

    def wait() -> None:
        for name in ("decode", "prefill", "router"):  # from the router's host: what it reaches, we reach
            lan.call(
                "router",
                lambda n=name: wait_healthy(_urls(lan)[n], procs[n], STARTUP_TIMEOUT_S, logs / f"{n}.log"),
                STARTUP_TIMEOUT_S + 10,
            )

    return wait


def _urls(lan: netns.Lan) -> dict[str, str]:
    r, p, d = (lan.addr(h) for h in HOSTS)
    return {
        "prefill": f"http://{p}:{PORTS['prefill']}",
        "decode": f"http://{d}:{PORTS['http']}",
        "router": f"http://{r}:{PORTS['router']}",
    }


@pytest.fixture(scope="module")
def every_hosts(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Hosts]]:
    """For each transport the selected tests use, its three hosts with their parts, all transports started at once
    (each start-up is mostly one process importing: started side by side they overlap); every namespace
    and process removed at the module's end."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    secret = write_secret_file()
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            waits = {}
            lans = {}
            for transport in _transports(request):
                lans[transport] = stack.enter_context(netns.lan(HOSTS))
                logs = tmp_path_factory.mktemp(f"hosts-{transport}")
                waits[transport] = _start_parts(lans[transport], transport, tiny_model, secret, logs)
            for wait in waits.values():
                wait()
            started_s = time.monotonic() - t0
            yield {
                transport: Hosts(lan, transport, tiny_model, *_urls(lan).values(), started_s)
                for transport, lan in lans.items()
            }
    finally:
        shutil.rmtree(secret.parent, ignore_errors=True)


@pytest.fixture(scope="module", params=["tcp", "mooncake", "nixl"])
def hosts(request: pytest.FixtureRequest, every_hosts: dict[str, Hosts]) -> Hosts:
    return every_hosts[request.param]


def _with_sender_address(cmd: list[str], transport: str, address: str) -> list[str]:
    """The prefill's connector told its own host's address for the transport's sender (Mooncake's engine names
    itself by it), as docs/deployment.md's multi-host table says."""
    if transport != "mooncake":
        return cmd
    return with_connector_settings(cmd, tilert_transport_options={"hostname": address})


def _prompts(model: Path) -> list[tuple[str, Any, bool]]:
    """(kind, prompt, stream): short, about 100 tokens (several 16-token blocks), a chat of about 120."""
    return [
        ("completion", "def add(a, b):", False),
        ("completion", source_text(100, model), True),
        ("chat", [{"role": "user", "content": source_text(120, model, offset=500)}], False),
    ]


def _kv_bytes_per_token(model: Path) -> int:
    """What one prompt token's KV takes on the wire (the tiny DeepSeek-V3's MLA latent + rope key, float32)."""
    config = read_json(model / "config.json")
    width = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
    return int(config["num_hidden_layers"]) * width * 4


def _received(decode: str) -> float:
    text = httpx.get(decode + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "tilert:kv_transfers_received"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def test_router_tokens_equal_vllm_alone_with_each_part_on_its_own_host(hosts: Hosts) -> None:
    lan = hosts.lan
    health = lan.call("router", lambda: httpx.get(hosts.decode + "/health", timeout=10).json())
    assert health["transport"] == hosts.transport  # no silent fallback to another transport
    received_before = lan.call("router", lambda: _received(hosts.decode))
    rx_before = lan.rx_bytes("decode")
    prompt_tokens = 0
    t0 = time.monotonic()
    for kind, prompt, stream in _prompts(hosts.model):
        want_ids, want_text, n = lan.call("router", lambda k=kind, q=prompt: vllm_alone(hosts, k, q))
        got_ids, got_text, usage = lan.call(
            "router", lambda k=kind, q=prompt, s=stream: router_call(hosts.router, hosts.model, k, q, s)
        )
        assert (got_ids, got_text) == (want_ids, want_text), f"{hosts.transport}: {kind} prompt of {n} tokens"
        assert usage["prompt_tokens"] == n and usage["completion_tokens"] == MAX_TOKENS
        prompt_tokens += n
    rx = lan.rx_bytes("decode") - rx_before
    assert lan.call("router", lambda: _received(hosts.decode)) == received_before + len(_prompts(hosts.model))
    kv = prompt_tokens * _kv_bytes_per_token(hosts.model)
    assert rx >= kv, f"{hosts.transport}: the decode host received {rx} bytes, the prompts' KV is {kv}"
    print(
        f"\n{hosts.transport}: parts up in {hosts.started_s:.1f}s, prompts in {time.monotonic() - t0:.1f}s, "
        f"{rx} bytes into the decode host for {kv} bytes of KV"
    )
