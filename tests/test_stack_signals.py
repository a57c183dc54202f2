"""However ``tilert up`` (or ``make demo`` above it) ends, it leaves no process of its stack behind: the terminal
closed (SIGHUP), a supervisor's SIGTERM to the demo alone, ``tilert up`` killed outright (SIGKILL, as the OOM killer
does). Each stack is stopped while its children start (vLLM still importing), which is where a launcher most often
dies, and costs no vLLM start-up here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support.stack import free_port

SECRET = {"TILERT_SECRET": "0123456789abcdef0123456789abcdef"}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the process tree from /proc")


def _parent(pid: int) -> int | None:
    """A live process's parent; ``None`` once it has exited (a zombie counts as exited)."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except OSError:
        return None
    return None if state in ("Z", "X") else int(ppid)


def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    return {int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and _parent(int(e.name)) == pid}


def _all_gone(pids: set[int]) -> bool:
    return all(_parent(p) is None for p in pids)


def _wait_for(what: str, cond: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


def _start(module_argv: list[str], tiny_model: Path, tmp_path: Path) -> subprocess.Popen[str]:
    ports = [str(free_port()) for _ in range(4)]
    cmd = [sys.executable, "-m", *module_argv, "--model", str(tiny_model), "--port", ports[0]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(SECRET)
    # the stack's other ports and its log directory, through the variables ``tilert up`` reads
    env.update(TILERT_UP_PREFILL_PORT=ports[1], TILERT_UP_CTRL_PORT=ports[2], TILERT_UP_DECODE_HTTP_PORT=ports[3])
    env["TILERT_UP_LOG_DIR"] = str(tmp_path)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _stack_of(up_pid: int) -> set[int]:
    """The stack's three children, once ``tilert up`` has started them."""
    found: set[int] = set()

    def started() -> bool:
        found.update(_children(up_pid))
        return len(found) >= 3

    _wait_for("tilert up starts prefill, decode and router", started, 60.0)
    return found


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["terminal-closed", "killed-outright"])
def test_up_leaves_no_child_however_it_ends(tiny_model: Path, tmp_path: Path, sig: signal.Signals) -> None:
    up = _start(["tilert.cli", "up"], tiny_model, tmp_path)
    try:
        stack = _stack_of(up.pid)
        up.send_signal(sig)
        up.wait(timeout=60)
        _wait_for(f"every child of tilert up gone after {sig.name}: {sorted(stack)}", lambda: _all_gone(stack), 30.0)
        if sig == signal.SIGHUP:  # stopped in order, as on Ctrl-C
            said = up.stdout.read() if up.stdout else ""
            assert up.returncode == 1 and "tilert up: interrupted during start-up" in said, said
    finally:
        up.kill()
        up.wait()


def test_demo_stopped_alone_stops_its_stack(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM to the demo process only (a supervisor's stop, ``kill PID``): ``tilert up`` and every child go."""
    demo = _start(["tilert.demo"], tiny_model, tmp_path)
    try:
        ups: set[int] = set()

        def started() -> bool:
            ups.update(_children(demo.pid))
            return bool(ups)

        _wait_for("the demo starts tilert up", started, 30.0)
        (up,) = ups
        stack = _stack_of(up)
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=60)
        _wait_for(f"tilert up and its children gone: {up}, {sorted(stack)}", lambda: _all_gone({up, *stack}), 30.0)
        said = demo.stdout.read() if demo.stdout else ""
        assert "tilert up: interrupted during start-up" in said, said  # stopped by the demo, in order
    finally:
        demo.kill()
        demo.wait()
