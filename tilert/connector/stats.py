"""The staging pool's state on vLLM's own ``/metrics``, through vLLM's KV-connector stats channel.

After every step vLLM's scheduler asks the connector for ``get_kv_connector_stats()``; the scheduler half
answers with a snapshot of the pool it accounts (:class:`TileRTConnectorStats`: capacity, bytes held,
transfers holding an extent). vLLM ships it to the API server process, where :class:`TileRTPromMetrics`
(built by the connector's ``build_prom_metrics``) sets three gauges::

    tilert:staging_pool_capacity_bytes   the pool's size
    tilert:staging_pool_used_bytes       bytes held by transfers in flight (0 when the pool is whole)
    tilert:staging_transfers_in_flight   transfers holding an extent

The snapshot is never "empty" (vLLM drops empty stats), so the step that frees the last extent also
publishes the whole pool; the connector keeps vLLM stepping while extents are out
(``has_pending_push_work``), so that step always comes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from prometheus_client import Gauge
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

GAUGES = {
    "capacity_bytes": ("tilert:staging_pool_capacity_bytes", "Size of the TileRT connector's KV staging pool."),
    "used_bytes": ("tilert:staging_pool_used_bytes", "Bytes of the KV staging pool held by transfers in flight."),
    "in_flight": ("tilert:staging_transfers_in_flight", "KV transfers holding an extent of the staging pool."),
}


class TileRTConnectorStats(KVConnectorStats):
    """A snapshot of the staging pool (``data`` keys: those of :data:`GAUGES`); gauges: the latest wins."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.data:
            self.data = dict(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if key in GAUGES}

    def is_empty(self) -> bool:
        return not self.data


class TileRTPromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        gauge_cls = cast(type[Gauge], self._gauge_cls)  # vLLM's multiprocess-aware Gauge class
        self._gauges: dict[str, dict[int, Gauge]] = {}
        for key, (name, doc) in GAUGES.items():
            gauge = gauge_cls(name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent")
            self._gauges[key] = cast(dict[int, Gauge], create_metric_per_engine(gauge, per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._gauges.get(key)
            if per_engine is not None and engine_idx in per_engine:
                per_engine[engine_idx].set(value)
