"""``n`` choices on the TileRT pool, through the router (stock vLLM prefill + the decode node) with the real OpenAI
client, against the stack's vLLM alone.

- vLLM refuses ``n`` > 1 when greedy (``SamplingParams``: "n must be 1 when using greedy sampling"), and so does the
  router, before any prefill. The deterministic oracle is the greedy argmax sampled at temperature 1 with
  ``top_k=1``, which vLLM serves with ``n`` > 1: every choice equals vLLM alone's greedy answer (choice 0 continues
  prefill's token on the node, the others draw theirs on the node from the prompt's last position), streamed and
  not, chat and completions, with vLLM's choice indexes, finish reasons and usage (the sum over the choices).
- Sampled with a ``seed`` (temperature 1): the same choices twice, streamed as not, the choices apart from each
  other, choice 0 the request's own stream (what ``n=1`` with that seed answers), and stop strings per choice.
- ``n`` above what a decode node decodes at once, ``n=0``, greedy ``n`` > 1: a 400 naming ``n`` before any prefill,
  no slot held; a client that leaves mid-stream frees every slot of its choices.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from support.oracle import vllm_alone
from support.stack import Stack
from support.waiting import wait_until

MAX_TOKENS = 32
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
SEED = 7
ARGMAX = {"temperature": 1.0, "top_k": 1}  # greedy's tokens, sampled: what vLLM serves with n > 1

pytestmark = pytest.mark.stack


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=120, max_retries=0)


def _prompt(kind: str) -> dict[str, Any]:
    return {"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT}


def _health(stack: Stack) -> dict[str, Any]:
    return httpx.get(stack.decode + "/health", timeout=10).json()


def _ask(stack: Stack, kind: str, n: int, stream: bool, **fields: Any) -> dict[str, Any]:
    """The router's answer through the OpenAI client, choice by choice (by index): text, token ids and finish
    reason; the usage; the indexes as the client saw them (each chunk's, streamed)."""
    api = _client(stack).chat.completions if kind == "chat" else _client(stack).completions
    extra = {"return_token_ids": True, **{k: v for k, v in fields.items() if k in ("top_k", "stop")}}
    kwargs = {k: v for k, v in fields.items() if k not in extra}
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    resp = api.create(
        model=str(stack.model), n=n, max_tokens=MAX_TOKENS, stream=stream, extra_body=extra, **_prompt(kind), **kwargs
    )
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finish: dict[int, str | None] = {}
    seen: list[int] = []
    usage: dict[str, int] = {}
    for chunk in resp if stream else [resp]:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump(exclude_none=True)
        for choice in chunk.choices:
            seen.append(choice.index)
            part = choice.text if kind != "chat" else (choice.delta if stream else choice.message).content
            texts[choice.index] = texts.get(choice.index, "") + (part or "")
            ids.setdefault(choice.index, []).extend((choice.model_extra or {}).get("token_ids") or [])
            if choice.finish_reason is not None:
                assert finish.get(choice.index) is None, f"choice {choice.index} finished twice"
                finish[choice.index] = choice.finish_reason
    return {"texts": texts, "ids": ids, "finish": finish, "usage": usage, "seen": seen}


def _vllm_alone_choices(stack: Stack, kind: str, n: int, **fields: Any) -> list[dict[str, Any]]:
    """vLLM's own choices for the same request (no connector involved), sorted by index."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {"model": str(stack.model), "n": n, "max_tokens": MAX_TOKENS, "return_token_ids": True, **fields}
    r = httpx.post(stack.prefill + path, json={**body, **_prompt(kind)}, timeout=120)
    r.raise_for_status()
    return sorted(r.json()["choices"], key=lambda choice: choice["index"])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_two_argmax_choices_each_equal_vllm_alones_greedy_answer(stack: Stack, kind: str, stream: bool) -> None:
    want_ids, want_text, prompt_tokens = vllm_alone(stack, kind, MESSAGES if kind == "chat" else PROMPT)
    assert len(want_ids) == MAX_TOKENS
    alone = _vllm_alone_choices(stack, kind, 2, **ARGMAX)
    assert [c["token_ids"] for c in alone] == [want_ids, want_ids], "vLLM alone: top_k=1 is its greedy answer"
    got = _ask(stack, kind, 2, stream, **ARGMAX)
    assert got["ids"] == {0: want_ids, 1: want_ids}
    assert got["texts"] == {0: want_text, 1: want_text}
    assert got["finish"] == {0: "length", 1: "length"} == {c["index"]: c["finish_reason"] for c in alone}
    assert got["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 2 * MAX_TOKENS,  # vLLM's count: every choice's tokens
        "total_tokens": prompt_tokens + 2 * MAX_TOKENS,
    }
    assert set(got["seen"]) == {0, 1} and (stream or got["seen"] == [0, 1])  # non-streamed: sorted by index
    health = _health(stack)
    assert health["slots_free"] == health["slots_total"]


def test_seeded_choices_are_reproducible_and_apart(stack: Stack) -> None:
    sampled = {"temperature": 1.0, "seed": SEED}
    first = _ask(stack, "completion", 3, False, **sampled)
    again = _ask(stack, "completion", 3, False, **sampled)
    streamed = _ask(stack, "completion", 3, True, **sampled)
    assert first["texts"] == again["texts"] == streamed["texts"]
    assert first["ids"] == again["ids"] == streamed["ids"]
    assert [len(first["ids"][i]) for i in range(3)] == [MAX_TOKENS] * 3
    assert len(set(first["texts"].values())) == 3, f"three choices sampled apart: {first['texts']}"
    assert first["usage"]["completion_tokens"] == 3 * MAX_TOKENS == streamed["usage"]["completion_tokens"]
    one = _ask(stack, "completion", 1, False, **sampled)  # choice 0 is the request's own stream
    assert one["ids"][0] == first["ids"][0]
    # vLLM seeds a parallel request's choice i with seed + i: choice 0's first token is prefill's, seeded as vLLM's.
    alone = _vllm_alone_choices(stack, "completion", 3, **sampled)
    assert alone[0]["token_ids"][0] == first["ids"][0][0]


def test_stop_strings_apply_to_each_choice_on_its_own(stack: Stack) -> None:
    sampled = {"temperature": 1.0, "seed": SEED}
    free = _ask(stack, "completion", 3, False, **sampled)["texts"]
    stop = next(
        free[1][i : i + 3]
        for i in range(4, len(free[1]) - 3)
        if free[1][i : i + 3].strip() and free[1][i : i + 3] not in free[0]
    )
    for stream in (False, True):
        got = _ask(stack, "completion", 3, stream, stop=[stop], **sampled)
        for i in range(3):
            cut = free[i].find(stop)
            assert got["texts"][i] == (free[i] if cut < 0 else free[i][:cut]), (i, stop)
            assert got["finish"][i] == ("length" if cut < 0 else "stop"), (i, stop)
        assert got["finish"][0] == "length" and got["finish"][1] == "stop"


def test_invalid_n_is_refused_before_prefill_holding_no_slot(stack: Stack) -> None:
    before = _health(stack)
    cap = before["max_choices"]  # the sequences the node decodes at once
    assert 2 <= cap <= before["slots_total"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"n": cap + 1, "temperature": 1.0}, f"n must be at most {cap}"),
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": 2, "temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ]
    for fields, message in cases:
        with pytest.raises(BadRequestError) as refused:
            _client(stack).completions.create(model=str(stack.model), prompt=PROMPT, max_tokens=4, **fields)
        assert refused.value.status_code == 400 and message in refused.value.message
        assert refused.value.body["param"] == "n"  # type: ignore[index]
    for fields, _ in cases[1:]:  # what vLLM itself refuses, it refuses too
        r = httpx.post(
            stack.prefill + "/v1/completions",
            json={"model": str(stack.model), "prompt": PROMPT, "max_tokens": 4, **fields},
            timeout=60,
        )
        assert r.status_code == 400, r.text
    after = _health(stack)
    assert after["slots_free"] == after["slots_total"]
    assert after["transfers_received"] == before["transfers_received"]  # no prefill ran


def test_client_gone_mid_stream_frees_every_choices_slot(stack: Stack) -> None:
    body = {"model": str(stack.model), "prompt": "def main():", "max_tokens": 1500, "stream": True, "n": 2, "seed": 3}
    total = _health(stack)["slots_total"]
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", stack.router + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                events += line.startswith("data: ")
                if events == 4:  # mid-stream: both choices hold a slot each
                    assert _health(stack)["slots_free"] == total - 2
                if events >= 6:
                    break
    wait_until(lambda: _health(stack)["slots_free"] == total, 5, "every slot free after the client left", 0.1)
