"""The router's token loop without any I/O, from a table of cases: node lines in, client deltas out.

The node decides token-level stops (its last line's ``finish_reason``); the loop detokenises, applies stop
strings (truncating and finishing early), holds back a possible stop string's tail while streaming, and
leaves the stopping token's text out unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from tokenizers import Tokenizer

from tilert.contracts import TokenLine
from tilert.models.tiny import train_tokenizer
from tilert.router.token_loop import TokenLoop


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer()


@dataclass
class Case:
    name: str
    text: str  # what the model "generates" after the first token (split into one token per line)
    finish: str  # the node's finish_reason on the last line
    stop_at_end: str | None = None  # a token appended as the stopping token ("<|eos|>" or a stop id's text)
    stop: list[str] = field(default_factory=list)
    include: bool = False
    want_text: str = ""
    want_finish: str = ""
    want_stop_reason: object = None
    want_tokens: int | None = None  # completion tokens counted (first token included); None: all


CASES = [
    Case("length", " return x * 2", "length", want_text="def return x * 2", want_finish="length"),
    Case("eos text left out", " return x", "stop", "<|eos|>", want_text="def return x", want_finish="stop"),
    Case(
        "stop id text left out",
        " return x",
        "stop",
        " y",
        want_text="def return x",
        want_finish="stop",
        want_stop_reason="stop-id",
    ),
    Case(
        "stop id text kept on request",
        " return x",
        "stop",
        " y",
        include=True,
        want_text="def return x y",
        want_finish="stop",
        want_stop_reason="stop-id",
    ),
    Case(
        "stop string truncates and ends early",
        " return x * 2 + 1",
        "length",
        stop=["* 2"],
        want_text="def return x ",
        want_finish="stop",
        want_stop_reason="* 2",
        want_tokens=-1,
    ),
    Case(
        "stop string kept on request",
        " return x * 2 + 1",
        "length",
        stop=["* 2"],
        include=True,
        want_text="def return x * 2",
        want_finish="stop",
        want_stop_reason="* 2",
        want_tokens=-1,
    ),
    Case("no stop string hit", " return x", "length", stop=["zzz"], want_text="def return x", want_finish="length"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_token_loop(tok: Tokenizer, case: Case) -> None:
    first = tok.encode("def").ids
    assert len(first) == 1
    body = tok.encode(case.text).ids
    stop_id = tok.encode(case.stop_at_end).ids[-1] if case.stop_at_end else None
    if case.stop_at_end == "<|eos|>":
        stop_id = tok.token_to_id("<|eos|>")
    ids = body + ([stop_id] if stop_id is not None else [])
    lines = [TokenLine([t]) for t in ids[:-1]] + [TokenLine([ids[-1]], case.finish, None)]  # type: ignore[arg-type]
    if case.want_stop_reason == "stop-id":
        lines[-1] = TokenLine([ids[-1]], "stop", stop_id)
    loop = TokenLoop(tok, None, first[0], "def", case.stop, case.include)
    streamed = loop.first_delta()
    for line in lines:
        delta = loop.feed(line)
        streamed += delta.text
        if loop.done:
            break
    assert loop.done and loop.finish_reason == case.want_finish
    want_reason = stop_id if case.want_stop_reason == "stop-id" else case.want_stop_reason
    assert loop.stop_reason == want_reason
    assert loop.text == case.want_text == streamed  # the stream and the whole answer agree
    if case.want_tokens is None:
        assert loop.token_ids == first + ids  # every token the node sent counts, the stopping one too
    else:
        assert len(loop.token_ids) < len(first + ids)  # a stop string ends the request before the node did
    with pytest.raises(RuntimeError):
        loop.feed(TokenLine([1]))


def test_held_back_tail_is_released_only_when_it_is_no_stop(tok: Tokenizer) -> None:
    """While a stop string could still be forming, its first characters are not streamed."""
    first = tok.encode("def").ids[0]
    loop = TokenLoop(tok, None, first, "def", ["xyz"])
    assert loop.first_delta() == "d"  # the last len("xyz") - 1 = 2 characters are held back
    ids = tok.encode(" a b").ids
    out = [loop.feed(TokenLine([t])).text for t in ids]
    assert "".join(out) == "ef a"
    assert loop.feed(TokenLine([], "length")).text == " b"  # finishing releases the rest


def test_stop_strings_count_only_past_min_tokens(tok: Tokenizer) -> None:
    """As in vLLM, a stop string in the first ``min_tokens`` tokens of the completion does not stop it; one that
    completes after them does (the first token counts)."""
    first = tok.encode("def").ids[0]
    ids = tok.encode(" a a a b").ids
    early = TokenLoop(tok, None, first, "def", [" a"], min_tokens=0)
    early.feed(TokenLine([ids[0]]))
    assert early.done and early.text == "def"
    late = TokenLoop(tok, None, first, "def", [" a"], min_tokens=len(ids) - 1)
    for t in ids[:-2]:
        assert not late.feed(TokenLine([t])).finish_reason
    assert late.feed(TokenLine([ids[-2]])).finish_reason == "stop"  # the completion's len(ids)th token
    assert late.text == tok.decode([first, *ids[:-2]])


# -- lines that queued up are joined (the node's stream and the router's reader) ----------------------------


def test_join_lines_keeps_order_and_the_last_finish() -> None:
    from tilert.contracts import MAX_LINE_TOKENS, join_lines

    joined = join_lines([TokenLine([1, 2]), TokenLine([3]), TokenLine([4], "stop", 4)])
    assert joined == TokenLine([1, 2, 3, 4], "stop", 4)
    with pytest.raises(ValueError, match="only the last"):
        join_lines([TokenLine([1], "length"), TokenLine([2])])
    with pytest.raises(ValueError, match="more than one line holds"):
        join_lines([TokenLine([1] * MAX_LINE_TOKENS), TokenLine([2])])


def test_reader_joins_runs_of_token_lines_but_never_past_a_finish_or_an_error() -> None:
    from tilert.contracts import MAX_LINE_TOKENS, ErrorLine, join_runs

    big = TokenLine([7] * (MAX_LINE_TOKENS - 1))
    lines = [
        TokenLine([1]),
        TokenLine([2]),
        ErrorLine(500, "x"),
        TokenLine([3]),
        big,
        TokenLine([4], "length"),
        TokenLine([5]),
    ]
    assert join_runs(lines) == [
        TokenLine([1, 2]),
        ErrorLine(500, "x"),
        TokenLine([3, *big.token_ids]),  # full: [4] starts a new line
        TokenLine([4], "length"),
        TokenLine([5]),  # after the finish: left alone for the relay to refuse
    ]
