"""The contract every decode engine meets.

Engines only compute: the decode server owns slots, transfers, sampling and streaming. An engine
holds one sequence's state (a static cache sized at load), accepts the prompt's KV as vLLM laid it
out (converting it to its own layout), and runs forward steps that return logits.

Engines are plugins: registered under the ``tilert.engines`` entry-point group and looked up there
(see ``tilert.plugins``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from tilert.contracts import KVLayout

__all__ = ["Capabilities", "DecodeEngine", "KVLayout", "SpecStepResult", "require_exact_layouts"]


def require_exact_layouts(expected: Mapping[str, KVLayout], offered: Mapping[str, KVLayout]) -> None:
    """``ValueError`` unless ``offered`` carries ``"mla"`` and every tensor exactly as ``expected``."""
    if "mla" not in offered:
        raise ValueError("offer carries no 'mla' state")
    for name, lay in offered.items():
        want = expected.get(name)
        if want is None:
            raise ValueError(f"engine takes no '{name}' state (it takes {sorted(expected)})")
        got = (lay.kind, lay.dtype, lay.row_bytes, lay.num_layers)
        if got != (want.kind, want.dtype, want.row_bytes, want.num_layers):
            raise ValueError(f"'{name}' layout mismatch: prefill sends {lay}, engine expects {want}")


@dataclass(frozen=True)
class Capabilities:
    """What an engine can honour; the decode server refuses (400/501) whatever is not listed.

    The sampling flags say which request options the engine's logits can serve. The fast-path flags say
    which optional :class:`DecodeEngine` methods the engine implements; the decode loop calls a method only
    when its flag is set:

    - ``pipelined_greedy``: :meth:`DecodeEngine.greedy_stream` (plain greedy, next step launched while
      the current token is read).
    - ``mtp``: :meth:`DecodeEngine.speculative_greedy_step` drafts with a multi-token-prediction module
      (greedy requests decode several tokens per step).

    ``max_seq_len``: positions the engine's static cache holds (0: not declared).
    """

    temperature: bool = True
    top_p: bool = True
    top_k: bool = True
    mtp: bool = False
    pipelined_greedy: bool = False
    max_seq_len: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class SpecStepResult:
    """Outcome of one :meth:`DecodeEngine.speculative_greedy_step`.

    ``tokens``: the newly decided tokens, in order: the accepted drafts followed by one bonus token
    (``num_accepted + 1`` tokens). The next step is called with ``next_token=tokens[-1]`` and
    ``start_pos = start_pos + len(tokens)``. ``num_drafted``: drafts proposed (0 when the MTP module
    could not run, e.g. right after an injection with no hidden state yet).
    """

    tokens: list[int]
    num_drafted: int
    num_accepted: int


class DecodeEngine(ABC):
    """One model, one sequence at a time, a static cache sized at load."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def load(
        cls, model_dir: Path, *, device: str, dtype: torch.dtype, max_seq_len: int
    ) -> DecodeEngine:
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

    # ------------------------------------------------------------------ optional fast paths
    # Called only when ``capabilities()`` sets the flag named in each docstring.

    def greedy_stream(self, first_token: int, start_pos: int, max_new: int) -> Iterator[int]:
        """Plain greedy decoding, pipelined (``Capabilities.pipelined_greedy``).

        Feed ``first_token`` at ``start_pos`` and yield up to ``max_new`` next tokens one by one, exactly
        the argmax tokens of successive :meth:`forward` steps. Ends early when the cache is full (the last
        step runs at position ``max_seq_len - 1``). The caller may stop iterating at any time; the engine
        is then ready to continue from the last token read.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare Capabilities.pipelined_greedy")

    def speculative_greedy_step(self, next_token: int, start_pos: int, num_draft: int) -> SpecStepResult:
        """One greedy speculative step (``Capabilities.mtp``).

        Precondition: positions ``0..start_pos-1`` are in the cache and ``next_token`` is the greedy token
        at ``start_pos``, not yet run. Drafts up to ``num_draft`` tokens, verifies them with the main model
        and returns the accepted drafts plus one bonus token: token for token what plain greedy decoding
        would emit. ``start_pos`` must be below ``max_seq_len``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare Capabilities.mtp")
