"""Log-probabilities on the TileRT pool: ``logprobs`` / ``top_logprobs`` (chat), ``logprobs`` and ``echo``
(completions), ``prompt_logprobs`` and ``return_tokens_as_token_ids``, as vLLM serves them.

- The decode node's computation (``tilert.decode.sampling``) on a real tiny engine's logits: each emitted token's
  logprob, rank and top ones are ``torch.log_softmax`` of the step's raw logits (before the penalties and the
  temperature) and equal vLLM's own ``Sampler.compute_logprobs`` / ``gather_logprobs`` bit for bit.
- The router's rendering (``tilert.router.logprobs``) against vLLM's code on the same inputs: the per-token strings
  (``LogprobsProcessor``, U+FFFD corrected from the tokens before), the chat and completions shapes
  (``_create_chat_logprobs``, ``_create_completion_logprobs``), a sampled token outside the top ones, tokens as
  ids, and a resumed stream's token read back from the prefill's answer.
- Through the router (stock vLLM prefill + the decode node, the real OpenAI client), greedy, against vLLM alone:
  the same tokens, strings and bytes and the same values (within 1e-4: the node's kernels are not vLLM's), streamed
  and not; ``prompt_logprobs`` and ``echo`` as vLLM answers them; what vLLM refuses is a 400 naming the field
  before any prefill.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from openai import BadRequestError, OpenAI
from support.stack import Stack
from tokenizers import Tokenizer

from tilert.contracts import (
    LOGPROB_FLOOR,
    MAX_LINE_BYTES,
    MAX_LINE_LOGPROB_TOKENS,
    ContractError,
    Sampling,
    TokenLine,
    TokenLogprobs,
    dump_line,
    join_runs,
    parse_line,
)
from tilert.decode.generate import Finish, run_decode
from tilert.decode.sampling import DecodeParams, Sampler, gather_logprobs
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine
from tilert.router.logprobs import ChoiceLogprobs, TokenStrings, resumed_logprobs
from tilert.router.validation import build_plan

PROMPT_LEN = 8
MAX_SEQ = 48
TOL = 1e-4

# ---------------------------------------------------------------------------------------------------
# The decode node's logprobs against the engine's logits and vLLM's sampler
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[TileRTEngine, dict[str, torch.Tensor], int]:
    from tilert.models.tiny import build_tiny_model

    path = build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("lp") / "m", seed=0, num_hidden_layers=1)
    eng = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    prompt = torch.randint(8, eng.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3))
    first = int(eng.forward(prompt, 0)[-1].argmax())
    a = eng.model.args
    state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :PROMPT_LEN], "float32", a.kv_lora_rank, True)}
    return eng, state, first


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "logprobs": 5},
        {"temperature": 0, "logprobs": 0},
        {"temperature": 0.9, "seed": 11, "logprobs": 20, "repetition_penalty": 1.5, "frequency_penalty": 1.0},
    ],
)
def test_node_logprobs_are_the_raw_logits_log_softmax(
    engine: tuple[TileRTEngine, dict[str, torch.Tensor], int], sampling: dict[str, Any]
) -> None:
    from vllm.v1.sample.sampler import Sampler as VllmSampler  # lazy: vLLM takes seconds to import

    eng, state, first = engine
    params = DecodeParams.of(
        "t", Sampling(max_tokens=16, **sampling), eng.vocab_size, {}, first, PROMPT_LEN, list(range(PROMPT_LEN))
    )
    emitted: list[tuple[list[int], list[TokenLogprobs] | None]] = []

    def emit(ids: list[int], finish: Finish | None, logprobs: list[TokenLogprobs] | None = None) -> None:
        emitted.append((ids, logprobs))

    finish = run_decode(eng, state, eng.expected_layouts(), PROMPT_LEN, params, frozenset(), emit, threading.Event())
    assert finish == Finish("length")
    tokens = [t for ids, _ in emitted for t in ids]
    logprobs = [lp for _, lps in emitted for lp in lps or []]
    assert len(tokens) == len(logprobs) == 16, "one entry per emitted token"
    eng.inject(state, eng.expected_layouts(), PROMPT_LEN)  # the same steps again, for their raw logits
    token, k = first, sampling["logprobs"]
    for pos, (chosen, got) in enumerate(zip(tokens, logprobs, strict=True), start=PROMPT_LEN):
        logits = eng.forward(torch.tensor([token]), pos)[-1]
        want = torch.log_softmax(logits, dim=-1)
        assert got.logprob == float(want[chosen])
        assert got.rank == int((want >= want[chosen]).sum())
        top = torch.topk(want, k)
        assert (got.top_ids, got.top_logprobs) == (top.indices.tolist(), top.values.tolist())
        vllm = VllmSampler.gather_logprobs(VllmSampler.compute_logprobs(logits[None]), k, torch.tensor([chosen]))
        assert [got.logprob, *got.top_logprobs] == vllm.logprobs[0].tolist()
        assert [chosen, *got.top_ids] == vllm.logprob_token_ids[0].tolist()
        assert got.rank == int(vllm.selected_token_ranks[0])
        token = chosen
    if sampling["temperature"] == 0:
        assert all(lp.rank == 1 for lp in logprobs), "greedy picks the most likely token"


def test_logprobs_are_taken_before_the_rules_and_masked_tokens_show_the_floor() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, float("-inf"), -1.0, float("-inf")])
    rules = Sampling(temperature=0, logprobs=5, logit_bias={4: 50.0})
    sampler = Sampler(DecodeParams.of("t", rules, 6, {}, 0, 1))
    token = sampler(logits.clone())
    assert token == 4, "the bias chose the token"
    raw = torch.log_softmax(logits, dim=-1)
    got = sampler.last_logprobs
    assert got is not None and got.logprob == float(raw[4]) and got.rank == 4
    assert got.top_ids[:4] == [0, 1, 2, 4] and got.top_logprobs[4] == LOGPROB_FLOOR  # -inf as vLLM shows it
    masked = gather_logprobs(raw, 3, 2)
    assert (masked.logprob, masked.rank) == (LOGPROB_FLOOR, 6)


def test_token_lines_carry_one_entry_a_token_and_join_within_their_room() -> None:
    entry = TokenLogprobs(-1.5, 2, [4, 9], [-0.5, -1.5])
    lines = [TokenLine([9], logprobs=[entry]) for _ in range(MAX_LINE_LOGPROB_TOKENS + 5)] + [TokenLine([], "length")]
    joined = join_runs(lines)
    assert [len(line.token_ids) for line in joined] == [MAX_LINE_LOGPROB_TOKENS, 5]  # type: ignore[union-attr]
    assert all(line.logprobs == [entry] * len(line.token_ids) for line in joined)  # type: ignore[union-attr]
    assert joined[-1].finish_reason == "length"  # type: ignore[union-attr]
    raw = dump_line(joined[0])  # type: ignore[arg-type]
    assert len(raw) < MAX_LINE_BYTES and parse_line(raw) == joined[0]
    with pytest.raises(ContractError):
        parse_line(b'{"type": "tokens", "token_ids": [1, 2], "logprobs": [[-1.0, 1, [], []]]}')
    with pytest.raises(ContractError):  # a logprob JSON cannot hold (-inf is sent as the floor)
        parse_line(b'{"type": "tokens", "token_ids": [1], "logprobs": [[null, 1, [], []]]}')


# ---------------------------------------------------------------------------------------------------
# The router's rendering against vLLM's code
# ---------------------------------------------------------------------------------------------------


class Vllm:
    """vLLM's tokenizer, its output processor's logprobs and its OpenAI servers' shaping, on given positions."""

    def __init__(self, model: Path) -> None:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
        from vllm.tokenizers import get_tokenizer

        self.tokenizer = get_tokenizer(str(model))
        self.chat_cls, self.completion_cls = OpenAIServingChat, OpenAIServingCompletion

    def positions(self, tokens: list[int], entries: list[TokenLogprobs], k: int) -> list[Any]:
        from vllm.v1.engine.logprobs import LogprobsProcessor
        from vllm.v1.outputs import LogprobsLists

        proc = LogprobsProcessor(self.tokenizer, [], None, 0.0, k, None)
        for token, lp in zip(tokens, entries, strict=True):
            ids = np.array([[token, *lp.top_ids]], dtype=np.int32)
            values = np.array([[lp.logprob, *lp.top_logprobs]], dtype=np.float32)
            proc._update_sample_logprobs(LogprobsLists(ids, values, np.array([lp.rank])))
        assert proc.logprobs is not None
        return proc.logprobs

    def shaped(self, route: str, tokens: list[int], entries: list[TokenLogprobs], k: int, as_ids: bool) -> Any:
        server = SimpleNamespace(return_tokens_as_token_ids=False)
        cls = self.chat_cls if route == "chat" else self.completion_cls
        server._get_decoded_token = cls._get_decoded_token  # a static method
        server._get_top_logprobs = MethodType(self.chat_cls._get_top_logprobs, server)
        positions = self.positions(tokens, entries, k)
        if route == "chat":
            out = cls._create_chat_logprobs(server, tokens, positions, self.tokenizer, k, None, as_ids)
        else:
            out = cls._create_completion_logprobs(server, tokens, positions, k, self.tokenizer, None, 0, as_ids)
        return out.model_dump()


@pytest.fixture(scope="module")
def vllm_shapes(tiny_model: Path) -> Vllm:
    return Vllm(tiny_model)


def _random_positions(tokens: list[int], vocab: int, k: int, seed: int) -> list[TokenLogprobs]:
    """Entries as a sampler could make them: the token often among the top ones, sometimes not, values falling."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, token in enumerate(tokens):
        top = torch.randperm(vocab, generator=gen)[:k].tolist()
        if i % 3 == 0 and k:
            top[int(torch.randint(k, (1,), generator=gen))] = token  # the token is one of the top ones
        values = sorted((-torch.rand(k, generator=gen) * 8).tolist(), reverse=True)
        logprob = values[top.index(token)] if token in top else -9.5
        rank = top.index(token) + 1 if token in top else k + 1 + i
        out.append(TokenLogprobs(logprob, rank, top, values))
    return out


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize(("k", "as_ids"), [(0, False), (3, False), (20, False), (4, True)])
def test_rendering_equals_vllms(vllm_shapes: Vllm, tiny_model: Path, route: str, k: int, as_ids: bool) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    # Multi-byte characters: byte-level tokens whose strings alone end in U+FFFD, corrected from the tokens before.
    tokens = tokenizer.encode("héllo wörld ñ 日本語 😀 ok", add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokens), "the case tests no U+FFFD correction"
    entries = _random_positions(tokens, tokenizer.get_vocab_size(), k, seed=k)
    fields = (
        {"messages": [{}], "logprobs": True, "top_logprobs": k} if route == "chat" else {"prompt": "x", "logprobs": k}
    )
    plan = build_plan(route, orjson.dumps({**fields, "return_tokens_as_token_ids": as_ids}))  # type: ignore[arg-type]
    ours = ChoiceLogprobs(plan, TokenStrings(tokenizer), [])
    ours.add(tokens[:5], entries[:5], [])  # in two lines, as a stream brings them
    ours.add(tokens[5:], entries[5:], tokens[:5])
    assert ours.whole() == vllm_shapes.shaped(route, tokens, entries, k, as_ids)


def test_token_strings_equal_vllms_for_the_whole_vocabulary(vllm_shapes: Vllm, tiny_model: Path) -> None:
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = list(range(tokenizer.get_vocab_size()))
    assert TokenStrings(tokenizer).pieces(ids) == convert_ids_list_to_tokens(vllm_shapes.tokenizer, ids)


def test_a_resumed_token_reads_back_as_the_same_position(vllm_shapes: Vllm, tiny_model: Path) -> None:
    """A resumed stream's prefill answers its token as ids (completions, ``return_tokens_as_token_ids``): read back,
    it renders as the node's own entry would."""
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    tokens = tokenizer.encode("a b ñ c", add_special_tokens=False).ids
    entries = _random_positions(tokens, tokenizer.get_vocab_size(), 4, seed=9)
    plan = build_plan("completions", orjson.dumps({"prompt": "x", "logprobs": 4}))
    for i, token in enumerate(tokens):
        answer = vllm_shapes.shaped("completions", tokens[: i + 1], entries[: i + 1], 4, True)
        last = {key: values[-1:] for key, values in answer.items()}
        back = resumed_logprobs({"choices": [{"logprobs": last}]}, token)
        direct, read = (ChoiceLogprobs(plan, TokenStrings(tokenizer), []) for _ in range(2))
        direct.add([token], [entries[i]], tokens[:i])
        read.add([token], [back], tokens[:i])
        assert read.whole() == direct.whole()


# ---------------------------------------------------------------------------------------------------
# Through the router against vLLM alone
# ---------------------------------------------------------------------------------------------------

MAX_TOKENS = 24
MESSAGES = [{"role": "user", "content": "Write a function that reverses a list."}]
PROMPT = "def add(a, b):"


def _close(want: Any, got: Any, where: str = "$") -> None:
    """Equal JSON values, floats within ``TOL``."""
    if isinstance(want, float) or isinstance(got, float):
        assert isinstance(got, int | float) and isinstance(want, int | float), (where, want, got)
        assert abs(want - got) <= TOL, (where, want, got)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(want), got)
        for key in want:
            _close(want[key], got[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, len(want), got)
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            _close(a, b, f"{where}[{i}]")
    else:
        assert want == got, (where, want, got)


def _answer(
    base: str, kind: str, stream: bool, fields: dict[str, Any], model: Path, router: bool
) -> tuple[str, Any, Any]:
    """(text, the choice's logprobs, the OpenAI client's parsed response or last chunk) of one request through the
    real OpenAI client, the stream's chunks joined; ``router``: the answer must come from the TileRT pool."""
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)
    common: dict[str, Any] = {"model": str(model), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    extra = {k: v for k, v in fields.items() if k in ("prompt_logprobs", "ignore_eos")}
    known = {k: v for k, v in fields.items() if k not in extra}
    if kind == "chat":
        raw = client.chat.completions.with_raw_response.create(messages=MESSAGES, extra_body=extra, **common, **known)
    else:
        raw = client.completions.with_raw_response.create(prompt=PROMPT, extra_body=extra, **common, **known)
    if router:
        assert raw.headers.get("x-tilert-pool") == "tilert"
    resp = raw.parse()
    if not stream:
        choice = resp.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text or "", None if choice.logprobs is None else choice.logprobs.model_dump(), resp
    text, joined, last = "", None, None
    for chunk in resp:
        last = chunk
        for choice in chunk.choices:
            text += (choice.delta.content if kind == "chat" else choice.text) or ""
            if choice.logprobs is not None:
                part = choice.logprobs.model_dump()
                joined = part if joined is None else {k: (joined[k] or []) + (part[k] or []) for k in part}
    return text, joined, last


CASES = [
    ("chat", {"logprobs": True, "top_logprobs": 5}),
    ("chat", {"logprobs": True, "top_logprobs": 20}),
    ("chat", {"logprobs": True}),
    ("completion", {"logprobs": 5}),
    ("completion", {"logprobs": 20}),
    ("completion", {"logprobs": 0}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("kind", "fields"), CASES)
def test_router_equals_vllm_alone(stack: Stack, kind: str, fields: dict[str, Any], stream: bool) -> None:
    fields = {**fields, "ignore_eos": True}
    want_text, want, _ = _answer(stack.prefill, kind, stream, fields, stack.model, router=False)
    text, got, resp = _answer(stack.router, kind, stream, fields, stack.model, router=True)
    assert text == want_text
    entries = want["content"] if kind == "chat" else want["tokens"]
    assert len(entries) == MAX_TOKENS
    _close(want, got)
    if kind == "chat" and not stream:  # the SDK's typed objects
        item = resp.choices[0].logprobs.content[3]
        assert isinstance(item.logprob, float) and len(item.top_logprobs) == fields.get("top_logprobs", 0)
        if item.top_logprobs:
            assert isinstance(item.top_logprobs[0].logprob, float) and item.top_logprobs[0].token == item.token


@pytest.mark.parametrize(
    ("kind", "fields", "stream"),
    [
        ("completion", {"echo": True, "logprobs": 3}, False),
        ("completion", {"echo": True, "logprobs": 3}, True),
        ("completion", {"echo": True}, False),
        ("completion", {"prompt_logprobs": 2}, False),
        ("completion", {"prompt_logprobs": 1, "logprobs": 2, "echo": True}, False),
        ("chat", {"prompt_logprobs": 2, "logprobs": True, "top_logprobs": 2}, False),
    ],
)
def test_prompt_logprobs_and_echo_equal_vllm_alone(
    stack: Stack, kind: str, fields: dict[str, Any], stream: bool
) -> None:
    want_text, want, want_resp = _answer(stack.prefill, kind, stream, fields, stack.model, router=False)
    text, got, resp = _answer(stack.router, kind, stream, fields, stack.model, router=True)
    assert text == want_text
    if fields.get("echo"):
        assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    _close(want, got)
    if "prompt_logprobs" in fields:
        holder = (lambda r: r.model_extra) if kind == "chat" else (lambda r: r.choices[0].model_extra)
        assert holder(want_resp)["prompt_logprobs"], "vLLM answered no prompt logprobs: the case tests nothing"
        _close(holder(want_resp)["prompt_logprobs"], holder(resp)["prompt_logprobs"])


def test_echo_of_a_token_prompt_equals_vllm_alone(stack: Stack) -> None:
    body = {"model": str(stack.model), "prompt": [5, 300, 41, 1000], "max_tokens": 8, "temperature": 0}
    body.update(echo=True, logprobs=2)
    want, got = (
        httpx.post(url + "/v1/completions", json=body, timeout=120).json() for url in (stack.prefill, stack.router)
    )
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    _close(want["choices"][0]["logprobs"], got["choices"][0]["logprobs"])


@pytest.mark.parametrize(
    ("kind", "fields", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
        ("completion", {"logprobs": 21}, "logprobs"),
        ("completion", {"logprobs": -3}, "logprobs"),
        ("completion", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completion", {"prompt_logprobs": -4}, "prompt_logprobs"),
        ("completion", {"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ],
)
def test_invalid_values_are_400_naming_the_field_before_any_prefill(
    stack: Stack, kind: str, fields: dict[str, Any], param: str
) -> None:
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    before = _prefills(stack.router)
    with pytest.raises(BadRequestError) as err:
        if kind == "chat":
            client.chat.completions.create(model=str(stack.model), messages=MESSAGES, max_tokens=4, extra_body=fields)
        else:
            client.completions.create(model=str(stack.model), prompt=PROMPT, max_tokens=4, extra_body=fields)
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == param and f"parameter={param}" in body["message"]
    assert _prefills(stack.router) == before, "a prefill ran for a refused request"


def _prefills(router: str) -> float:
    """The prefill calls the router made so far (``tilert:prefill_requests_total``, every instance and outcome)."""
    text = httpx.get(router + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("tilert:prefill_requests_total")
    )
