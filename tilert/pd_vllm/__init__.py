"""The published TileRT x vLLM entry points (``decode_server``, ``pd_router``, ``prefill_connector``), as thin
aliases of tilert's own commands; the translation lives in :mod:`tilert.pd_vllm.aliases`."""
