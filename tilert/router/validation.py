"""Validate an OpenAI request body and turn it into a :class:`RequestPlan`.

The raw body is decoded with the strict schemas of :mod:`tilert.router.openai_schema`: every vLLM field is
honoured (by vLLM's prefill or by the decode path) or refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec
import orjson
from msgspec import UNSET

from tilert import contracts as c
from tilert.router import openai_schema as schema
from tilert.router.errors import RouterError, bad_request, unsupported
from tilert.router.structured import grammar_of

Route = Literal["chat", "completions"]

GREEDY_BELOW = 1e-5  # a temperature under this is greedy (the plan stores 0.0), so 1e-300 never reaches a sampler
MIN_TEMPERATURE = 1e-2  # vLLM 0.32's SamplingParams raises 0 < temperature < 0.01 to 0.01 (nan/inf otherwise)

_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_SAME_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_PARAM = (re.compile(r"`\$\.(\w+)"), re.compile(r"field `([^`]{1,200})`"))  # "... - at `$.top_p`", "... field `x`"


@dataclass
class RequestPlan:
    """What the router will do with one client request."""

    route: Route
    body: dict[str, Any]  # the fields the prefill gets (loose contents as orjson.Fragment, temperature normalised)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int | None  # None: until the context is full (the decode node knows where that is)
    temperature: float | None  # None: the model's default; 0.0: greedy
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    min_tokens: int = 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)  # clamped to +-100 as vLLM does
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    grammar: c.Grammar | None = None  # structured output
    n: int = 1  # choices: the decode node samples each from the one prefill
    logprobs: int | None = None  # each token's logprob and this many top ones (None: not asked)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    echo: bool = False  # completions: the prompt before the completion (its logprobs too)
    # The first field the TileRT pool cannot serve (a 400 naming it), None when it can: the native pool may.
    fast_pool_refusal: RouterError | None = None
    # The request as vLLM's tool / reasoning parser sees it: a tilert.router.tools.ParsedRequest (made by its
    # prepare_chat; typed loosely here, as that module builds on this one); None: not parsed.
    parsed: Any = None

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.route == "chat" else "/v1/completions"

    @property
    def resumable(self) -> bool:
        """Whether the answer can go on from a prompt that ends with the tokens already produced: no rule
        that treats the completion apart from the prompt (frequency / presence penalties, bad words spanning
        tokens, a grammar's state)."""
        return (
            self.grammar is None
            and not self.frequency_penalty
            and not self.presence_penalty
            and not self.bad_words
            and self.n == 1  # the choices of one answer go on from one prompt each: not resumed
        )

    def prefill_body(self, kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
        """The forwarded fields with ``max_tokens=1``, no streaming, token ids on, and the TileRT claim."""
        body = dict(self.body)
        body.update(max_tokens=1, stream=False, return_token_ids=True, kv_transfer_params=kv_transfer_params)
        if self.min_tokens:  # vLLM wants min_tokens <= max_tokens; the first token is the prefill's one
            body["min_tokens"] = 1
        return body


def continuation(plan: RequestPlan, prompt_ids: list[int], max_tokens: int | None, produced: int) -> RequestPlan:
    """The prefill of ``plan``'s answer from where it stands: a completions request whose prompt is the prompt's
    ids and the ``produced`` tokens, with the same sampling, ``max_tokens`` left, and ``min_tokens`` less what
    was produced, and the logprobs of its token asked with the tokens as ids. Stop strings stay with the router (it
    holds the text so far)."""
    keep = schema.DECODE_FIELDS_FOR_PREFILL - {"stop", "include_stop_str_in_output"}
    body = {k: v for k, v in plan.body.items() if k in keep or k in ("model", "cache_salt", "priority", "user")}
    body["prompt"] = prompt_ids
    if plan.logprobs is not None:  # the next token's, read back by id (tilert.router.logprobs.resumed_logprobs)
        body.update(logprobs=plan.logprobs, return_tokens_as_token_ids=True)
    return replace(
        plan,
        route="completions",
        body=body,
        max_tokens=max_tokens,
        min_tokens=max(plan.min_tokens - produced, 0),
        stop=[],
    )


def build_plan(
    route: Route,
    raw: bytes,
    *,
    default_max_tokens: int | None = None,
    max_body_bytes: int = 16 << 20,
    sampling_defaults: dict[str, Any] | None = None,
) -> RequestPlan:
    """Validate the raw body for ``route``; raise :class:`RouterError` (400, 413) with the reason if refused.
    ``sampling_defaults``: the model's (``generation_config.json``): is an unset temperature greedy?"""
    request = _decode(route, raw, max_body_bytes)
    refusal = _refused(request, route)
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and len(prompt) > 1 and set(map(type, prompt)) != {int}:  # one C pass over the ids
        raise unsupported("prompt", "one prompt per request (no batched prompts)")
    stream, options = _streaming(request)
    temperature, stop = _temperature(request.temperature), _set(request.stop) or []
    max_tokens = _max_tokens(request, route, default_max_tokens)
    min_tokens = _min_tokens(request, max_tokens)
    grammar, refusal = _grammar(request, refusal)
    n, logprobs = _choices(request.n, temperature, sampling_defaults or {}), _logprobs(request, route, stream)
    refusal = refusal or _one_choice_only(request, n, logprobs)
    body = _forwarded(request, route)
    if temperature is not None:  # the prefill samples the first token with the temperature the decode engine uses
        body["temperature"] = temperature
    return RequestPlan(
        route=route,
        body=body,
        stream=stream,
        include_usage=options is not None and options.include_usage is True,
        continuous_usage=options is not None and options.continuous_usage_stats is True,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=_set(request.top_p),
        top_k=_set(request.top_k),
        seed=None if request.seed in (UNSET, None, -1) else request.seed,  # vLLM: seed -1 means no seed
        stop=[stop] if isinstance(stop, str) else list(stop),
        stop_token_ids=list(_set(request.stop_token_ids) or []),
        ignore_eos=request.ignore_eos is True,
        include_stop_str_in_output=request.include_stop_str_in_output is True,
        skip_special_tokens=request.skip_special_tokens is not False,
        return_token_ids=request.return_token_ids is True,
        min_tokens=min_tokens,
        **_logits_rules(request),
        **logprobs,
        grammar=grammar,
        fast_pool_refusal=refusal,
        n=n,
    )


def _min_tokens(request: Any, max_tokens: int | None) -> int:
    min_tokens: int = _set(request.min_tokens) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.", "min_tokens"
        )
    return min_tokens


def _one_choice_only(request: Any, n: int, logprobs: dict[str, Any]) -> RouterError | None:
    """The TileRT pool gives log-probabilities and echo to one choice: with ``n`` > 1 they are its refusal."""
    if n > 1 and (logprobs["logprobs"] is not None or logprobs["echo"] or _set(request.prompt_logprobs) is not None):
        return unsupported("n", "the decode path gives log-probabilities and echo to one choice only")
    return None


def _streaming(request: Any) -> tuple[bool, schema.StreamOptions | None]:
    """Whether the answer is streamed, and its stream options (allowed only then)."""
    stream, options = request.stream is True, request.stream_options or None
    if options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, options


def _choices(value: Any, temperature: float | None, defaults: dict[str, Any]) -> int:
    """``n`` as vLLM checks it (``SamplingParams``): at least 1, and 1 when greedy (the temperature sent, else the
    model's default, under 1e-5)."""
    n = 1 if value is UNSET or value is None else int(value)
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}.", "n")
    if temperature is None:
        temperature = float(defaults.get("temperature", 1.0))
    if n > 1 and temperature < GREEDY_BELOW:
        raise bad_request(f"n must be 1 when using greedy sampling, got {n}.", "n")
    return n


def _refused(request: Any, route: Route) -> RouterError | None:
    """The first field set that the TileRT pool does not serve (the native pool may); one that no pool takes
    (``NO_POOL``) is raised."""
    refusal = None
    for name, (neutral, why) in schema.REFUSED[route].items():
        if not _is_off(getattr(request, name), neutral):
            if name in schema.NO_POOL:
                raise unsupported(name, why)
            refusal = refusal or unsupported(name, why)
    return refusal


def _grammar(request: Any, refusal: RouterError | None) -> tuple[c.Grammar | None, RouterError | None]:
    """The request's grammar, and the TileRT pool's refusal: what the node does not compile (a structural tag, a
    whitespace option) vLLM may, so it is the native pool's; a malformed constraint is a 400 for every pool."""
    try:
        return grammar_of(_set(request.response_format), _set(request.structured_outputs)), refusal
    except RouterError as exc:
        if exc.outcome != "unsupported":
            raise
        return None, refusal or exc


def _logits_rules(request: Any) -> dict[str, Any]:
    """The plan's logits rules: unset ones None (the model's default), ``logit_bias`` clamped as vLLM does."""
    return {
        "min_p": _set(request.min_p),
        "repetition_penalty": _set(request.repetition_penalty),
        "frequency_penalty": _set(request.frequency_penalty),
        "presence_penalty": _set(request.presence_penalty),
        "logit_bias": {int(k): min(100.0, max(-100.0, v)) for k, v in (_set(request.logit_bias) or {}).items()},
        "allowed_token_ids": _set(request.allowed_token_ids),
        "bad_words": list(_set(request.bad_words) or []),
    }


def _logprobs(request: Any, route: Route, stream: bool) -> dict[str, Any]:
    """The plan's log-probability fields, checked as vLLM checks them (its messages; the limit is vLLM's default
    ``max_logprobs``, the most the decode node returns): a 400 naming the field before any prefill."""
    if route == "chat":
        name, top = "top_logprobs", _set(request.top_logprobs)
        if top is not None and top < 0 and top != -1:
            raise _invalid("`top_logprobs` must be a positive value or -1.", name, top)
        if top is not None and (top == -1 or top > 0) and request.logprobs is not True:
            raise _invalid("when using `top_logprobs`, `logprobs` must be set to true.", name)
        count = (top or 0) if request.logprobs is True else None
    else:
        name, count = "logprobs", _set(request.logprobs)
        if count is not None and count < 0 and count != -1:
            raise _invalid("`logprobs` must be a positive value or -1.", name, count)
    _within_max_logprobs(count, "sample", name)
    prompt = _set(request.prompt_logprobs)
    if prompt is not None:
        if stream and (prompt > 0 or prompt == -1):
            raise _invalid("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt < 0 and prompt != -1:
            raise _invalid("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs", prompt)
        _within_max_logprobs(prompt, "prompt", "prompt_logprobs")
    echo = route == "completions" and request.echo is True
    return {"logprobs": count, "tokens_as_ids": request.return_tokens_as_token_ids is True, "echo": echo}


def _within_max_logprobs(count: int | None, kind: str, name: str) -> None:
    if count is not None and (count == -1 or count > c.MAX_LOGPROBS):
        asked = "the whole vocabulary" if count == -1 else count
        message = f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {c.MAX_LOGPROBS}"
        raise _invalid(message, name, count)


def _invalid(message: str, name: str, value: int | None = None) -> RouterError:
    """A 400 worded as vLLM's ``VLLMValidationError`` words it (the parameter, and the value, after the message)."""
    named = f"parameter={name}" if value is None else f"parameter={name}, value={value}"
    return bad_request(f"{message} ({named})", name)


def _logprobs_body(request: Any, route: Route) -> dict[str, Any]:
    """The log-probability fields the prefill gets: those set to something other than vLLM's default."""
    values = {name: getattr(request, name) for name in sorted(schema.LOGPROBS[route])}
    return {name: v for name, v in values.items() if v is not UNSET and v is not None and v is not False}


def _decode(route: Route, raw: bytes, max_body_bytes: int) -> Any:
    if len(raw) > max_body_bytes:
        raise RouterError(
            413, f"request body is {len(raw)} bytes, over the limit of {max_body_bytes}", outcome="too_large"
        )
    try:
        if not raw.isascii():
            raw.decode()
        request = msgspec.json.decode(raw, type=schema.SCHEMAS[route])
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: {exc}") from None
    except msgspec.ValidationError as exc:
        text = str(exc) if len(str(exc)) <= 500 else str(exc)[:500] + "..."  # it may quote a client's key
        found = (m.group(1) for pattern in _PARAM if (m := pattern.search(text)))
        raise bad_request(f"invalid request body: {text}", next(found, None)) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        request = None
    if request is None or _nested_too_deep(raw):
        raise bad_request(f"request body is nested deeper than {schema.MAX_DEPTH} levels")
    return request


def _within(depth: int) -> re.Pattern[bytes]:
    """Balanced ``[]`` nested at most ``depth`` deep; possessive, so it runs in linear time and fails fast."""
    pattern = b""
    for _ in range(depth):
        pattern = rb"(?:\[" + pattern + rb"\])*+"
    return re.compile(pattern)


_WITHIN_MAX_DEPTH = _within(schema.MAX_DEPTH)


def _nested_too_deep(raw: bytes) -> bool:
    """On valid JSON: drop the strings, keep the brackets (``{}`` as ``[]``), match them against the limit."""
    return _WITHIN_MAX_DEPTH.fullmatch(_STRING.sub(b"", raw).translate(_SAME_BRACKETS, _NOT_BRACKETS)) is None


# vLLM 0.32's own defaults without max_tokens: a chat request runs to the end of the context (None),
# a completions request stops after 16 tokens (CompletionRequest.max_tokens = 16).
VLLM_DEFAULT_MAX_TOKENS: dict[str, int | None] = {"chat": None, "completions": 16}


def _max_tokens(request: Any, route: Route, default: int | None) -> int | None:
    """The client's max_completion_tokens, else its max_tokens, else ``default``, else vLLM's default for
    the route (None: until the context is full)."""
    for value in (getattr(request, "max_completion_tokens", None), request.max_tokens):
        if isinstance(value, int):
            return value
    return default if default is not None else VLLM_DEFAULT_MAX_TOKENS[route]


def _temperature(value: Any) -> float | None:
    if value is UNSET or value is None:
        return None
    return 0.0 if value < GREEDY_BELOW else max(value, MIN_TEMPERATURE)


def _forwarded(request: Any, route: Route) -> dict[str, Any]:
    """The fields the prefill gets as the client sent them; loose (``Raw``) contents travel as raw JSON."""
    names = schema.PASSED_TO_VLLM[route] | schema.DECODE_FIELDS_FOR_PREFILL
    refused = schema.REFUSED[route]
    body: dict[str, Any] = _logprobs_body(request, route)
    for name in request.__struct_fields__:
        value = getattr(request, name)
        if name in refused:  # only the native pool serves it: it gets the field when it is not "off"
            if not _is_off(value, refused[name][0]):
                body[name] = _encodable(name, value)
        elif name in names and value is not UNSET and value is not None:
            body[name] = _jsonable(value)
    return body


def _encodable(name: str, value: Any) -> Any:
    """A refused field's value as sent, when it can be sent on (a JSON integer past 64 bits cannot)."""
    try:
        orjson.dumps(value)
    except TypeError as exc:
        raise bad_request(f"'{name}': {exc}", name) from None
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, msgspec.Raw):
        return orjson.Fragment(bytes(value))
    if isinstance(value, list) and value and isinstance(value[0], msgspec.Raw):
        return [orjson.Fragment(bytes(item)) for item in value]
    if isinstance(value, dict):  # the loose objects (chat_template_kwargs, ...): dict[str, Raw]; logit_bias
        return {
            key: orjson.Fragment(bytes(item)) if isinstance(item, msgspec.Raw) else item for key, item in value.items()
        }
    return value


def _is_off(value: Any, neutral: tuple[Any, ...]) -> bool:
    """Absent, null, or equal to a neutral value of the same JSON type (``0`` is not ``false``)."""
    return value is UNSET or value is None or any(type(value) is type(n) and value == n for n in neutral)


def _set(value: Any) -> Any:
    return None if value is UNSET else value


__all__ = ["RequestPlan", "Route", "RouterError", "build_plan"]
