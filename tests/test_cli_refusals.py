"""Every input that can be wrong is refused at start-up with a reason and exit status 2, not a traceback."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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
    (["decode", "--model", ".", "--draft-head", "int4"], "DRAFT_HEAD) must be one of model, fp8 ('int4')", SECRET),
    (["decode", "--model", ".", "--draft-vocab", "/nonexistent.json"], "DRAFT_VOCAB): cannot read a JSON list", SECRET),
    (
        ["decode", "--model", ".", "--draft-vocab", "/nonexistent.json", "--tp", "2"],
        "DRAFT_VOCAB) needs num_speculative_tokens",
        SECRET,
    ),
    (
        ["decode", "--model", ".", "--draft-head", "fp8", "--num-speculative-tokens", "0"],
        "DRAFT_HEAD) fp8 needs num_speculative_tokens",
        SECRET,
    ),
]

COMMANDS = ["tiny-model", "convert", "draft-vocab", "decode", "router", "up"]


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


def _limited_to(gib: int) -> Callable[[], None]:
    """A child's address space capped at ``gib`` GiB: a refusal must come before any large allocation."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib << 30, gib << 30))

    return limit


def _refusal(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**base, **env}, preexec_fn=_limited_to(1)
    )


def test_decode_refuses_what_the_checkpoint_cannot_hold(tiny_model: Path) -> None:
    """More positions than the checkpoint's context, or MTP drafts (or their FP8 head) without an MTP layer (the
    published ``--with-mtp`` included): exit 2 with one line naming the flag and the checkpoint's value, in a process
    that may not allocate 1 GiB (so before the engine sizes anything)."""
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and cfg["num_nextn_predict_layers"] == 0
    decode = [sys.executable, "-m", "tilert.cli", "decode", "--model", str(tiny_model)]
    published = [sys.executable, "-m", "tilert.pd_vllm.decode_server", "--model", "deepseek-v3"]
    published += ["--model-weights-dir", str(tiny_model), "--with-mtp"]
    for cmd, reasons in [
        (
            [*decode, "--max-seq-len", "202752"],
            ["max_seq_len (--max-seq-len, $TILERT_DECODE_MAX_SEQ_LEN) 202752", "max_position_embeddings is 4096"],
        ),
        (
            [*decode, "--num-speculative-tokens", "2"],
            ["(--num-speculative-tokens, $TILERT_DECODE_NUM_SPECULATIVE_TOKENS) 2", "num_nextn_predict_layers 0"],
        ),
        (published, ["--num-speculative-tokens", "num_nextn_predict_layers 0"]),
        (
            [*decode, "--draft-head", "fp8"],  # drafts default to one: nothing to draft with on this checkpoint
            ["(--draft-head, $TILERT_DECODE_DRAFT_HEAD) fp8 needs an MTP layer", "num_nextn_predict_layers 0"],
        ),
    ]:
        proc = _refusal(cmd, SECRET)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.startswith("tilert decode: ")]
        assert len(lines) == 1 and all(r in lines[0] for r in reasons), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    within = _refusal([*decode, "--max-seq-len", "4096", "--num-speculative-tokens", "0", "--slots", "0"], SECRET)
    assert within.returncode == 2 and "--slots" in within.stderr, within.stderr[-2000:]
    assert "max_position_embeddings" not in within.stderr and "MTP" not in within.stderr


def test_up_refuses_a_context_longer_than_the_checkpoints(tiny_model: Path) -> None:
    """``tilert up --max-model-len`` goes to vLLM and the node alike: beyond the checkpoint's context ``tilert up``
    refuses before it starts anything, with the reason."""
    cmd = [sys.executable, "-m", "tilert.cli", "up", "--model", str(tiny_model), "--max-model-len", "8192"]
    base = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**base, **SECRET})
    assert proc.returncode == 2 and not proc.stdout, proc.stderr[-3000:]
    assert "max_model_len (--max-model-len, $TILERT_UP_MAX_MODEL_LEN) 8192 exceeds" in proc.stderr, proc.stderr
    assert "max_position_embeddings is 4096" in proc.stderr


def test_up_says_which_process_failed_with_its_last_log_lines(tiny_model: Path, tmp_path: Path) -> None:
    """A process of the stack that stops at start-up (here the decode node, refusing the setting it inherited from the
    environment): ``tilert up`` stops the others and puts that process's last log lines on its terminal, and
    nothing of the processes that did not fail."""
    from support.stack import free_port

    ports = [str(free_port()) for _ in range(4)]
    cmd = [sys.executable, "-m", "tilert.cli", "up", "--model", str(tiny_model), "--log-dir", str(tmp_path)]
    cmd += ["--port", ports[0], "--prefill-port", ports[1], "--ctrl-port", ports[2], "--decode-http-port", ports[3]]
    base = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env = {**base, **SECRET, "TILERT_DECODE_MAX_SEQUENCES": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [f"tilert up: starting prefill, decode, router; logs in {tmp_path}/"]
    head, *tail = proc.stderr.splitlines()
    assert head == f"tilert up: decode exited with status 2 during start-up; the last lines of {tmp_path}/decode.log:"
    assert any("max_sequences (--max-sequences, $TILERT_DECODE_MAX_SEQUENCES) must be in 1..64" in t for t in tail)
    assert not [line for line in tail if "vllm" in line.lower()], tail  # the prefill's log stays in its file
    assert (tmp_path / "prefill.log").exists() and (tmp_path / "up.log").exists()


def test_decode_refuses_a_port_another_process_holds(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node binds its two ports when it starts, before its engine loads: a port another process listens on is
    refused then, with the setting's name, exit 2 and no traceback."""
    from support.stack import free_port

    from tilert.decode import server
    from tilert.decode.config import DecodeConfig
    from tilert.netio import listening_socket
    from tilert.settings import ConfigError

    held = listening_socket("127.0.0.1", 0)
    port = held.getsockname()[1]
    try:
        cmd = [sys.executable, "-m", "tilert.cli", "decode", "--model", str(tiny_model)]
        cmd += ["--ctrl-port", str(port), "--http-port", str(free_port())]
        base = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**base, **SECRET})
        assert proc.returncode == 2, proc.stderr[-2000:]
        reason = f"ctrl_port (--ctrl-port, $TILERT_DECODE_CTRL_PORT): cannot listen on 127.0.0.1:{port}"
        assert reason in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        # in process: the engine is never built (build_node stands in for it here, to show the order)
        built: list[object] = []
        monkeypatch.setattr(server, "build_node", built.append)
        cfg = DecodeConfig(model=tiny_model, ctrl_port=free_port(), http_port=port)
        with pytest.raises(ConfigError, match=f"http_port .*127.0.0.1:{port}"):
            server.serve(cfg)
        assert built == []
        with listening_socket("127.0.0.1", cfg.ctrl_port):  # the free one bound first is closed again
            pass
    finally:
        held.close()


def test_draft_vocab_file_is_read_strictly(tmp_path: Path) -> None:
    """``--draft-vocab``: a non-empty JSON list of distinct token ids inside the checkpoint's vocabulary, else a
    reason."""
    from tilert.decode.config import read_draft_vocab

    f = tmp_path / "vocab.json"
    f.write_text("[3, 1, 2]")
    assert read_draft_vocab(str(f), 4) == (3, 1, 2)
    for text, reason in [
        ("{}", "non-empty JSON list"),
        ("[]", "non-empty JSON list"),
        ("[1, 2.0]", "non-empty JSON list"),
        ("[1, true]", "non-empty JSON list"),
        ("[1, 1]", "distinct"),
        ("[0, 4]", "token id 4 is outside the checkpoint's vocabulary (0..3)"),
        ("[-1]", "token id -1 is outside"),
        ("[1,", "cannot read a JSON list"),
    ]:
        f.write_text(text)
        with pytest.raises(ValueError, match=re.escape(reason)):
            read_draft_vocab(str(f), 4)
