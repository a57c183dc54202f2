"""The contract every decode engine meets.

Engines only compute: the decode server owns slots, transfers, sampling and streaming. An engine
holds the state of up to ``Capabilities.max_sequences`` independent sequences (static caches sized at
load, one slot per sequence, ``seq in range(max_sequences)``), accepts a prompt's KV as vLLM laid it out
(converting it to its own layout) into one slot, and runs forward steps that return logits: for one
sequence (``forward``) or one new token for each of several sequences at once (``decode_step``).

Engines are plugins of kind ``node-engine``: registered under the ``tilert.engines`` entry-point group and
loaded with ``tilert.engines.plugin.load_engine``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import torch

from tilert.contracts import KVLayout
from tilert.engines.shaping import NextMask, Shaping

__all__ = ["Capabilities", "DecodeEngine", "KVLayout", "SpecStepResult", "check_decode_batch", "require_exact_layouts"]


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


def check_decode_batch(tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int]) -> None:
    """``ValueError`` unless ``decode_step``'s rows are one token, position and distinct sequence each."""
    n = len(tokens)
    if n == 0 or len(positions) != n or len(seqs) != n:
        raise ValueError(
            f"decode_step needs one token, position and sequence per row (got {n}, {len(positions)}, {len(seqs)})"
        )
    if len(set(seqs)) != n:
        raise ValueError(f"decode_step takes each sequence at most once (seqs={list(seqs)})")


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

    ``max_seq_len``: positions the engine's static cache holds per sequence (0: not declared).
    ``max_sequences``: sequences the engine holds at once (slots ``0..max_sequences-1`` of every method's
    ``seq``; :meth:`DecodeEngine.decode_step` takes up to this many).
    """

    temperature: bool = True
    top_p: bool = True
    top_k: bool = True
    mtp: bool = False
    pipelined_greedy: bool = False
    max_seq_len: int = 0
    max_sequences: int = 1
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
    """One model, up to ``max_sequences`` sequences, static caches sized at load.

    Every per-sequence method takes ``seq`` (the slot, default 0, so single-sequence callers pass nothing);
    sequences are independent: what one method does to slot ``seq`` never changes another slot's results.
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["node-engine"]]  # what a plugin class declares (tilert.engines.plugin.NODE_ENGINE)

    @classmethod
    @abstractmethod
    def load(
        cls, model_dir: Path, *, device: str, dtype: torch.dtype, max_seq_len: int, max_sequences: int = 1
    ) -> DecodeEngine:
        """Read the HF checkpoint in ``model_dir`` and allocate the static caches: ``max_sequences`` slots of
        ``max_seq_len`` positions (an engine may hold fewer; ``Capabilities.max_sequences`` says how many)."""

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
    def inject(
        self,
        state: dict[str, torch.Tensor],
        layouts: dict[str, KVLayout],
        num_tokens: int,
        seq: int = 0,
        last_token_id: int | None = None,
    ) -> None:
        """Replace sequence ``seq`` with a prompt of ``num_tokens`` tokens whose KV is ``state`` (a slot in
        use is simply overwritten; the other sequences are untouched).

        Each tensor is ``uint8 [num_layers, num_tokens, row_bytes]`` exactly as vLLM held it (on any
        device); the engine converts it to its own layout. ``last_token_id`` is the prompt's last token
        when the prefill side sent it (an engine may recompute that position, e.g. to draft with MTP at
        once; others ignore it). Raises ``ValueError`` on a layout it cannot take, or a ``seq`` outside
        ``0..max_sequences-1``.
        """

    @abstractmethod
    def forward(self, token_ids: torch.Tensor, start_pos: int, seq: int = 0) -> torch.Tensor:
        """Run ``token_ids`` (int64 ``[n]``) at positions ``start_pos..start_pos+n-1`` of sequence ``seq``.

        Writes their KV into that sequence's cache and returns float32 logits ``[n, vocab]``.
        """

    def decode_step(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """One new token for each of ``n`` distinct sequences (``n <= Capabilities.max_sequences``):
        ``tokens[i]`` at position ``positions[i]`` of sequence ``seqs[i]``; returns float32 logits ``[n, vocab]``.

        Batch-invariant: row ``i`` is bit for bit what ``forward(torch.tensor([tokens[i]]), positions[i],
        seqs[i])`` gives alone, so sequences may join and leave between steps without changing anyone's
        tokens. Raises ``ValueError`` on repeated or out-of-range sequences, positions outside the cache, or
        lists of different lengths. This default runs :meth:`forward` once per sequence (correct for any
        engine); engines override it to run the sequences together.
        """
        check_decode_batch(tokens, positions, seqs)
        rows = [
            self.forward(torch.tensor([t], dtype=torch.int64), p, s)[-1:].float()
            for t, p, s in zip(tokens, positions, seqs, strict=True)
        ]
        return torch.cat(rows)

    def decode_step_greedy(self, tokens: list[int], positions: list[int], seqs: list[int]) -> list[int]:
        """:meth:`decode_step` followed by the argmax of every row (engines take it on the device, with one
        host read): the next greedy token of each sequence."""
        return self.decode_step(tokens, positions, seqs).argmax(-1).tolist()

    def greedy_batch_stream(
        self, tokens: list[int], positions: list[int], seqs: list[int], max_new: int
    ) -> Generator[list[int], None, None]:
        """Plain greedy decoding of several sequences together: feed ``tokens[i]`` at ``positions[i]`` of
        sequence ``seqs[i]`` and yield, step by step, the next token of every sequence (in ``seqs``' order), up to
        ``max_new`` steps: exactly what successive :meth:`decode_step_greedy` calls give. Ends early when a
        sequence's cache is full. The caller may stop iterating at any time (e.g. when one sequence ends or another
        joins); at most one step beyond the last one read has run (its rows lie beyond each sequence and are
        overwritten later), and the engine goes on from the tokens read.

        This default calls :meth:`decode_step_greedy` once a step; an engine that pipelines its steps
        (``Capabilities.pipelined_greedy``) overrides it to launch step ``t+1`` before step ``t``'s tokens are read.
        """
        check_decode_batch(tokens, positions, seqs)
        limit = self.capabilities().max_seq_len
        steps = min(max_new, limit - max(positions)) if limit else max_new
        toks, pos = list(tokens), list(positions)
        for _ in range(max(steps, 0)):
            toks = self.decode_step_greedy(toks, pos, seqs)
            pos = [p + 1 for p in pos]
            yield toks

    def warm_up(
        self,
        num_draft: int = 0,
        accept_all: bool = False,
        draft_head: str = "model",
        draft_vocab: Sequence[int] | None = None,
    ) -> None:
        """Prepare what the first requests would otherwise wait for (e.g. captured graphs), before any sequence is
        injected; the decode node calls it once, after :meth:`load`, with the drafts its greedy requests take a
        step (``Capabilities.mtp``), whether it accepts all of them and what the drafts' vocabulary head reads
        (``draft_head``, one of :data:`~tilert.engines.plugin.DRAFT_HEADS`; ``draft_vocab``, the only token ids
        drafts may propose, ``None`` for all). This default does nothing, and refuses (ValueError) a draft head
        other than the model's whole one."""
        if draft_head != "model" or draft_vocab is not None:
            raise ValueError(f"engine {self.name!r} drafts only with the model's whole head")

    # ------------------------------------------------------------------ optional fast paths
    # Called only when ``capabilities()`` sets the flag named in each docstring.

    def greedy_stream(self, first_token: int, start_pos: int, max_new: int, seq: int = 0) -> Iterator[int]:
        """Plain greedy decoding of sequence ``seq``, pipelined (``Capabilities.pipelined_greedy``).

        Feed ``first_token`` at ``start_pos`` and yield up to ``max_new`` next tokens one by one, exactly
        the argmax tokens of successive :meth:`forward` steps. Ends early when the cache is full (the last
        step runs at position ``max_seq_len - 1``). The caller may stop iterating at any time; the engine
        is then ready to continue from the last token read.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare Capabilities.pipelined_greedy")

    def shaped_greedy_stream(
        self,
        first_token: int,
        start_pos: int,
        max_new: int,
        shaping: Shaping,
        next_mask: NextMask | None = None,
        seq: int = 0,
    ) -> Iterator[int]:
        """Greedy decoding of sequence ``seq`` under logits rules, as :meth:`greedy_stream` yields plain greedy
        tokens: each step's logits get the grammar's bitmask (``next_mask()``, asked once the caller has taken
        the previous token) and ``shaping``'s rules, then the argmax. The engine applies the rules to its own
        copy of ``shaping``, which it advances by each token it decides; ``shaping`` itself is the caller's.

        This default runs :meth:`forward` once a step (every engine has it); an engine that pipelines its steps
        (``Capabilities.pipelined_greedy``) overrides it to apply the rules inside them.
        """
        limit = self.capabilities().max_seq_len
        end = min(start_pos + max_new, limit) if limit else start_pos + max_new
        rules: Shaping | None = None
        token = first_token
        for pos in range(start_pos, end):
            logits = self.forward(torch.tensor([token], dtype=torch.int64), pos, seq)[-1].float()
            if rules is None:
                rules = shaping.clone_to(logits.device)
            bitmask = next_mask() if next_mask is not None else None
            rules.apply_(logits, bitmask=None if bitmask is None else bitmask.to(logits.device))
            token = int(logits.argmax())
            rules.observe([token])
            yield token

    def speculative_greedy_step(
        self, next_token: int, start_pos: int, num_draft: int, seq: int = 0, accept_all: bool = False
    ) -> SpecStepResult:
        """One greedy speculative step of sequence ``seq`` (``Capabilities.mtp``).

        Precondition: positions ``0..start_pos-1`` are in the cache and ``next_token`` is the greedy token
        at ``start_pos``, not yet run. Drafts up to ``num_draft`` tokens, verifies them with the main model
        and returns the accepted drafts plus one bonus token: token for token what plain greedy decoding
        would emit. ``start_pos`` must be below ``max_seq_len``.

        ``accept_all`` (benchmarks only: ``tilert decode --accept-all-drafts``): every draft is accepted whatever
        the main model says, then its token after the last draft; the tokens are then not greedy's. It measures
        the serving path at full acceptance, which random weights never reach.
        """
        raise NotImplementedError(f"{type(self).__name__} does not declare Capabilities.mtp")

    def speculative_stream(
        self, first_token: int, start_pos: int, num_draft: int, seq: int = 0, accept_all: bool = False
    ) -> Generator[SpecStepResult, None, None]:
        """Greedy speculative steps of sequence ``seq`` one after another (``Capabilities.mtp``): the first feeds
        ``first_token`` at ``start_pos``, each next one the last token of the step before, at the position after
        it; each yields its :class:`SpecStepResult`. Runs until the caller stops iterating; the engine is then
        ready to continue from the last token read (as after :meth:`speculative_greedy_step`). This default
        runs one :meth:`speculative_greedy_step` at a time; an engine may run the next step before the caller has
        read this one."""
        token, pos = first_token, start_pos
        while True:
            step = self.speculative_greedy_step(token, pos, num_draft, seq, accept_all)
            yield step
            token, pos = step.tokens[-1], pos + len(step.tokens)
