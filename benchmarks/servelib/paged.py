"""vLLM's paged KV caches for one model on one device, and the engine's prompt rows written into them.

One page tensor per attention layer, under vLLM's layer name, as vLLM hands them to a connector's
``register_kv_caches``:

- ``model.layers.{i}.self_attn.attn``: the MLA latent. ``dense`` is ``[c_kv | k_pe]`` in the model dtype with the rope
  pairs interleaved: on the CPU in vLLM's CPU MLA shape ``[num_blocks, 1, block_size, 576]``, on CUDA
  ``[num_blocks, block_size, 576]``; ``fp8_ds_mla`` (vLLM's sparse-MLA cache on CUDA) is ``[num_blocks, 64, 656]``
  uint8.
- ``model.layers.{i}.self_attn.indexer.k_cache`` (DSA models, every layer with its own indexer): the indexer keys, fp8
  with one fp32 scale per token, block-major (each block's 64 keys, then their 64 scales), ``[num_blocks, 64, D + 4]``
  uint8.

Any kind on any device (``fp8_ds_mla`` on the CPU: vLLM's CUDA layout, exercised where vLLM never writes it).
Block size: 64 for a DSA model (vLLM's for the sparse caches; one block table addresses every layer, as the
connector assumes), else 16 on the CPU (vLLM's CPU MLA) and 64 on CUDA. The encoders are the engine's own
(:mod:`tilert.engines.tilert.layouts`), which follow vLLM's rules (fp8 scales ``max(amax / 448, FLT_MIN)``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

import torch

from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine

MlaKind = Literal["dense", "fp8_ds_mla"]
DSA_BLOCK = layouts.DSA_BLOCK_SIZE
CPU_BLOCK = 16


def default_kind(device: str, dsa: bool) -> MlaKind:
    """What vLLM keeps: ``fp8_ds_mla`` for a DSA model on CUDA, the dense latent otherwise."""
    return "fp8_ds_mla" if dsa and device.startswith("cuda") else "dense"


def attention_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def indexer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


@dataclass
class PagedCaches:
    """The page tensors of every main layer (``caches``, in vLLM's registration order) and where prompts go."""

    engine: TileRTEngine
    kind: MlaKind
    block_size: int
    num_blocks: int
    caches: dict[str, torch.Tensor] = field(default_factory=dict)
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    @classmethod
    def build(cls, engine: TileRTEngine, kind: MlaKind, max_tokens: int) -> PagedCaches:
        """Pages for one prompt of ``max_tokens`` twice over (a block table is drawn from all of them)."""
        a = engine.model.args
        dev = engine.device
        block = DSA_BLOCK if a.dsa or dev.type == "cuda" else CPU_BLOCK
        num_blocks = 2 * -(-max_tokens // block)
        out = cls(engine, kind, block, num_blocks)
        index_layers = set(a.index_layers)
        for i in range(a.num_layers):
            if kind == "fp8_ds_mla":
                row = layouts.fp8_ds_mla_row_bytes(a.kv_lora_rank, a.qk_rope_head_dim)
                mla = torch.zeros(num_blocks, block, row, dtype=torch.uint8, device=dev)
            elif dev.type == "cpu":
                mla = torch.zeros(num_blocks, 1, block, a.latent_dim, dtype=engine.dtype, device=dev)
            else:
                mla = torch.zeros(num_blocks, block, a.latent_dim, dtype=engine.dtype, device=dev)
            out.caches[attention_name(i)] = mla
            if i in index_layers:
                row = layouts.dsa_indexer_row_bytes(a.index_head_dim)
                out.caches[indexer_name(i)] = torch.zeros(num_blocks, block, row, dtype=torch.uint8, device=dev)
        return out

    def block_table(self, num_tokens: int) -> list[int]:
        """A fresh, shuffled block table for a prompt (vLLM's free list hands out blocks in no particular order)."""
        need = -(-num_tokens // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"a prompt of {num_tokens} tokens needs {need} blocks, the caches hold {self.num_blocks}")
        return self.rng.sample(range(self.num_blocks), need)

    def slots(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """Each prompt position's cache slot, ``block * block_size + offset`` (vLLM's slot mapping)."""
        pos = torch.arange(num_tokens)
        table = torch.tensor(blocks)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(self.engine.device)

    # ---- the engine's rows, as vLLM's cache holds them -----------------------------------------------------

    def mla_rows(self, layer: int, num_tokens: int, seq: int = 0) -> torch.Tensor:
        """Layer ``layer``'s latent rows of sequence ``seq``'s first ``num_tokens`` positions, encoded as this cache
        holds them: ``uint8 [num_tokens, row_bytes]``."""
        a = self.engine.model.args
        lo = seq * self.engine.max_seq_len
        latent = self.engine.model.kv_cache[layer, lo : lo + num_tokens]
        if self.kind == "fp8_ds_mla":
            return layouts.encode_fp8_ds_mla(latent, a.kv_lora_rank, rope_interleaved=True)
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.engine.dtype]
        return layouts.encode_mla_dense(latent, dtype, a.kv_lora_rank, rope_interleaved=True)

    def indexer_rows(self, layer: int, num_tokens: int, seq: int = 0) -> torch.Tensor:
        """Layer ``layer``'s indexer keys, encoded per token: ``uint8 [num_tokens, D + 4]``."""
        a = self.engine.model.args
        lo = seq * self.engine.max_seq_len
        keys = self.engine.model.index_cache[self.engine.model.index_slot[layer], lo : lo + num_tokens]
        return layouts.encode_dsa_indexer(keys, a.qk_rope_head_dim, a.indexer_rope_interleave)

    def held_state(self, num_tokens: int, seq: int = 0) -> dict[str, torch.Tensor]:
        """Sequence ``seq``'s prompt state as a decode node receives it (``"mla"``, ``"indexer"``: ``uint8 [layers,
        tokens, row_bytes]``), for the engine's :meth:`~TileRTEngine.inject`."""
        a = self.engine.model.args
        state = {"mla": torch.stack([self.mla_rows(i, num_tokens, seq) for i in range(a.num_layers)])}
        if a.dsa:
            state["indexer"] = torch.stack([self.indexer_rows(i, num_tokens, seq) for i in a.index_layers])
        return state

    # ---- the pages -----------------------------------------------------------------------------------------

    def write_layer(self, layer: int, slots: torch.Tensor, num_tokens: int) -> None:
        """Write layer ``layer``'s prompt rows (sequence 0, just computed by the engine) into its pages at ``slots``,
        as vLLM's attention (and the layer's indexer) write them during the forward."""
        mla = self.caches[attention_name(layer)]
        flat = mla.view(-1, mla.shape[-1]).view(torch.uint8)
        flat[slots] = self.mla_rows(layer, num_tokens)
        name = indexer_name(layer)
        if name in self.caches:
            rows = self.indexer_rows(layer, num_tokens)
            pages = self.caches[name].view(self.num_blocks, -1)
            bs, key_bytes = self.block_size, rows.shape[1] - 4
            keys = pages[:, : bs * key_bytes].view(self.num_blocks, bs, key_bytes)  # views: written in place
            scales = pages[:, bs * key_bytes :].view(self.num_blocks, bs, 4)
            block, offset = slots // bs, slots % bs
            keys[block, offset] = rows[:, :key_bytes]
            scales[block, offset] = rows[:, key_bytes:]
