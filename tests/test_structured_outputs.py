"""Structured outputs on the TileRT pool: ``response_format`` (``json_object``, ``json_schema``) and
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``), the decode node matching each step with
xgrammar as vLLM's default backend does.

Through the router (stock vLLM prefill + the decode node), greedy, the answer equals what vLLM alone answers to
the same request, streamed and not; each constrained answer differs from the unconstrained one and keeps to its
constraint. What the node does not compile is refused before prefill with the field named.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from openai import BadRequestError, OpenAI
from support.oracle import router_answer, vllm_alone
from support.stack import Stack

from tilert.decode.grammar import is_lark
from tilert.router.structured import choice_as_grammar

MAX_TOKENS = 40
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe later"]
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
EBNF = 'root ::= "x" ("ab" | "cd")+ "!"'

CASES: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "json_schema": (
        "chat",
        MESSAGES,
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
    ),
    "json_object": ("chat", MESSAGES, {"response_format": {"type": "json_object"}}),
    "json": ("completion", PROMPT, {"structured_outputs": {"json": SCHEMA}}),
    "regex": ("completion", PROMPT, {"structured_outputs": {"regex": REGEX}}),
    "choice": ("completion", PROMPT, {"structured_outputs": {"choice": CHOICES}}),
    "grammar": ("completion", PROMPT, {"structured_outputs": {"grammar": EBNF}}),
}


def _keeps_to(case: str, text: str, finished: bool) -> None:
    if case == "regex":
        assert re.fullmatch(REGEX, text) if finished else re.match(r"[a-c]", text), text
    elif case == "choice":
        assert text in CHOICES, text
    elif case == "grammar":
        assert re.fullmatch(r"x(ab|cd)+!", text) if finished else text.startswith("x"), text
    elif finished:
        value = json.loads(text)
        assert isinstance(value, dict)
        if case != "json_object":
            assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool) and len(value["name"]) <= 6


@pytest.mark.parametrize(
    ("case", "stream"), [(case, False) for case in CASES] + [("json_schema", True), ("choice", True)]
)
def test_router_equals_vllm_alone(stack: Stack, case: str, stream: bool) -> None:
    kind, prompt, fields = CASES[case]
    want, want_text, _ = vllm_alone(stack, kind, prompt, {"max_tokens": MAX_TOKENS, **fields})
    plain = vllm_alone(stack, kind, prompt, {"max_tokens": MAX_TOKENS})[0]
    assert want != plain, f"{case}: the constraint changed nothing; the case tests nothing"
    got, text, usage, pool = router_answer(
        stack.router, stack.model, kind, prompt, stream, max_tokens=MAX_TOKENS, extra=fields
    )
    assert pool == "tilert"
    assert got == want, case
    assert text == want_text
    _keeps_to(case, text, finished=len(got) < MAX_TOKENS)
    assert usage["completion_tokens"] == len(want)


def test_the_sdk_parses_a_json_schema_answer(stack: Stack) -> None:
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=120, max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model=str(stack.model),
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format=fmt,  # type: ignore[arg-type]
    )
    choice = reply.choices[0]
    _keeps_to("json_schema", choice.message.content or "", finished=choice.finish_reason == "stop")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}},
            "disable_any_whitespace",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ],
)
def test_what_the_node_does_not_compile_is_refused(stack: Stack, fields: dict[str, Any], param: str) -> None:
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(BadRequestError) as err:
        client.completions.create(model=str(stack.model), prompt=PROMPT, max_tokens=8, extra_body=fields)
    assert param in str(err.value)


def test_choice_grammar_and_lark_test_are_vllms() -> None:
    from vllm.v1.structured_output.utils import choice_as_grammar as vllm_choice
    from vllm.v1.structured_output.utils import grammar_is_likely_lark

    for choice in (CHOICES, ['say "hi"', "tab\there", "back\\slash", "nul\x00x"]):
        assert choice_as_grammar(choice) == vllm_choice(choice)
    for grammar in (EBNF, "start: 'a'+", "# comment ::= no\nstart: 'a'", "root ::= 'a' // x", ""):
        assert is_lark(grammar) == grammar_is_likely_lark(grammar), grammar
