"""The relay's per-chunk shortcuts give what their per-token forms give: the node's lines decoded in one call, a run
of lines joined in one pass, a line of several tokens through the token loop, ``n`` inter-token gaps observed at
once. No servers."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from tokenizers import Tokenizer

from tilert import contracts as c
from tilert.metric_conventions import ManyObservations
from tilert.models.tiny import train_tokenizer
from tilert.router.token_loop import TokenLoop

TEXT = " return fibonacci(n - 1) + fibonacci(n - 2)  # the sum of the two before, as a stop string may cut it"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer()


def test_lines_decoded_in_one_call_are_those_decoded_one_by_one() -> None:
    lines = [c.TokenLine([1, 2]), c.TokenLine([3], index=1), c.ErrorLine(500, "x"), c.TokenLine([4], "stop", 7)]
    raw = b"".join(c.dump_line(line) for line in lines)
    assert c.parse_lines(raw) == [c.parse_line(line) for line in raw.splitlines()] == lines
    assert c.parse_lines(b"\n" + raw + b"\n\n") == lines  # blank lines skipped
    with pytest.raises(c.ContractError, match="invalid line"):
        c.parse_lines(raw + b'{"type": "tokens", "token_ids": ["x"]}\n')
    with pytest.raises(c.ContractError, match="malformed JSON"):
        c.parse_lines(raw + b"{nope}\n")


def test_a_run_of_one_choice_joins_as_its_lines_would() -> None:
    rng = random.Random(0)
    for _ in range(200):
        lines = [c.TokenLine([rng.randrange(100) for _ in range(rng.randint(0, 3))]) for _ in range(rng.randint(2, 9))]
        if rng.random() < 0.5:
            lines[-1] = c.TokenLine([5], rng.choice(["stop", "length"]), 5 if rng.random() < 0.5 else None)
        assert c.join_runs(lines) == [c.join_lines(lines)]
    finished_early = [c.TokenLine([1], "length"), c.TokenLine([2])]
    assert c.join_runs(finished_early) == finished_early  # never past a finish
    choices = [c.TokenLine([1]), c.TokenLine([2], index=1), c.TokenLine([3])]
    assert c.join_runs(choices) == [c.TokenLine([1, 3]), c.TokenLine([2], index=1)]
    many = [c.TokenLine([1] * 600), c.TokenLine([2] * 600)]
    assert c.join_runs(many) == many  # one line holds MAX_LINE_TOKENS at most


@pytest.mark.parametrize("stop", [[], ["fibonacci(n - 2)"], ["never there"]], ids=["no stop", "hit", "no hit"])
@pytest.mark.parametrize("last", ["length", "eos"])
def test_the_token_loop_answers_alike_whatever_the_lines_carry(tok: Tokenizer, stop: list[str], last: str) -> None:
    """A token a line, or the same tokens in lines of several: the same text, tokens, finish and stop reason."""
    first, *body = tok.encode(TEXT).ids
    eos = tok.token_to_id("<|eos|>")
    ids = [*body, eos] if last == "eos" else body

    def run(size: int, stops: list[str] = stop) -> tuple[str, list[int], str | None, object]:
        loop = TokenLoop(tok, None, first, tok.decode([first]), stops)
        streamed = loop.first_delta()
        for at in range(0, len(ids), size):
            part = ids[at : at + size]
            end = at + size >= len(ids)
            finish = ("stop" if last == "eos" else "length") if end else None
            streamed += loop.feed(c.TokenLine(part, finish)).text  # type: ignore[arg-type]
            if loop.done:
                break
        assert streamed == loop.text
        return loop.text, loop.token_ids, loop.finish_reason, loop.stop_reason

    one = run(1)
    assert one[2] == ("stop" if stop == ["fibonacci(n - 2)"] or last == "eos" else "length")
    if stop == ["fibonacci(n - 2)"]:
        assert one[3] == stop[0] and not one[0].endswith(stop[0]) and len(one[1]) < 1 + len(ids)
    for size in (2, 3, 7, len(ids)):
        assert run(size) == one, size
    if not stop:  # the loop's path without stop strings answers as its path with one that never matches
        assert run(1, ["never there"]) == one


def test_n_gaps_observed_at_once_are_n_observations() -> None:
    rng = random.Random(1)
    registries = CollectorRegistry(), CollectorRegistry()
    at_once, one_by_one = (
        Histogram("gap", "doc", ["m"], registry=r, buckets=(0.001, 0.01, 0.1, 1.0)).labels("x") for r in registries
    )
    many = ManyObservations(at_once)
    for _ in range(500):
        value, n = rng.choice([0.0005, 0.001, 0.0011, 0.01, 0.5, 2.0, rng.random()]), rng.randint(1, 9)
        many.observe(value, n)
        for _ in range(n):
            one_by_one.observe(value)

    def samples(registry: CollectorRegistry) -> list[str]:
        return [s for s in generate_latest(registry).decode().splitlines() if "_sum" not in s and "_created" not in s]

    assert samples(registries[0]) == samples(registries[1])
    assert at_once._sum.get() == pytest.approx(one_by_one._sum.get())  # type: ignore[attr-defined]
