"""Log-probabilities and the echoed prompt in vLLM's OpenAI shapes: what a choice carries besides its text.

vLLM (0.32) builds them in three places, each replicated here over the router's tokenizer (vLLM itself takes
seconds to import, too long for a router's request; ``tests/test_logprobs.py`` checks each against vLLM's code):

- ``vllm.v1.engine.logprobs.LogprobsProcessor``: per position, an ordered dict ``{token id: (logprob, decoded)}``
  of the sampled token then the top ones (a token in both keeps the first place); the decoded strings are
  ``vllm.tokenizers.detokenizer_utils.convert_ids_list_to_tokens`` (each id decoded alone, a SentencePiece
  leading space restored), a string ending in U+FFFD corrected with the up to four tokens sampled before it.
- ``OpenAIServingChat._create_chat_logprobs``: ``{token, logprob, bytes, top_logprobs}`` per token, the first
  ``top_logprobs`` entries of that dict; ``OpenAIServingCompletion._create_completion_logprobs``: ``text_offset``,
  ``token_logprobs``, ``tokens`` and ``top_logprobs`` (the first ``logprobs + 1`` entries keyed by their string).
  Log-probabilities show at least -9999.0; ``return_tokens_as_token_ids`` shows tokens as ``token_id:N``.
- Completions' ``echo``: the prompt's text before the completion's (none when ``return_token_ids`` is set), its
  tokens' entries before the completion's.

The prefill's token comes with vLLM's own entries (its answer, and the prompt's under ``echo``), used as they are;
each token the decode node emits comes with its :class:`~tilert.contracts.TokenLogprobs`, rendered here. A token
from a resumed stream's prefill (asked with ``return_tokens_as_token_ids``) is read back as one.
"""

from __future__ import annotations

from typing import Any

import orjson
from tokenizers import Tokenizer

from tilert.contracts import LOGPROB_FLOOR, TokenLogprobs
from tilert.router.errors import RouterError
from tilert.router.validation import RequestPlan

_REPLACEMENT = "\ufffd"
_CONTEXT = 4  # sampled tokens a U+FFFD string is corrected with (vLLM: enough for any UTF-8 sequence)
_AS_ID = "token_id:"

Position = dict[int, tuple[float, str]]  # token id -> (logprob, decoded string), in vLLM's order


class TokenStrings:
    """vLLM's strings of single tokens: ``convert_ids_list_to_tokens`` and the U+FFFD correction of
    ``LogprobsProcessor._verify_tokens`` (decoding as the Hugging Face tokenizer does, special tokens kept)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._marker = _space_marker(tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def pieces(self, ids: list[int]) -> list[str]:
        """``convert_ids_list_to_tokens``: each id alone, with the leading spaces a Metaspace decode strips."""
        if self._marker is None:
            return [self.decode([t]) or "" for t in ids]
        return [_restore_spaces(self._tok.id_to_token(t) or "", self.decode([t]) or "", self._marker) for t in ids]

    def position(self, ids: list[int], context: list[int]) -> list[str]:
        """The strings of one position's ids (the sampled one, then the top ones), corrected with ``context``:
        the tokens sampled before it, oldest first."""
        out = self.pieces(ids)
        return [
            self._corrected(t, context[-_CONTEXT:]) if s.endswith(_REPLACEMENT) else s
            for t, s in zip(ids, out, strict=True)
        ]

    def _corrected(self, token: int, context: list[int]) -> str:
        """``LogprobsProcessor._correct_decoded_token``: the token's text once the context completes its bytes."""
        for n in range(1, min(len(context), _CONTEXT) + 1):
            ctx = context[-n:]
            full = self.decode([*ctx, token])
            if full.endswith(_REPLACEMENT):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if not self.decode([ctx[j]]).endswith(_REPLACEMENT):
                    break
                clean_end = j
            prefix = self.decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _space_marker(tokenizer: Tokenizer) -> str | None:
    """``get_leading_space_marker``: a Metaspace pre-tokenizer's replacement character (its decode strips it)."""
    pre = tokenizer.pre_tokenizer
    if pre is None:
        return None
    try:
        config = orjson.loads(pre.__getstate__())
    except (orjson.JSONDecodeError, TypeError, AttributeError):
        return None
    if config.get("type") == "Metaspace":
        return str(config.get("replacement", "\u2581"))
    if config.get("type") == "Sequence":
        for sub in config.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return str(sub.get("replacement", "\u2581"))
    return None


def _restore_spaces(raw: str, text: str, marker: str) -> str:
    markers = len(raw) - len(raw.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if markers and missing > 0 else text


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class ChoiceLogprobs:
    """One choice's log-probabilities in its route's shape, entry by entry as the answer grows: :meth:`take`
    the ones not streamed yet, :meth:`whole` all of them."""

    def __init__(self, plan: RequestPlan, strings: TokenStrings, first: list[Any]) -> None:
        assert plan.logprobs is not None
        self.chat = plan.route == "chat"
        self.top = plan.logprobs
        self.as_ids = plan.tokens_as_ids
        self.strings = strings
        self.entries: list[Any] = list(first)  # chat: content items; completions: (token, logprob, top) triples
        self._sent = 0
        self._offset = 0  # completions: the text offset of the first entry not streamed yet

    def add(self, ids: list[int], logprobs: list[TokenLogprobs], context: list[int]) -> None:
        """The decode node's tokens ``ids`` with their logprobs; ``context``: the completion's tokens before them."""
        for i, (token, lp) in enumerate(zip(ids, logprobs, strict=True)):
            alts = [token, *lp.top_ids]
            texts = self.strings.position(alts, [*context, *ids[:i]])
            position: Position = dict(zip(alts, zip([lp.logprob, *lp.top_logprobs], texts, strict=True), strict=True))
            self.entries.append(self._chat_item(token, position) if self.chat else self._triple(token, position))

    def take(self) -> dict[str, Any]:
        """The entries not streamed yet, as a chunk's ``logprobs``."""
        start, self._sent = self._sent, len(self.entries)
        out = self._shaped(self.entries[start:], self._offset)
        if not self.chat and out["tokens"]:
            self._offset = out["text_offset"][-1] + len(out["tokens"][-1])
        return out

    def whole(self) -> dict[str, Any]:
        return self._shaped(self.entries, 0)

    def _shaped(self, entries: list[Any], offset: int) -> dict[str, Any]:
        if self.chat:
            return {"content": entries}
        offsets = []
        for token, _, _ in entries:
            offsets.append(offset)
            offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": [e[1] for e in entries],
            "tokens": [e[0] for e in entries],
            "top_logprobs": [e[2] for e in entries],
        }

    def _shown(self, token: int, decoded: str) -> str:
        return f"{_AS_ID}{token}" if self.as_ids else decoded

    def _chat_item(self, token: int, position: Position) -> dict[str, Any]:
        logprob, decoded = position[token]
        tops = []
        for i, (alt, (alt_logprob, alt_decoded)) in enumerate(position.items()):
            if i >= self.top:
                break
            shown = self._shown(alt, alt_decoded)
            tops.append({"token": shown, "logprob": _floor(alt_logprob), "bytes": _bytes(shown)})
        shown = self._shown(token, decoded)
        return {"token": shown, "logprob": _floor(logprob), "bytes": _bytes(decoded), "top_logprobs": tops}

    def _triple(self, token: int, position: Position) -> tuple[str, float, dict[str, float]]:
        logprob, decoded = position[token]
        tops = {
            self._shown(alt, alt_decoded): _floor(alt_logprob)
            for i, (alt, (alt_logprob, alt_decoded)) in enumerate(position.items())
            if self.top >= i
        }
        return self._shown(token, decoded), _floor(logprob), tops


class ChoiceExtras:
    """What one choice carries besides its completion's text and tokens, as vLLM gives it: the echoed prompt's
    text (``echo``), the log-probabilities of its tokens, the prompt's (``prompt_logprobs``, vLLM's answer)."""

    def __init__(self, echo: str, logprobs: ChoiceLogprobs | None, prompt_logprobs: Any) -> None:
        self.echo = echo
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self._echo_pending = echo

    @classmethod
    def of(
        cls, plan: RequestPlan, raw: dict[str, Any], prompt_ids: list[int] | None, tokenizer: Tokenizer
    ) -> ChoiceExtras | None:
        """From the prefill's answer ``raw`` (the first token, and the prompt's entries under ``echo``); None for a
        request that asks for none of them."""
        if plan.logprobs is None and not plan.echo and "prompt_logprobs" not in plan.body:
            return None
        strings = TokenStrings(tokenizer)
        choice = _first_choice(raw)
        logprobs = None
        if plan.logprobs is not None:
            logprobs = ChoiceLogprobs(plan, strings, _prefill_entries(plan, choice.get("logprobs")))
        echo = ""
        if plan.echo and not plan.return_token_ids:  # vLLM echoes no text when it returns the prompt's ids
            prompt = plan.body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            echo = prompt if isinstance(prompt, str) else strings.decode(prompt_ids or [])  # vLLM decodes token ids
        found = raw.get("prompt_logprobs") if plan.route == "chat" else choice.get("prompt_logprobs")
        return cls(echo, logprobs, found)

    def take_echo(self) -> str:
        """The echoed prompt's text for the first chunk of a stream (then nothing)."""
        echo, self._echo_pending = self._echo_pending, ""
        return echo

    def chunk_logprobs(self) -> dict[str, Any] | None:
        """A stream chunk's ``logprobs``: the entries not streamed yet (None when not asked)."""
        return None if self.logprobs is None else self.logprobs.take()

    def complete(self, body: dict[str, Any], choice: dict[str, Any]) -> None:
        """Into a final body: the choice's ``logprobs``; ``prompt_logprobs`` where vLLM puts them (chat: the body's,
        completions: the choice's), when the prefill gave them."""
        if self.logprobs is not None:
            choice["logprobs"] = self.logprobs.whole()
        if self.prompt_logprobs is not None:
            (body if "message" in choice else choice)["prompt_logprobs"] = self.prompt_logprobs


def _fail(what: str) -> RouterError:
    return RouterError(502, f"prefill answered {what} outside vLLM's shape", outcome="prefill_error")


def _first_choice(raw: dict[str, Any]) -> dict[str, Any]:
    choices = raw.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail("choices")
    return choices[0]


def _prefill_entries(plan: RequestPlan, found: Any) -> list[Any]:
    """vLLM's own entries in the prefill's answer (its token, and the prompt's under ``echo``), as entries."""
    if plan.route == "chat":
        content = found.get("content") if isinstance(found, dict) else None
        if not isinstance(content, list) or not all(isinstance(item, dict) for item in content):
            raise _fail("logprobs")
        return content
    lists = [found.get(k) if isinstance(found, dict) else None for k in ("tokens", "token_logprobs", "top_logprobs")]
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1:  # type: ignore[arg-type]
        raise _fail("logprobs")
    return [tuple(entry) for entry in zip(*lists, strict=True)]


def resumed_logprobs(raw: dict[str, Any], token: int) -> TokenLogprobs:
    """The logprobs of a resumed stream's prefill token, from its completions answer with tokens as ids: the
    token's logprob and the others of its entry in vLLM's order (the same position dict when rendered again).
    ``rank`` counts the listed ones at least as likely (vLLM's rank when the token is among them)."""
    found: Any = _first_choice(raw).get("logprobs")
    try:
        shown, logprob, tops = found["tokens"][0], found["token_logprobs"][0], found["top_logprobs"][0]
        alts = {int(key.removeprefix(_AS_ID)): float(value) for key, value in tops.items()}
        if shown != f"{_AS_ID}{token}" or isinstance(logprob, bool):
            raise ValueError(shown)
        logprob = float(logprob)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        raise _fail("logprobs") from None
    others = {alt: value for alt, value in alts.items() if alt != token}
    rank = 1 + sum(value >= logprob for value in others.values())
    return TokenLogprobs(logprob, rank, list(others), list(others.values()))
