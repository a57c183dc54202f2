"""Strict msgspec schemas of the two OpenAI request bodies the router accepts.

Every field of vLLM 0.32's ``ChatCompletionRequest`` and ``CompletionRequest`` is in exactly one group
(``tests/test_router_validation.py`` checks this against vLLM's ``model_fields``, so an upgrade that
adds a field fails until it is classified here):

* ``PASSED_TO_VLLM``: shapes the prompt or is prefill metadata; vLLM's prefill honours it as sent.
* ``HONOURED_BY_DECODE``: sampling and output fields the router and the decode engine honour. The sampling
  and stop ones also go to the prefill, which samples the first token with them (``n`` does not: the prefill
  samples choice 0's first token, the decode node the others').
* ``REFUSED``: what the TileRT decode path cannot honour. Absent, null or equal to a neutral value that means
  "off", it is not forwarded (vLLM's default is the same); any other value sends the request to the native
  pool (stock vLLM decodes it, so it gets the field as sent) when the router has one and
  ``unsupported_to_native`` is on, else it is refused with a 400 naming the field. ``NO_POOL`` fields are
  refused whichever pool would serve them.

Any other field is unknown and refused (``forbid_unknown_fields``). Types are strict: no bool for an
int, no string for a number, no float for an int; a JSON number too large for a float (``1e999``) is
refused. Message contents and the template/processor objects stay loose (``msgspec.Raw``, forwarded
byte for byte to vLLM, which validates them) but bounded; the prompt is a string or token ids.
``validation.build_plan`` normalises the temperature (below 1e-5 greedy, else at least 0.01 as vLLM 0.32
does) and reads seed -1 as no seed (vLLM's rule).

Limits (400 when exceeded, 413 for the body size):

=========================  =======================================================================
body                       16 MiB (``build_plan(max_body_bytes=...)``), UTF-8
JSON nesting               32 levels, the top-level object being level 1 (``MAX_DEPTH``)
``messages``               1 to 4096 entries
``prompt``                 one prompt: a string, up to 2**21 token ids, or a one-element list of either
``stop``                   up to 64 strings of 1 to 1024 characters (vLLM's prefill applies its own
                           ``VLLM_MAX_STOP_STRINGS``, 4 by default)
``stop_token_ids``         up to 64 ids
token ids                  0 to 2**31 - 1
``max_tokens``, ``top_k``  at most 2**31 - 1
``seed``, ``priority``     int64
``n``                      at least 1; 1 when greedy (vLLM's rules); on the TileRT pool at most the decode nodes'
                           ``max_choices`` (their sequences at once)
``temperature``            0 to 1e6
``min_p``                  0 to 1; ``frequency_penalty``, ``presence_penalty``: -2 to 2;
                           ``repetition_penalty``: above 0, at most 1e6
``logit_bias``             up to 2**18 entries, keys token ids (as strings), values clamped to +-100
``allowed_token_ids``      1 to 2**18 ids
``bad_words``              up to 128 strings of 1 to 1024 characters
``documents``              up to 1024 entries
log-probabilities          ``top_logprobs``, completions' ``logprobs``, ``prompt_logprobs``: 0 to 20 (vLLM's
                           default ``max_logprobs``; -1, the whole vocabulary, is over it); ``top_logprobs``
                           needs ``logprobs``, ``prompt_logprobs`` no ``stream`` (``validation._logprobs``)
``tools``                  up to 1024 entries
short strings              ``model``, ``user``, ``session_id``, ``cache_salt``: up to 1024 characters
=========================  =======================================================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar, Union

import msgspec
from msgspec import UNSET, Meta, Raw, UnsetType

MAX_DEPTH = 32
MAX_MESSAGES = 4096
MAX_PROMPT_TOKENS = 1 << 21
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_DOCUMENTS = 1024
MAX_TOOLS = 1024
MAX_SHORT_STR = 1024
MAX_TEMPERATURE = 1e6
MAX_REPETITION_PENALTY = 1e6
MAX_LOGIT_BIAS = 1 << 18  # logit_bias entries, allowed_token_ids: a whole vocabulary
MAX_BAD_WORDS = 128  # each tokenized with and without a leading space, as vLLM does
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

T = TypeVar("T")
Opt = Union[T, None, UnsetType]  # noqa: UP007 (a generic alias: ``T | None`` cannot be subscripted)
"""A field that may be absent (``UNSET``) or null (``None``); both mean "not set"."""

TokenId = Annotated[int, Meta(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
ShortStr = Annotated[str, Meta(max_length=MAX_SHORT_STR)]
StopStr = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
BadWord = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
BiasKey = Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")]  # a token id, as JSON object keys are strings
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
LooseObject = dict[str, Raw]
TokenIds = Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]

# vLLM's logits rules the decode engine applies as vLLM's sampler does (the prefill gets them for the first token).
LOGITS_RULES = (
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
# Structured outputs: the decode node constrains each step with the same grammar (xgrammar), the prefill the first.
STRUCTURED = ("response_format", "structured_outputs")
# Sampling and output fields the router and the decode engine honour.
_COMMON_DECODE = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "stream",
        "stream_options",
        "return_token_ids",
        *LOGITS_RULES,
        *STRUCTURED,
        "min_tokens",
        "n",
    }
)
# Log-probabilities (the decode node's for its tokens, the prefill's for the first token and the prompt) and the
# echoed prompt: the prefill gets them as sent (ChatRequest's and CompletionRequest's own fields, checked by
# validation as vLLM checks them).
LOGPROBS: dict[str, frozenset[str]] = {
    "chat": frozenset({"logprobs", "top_logprobs", "prompt_logprobs", "return_tokens_as_token_ids"}),
    "completions": frozenset({"logprobs", "echo", "prompt_logprobs", "return_tokens_as_token_ids"}),
}
HONOURED_BY_DECODE: dict[str, frozenset[str]] = {
    "chat": _COMMON_DECODE | {"max_completion_tokens"} | LOGPROBS["chat"],
    "completions": _COMMON_DECODE | LOGPROBS["completions"],
}
# Of those, the ones the prefill also gets, to sample and stop the first token as the decode engine will.
DECODE_FIELDS_FOR_PREFILL = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        *LOGITS_RULES,
        *STRUCTURED,
    }
)

_COMMON_TO_VLLM = frozenset(
    {
        "model",
        "user",
        "session_id",
        "cache_salt",
        "priority",
        "truncate_prompt_tokens",
        "truncation_side",
        "add_special_tokens",
    }
)
PASSED_TO_VLLM: dict[str, frozenset[str]] = {
    "chat": _COMMON_TO_VLLM
    | {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "reasoning_effort",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
    "completions": _COMMON_TO_VLLM | {"prompt", "suffix"},
}

_SAMPLER = "the decode engine does not run this sampling extension"
_RENDER_ONLY = "only vLLM's /render endpoints use it"
_SET_BY_ROUTER = "the router sets it for the TileRT transfer; clients may not"

# field -> (neutral values that mean "off", why anything else is refused); null always means "off".
_COMMON_REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "no beam search on the decode path"),
    "length_penalty": ((1, 1.0), "no beam search on the decode path"),
    "watermarking": ((False,), _SAMPLER),
    "vllm_xargs": (({},), "custom sampling extensions do not run on the decode path"),
    "repetition_detection": ((), "the decode path does not detect repetition"),
    "thinking_token_budget": ((-1,), "the decode path does not count thinking tokens"),
    "logprob_token_ids": (([],), "the decode path returns the top log-probabilities, not chosen tokens'"),
    "spaces_between_special_tokens": ((True,), "the router's detokenizer has no such switch"),
    "stream_interval": ((1,), "the router streams every token as it is decoded"),
    "routed_experts_prompt_start": ((0,), "the decode path does not return routed experts"),
    "return_token_offsets": ((False,), _RENDER_ONLY),
    "mm_payload": (("tensors",), _RENDER_ONLY),
    "return_mm_kwargs": ((True,), _RENDER_ONLY),
    "request_id": ((), "send the X-Request-Id header instead: vLLM names the request after the header"),
    "kv_transfer_params": ((), _SET_BY_ROUTER),
    "ec_transfer_params": ((), "encoder-cache transfers are set by the serving stack, not by clients"),
}
# Refused whichever pool serves the request; every other refused field only on the TileRT pool (a request with one
# goes to the native pool when the router has one, unless unsupported_to_native is off).
NO_POOL = frozenset({"request_id", "kv_transfer_params", "ec_transfer_params"})
REFUSED: dict[str, dict[str, tuple[tuple[Any, ...], str]]] = {
    "chat": {
        **_COMMON_REFUSED,
        "echo": ((False,), "the router does not prepend the last message to the answer"),
        "include_reasoning": ((True,), "the decode path does not separate reasoning from content"),
        "return_prompt_text": ((False,), "the router does not return the rendered prompt"),
    },
    "completions": {
        **_COMMON_REFUSED,
        "prompt_embeds": ((), "the decode path needs the prompt's token ids"),
    },
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Honoured(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The fields both routes honour (``Opt``: absent and null both mean "not set")."""

    model: Opt[ShortStr] = UNSET
    user: Opt[ShortStr] = UNSET
    session_id: Opt[ShortStr] = UNSET
    cache_salt: Opt[ShortStr] = UNSET
    priority: Opt[Int64] = UNSET
    truncate_prompt_tokens: Opt[Annotated[int, Meta(ge=-1, le=INT64_MAX)]] = UNSET
    truncation_side: Opt[Literal["left", "right"]] = UNSET
    add_special_tokens: Opt[bool] = UNSET
    max_tokens: Opt[MaxTokens] = UNSET
    temperature: Opt[Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]] = UNSET
    top_p: Opt[Annotated[float, Meta(gt=0.0, le=1.0)]] = UNSET
    top_k: Opt[Annotated[int, Meta(ge=-1, le=INT32_MAX)]] = UNSET
    seed: Opt[Int64] = UNSET
    stop: Opt[StopStr | Annotated[list[StopStr], Meta(max_length=MAX_STOP)]] = UNSET
    stop_token_ids: Opt[Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]] = UNSET
    ignore_eos: Opt[bool] = UNSET
    include_stop_str_in_output: Opt[bool] = UNSET
    skip_special_tokens: Opt[bool] = UNSET
    stream: Opt[bool] = UNSET
    stream_options: Opt[StreamOptions] = UNSET
    return_token_ids: Opt[bool] = UNSET
    min_tokens: Opt[Annotated[int, Meta(ge=0, le=INT32_MAX)]] = UNSET
    min_p: Opt[Annotated[float, Meta(ge=0.0, le=1.0)]] = UNSET
    repetition_penalty: Opt[Annotated[float, Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]] = UNSET
    frequency_penalty: Opt[Annotated[float, Meta(ge=-2.0, le=2.0)]] = UNSET
    presence_penalty: Opt[Annotated[float, Meta(ge=-2.0, le=2.0)]] = UNSET
    logit_bias: Opt[Annotated[dict[BiasKey, float], Meta(max_length=MAX_LOGIT_BIAS)]] = UNSET
    allowed_token_ids: Opt[Annotated[list[TokenId], Meta(min_length=1, max_length=MAX_LOGIT_BIAS)]] = UNSET
    bad_words: Opt[Annotated[list[BadWord], Meta(max_length=MAX_BAD_WORDS)]] = UNSET
    response_format: Opt[LooseObject] = UNSET  # checked by validation.grammar_of
    n: Opt[Int64] = UNSET  # checked by validation.build_plan (vLLM's limits) and the decode pool (its nodes')
    structured_outputs: Opt[LooseObject] = UNSET
    prompt_logprobs: Opt[Int64] = UNSET  # ranges: validation (vLLM's messages)
    return_tokens_as_token_ids: Opt[bool] = UNSET


def _with_refused(route: str) -> Any:
    """``_Honoured`` plus the route's refused fields, loosely typed: any value but a neutral one is refused."""
    fields = [(name, Any, UNSET) for name in sorted(REFUSED[route])]
    return msgspec.defstruct(f"_{route}_refused", fields, bases=(_Honoured,), kw_only=True, forbid_unknown_fields=True)


class ChatRequest(_with_refused("chat")):  # type: ignore[misc]
    messages: Annotated[list[Raw], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Opt[MaxTokens] = UNSET
    add_generation_prompt: Opt[bool] = UNSET
    continue_final_message: Opt[bool] = UNSET
    documents: Opt[Annotated[list[Raw], Meta(max_length=MAX_DOCUMENTS)]] = UNSET
    chat_template: Opt[str] = UNSET
    chat_template_kwargs: Opt[LooseObject] = UNSET
    mm_processor_kwargs: Opt[LooseObject] = UNSET
    media_io_kwargs: Opt[LooseObject] = UNSET
    reasoning_effort: Opt[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = UNSET
    tools: Opt[Annotated[list[Raw], Meta(min_length=0, max_length=MAX_TOOLS)]] = UNSET  # vLLM checks each tool
    tool_choice: Opt[str | LooseObject] = UNSET  # "none", "auto", "required" or a named function; vLLM checks it
    parallel_tool_calls: Opt[bool] = UNSET
    logprobs: Opt[bool] = UNSET
    top_logprobs: Opt[Int64] = UNSET


class CompletionRequest(_with_refused("completions")):  # type: ignore[misc]
    prompt: str | Annotated[list[TokenId | str | TokenIds], Meta(min_length=1, max_length=MAX_PROMPT_TOKENS)]
    suffix: Opt[str] = UNSET  # fill-in-the-middle: vLLM renders it into the prompt
    logprobs: Opt[Int64] = UNSET
    echo: Opt[bool] = UNSET


SCHEMAS: dict[str, type[msgspec.Struct]] = {"chat": ChatRequest, "completions": CompletionRequest}
