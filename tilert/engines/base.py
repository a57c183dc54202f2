"""The contract every decode engine meets.

Engines only compute: the decode server owns slots, transfers, sampling and streaming. An engine
holds one sequence's state (a static cache sized at load), accepts the prompt's KV as vLLM laid it
out (converting it to its own layout), and runs forward steps that return logits.

Engines are plugins: registered under the ``tilert.engines`` entry-point group and looked up there
(see ``tilert.plugins``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from tilert.protocol import KVLayout

__all__ = ["Capabilities", "DecodeEngine", "KVLayout", "require_exact_layouts"]


def require_exact_layouts(expected: Mapping[str, KVLayout], offered: Mapping[str, KVLayout]) -> None:
    """``ValueError`` unless ``offered`` carries ``"mla"`` and every tensor exactly as ``expected``."""
    if "mla" not in offered:
        raise ValueError("offer carries no 'mla' state")
    for name, lay in offered.items():
        want = expected.get(name)
        if want is None:
            raise ValueError(f"engine takes no '{name}' state (it takes {sorted(expected)})")
        if (lay.kind, lay.dtype, lay.row_bytes, lay.num_layers) != (want.kind, want.dtype, want.row_bytes, want.num_layers):
            raise ValueError(f"'{name}' layout mismatch: prefill sends {lay}, engine expects {want}")


@dataclass(frozen=True)
class Capabilities:
    """What an engine can honour; the decode server refuses (400/501) whatever is not listed."""

    temperature: bool = True
    top_p: bool = True
    top_k: bool = True
    mtp: bool = False
    max_seq_len: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


class DecodeEngine(ABC):
    """One model, one sequence at a time, a static cache sized at load."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def load(
        cls, model_dir: Path, *, device: str, dtype: torch.dtype, max_seq_len: int
    ) -> "DecodeEngine":
        """Read the HF checkpoint in ``model_dir`` and allocate the static cache."""

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def capabilities(self) -> Capabilities: ...

    @abstractmethod
    def expected_layouts(self) -> dict[str, KVLayout]:
        """The KV tensors (by name, e.g. ``"mla"``, ``"indexer"``) this engine needs from prefill."""

    def check_layouts(self, layouts: Mapping[str, KVLayout]) -> None:
        """``ValueError`` naming why this engine cannot take a prompt state laid out as ``layouts``.

        Called before any byte moves (the decode node rejects the offer with this reason). The default
        takes exactly ``expected_layouts()``; engines that convert more layouts widen it.
        """
        require_exact_layouts(self.expected_layouts(), layouts)

    @abstractmethod
    def inject(self, state: dict[str, torch.Tensor], layouts: dict[str, KVLayout], num_tokens: int) -> None:
        """Replace the sequence with a prompt of ``num_tokens`` tokens whose KV is ``state``.

        Each tensor is ``uint8 [num_layers, num_tokens, row_bytes]`` exactly as vLLM held it (on any
        device); the engine converts it to its own layout. Raises ``ValueError`` on a layout it
        cannot take.
        """

    @abstractmethod
    def forward(self, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run ``token_ids`` (int64 ``[n]``) at positions ``start_pos..start_pos+n-1``.

        Writes their KV into the cache and returns float32 logits ``[n, vocab]``.
        """
