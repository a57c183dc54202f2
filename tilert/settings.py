"""Settings: one dataclass field per setting, read the same way by every command.

A config class (``RouterConfig``, ``DecodeConfig``, ``StackConfig``) declares each setting as a dataclass field
made by :func:`setting` (or :meth:`Setting.field` of a declaration shared by several commands, such as
:data:`SECRET_FILE`). A field without one is internal. Each setting has

- a flag ``--field-name`` (or the declaration's own ``flag`` and ``aliases``), added by :func:`add_config_arguments`;
- an environment variable ``<ENV_PREFIX>FIELD_NAME`` (the class's ``ENV_PREFIX``; or the declaration's own ``env``);
- a key ``field_name`` in a TOML table, for the commands that read one (:func:`toml_values`),

and a command merges them flag > environment variable > TOML > default (:func:`merge_values`, lowest layer first).
An empty environment variable counts as unset. Errors (:class:`ConfigError`) name the flag, variable or key the
value came from. A secret never travels on a command line: such a setting has no flag, and a flag that would carry
it is refused (``secret_flag``).

Also here: the defaults several commands share (ports, the bind address), declared once, and the checks several
config classes share (ports, numbers, key files, the deployment's shared secret).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from tilert.auth import MIN_SECRET_BYTES, SECRET_ENV, SECRET_FILE_ENV, SecretError, load_secret

# ---------------------------------------------------------------------------------------------------
# Defaults several commands share
# ---------------------------------------------------------------------------------------------------

LOOPBACK = "127.0.0.1"  # every server binds loopback unless told otherwise
WILDCARDS = ("0.0.0.0", "::", "")  # bind addresses that mean every interface: never an address a peer can dial
NODE_CTRL_PORT = 5556  # a decode node's control port (transfer handshakes)
NODE_HTTP_PORT = 5557  # a decode node's HTTP port (reserve / decode / release)
ROUTER_PORT = 23333  # `tilert router`
UP_ROUTER_PORT = 8000  # the router of `tilert up` (where a client of vLLM looks first)
UP_PREFILL_PORT = 8100  # the prefill vLLM of `tilert up`
NATIVE_PORT = 8200  # the native vLLM decode instance of `tilert up --native`
PREFILL_SIDE_PORT = 5600  # the prefill's NIXL side channel (`tilert up --native`)
NATIVE_SIDE_PORT = 5601  # the native decode instance's NIXL side channel


class ConfigError(ValueError):
    """The configuration is missing or invalid; the message says what to fix."""


# ---------------------------------------------------------------------------------------------------
# Declarations
# ---------------------------------------------------------------------------------------------------

_META_KEY = "tilert.setting"


class _Required:
    """The default of a setting that has none (``dataclasses.MISSING`` cannot be a dataclass field's default)."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()


@dataclass(frozen=True, eq=False)
class Setting:
    """How one config field is set from outside, and its default. Compared by identity: a declaration shared by
    several config classes is one object."""

    help: str
    default: Any = REQUIRED
    default_factory: Callable[[], Any] | None = None
    repr: bool = True  # False: left out of the config's repr (secrets)
    flag: str | None = None  # default: --field-name
    aliases: tuple[str, ...] = ()  # more flags for the same setting
    cli: bool = True  # False: no flag (secrets)
    env: str | bool = True  # True: ENV_PREFIX + FIELD_NAME; a string: that exact variable; False: none
    toml: bool | str = True  # False: not in the file; a string: refused there with that advice
    toml_aliases: tuple[str, ...] = ()
    parse: Callable[[Any], Any] | None = None  # converter for a string or TOML value (instead of the type's)
    repeat: bool = False  # the flag may be given several times
    group: str | None = None  # alternative forms of one setting (api_key / api_key_file): one per layer
    metavar: str | None = None
    secret_flag: str | None = None  # a flag that would put the secret this setting names a file of on a command
    secret_env: str | None = None  # line (refused), and the variable that holds that secret itself

    def field(self) -> Any:
        """The dataclass field of this setting (in each config class that has it)."""
        meta = {_META_KEY: self}
        if self.default_factory is not None:
            return field(default_factory=self.default_factory, repr=self.repr, metadata=meta)
        if self.default is REQUIRED:
            return field(repr=self.repr, metadata=meta)
        return field(default=self.default, repr=self.repr, metadata=meta)


def setting(default: Any = REQUIRED, **meta: Any) -> Any:
    """A dataclass field that is a setting of this class alone (see :class:`Setting` for ``meta``)."""
    return Setting(default=default, **meta).field()


@dataclass(frozen=True)
class Spec:
    """One setting as a config class has it: its field's name, declaration, type and default."""

    name: str
    setting: Setting
    type: Any  # the annotation without Optional
    optional: bool
    required: bool
    default: Any

    @property
    def flags(self) -> list[str]:
        return [self.setting.flag or "--" + self.name.replace("_", "-"), *self.setting.aliases]


def specs(cls: type) -> dict[str, Spec]:
    """The settings of config class ``cls`` by field name, in declaration order."""
    cached = cls.__dict__.get("_tilert_specs")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out: dict[str, Spec] = {}
    for f in fields(cls):
        meta = f.metadata.get(_META_KEY)
        if meta is None:
            continue
        typ, optional = _unwrap_optional(hints[f.name])
        default: Any = f.default
        factory: Any = f.default_factory
        if default is MISSING and factory is not MISSING:
            default = factory()
        out[f.name] = Spec(f.name, meta, typ, optional, default is MISSING, default)
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
    env = specs(cls)[name].setting.env
    if env is False:
        return None
    return env if isinstance(env, str) else cls.ENV_PREFIX + name.upper()  # type: ignore[attr-defined]


def describe(cls: type, name: str) -> str:
    """``name (--flag, $ENV)``: how a setting is called in every mode, for error messages."""
    spec = specs(cls).get(name)
    if spec is None:
        return name
    ways = [spec.flags[0]] if spec.setting.cli else []
    var = env_var(cls, name)
    if var:
        ways.append("$" + var)
    return f"{name} ({', '.join(ways)})" if ways else name


# ---------------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(spec: Spec, value: Any, source: str) -> Any:
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


# ---------------------------------------------------------------------------------------------------
# Sources: flags, environment, TOML
# ---------------------------------------------------------------------------------------------------


class _SecretFlag(argparse.Action):
    """A flag that would put a secret on the command line (``ps`` shows it to every user): refused."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        self.advice = str(kwargs.pop("advice"))
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: object, values: object, option: str | None = None
    ) -> None:
        parser.error(f"{option} is not accepted: secrets never go on a command line; {self.advice}")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per setting of ``cls`` (help from the declaration, its environment variable and default); the
    settings without a flag are listed with their variables in the epilog; flags that would carry a secret are
    refused."""
    env_only: list[str] = []
    for spec in specs(cls).values():
        s = spec.setting
        var = env_var(cls, spec.name)
        if not s.cli:
            if var:
                env_only.append(f"{var}: {s.help}")
            continue
        notes = []
        if var:
            notes.append(f"env {var}" + (f", else {s.secret_env}" if s.secret_env else ""))
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
        if s.secret_flag:
            ways = [
                f"{spec.flags[0]} {kwargs.get('metavar', '')}".strip(),
                *(f"${v}" for v in (var, s.secret_env) if v),
            ]
            parser.add_argument(s.secret_flag, action=_SecretFlag, advice=f"use {', '.join(ways[:-1])} or {ways[-1]}")
    if env_only:
        listed = "; ".join(env_only)
        parser.epilog = f"{parser.epilog}\n" if parser.epilog else ""
        parser.epilog += f"Environment only (never a flag): {listed}."


def _metavar(spec: Spec) -> str:
    if spec.type is int:
        return "N"
    if spec.type is float:
        return "SECONDS" if spec.name.endswith("_s") else "X"
    return spec.name.rsplit("_", 1)[-1].upper()


def cli_values(cls: type, namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags (those left out are absent), converted; errors name the flag."""
    out: dict[str, Any] = {}
    for spec in specs(cls).values():
        if spec.setting.cli and hasattr(namespace, spec.name):
            out[spec.name] = _convert(spec, getattr(namespace, spec.name), spec.flags[0])
    _check_groups(cls, out, lambda name: specs(cls)[name].flags[0])
    return out


def env_values(cls: type, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings given as environment variables, converted; errors name the variable."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for spec in specs(cls).values():
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
    declared = specs(cls)
    keys: dict[str, str] = {}
    for spec in declared.values():
        keys[spec.name] = spec.name
        for alias in spec.setting.toml_aliases:
            keys[alias] = spec.name
    unknown = sorted(k for k in data if k not in keys)
    if unknown:
        raise ConfigError(f"unknown keys in {where}: {unknown}")
    out: dict[str, Any] = {}
    for key, value in data.items():
        spec = declared[keys[key]]
        if spec.setting.toml is not True:
            advice = spec.setting.toml if isinstance(spec.setting.toml, str) else "it is not read from the file"
            raise ConfigError(f"{key} does not belong in {where}: {advice}")
        if spec.name in out:  # a key and its alias both given: the first as written wins
            continue
        out[spec.name] = _convert(spec, value, f"{key} in {where}")
    _check_groups(cls, out, lambda name: f"{name} in {where}")
    return out


def _check_groups(cls: type, values: Mapping[str, Any], label: Callable[[str], str]) -> None:
    seen: dict[str, str] = {}
    for name in values:
        group = specs(cls)[name].setting.group
        if group is None:
            continue
        if group in seen:
            raise ConfigError(f"{label(seen[group])} and {label(name)} set the same thing: give only one")
        seen[group] = name


def merge_values(cls: type, layers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge layers given lowest precedence first; a setting of a group replaces the group's lower forms."""
    out: dict[str, Any] = {}
    declared = specs(cls)
    for layer in layers:
        for name, value in layer.items():
            group = declared[name].setting.group
            if group is not None:
                for other in [n for n in out if declared[n].setting.group == group]:
                    del out[other]
            out[name] = value
    return out


def build_config(cls: type, values: Mapping[str, Any], *, where: str = "", **internal: Any) -> Any:
    """``cls(**values, **internal)``, refusing a missing required setting with how to give it."""
    missing = [describe(cls, spec.name) for spec in specs(cls).values() if spec.required and spec.name not in values]
    if missing:
        raise ConfigError(f"{'; '.join(missing)} {'is' if len(missing) == 1 else 'are'} required{where}")
    try:
        return cls(**values, **internal)
    except TypeError as exc:  # pragma: no cover - the layers only hold known fields
        raise ConfigError(f"invalid {cls.__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------------
# Checks several config classes share
# ---------------------------------------------------------------------------------------------------


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_port(value: Any, what: str) -> int:
    """``value`` as a TCP port (1..65535); :class:`ConfigError` naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer port, got {value!r}")
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be an integer port, got {value!r}") from None
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what} must be in 1..65535, got {port}")
    return port


_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def is_wildcard(host: str) -> bool:
    """Whether ``host`` binds every interface (``0.0.0.0``, ``::``): an address to listen on, not to dial."""
    return host.strip("[]") in WILDCARDS


def host_problem(value: Any, what: str, *, wildcard: bool) -> str | None:
    """Why ``value`` is no IP address or host name (``None`` when it is one); ``wildcard=False`` also refuses
    ``0.0.0.0`` / ``::``, which peers cannot dial (an address others are told about)."""
    if not isinstance(value, str) or not value:
        return f"{what} must be an IP address or a host name, got {value!r}"
    if is_wildcard(value):
        if wildcard:
            return None
        return f"{what} is an address peers dial: {value} (every interface) names none; give this host's address"
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    if _HOSTNAME_RE.match(value) and not value.replace(".", "").isdigit():
        return None
    return f"{what} must be an IP address or a host name, got {value!r}"


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


# ---------------------------------------------------------------------------------------------------
# The deployment's shared secret (tilert.auth)
# ---------------------------------------------------------------------------------------------------

SECRET_FILE = Setting(
    default=None,
    env=SECRET_FILE_ENV,
    metavar="PATH",
    secret_flag="--secret",
    secret_env=SECRET_ENV,
    help="file holding the deployment's shared secret, the one the router, the prefill's connector and the decode "
    "nodes share",
)


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
