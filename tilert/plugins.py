"""Plugin lookup through Python entry points.

Built-in transports and engines are registered in ``pyproject.toml`` under the ``tilert.transports``
and ``tilert.engines`` groups and found here exactly as a third-party package's would be.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tilert.engines.base import DecodeEngine
    from tilert.transports.base import Transport

TRANSPORTS_GROUP = "tilert.transports"
ENGINES_GROUP = "tilert.engines"


def available(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=group))


def _load(group: str, name: str) -> type:
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        raise LookupError(f"no plugin {name!r} in {group}; installed: {', '.join(available(group)) or 'none'}")
    return matches[0].load()


def load_transport(name: str) -> type[Transport]:
    return _load(TRANSPORTS_GROUP, name)


def load_engine(name: str) -> type[DecodeEngine]:
    return _load(ENGINES_GROUP, name)
