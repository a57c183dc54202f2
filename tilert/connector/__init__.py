"""The vLLM side of tilert: ``TileRTConnector``, loaded by vLLM through ``kv_connector_module_path``."""

from tilert.connector.connector import TileRTConnector

__all__ = ["TileRTConnector"]
