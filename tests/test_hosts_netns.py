"""The three parts on three hosts: the vLLM prefill, the decode node and the router each in a Linux network namespace
of its own, joined by veth pairs to a bridge in a fourth, with addresses only inside these namespaces (no route out).
For each transport the KV crosses from the prefill's host to the decode node's over that network, and greedy answers
through the router (asked from the router's host) are vLLM alone's, token for token.

NIXL's UCX is held to its TCP transport and to each host's own veth here: between two processes of one machine it
would otherwise copy with the kernel's cross-process copy, which network namespaces do not separate, and the bytes
would not cross the network.

The namespaces are made by the test and removed after it, also when it fails; their names carry the test's pid.
Skipped, with the reason, where the machine does not let this process make network namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from support.oracle import vllm_alone
from support.stack import Stack
from support.waiting import wait_until

from tilert.stack import StackConfig, child_env, decode_command, prefill_command, prefill_env, router_command

pytestmark = [pytest.mark.stack, pytest.mark.timeout(900)]

PROMPTS = ["def add(a, b):", "Hello", "import os"]
MAX_TOKENS = 24
PARTS = ("prefill", "decode", "router")
ROUTER_PORT = 8000


@dataclass(frozen=True)
class Hosts:
    names: dict[str, str]  # part -> namespace
    addrs: dict[str, str]  # part -> its address on the bridge


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _can_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"tlt{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, PermissionError) as exc:
        return f"this machine does not let the test make network namespaces: {exc}"
    _ip("netns", "delete", probe)
    return None


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    tag, net = f"tlt{os.getpid() % 100000}", f"10.213.{os.getpid() % 250}"
    switch = f"{tag}sw"
    names = {part: f"{tag}{part[:3]}" for part in PARTS}
    addrs = {part: f"{net}.{i + 2}" for i, part in enumerate(PARTS)}
    made: list[str] = []
    try:
        for ns in (switch, *names.values()):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for part, ns in names.items():
            here, there = f"v{part[:3]}", f"b{part[:3]}"
            _ip("-n", ns, "link", "add", here, "type", "veth", "peer", "name", there, "netns", switch)
            _ip("-n", switch, "link", "set", there, "master", "br0")
            _ip("-n", switch, "link", "set", there, "up")
            _ip("-n", ns, "addr", "add", f"{addrs[part]}/24", "dev", here)
            _ip("-n", ns, "link", "set", here, "up")
        yield Hosts(names, addrs)
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)


def _in(ns: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=out, stderr=subprocess.STDOUT)


def _ask(ns: str, url: str, timeout_s: float = 30) -> bytes | None:
    """``GET url`` from inside ``ns`` (None when it does not answer 200)."""
    code = (
        "import sys, urllib.request\n"
        f"try: sys.stdout.buffer.write(urllib.request.urlopen({url!r}, timeout={timeout_s}).read())\n"
        "except Exception: sys.exit(1)\n"
    )
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def _completions(ns: str, router: str, model: Path) -> list[list[int]]:
    """The router's greedy answers to ``PROMPTS``, asked from inside ``ns`` with the OpenAI client."""
    code = (
        "import json, sys\n"
        "from openai import OpenAI\n"
        f"client = OpenAI(base_url={router + '/v1'!r}, api_key='unused', timeout=120, max_retries=0)\n"
        "out = []\n"
        f"for prompt in {PROMPTS!r}:\n"
        f"    r = client.completions.create(model={str(model)!r}, prompt=prompt, max_tokens={MAX_TOKENS}, "
        "temperature=0, extra_body={'return_token_ids': True})\n"
        "    out.append(r.choices[0].model_extra['token_ids'])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return list(json.loads(done.stdout))


@pytest.mark.parametrize("transport", ["tcp", "mooncake", "nixl"])
def test_parts_on_three_hosts(stack: Stack, hosts: Hosts, transport: str, tmp_path: Path) -> None:
    assert stack.secret_file is not None
    want = [vllm_alone(stack, "completion", p, {"max_tokens": MAX_TOKENS})[0] for p in PROMPTS]
    base = replace(StackConfig(model=stack.model), transport=transport, port=ROUTER_PORT)
    pre, dec = replace(base, host=hosts.addrs["prefill"]), replace(base, host=hosts.addrs["decode"])
    env = child_env(stack.secret_file)
    ucx = {part: {"UCX_TLS": "tcp", "UCX_NET_DEVICES": f"v{part[:3]}"} if transport == "nixl" else {} for part in PARTS}
    router = router_command(replace(base, host="127.0.0.1"))
    router[router.index("--prefill-url") + 1] = f"http://{pre.host}:{pre.prefill_port}"
    router[router.index("--decode") + 1] = f"{dec.host}:{dec.ctrl_port}:{dec.decode_http_port}"
    procs = [
        _in(
            hosts.names["prefill"],
            prefill_command(pre),
            {**env, **prefill_env(pre), **ucx["prefill"]},
            tmp_path / "prefill.log",
        ),
        _in(hosts.names["decode"], decode_command(dec), {**env, **ucx["decode"]}, tmp_path / "decode.log"),
        _in(hosts.names["router"], router, env, tmp_path / "router.log"),
    ]
    url = f"http://127.0.0.1:{ROUTER_PORT}"
    try:

        def ready() -> bool:
            for proc, name in zip(procs, PARTS, strict=True):
                assert proc.poll() is None, f"{name} exited: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
            health = _ask(hosts.names["router"], url + "/health", 5)
            return health is not None and json.loads(health)["status"] == "ok"

        wait_until(ready, 300, "the three parts healthy on their hosts", interval_s=1.0)
        # The router's host reaches the others only over the bridge: nothing listens on its own loopback but it.
        assert _ask(hosts.names["router"], f"http://127.0.0.1:{pre.prefill_port}/health", 2) is None
        assert _ask(hosts.names["router"], f"http://{pre.host}:{pre.prefill_port}/health", 10) is not None
        assert _completions(hosts.names["router"], url, stack.model) == want
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
