"""The router's part of decoding, without I/O: decode-node lines in, client deltas out.

The decode node alone decides token-level stops (EOS, stop ids, ``max_tokens``, the end of the context)
and says so in its last line's ``finish_reason``. The router keeps what needs text: detokenising as
vLLM does, stop *strings* (truncating the text and ending the request early: the caller then releases
the node, which cancels the decode), and the held-back tail of a possible stop string while streaming.
As in vLLM, the text of the token that stopped decoding is left out unless
``include_stop_str_in_output``. A request of ``n`` choices has a loop a choice (:class:`Choices`), each with its
own text, stop strings and finish.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenizers import Tokenizer

from tilert.contracts import TokenLine
from tilert.router.detokenize import IncrementalDecoder, OutputText


@dataclass(frozen=True)
class Delta:
    """What one node line adds to the client's answer."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    index: int = 0  # the choice


@dataclass
class TokenLoop:
    tokenizer: Tokenizer
    prompt_token_ids: list[int] | None
    first_token_id: int | None  # None: a choice whose first token comes from the decode node with the rest
    first_text: str  # vLLM's text of the first token (stop strings already applied to it)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # as in vLLM, stop strings count only once the completion is longer than this

    def __post_init__(self) -> None:
        self.token_ids = [] if self.first_token_id is None else [self.first_token_id]
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._out = OutputText(self.stop, self.include_stop_str_in_output)
        self._out.text = self.first_text
        first = () if self.first_token_id is None else (self.first_token_id,)  # its text is first_text
        self._decoder = IncrementalDecoder(self.tokenizer, self.prompt_token_ids, self.skip_special_tokens, first)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def prime(self) -> None:
        """Prime the detokenizer now (its first line would otherwise): while the decode node works on that line."""
        self._decoder.prime()

    @property
    def text(self) -> str:
        return self._out.text

    def first_delta(self) -> str:
        """The first token's text as it may be streamed now (the tail of a possible stop string held, unless the
        first token already ended the choice)."""
        return self._out.delta(self.done)

    def end(self, finish_reason: str, stop_reason: str | int | None) -> None:
        """The choice ended before the decode node's lines (prefill's first token ended it)."""
        self.finish_reason, self.stop_reason = finish_reason, stop_reason

    def feed(self, line: TokenLine) -> Delta:
        """Take one node line; after the delta that finishes, the loop is :attr:`done`."""
        if self.done:
            raise RuntimeError("the token loop already finished")
        ids = line.token_ids
        stop_token = line.finish_reason == "stop" and bool(ids)
        if not self.stop:  # no stop string can end the text early: every token is taken, their text at once
            texted = ids[:-1] if stop_token and not self.include_stop_str_in_output else ids
            self._out.add(self._decoder.steps(texted))
            self.token_ids.extend(ids)
            if line.finish_reason is not None:
                self.finish_reason, self.stop_reason = line.finish_reason, line.stop_token_id
            return Delta(self._out.delta(self.done), ids, self.finish_reason, self.stop_reason)
        accepted: list[int] = []
        for i, tid in enumerate(ids):
            accepted.append(tid)
            if stop_token and i == len(ids) - 1 and not self.include_stop_str_in_output:
                break  # the stopping token counts, its text does not
            piece = self._decoder.step(tid)
            hit = self._out.add(piece, check=len(self.token_ids) + len(accepted) > self.min_tokens)
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
                break
        self.token_ids.extend(accepted)
        if self.finish_reason is None and line.finish_reason is not None:
            self.finish_reason, self.stop_reason = line.finish_reason, line.stop_token_id
        return Delta(self._out.delta(self.done), accepted, self.finish_reason, self.stop_reason)


class Choices:
    """The token loops of one answer's ``n`` choices: choice 0 goes on from prefill's first token (``first``), the
    others begin with the first token the decode node sends them. Lines of a choice that already ended here (a stop
    string, prefill's token) are dropped: the node decodes it on until its own finish or the request's end."""

    def __init__(self, first: TokenLoop, n: int) -> None:
        others = [replace(first, first_token_id=None, first_text="") for _ in range(n - 1)]
        self.loops = [first, *others]
        self._node_ended: set[int] = set()  # choices whose finish the node sent

    @property
    def first(self) -> TokenLoop:
        return self.loops[0]

    @property
    def done(self) -> bool:
        return self.loops[0].done if len(self.loops) == 1 else all(loop.done for loop in self.loops)

    def prime(self) -> None:
        """Every choice's :meth:`TokenLoop.prime`."""
        for loop in self.loops:
            loop.prime()

    @property
    def node_done(self) -> bool:
        """Whether the node sent every choice's finish (its stream then ends, the slot freed)."""
        return len(self._node_ended) == len(self.loops)

    @property
    def token_count(self) -> int:
        """Tokens of every choice (the answer's ``completion_tokens``, as vLLM counts them)."""
        return sum(len(loop.token_ids) for loop in self.loops)

    def feed(self, line: TokenLine) -> Delta:
        """Take one node line (its choice checked by the caller) into its choice's loop."""
        if line.finish_reason is not None:
            self._node_ended.add(line.index)
        loop = self.loops[line.index]
        if loop.done:
            return Delta("", [], index=line.index)
        delta = loop.feed(line)
        return replace(delta, index=line.index) if line.index else delta
