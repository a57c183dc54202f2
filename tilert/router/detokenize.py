"""Incremental detokenization and stop strings, matching vLLM's V1 output processing.

vLLM primes a ``tokenizers.decoders.DecodeStream(skip_special_tokens=...)`` with a short suffix of the
prompt, then steps each generated token; stop strings are searched in the accumulated text, and while a
request is running the last ``max(len(stop)) - 1`` characters are held back so that a stop string split
across tokens never reaches the client. The router does the same, so its text equals vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tilert.contracts import MAX_BAD_WORD_TOKENS
from tilert.models.checkpoint import eos_token_ids

log = structlog.get_logger("tilert.router.detokenize")

_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenizerBundle:
    """The model's fast tokenizer and the token ids that end generation (EOS from all config files)."""

    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]


def load_tokenizer(model_dir: str | Path) -> TokenizerBundle:
    """Load ``tokenizer.json`` (or a transformers fast tokenizer) and EOS ids from ``model_dir``."""
    d = Path(model_dir)
    tok_file = d / "tokenizer.json"
    if tok_file.is_file():
        tokenizer = Tokenizer.from_file(str(tok_file))
    else:
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(d))
        except Exception as exc:  # noqa: BLE001 - any loader failure is a start-up error
            raise RuntimeError(f"cannot load a tokenizer from {str(d)!r}: {exc}") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise RuntimeError(f"the tokenizer in {str(d)!r} is not a fast tokenizer (no tokenizer.json)")
        tokenizer = backend
    return TokenizerBundle(tokenizer=tokenizer, eos_token_ids=eos_token_ids(d, tokenizer.token_to_id))


class IncrementalDecoder:
    """Token ids in, text pieces out, with the same priming vLLM's fast incremental detokenizer uses.

    The priming (the prompt's tail, then ``then``: tokens already sampled whose text the caller has) runs at the first
    :meth:`step`, or earlier by :meth:`prime`: a prompt without a clean tail primes with all of it, which the text
    of a first token the caller already has need not wait for."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None,
        skip_special_tokens: bool,
        then: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._unprimed: tuple[list[int], Sequence[int]] | None = (prompt_token_ids or [], then)

    def prime(self) -> None:
        """Step the prompt's tail and ``then`` now (once)."""
        if self._unprimed is None:
            return
        prompt, then = self._unprimed
        self._unprimed = None
        for tid in (*_clean_tail(self._tok, prompt), *then):
            self._step(tid)

    def step(self, token_id: int) -> str:
        if self._unprimed is not None:
            self.prime()
        return self._step(token_id)

    def _step(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._tok, token_id)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises on an invalid prefix; vLLM resets too
            piece = self._reset(token_id, exc)
        return piece or ""

    def steps(self, token_ids: Sequence[int]) -> str:
        """The text of several tokens, each stepped as by :meth:`step` (without a Python call a token)."""
        if self._unprimed is not None:
            self.prime()
        pieces: list[str] = []
        stream, tok = self._stream, self._tok
        for tid in token_ids:
            try:
                piece = stream.step(tok, tid)
            except Exception as exc:  # noqa: BLE001 - as in step
                piece = self._reset(tid, exc)
                stream = self._stream
            if piece:
                pieces.append(piece)
        return "".join(pieces)

    def _reset(self, token_id: int, exc: Exception) -> str | None:
        """A fresh stream from ``token_id`` on, after the old one refused it."""
        log.warning("detokenizer_reset", token_id=token_id, error=str(exc))
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return self._stream.step(self._tok, token_id)


def _clean_tail(tokenizer: Tokenizer, prompt: list[int]) -> list[int]:
    """What vLLM primes its stream with: the shortest tail of 4 to 23 tokens whose text is clean (no U+FFFD), else
    the whole prompt."""
    if len(prompt) > 4:
        for i in range(4, min(len(prompt) + 1, 24)):
            candidate = prompt[-i:]
            if _REPLACEMENT not in tokenizer.decode(candidate, skip_special_tokens=False):
                return candidate
    return prompt


def find_stop(text: str, new_chars: int, stops: list[str], include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's stop-string check: the first stop (in list order) found in the newly added tail of ``text``.

    Returns ``(stop_string, truncate_to)``; ``truncate_to == -1`` means keep all of ``text``.
    """
    if not new_chars or not stops:
        return None
    for stop in stops:
        idx = text.find(stop, max(0, len(text) + 1 - new_chars - len(stop)))
        if idx == -1:
            continue
        if include_in_output:
            idx += len(stop)
            if idx >= len(text):
                return stop, -1
        return stop, idx
    return None


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words`` (``SamplingParams.update_from_tokenizer``): each word without and
    with a leading space, the spaced form kept when it starts with another token and is as long;
    ``ValueError`` for a word that tokenizes to nothing."""
    out: list[list[int]] = []
    for word in words:
        for spaced in (False, True):
            ids = tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False).ids
            if not ids:
                if not spaced:
                    raise ValueError("bad_words entries must tokenize to at least one token.")
                continue
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise ValueError(f"a bad_words entry tokenizes to {len(ids)} tokens, over {MAX_BAD_WORD_TOKENS}")
            if not spaced or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    return out


class OutputText:
    """The generated text so far, stop-string truncation and the held-back tail while streaming."""

    def __init__(self, stops: list[str], include_stop_str_in_output: bool) -> None:
        self.text = ""
        self._stops = stops
        self._include = include_stop_str_in_output
        self._holdback = max((len(s) for s in stops), default=1) - 1 if stops and not include_stop_str_in_output else 0
        self._sent = 0

    def add(self, piece: str, check: bool = True) -> str | None:
        """Append text; return the stop string if one now appears (the text is then truncated). ``check``
        False: append only (the completion is not past ``min_tokens`` yet)."""
        if not piece:
            return None
        self.text += piece
        if not check:
            return None
        hit = find_stop(self.text, len(piece), self._stops, self._include)
        if hit is None:
            return None
        stop, cut = hit
        if cut != -1:
            self.text = self.text[:cut]
        return stop

    def delta(self, finished: bool) -> str:
        """New text the client may see now (everything, once finished)."""
        end = len(self.text) if finished else len(self.text) - self._holdback
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
