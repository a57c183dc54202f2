"""Tool calls and reasoning on the TileRT pool, with vLLM's own parsers.

The router holds the parser vLLM's OpenAI server composes from ``tool_call_parser``, ``enable_auto_tool_choice`` and
``reasoning_parser`` (``vllm.parser.ParserManager``: the same flags, the same classes) and does with it what
vLLM's chat serving does:

* a request (:func:`prepare_chat`): vLLM's ``ChatCompletionRequest`` validates the tools and ``tool_choice`` (its
  400s); a ``tool_choice`` the flags do not serve is vLLM's 400 (``"auto"`` without ``enable_auto_tool_choice``,
  ``required`` or a named function without a tool parser); the parser's ``adjust_request`` gives the structured
  output that constrains the tool calls (a JSON schema, or an xgrammar structural tag for the parsers that read
  their own call format), which becomes the request's grammar (the decode node compiles it like any other, the
  prefill applies the same one to the first token), and ``skip_special_tokens`` (hermes keeps special tokens);
* an answer (:class:`AnswerParser`): the parser over the text the decode path produced, each streamed delta
  through ``parse_delta`` (vLLM's ``tool_calls`` / ``reasoning`` deltas, ``finish_reason`` ``tool_calls`` when
  a tool was called and the answer was not for a named function), the whole answer through ``parse`` and the
  message vLLM builds of it, with its tool call ids (``chatcmpl-tool-...``).

Requests without tools are parsed only when the parser can change their answer (a reasoning parser, or a tool
parser that reads answers itself even for ``tool_choice`` none). vLLM is imported only when the router has a parser
or a request has tools. vLLM waits for the end of the reasoning before it applies a grammar, the decode node
applies it from the first token: with a reasoning parser, a constrained request is the TileRT pool's refusal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson
from tokenizers import Tokenizer

from tilert import contracts as c
from tilert.router.config import RouterConfig
from tilert.router.detokenize import IncrementalDecoder, OutputText
from tilert.router.errors import RouterError, bad_request, unsupported
from tilert.router.structured import capped
from tilert.router.validation import RequestPlan


class PrefillResult(Protocol):
    """What the parsers read of a prefill's answer (:class:`tilert.router.prefill.PrefillResult`; named here, not
    imported, as the prefill leg's module imports the request plan that names this one's parsers)."""

    @property
    def stop_reason(self) -> str | int | None: ...
    @property
    def first_token_id(self) -> int: ...
    @property
    def prompt_token_ids(self) -> list[int] | None: ...


@dataclass(frozen=True)
class Parsers:
    """The router's vLLM parser (:func:`load_parsers`), what every request that is parsed starts from."""

    cls: Any  # vLLM's composed Parser class
    tokenizer: Any  # vLLM's tokenizer of the model (what the parsers look token ids up in)
    enable_auto_tools: bool
    reasoning: bool  # a reasoning parser: the usage counts reasoning tokens, as vLLM's does
    every_answer: bool  # answers without tools are parsed too

    @property
    def tools(self) -> bool:
        return self.cls.tool_parser_cls is not None


def load_parsers(config: RouterConfig) -> Parsers | None:
    """vLLM's parser for the router's flags (None: the flags name none vLLM would use); ``TypeError`` when vLLM
    refuses them for this model's tokenizer (its start-up check)."""
    if not (config.tool_call_parser or config.reasoning_parser):
        return None
    from vllm.parser import ParserManager  # lazy: vLLM, only when a parser is named
    from vllm.tokenizers import get_tokenizer  # lazy: vLLM, only when a parser is named

    tokenizer = get_tokenizer(config.model_dir)
    cls = ParserManager.get_parser(
        tool_parser_name=config.tool_call_parser,
        reasoning_parser_name=config.reasoning_parser,
        enable_auto_tools=config.enable_auto_tool_choice,
        model_name=config.model_dir,
        tokenizer=tokenizer,
    )
    if cls is None:
        return None
    tool_cls = cls.tool_parser_cls
    reasoning = cls.reasoning_parser_cls is not None
    engine_tools = tool_cls is not None and bool(tool_cls.engine_based_streaming)
    return Parsers(cls, tokenizer, config.enable_auto_tool_choice, reasoning, reasoning or engine_tools)


@dataclass(frozen=True)
class ParsedRequest:
    """One chat request as vLLM's parser sees it: vLLM's request object, adjusted as vLLM adjusts it."""

    parsers: Parsers
    request: Any  # vLLM's ChatCompletionRequest
    template_kwargs: dict[str, Any]

    def answer(self, pre: PrefillResult) -> AnswerParser:
        """The parser of one answer to this request (vLLM's parsers keep state: one per answer)."""
        return AnswerParser(self, pre.prompt_token_ids)


def prepare_chat(plan: RequestPlan, raw: bytes, parsers: Parsers | None) -> RequestPlan:
    """``plan`` with what vLLM's parser makes of the request (:attr:`RequestPlan.parsed`, the tool calls' grammar,
    ``skip_special_tokens``); the same plan when nothing is parsed; :class:`RouterError` with vLLM's 400."""
    if plan.route != "chat":
        return plan
    uses_tools = "tools" in plan.body or "tool_choice" in plan.body
    if not uses_tools and (parsers is None or not parsers.every_answer):
        return plan
    if parsers is None or not parsers.tools:  # checked without vLLM, which a router without parsers never imports
        _refuse_unserved(orjson.loads(raw), parsers)
    if parsers is None:
        return plan  # no tool choice to serve (vLLM's "none"): the prefill renders the tools, nothing is parsed
    request = _vllm_request(raw)
    kwargs = request.build_chat_params(None, "auto").chat_template_kwargs
    before = request.structured_outputs
    if parsers.cls.always_adjust_request or parsers.reasoning or request.tool_choice != "none":
        request = _adjusted(parsers, request, kwargs)
    grammar, refusal = plan.grammar, plan.fast_pool_refusal
    if request.structured_outputs is not before:
        grammar = _grammar(request.structured_outputs)
    if parsers.reasoning and grammar is not None:
        field = "tool_choice" if request.structured_outputs is not before else _constraint_field(plan)
        why = "vLLM applies the constraint once the reasoning ends, the decode node from the first token"
        refusal = refusal or unsupported(field, why)
    if plan.n > 1:
        refusal = refusal or unsupported("n", "vLLM's tool and reasoning parsers run over one choice only")
    return replace(
        plan,
        grammar=grammar,
        fast_pool_refusal=refusal,
        skip_special_tokens=request.skip_special_tokens is not False,
        parsed=ParsedRequest(parsers, request, kwargs),
    )


def _vllm_request(raw: bytes) -> Any:
    """vLLM's own request object of the body: its validation of the tools and ``tool_choice`` (a 400 with its
    message and parameter)."""
    import pydantic  # lazy: with vLLM
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # lazy: vLLM
    from vllm.exceptions import VLLMValidationError  # lazy: vLLM

    try:
        return ChatCompletionRequest.model_validate(orjson.loads(raw))
    except VLLMValidationError as exc:  # vLLM's own checks (its message names the parameter)
        raise bad_request(str(exc), exc.parameter) from None
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        cause = (error.get("ctx") or {}).get("error")
        param = getattr(cause, "parameter", None) or ".".join(str(p) for p in error.get("loc", ())) or None
        raise bad_request(str(cause) if cause is not None else error["msg"], param) from None


def _adjusted(parsers: Parsers, request: Any, kwargs: dict[str, Any]) -> Any:
    """``request`` as vLLM's parser adjusts it before rendering (its structured output for the tool calls); what
    the parser refuses is a 400, as in vLLM."""
    from vllm.exceptions import VLLMValidationError  # lazy: vLLM

    try:
        return parsers.cls(parsers.tokenizer, request.tools, chat_template_kwargs=kwargs).adjust_request(request)
    except VLLMValidationError as exc:
        raise bad_request(str(exc), exc.parameter) from None
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from None


def _refuse_unserved(body: dict[str, Any], parsers: Parsers | None) -> None:
    """vLLM's 400 for a ``tool_choice`` its flags do not serve, with no tool parser (its chat renderer's check, its
    messages; vLLM's default ``tool_choice`` is ``auto`` with tools, ``none`` without)."""
    choice = body.get("tool_choice", "auto" if body.get("tools") else "none")
    if choice in (None, "none"):
        return
    if choice == "auto":
        if parsers is None or not parsers.enable_auto_tools:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        return
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    what = f'function "{name}"' if isinstance(choice, dict) else f'"{choice}"'
    raise bad_request(f"tool_choice={what} requires --tool-call-parser to be set")


def _grammar(outputs: Any) -> c.Grammar:
    """The structured output vLLM's parser set for the tool calls, as the decode node's grammar."""
    if outputs.structural_tag is not None:
        return capped(c.Grammar("structural_tag", outputs.structural_tag))
    if outputs.json is not None:
        spec = outputs.json if isinstance(outputs.json, str) else json.dumps(outputs.json)
        return capped(c.Grammar("json", spec))
    if outputs.grammar is not None:
        return capped(c.Grammar("grammar", outputs.grammar))
    if outputs.regex is not None:
        return capped(c.Grammar("regex", outputs.regex))
    raise unsupported("tool_choice", "the tool parser's constraint is not one the decode node compiles")


def _constraint_field(plan: RequestPlan) -> str:
    return "response_format" if "response_format" in plan.body else "structured_outputs"


class AnswerParser:
    """vLLM's parser over one answer, as vLLM's chat serving runs it (streaming: :meth:`delta` and
    :meth:`finish_reason`; whole: :meth:`message`)."""

    def __init__(self, parsed: ParsedRequest, prompt_token_ids: list[int] | None) -> None:
        p = parsed.parsers
        self._parsed = parsed
        self._request = parsed.request
        self._parser = p.cls(p.tokenizer, parsed.request.tools, chat_template_kwargs=parsed.template_kwargs)
        self._prompt_ids = prompt_token_ids
        choice = parsed.request.tool_choice
        self._named = choice is not None and not isinstance(choice, str)
        self._tools_streamed = False
        self._token_ids: list[int] = []  # the answer's tokens so far (its usage counts its reasoning tokens)

    def first_text(self, tokenizer: Tokenizer, plan: RequestPlan, pre: PrefillResult, finish: str | None) -> str:
        """The text of the prefill's token as vLLM's output holds it before any parsing (the prefill's answer
        carries its content after its own parser ran)."""
        if finish == "stop" and not isinstance(pre.stop_reason, str) and not plan.include_stop_str_in_output:
            return ""  # EOS or a stop id: its text is left out, as vLLM leaves it out
        piece = IncrementalDecoder(tokenizer, pre.prompt_token_ids, plan.skip_special_tokens).step(pre.first_token_id)
        out = OutputText(plan.stop, plan.include_stop_str_in_output)
        out.add(piece, check=plan.min_tokens < 1)
        return out.text

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None) -> dict[str, Any] | None:
        """One streamed delta as vLLM's chunk carries it (None: the parser holds it back)."""
        from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls  # lazy: vLLM

        self._token_ids += token_ids
        message = self._parser.parse_delta(
            delta_text=text,
            delta_token_ids=list(token_ids),
            request=self._request,
            prompt_token_ids=self._prompt_ids,
            finished=finish_reason is not None,
        )
        if message is None:
            return None
        if message.tool_calls:
            self._tools_streamed = True
        message = maybe_filter_parallel_tool_calls(message, self._request)
        out: dict[str, Any] = message.model_dump(mode="json", exclude_unset=True)
        return out

    def finish_reason(self, finish_reason: str) -> str:
        """The streamed answer's finish reason: ``tool_calls`` once a tool call was streamed and the answer
        stopped, unless it was for a named function (OpenAI's rule, as vLLM applies it)."""
        return "tool_calls" if self._tools_streamed and not self._named and finish_reason == "stop" else finish_reason

    def message(self, text: str, token_ids: list[int], finish_reason: str | None) -> tuple[dict[str, Any], str]:
        """The whole answer's ``message`` and ``finish_reason``, as vLLM's chat serving builds them."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage  # lazy: vLLM

        parsers, request = self._parsed.parsers, self._request
        self._token_ids = list(token_ids)
        if self._prompt_ids is not None:
            self._parser.set_prompt_token_ids(self._prompt_ids)
        reasoning, content, calls = self._parser.parse(
            text, request, enable_auto_tools=parsers.enable_auto_tools, model_output_token_ids=token_ids
        )
        required = request.tool_choice == "required"
        auto = parsers.enable_auto_tools and parsers.tools and request.tools and request.tool_choice in ("auto", None)
        auto_called = bool(auto and calls)
        if self._named or required or auto_called:
            tool_calls = _tool_calls(calls or [])[: 1 if request.parallel_tool_calls is False else None]
            body = content if auto_called else content or ""
            message = ChatMessage(role="assistant", reasoning=reasoning, content=body, tool_calls=tool_calls)
        else:
            message = ChatMessage(role="assistant", reasoning=reasoning, content=content)
        called = auto_called or (required and finish_reason == "stop")
        return message.model_dump(mode="json"), "tool_calls" if called else finish_reason or "stop"

    def usage(self, use: dict[str, Any]) -> dict[str, Any]:
        """``use`` with vLLM's count of the reasoning tokens, as vLLM's usage has it with a reasoning parser."""
        if not self._parsed.parsers.reasoning:
            return use
        return {
            **use,
            "completion_tokens_details": {"reasoning_tokens": self._parser.count_reasoning_tokens(self._token_ids)},
        }


def _tool_calls(calls: list[Any]) -> list[Any]:
    """vLLM's tool calls of the parsed function calls, with its ids (the parser's own, else ``chatcmpl-tool-...``)."""
    from vllm.entrypoints.generate.base.protocol import ToolCall  # lazy: vLLM
    from vllm.renderers.chat_utils import make_tool_call_id  # lazy: vLLM

    return [ToolCall(id=call.id or make_tool_call_id(), function=call) for call in calls]


__all__ = ["AnswerParser", "ParsedRequest", "Parsers", "RouterError", "load_parsers", "prepare_chat"]
