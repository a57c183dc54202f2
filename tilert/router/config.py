"""Router configuration: :class:`RouterConfig`, one dataclass field per setting (:mod:`tilert.settings`).

Each setting has a flag ``--field-name`` on ``tilert router`` (a few keep their historical names: ``--decode``,
``--model``), an environment variable ``TILERT_ROUTER_FIELD_NAME`` and a key ``field_name`` in the TOML file
(``--config PATH`` or ``$TILERT_ROUTER_CONFIG``); the precedence is flag > environment variable > TOML > default.
``tilert router`` and ``uvicorn tilert.router:app`` (``$TILERT_ROUTER_CONFIG`` optional; the environment alone
may do) read them the same way, through :func:`load_router_config`.

Secrets never travel on a command line:

- the clients' API key: ``--api-key-file PATH`` / ``$TILERT_ROUTER_API_KEY_FILE`` / ``$TILERT_ROUTER_API_KEY``;
- the key the router sends to vLLM: ``--prefill-api-key-file`` / ``$TILERT_ROUTER_PREFILL_API_KEY_FILE`` /
  ``$TILERT_ROUTER_PREFILL_API_KEY``;
- the deployment's shared secret (:mod:`tilert.auth`): ``--secret-file`` / ``$TILERT_SECRET_FILE`` /
  ``$TILERT_SECRET``, loaded into ``RouterConfig.secret``; the router refuses to start without one.
"""

from __future__ import annotations

import functools
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from tilert.contracts import NODE_BEAT_S
from tilert.logs import LOG_FORMAT, LOG_LEVEL
from tilert.settings import (
    LOOPBACK,
    ROUTER_PORT,
    SECRET_FILE,
    ConfigError,
    Setting,
    build_config,
    check_port,
    describe,
    env_values,
    host_problem,
    is_int,
    is_number,
    merge_values,
    read_key_file,
    secret_problem,
    setting,
    toml_values,
    try_load_secret,
)

CONFIG_ENV = "TILERT_ROUTER_CONFIG"
ENV_PREFIX = "TILERT_ROUTER_"
API_KEY_ENV = "TILERT_ROUTER_API_KEY"
PREFILL_URL_ENV = "TILERT_ROUTER_PREFILL_URL"  # as the flag: one URL, or several comma-separated
PREFILL_POLICIES = ("least_loaded", "prefix_hash")
PREFILL_API_KEY_ENV = "TILERT_ROUTER_PREFILL_API_KEY"
LEASE_MARGIN_S = 30.0
DEFAULT_PREFILL_TIMEOUT_S = 600.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
TILERT_POOL = "tilert"  # decode by our decode nodes
NATIVE_POOL = "vllm"  # decode by a stock vLLM decode instance (engine plugin "vllm"), vLLM's own P/D
POOLS = (TILERT_POOL, NATIVE_POOL)


# ---------------------------------------------------------------------------------------------------
# Decode node specs
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeNodeSpec:
    """One decode node: its host, control port (transfer handshake) and HTTP port (reserve/decode API)."""

    host: str
    ctrl_port: int
    http_port: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.ctrl_port}:{self.http_port}"

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.http_port}"


def parse_decode_spec(spec: str) -> DecodeNodeSpec:
    """Parse ``host:ctrl_port:http_port`` (IPv6 hosts in brackets: ``[::1]:5556:5557``)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"decode node spec must be 'host:ctrl_port:http_port', got {spec!r}")
    text = spec.strip()
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[0]:
        raise ConfigError(f"decode node spec must be 'host:ctrl_port:http_port', got {spec!r}")
    host = parts[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"IPv6 decode host must be in brackets ('[::1]:5556:5557'), got {spec!r}")
    if not host:
        raise ConfigError(f"decode node spec has an empty host: {spec!r}")
    problem = host_problem(
        host, f"the host of decode spec {spec!r} (written into each claim: the prefill dials it)", wildcard=False
    )
    if problem:
        raise ConfigError(problem)
    ctrl = check_port(parts[1], f"ctrl port in decode spec {spec!r}")
    http = check_port(parts[2], f"http port in decode spec {spec!r}")
    if ctrl == http:
        raise ConfigError(f"ctrl port and http port must differ in decode spec {spec!r}")
    return DecodeNodeSpec(host=host, ctrl_port=ctrl, http_port=http)


def parse_decode_nodes(raw: Any) -> list[DecodeNodeSpec]:
    """Decode nodes from a flag list, a comma-separated string (env) or TOML (strings or tables)."""
    if raw is None:
        return []
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        raise ConfigError("decode must be a list of 'host:ctrl:http' strings or [[decode]] tables")
    nodes: list[DecodeNodeSpec] = []
    for item in raw:
        if isinstance(item, str):
            nodes.extend(parse_decode_spec(part) for part in item.split(",") if part.strip())
        elif isinstance(item, dict):
            unknown = set(item) - {"host", "ctrl_port", "http_port"}
            if unknown or "host" not in item:
                raise ConfigError(f"[[decode]] entries take host, ctrl_port, http_port; got {sorted(item)}")
            ctrl = check_port(item.get("ctrl_port"), "decode ctrl_port")
            http = check_port(item.get("http_port"), "decode http_port")
            nodes.append(DecodeNodeSpec(host=str(item["host"]), ctrl_port=ctrl, http_port=http))
        else:
            raise ConfigError(f"bad decode entry {item!r}")
    return nodes


def parse_prefill_urls(raw: Any) -> list[str]:
    """Prefill instances from a flag list, a comma-separated string (env) or TOML (a string or a list of them)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(item, str) for item in raw):
        raise ConfigError(f"prefill URLs must be a URL or a list of URLs, got {raw!r}")
    return [part.strip() for item in raw for part in item.split(",") if part.strip()]


def prefill_url_problem(url: Any) -> str | None:
    """Why ``url`` is no prefill server root (None: it is one)."""
    parsed = urlparse(url) if isinstance(url, str) else urlparse("")
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        return f"must be an http(s) URL such as http://127.0.0.1:8000, got {url!r}"
    if parsed.username is not None or parsed.password is not None:
        return "must carry no credentials (the router sends prefill_api_key as a bearer token)"
    if parsed.query or parsed.fragment or parsed.params:
        return f"is the server root, without a query or fragment: {url!r}"
    try:
        parsed.port  # noqa: B018 - raises on a port that is no number in range
    except ValueError:
        return f"has no valid port: {url!r}"
    if url.rstrip("/").endswith("/v1"):
        return f"is the server root, without /v1: {url!r}"
    return None


# ---------------------------------------------------------------------------------------------------
# RouterConfig
# ---------------------------------------------------------------------------------------------------

_NO_KEY_IN_FILE = "put the key in a file of its own and name it with {key}_file (or set ${env})"

# Settings `tilert up` (tilert.stack.StackConfig) passes on to its router: declared once, here.
RESERVE_LEASE_S = Setting(
    default=None,
    help="the decode slot lease the router asks of a node; it must outlive prefill + transfer "
    f"(default prefill_timeout_s + transfer_timeout_s + {LEASE_MARGIN_S:.0f})",
)
NATIVE_ENGINE = Setting(default=NATIVE_POOL, help="the native pool's engine plugin (tilert.engines group)")
OVERFLOW_WAIT_S = Setting(
    default=None,
    help="a TileRT-pool request with no decode slot after this wait goes to the native pool (when it is healthy "
    "then, or as soon as it is again) instead of waiting on to queue_timeout_s and a 429 (needs the native pool; "
    "unset: no overflow)",
)
# vLLM's own flags, with vLLM's names and meanings: the router parses answers with vLLM's parsers
# (tilert.router.tools), and `tilert up` hands the same flags to every vLLM instance it starts.
TOOL_CALL_PARSER = Setting(
    default=None,
    metavar="NAME",
    help="vLLM's --tool-call-parser: the vLLM tool parser that reads the model's tool calls back (hermes, ...); "
    "tool_choice required or a named function needs it, auto also enable_auto_tool_choice",
)
ENABLE_AUTO_TOOL_CHOICE = Setting(
    default=False,
    help="vLLM's --enable-auto-tool-choice: serve tool_choice auto (the model decides whether it calls a tool; "
    "needs tool_call_parser)",
)
REASONING_PARSER = Setting(
    default=None,
    metavar="NAME",
    help="vLLM's --reasoning-parser: the vLLM reasoning parser that splits a chat answer into reasoning and "
    "content (qwen3, deepseek_r1, ...)",
)
TOOL_PARSER_PLUGIN = Setting(
    default=None,
    metavar="PATH",
    help="vLLM's --tool-parser-plugin: a Python file registering more tool parsers (names for tool_call_parser)",
)
PARSER_SETTINGS = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser", "tool_parser_plugin")


def vllm_parser_args(cfg: Any) -> list[str]:
    """The parser settings of ``cfg`` (a config with the fields of :data:`PARSER_SETTINGS`) as vLLM's flags."""
    args = ["--tool-call-parser", cfg.tool_call_parser] if cfg.tool_call_parser else []
    args += ["--enable-auto-tool-choice"] if cfg.enable_auto_tool_choice else []
    args += ["--reasoning-parser", cfg.reasoning_parser] if cfg.reasoning_parser else []
    return args + (["--tool-parser-plugin", cfg.tool_parser_plugin] if cfg.tool_parser_plugin else [])


def parser_problems(cfg: Any, cls: type) -> list[str]:
    """Why vLLM would not start with ``cfg``'s parser settings (:data:`PARSER_SETTINGS` of config class ``cls``):
    each name checked against vLLM's registries once the plugin is imported, as vLLM does. vLLM is imported only
    when a parser or a plugin is named."""
    d = lambda name: describe(cls, name)  # noqa: E731
    problems: list[str] = []
    if cfg.enable_auto_tool_choice and not cfg.tool_call_parser:
        problems.append(f"{d('enable_auto_tool_choice')} needs {d('tool_call_parser')} (as vLLM's does)")
    if not (cfg.tool_call_parser or cfg.reasoning_parser or cfg.tool_parser_plugin):
        return problems
    logging.getLogger("vllm").setLevel(logging.WARNING)  # its import-time notes are not the router's to log
    from vllm.reasoning import ReasoningParserManager  # lazy: vLLM, only when a parser is named
    from vllm.tool_parsers import ToolParserManager  # lazy: vLLM, only when a parser is named

    if cfg.tool_parser_plugin and not _plugin_loaded(cfg.tool_parser_plugin):
        problems.append(f"{d('tool_parser_plugin')}: vLLM cannot import {cfg.tool_parser_plugin!r}")
    registries = (
        ("tool_call_parser", "tool call", ToolParserManager.list_registered()),
        ("reasoning_parser", "reasoning", ReasoningParserManager.list_registered()),
    )
    for name, kind, names in registries:
        value = getattr(cfg, name)
        if value and value not in names:
            problems.append(f"{d(name)}: vLLM has no {kind} parser {value!r}; valid names: {', '.join(sorted(names))}")
    return problems


@functools.cache
def _plugin_loaded(path: str) -> bool:
    """Import a tool parser plugin as vLLM does (a module name or a file), once per process."""
    from vllm.utils.import_utils import import_plugin  # lazy: vLLM, only with a plugin

    return import_plugin(path) is not None


@dataclass
class RouterConfig:
    """Everything the router needs. ``served_model_name`` defaults to ``model_dir`` as given (vLLM's default)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    prefill_urls: list[str] = setting(
        help="a stock vLLM prefill instance's server root, without /v1 (http://127.0.0.1:8000); repeat the flag, or "
        'comma-separate, for several (TOML: prefill_urls = [...] or prefill_url = "...")',
        flag="--prefill-url",
        aliases=("--prefill-urls",),
        env=PREFILL_URL_ENV,
        repeat=True,
        parse=parse_prefill_urls,
        toml_aliases=("prefill_url",),
        metavar="URL",
    )
    decode_nodes: list[DecodeNodeSpec] = setting(
        help="a decode node as host:ctrl_port:http_port (repeat the flag, or comma-separate, for several)",
        flag="--decode",
        aliases=("--decode-nodes",),
        repeat=True,
        parse=parse_decode_nodes,
        toml_aliases=("decode",),
        metavar="HOST:CTRL:HTTP",
    )
    model_dir: str = setting(
        help="directory with the tokenizer and config.json (the one vLLM serves)",
        flag="--model",
        aliases=("--model-dir",),
        metavar="DIR",
    )
    served_model_name: str | None = setting(None, help="model name clients use (default: model_dir as given)")
    host: str = setting(LOOPBACK, help="bind address of `tilert router` (uvicorn's own --host rules under uvicorn)")
    port: int = setting(ROUTER_PORT, help="port of `tilert router` (uvicorn's own --port rules under uvicorn)")
    api_key: str | None = setting(
        None,
        help="the API key clients must send as 'Authorization: Bearer KEY' on /v1/*",
        cli=False,
        env=API_KEY_ENV,
        group="api_key",
        repr=False,
        toml=_NO_KEY_IN_FILE.format(key="api_key", env=API_KEY_ENV),
    )
    api_key_file: str | None = setting(
        None,
        help="file holding the API key clients must send (first line); unset: /v1/* is open",
        group="api_key",
        metavar="PATH",
        secret_flag="--api-key",
        secret_env=API_KEY_ENV,
    )
    prefill_api_key: str | None = setting(
        None,
        help="bearer token sent to vLLM (when vLLM runs with --api-key)",
        cli=False,
        env=PREFILL_API_KEY_ENV,
        repr=False,
        group="prefill_api_key",
        toml=_NO_KEY_IN_FILE.format(key="prefill_api_key", env=PREFILL_API_KEY_ENV),
    )
    prefill_api_key_file: str | None = setting(
        None,
        help="file holding the bearer token sent to vLLM (first line)",
        group="prefill_api_key",
        metavar="PATH",
        secret_flag="--prefill-api-key",
        secret_env=PREFILL_API_KEY_ENV,
    )
    secret_file: str | None = SECRET_FILE.field()
    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()
    queue_timeout_s: float = setting(30.0, help="FIFO wait for a decode slot before 429")
    max_queue: int = setting(256, help="requests waiting beyond this get 429 at once")
    retry_after_s: int = setting(1, help="Retry-After of a 429/503")
    default_max_tokens: int | None = setting(
        None, help="max_tokens of a request that sends none (unset: up to the end of the context, as vLLM)"
    )
    max_body_bytes: int = setting(16 << 20, help="largest request body accepted (413 beyond)")
    reserve_lease_s: float | None = RESERVE_LEASE_S.field()
    connect_timeout_s: float = setting(5.0, help="TCP connect timeout to vLLM and the decode nodes")
    prefill_timeout_s: float = setting(DEFAULT_PREFILL_TIMEOUT_S, help="the whole max_tokens=1 prefill call")
    transfer_timeout_s: float = setting(
        DEFAULT_TRANSFER_TIMEOUT_S, help="decode request sent -> first decode token (KV transfer wait)"
    )
    decode_idle_timeout_s: float = setting(30.0, help="longest silence between decode tokens")
    decode_resumes: int = setting(
        2,
        help="times one stream is continued on another decode node when its node dies or stalls (the prompt and "
        "the tokens already sent prefilled again; the client sees a pause); 0: the client gets the error",
    )
    control_timeout_s: float = setting(5.0, help="reserve / release / cancel calls to a decode node")
    health_interval_s: float = setting(2.0, help="decode node health probe period")
    health_timeout_s: float = setting(2.0, help="decode node / prefill health probe timeout")
    node_silence_s: float = setting(
        5.0,
        help=f"a decode node whose watch stream (a beat every {NODE_BEAT_S:g} s) is silent this long is lost: "
        "no new requests go there and those whose prefill is running move to another node (a node that dies "
        "closes the stream, which counts at once)",
    )
    prefill_policy: str = setting(
        PREFILL_POLICIES[0],
        help=f"how a request picks its prefill instance: {' or '.join(PREFILL_POLICIES)} (least_loaded: fewest "
        "requests in flight; prefix_hash: prompts sharing their first prefill_prefix_chars characters go to one "
        "instance, for vLLM's prefix cache, unless it is out or prefill_prefix_slack requests busier than the least "
        "loaded)",
    )
    prefill_prefix_chars: int = setting(
        256, help="prefix_hash: how many leading characters of the prompt (or of the chat messages) pick the instance"
    )
    prefill_prefix_slack: int = setting(
        4, help="prefix_hash: the prefix's instance is passed over when it has this many more requests in flight"
    )
    prefill_breaker_failures: int = setting(
        3,
        help="a prefill instance that fails this many requests in a row (unreachable, HTTP 5xx, timed out) is taken "
        "out (its circuit breaker opens)",
    )
    prefill_breaker_open_s: float = setting(
        5.0,
        help="how long a prefill instance taken out waits before its /health is probed; once it answers, one "
        "request at a time tries it (half-open) until one succeeds",
    )
    native_url: str | None = setting(
        None,
        metavar="URL",
        help=f"the native decode pool ('{NATIVE_POOL}'): a stock vLLM decode instance's server root, fed by vLLM's "
        "own P/D connector beside TileRTConnector in the prefill's MultiConnector (unset: no native pool)",
    )
    native_engine: str = NATIVE_ENGINE.field()
    default_pool: str = setting(
        TILERT_POOL,
        help=f"pool of a request that names none ({' or '.join(POOLS)}); a request names one with the "
        "header x-tilert-pool, or by its model (pool_models)",
    )
    pool_models: dict[str, str] = setting(
        default_factory=dict,
        metavar="JSON",
        help='model name -> pool, e.g. {"my-model-fast": "tilert"} (names vLLM serves, see its --served-model-name)',
    )
    overflow_wait_s: float | None = OVERFLOW_WAIT_S.field()
    unsupported_to_native: bool = setting(
        True,
        help="a request with a field the TileRT pool cannot serve (n > 1, logprobs, ...) goes to the native "
        "pool when there is one (its response says so in x-tilert-pool-reason); off: refused with a 400 naming it",
    )
    tool_call_parser: str | None = TOOL_CALL_PARSER.field()
    enable_auto_tool_choice: bool = ENABLE_AUTO_TOOL_CHOICE.field()
    reasoning_parser: str | None = REASONING_PARSER.field()
    tool_parser_plugin: str | None = TOOL_PARSER_PLUGIN.field()
    # Filled at load time from secret_file / $TILERT_SECRET_FILE / $TILERT_SECRET (tilert.auth.load_secret).
    secret: bytes = field(default=b"", repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def lease_s(self) -> float:
        """The reservation lease asked of a decode node (``reserve_lease_s``, or the default)."""
        if self.reserve_lease_s is not None:
            return float(self.reserve_lease_s)
        return default_reserve_lease_s(self.prefill_timeout_s, self.transfer_timeout_s)

    def __post_init__(self) -> None:
        if self.served_model_name is None or self.served_model_name == "":
            self.served_model_name = self.model_dir
        if self.api_key == "":
            self.api_key = None
        if self.prefill_api_key == "":
            self.prefill_api_key = None
        if self.reserve_lease_s is None and is_number(self.prefill_timeout_s) and is_number(self.transfer_timeout_s):
            self.reserve_lease_s = default_reserve_lease_s(self.prefill_timeout_s, self.transfer_timeout_s)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` naming every setting the router cannot start with; returns ``self``."""
        problems = self._address_problems() + self._number_problems() + self._key_problems() + self._pool_problems()
        problems += parser_problems(self, RouterConfig)
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def _address_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        problems += self._prefill_problems()
        if not self.decode_nodes:
            problems.append(f"at least one decode node is required: {d('decode_nodes')} host:ctrl_port:http_port")
        else:
            names = [n.name for n in self.decode_nodes]
            if len(set(names)) != len(names):
                problems.append(f"duplicate decode nodes: {names}")
        if not self.model_dir:
            problems.append(f"{d('model_dir')} is required (the directory holding the tokenizer and config.json)")
        elif not Path(self.model_dir).is_dir():
            problems.append(f"{d('model_dir')}: {self.model_dir!r} is not a directory")
        return problems

    def _prefill_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        urls = self.prefill_urls
        if not isinstance(urls, list) or not urls:
            return [f"at least one prefill instance is required: {d('prefill_urls')} URL"]
        problems = [f"{d('prefill_urls')} {why}" for url in urls if (why := prefill_url_problem(url))]
        if problems:
            return problems
        self.prefill_urls = [url.rstrip("/") for url in urls]
        if len(set(self.prefill_urls)) != len(self.prefill_urls):
            problems.append(f"duplicate prefill instances in {d('prefill_urls')}: {self.prefill_urls}")
        if self.prefill_policy not in PREFILL_POLICIES:
            problems.append(
                f"{d('prefill_policy')} must be one of {', '.join(PREFILL_POLICIES)}, got {self.prefill_policy!r}"
            )
        for name, low in (("prefill_prefix_chars", 1), ("prefill_prefix_slack", 0), ("prefill_breaker_failures", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                problems.append(f"{d(name)} must be an integer >= {low}, got {value!r}")
        open_s = self.prefill_breaker_open_s
        if not is_number(open_s) or open_s <= 0:
            problems.append(f"{d('prefill_breaker_open_s')} must be a positive number, got {open_s!r}")
        return problems

    def _number_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        try:
            check_port(self.port, d("port"))
        except ConfigError as exc:
            problems.append(str(exc))
        timeouts = (
            "queue_timeout_s",
            "connect_timeout_s",
            "prefill_timeout_s",
            "transfer_timeout_s",
            "decode_idle_timeout_s",
            "control_timeout_s",
            "health_interval_s",
            "health_timeout_s",
            "reserve_lease_s",
        )
        for name in timeouts:
            value = getattr(self, name)
            if not is_number(value) or value <= 0:
                problems.append(f"{d(name)} must be a positive number, got {value!r}")
        if not is_number(self.node_silence_s) or self.node_silence_s <= NODE_BEAT_S:
            problems.append(
                f"{d('node_silence_s')} must be a number above the nodes' beat ({NODE_BEAT_S:g} s), "
                f"got {self.node_silence_s!r}"
            )
        for name in ("max_queue", "retry_after_s"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                problems.append(f"{d(name)} must be a non-negative integer, got {value!r}")
        if self.default_max_tokens is not None and (not is_int(self.default_max_tokens) or self.default_max_tokens < 1):
            problems.append(
                f"{d('default_max_tokens')} must be an integer >= 1 (or unset), got {self.default_max_tokens!r}"
            )
        if not is_int(self.max_body_bytes) or self.max_body_bytes < 1024:
            problems.append(f"{d('max_body_bytes')} must be an integer >= 1024, got {self.max_body_bytes!r}")
        if all(is_number(getattr(self, n)) for n in ("reserve_lease_s", "prefill_timeout_s", "transfer_timeout_s")):
            floor = self.prefill_timeout_s + self.transfer_timeout_s
            if self.reserve_lease_s < floor:  # type: ignore[operator]
                problems.append(
                    f"{d('reserve_lease_s')} = {self.reserve_lease_s:g} is shorter than prefill_timeout_s + "
                    f"transfer_timeout_s = {floor:g}: a slow prefill would lose its decode slot; leave it unset "
                    f"(default {floor + LEASE_MARGIN_S:g}) or raise it"
                )
        return problems

    @property
    def has_native_pool(self) -> bool:
        return bool(self.native_url)

    def _pool_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        if self.native_url is not None:
            url = urlparse(self.native_url) if isinstance(self.native_url, str) else urlparse("")
            if url.scheme not in ("http", "https") or not url.netloc or url.path.rstrip("/").endswith("/v1"):
                problems.append(
                    f"{d('native_url')} must be an http(s) server root such as http://127.0.0.1:8200 "
                    f"(without /v1), got {self.native_url!r}"
                )
            else:
                self.native_url = self.native_url.rstrip("/")
        wanted = {"default_pool": self.default_pool}
        if not isinstance(self.pool_models, dict):
            problems.append(f"{d('pool_models')} must be a table of model name -> pool")
        else:
            wanted |= {f"pool_models[{k!r}]": v for k, v in self.pool_models.items()}
        for what, pool in wanted.items():
            if pool not in POOLS:
                problems.append(f"{what} must be one of {', '.join(POOLS)}, got {pool!r}")
            elif pool == NATIVE_POOL and not self.has_native_pool:
                problems.append(f"{what} is {pool!r} but no native pool is configured: set {d('native_url')}")
        if self.overflow_wait_s is not None:
            if not is_number(self.overflow_wait_s) or self.overflow_wait_s < 0:
                problems.append(f"{d('overflow_wait_s')} must be a number >= 0, got {self.overflow_wait_s!r}")
            elif not self.has_native_pool:
                problems.append(f"{d('overflow_wait_s')} overflows to the native pool: set {d('native_url')} too")
        return problems

    def _key_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        for name in ("api_key", "prefill_api_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or value != value.strip() or not value):
                problems.append(f"{name} must be a non-empty string without surrounding blanks")
            if value is None and getattr(self, name + "_file"):
                problems.append(
                    f"{d(name + '_file')} is set but was not read: load the config with load_router_config()"
                )
        problem = secret_problem(self.secret, self.secret_file)
        if problem:
            problems.append(problem)
        return problems


def default_reserve_lease_s(prefill_timeout_s: float | None = None, transfer_timeout_s: float | None = None) -> float:
    """The lease a router asks for when ``reserve_lease_s`` is unset: prefill + transfer timeouts + 30 s."""
    prefill = DEFAULT_PREFILL_TIMEOUT_S if prefill_timeout_s is None else prefill_timeout_s
    transfer = DEFAULT_TRANSFER_TIMEOUT_S if transfer_timeout_s is None else transfer_timeout_s
    return float(prefill + transfer + LEASE_MARGIN_S)


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


_REQUIRED_HINT = f" (or in the TOML file named by --config / ${CONFIG_ENV})"


def _read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read router config {str(p)!r}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"router config {str(p)!r} is not valid TOML: {exc}") from None


def _flatten_router_table(data: Mapping[str, Any]) -> dict[str, Any]:
    if "router" in data and isinstance(data["router"], dict):
        return {**data["router"], **{k: v for k, v in data.items() if k != "router"}}
    return dict(data)


def load_router_config(
    cli: Mapping[str, Any] | None = None,
    *,
    toml_path: str | os.PathLike[str] | None = None,
    toml_data: Mapping[str, Any] | None = None,
) -> RouterConfig:
    """The router's config: flags (``cli``, from :func:`cli_values`) > environment > TOML > defaults.

    Reads the key files and the shared secret, then validates. Every launch mode goes through here.
    """
    layers: list[Mapping[str, Any]] = []
    where = ""
    if toml_path is not None:
        toml_data = _read_toml(toml_path)
        where = f"router config {str(toml_path)!r}"
    if toml_data is not None:
        layers.append(toml_values(RouterConfig, _flatten_router_table(toml_data), where or "the router config"))
    layers.append(env_values(RouterConfig))
    if cli:
        layers.append(cli)
    values = merge_values(RouterConfig, layers)
    for key, what in (("api_key", "the API key file"), ("prefill_api_key", "the prefill API key file")):
        path = values.get(key + "_file")
        if path:
            values[key] = read_key_file(path, what)
    secret = try_load_secret(values.get("secret_file"))
    config = build_config(RouterConfig, values, where=_REQUIRED_HINT, secret=secret)
    return config.validate()


def load_config(path: str | os.PathLike[str]) -> RouterConfig:
    """Read a TOML router config file (environment variables override it)."""
    return load_router_config(toml_path=path)


def load_config_from_env() -> RouterConfig:
    """The ``uvicorn tilert.router:app`` config: the TOML file named by ``$TILERT_ROUTER_CONFIG`` (if set)
    under the ``TILERT_ROUTER_*`` environment variables."""
    path = os.environ.get(CONFIG_ENV) or None
    try:
        return load_router_config(toml_path=path)
    except ConfigError as exc:
        if path is None and str(exc).endswith(_REQUIRED_HINT):
            raise ConfigError(
                f"{exc}; set {CONFIG_ENV} to a router TOML file (see config/router.example.toml) or the "
                f"{ENV_PREFIX}* variables, or start the router with "
                "`tilert router --prefill-url URL [--prefill-url URL ...] --decode host:ctrl:http --model DIR`"
            ) from None
        raise
