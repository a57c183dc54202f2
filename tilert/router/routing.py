"""Which decode pool serves a request: the routing policy of the router's config, in one place.

In order: the request's ``x-tilert-pool`` header (``tilert`` or ``vllm``), then its model name
(``pool_models``), then ``default_pool``. A header naming an unknown pool, or the native pool on a router
that has none, is refused with a 400 that says what is available.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tilert.router.config import NATIVE_POOL, POOLS, TILERT_POOL, RouterConfig
from tilert.router.errors import bad_request

POOL_HEADER = "x-tilert-pool"

Reason = Literal["header", "model", "default"]


@dataclass(frozen=True)
class PoolChoice:
    pool: str  # TILERT_POOL or NATIVE_POOL
    reason: Reason
    overflow: bool  # a TileRT-pool request that may go native when no slot frees within overflow_wait_s

    @property
    def native(self) -> bool:
        return self.pool == NATIVE_POOL


def choose_pool(config: RouterConfig, header: str | None, model: object) -> PoolChoice:
    reason: Reason
    if header is not None:
        pool, reason = header.strip().lower(), "header"
        if pool not in POOLS:
            raise bad_request(f"{POOL_HEADER} must be one of {', '.join(POOLS)}, got {header[:64]!r}")
        if pool == NATIVE_POOL and not config.has_native_pool:
            raise bad_request(
                f"{POOL_HEADER}: {NATIVE_POOL!r}: this router has no native decode pool (pools: {TILERT_POOL})"
            )
    elif isinstance(model, str) and model in config.pool_models:
        pool, reason = config.pool_models[model], "model"
    else:
        pool, reason = config.default_pool, "default"
    overflow = pool == TILERT_POOL and config.overflow_wait_s is not None and config.has_native_pool
    return PoolChoice(pool, reason, overflow)


__all__ = ["POOL_HEADER", "PoolChoice", "choose_pool"]
