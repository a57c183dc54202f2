"""Logs of every tilert process: one format, one timestamp, on stderr.

Two settings, the same on every command (a flag of each command, and one environment variable for all):

- ``--log-level`` / ``$TILERT_LOG_LEVEL``: ``debug``, ``info`` (default), ``warning``, ``error``;
- ``--log-format`` / ``$TILERT_LOG_FORMAT``: ``console`` (default: ``key=value`` lines for people) or ``json``
  (one JSON object a line, for a log shipper).

tilert's own lines come from structlog with the request or transfer id bound to them; the lines of the libraries
that log through :mod:`logging` (uvicorn's server and access logs) are rendered by the same processors, so a
process writes one format with one timestamp (ISO 8601, UTC). uvicorn's access log leaves out the paths that are
polled all the time (:data:`QUIET_PATHS`): a health check, a metrics scrape, the router's watch stream of a node.
Inside vLLM, whose :mod:`logging` is its own, the connector's lines follow the same two environment variables
(:func:`configure_embedded`).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TextIO

import structlog

from tilert.settings import ConfigError, Setting, build_config, env_values, merge_values

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("console", "json")
LEVEL_ENV = "TILERT_LOG_LEVEL"
FORMAT_ENV = "TILERT_LOG_FORMAT"

CHATTY_LIBRARIES = ("httpx", "httpcore")  # a line per request they make, at info: warnings and up only
QUIET_PATHS = ("/health", "/metrics", "/v1/watch")  # polled all the time: no access-log line


def _choice(name: str, choices: tuple[str, ...]) -> Any:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ConfigError(f"{name} must be one of {', '.join(choices)} ({value!r})")
        return text

    return parse


LOG_LEVEL = Setting(
    default="info",
    env=LEVEL_ENV,
    parse=_choice("the log level", LEVELS),
    metavar="|".join(LEVELS),
    help="the least severe log lines written",
)
LOG_FORMAT = Setting(
    default="console",
    env=FORMAT_ENV,
    parse=_choice("the log format", FORMATS),
    metavar="|".join(FORMATS),
    help="console: key=value lines; json: one JSON object a line",
)


@dataclass
class LogConfig:
    """The log settings alone, for a command that has no config class of its own."""

    ENV_PREFIX: ClassVar[str] = "TILERT_"

    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()


class _CurrentStderr:
    """``sys.stderr`` as it is when a line is written, not when logging was configured (a test harness or
    a daemon may swap it; writing to the stream of the moment never hits a closed file)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class QuietPaths(logging.Filter):
    """Drops uvicorn access-log records of requests to ``paths`` (its record's arguments are client, method,
    path with query, HTTP version, status)."""

    def __init__(self, paths: Iterable[str] = QUIET_PATHS) -> None:
        super().__init__()
        self.paths = tuple(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def configure(level: str = "info", log_format: str = "console", file: TextIO | None = None) -> None:
    """Set up this process's logs (both settings already checked: :data:`LOG_LEVEL`, :data:`LOG_FORMAT`), written
    to ``file`` (unset: stderr)."""
    out: Any = file if file is not None else _CurrentStderr()
    level_no = getattr(logging, level.upper())
    renderer, stamp = _configure_structlog(level_no, log_format, out)
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,  # the request id of an access-log line
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                stamp,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level_no)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root's handler, at its level
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(max(level_no, logging.WARNING))
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, QuietPaths) for f in access.filters):
        access.addFilter(QuietPaths())


def configure_embedded(environ: Mapping[str, str] | None = None) -> None:
    """tilert's own lines inside a process whose :mod:`logging` belongs to its host (the connector in vLLM): the
    settings from the environment, structlog alone configured, and nothing at all if it already is (a tilert
    process, or a host that set structlog up itself). A wrong setting is a :class:`ConfigError`."""
    if structlog.is_configured():
        return
    config = build_config(LogConfig, merge_values(LogConfig, [env_values(LogConfig, environ)]))
    _configure_structlog(getattr(logging, config.log_level.upper()), config.log_format, _CurrentStderr())


def _configure_structlog(level_no: int, log_format: str, out: Any) -> tuple[Any, Any]:
    """structlog's processors (an exception as plain text: the default's rich rendering takes a large part of a
    second on the thread that logs it); the renderer and time stamp, for :mod:`logging`'s lines to share."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if log_format == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    return renderer, stamp


def vllm_access_log_args() -> list[str]:
    """The flags that keep a stock vLLM server's access log as quiet as tilert's own (vLLM's OpenAI server)."""
    return ["--disable-access-log-for-endpoints", ",".join(QUIET_PATHS)]


def uvicorn_options() -> dict[str, Any]:
    """What a tilert server passes to uvicorn so that :func:`configure`'s set-up stays in place."""
    return {"log_config": None, "log_level": None, "access_log": True}
