"""Which decode pool serves a request: the routing policy of the router's config, in one place.

In order: the request's ``x-tilert-pool`` header (``tilert`` or ``vllm``), then its model name
(``pool_models``), then ``default_pool``. A header naming an unknown pool, or the native pool on a router
that has none, is refused with a 400 that says what is available. A request the TileRT pool cannot serve (a
field only vLLM decodes) goes to the native pool unless the header asked for the TileRT pool; the response's
``x-tilert-pool-reason`` then says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tilert.router.config import NATIVE_POOL, POOLS, TILERT_POOL, RouterConfig
from tilert.router.errors import RouterError, bad_request

POOL_HEADER = "x-tilert-pool"

Reason = Literal["header", "model", "default", "unsupported"]
REASON_HEADER = "x-tilert-pool-reason"


@dataclass(frozen=True)
class PoolChoice:
    pool: str  # TILERT_POOL or NATIVE_POOL
    reason: Reason
    overflow: bool  # a TileRT-pool request that may go native when no slot frees within overflow_wait_s
    why: str | None = None  # for "unsupported": what the TileRT pool cannot serve (the response's reason header)

    @property
    def native(self) -> bool:
        return self.pool == NATIVE_POOL


def choose_pool(
    config: RouterConfig, header: str | None, model: object, refusal: RouterError | None = None
) -> PoolChoice:
    """``refusal``: why the TileRT pool cannot serve the request (None: it can); such a request goes to the
    native pool when the router has one and ``unsupported_to_native``, else the refusal is raised."""
    choice = _by_policy(config, header, model)
    if refusal is None or choice.native:
        return choice
    if choice.reason == "header" or not (config.unsupported_to_native and config.has_native_pool):
        raise refusal
    return PoolChoice(NATIVE_POOL, "unsupported", False, refusal.message)


def _by_policy(config: RouterConfig, header: str | None, model: object) -> PoolChoice:
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


__all__ = ["POOL_HEADER", "REASON_HEADER", "PoolChoice", "choose_pool"]
