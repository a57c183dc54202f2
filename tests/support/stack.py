"""A whole stack started through ``tilert up``, exactly as a user starts it, and its shutdown checked: what the
session-wide ``stack`` fixture (``tests/conftest.py``) and the tests that start stacks of their own share."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support.waiting import wait_until

from tilert.netio import free_port

STARTUP_TIMEOUT_S = 600
SHUTDOWN_TIMEOUT_S = 60  # from the SIGINT to ``tilert up``'s exit
LEFTOVER_TIMEOUT_S = 15  # from ``tilert up``'s exit until none of its processes is left


def with_connector_settings(cmd: list[str], **settings: object) -> list[str]:
    """A prefill command (``tilert.stack.prefill_command``) with these ``tilert_*`` keys set in its connector's
    ``kv_connector_extra_config``."""
    i = cmd.index("--kv-transfer-config") + 1
    config = json.loads(cmd[i])
    config["kv_connector_extra_config"].update(settings)
    return [*cmd[:i], json.dumps(config), *cmd[i + 1 :]]


def wait_healthy(url: str, proc: subprocess.Popen[Any], timeout_s: float, log: Path | None = None) -> None:
    """Until ``url``/health answers 200; fails at once if ``proc`` exits, or after ``timeout_s``."""

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:] if log else f"exited with {proc.returncode}"
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, timeout_s, f"{url} healthy", interval_s=0.2)


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
    log_dir: Path | None = None  # each process's own log (``tilert up --log-dir``): prefill.log, router.log ...

    def process_log(self, name: str) -> str:
        """The log of one process of the stack (``prefill``, ``decode``, ``router``, ``native``, ``up``)."""
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""


# vLLM's tool-call flags the tests' stacks run with (tilert up hands them to every vLLM it starts and the router)
TOOL_FLAGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice")


@dataclass
class Launch:
    """A ``tilert up`` started and not yet waited for (:func:`launch_stack`): its ports and secret are known, so
    processes that join the stack can start while it comes up; :meth:`wait` returns the :class:`Stack`."""

    proc: subprocess.Popen[str]
    model: Path
    log: Path
    prefill_port: int
    secret_file: Path
    fault_dir: Path

    def wait(self) -> Stack:
        """Once ``tilert up`` printed its URLs (the router's last); fails the test if it stopped first."""
        urls: dict[str, str] = {}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        assert self.proc.stdout is not None
        while "router" not in urls and time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            name, _, rest = line.strip().partition(": ")
            if name in ("prefill", "native", "decode", "router"):
                urls[name] = rest.split()[0]
        if len(urls) < 3:
            self.proc.kill()
            pytest.fail(f"tilert up did not come up; log tail:\n{_tail(self.log)}")
        return Stack(
            self.proc,
            self.model,
            urls["prefill"],
            urls["decode"],
            urls["router"],
            self.log,
            native=urls.get("native"),
            secret_file=self.secret_file,
            fault_dir=self.fault_dir,
            log_dir=self.log.with_suffix(""),
        )


def launch_stack(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> Launch:
    """``tilert up`` started on free ports, as a user starts it, with a secret file the tests know and the connector's
    test-only fault hook enabled (both next to ``log``); :meth:`Launch.wait` waits for it."""
    from tilert.connector.faults import ENV as FAULTS_ENV
    from tilert.stack import write_secret_file

    ports = [free_port() for _ in range(4)]
    secret_file = write_secret_file()
    fault_dir = log.parent / "faults"
    fault_dir.mkdir(exist_ok=True)
    env = {**(os.environ if env is None else env), FAULTS_ENV: str(fault_dir)}
    cmd = [
        *(sys.executable, "-m", "tilert.cli", "up", "--model", str(model)),
        *("--port", str(ports[0]), "--prefill-port", str(ports[1])),
        *("--ctrl-port", str(ports[2]), "--decode-http-port", str(ports[3])),
        *("--secret-file", str(secret_file), "--log-dir", str(log.with_suffix("")), *extra),
    ]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    return Launch(proc, model, log, ports[1], secret_file, fault_dir)


def stop_launch(launch: Launch) -> None:
    """SIGINT a ``tilert up`` that was never waited for (SIGKILL after ``SHUTDOWN_TIMEOUT_S``), its secret removed."""
    _interrupt(launch.proc)
    shutil.rmtree(launch.secret_file.parent, ignore_errors=True)


def start_stack(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None) -> Stack:
    """:func:`launch_stack`, then :meth:`Launch.wait`: returns once the stack serves."""
    return launch_stack(model, log, *extra, env=env).wait()


def stop_stack(stack: Stack) -> None:
    """SIGINT ``tilert up`` (SIGKILL after ``SHUTDOWN_TIMEOUT_S``) and remove its secret; checks nothing."""
    _interrupt(stack.proc)
    if stack.secret_file is not None:
        shutil.rmtree(stack.secret_file.parent, ignore_errors=True)


def stop_procs(procs: Sequence[subprocess.Popen[Any]], grace_s: float = 30.0) -> None:
    """SIGTERM every process at once, then wait for each (SIGKILL after ``grace_s``)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _interrupt(proc: subprocess.Popen[str]) -> None:
    """SIGINT ``tilert up`` if it still runs; SIGKILL after ``SHUTDOWN_TIMEOUT_S``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a process that exited but was not reaped yet counts as gone)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _tail(log: Path) -> str:
    """The end of ``tilert up``'s own output, then of each of its processes' logs (``--log-dir``)."""
    parts = [log, *sorted(log.with_suffix("").glob("*.log"))]
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in parts if p.exists())


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def stop_stack_checked(stack: Stack) -> None:
    """Ctrl-C as a user stops ``tilert up``: SIGINT must end it with status 0 and end every process it started
    (vLLM's API server and its engine core, the decode node, the router, and whatever they started), within
    ``SHUTDOWN_TIMEOUT_S`` + ``LEFTOVER_TIMEOUT_S``. Anything left is killed, then the check fails."""
    code = stack.proc.poll()
    if code is not None:
        stop_stack(stack)
        pytest.fail(f"tilert up exited with status {code} before its shutdown; log tail:\n{_tail(stack.log)}")
    family = psutil.Process(stack.proc.pid).children(recursive=True)
    cmdlines = [_cmdline(p) for p in family]
    started = {  # each as its command line shows it (vLLM names its engine core's process)
        "vLLM": "vllm.entrypoints.openai.api_server",
        "vLLM's engine core": "EngineCore",
        "decode node": "tilert.cli decode",
        "router": "tilert.cli router",
    }
    try:
        missing = [role for role, mark in started.items() if not any(mark in line for line in cmdlines)]
        assert not missing, f"before the SIGINT, no {', no '.join(missing)} among tilert up's processes: {cmdlines}"
        stack.proc.send_signal(signal.SIGINT)
        try:
            code = stack.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tilert up still running {SHUTDOWN_TIMEOUT_S} s after SIGINT")
        assert code == 0, f"tilert up exited with status {code} on SIGINT; log tail:\n{_tail(stack.log)}"
        assert stack.proc.stdout is not None
        said = stack.proc.stdout.read().splitlines() + stack.log.read_text(errors="replace").splitlines()
        assert [line for line in said if not line.startswith("tilert up: serving at ")] == [], (
            f"tilert up wrote to its terminal while it served: {said}"
        )
        try:
            wait_until(lambda: not any(alive(p) for p in family), LEFTOVER_TIMEOUT_S, "no process of the stack left")
        except AssertionError:
            left = [(p.pid, _cmdline(p)) for p in family if alive(p)]
            pytest.fail(f"tilert up exited, leaving behind: {left}")
    finally:
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
        stop_stack(stack)


def start_logged(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``cmd`` started with its output in ``log`` (appended: a restarted process keeps its earlier lines)."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def without_decode(cmd: list[str]) -> list[str]:
    """A router command without its ``--decode`` flags (a test then lists the nodes it wants)."""
    out: list[str] = []
    skip = False
    for arg in cmd:
        if skip:
            skip = False
        elif arg == "--decode":
            skip = True
        else:
            out.append(arg)
    return out


def decodes_served(node: str) -> int:
    """Decode requests the node has finished (its ``tilert:request_success_total`` over every reason)."""
    text = httpx.get(node + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^tilert:request_success_total\{.*\} (\S+)$", text, re.M)))
