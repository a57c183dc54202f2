"""Every input that can be wrong is refused at start-up with a reason, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [
    (["decode", "--model", "/nonexistent", "--slots", "0"], "--slots must be >= 1"),
    (["decode", "--model", "/nonexistent"], "config.json"),
    (["router", "--prefill-url", "http://127.0.0.1:1", "--decode", "127.0.0.1:5556", "--model", "."], "host:ctrl_port:http_port"),
    (["router", "--prefill-url", "ftp://x", "--decode", "127.0.0.1:1:2", "--model", "."], "prefill_url"),
    (["up", "--model", "/nonexistent"], "config.json"),
]


@pytest.mark.parametrize("args,reason", CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_start_up_arguments_are_refused_with_a_reason(args: list[str], reason: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "tilert.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert reason in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
