"""Unit tests of the router's request validation (no servers): schema, field coverage, bounds, the plan."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tilert.router import openai_schema as schema
from tilert.router.errors import RouterError
from tilert.router.validation import RequestPlan, build_plan, continuation

ROUTES = ("chat", "completions")
BASE: dict[str, dict[str, Any]] = {
    "chat": {"messages": [{"role": "user", "content": "hi"}]},
    "completions": {"prompt": "hi"},
}
KV = {"tilert_host": "10.0.0.1", "tilert_ctrl_port": 7000, "tilert_transfer_id": "t-1"}

# A realistic value that is not neutral, for every refused field (a new refused field needs one here).
NON_NEUTRAL: dict[str, Any] = {
    "use_beam_search": True,
    "length_penalty": 0.8,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.1,
    "min_p": 0.05,
    "logit_bias": {"50256": -100},
    "bad_words": ["darn"],
    "allowed_token_ids": [1, 2, 3],
    "watermarking": True,
    "vllm_xargs": {"my_processor": 1},
    "min_tokens": 4,
    "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "a+"},
    "repetition_detection": {"max_pattern_size": 8, "min_count": 3},
    "thinking_token_budget": 100,
    "logprob_token_ids": [5],
    "echo": True,
    "spaces_between_special_tokens": False,
    "stream_interval": 4,
    "routed_experts_prompt_start": 3,
    "return_token_offsets": True,
    "mm_payload": "none",
    "return_mm_kwargs": False,
    "request_id": "my-id",
    "kv_transfer_params": {},
    "ec_transfer_params": {"x": 1},
    "include_reasoning": False,
    "return_prompt_text": True,
    "prompt_embeds": "AAAA",
}
NON_NEUTRAL_BY_ROUTE: dict[str, dict[str, Any]] = {"chat": {}, "completions": {}}


def raw_of(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


def plan_of(route: str, body: dict[str, Any] | bytes, **kwargs: Any) -> RequestPlan:
    return build_plan(route, raw_of(body), **kwargs)  # type: ignore[arg-type]


def refusal(route: str, body: dict[str, Any] | bytes, **kwargs: Any) -> RouterError:
    """Why the TileRT pool refuses the request: a 400 from validation, or the refusal its plan carries (the
    native pool may serve it)."""
    with pytest.raises(RouterError) as info:
        plan = plan_of(route, body, **kwargs)
        if plan.fast_pool_refusal is not None:
            raise plan.fast_pool_refusal
    return info.value


def with_base(route: str, **fields: Any) -> dict[str, Any]:
    return {**BASE[route], **fields}


def prefill_json(plan: RequestPlan) -> dict[str, Any]:
    return orjson.loads(orjson.dumps(plan.prefill_body(KV)))


# --- every vLLM field is honoured or refused ------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_models() -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"chat": ChatCompletionRequest, "completions": CompletionRequest}


@pytest.mark.parametrize("route", ROUTES)
def test_every_vllm_field_is_classified(route: str, vllm_models: dict[str, Any]) -> None:
    vllm_fields = {f.alias or name for name, f in vllm_models[route].model_fields.items()}
    ours = set(schema.SCHEMAS[route].__struct_fields__)
    assert vllm_fields - ours == set(), "vLLM fields neither honoured nor refused: classify them in openai_schema"
    assert ours - vllm_fields == set(), "schema fields vLLM does not know"
    groups = [schema.PASSED_TO_VLLM[route], schema.HONOURED_BY_DECODE[route], set(schema.REFUSED[route])]
    assert set().union(*groups) == ours
    assert sum(len(g) for g in groups) == len(ours), "a field is in two groups"
    assert schema.DECODE_FIELDS_FOR_PREFILL <= schema.HONOURED_BY_DECODE[route]


REFUSED_CASES = [(route, name) for route in ROUTES for name in schema.REFUSED[route]]


@pytest.mark.parametrize(("route", "name"), REFUSED_CASES)
def test_refused_field_with_a_real_value_is_400_naming_it(route: str, name: str) -> None:
    value = NON_NEUTRAL_BY_ROUTE[route].get(name, NON_NEUTRAL.get(name, KeyError))
    assert value is not KeyError, f"add a non-neutral sample value for {name!r}"
    err = refusal(route, with_base(route, **{name: value}))
    assert (err.status, err.param, err.outcome) == (400, name, "unsupported")
    assert f"'{name}'" in err.message
    if name in schema.NO_POOL:  # refused whichever pool: before any plan
        with pytest.raises(RouterError):
            plan_of(route, with_base(route, **{name: value}))
    else:  # the native pool gets the field as sent
        assert plan_of(route, with_base(route, **{name: value})).body[name] == value


def test_a_constraint_the_node_does_not_compile_is_left_to_the_native_pool() -> None:
    """A structural tag: the TileRT pool refuses it, the plan keeps it for vLLM (which compiles it)."""
    fmt = {"type": "structural_tag", "format": {"type": "any_text"}}
    plan = plan_of("chat", with_base("chat", response_format=fmt))
    assert plan.grammar is None and plan.fast_pool_refusal is not None
    assert plan.fast_pool_refusal.param == "response_format"
    assert prefill_json(plan)["response_format"] == fmt
    assert refusal("chat", with_base("chat", response_format={"type": "xml"})).outcome == "bad_request"


def test_a_refused_field_that_cannot_be_sent_on_is_400() -> None:
    """The native pool would get the field as sent: a JSON integer past 64 bits cannot be."""
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "include_reasoning": [-9223372036854775809]}'
    err = refusal("chat", raw)
    assert (err.status, err.param) == (400, "include_reasoning")


@pytest.mark.parametrize(("route", "name"), REFUSED_CASES)
def test_refused_field_absent_null_or_neutral_is_accepted_and_not_forwarded(route: str, name: str) -> None:
    neutral, _ = schema.REFUSED[route][name]
    for value in (None, *neutral):
        plan = plan_of(route, with_base(route, **{name: value}))
        assert name not in plan.body
        assert prefill_json(plan)["kv_transfer_params"] == KV


@pytest.mark.parametrize(
    ("name", "value"), [("n", True), ("n", 1.0), ("presence_penalty", False), ("echo", 0), ("logprobs", 0)]
)
def test_a_neutral_value_must_have_the_neutral_json_type(name: str, value: Any) -> None:
    assert refusal("chat", with_base("chat", **{name: value})).param == name


def test_kv_transfer_params_come_from_the_router_only() -> None:
    assert refusal("chat", with_base("chat", kv_transfer_params={"tilert_host": "evil"})).param == "kv_transfer_params"
    assert refusal("completions", with_base("completions", ec_transfer_params={})).param == "ec_transfer_params"
    assert prefill_json(plan_of("chat", with_base("chat", kv_transfer_params=None)))["kv_transfer_params"] == KV


@pytest.mark.parametrize(
    ("route", "name"),
    [
        ("chat", "temprature"),
        ("chat", "functions"),  # legacy OpenAI, gone from vLLM
        ("chat", "best_of"),
        ("chat", "guided_json"),  # removed from vLLM
        ("chat", "prompt"),  # the other route's field
        ("chat", "suffix"),
        ("completions", "messages"),
        ("completions", "max_completion_tokens"),
        ("completions", "top_logprobs"),
        ("completions", "odd key-with spaces"),
    ],
)
def test_unknown_field_is_400_naming_it(route: str, name: str) -> None:
    err = refusal(route, with_base(route, **{name: 1}))
    assert (err.status, err.param) == (400, name)
    assert name in err.message


def test_unknown_nested_field_is_400() -> None:
    err = refusal("chat", with_base("chat", stream=True, stream_options={"include_usage": True, "sneaky": 1}))
    assert err.status == 400 and err.param == "stream_options" and "sneaky" in err.message


# --- strict types -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "raw_value"),
    [
        ("max_tokens", b"true"),
        ("max_tokens", b'"5"'),
        ("max_tokens", b"1.5"),
        ("max_tokens", b"0"),
        ("max_tokens", b"2147483648"),
        ("max_completion_tokens", b"false"),
        ("top_k", b"true"),
        ("top_k", b"2.0"),
        ("top_k", b"-2"),
        ("seed", b"false"),
        ("seed", b"9223372036854775808"),
        ("seed", b"-9223372036854775809"),
        ("seed", b"123456789012345678901234567890"),
        ("temperature", b'"0.5"'),
        ("temperature", b"true"),
        ("temperature", b"-0.1"),
        ("temperature", b"1e999"),
        ("temperature", b"-1e999"),
        ("temperature", b"1e7"),
        ("top_p", b"0"),
        ("top_p", b"1.01"),
        ("top_p", b"1e999"),
        ("top_p", b"[]"),
        ("stream", b"1"),
        ("stream", b'"true"'),
        ("ignore_eos", b"0"),
        ("stop", b'[""]'),
        ("stop", b"[1]"),
        ("stop", b"5"),
        ("stop", orjson.dumps(["x"] * 65)),
        ("stop", orjson.dumps("x" * 1025)),
        ("stop_token_ids", b"[-1]"),
        ("stop_token_ids", b"[true]"),
        ("stop_token_ids", orjson.dumps(list(range(65)))),
        ("stream_options", b"true"),
        ("model", b"5"),
        ("priority", b"1.0"),
        ("truncation_side", b'"middle"'),
        ("reasoning_effort", b'"extreme"'),
        ("chat_template_kwargs", b"[]"),
        ("messages", b'"hi"'),
        ("messages", b"[]"),
        ("messages", b"null"),
        ("messages", orjson.dumps([{}] * (schema.MAX_MESSAGES + 1))),
    ],
)
def test_wrong_type_or_range_is_400_naming_the_field(name: str, raw_value: bytes) -> None:
    # a duplicate key replaces the earlier one, as in vLLM's JSON parser
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "' + name.encode() + b'": ' + raw_value
    err = refusal("chat", raw + b"}")
    assert (err.status, err.param, err.outcome) == (400, name, "bad_request"), err.message


@pytest.mark.parametrize(
    "prompt",
    [[], [-1], [True], [1.5], [[]], ["a", "b"], [[1], [2]], [1, "a"], {"text": "x"}, None, 5],
)
def test_bad_or_batched_prompt_is_400(prompt: Any) -> None:
    err = refusal("completions", {"prompt": prompt})
    assert (err.status, err.param) == (400, "prompt")


def test_prompt_forms_vllm_accepts_for_one_prompt() -> None:
    for prompt in ("hi", [1, 2, 3], ["hi"], [[1, 2]], [7]):
        assert plan_of("completions", {"prompt": prompt}).body["prompt"] == prompt
    assert refusal("completions", {}).param == "prompt"


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[]", b"null", b'"x"', b"{} {}", b"{'a': 1}", b'{"messages": [NaN]}', b"\xef\xbb\xbf{}"]
)
def test_not_a_json_object_is_400(raw: bytes) -> None:
    err = refusal("chat", raw)
    assert err.status == 400


def test_invalid_utf8_even_inside_loose_content_is_400() -> None:
    err = refusal("chat", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}')
    assert err.status == 400 and "UTF-8" in err.message


# --- bounds ----------------------------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    """A chat body whose deepest value is ``depth`` levels down (the top-level object is level 1)."""
    inner = depth - 3  # body {, messages [, message {
    return b'{"messages": [{"role": "user", "content": ' + b"[" * inner + b"]" * inner + b"}]}"


@pytest.mark.parametrize("depth", [33, 34, 300, 1000, 5000, 100_000])
def test_deep_nesting_is_400_not_an_exception(depth: int) -> None:
    err = refusal("chat", nested(depth))
    assert err.status == 400 and "nested deeper than 32" in err.message


def test_nesting_at_the_limit_passes_and_reserialises() -> None:
    plan = plan_of("chat", nested(schema.MAX_DEPTH))
    assert orjson.loads(orjson.dumps(plan.prefill_body(KV)))["messages"][0]["content"]
    objects = b'{"chat_template_kwargs": ' + b'{"a": ' * 31 + b"1" + b"}" * 31 + b', "messages": [{}]}'
    assert plan_of("chat", objects).body["chat_template_kwargs"]
    err = refusal("chat", objects.replace(b'{"a": ', b'{"a": {"a": ', 1).replace(b"1}", b"1}}", 1))
    assert "nested deeper" in err.message


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    content = "[{" * 500 + '\\"]' + "}]" * 500
    assert plan_of("chat", {"messages": [{"role": "user", "content": content}]}).body["messages"]


def test_body_over_the_byte_limit_is_413() -> None:
    raw = raw_of(BASE["chat"])
    padded = raw[:-1] + b" " * (1000 - len(raw)) + b"}"
    assert len(padded) == 1000
    assert plan_of("chat", padded, max_body_bytes=1000).route == "chat"
    err = refusal("chat", padded + b" ", max_body_bytes=1000)
    assert (err.status, err.outcome) == (413, "too_large")
    assert refusal("chat", b" " * ((16 << 20) + 1)).status == 413


def test_loose_content_is_forwarded_byte_for_byte() -> None:
    raw = (
        b'{"messages": [{"role": "user", "content": "caf\xc3\xa9 \\u00e9", "n": 123456789012345678901234567890,'
        b' "x": 1.0e+5}], "chat_template_kwargs": {"enable_thinking": false, "k": [1, {"a": null}]}}'
    )
    out = orjson.dumps(plan_of("chat", raw).prefill_body(KV))
    assert b'"content": "caf\xc3\xa9 \\u00e9", "n": 123456789012345678901234567890, "x": 1.0e+5}' in out
    assert b'"chat_template_kwargs":{"enable_thinking":false,"k":[1, {"a": null}]}' in out


# --- sampling and max_tokens -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "planned"),
    [(0, 0.0), (0.0, 0.0), (1e-300, 0.0), (5e-324, 0.0), (9.9e-6, 0.0), (1e-5, 0.01), (0.005, 0.01), (0.7, 0.7)],
)
def test_tiny_temperature_is_greedy_and_small_ones_are_raised(temperature: float, planned: float) -> None:
    plan = plan_of("chat", with_base("chat", temperature=temperature))
    assert plan.temperature == planned and type(plan.temperature) is float
    assert prefill_json(plan)["temperature"] == planned  # the first token is sampled the same way


def test_sampling_fields_reach_the_plan() -> None:
    plan = plan_of("completions", with_base("completions", top_p=1e-300, top_k=-1, seed=-1, ignore_eos=True))
    assert (plan.top_p, plan.top_k, plan.seed, plan.ignore_eos) == (1e-300, -1, None, True)
    plan = plan_of("completions", with_base("completions", top_k=0, seed=2**63 - 1, stop="\n"))
    assert (plan.top_k, plan.seed, plan.stop) == (0, 2**63 - 1, ["\n"])
    plan = plan_of("chat", BASE["chat"])
    assert (plan.temperature, plan.top_p, plan.top_k, plan.seed, plan.stop, plan.stop_token_ids) == (
        None,
        None,
        None,
        None,
        [],
        [],
    )
    assert (plan.ignore_eos, plan.skip_special_tokens, plan.include_stop_str_in_output) == (False, True, False)


@pytest.mark.parametrize(
    ("route", "fields", "default", "expected"),
    [
        ("chat", {}, None, None),  # until the context is full
        ("chat", {"max_tokens": None, "max_completion_tokens": None}, None, None),
        ("chat", {}, 256, 256),
        ("chat", {"max_tokens": 7}, 256, 7),
        ("chat", {"max_completion_tokens": 5, "max_tokens": 7}, None, 5),
        ("chat", {"max_completion_tokens": None, "max_tokens": 7}, None, 7),
        ("completions", {}, None, 16),  # vLLM 0.32's CompletionRequest default
        ("completions", {}, 256, 256),
        ("completions", {"max_tokens": None}, None, 16),
        ("completions", {"max_tokens": None}, 256, 256),
        ("completions", {"max_tokens": 1}, 256, 1),
    ],
)
def test_max_tokens(route: str, fields: dict[str, Any], default: int | None, expected: int | None) -> None:
    assert plan_of(route, with_base(route, **fields), default_max_tokens=default).max_tokens == expected


def test_stream_options_need_stream() -> None:
    for stream in (False, None):
        err = refusal("chat", with_base("chat", stream=stream, stream_options={"include_usage": True}))
        assert err.param == "stream_options"
    plan = plan_of("chat", with_base("chat", stream=True, stream_options={"continuous_usage_stats": True}))
    assert (plan.stream, plan.include_usage, plan.continuous_usage) == (True, False, True)
    plan = plan_of("chat", with_base("chat", stream=False, stream_options=None))
    assert (plan.stream, plan.include_usage, plan.continuous_usage) == (False, False, False)


# --- whole requests --------------------------------------------------------------------------------------------


def test_a_full_chat_request(vllm_models: dict[str, Any]) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    sent = {
        "model": "m",
        "messages": messages,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "max_completion_tokens": 50,
        "max_tokens": 80,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2],
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "ignore_eos": False,
        "user": "u",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "n": 1,
        "logprobs": False,
        "top_logprobs": None,
        "presence_penalty": 0.0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "cache_salt": "s" * 43,
        "reasoning_effort": "low",
    }
    plan = plan_of("chat", sent)
    assert (plan.route, plan.path, plan.stream, plan.include_usage, plan.continuous_usage) == (
        "chat",
        "/v1/chat/completions",
        True,
        True,
        False,
    )
    assert (plan.max_tokens, plan.temperature, plan.top_p, plan.top_k, plan.seed) == (50, 0.7, 0.9, 40, 7)
    assert (plan.stop, plan.stop_token_ids, plan.ignore_eos) == (["\n\n", "END"], [2], False)
    assert (plan.include_stop_str_in_output, plan.skip_special_tokens, plan.return_token_ids) == (True, False, True)
    body = prefill_json(plan)
    assert body == {
        "model": "m",
        "messages": messages,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "seed": 7,
        "stop": ["\n\n", "END"],
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "ignore_eos": False,
        "user": "u",
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": True,
        "cache_salt": "s" * 43,
        "reasoning_effort": "low",
        "presence_penalty": 0.0,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "max_tokens": 1,
        "stream": False,
        "return_token_ids": True,
        "kv_transfer_params": KV,
    }
    vllm_models["chat"].model_validate(body)  # vLLM accepts what the prefill gets
    assert not hasattr(plan, "decode_body")


def test_logits_rules_are_planned_and_go_to_the_prefill(vllm_models: dict[str, Any]) -> None:
    rules = {
        "min_tokens": 4,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "logit_bias": {"7": 250, "9": -3},
        "bad_words": ["darn"],
        "allowed_token_ids": [1, 2, 3],
    }
    plan = plan_of("completions", with_base("completions", max_tokens=20, **rules))
    assert plan.logit_bias == {7: 100.0, 9: -3.0}  # clamped as vLLM does
    assert (plan.min_tokens, plan.frequency_penalty, plan.presence_penalty) == (4, 0.5, -0.5)
    assert (plan.repetition_penalty, plan.min_p, plan.bad_words, plan.allowed_token_ids) == (
        1.1,
        0.05,
        ["darn"],
        [1, 2, 3],
    )
    body = prefill_json(plan)
    assert body["min_tokens"] == 1, "vLLM wants min_tokens <= max_tokens: the prefill makes one token"
    assert {k: body[k] for k in rules if k != "min_tokens"} == {k: v for k, v in rules.items() if k != "min_tokens"}
    vllm_models["completions"].model_validate(body)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": 1.01}, "min_p"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_logits_rules_are_refused(fields: dict[str, Any], param: str) -> None:
    assert refusal("completions", with_base("completions", **fields)).param == param


@pytest.mark.parametrize(
    ("route", "fields", "planned", "forwarded"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 5}, 5, {"logprobs": True, "top_logprobs": 5}),
        ("chat", {"logprobs": True, "top_logprobs": None}, 0, {"logprobs": True}),
        ("chat", {"logprobs": False, "top_logprobs": 0}, None, {"top_logprobs": 0}),
        ("chat", {"prompt_logprobs": 3}, None, {"prompt_logprobs": 3}),
        ("completions", {"logprobs": 0}, 0, {"logprobs": 0}),
        ("completions", {"logprobs": 20, "echo": True}, 20, {"logprobs": 20, "echo": True}),
        (
            "completions",
            {"echo": False, "return_tokens_as_token_ids": True},
            None,
            {"return_tokens_as_token_ids": True},
        ),
    ],
)
def test_logprobs_are_planned_and_go_to_the_prefill(
    vllm_models: dict[str, Any], route: str, fields: dict[str, Any], planned: int | None, forwarded: dict[str, Any]
) -> None:
    plan = plan_of(route, with_base(route, **fields))
    assert plan.fast_pool_refusal is None and plan.logprobs == planned
    assert (plan.echo, plan.tokens_as_ids) == (fields.get("echo") is True, "return_tokens_as_token_ids" in fields)
    body = prefill_json(plan)
    assert {k: body[k] for k in schema.LOGPROBS[route] if k in body} == forwarded
    vllm_models[route].model_validate(body)
    resumed = continuation(plan, [1, 2, 3], 8, 2)
    if planned is None:
        assert "logprobs" not in resumed.body
    else:  # the resumed stream's token: its logprobs read back by id
        assert resumed.body["logprobs"] == planned and resumed.body["return_tokens_as_token_ids"] is True
    assert "echo" not in resumed.body and "prompt_logprobs" not in resumed.body


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "greater than max allowed: 20"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "the whole vocabulary"),
        ("chat", {"top_logprobs": 2}, "top_logprobs", "`logprobs` must be set to true"),
        ("chat", {"logprobs": True, "top_logprobs": -2}, "top_logprobs", "must be a positive value or -1"),
        ("completions", {"logprobs": 21}, "logprobs", "Requested sample logprobs of 21"),
        ("completions", {"logprobs": -5}, "logprobs", "must be a positive value or -1"),
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21"),
        ("completions", {"prompt_logprobs": 0, "stream": True, "echo": True}, None, None),
        ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream=True`"),
        ("completions", {"logprobs": True}, "logprobs", "Expected `int"),
        ("chat", {"logprobs": 1}, "logprobs", "Expected `bool"),
        ("completions", {"echo": 1}, "echo", "Expected `bool"),
    ],
)
def test_bad_logprobs_are_refused_as_vllm_refuses_them(
    route: str, fields: dict[str, Any], param: str | None, message: str | None
) -> None:
    if param is None:  # vLLM accepts it
        assert plan_of(route, with_base(route, **fields)).fast_pool_refusal is None
        return
    err = refusal(route, with_base(route, **fields))
    assert (err.status, err.param) == (400, param) and message in err.message, err.message


def test_a_full_completions_request(vllm_models: dict[str, Any]) -> None:
    sent = {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 20,
        "temperature": 0,
        "seed": -1,
        "stop": "x",
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "echo": False,
        "logprobs": None,
        "suffix": None,
        "truncate_prompt_tokens": 100,
        "add_special_tokens": False,
    }
    plan = plan_of("completions", sent)
    assert (plan.path, plan.max_tokens, plan.temperature, plan.seed, plan.stop) == (
        "/v1/completions",
        20,
        0.0,
        None,
        ["x"],
    )
    assert (plan.include_usage, plan.continuous_usage, plan.return_token_ids) == (True, True, False)
    body = prefill_json(plan)
    assert body == {
        "model": "m",
        "prompt": [1, 2, 3],
        "temperature": 0.0,
        "seed": -1,
        "stop": "x",
        "truncate_prompt_tokens": 100,
        "add_special_tokens": False,
        "max_tokens": 1,
        "stream": False,
        "return_token_ids": True,
        "kv_transfer_params": KV,
    }
    vllm_models["completions"].model_validate(body)


def test_prefill_body_does_not_alias_the_plan() -> None:
    plan = plan_of("chat", BASE["chat"])
    plan.prefill_body(KV)["model"] = "changed"
    assert "model" not in plan.body and "max_tokens" not in plan.body


# --- property: nothing but a 4xx RouterError ---------------------------------------------------------------------

FIELD_NAMES = sorted({name for route in ROUTES for name in schema.SCHEMAS[route].__struct_fields__})
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
BODIES = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=12), JSON, max_size=6)


def check_outcome(route: str, raw: bytes) -> None:
    try:
        plan = build_plan(route, raw)  # type: ignore[arg-type]
    except RouterError as exc:
        assert 400 <= exc.status < 500, exc.message
        return
    orjson.loads(orjson.dumps(plan.prefill_body(KV)))  # the prefill body re-serialises to valid JSON


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ROUTES), BODIES, st.booleans())
def test_random_json_bodies_are_a_plan_or_a_4xx(route: str, extra: dict[str, Any], keep_base: bool) -> None:
    body = {**BASE[route], **extra} if keep_base else extra
    check_outcome(route, json.dumps(body).encode())  # json, not orjson: integers beyond 64 bits too


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ROUTES), st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_random_bytes_are_a_plan_or_a_4xx(route: str, raw: bytes) -> None:
    check_outcome(route, raw)


# --- n: vLLM's limits, and the prefill samples one choice ---------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_n_choices_are_the_decodes_not_the_prefills(route: str) -> None:
    plan = plan_of(route, with_base(route, n=3, seed=4))
    assert plan.n == 3 and plan.fast_pool_refusal is None and not plan.resumable
    body = prefill_json(plan)
    assert "n" not in body and body["seed"] == 4  # vLLM samples choice 0's first token, one choice
    assert plan_of(route, with_base(route)).n == 1 and plan_of(route, with_base(route, n=None)).n == 1


@pytest.mark.parametrize(
    ("fields", "defaults", "message"),
    [
        ({"n": 0}, {}, "n must be at least 1, got 0."),
        ({"n": -3}, {}, "n must be at least 1, got -3."),
        ({"n": 2, "temperature": 0}, {}, "n must be 1 when using greedy sampling, got 2."),
        ({"n": 2, "temperature": 1e-6}, {}, "n must be 1 when using greedy sampling, got 2."),
        ({"n": 2}, {"temperature": 0.0}, "n must be 1 when using greedy sampling, got 2."),  # the model's default
    ],
)
def test_n_is_refused_as_vllm_refuses_it(fields: dict[str, Any], defaults: dict[str, Any], message: str) -> None:
    for route in ROUTES:
        err = refusal(route, with_base(route, **fields), sampling_defaults=defaults)
        assert (err.status, err.param, err.message) == (400, "n", message)
    assert plan_of("chat", with_base("chat", n=2), sampling_defaults={"temperature": 0.7}).n == 2


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("chat", {"logprobs": True}),
        ("chat", {"prompt_logprobs": 2}),
        ("completions", {"logprobs": 2}),
        ("completions", {"echo": True}),
    ],
)
def test_several_choices_with_logprobs_are_left_to_the_native_pool(route: str, fields: dict[str, Any]) -> None:
    """One choice carries log-probabilities and echo on the TileRT pool: with n > 1 they are its refusal, naming n;
    the same fields alone, or n alone, are served."""
    plan = plan_of(route, with_base(route, n=2, temperature=1.0, **fields))
    assert plan.fast_pool_refusal is not None and plan.fast_pool_refusal.param == "n"
    assert plan_of(route, with_base(route, temperature=1.0, **fields)).fast_pool_refusal is None
    assert plan_of(route, with_base(route, n=2, temperature=1.0)).fast_pool_refusal is None
