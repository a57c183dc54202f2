"""``"kv_connector_module_path": "tilert.pd_vllm.prefill_connector"``: the published module path of the prefill
connector. ``TileRTConnector`` here is :class:`tilert.connector.TileRTConnector` that first checks the published
``kv_connector_extra_config`` keys (``tilert_host``, ``tilert_ctrl_port``, ``tilert_model``,
``tilert_max_seq_len``; :func:`tilert.pd_vllm.aliases.check_connector_extra`); any other key is one of the
connector's own settings (:class:`tilert.contracts.ConnectorSettings`), an unknown one stops vLLM's start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog

from tilert.connector import TileRTConnector as _TileRTConnector
from tilert.contracts import ConnectorSettings
from tilert.pd_vllm.aliases import check_connector_extra, connector_extra

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = structlog.get_logger("tilert.pd_vllm.prefill_connector")

__all__ = ["TileRTConnector"]


class TileRTConnector(_TileRTConnector):
    def __init__(self, vllm_config: VllmConfig, role: Any, kv_cache_config: Any = None) -> None:
        cfg = vllm_config.kv_transfer_config
        extra = dict((cfg.kv_connector_extra_config if cfg is not None else None) or {})
        model = vllm_config.model_config
        for warning in check_connector_extra(extra, str(model.hf_config.model_type), int(model.max_model_len)):
            log.warning("published_extra_config", detail=warning)
        super().__init__(vllm_config, role, kv_cache_config)

    @classmethod
    def settings(cls, extra: dict[str, Any]) -> ConnectorSettings:
        """The connector's own settings: the published keys (checked above) set none of them."""
        return super().settings(connector_extra(extra))
