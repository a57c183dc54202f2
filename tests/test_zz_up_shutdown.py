"""Runs last (by name): SIGINT stops the session's ``tilert up`` and every process it started."""

from __future__ import annotations

import signal
import time
from typing import Any

import psutil
import pytest


@pytest.mark.stack
def test_sigint_leaves_no_process_behind(stack: Any) -> None:
    root = psutil.Process(stack.proc.pid)
    family = root.children(recursive=True)
    names = " ".join(" ".join(p.cmdline()) for p in family)
    assert "vllm" in names and "decode" in names and "router" in names, names
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 15
    alive = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
