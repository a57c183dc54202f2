"""Process-wide router state built in the app's lifespan: config, upstream clients, pools, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import aiohttp
import anyio
import structlog
from anyio.abc import TaskStatus

from tilert.engines.plugin import NativePool, load_native_pool
from tilert.models.checkpoint import sampling_defaults
from tilert.plugins import PluginError
from tilert.router.config import RouterConfig
from tilert.router.detokenize import TokenizerBundle, load_tokenizer
from tilert.router.metrics import RouterMetrics
from tilert.router.node_client import NodeClient
from tilert.router.pool import DecodePool, PooledNode, ProbeTimeouts
from tilert.router.prefill import prefill_client, vllm_session
from tilert.router.prefill_pool import PrefillPool
from tilert.router.tools import Parsers, load_parsers
from tilert.router.watch import NodeWatch

log = structlog.get_logger("tilert.router")


async def _model_files(config: RouterConfig) -> tuple[TokenizerBundle, Parsers | None]:
    """The model's tokenizer, and vLLM's parsers of the router's flags; a start-up refusal saying why not."""
    try:
        tokenizer = await anyio.to_thread.run_sync(load_tokenizer, config.model_dir)
    except Exception as exc:  # noqa: BLE001 - refuse start-up with the reason
        raise RuntimeError(f"router cannot load the tokenizer from model_dir {config.model_dir!r}: {exc}") from exc
    try:
        parsers = await anyio.to_thread.run_sync(load_parsers, config)
    except Exception as exc:  # noqa: BLE001 - vLLM refuses the parsers for this model: refuse start-up with why
        raise RuntimeError(f"the router's parsers: {exc}") from exc
    return tokenizer, parsers


@dataclass
class RouterContext:
    config: RouterConfig
    metrics: RouterMetrics
    pool: DecodePool
    prefills: PrefillPool  # every call to a prefill vLLM goes through it
    nodes: dict[str, NodeClient]
    watches: dict[str, NodeWatch]
    tokenizer: TokenizerBundle
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the checkpoint's generation_config.json
    started_at: int = field(default_factory=lambda: int(time.time()))
    # The native decode pool (config.native_url): a stock vLLM decode instance, and the plugin that speaks to it.
    native: aiohttp.ClientSession | None = None
    native_plugin: type[NativePool] | None = None
    native_healthy: bool = False
    native_probe_timeouts: ProbeTimeouts = field(default_factory=ProbeTimeouts)
    parsers: Parsers | None = None  # vLLM's tool / reasoning parser of the router's flags (tilert.router.tools)

    @classmethod
    async def start(cls, config: RouterConfig, metrics: RouterMetrics) -> RouterContext:
        config.validate()
        tokenizer, parsers = await _model_files(config)
        prefills = _prefill_pool(config, metrics)
        nodes = {
            spec.name: NodeClient(
                spec, config.connect_timeout_s, config.control_timeout_s, config.secret, config.lease_s
            )
            for spec in config.decode_nodes
        }
        pool = DecodePool(
            config.decode_nodes, max_queue=config.max_queue, retry_after_s=config.retry_after_s, metrics=metrics
        )
        watches = {name: NodeWatch() for name in nodes}
        ctx = cls(
            config=config,
            metrics=metrics,
            pool=pool,
            prefills=prefills,
            nodes=nodes,
            watches=watches,
            tokenizer=tokenizer,
            sampling_defaults=sampling_defaults(config.model_dir),
            parsers=parsers,
        )
        if config.native_url:
            try:
                ctx.native_plugin = load_native_pool(config.native_engine)
            except PluginError as exc:
                await ctx.aclose()
                raise RuntimeError(f"native_engine: {exc}") from exc
            # No total timeout: a native decode streams as long as it needs; reads are bounded per event.
            ctx.native = vllm_session(
                config.native_url,
                aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s),
                config.prefill_api_key,
            )
        return ctx

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The router's background work, for its life: a watch on every decode node (``router.watch``), the
        first health check (``task_status.started()`` after it: the router serves from then on), then the
        periodic one."""
        config = self.config
        async with anyio.create_task_group() as tg:
            for node in self.pool.nodes:
                tg.start_soon(
                    self.watches[node.name].run,
                    self.node_client(node),
                    config.node_silence_s,
                    config.health_interval_s,
                    partial(self._lost, node),
                )
            tg.start_soon(self.prefills.run, config.health_timeout_s)
            await self.check_nodes()
            await self.check_native()
            log.info(
                "router_started",
                prefill=config.prefill_urls,
                prefill_policy=config.prefill_policy,
                decode=[n.name for n in self.pool.nodes],
                healthy=[n.name for n in self.pool.nodes if n.healthy],
                model=config.model_name,
                native=config.native_url,
                native_healthy=self.native_healthy if config.native_url else None,
                default_pool=config.default_pool,
                overflow_wait_s=config.overflow_wait_s,
            )
            task_status.started()
            await self.health_loop()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.prefills.aclose()
            if self.native is not None:
                await self.native.close()
            for client in self.nodes.values():
                await client.aclose()

    def _lost(self, node: PooledNode, reason: str) -> None:
        self.pool.mark_unhealthy(node, f"lost: {reason}")

    def node_client(self, node: PooledNode) -> NodeClient:
        return self.nodes[node.name]

    async def check_nodes(self) -> list[dict[str, Any]]:
        """Probe every decode node's /health at once and feed the results to the pool."""
        results: dict[str, dict[str, Any]] = {}

        async def probe(node: PooledNode) -> None:
            health = await self.node_client(node).health(self.config.health_timeout_s)
            watch = self.watches[node.name]
            if health.ok and not await watch.opened(self.config.health_timeout_s):  # admitted only while watched
                health = replace(health, ok=False, error=f"its watch stream is not open: {watch.reason}")
            self.pool.update_health(
                node,
                health.ok,
                slots_total=health.slots_total,
                slots_free=health.slots_free,
                error=health.error,
                max_choices=health.max_choices,
                timed_out=health.timed_out,
            )
            results[node.name] = {
                "node": node.name,
                "ok": health.ok,
                "slots_total": health.slots_total,
                "slots_free": health.slots_free,
                "router_in_use": node.in_use,
                "error": health.error,
            }

        async with anyio.create_task_group() as tg:
            for node in self.pool.nodes:
                tg.start_soon(probe, node)
        return [results[n.name] for n in self.pool.nodes]

    async def check_prefill(self) -> list[dict[str, Any]]:
        """Every prefill instance's /health and circuit breaker state."""
        return await self.prefills.check(self.config.health_timeout_s)

    async def check_native(self) -> dict[str, Any] | None:
        """Probe the native decode instance (None: no native pool); routing reads ``native_healthy``."""
        if self.native is None:
            return None
        result = await self._probe(self.native, self.config.native_url or "")
        if self.native_probe_timeouts.ignore(result["ok"], result.pop("timed_out"), self.native_healthy):
            log.info("native_pool_probe_timed_out", in_a_row=self.native_probe_timeouts.in_a_row)
            return result  # still counted healthy (native_healthy) until the next one times out too
        if result["ok"] != self.native_healthy:
            (log.info if result["ok"] else log.warning)("native_pool_health", ok=result["ok"], error=result["error"])
        self.native_healthy = bool(result["ok"])
        return result

    async def _probe(self, session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with session.get("/health", timeout=timeout) as resp:
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            return {"url": url, "ok": False, "error": error, "timed_out": isinstance(exc, TimeoutError)}
        ok = status == 200
        return {"url": url, "ok": ok, "error": None if ok else f"HTTP {status}", "timed_out": False}

    async def health_loop(self) -> None:
        while True:
            await anyio.sleep(self.config.health_interval_s)
            try:
                await self.check_nodes()
                await self.check_native()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health_loop_error")


def _prefill_pool(config: RouterConfig, metrics: RouterMetrics) -> PrefillPool:
    """The router's prefill instances, each with its clients (:func:`~tilert.router.prefill.prefill_client`)."""
    client = partial(
        prefill_client,
        timeout_s=config.prefill_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        api_key=config.prefill_api_key,
    )
    return PrefillPool(
        config.prefill_urls,
        client,
        metrics,
        policy=config.prefill_policy,
        prefix_chars=config.prefill_prefix_chars,
        slack=config.prefill_prefix_slack,
        failures_to_open=config.prefill_breaker_failures,
        open_s=config.prefill_breaker_open_s,
        retry_after_s=config.retry_after_s,
    )
