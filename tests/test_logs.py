"""tilert's logs: the access line of each request as its response ends, and the connector's lines inside vLLM."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from typing import Any

import pytest

from tilert.logs import ACCESS_LOGGER, AccessLog


def _scope(path: str, query: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "query_string": query,
        "http_version": "1.1",
        "client": ("127.0.0.1", 5000),
        "headers": [],
    }


def test_the_access_line_is_written_when_the_response_has_ended(caplog: pytest.LogCaptureFixture) -> None:
    """Not at the response's start (that would delay a stream's first byte): after its last body, with its status;
    none for a path polled all the time; a response that never started is a 500."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    seen_at_first_body: list[int] = []

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen_at_first_body.append(len(caplog.records))
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("app failed")

    async def sink(message: Any) -> None:
        pass

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def run() -> None:
        await AccessLog(stream)(_scope("/v1/completions", b"a=1"), receive, sink)
        await AccessLog(stream)(_scope("/health"), receive, sink)
        with pytest.raises(RuntimeError):
            await AccessLog(broken)(_scope("/v1/chat/completions"), receive, sink)

    asyncio.run(run())
    assert seen_at_first_body == [0, 1]  # no line of its own while each response went on
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert lines == [
        '127.0.0.1:5000 - "POST /v1/completions?a=1 HTTP/1.1" 201',
        '127.0.0.1:5000 - "POST /v1/chat/completions HTTP/1.1" 500',
    ]


EMBEDDED_LOGS = """
import logging
import structlog
from tilert.logs import configure_embedded
root = list(logging.getLogger().handlers)
configure_embedded()
assert logging.getLogger().handlers == root, "the host's logging is its own"
log = structlog.get_logger("tilert.connector")
log.info("below_the_level")
try:
    raise RuntimeError("boom")
except RuntimeError:
    log.exception("staging_failed", transfer_id="t-1")
"""


def test_the_connector_logs_follow_tilerts_settings_inside_its_host() -> None:
    """In vLLM's process the connector's lines take ``TILERT_LOG_LEVEL`` / ``TILERT_LOG_FORMAT`` (the stack sets
    them), leave vLLM's :mod:`logging` alone, and render an exception as plain text (structlog's default rich
    traceback, with every frame's locals, holds the logging thread, vLLM's forward, for a large part of a second).
    A wrong value refuses."""
    env = {"TILERT_LOG_LEVEL": "warning", "TILERT_LOG_FORMAT": "json", "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", EMBEDDED_LOGS], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["staging_failed"]
    assert lines[0]["transfer_id"] == "t-1" and "RuntimeError: boom" in lines[0]["exception"]  # plain text
    env = {"TILERT_LOG_FORMAT": "xml"}
    bad = subprocess.run([sys.executable, "-c", EMBEDDED_LOGS], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "the log format must be one of console, json" in bad.stderr
