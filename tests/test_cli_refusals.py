"""Every input that can be wrong is refused at start-up with a reason and exit status 2, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SECRET = {"TILERT_SECRET": "0123456789abcdef0123456789abcdef"}
ROUTER = ["router", "--prefill-url", "http://127.0.0.1:1", "--decode", "127.0.0.1:1:2", "--model", "."]

CASES: list[tuple[list[str], str, dict[str, str]]] = [
    (["decode", "--model", "/nonexistent", "--slots", "0"], "--slots, $TILERT_DECODE_NUM_SLOTS) must be >= 1", SECRET),
    (["decode", "--model", "/nonexistent"], "config.json", SECRET),
    (["decode", "--model", ".", "--slots", "two"], "--slots: expected an integer", SECRET),
    (
        ["decode", "--model", "."],
        "$TILERT_DECODE_MAX_SEQ_LEN: expected an integer",
        {**SECRET, "TILERT_DECODE_MAX_SEQ_LEN": "x"},
    ),
    (
        ["router", "--prefill-url", "http://127.0.0.1:1", "--decode", "127.0.0.1:5556", "--model", "."],
        "host:ctrl_port:http_port",
        SECRET,
    ),
    (["router", "--prefill-url", "ftp://x", "--decode", "127.0.0.1:1:2", "--model", "."], "prefill_url", SECRET),
    (ROUTER, "no shared secret", {}),
    (ROUTER, "$TILERT_ROUTER_MAX_QUEUE: expected an integer", {**SECRET, "TILERT_ROUTER_MAX_QUEUE": "many"}),
    (ROUTER + ["--api-key", "k"], "secrets never go on a command line", SECRET),
    (ROUTER + ["--reserve-lease-s", "5"], "shorter than prefill_timeout_s + transfer_timeout_s", SECRET),
    (["up", "--model", "/nonexistent"], "config.json", SECRET),
    (ROUTER + ["--log-level", "loud"], "the log level must be one of debug, info, warning, error", SECRET),
    (["decode", "--model", "."], "the log format must be one of console, json", {**SECRET, "TILERT_LOG_FORMAT": "xml"}),
    (["up", "--model", ".", "--log-format", "yaml"], "the log format must be one of console, json", SECRET),
    (["tiny-model", "--arch", "deepseek_v3", "--out", "unused", "--log-level", "x"], "the log level", {}),
]

COMMANDS = ["tiny-model", "convert", "decode", "router", "up"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_log_settings(command: str) -> None:
    """The same two log settings on every command, with the same environment variables."""
    proc = subprocess.run(
        [sys.executable, "-m", "tilert.cli", command, "--help"], capture_output=True, text=True, timeout=120
    )
    text = " ".join(proc.stdout.split())
    assert proc.returncode == 0, proc.stderr
    assert "--log-level debug|info|warning|error" in text and "TILERT_LOG_LEVEL" in text, text
    assert "--log-format console|json" in text and "TILERT_LOG_FORMAT" in text, text


@pytest.mark.parametrize("args,reason,env", CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_start_up_arguments_are_refused_with_a_reason(args: list[str], reason: str, env: dict[str, str]) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "tilert.cli", *args], capture_output=True, text=True, timeout=120, env={**base, **env}
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert reason in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "0123456789abcdef" not in proc.stderr
