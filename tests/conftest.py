"""Session-wide fixtures: one tiny checkpoint, one real stack (stock vLLM + decode node + router).

The stack is started once per session through ``tilert up`` itself, exactly as a user starts it;
``tests/test_zz_up_shutdown.py`` (last by name) stops it with SIGINT and checks nothing is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls: one intra-op thread is several times faster than two on a busy 2-core machine. A module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float, log: Path | None = None) -> None:
    """Until ``url``/health answers 200; fails at once if ``proc`` exits, or after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:] if log else f"exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"{url} not healthy within {timeout_s:g} s")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert.models.tiny import build_tiny_model

    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("models") / "tiny-deepseek-v3", seed=0)


@dataclass
class Stack:
    proc: subprocess.Popen[str]
    model: Path
    prefill: str
    decode: str
    router: str
    log: Path
    transport: str = "tcp"
    native: str | None = None  # the native vLLM decode instance (``tilert up --native``)
    secret_file: Path | None = None  # the stack's secret (more nodes and routers can join it)
    fault_dir: Path | None = None  # the connector's test-only fault hook (tilert.connector.faults), armed here


def start_stack(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> Stack:
    """``tilert up`` on free ports, as a user starts it, with a secret file the tests know and the connector's
    test-only fault hook enabled (both next to ``log``); returns once it printed its URLs (the router's last)."""
    from tilert.connector.faults import ENV as FAULTS_ENV
    from tilert.stack import write_secret_file

    ports = [free_port() for _ in range(4)]
    secret_file = write_secret_file()
    fault_dir = log.parent / "faults"
    fault_dir.mkdir(exist_ok=True)
    env = {**(os.environ if env is None else env), FAULTS_ENV: str(fault_dir)}
    cmd = [
        sys.executable, "-m", "tilert.cli", "up", "--model", str(model),
        "--port", str(ports[0]), "--prefill-port", str(ports[1]),
        "--ctrl-port", str(ports[2]), "--decode-http-port", str(ports[3]),
        "--secret-file", str(secret_file), *extra,
    ]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    urls: dict[str, str] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    assert proc.stdout is not None
    while "router" not in urls and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        name, _, url = line.strip().partition(": ")
        if name in ("prefill", "native", "decode", "router"):
            urls[name] = url
    if len(urls) < 3:
        proc.kill()
        pytest.fail(f"tilert up did not come up; log tail:\n{log.read_text()[-4000:]}")
    return Stack(proc, model, urls["prefill"], urls["decode"], urls["router"], log, native=urls.get("native"),
                 secret_file=secret_file, fault_dir=fault_dir)  # fmt: skip


def stop_stack(stack: Stack) -> None:
    if stack.proc.poll() is None:
        stack.proc.send_signal(signal.SIGINT)
        try:
            stack.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stack.proc.kill()
    if stack.secret_file is not None:
        shutil.rmtree(stack.secret_file.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    handle = start_stack(tiny_model, tmp_path_factory.mktemp("logs") / "stack.log")
    yield handle
    stop_stack(handle)


@pytest.fixture(scope="session", autouse=True)
def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
