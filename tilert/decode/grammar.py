"""Structured outputs on the decode node: the grammar of a request compiled and matched with xgrammar, the library
vLLM's default backend uses, the way that backend does it (its compile calls and options, the request's stop ids as
the matcher's stop tokens), so that the tokens it allows are the ones vLLM allows.

A :class:`Matcher` follows one sequence: it accepts each token the sequence emits (prefill's first one included)
and masks the logits of the next step to the tokens the grammar allows; once the grammar is complete it masks
nothing (EOS or a stop id ends the sequence, as the grammar's end allows only those).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tilert import contracts as c
from tilert.engines.shaping import apply_bitmask_

if TYPE_CHECKING:
    import xgrammar


class Matcher:
    """One sequence's grammar state."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        import xgrammar as xgr  # lazy: only structured requests load it

        self._matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def accept(self, tokens: list[int]) -> None:
        """Advance over the emitted ``tokens``; ``ValueError`` when one is not allowed (the mask lets none of
        those through, so this is a token the grammar never saw: a prefill that ignored it)."""
        for token in tokens:
            if self.terminated:
                return
            if not self._matcher.accept_token(token):
                raise ValueError(f"token {token} does not continue the request's grammar")

    def next_bitmask(self) -> torch.Tensor | None:
        """The tokens the grammar allows next, as xgrammar's int32 bitmask on the host (None once it is complete:
        every token)."""
        if self.terminated:
            return None
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of the tokens the grammar does not allow next to -inf, in place (``[vocab]``)."""
        bitmask = self.next_bitmask()
        if bitmask is not None:
            apply_bitmask_(logits, bitmask.to(logits.device))


class Grammars:
    """The node's grammar compiler for one checkpoint's tokenizer, made at the first structured request (its
    compiled grammars cached, as vLLM's are)."""

    def __init__(self, model_dir: str | Path, vocab_size: int) -> None:
        self.model_dir, self.vocab_size = str(model_dir), vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _compiler_once(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def matcher(self, grammar: c.Grammar, stop_ids: frozenset[int]) -> Matcher:
        """A matcher at the grammar's start; ``ValueError`` when the grammar does not compile."""
        import xgrammar as xgr

        compiler = self._compiler_once()
        try:
            if grammar.kind == "json":
                compiled = compiler.compile_json_schema(grammar.spec, any_whitespace=True)
            elif grammar.kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
            elif grammar.kind == "regex":
                compiled = compiler.compile_regex(grammar.spec)
            elif grammar.kind == "structural_tag":
                compiled = compiler.compile_structural_tag(grammar.spec)
            elif is_lark(grammar.spec):
                compiled = compiler.compile_lark(grammar.spec)
            else:
                compiled = compiler.compile_grammar(grammar.spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for a bad grammar
            raise ValueError(f"the {grammar.kind} grammar does not compile: {exc}") from None
        stops = sorted(stop_ids) or None
        return Matcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops), self.vocab_size)


def is_lark(grammar: str) -> bool:
    """vLLM's test for a Lark grammar: no line (comments removed) holds an EBNF ``::=`` rule."""
    import re

    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return bool(grammar) and not any("::=" in line for line in lines if line)
