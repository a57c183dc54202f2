"""Plugin lookup through Python entry points.

Built-in transports and engines are registered in ``pyproject.toml`` under the ``tilert.transports``
and ``tilert.engines`` groups and found here exactly as a third-party package's would be.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tilert.engines.base import DecodeEngine
    from tilert.engines.vllm import VllmNativePool
    from tilert.transports.base import Transport

class PluginError(LookupError):
    """No plugin of that name in the group, or one of another kind; the message says what is there."""


TRANSPORTS_GROUP = "tilert.transports"
ENGINES_GROUP = "tilert.engines"


def available(group: str) -> list[str]:
    return sorted(ep.name for ep in entry_points(group=group))


def _load(group: str, name: str) -> type:
    matches = [ep for ep in entry_points(group=group) if ep.name == name]
    if not matches:
        raise PluginError(f"no plugin {name!r} in {group}; installed: {', '.join(available(group)) or 'none'}")
    return matches[0].load()


def load_transport(name: str) -> type[Transport]:
    return _load(TRANSPORTS_GROUP, name)


def load_engine(name: str) -> type[DecodeEngine]:
    """A decode engine our decode node runs; a native pool (plugin ``vllm``) is refused with the reason."""
    from tilert.engines.base import DecodeEngine

    cls = _load(ENGINES_GROUP, name)
    if not (isinstance(cls, type) and issubclass(cls, DecodeEngine)):
        raise PluginError(
            f"engine {name!r} is a native decode pool (stock vLLM decode instances), not an engine the decode "
            f"node runs: start it with `tilert up --native`; decode-node engines: {', '.join(_engine_names())}"
        )
    return cls


def load_native_pool(name: str) -> type[VllmNativePool]:
    """A native decode pool plugin (``vllm``): what the stack starts and the router's native leg speaks."""
    from tilert.engines.vllm import VllmNativePool

    cls = _load(ENGINES_GROUP, name)
    if not (isinstance(cls, type) and issubclass(cls, VllmNativePool)):
        raise PluginError(f"engine {name!r} is not a native decode pool plugin (such as 'vllm')")
    return cls


def _engine_names() -> list[str]:
    from tilert.engines.base import DecodeEngine

    names = []
    for ep in entry_points(group=ENGINES_GROUP):
        try:
            cls = ep.load()
        except Exception:  # noqa: BLE001 - a broken plugin is not listed
            continue
        if isinstance(cls, type) and issubclass(cls, DecodeEngine):
            names.append(ep.name)
    return sorted(names)
