"""However ``tilert up`` (or ``make demo`` above it) ends, it leaves no process of its stack behind: the terminal
closed (SIGHUP), a supervisor's SIGTERM to the demo alone, ``tilert up`` killed outright (SIGKILL, as the OOM killer
does). Each stack is stopped while its children start (vLLM still importing), which is where a launcher most often
dies, and costs no vLLM start-up here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from support.stack import alive, free_port, launch_stack, stop_launch
from support.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
GONE_S = 30.0  # from the signal until no process of the stack is left


def _children(proc: psutil.Process, count: int) -> list[psutil.Process]:
    """``proc``'s first ``count`` children, once it has started them."""
    return wait_until(lambda: len(kids := proc.children()) >= count and kids, 60.0, f"{count} children started")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["terminal-closed", "killed-outright"])
def test_up_leaves_no_child_however_it_ends(tiny_model: Path, tmp_path: Path, sig: signal.Signals) -> None:
    launch = launch_stack(tiny_model, tmp_path / "up.log")
    try:
        stack = _children(psutil.Process(launch.proc.pid), 3)  # prefill, decode, router
        launch.proc.send_signal(sig)
        launch.proc.wait(timeout=60)
        wait_until(lambda: not any(alive(p) for p in stack), GONE_S, f"every child of tilert up gone after {sig.name}")
        if sig == signal.SIGHUP:  # stopped in order, as on Ctrl-C
            said = launch.log.read_text()
            assert launch.proc.returncode == 1 and "tilert up: interrupted during start-up" in said, said
    finally:
        stop_launch(launch)


def test_demo_stopped_alone_stops_its_stack(tiny_model: Path, tmp_path: Path) -> None:
    """SIGTERM to the demo process only (a supervisor's stop, ``kill PID``): ``tilert up`` and every child go."""
    port, prefill, ctrl, http = (str(free_port()) for _ in range(4))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env.update(TILERT_SECRET="0123456789abcdef0123456789abcdef", TILERT_UP_LOG_DIR=str(tmp_path))
    env.update(TILERT_UP_PREFILL_PORT=prefill, TILERT_UP_CTRL_PORT=ctrl, TILERT_UP_DECODE_HTTP_PORT=http)
    cmd = [sys.executable, "-m", "tilert.demo", "--model", str(tiny_model), "--port", port]
    demo = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        (up,) = _children(psutil.Process(demo.pid), 1)
        family = [up, *_children(up, 3)]
        demo.send_signal(signal.SIGTERM)
        demo.wait(timeout=60)
        wait_until(lambda: not any(alive(p) for p in family), GONE_S, "tilert up and its children gone")
        said = demo.stdout.read() if demo.stdout else ""
        assert "tilert up: interrupted during start-up" in said, said  # stopped by the demo, in order
    finally:
        demo.kill()
        demo.wait()
