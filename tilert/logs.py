"""structlog set-up shared by tilert's processes: key=value lines (or JSON) on stderr."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured (a test harness or
    a daemon may swap it; writing to the stream of the moment never hits a closed file)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure(json_logs: bool | None = None, level: str | None = None) -> None:
    json_logs = os.environ.get("TILERT_LOG_JSON", "0") == "1" if json_logs is None else json_logs
    level_no = logging.getLevelName((level or os.environ.get("TILERT_LOG_LEVEL", "INFO")).upper())
    renderer = structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no if isinstance(level_no, int) else logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
