"""Worker half of the connector (lives in vLLM's worker process, one per TP rank).

Inside the forward window, as each attention layer finishes, the rows of every claimed request whose
prompt completes in this step are gathered out of the paged cache into that request's own staging
buffer (a per-request slot: two claimed requests never share one). After the forward the complete
stagings go to the background sender; the paged blocks can be recycled at once.

Cache layouts are detected from shape and dtype at registration and anything unknown is refused
there, at start-up, never guessed at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import torch

from tilert.connector.claims import SaveRequest, TileRTConnectorMetadata
from tilert.connector.sender import BackgroundSender
from tilert.contracts import KVLayout

log = structlog.get_logger("tilert.connector.worker")

FP8_DS_MLA_ROW = 656
INDEXER_SCALE_BYTES = 4  # one fp32 scale per token's fp8 key
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_DENSE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class _Layer:
    group: str  # "mla", "mla_mtp", "indexer", "indexer_mtp"
    position: int  # index within its group
    cache: torch.Tensor


def classify(
    name: str, cache: torch.Tensor, mla_width: int, index_head_dim: int, indexer_rope_interleaved: bool
) -> tuple[str, KVLayout]:
    """Name the vLLM layout of one layer's cache, or raise ``ValueError`` for one we do not know.

    vLLM always keeps MLA's rope pairs interleaved; the indexer's keys follow the model's
    ``indexer_rope_interleave`` (GLM-5: interleaved, DeepSeek-V3.2: half-split)."""
    if "indexer" in name:
        if cache.dtype != torch.uint8:
            raise ValueError(f"{name}: indexer cache of dtype {cache.dtype}, expected uint8")
        if not index_head_dim:
            raise ValueError(f"{name}: an indexer cache, but the model config has no index_head_dim")
        row = index_head_dim + INDEXER_SCALE_BYTES
        return "indexer", KVLayout("dsa_indexer", "float8_e4m3fn", row, 0, indexer_rope_interleaved)
    last = cache.shape[-1]
    if cache.dtype == torch.uint8 and last == FP8_DS_MLA_ROW:
        return "mla", KVLayout("fp8_ds_mla", "fp8_ds_mla", FP8_DS_MLA_ROW, 0)
    if cache.dtype in _DENSE_DTYPES and last == mla_width:
        return "mla", KVLayout("mla_dense", _DENSE_DTYPES[cache.dtype], mla_width * cache.element_size(), 0)
    raise ValueError(
        f"{name}: unsupported KV cache layout shape={tuple(cache.shape)} dtype={cache.dtype}; "
        f"TileRTConnector handles MLA caches of width {mla_width} (dense), fp8_ds_mla and DSA indexer caches"
    )


def gather_rows(kind: str, row_bytes: int, cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """The ``[T, row_bytes]`` uint8 rows of ``slots`` (block_id * block_size + offset) from one layer."""
    if kind == "dsa_indexer":
        # Block-major: per block, block_size fp8 keys of row_bytes-4 bytes, then block_size fp32 scales.
        key_bytes = row_bytes - INDEXER_SCALE_BYTES
        blocks = cache.reshape(cache.shape[0], -1)
        bs = blocks.shape[1] // row_bytes
        keys = blocks[:, : bs * key_bytes].reshape(-1, key_bytes)
        scales = blocks[:, bs * key_bytes :].reshape(-1, INDEXER_SCALE_BYTES)
        s = (slots // block_size) * bs + slots % block_size
        return torch.cat([keys.index_select(0, s), scales.index_select(0, s)], dim=1)
    rows = cache.reshape(-1, cache.shape[-1])
    if rows.shape[0] % block_size:
        raise ValueError(f"cache of {rows.shape[0]} rows is not a whole number of {block_size}-token blocks")
    return rows.index_select(0, slots).view(torch.uint8).reshape(slots.numel(), -1)


@dataclass
class _Staging:
    save: SaveRequest
    buffer: torch.Tensor
    views: dict[str, torch.Tensor]
    slots: torch.Tensor
    layers_done: set[str] = field(default_factory=set)


class WorkerSide:
    def __init__(self, hf_config: Any, sender: BackgroundSender) -> None:
        lora, rope = getattr(hf_config, "kv_lora_rank", None), getattr(hf_config, "qk_rope_head_dim", None)
        if not lora or not rope:
            raise ValueError("TileRTConnector needs an MLA model (config without kv_lora_rank/qk_rope_head_dim)")
        self._mla_width = int(lora) + int(rope)
        self._num_main_layers = int(hf_config.num_hidden_layers)
        self._index_head_dim = int(getattr(hf_config, "index_head_dim", 0) or 0)
        self._indexer_rope_interleaved = bool(getattr(hf_config, "indexer_rope_interleave", False))
        self._sender = sender
        self._layers: dict[str, _Layer] = {}
        self._layouts: dict[str, KVLayout] = {}
        self._staging: dict[str, _Staging] = {}

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
        kinds: dict[str, KVLayout] = {}
        for order, (name, cache) in enumerate(kv_caches.items()):
            group, layout = classify(
                name, cache, self._mla_width, self._index_head_dim, self._indexer_rope_interleaved
            )
            match = _LAYER_INDEX.search(name)
            index = int(match.group(1)) if match else order
            if index >= self._num_main_layers:
                group += "_mtp"
            if kinds.setdefault(group, layout) != layout:
                raise ValueError(f"{name}: layout {layout} differs from the rest of group {group}: {kinds[group]}")
            groups.setdefault(group, []).append((index, name, cache))
        for group, members in groups.items():
            members.sort()
            for position, (_, name, cache) in enumerate(members):
                self._layers[name] = _Layer(group, position, cache)
            base = kinds[group]
            self._layouts[group] = KVLayout(base.kind, base.dtype, base.row_bytes, len(members), base.rope_interleaved)
        log.info("kv_caches_registered", layouts={g: msgspec.to_builtins(lay) for g, lay in self._layouts.items()})

    def save_layer(self, meta: TileRTConnectorMetadata, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if layer is None or not meta.saves:
            return
        layout = self._layouts[layer.group]
        for save in meta.saves:
            staging = self._staging.get(save.req_id) or self._open(save, layer.cache.device)
            rows = gather_rows(layout.kind, layout.row_bytes, layer.cache, staging.slots, save.block_size)
            staging.views[layer.group][layer.position].copy_(rows, non_blocking=True)
            staging.layers_done.add(layer_name)

    def _open(self, save: SaveRequest, device: torch.device) -> _Staging:
        total = sum(lay.nbytes(save.num_tokens) for lay in self._layouts.values())
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        views, offset = {}, 0
        for group, lay in self._layouts.items():
            n = lay.nbytes(save.num_tokens)
            views[group] = buffer[offset : offset + n].view(lay.num_layers, save.num_tokens, lay.row_bytes)
            offset += n
        slots = torch.tensor(save.slot_ids(), dtype=torch.long, device=device)
        staging = _Staging(save, buffer, views, slots)
        self._staging[save.req_id] = staging
        return staging

    def flush(self) -> None:
        """After the forward: hand every staged request to the sender (or abort an incomplete one)."""
        for req_id, staging in list(self._staging.items()):
            del self._staging[req_id]
            claim = staging.save.claim
            if len(staging.layers_done) != len(self._layers):
                missing = len(self._layers) - len(staging.layers_done)
                log.error("staging_incomplete", transfer_id=claim.transfer_id, missing_layers=missing)
                self._sender.abort(claim, f"prefill staged {len(staging.layers_done)}/{len(self._layers)} layers")
                continue
            wait_ready = None
            if staging.buffer.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
                wait_ready = event.synchronize
            self._sender.submit(claim, staging.save.num_tokens, dict(self._layouts), staging.buffer, wait_ready)

    def close(self) -> None:
        self._sender.close()
