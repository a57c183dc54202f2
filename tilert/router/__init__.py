"""OpenAI-compatible router in front of vLLM prefill and the TileRT decode pool.

``uvicorn tilert.router:app`` reads its config at start-up from the ``TILERT_ROUTER_*`` environment
variables over the TOML file named by ``$TILERT_ROUTER_CONFIG`` (see :mod:`tilert.router.config`);
``build_app(RouterConfig(...))`` builds one from arguments (the ``tilert router`` CLI does that).

``app`` and ``build_app`` are resolved on first access, so importing the config (the CLI, ``tilert up``)
neither builds the Starlette app nor imports its dependencies. ``tilert.router.app``
always names the ASGI app, even once the submodule of the same name is loaded (the import system's
binding of the submodule to the package is ignored; the submodule stays in ``sys.modules``).
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from tilert.logs import configure
from tilert.router.config import (
    ConfigError,
    DecodeNodeSpec,
    RouterConfig,
    load_config,
    load_config_from_env,
    parse_decode_spec,
)

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from tilert.router.app import build_app

    app: Starlette


class _RouterPackage(types.ModuleType):
    @property
    def app(self) -> Any:
        """The app as ``uvicorn tilert.router:app`` loads it: its config read and checked now, with this process's
        logs set up from it; a config it cannot start with ends the process with the reason (status 2)."""
        built = self.__dict__.get("_asgi_app")
        if built is None:
            from tilert.router.app import build_app  # lazy: the app is built when uvicorn asks for it

            try:
                config = load_config_from_env().validate()
            except ConfigError as exc:
                print(f"tilert router: {exc}", file=sys.stderr)
                raise SystemExit(2) from None
            configure(config.log_level, config.log_format)
            built = self.__dict__["_asgi_app"] = build_app(config, own_process=True)
        return built

    @app.setter
    def app(self, value: Any) -> None:
        if not isinstance(value, types.ModuleType):  # the import system binding the submodule: keep the app
            self.__dict__["_asgi_app"] = value


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from tilert.router.app import build_app  # lazy: the package imports without the app's dependencies

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _RouterPackage

__all__ = ["ConfigError", "DecodeNodeSpec", "RouterConfig", "app", "build_app", "load_config", "parse_decode_spec"]
