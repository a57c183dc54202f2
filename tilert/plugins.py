"""Plugin lookup through Python entry points.

Built-in transports and engines are registered in ``pyproject.toml`` under the ``tilert.transports``
and ``tilert.engines`` groups and found here exactly as a third-party package's would be.

A group whose plugins come in several kinds (``tilert.engines``: see :mod:`tilert.engines.plugin`) has each
plugin class declare its kind as the class attribute ``kind``; :func:`load` reads it and refuses a plugin of
another kind, of no kind or of a kind the group does not know, saying what is there.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tilert.transports.base import Transport


class PluginError(LookupError):
    """No plugin of that name in the group, or one of another kind; the message says what is there."""


TRANSPORTS_GROUP = "tilert.transports"
ENGINES_GROUP = "tilert.engines"


def available(group: str) -> list[str]:
    """The names registered in ``group`` (nothing is imported)."""
    return sorted(ep.name for ep in entry_points(group=group))


def _load_class(group: str, name: str) -> type[Any]:
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        raise PluginError(f"no plugin {name!r} in {group}; installed: {', '.join(available(group)) or 'none'}")
    try:
        cls = matches[0].load()
    except Exception as exc:  # noqa: BLE001 - a plugin that cannot be imported is refused with the reason
        raise PluginError(f"plugin {name!r} of {group} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not isinstance(cls, type):
        raise PluginError(f"plugin {name!r} of {group} is not a class ({matches[0].value})")
    return cls


def declared_kind(group: str, name: str, cls: type, kinds: Mapping[str, str]) -> str:
    """The kind ``cls`` declares (its ``kind`` class attribute), one of ``kinds``; else ``PluginError``."""
    kind = getattr(cls, "kind", None)
    if kind is None:
        raise PluginError(
            f"plugin {name!r} of {group} declares no kind (class attribute 'kind': one of {', '.join(kinds)})"
        )
    if kind not in kinds:
        raise PluginError(f"plugin {name!r} of {group} declares the unknown kind {kind!r} (known: {', '.join(kinds)})")
    return str(kind)


def load(group: str, name: str, kind: str, kinds: Mapping[str, str]) -> type[Any]:
    """The class of plugin ``name`` in ``group``, which must declare ``kind``.

    ``kinds`` maps each kind the group knows to what it is (for the messages). A plugin of another kind is
    refused with what it is and which plugins of ``kind`` are installed.
    """
    cls = _load_class(group, name)
    got = declared_kind(group, name, cls, kinds)
    if got != kind:
        raise PluginError(
            f"plugin {name!r} of {group} is a {got!r} plugin, {kinds[got]}, not a {kind!r} plugin, {kinds[kind]}; "
            f"{kind!r} plugins: {', '.join(names_of_kind(group, kind, kinds)) or 'none'}"
        )
    return cls


def names_of_kind(group: str, kind: str, kinds: Mapping[str, str]) -> list[str]:
    """The plugins of ``group`` that declare ``kind`` (each plugin's class is loaded to read it; one that
    cannot be loaded or declares no known kind is left out, without failing the others)."""
    names = []
    for name in available(group):
        try:
            if declared_kind(group, name, _load_class(group, name), kinds) == kind:
                names.append(name)
        except PluginError:
            continue
    return names


def load_transport(name: str) -> type[Transport]:
    return _load_class(TRANSPORTS_GROUP, name)
