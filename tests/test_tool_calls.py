"""Tool calls and reasoning on the TileRT pool, parsed by the router with vLLM's own parsers, against vLLM alone.

The session stack runs with ``--tool-call-parser hermes --enable-auto-tool-choice`` (``tests/conftest.py``): its
router serves ``tools`` on the TileRT pool (vLLM's prefill renders them; the decode node follows the structural tag
vLLM's hermes parser constrains the calls with), and its vLLM, asked directly, is the oracle. The tools are strict
(their arguments pinned to an enum) and whitespace-only tokens are biased down, so that the random tiny model writes
complete calls within a few dozen tokens; the grammar still lets the whitespace it requires through.

The hermes and reasoning parsers are also run on hand-written answers, fed in small pieces, where what vLLM makes
of them is known. A second prefill vLLM with ``--reasoning-parser qwen3`` (and no tool flags) and a router with the
same flag over it and the stack's decode node check the reasoning split end to end and vLLM's 400 for ``auto``
without ``--enable-auto-tool-choice``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI
from support.stack import Stack, free_port, start_logged, stop_procs, wait_healthy
from tokenizers import Tokenizer

from tilert.router.config import RouterConfig
from tilert.router.openai_format import ResponseShape
from tilert.router.tools import AnswerParser, Parsers, load_parsers, prepare_chat
from tilert.router.validation import build_plan
from tilert.stack import StackConfig, child_env, native_command, prefill_command, prefill_env, router_command

pytestmark = [pytest.mark.timeout(600)]


def _tool(name: str, prop: str, values: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": {prop: {"type": "string", "enum": values}}, "required": [prop]}
    return {
        "type": "function",
        "function": {"name": name, "strict": True, "parameters": {**schema, "additionalProperties": False}},
    }


TOOLS = [_tool("get_weather", "city", ["Paris", "Tokyo"]), _tool("get_time", "zone", ["UTC", "CET"])]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 80


@dataclass
class Answer:
    """What a client reads of one chat answer: each tool call's (name, arguments as JSON), their ids, the text."""

    calls: list[tuple[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    content: str | None = None
    reasoning: str | None = None
    finish: str | None = None
    pool: str | None = None


def _client(base: str) -> OpenAI:
    return OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)


def ask(base: str, model: Path, stream: bool, **fields: Any) -> Answer:
    """One greedy chat request through the OpenAI SDK, its typed objects read back (streamed: the tool call deltas
    joined by index, as a client joins them)."""
    raw = _client(base).chat.completions.with_raw_response.create(
        model=str(model), messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=stream, **fields
    )
    pool, resp = raw.headers.get("x-tilert-pool"), raw.parse()
    if not stream:
        choice = resp.choices[0]
        calls = choice.message.tool_calls or []
        return Answer(
            [(c.function.name, json.loads(c.function.arguments)) for c in calls],
            [c.id for c in calls],
            choice.message.content,
            (choice.message.model_extra or {}).get("reasoning"),
            choice.finish_reason,
            pool,
        )
    return _joined(resp, pool)


def _joined(chunks: Any, pool: str | None) -> Answer:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    out = Answer(pool=pool)
    content, reasoning = [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content.append(delta.content or "")
            reasoning.append((delta.model_extra or {}).get("reasoning") or "")
            for call in delta.tool_calls or []:
                if call.id is not None:
                    out.ids.append(call.id)
                if call.function is not None:
                    names[call.index] = names.get(call.index, "") + (call.function.name or "")
                    args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
            out.finish = choice.finish_reason or out.finish
    out.calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    out.content, out.reasoning = "".join(content), "".join(reasoning) or None
    return out


@pytest.fixture(scope="module")
def compact(stack: Stack) -> dict[str, int]:
    """``logit_bias`` that keeps the random model's JSON compact: whitespace-only tokens down by 100."""
    tok = Tokenizer.from_file(str(stack.model / "tokenizer.json"))
    spaces = [i for i in range(tok.get_vocab_size()) if tok.decode([i]) and not tok.decode([i]).strip()]
    assert spaces
    return {str(i): -100 for i in spaces}


# --- through the TileRT pool, against vLLM alone -------------------------------------------------------------------


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_tool_calls_are_vllm_alones(
    stack: Stack, compact: dict[str, int], choice: str, stream: bool
) -> None:
    """``required`` (one call: ``parallel_tool_calls`` false) and a named function: the decode node follows the
    structural tag vLLM's hermes parser builds, and the router parses the calls as vLLM does."""
    fields: dict[str, Any] = {"tools": TOOLS, "logit_bias": compact}
    fields |= (
        {"tool_choice": "required", "parallel_tool_calls": False} if choice == "required" else {"tool_choice": NAMED}
    )
    alone = ask(stack.prefill, stack.model, stream, **fields)
    fast = ask(stack.router, stack.model, stream, **fields)
    assert fast.pool == "tilert"
    assert len(alone.calls) == 1 and alone.finish == ("tool_calls" if choice == "required" else "stop")
    if choice == "named":
        assert alone.calls[0][0] == "get_weather"
    assert (fast.calls, fast.content, fast.finish) == (alone.calls, alone.content, alone.finish)
    assert len(fast.ids) == 1 and fast.ids[0].startswith("chatcmpl-tool-")


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_answers_as_vllm_alone(stack: Stack, stream: bool) -> None:
    """``auto``: the random model writes no call, and the parser run over its text invents none."""
    alone = ask(stack.prefill, stack.model, stream, tools=TOOLS, tool_choice="auto")
    fast = ask(stack.router, stack.model, stream, tools=TOOLS, tool_choice="auto")
    assert fast.pool == "tilert"
    assert alone.content and not alone.calls
    assert (fast.calls, fast.content, fast.finish) == (alone.calls, alone.content, alone.finish)


@pytest.mark.stack
def test_tool_choice_none_and_bad_tools_are_vllms(stack: Stack) -> None:
    """``none`` renders the tools and parses nothing; a ``tool_choice`` naming no tool is vLLM's 400."""
    alone = ask(stack.prefill, stack.model, False, tools=TOOLS, tool_choice="none")
    fast = ask(stack.router, stack.model, False, tools=TOOLS, tool_choice="none")
    assert (fast.content, fast.calls, fast.finish) == (alone.content, [], alone.finish)
    body = {"model": str(stack.model), "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}
    body["tool_choice"] = {"type": "function", "function": {"name": "nope"}}
    answers = [httpx.post(url + "/v1/chat/completions", json=body, timeout=60) for url in (stack.prefill, stack.router)]
    assert [a.status_code for a in answers] == [400, 400]
    assert answers[1].json()["error"]["message"] == answers[0].json()["error"]["message"]


# --- the router's parser wrapper on hand-written answers -----------------------------------------------------------


def _parsers(model: Path, **flags: Any) -> Parsers:
    config = RouterConfig(prefill_urls=["http://127.0.0.1:9"], decode_nodes=[], model_dir=str(model), **flags)
    parsers = load_parsers(config)
    assert parsers is not None
    return parsers


def _answer(model: Path, parsers: Parsers, **body: Any) -> tuple[AnswerParser, ResponseShape]:
    raw = orjson.dumps({"model": "m", "messages": MESSAGES, **body})
    plan = prepare_chat(build_plan("chat", raw), raw, parsers)
    assert plan.parsed is not None
    shape = ResponseShape("chat", "chatcmpl-1", 0, "m", False)
    shape.parsing = AnswerParser(plan.parsed, [1, 2, 3])
    return shape.parsing, shape


def _stream(model: Path, shape: ResponseShape, text: str, piece_chars: int) -> list[dict[str, Any]]:
    """``text`` through ``shape`` in pieces of a few characters (each with its tokens), as the router streams it."""
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    pieces = [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)]
    chunks = []
    for i, piece in enumerate(pieces):
        chunk = shape.chunk(
            piece, tok.encode(piece, add_special_tokens=False).ids, "stop" if i == len(pieces) - 1 else None
        )
        if chunk is not None:
            chunks.append(chunk["choices"][0])
    return chunks


HERMES_ANSWER = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("piece_chars", [1, 3, 7])
def test_hermes_wrapper_streams_vllms_tool_call_deltas(tiny_model: Path, piece_chars: int) -> None:
    parsers = _parsers(tiny_model, tool_call_parser="hermes", enable_auto_tool_choice=True)
    _, shape = _answer(tiny_model, parsers, tools=TOOLS)
    chunks = _stream(tiny_model, shape, HERMES_ANSWER, piece_chars)
    deltas = [c["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    first = calls[0]
    assert (first["index"], first["type"], first["function"]) == (0, "function", {"name": "get_weather"})
    assert first["id"].startswith("chatcmpl-tool-") and all("id" not in c for c in calls[1:])
    assert all(c["index"] == 0 and set(c["function"]) == {"arguments"} for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls[1:])) == {"city": "Paris"}
    assert [c["finish_reason"] for c in chunks][-1] == "tool_calls"  # a call, an auto choice: OpenAI's reason


def test_hermes_wrapper_whole_answer_is_vllms_message(tiny_model: Path) -> None:
    parsers = _parsers(tiny_model, tool_call_parser="hermes", enable_auto_tool_choice=True)
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tok.encode(HERMES_ANSWER, add_special_tokens=False).ids
    answer, _ = _answer(tiny_model, parsers, tools=TOOLS)
    message, finish = answer.message(HERMES_ANSWER, ids, "stop")
    assert (message["content"], finish, message["reasoning"]) == ("Sure. ", "tool_calls", None)
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    named, _ = _answer(tiny_model, parsers, tools=TOOLS, tool_choice=NAMED)
    assert named.message(HERMES_ANSWER, ids, "stop")[1] == "stop"  # a named function: "stop", as OpenAI says
    plain, _ = _answer(tiny_model, parsers, tools=TOOLS)
    message, finish = plain.message("no call here", [], "length")
    assert (message["content"], finish, "tool_calls" in message) == ("no call here", "length", False)


THINK_ANSWER = "<think>I reason here</think>The answer is 4."


@pytest.mark.parametrize("piece_chars", [1, 4])
def test_reasoning_wrapper_splits_as_vllm(tiny_model: Path, piece_chars: int) -> None:
    """qwen3's reasoning parser (it reads ``<think>`` as text): ``reasoning`` and ``content``, streamed and whole."""
    parsers = _parsers(tiny_model, reasoning_parser="qwen3")
    _, shape = _answer(tiny_model, parsers)
    deltas = [c["delta"] for c in _stream(tiny_model, shape, THINK_ANSWER, piece_chars)]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "I reason here"
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 4."
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    answer, _ = _answer(tiny_model, parsers)
    message, finish = answer.message(THINK_ANSWER, tok.encode(THINK_ANSWER, add_special_tokens=False).ids, "stop")
    assert (message["reasoning"], message["content"], finish) == ("I reason here", "The answer is 4.", "stop")
    assert "completion_tokens_details" in answer.usage({"completion_tokens": 9})


def test_a_reasoning_parser_with_a_constraint_is_left_to_the_native_pool(tiny_model: Path) -> None:
    """vLLM constrains once the reasoning ends, the decode node from the first token: the TileRT pool refuses."""
    parsers = _parsers(tiny_model, reasoning_parser="qwen3")
    raw = orjson.dumps({"model": "m", "messages": MESSAGES, "response_format": {"type": "json_object"}})
    plan = prepare_chat(build_plan("chat", raw), raw, parsers)
    assert plan.fast_pool_refusal is not None and plan.fast_pool_refusal.param == "response_format"


# --- start-up -----------------------------------------------------------------------------------------------------


def _router_args(model: Path, secret: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "tilert.cli", "router", "--model", str(model)),
        *("--prefill-url", "http://127.0.0.1:9", "--decode", "127.0.0.1:9:10", "--secret-file", str(secret)),
        *("--port", str(free_port())),
    ]


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text("s" * 48 + "\n")
    path.chmod(0o600)
    return path


def test_unknown_parsers_are_refused_at_start_up(tiny_model: Path, secret: Path) -> None:
    """One line naming each flag and listing vLLM's names, a non-zero exit, before anything is served."""
    cmd = [*_router_args(tiny_model, secret), "--tool-call-parser", "nope", "--reasoning-parser", "nada"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    tool, reasoning = lines[0].split("; reasoning_parser")
    assert "--tool-call-parser" in tool and "'nope'" in tool and " hermes," in tool
    assert "--reasoning-parser" in reasoning and "'nada'" in reasoning and " qwen3," in reasoning


def test_a_parser_vllm_refuses_for_the_tokenizer_stops_the_router(tiny_model: Path, secret: Path) -> None:
    """deepseek_r1 needs ``<think>`` tokens the tiny tokenizer lacks: vLLM's own start-up check, and its reason."""
    cmd = [*_router_args(tiny_model, secret), "--reasoning-parser", "deepseek_r1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "--reasoning-parser deepseek_r1 cannot be used with the tokenizer" in done.stderr


# --- a reasoning parser end to end --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningWorld:
    router: str  # --reasoning-parser qwen3, no tool flags, over the prefill below and the stack's decode node
    alone: str  # a prefill vLLM with --reasoning-parser qwen3 and no tool flags


@pytest.fixture(scope="module")
def reasoning(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReasoningWorld]:
    assert stack.secret_file is not None
    logs = tmp_path_factory.mktemp("reasoning")
    node = httpx.get(stack.decode + "/health", timeout=10).json()
    base = StackConfig(
        model=stack.model,
        prefill_port=free_port(),
        port=free_port(),
        ctrl_port=node["ctrl_port"],
        decode_http_port=int(stack.decode.rsplit(":", 1)[1]),
        reasoning_parser="qwen3",
    )
    env = child_env(stack.secret_file)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_logged(prefill_command(base), {**env, **prefill_env(base)}, logs / "prefill.log"))
        procs.append(start_logged(router_command(base), env, logs / "router.log"))
        world = ReasoningWorld(f"http://127.0.0.1:{base.port}", f"http://127.0.0.1:{base.prefill_port}")
        wait_healthy(world.alone, procs[0], 500, logs / "prefill.log")
        wait_healthy(world.router, procs[1], 60, logs / "router.log")
        yield world
    finally:
        stop_procs(procs)


@pytest.mark.stack
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_router_splits_as_vllm_alone(stack: Stack, reasoning: ReasoningWorld, stream: bool) -> None:
    """No ``</think>`` in a random answer: qwen3's parser makes all of it reasoning, vLLM's and the router's alike."""
    alone = ask(reasoning.alone, stack.model, stream)
    fast = ask(reasoning.router, stack.model, stream)
    assert fast.pool == "tilert"
    assert alone.reasoning and not alone.content
    assert (fast.reasoning, fast.content or None, fast.finish) == (alone.reasoning, alone.content or None, alone.finish)


@pytest.mark.stack
@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_choice_without_its_flags_is_vllms_400(stack: Stack, reasoning: ReasoningWorld, choice: str) -> None:
    """No ``--enable-auto-tool-choice`` / ``--tool-call-parser``: the router answers vLLM's 400, before any prefill."""
    body = {"model": str(stack.model), "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "max_tokens": 4}
    alone = httpx.post(reasoning.alone + "/v1/chat/completions", json=body, timeout=60)
    fast = httpx.post(reasoning.router + "/v1/chat/completions", json=body, timeout=60)
    assert (fast.status_code, alone.status_code) == (400, 400)
    assert fast.json()["error"]["message"] == alone.json()["error"]["message"]
    assert "--tool-call-parser" in alone.json()["error"]["message"]


def test_up_hands_the_parser_flags_to_every_vllm(tmp_path: Path) -> None:
    """``tilert up`` gives vLLM's flags to the prefill, the native decode instance and the router alike."""
    cfg = replace(
        StackConfig(model=tmp_path),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        reasoning_parser="qwen3",
        native=True,
    )
    flags = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3"]
    for cmd in (prefill_command(cfg), native_command(cfg), router_command(cfg)):
        at = cmd.index("--tool-call-parser")
        assert cmd[at : at + len(flags)] == flags
