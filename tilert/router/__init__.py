"""OpenAI-compatible router in front of vLLM prefill and the TileRT decode pool.

``uvicorn tilert.router:app`` reads its TOML config from ``$TILERT_ROUTER_CONFIG`` at start-up;
``build_app(RouterConfig(...))`` builds one from arguments (the ``tilert router`` CLI does that).
"""

from tilert.router.app import build_app
from tilert.router.config import ConfigError, DecodeNodeSpec, RouterConfig, load_config, parse_decode_spec

app = build_app()

__all__ = ["ConfigError", "DecodeNodeSpec", "RouterConfig", "app", "build_app", "load_config", "parse_decode_spec"]
