"""Router configuration: a dataclass, a TOML loader and the ``host:ctrl:http`` decode-node spec parser."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

CONFIG_ENV = "TILERT_ROUTER_CONFIG"
API_KEY_ENV = "TILERT_ROUTER_API_KEY"


class ConfigError(ValueError):
    """The router configuration is missing or invalid; the message says what to fix."""


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


def _port(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer port, got {value!r}")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be an integer port, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what} must be in 1..65535, got {port}")
    return port


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
    ctrl = _port(parts[1], f"ctrl port in decode spec {spec!r}")
    http = _port(parts[2], f"http port in decode spec {spec!r}")
    if ctrl == http:
        raise ConfigError(f"ctrl port and http port must differ in decode spec {spec!r}")
    return DecodeNodeSpec(host=host, ctrl_port=ctrl, http_port=http)


@dataclass
class RouterConfig:
    """Everything the router needs. ``served_model_name`` defaults to ``model_dir`` as given (vLLM's default)."""

    prefill_url: str
    decode_nodes: list[DecodeNodeSpec]
    model_dir: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 23333
    api_key: str | None = None
    prefill_api_key: str | None = None
    queue_timeout_s: float = 30.0
    max_queue: int = 256
    retry_after_s: int = 1
    default_max_tokens: int = 256
    # Context length of the served model (vLLM --max-model-len / decode --max-seq-len). vLLM only sees
    # max_tokens=1, so the router enforces prompt + max_tokens <= max_model_len itself. None: no check.
    max_model_len: int | None = None
    reserve_lease_s: float = 30.0
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 600.0
    transfer_timeout_s: float = 30.0
    decode_idle_timeout_s: float = 30.0
    control_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.served_model_name is None or self.served_model_name == "":
            self.served_model_name = self.model_dir
        if self.api_key == "":
            self.api_key = None
        if self.prefill_api_key == "":
            self.prefill_api_key = None

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` with a clear message for anything the router cannot start with."""
        url = urlparse(self.prefill_url or "")
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"prefill_url must be an http(s) URL such as http://127.0.0.1:8000, got {self.prefill_url!r}")
        self.prefill_url = self.prefill_url.rstrip("/")
        if self.prefill_url.endswith("/v1"):
            raise ConfigError(f"prefill_url is the server root, without /v1: {self.prefill_url!r}")
        if not self.decode_nodes:
            raise ConfigError("at least one decode node is required (decode = ['host:ctrl_port:http_port'])")
        names = [n.name for n in self.decode_nodes]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate decode nodes: {names}")
        if not self.model_dir:
            raise ConfigError("model_dir is required (the directory holding the tokenizer and config.json)")
        if not Path(self.model_dir).is_dir():
            raise ConfigError(f"model_dir {self.model_dir!r} is not a directory")
        _port(self.port, "port")
        for name in (
            "queue_timeout_s",
            "reserve_lease_s",
            "connect_timeout_s",
            "prefill_timeout_s",
            "transfer_timeout_s",
            "decode_idle_timeout_s",
            "control_timeout_s",
            "health_interval_s",
            "health_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"{name} must be a positive number, got {value!r}")
        for name in ("max_queue", "retry_after_s", "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ConfigError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens must be >= 1")
        return self


def _decode_nodes_from(raw: Any) -> list[DecodeNodeSpec]:
    if raw is None:
        return []
    if isinstance(raw, (str, dict)):
        raw = [raw]
    if not isinstance(raw, list):
        raise ConfigError("decode must be a list of 'host:ctrl:http' strings or [[decode]] tables")
    nodes: list[DecodeNodeSpec] = []
    for item in raw:
        if isinstance(item, str):
            nodes.append(parse_decode_spec(item))
        elif isinstance(item, dict):
            unknown = set(item) - {"host", "ctrl_port", "http_port"}
            if unknown or "host" not in item:
                raise ConfigError(f"[[decode]] entries take host, ctrl_port, http_port; got {sorted(item)}")
            ctrl = _port(item.get("ctrl_port"), "decode ctrl_port")
            http = _port(item.get("http_port"), "decode http_port")
            nodes.append(DecodeNodeSpec(host=str(item["host"]), ctrl_port=ctrl, http_port=http))
        else:
            raise ConfigError(f"bad decode entry {item!r}")
    return nodes


def config_from_mapping(data: dict[str, Any]) -> RouterConfig:
    """Build and validate a config from a parsed TOML table (accepts an optional top-level [router] table)."""
    if "router" in data and isinstance(data["router"], dict):
        data = {**data["router"], **{k: v for k, v in data.items() if k != "router"}}
    known = {f.name for f in fields(RouterConfig)} - {"decode_nodes", "extra"}
    unknown = set(data) - known - {"decode", "decode_nodes"}
    if unknown:
        raise ConfigError(f"unknown router config keys: {sorted(unknown)}")
    for required in ("prefill_url", "model_dir"):
        if required not in data:
            raise ConfigError(f"router config lacks required key {required!r}")
    kwargs = {k: v for k, v in data.items() if k in known}
    nodes = _decode_nodes_from(data.get("decode", data.get("decode_nodes")))
    try:
        cfg = RouterConfig(decode_nodes=nodes, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"invalid router config: {exc}") from None
    if os.environ.get(API_KEY_ENV):
        cfg.api_key = os.environ[API_KEY_ENV]
    return cfg.validate()


def load_config(path: str | os.PathLike[str]) -> RouterConfig:
    """Read a TOML router config file."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read router config {str(p)!r}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"router config {str(p)!r} is not valid TOML: {exc}") from None
    return config_from_mapping(data)


def load_config_from_env() -> RouterConfig:
    """Load the config named by ``$TILERT_ROUTER_CONFIG``."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        raise ConfigError(
            f"set {CONFIG_ENV} to a router TOML file (see config/router.example.toml), "
            "or start the router with `tilert router --prefill-url ... --decode host:ctrl:http --model DIR`"
        )
    return load_config(path)
