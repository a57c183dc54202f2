"""``TileRTConnector``: a pure-producer ``KVConnectorBase_V1`` for unmodified vLLM.

Load it with::

    --kv-transfer-config '{"kv_connector": "TileRTConnector",
                           "kv_connector_module_path": "tilert.connector",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"tilert_transport": "tcp"}}'

Settings in ``kv_connector_extra_config``: :class:`tilert.contracts.ConnectorSettings` (``tilert_transport``,
``tilert_staging_bytes``, ...); an unknown key or a wrong value stops vLLM's start-up with the reason.

It claims only requests whose ``kv_transfer_params`` carry a ``tilert_*`` claim signed with the
deployment's shared secret (read from ``$TILERT_SECRET_FILE`` / ``$TILERT_SECRET``, or the file named by
``tilert_secret_file`` in ``kv_connector_extra_config``; without one it refuses to start) and is a strict
no-op for every other request; it never changes scheduling or sampling. vLLM builds one instance per role;
this class only dispatches to the half for its role (``scheduler.py`` / ``worker.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from tilert.auth import load_secret
from tilert.connector.claims import TileRTConnectorMetadata, TileRTWorkerMeta
from tilert.connector.scheduler import SchedulerSide
from tilert.connector.sender import BackgroundSender
from tilert.connector.staging import bytes_per_token, pool_bytes
from tilert.connector.stats import TileRTConnectorStats, TileRTPromMetrics
from tilert.connector.worker import WorkerSide
from tilert.contracts import ConnectorSettings
from tilert.logs import configure_embedded

log = structlog.get_logger("tilert.connector")

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class TileRTConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # None from older callers
        configure_embedded()  # tilert's log settings from the environment; vLLM's own logging untouched
        cfg = self._kv_transfer_config
        if not cfg.is_kv_producer or cfg.is_kv_consumer:
            raise ValueError('TileRTConnector is a pure producer: set "kv_role": "kv_producer"')
        settings = self.settings(dict(cfg.kv_connector_extra_config or {}))
        secret = load_secret(settings.secret_file)  # refuses start-up when none is configured
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        max_model_len = int(vllm_config.model_config.max_model_len)
        staging_bytes = settings.staging_bytes
        # One figure on both sides, from the same config: the worker checks its cache tensors against it.
        per_token = bytes_per_token(kv_cache_config) if kv_cache_config is not None else None
        if role == KVConnectorRole.SCHEDULER:
            if per_token is None:
                raise ValueError("TileRTConnector needs vLLM's kv_cache_config to account its staging pool")
            self._scheduler = SchedulerSide(
                _block_size(vllm_config, kv_cache_config),
                secret,
                bytes_per_token=per_token,
                pool_bytes=pool_bytes(staging_bytes, per_token, max_model_len),
                workers=int(vllm_config.parallel_config.world_size),
                retry_after_s=settings.busy_retry_after_s,
            )
        else:
            sender = BackgroundSender(
                settings.transport,
                dict(settings.transport_options),
                secret,
                timeout_s=settings.timeout_s,
                workers=settings.sender_threads,
            )
            self._worker = WorkerSide(
                vllm_config.model_config.hf_config,
                sender,
                staging_bytes=staging_bytes,
                max_model_len=max_model_len,
                expected_bytes_per_token=per_token,
                staging_device=settings.staging_device,
                poll_wait_s=settings.poll_wait_s,
                stage_batch_bytes=settings.stage_batch_bytes,
            )
            _warn_cpu_rope(vllm_config)

    @classmethod
    def settings(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """Our settings from ``kv_connector_extra_config`` (``ContractError`` stops vLLM's start-up)."""
        return ConnectorSettings.from_extra(extra)

    # ---- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Layouts detected, staging pool allocated and registered: any failure here stops vLLM's start."""
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # a producer loads nothing

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, TileRTConnectorMetadata) and meta.saves:
            self._worker.save_layer(meta, layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            self._worker.flush(meta if isinstance(meta, TileRTConnectorMetadata) else None)

    def build_connector_worker_meta(self) -> TileRTWorkerMeta | None:
        """Staging extents the sender is done with, for the scheduler (vLLM calls this after every step,
        empty ones included, and hands the result to ``update_connector_output`` in the EngineCore)."""
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TileRTConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.request_finished(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update(connector_output)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler half's snapshot of the staging pool, after every step (vLLM's ``/metrics``)."""
        return TileRTConnectorStats(self._scheduler.pool_snapshot()) if self._scheduler is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TileRTConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """The staging pool's gauges on vLLM's ``/metrics`` (see :mod:`tilert.connector.stats`)."""
        return TileRTPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def has_pending_push_work(self) -> bool:
        """True while staging extents are out: vLLM keeps stepping (empty steps) so that the workers'
        reports of freed extents come back even when no new request arrives."""
        return self._scheduler is not None and self._scheduler.has_pending_work()


def _warn_cpu_rope(vllm_config: VllmConfig) -> None:
    """vLLM 0.32's CPU rotary kernel mis-rotates MLA's strided q_pe/k_pe (keys come out unrotated), so the
    handed-off KV would not be the model's; its PyTorch-native RoPE is exact. Say so at start-up."""
    device = getattr(vllm_config.device_config, "device_type", None)
    custom_ops = list(vllm_config.compilation_config.custom_ops or [])
    if device == "cpu" and "-rotary_embedding" not in custom_ops:
        log.warning(
            "cpu_rotary_kernel_inexact",
            remedy="""start vLLM with --compilation-config '{"custom_ops": ["-rotary_embedding"]}'""",
        )


def _block_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> int:
    if kv_cache_config is not None and kv_cache_config.kv_cache_groups:
        return int(kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)


def register_with_vllm() -> None:
    """Put ``TileRTConnector`` in vLLM's connector registry (``KVConnectorFactory.register_connector``, public).

    vLLM loads it by ``kv_connector_module_path`` without that, but under ``MultiConnector`` the API server
    rebuilds each sub-connector's stats by looking its class up *by name* in the registry, and a class missing
    there fails vLLM's output handler (every request then gets a 500). Runs when this module is imported, which
    vLLM does in every process that loads the connector or its metrics; a second call does nothing."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(TileRTConnector.__name__, "tilert.connector", "TileRTConnector")
    except ValueError:  # already registered
        pass


register_with_vllm()
