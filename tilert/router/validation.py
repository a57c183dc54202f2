"""Validate an OpenAI request body and turn it into a :class:`RequestPlan`.

Everything the TileRT decode engine cannot honour is refused with a 400 and a reason, never ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from tilert.router.errors import RouterError, bad_request, unsupported

Route = Literal["chat", "completions"]

# Fields that change what decoding does and that the decode engine does not implement. A field is
# accepted only when absent, null, or equal to one of its listed neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "prompt_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "length_penalty": (1, 1.0),
    "min_tokens": (0,),
    "min_p": (0, 0.0),
    "use_beam_search": (False,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "tool_choice": ("none", "auto"),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_whitespace_pattern": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": ([],),
    "vllm_xargs": (),
    "spaces_between_special_tokens": (True,),
    "prompt_embeds": (),
}

_WHY: dict[str, str] = {
    "n": "only one choice per request",
    "best_of": "only one choice per request",
    "echo": "the prompt is not echoed",
    "logprobs": "decode does not return log-probabilities",
    "top_logprobs": "decode does not return log-probabilities",
    "prompt_logprobs": "decode does not return log-probabilities",
    "min_tokens": "decode does not suppress EOS",
    "min_p": "decode samples with temperature/top_p/top_k only",
    "use_beam_search": "no beam search",
    "logit_bias": "decode does not bias logits",
    "suffix": "no insertion mode",
    "tools": "no tool-call parsing on the decode path",
    "functions": "no tool-call parsing on the decode path",
    "function_call": "no tool-call parsing on the decode path",
    "tool_choice": "no tool-call parsing on the decode path",
    "bad_words": "decode does not ban words",
    "allowed_token_ids": "decode does not restrict the vocabulary",
    "logits_processors": "decode runs no logits processors",
}


@dataclass
class RequestPlan:
    """What the router will do with one client request."""

    route: Route
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int
    max_tokens_defaulted: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"

    def prefill_body(self, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """The client's body with ``max_tokens=1``, no streaming, token ids on, and the TileRT claim."""
        body = dict(self.body)
        body.pop("max_completion_tokens", None)
        body.pop("stream_options", None)
        body["max_tokens"] = 1
        body["stream"] = False
        body["return_token_ids"] = True
        body["kv_transfer_params"] = kv_transfer_params
        return body

    def decode_body(self, transfer_id: str, first_token_id: int, prompt_tokens: int) -> dict[str, Any]:
        return {
            "transfer_id": transfer_id,
            "first_token_id": first_token_id,
            "prompt_tokens": prompt_tokens,
            "max_tokens": self.max_tokens - 1,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop_token_ids": self.stop_token_ids or None,
            "ignore_eos": self.ignore_eos,
        }


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    if value is None:
        return True
    for n in neutral:
        if isinstance(n, bool) or isinstance(value, bool):
            if type(value) is type(n) and value == n:
                return True
        elif value == n:
            return True
    return False


def _number(body: dict[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number", key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise bad_request(f"'{key}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", key)
    return float(value)


def _int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    return value


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{key}' must be a boolean", key)
    return value


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def build_plan(route: Route, body: dict[str, Any], default_max_tokens: int) -> RequestPlan:
    """Validate ``body`` for ``route``; raise :class:`RouterError` (400) with the reason if it is refused."""
    for key, neutral in _NEUTRAL.items():
        if key in body and not _is_neutral(body[key], neutral):
            raise unsupported(key, _WHY.get(key, "not implemented by the decode engine"))
    response_format = body.get("response_format")
    if response_format is not None:
        if not (isinstance(response_format, dict) and response_format.get("type") == "text"):
            raise unsupported("response_format", "no structured output on the decode path")

    if route == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", "messages")
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise bad_request("'prompt' is required", "prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            if len(prompt) != 1:
                raise unsupported("prompt", "one prompt per request (no batched prompts)")
        elif not isinstance(prompt, (str, list)):
            raise bad_request("'prompt' must be a string, a list of token ids, or a one-element list", "prompt")

    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
        include_usage = _bool(stream_options, "include_usage", False)
        continuous_usage = _bool(stream_options, "continuous_usage_stats", False)

    max_tokens: Any = body.get("max_completion_tokens")
    key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, key = body.get("max_tokens"), "max_tokens"
    defaulted = max_tokens is None
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request(f"'{key}' must be a positive integer, got {max_tokens!r}", key)

    temperature = _number(body, "temperature", 0.0, 1e6)
    top_p = _number(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise bad_request("'top_k' must be -1 (disabled), 0 (disabled) or a positive integer", "top_k")
    seed = _int(body, "seed")

    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: list[str] = []
    elif isinstance(stop_raw, str):
        stop = [stop_raw]
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = list(stop_raw)
    else:
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must be non-empty", "stop")

    ids_raw = body.get("stop_token_ids")
    if ids_raw is None:
        stop_token_ids: list[int] = []
    elif isinstance(ids_raw, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids_raw):
        stop_token_ids = list(ids_raw)
    else:
        raise bad_request("'stop_token_ids' must be a list of non-negative integers", "stop_token_ids")

    ignore_eos_raw = body.get("ignore_eos")
    ignore_eos = None if ignore_eos_raw is None else _bool(body, "ignore_eos", False)

    return RequestPlan(
        route=route,
        body=body,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        max_tokens=max_tokens,
        max_tokens_defaulted=defaulted,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=ignore_eos,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        return_token_ids=_bool(body, "return_token_ids", False),
    )


__all__ = ["RequestPlan", "Route", "RouterError", "build_plan", "parse_body"]
