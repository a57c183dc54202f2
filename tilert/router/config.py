"""Router configuration: one dataclass field per setting, read the same way in every launch mode.

Each field of :class:`RouterConfig` that carries :func:`setting` metadata is one setting, with

- a flag ``--field-name`` on ``tilert router`` (a few keep their historical names: ``--decode``, ``--model``),
- an environment variable ``TILERT_ROUTER_FIELD_NAME``,
- a key ``field_name`` in the TOML file (``--config PATH`` or ``$TILERT_ROUTER_CONFIG``),

and the precedence is flag > environment variable > TOML > default. ``tilert router`` and
``uvicorn tilert.router:app`` (``$TILERT_ROUTER_CONFIG`` optional; the environment alone may do) read the
same environment variables, through :func:`load_router_config`. An empty environment variable counts as unset.

Secrets never travel on a command line:

- the clients' API key: ``--api-key-file PATH`` / ``$TILERT_ROUTER_API_KEY_FILE`` / ``$TILERT_ROUTER_API_KEY``;
- the key the router sends to vLLM: ``--prefill-api-key-file`` / ``$TILERT_ROUTER_PREFILL_API_KEY_FILE`` /
  ``$TILERT_ROUTER_PREFILL_API_KEY``;
- the deployment's shared secret (:mod:`tilert.auth`): ``--secret-file`` / ``$TILERT_SECRET_FILE`` /
  ``$TILERT_SECRET``, loaded into ``RouterConfig.secret``; the router refuses to start without one.

The generic machinery (:func:`setting`, :func:`add_config_arguments`, :func:`cli_values`, :func:`env_values`,
:func:`toml_values`, :func:`merge_values`, :func:`build_config`) serves :mod:`tilert.decode.config` too.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from tilert.auth import MIN_SECRET_BYTES, SECRET_ENV, SECRET_FILE_ENV, SecretError, load_secret
from tilert.contracts import NODE_BEAT_S

CONFIG_ENV = "TILERT_ROUTER_CONFIG"
ENV_PREFIX = "TILERT_ROUTER_"
API_KEY_ENV = "TILERT_ROUTER_API_KEY"
API_KEY_FILE_ENV = "TILERT_ROUTER_API_KEY_FILE"
PREFILL_API_KEY_ENV = "TILERT_ROUTER_PREFILL_API_KEY"
PREFILL_API_KEY_FILE_ENV = "TILERT_ROUTER_PREFILL_API_KEY_FILE"
LEASE_MARGIN_S = 30.0
DEFAULT_PREFILL_TIMEOUT_S = 600.0
DEFAULT_TRANSFER_TIMEOUT_S = 30.0
TILERT_POOL = "tilert"  # decode by our decode nodes
NATIVE_POOL = "vllm"  # decode by a stock vLLM decode instance (engine plugin "vllm"), vLLM's own P/D
POOLS = (TILERT_POOL, NATIVE_POOL)


class ConfigError(ValueError):
    """The configuration is missing or invalid; the message says what to fix."""


# ---------------------------------------------------------------------------------------------------
# Settings machinery: dataclass fields -> flags, environment variables, TOML keys
# ---------------------------------------------------------------------------------------------------

_META_KEY = "tilert.setting"


@dataclass(frozen=True)
class Setting:
    """How one config field is set from outside. Fields without a ``Setting`` are internal."""

    help: str
    flag: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()  # more flags for the same setting
    cli: bool = True  # False: no flag (secrets)
    env: str | bool = True  # True: PREFIX + FIELD_NAME; a string: that exact variable; False: none
    toml: bool | str = True  # False: not in the file; a string: refused there with that advice
    toml_aliases: tuple[str, ...] = ()
    parse: Callable[[Any], Any] | None = None  # converter for a string or TOML value (instead of the type's)
    repeat: bool = False  # the flag may be given several times
    group: str | None = None  # alternative forms of one setting (api_key / api_key_file)
    metavar: str | None = None


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, repr: bool = True, **meta: Any) -> Any:
    """A dataclass field that is a setting (see :class:`Setting` for ``meta``)."""
    return field(default=default, default_factory=default_factory, repr=repr, metadata={_META_KEY: Setting(**meta)})


@dataclass(frozen=True)
class _Spec:
    name: str
    setting: Setting
    type: Any  # the annotation without Optional
    optional: bool
    required: bool
    default: Any

    @property
    def flags(self) -> list[str]:
        return [self.setting.flag or "--" + self.name.replace("_", "-"), *self.setting.aliases]


def _specs(cls: type) -> dict[str, _Spec]:
    cached = cls.__dict__.get("_tilert_specs")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out: dict[str, _Spec] = {}
    for f in fields(cls):
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            continue
        typ, optional = _unwrap_optional(hints[f.name])
        default: Any = f.default
        factory: Any = f.default_factory
        if default is MISSING and factory is not MISSING:
            default = factory()
        out[f.name] = _Spec(f.name, meta, typ, optional, default is MISSING, default)
    type.__setattr__(cls, "_tilert_specs", out)
    return out


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def env_var(cls: type, name: str) -> str | None:
    """The environment variable of setting ``name`` of config class ``cls`` (None: it has none)."""
    env = _specs(cls)[name].setting.env
    if env is False:
        return None
    return env if isinstance(env, str) else cls.ENV_PREFIX + name.upper()  # type: ignore[attr-defined]


def describe(cls: type, name: str) -> str:
    """``name (--flag, $ENV)``: how a setting is called in every mode, for error messages."""
    spec = _specs(cls).get(name)
    if spec is None:
        return name
    ways = [spec.flags[0]] if spec.setting.cli else []
    var = env_var(cls, name)
    if var:
        ways.append("$" + var)
    return f"{name} ({', '.join(ways)})" if ways else name


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(spec: _Spec, value: Any, source: str) -> Any:
    """``value`` (a string from a flag or the environment, or a TOML value) as the field's type."""
    if spec.setting.parse is not None:
        try:
            return spec.setting.parse(value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if value is None or (spec.optional and isinstance(value, str) and value.strip().lower() in ("", "none")):
        if spec.optional:
            return None
        raise ConfigError(f"{source}: a value is required")
    typ = spec.type
    try:
        return _as_type(typ, value, value.strip() if isinstance(value, str) else None)
    except ValueError as exc:
        reason = str(exc)
        if reason.startswith(("invalid literal", "could not convert")):
            reason = "expected an integer" if typ is int else "expected a number"
        raise ConfigError(f"{source}: {reason}, got {value!r}") from None


def _as_type(typ: Any, value: Any, text: str | None) -> Any:
    """``value`` as ``typ``; ``ValueError`` saying what was expected."""
    if typ is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError("expected true or false")
    if typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None:
            return int(text, 0) if text.lower().startswith(("0x", "0o", "0b")) else int(text)
        raise ValueError("expected an integer")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text is not None:
            return float(text)
        raise ValueError("expected a number")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ValueError("expected a string")
    if typ is Path:
        if isinstance(value, (str, os.PathLike)):
            return Path(value)
        raise ValueError("expected a path")
    if typing.get_origin(typ) is dict or typ is dict:
        if isinstance(value, dict):
            return value
        if text is not None:
            try:
                parsed = json.loads(text) if text else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not JSON ({exc})") from None
            if isinstance(parsed, dict):
                return parsed
        raise ValueError("expected a JSON object")
    raise ValueError(f"unsupported setting type {typ!r}")  # a programming error


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per setting of ``cls``: help from the field, the environment variable and the default."""
    for spec in _specs(cls).values():
        s = spec.setting
        if not s.cli:
            continue
        notes = []
        var = env_var(cls, spec.name)
        if var:
            notes.append(f"env {var}")
        if spec.required:
            notes.append("required")
        elif spec.default not in (None, MISSING, {}, [], ""):
            notes.append(f"default {spec.default}")
        text = s.help + (f" [{'; '.join(notes)}]" if notes else "")
        kwargs: dict[str, Any] = {"dest": spec.name, "default": argparse.SUPPRESS, "help": text.replace("%", "%%")}
        if spec.type is bool and not s.repeat:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["action"] = "append" if s.repeat else "store"
            kwargs["metavar"] = s.metavar or _metavar(spec)
        parser.add_argument(*spec.flags, **kwargs)


def _metavar(spec: _Spec) -> str:
    if spec.type is int:
        return "N"
    if spec.type is float:
        return "SECONDS" if spec.name.endswith("_s") else "X"
    return spec.name.rsplit("_", 1)[-1].upper()


def cli_values(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (those left out are absent), converted; errors name the flag."""
    out: dict[str, Any] = {}
    for spec in _specs(cls).values():
        if spec.setting.cli and hasattr(namespace, spec.name):
            out[spec.name] = _convert(spec, getattr(namespace, spec.name), spec.flags[0])
    _check_groups(cls, out, lambda name: _specs(cls)[name].flags[0])
    return out


def env_values(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings given as environment variables, converted; errors name the variable."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for spec in _specs(cls).values():
        var = env_var(cls, spec.name)
        if var is None:
            continue
        raw = environ.get(var)
        if raw is None or raw.strip() == "":
            continue
        out[spec.name] = _convert(spec, raw, "$" + var)
    _check_groups(cls, out, lambda name: "$" + (env_var(cls, name) or name))
    return out


def toml_values(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings given in a parsed TOML table; unknown keys and secrets are refused."""
    specs = _specs(cls)
    keys: dict[str, str] = {}
    for spec in specs.values():
        keys[spec.name] = spec.name
        for alias in spec.setting.toml_aliases:
            keys[alias] = spec.name
    unknown = sorted(k for k in data if k not in keys)
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {unknown}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        spec = specs[keys[key]]
        if spec.setting.toml is not True:
            advice = spec.setting.toml if isinstance(spec.setting.toml, str) else "it is not read from the file"
            raise ConfigError(f"{key} does not belong in {where}: {advice}")
        if spec.name in out:  # `decode` and `decode_nodes` both given: the first key as written wins
            continue
        out[spec.name] = _convert(spec, value, f"{key} in {where}")
    _check_groups(cls, out, lambda name: f"{name} in {where}")
    return out


def _check_groups(cls: type, values: Mapping[str, Any], label: Callable[[str], str]) -> None:
    seen: dict[str, str] = {}
    for name in values:
        group = _specs(cls)[name].setting.group
        if group is None:
            continue
        if group in seen:
            raise ConfigError(f"{label(seen[group])} and {label(name)} set the same thing: give only one")
        seen[group] = name


def merge_values(cls: type, layers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge layers given lowest precedence first; a setting of a group replaces the group's lower forms."""
    out: dict[str, Any] = {}
    specs = _specs(cls)
    for layer in layers:
        for name, value in layer.items():
            group = specs[name].setting.group
            if group is not None:
                for other in [n for n in out if specs[n].setting.group == group]:
                    del out[other]
            out[name] = value
    return out


def build_config(cls: type, values: Mapping[str, Any], *, where: str = "", **internal: Any) -> Any:
    """``cls(**values, **internal)``, refusing a missing required setting with how to give it."""
    missing = [describe(cls, spec.name) for spec in _specs(cls).values() if spec.required and spec.name not in values]
    if missing:
        raise ConfigError(f"{'; '.join(missing)} {'is' if len(missing) == 1 else 'are'} required{where}")
    try:
        return cls(**values, **internal)
    except TypeError as exc:  # pragma: no cover - the layers only hold known fields
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from None


def read_key_file(path: str | os.PathLike[str], what: str) -> str:
    """The first line of a key file (surrounding blanks ignored); refuses an unreadable or empty file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").strip().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"{what} {str(path)!r} is empty")
    return key


def try_load_secret(secret_file: str | os.PathLike[str] | None) -> bytes:
    """The shared secret, or ``b""`` when none is configured (``validate()`` then says why)."""
    try:
        return load_secret(secret_file)
    except SecretError:
        return b""


def secret_problem(secret: bytes, secret_file: str | os.PathLike[str] | None) -> str | None:
    """None when ``secret`` is usable, else :func:`tilert.auth.load_secret`'s reason."""
    if isinstance(secret, bytes) and len(secret) >= MIN_SECRET_BYTES:
        return None
    if secret:
        return f"the shared secret must be bytes of at least {MIN_SECRET_BYTES}"
    try:
        load_secret(secret_file)
    except SecretError as exc:
        return str(exc)
    return f"no shared secret loaded: build the config with its loader, which reads {SECRET_FILE_ENV} / {SECRET_ENV}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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


# What the pool holds per node: the node's address is all it needs today.


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
            ctrl = _port(item.get("ctrl_port"), "decode ctrl_port")
            http = _port(item.get("http_port"), "decode http_port")
            nodes.append(DecodeNodeSpec(host=str(item["host"]), ctrl_port=ctrl, http_port=http))
        else:
            raise ConfigError(f"bad decode entry {item!r}")
    return nodes


_decode_nodes_from = parse_decode_nodes  # the old name


# ---------------------------------------------------------------------------------------------------
# RouterConfig
# ---------------------------------------------------------------------------------------------------

_NO_KEY_IN_FILE = "put the key in a file of its own and name it with {key}_file (or set ${env})"


@dataclass
class RouterConfig:
    """Everything the router needs. ``served_model_name`` defaults to ``model_dir`` as given (vLLM's default)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    prefill_url: str = setting(help="stock vLLM's server root, without /v1 (http://127.0.0.1:8000)", metavar="URL")
    decode_nodes: list[DecodeNodeSpec] = setting(
        help="a decode node as host:ctrl_port:http_port (repeat the flag, or comma-separate, for several)",
        flag="--decode", aliases=("--decode-nodes",), repeat=True, parse=parse_decode_nodes,
        toml_aliases=("decode",), metavar="HOST:CTRL:HTTP",
    )  # fmt: skip
    model_dir: str = setting(
        help="directory with the tokenizer and config.json (the one vLLM serves)",
        flag="--model", aliases=("--model-dir",), metavar="DIR",
    )  # fmt: skip
    served_model_name: str | None = setting(None, help="model name clients use (default: model_dir as given)")
    host: str = setting("127.0.0.1", help="bind address of `tilert router` (uvicorn's own --host rules under uvicorn)")
    port: int = setting(23333, help="port of `tilert router` (uvicorn's own --port rules under uvicorn)")
    api_key: str | None = setting(
        None, help="require 'Authorization: Bearer KEY' on /v1/*", cli=False, group="api_key", repr=False,
        toml=_NO_KEY_IN_FILE.format(key="api_key", env=API_KEY_ENV),
    )  # fmt: skip
    api_key_file: str | None = setting(
        None, help="file holding the API key clients must send (first line); unset: /v1/* is open",
        group="api_key", metavar="PATH",
    )  # fmt: skip
    prefill_api_key: str | None = setting(
        None, help="bearer token sent to vLLM (when vLLM runs with --api-key)", cli=False, repr=False,
        group="prefill_api_key", toml=_NO_KEY_IN_FILE.format(key="prefill_api_key", env=PREFILL_API_KEY_ENV),
    )  # fmt: skip
    prefill_api_key_file: str | None = setting(
        None, help="file holding the bearer token sent to vLLM (first line)", group="prefill_api_key", metavar="PATH"
    )
    secret_file: str | None = setting(
        None, env=SECRET_FILE_ENV, metavar="PATH",
        help=f"file holding the deployment's shared secret (else ${SECRET_ENV}); router, connector and decode "
        "nodes share it",
    )  # fmt: skip
    queue_timeout_s: float = setting(30.0, help="FIFO wait for a decode slot before 429")
    max_queue: int = setting(256, help="requests waiting beyond this get 429 at once")
    retry_after_s: int = setting(1, help="Retry-After of a 429/503")
    default_max_tokens: int | None = setting(
        None, help="max_tokens of a request that sends none (unset: up to the end of the context, as vLLM)"
    )
    max_body_bytes: int = setting(16 << 20, help="largest request body accepted (413 beyond)")
    reserve_lease_s: float | None = setting(
        None, help="decode slot lease asked of the node; must outlive prefill + transfer "
        f"(default prefill_timeout_s + transfer_timeout_s + {LEASE_MARGIN_S:.0f})",
    )  # fmt: skip
    connect_timeout_s: float = setting(5.0, help="TCP connect timeout to vLLM and the decode nodes")
    prefill_timeout_s: float = setting(DEFAULT_PREFILL_TIMEOUT_S, help="the whole max_tokens=1 prefill call")
    transfer_timeout_s: float = setting(
        DEFAULT_TRANSFER_TIMEOUT_S, help="decode request sent -> first decode token (KV transfer wait)"
    )
    decode_idle_timeout_s: float = setting(30.0, help="longest silence between decode tokens")
    control_timeout_s: float = setting(5.0, help="reserve / release / cancel calls to a decode node")
    health_interval_s: float = setting(2.0, help="decode node health probe period")
    health_timeout_s: float = setting(2.0, help="decode node / prefill health probe timeout")
    node_silence_s: float = setting(
        5.0, help=f"a decode node whose watch stream (a beat every {NODE_BEAT_S:g} s) is silent this long is lost: "
        "no new requests go there and those whose prefill is running move to another node (a node that dies "
        "closes the stream, which counts at once)",
    )  # fmt: skip
    native_url: str | None = setting(
        None, metavar="URL",
        help=f"the native decode pool ('{NATIVE_POOL}'): a stock vLLM decode instance's server root, fed by vLLM's "
        "own P/D connector beside TileRTConnector in the prefill's MultiConnector (unset: no native pool)",
    )  # fmt: skip
    native_engine: str = setting(NATIVE_POOL, help="the native pool's engine plugin (tilert.engines group)")
    default_pool: str = setting(
        TILERT_POOL, help=f"pool of a request that names none ({' or '.join(POOLS)}); a request names one with the "
        "header x-tilert-pool, or by its model (pool_models)",
    )  # fmt: skip
    pool_models: dict[str, str] = setting(
        default_factory=dict, metavar="JSON",
        help='model name -> pool, e.g. {"my-model-fast": "tilert"} (names vLLM serves, see its --served-model-name)',
    )  # fmt: skip
    overflow_wait_s: float | None = setting(
        None, help="a TileRT-pool request with no decode slot after this wait goes to the native pool instead of "
        "waiting on to queue_timeout_s and a 429 (needs native_url; unset: no overflow)",
    )  # fmt: skip
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
        if self.reserve_lease_s is None and _is_number(self.prefill_timeout_s) and _is_number(self.transfer_timeout_s):
            self.reserve_lease_s = default_reserve_lease_s(self.prefill_timeout_s, self.transfer_timeout_s)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` naming every setting the router cannot start with; returns ``self``."""
        problems = self._address_problems() + self._number_problems() + self._key_problems() + self._pool_problems()
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def _address_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        url = urlparse(self.prefill_url or "") if isinstance(self.prefill_url, str) else urlparse("")
        if url.scheme not in ("http", "https") or not url.netloc:
            problems.append(
                f"{d('prefill_url')} must be an http(s) URL such as http://127.0.0.1:8000, got {self.prefill_url!r}"
            )
        else:
            self.prefill_url = self.prefill_url.rstrip("/")
            if self.prefill_url.endswith("/v1"):
                problems.append(f"{d('prefill_url')} is the server root, without /v1: {self.prefill_url!r}")
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

    def _number_problems(self) -> list[str]:
        d = lambda name: describe(RouterConfig, name)  # noqa: E731
        problems: list[str] = []
        try:
            _port(self.port, d("port"))
        except ConfigError as exc:
            problems.append(str(exc))
        timeouts = ("queue_timeout_s", "connect_timeout_s", "prefill_timeout_s", "transfer_timeout_s",
                    "decode_idle_timeout_s", "control_timeout_s", "health_interval_s", "health_timeout_s",
                    "reserve_lease_s")  # fmt: skip
        for name in timeouts:
            value = getattr(self, name)
            if not _is_number(value) or value <= 0:
                problems.append(f"{d(name)} must be a positive number, got {value!r}")
        if not _is_number(self.node_silence_s) or self.node_silence_s <= NODE_BEAT_S:
            problems.append(f"{d('node_silence_s')} must be a number above the nodes' beat ({NODE_BEAT_S:g} s), "
                            f"got {self.node_silence_s!r}")  # fmt: skip
        for name in ("max_queue", "retry_after_s"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                problems.append(f"{d(name)} must be a non-negative integer, got {value!r}")
        if self.default_max_tokens is not None and (
            not _is_int(self.default_max_tokens) or self.default_max_tokens < 1
        ):
            problems.append(
                f"{d('default_max_tokens')} must be an integer >= 1 (or unset), got {self.default_max_tokens!r}"
            )
        if not _is_int(self.max_body_bytes) or self.max_body_bytes < 1024:
            problems.append(f"{d('max_body_bytes')} must be an integer >= 1024, got {self.max_body_bytes!r}")
        if all(_is_number(getattr(self, n)) for n in ("reserve_lease_s", "prefill_timeout_s", "transfer_timeout_s")):
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
                problems.append(f"{d('native_url')} must be an http(s) server root such as http://127.0.0.1:8200 "
                                f"(without /v1), got {self.native_url!r}")  # fmt: skip
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
            if not _is_number(self.overflow_wait_s) or self.overflow_wait_s < 0:
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


def config_from_mapping(data: dict[str, Any]) -> RouterConfig:
    """Build and validate a config from a parsed TOML table (optional top-level [router] table); env wins."""
    return load_router_config(toml_data=data)


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
                "`tilert router --prefill-url URL --decode host:ctrl:http --model DIR`"
            ) from None
        raise
