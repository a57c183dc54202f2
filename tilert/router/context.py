"""Process-wide router state built in the app's lifespan: config, upstream clients, pool, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import structlog

from tilert.router.config import RouterConfig
from tilert.router.detokenize import TokenizerBundle, load_tokenizer
from tilert.router.metrics import RouterMetrics
from tilert.router.node_client import NodeClient
from tilert.router.pool import DecodePool, PooledNode
from tilert.router.prefill import prefill_session

log = structlog.get_logger("tilert.router")


@dataclass
class RouterContext:
    config: RouterConfig
    metrics: RouterMetrics
    pool: DecodePool
    prefill: aiohttp.ClientSession
    nodes: dict[str, NodeClient]
    tokenizer: TokenizerBundle
    started_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    async def start(cls, config: RouterConfig, metrics: RouterMetrics) -> RouterContext:
        config.validate()
        try:
            tokenizer = await anyio.to_thread.run_sync(load_tokenizer, config.model_dir)
        except Exception as exc:  # noqa: BLE001 - refuse start-up with the reason
            raise RuntimeError(f"router cannot load the tokenizer from model_dir {config.model_dir!r}: {exc}") from exc
        prefill = prefill_session(config.prefill_url, config.prefill_timeout_s, config.connect_timeout_s)
        nodes = {
            spec.name: NodeClient(spec, config.connect_timeout_s, config.control_timeout_s, config.secret)
            for spec in config.decode_nodes
        }
        pool = DecodePool(
            config.decode_nodes, max_queue=config.max_queue, retry_after_s=config.retry_after_s, metrics=metrics
        )
        ctx = cls(config=config, metrics=metrics, pool=pool, prefill=prefill, nodes=nodes, tokenizer=tokenizer)
        await ctx.check_nodes()
        log.info(
            "router_started",
            prefill_url=config.prefill_url,
            decode=[n.name for n in pool.nodes],
            healthy=[n.name for n in pool.nodes if n.healthy],
            model=config.model_name,
        )
        return ctx

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.prefill.close()
            for client in self.nodes.values():
                await client.aclose()

    def node_client(self, node: PooledNode) -> NodeClient:
        return self.nodes[node.name]

    async def check_nodes(self) -> list[dict[str, Any]]:
        """Probe every decode node's /health at once and feed the results to the pool."""
        results: dict[str, dict[str, Any]] = {}

        async def probe(node: PooledNode) -> None:
            health = await self.node_client(node).health(self.config.health_timeout_s)
            self.pool.update_health(
                node, health.ok, slots_total=health.slots_total, slots_free=health.slots_free, error=health.error
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

    async def check_prefill(self) -> dict[str, Any]:
        url = self.config.prefill_url
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            async with self.prefill.get("/health", timeout=timeout) as resp:
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            return {"url": url, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"url": url, "ok": status == 200, "error": None if status == 200 else f"HTTP {status}"}

    async def health_loop(self) -> None:
        while True:
            await anyio.sleep(self.config.health_interval_s)
            try:
                await self.check_nodes()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health_loop_error")
