"""Logs of every tilert process: one format, one timestamp, on stderr.

Two settings, the same on every command (a flag of each command, and one environment variable for all):

- ``--log-level`` / ``$TILERT_LOG_LEVEL``: ``debug``, ``info`` (default), ``warning``, ``error``;
- ``--log-format`` / ``$TILERT_LOG_FORMAT``: ``console`` (default: ``key=value`` lines for people) or ``json``
  (one JSON object a line, for a log shipper).

tilert's own lines come from structlog with the request or transfer id bound to them; the lines of the libraries
that log through :mod:`logging` (uvicorn's server log) are rendered by the same processors, so a process writes one
format with one timestamp (ISO 8601, UTC). A server's access log is :class:`AccessLog`'s, in uvicorn's format, one
line as each response ends (not as it starts: that would delay every stream's first byte), none for the paths
polled all the time (:data:`QUIET_PATHS`): a health check, a metrics scrape, the router's watch stream of a node.
Inside vLLM, whose :mod:`logging` is its own, the connector's lines follow the same two environment variables
(:func:`configure_embedded`).
"""

from __future__ import annotations

import logging
import sys
from asyncio import CancelledError
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TextIO

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tilert.settings import ConfigError, Setting, build_config, env_values, merge_values

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("console", "json")
LEVEL_ENV = "TILERT_LOG_LEVEL"
FORMAT_ENV = "TILERT_LOG_FORMAT"

CHATTY_LIBRARIES = ("httpx", "httpcore")  # a line per request they make, at info: warnings and up only
QUIET_PATHS = ("/health", "/metrics", "/v1/watch")  # polled all the time: no access-log line
ACCESS_LOGGER = "tilert.access"


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


class AccessLog:
    """ASGI middleware: one access line for each HTTP request, written when its response has ended (uvicorn's own
    comes as the response starts, and rendering it then delays the first byte of every stream: the first token).
    uvicorn's format and arguments (client, method, path with query, HTTP version, status), on the
    :data:`ACCESS_LOGGER` logger; none for :data:`QUIET_PATHS`. A response that never started (the app raised, or
    the client left first) is logged with status 500, or 499 when the request was cancelled."""

    def __init__(self, app: ASGIApp, quiet: Iterable[str] = QUIET_PATHS) -> None:
        self.app = app
        self.quiet = frozenset(quiet)
        self._log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.quiet or not self._log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        status = 0

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        except BaseException as exc:
            status = status or (499 if isinstance(exc, CancelledError) else 500)
            raise
        finally:
            client = scope.get("client")
            path = scope.get("root_path", "") + scope["path"]
            query = scope.get("query_string", b"")
            self._log.info(
                '%s - "%s %s HTTP/%s" %d',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                f"{path}?{query.decode('latin-1')}" if query else path,
                scope.get("http_version", "1.1"),
                status,
            )


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
    for name in ("uvicorn", "uvicorn.error", ACCESS_LOGGER):  # through the root's handler, at its level
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    for name in CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(max(level_no, logging.WARNING))
    logging.getLogger("uvicorn.access").disabled = True  # :class:`AccessLog` writes the access lines


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
    """What a tilert server passes to uvicorn so that :func:`configure`'s set-up stays in place (its app wrapped in
    :class:`AccessLog`, which replaces uvicorn's access log)."""
    return {"log_config": None, "log_level": None, "access_log": False}
