"""vLLM's logits rules on the TileRT pool: penalties, ``logit_bias``, ``min_p``, ``min_tokens``, ``bad_words``,
``allowed_token_ids``.

- The decode node's rules (``tilert.decode.sampling.LogitsRules``) against vLLM's own functions on the same
  logits: ``apply_penalties`` (repetition over prompt and completion, frequency and presence over the
  completion) and ``apply_bad_words``.
- Through the router (stock vLLM prefill + the decode node), greedy, against what vLLM alone answers with the
  same fields: the same tokens, streamed and not, for each rule and for several at once; each request's answer
  differs from the plain greedy one, so a rule that was ignored would fail.
- What vLLM refuses is refused before prefill with the field named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from openai import BadRequestError, OpenAI
from support.oracle import router_answer, vllm_alone
from support.stack import Stack
from tokenizers import Tokenizer

from tilert.contracts import Sampling
from tilert.decode.sampling import DecodeParams, LogitsRules, Sampler
from tilert.router.detokenize import bad_words_token_ids

VOCAB = 64
MAX_TOKENS = 24
PROMPT = "def add(a, b):"


# ---------------------------------------------------------------------------------------------------
# The rules against vLLM's own code
# ---------------------------------------------------------------------------------------------------


PROMPT_IDS = [3, 7, 7, 9, 11]


def _params(**rules: Any) -> DecodeParams:
    return DecodeParams.of("t", Sampling(temperature=0, **rules), VOCAB, {}, 5, len(PROMPT_IDS), PROMPT_IDS)


@pytest.mark.parametrize(
    "rules",
    [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 1.3},
        {"presence_penalty": -0.8},
        {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.7},
    ],
)
def test_penalties_equal_vllms(rules: dict[str, Any]) -> None:
    from vllm.model_executor.layers.utils import apply_penalties  # lazy: vLLM takes seconds to import

    params = _params(**rules)
    rule = LogitsRules(params, frozenset())
    rule.observe([5, 12, 12, 40])
    logits = torch.randn(VOCAB) * 4
    want = apply_penalties(
        logits.clone()[None],
        torch.tensor([PROMPT_IDS]),
        torch.tensor([rule.output]),
        torch.tensor([params.presence_penalty]),
        torch.tensor([params.frequency_penalty]),
        torch.tensor([params.repetition_penalty]),
    )[0]
    have = rule(logits)
    assert not torch.equal(have, logits), "the rule changed nothing"
    torch.testing.assert_close(have, want, rtol=0, atol=1e-6)


def test_bad_words_equal_vllms() -> None:
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    words = [[9], [12, 40], [40, 41, 42], [7, 13]]
    rule = LogitsRules(_params(bad_words_token_ids=words), frozenset())
    for step in ([5], [12], [40, 41], [3]):  # the completion grows; prefixes match at some steps only
        rule.observe(step[1:] if step == [5] else step)
        logits = torch.randn(VOCAB)
        want = logits.clone()[None]
        apply_bad_words(want, {0: words}, [rule.output])
        assert torch.equal(rule(logits), want[0]), rule.output


def test_min_tokens_allowed_ids_and_bias() -> None:
    params = _params(min_tokens=4, allowed_token_ids=[1, 2, 3, 60], logit_bias={2: 5.0, 60: -100.0})
    rule = LogitsRules(params, frozenset({3, 60}))  # EOS and the stop ids, masked below min_tokens
    logits = torch.zeros(VOCAB)
    got = rule(logits)
    assert torch.isfinite(got).nonzero().flatten().tolist() == [1, 2]  # 3 and 60 are stop ids: masked
    assert got[2] == 5.0 and got[1] == 0.0
    rule.observe([1, 1, 1])  # four completion tokens now: the stop ids are back
    got = rule(logits)
    assert torch.isfinite(got).nonzero().flatten().tolist() == [1, 2, 3, 60]
    assert got[60] == -100.0


def test_min_p_keeps_tokens_near_the_best() -> None:
    params = DecodeParams.of("t", Sampling(temperature=1.0, min_p=0.5, seed=7), VOCAB, {}, 0, 1)
    logits = torch.full((VOCAB,), -10.0)
    logits[[4, 5, 6]] = torch.tensor([2.0, 2.0 - 0.5, 2.0 - 1.0])  # p(6) / p(4) = e^-1 < 0.5 <= p(5) / p(4)
    sampler = Sampler(params)
    assert {sampler(logits) for _ in range(200)} == {4, 5}


def test_generation_config_defaults_apply() -> None:
    params = DecodeParams.of("t", Sampling(), VOCAB, {"repetition_penalty": 1.1, "min_p": 0.05}, 0, 1)
    assert params.repetition_penalty == 1.1 and params.min_p == 0.05
    assert (
        DecodeParams.of("t", Sampling(repetition_penalty=1.0), VOCAB, {"repetition_penalty": 1.1}).repetition_penalty
        == 1.0
    )


def test_out_of_vocabulary_ids_are_refused() -> None:
    for rules in ({"logit_bias": {VOCAB: 1.0}}, {"allowed_token_ids": [VOCAB]}, {"bad_words_token_ids": [[1, VOCAB]]}):
        with pytest.raises(ValueError, match=f"below {VOCAB}"):
            DecodeParams.of("t", Sampling(**rules), VOCAB)


def test_bad_words_tokenize_as_vllm_does(stack: Stack) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.tokenizers import get_tokenizer

    words = ["add", " return", "a, b", "xyzzy"]
    ours = bad_words_token_ids(Tokenizer.from_file(str(stack.model / "tokenizer.json")), words)
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(get_tokenizer(str(stack.model)))
    assert ours == params.bad_words_token_ids


# ---------------------------------------------------------------------------------------------------
# Through the router against vLLM alone
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(stack: Stack) -> list[int]:
    """vLLM's own greedy answer to the prompt, no rules."""
    return vllm_alone(stack, "completion", PROMPT, {"max_tokens": MAX_TOKENS})[0]


def _cases(plain: list[int], tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    seen = sorted(set(plain))
    return {
        # The tiny model's plain answer seldom repeats a token: penalties below neutral make it repeat.
        "repetition": {"repetition_penalty": 0.3},
        "frequency": {"frequency_penalty": -2.0},
        "presence": {"presence_penalty": -2.0},
        "bias": {"logit_bias": {str(plain[3]): -100, str(seen[0] + 1): 3.5}},
        "allowed": {"allowed_token_ids": [t for t in seen if t != plain[2]] + [plain[-1] + 1]},
        "bad_words": {"bad_words": [tokenizer.decode([plain[2]]).strip() or tokenizer.decode([plain[2]])]},
        # Without min_tokens the answer would end at its third token (a stop id): it runs on instead.
        "min_tokens": {"min_tokens": 9, "stop_token_ids": [plain[2]]},
        "together": {"repetition_penalty": 1.3, "presence_penalty": -1.5, "logit_bias": {str(plain[1]): -20}},
    }


CASES = ("repetition", "frequency", "presence", "bias", "allowed", "bad_words", "min_tokens", "together")
STREAMED = ("min_tokens", "together")  # the stream and the whole answer share the path after the node


@pytest.mark.parametrize(("case", "stream"), [(case, False) for case in CASES] + [(case, True) for case in STREAMED])
def test_router_equals_vllm_alone(stack: Stack, plain: list[int], case: str, stream: bool) -> None:
    rules = _cases(plain, Tokenizer.from_file(str(stack.model / "tokenizer.json")))[case]
    want, want_text, _ = vllm_alone(stack, "completion", PROMPT, {"max_tokens": MAX_TOKENS, **rules})
    assert want != plain, f"{case}: vLLM's answer is the plain greedy one; the case tests nothing"
    got, text, usage, pool = router_answer(
        stack.router, stack.model, "completion", PROMPT, stream, max_tokens=MAX_TOKENS, extra=rules
    )
    assert pool == "tilert"
    assert got == want, case
    assert text == want_text
    assert usage["completion_tokens"] == len(want)


def test_chat_with_penalties_equals_vllm_alone(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    rules = {"repetition_penalty": 0.5, "frequency_penalty": -0.4, "max_tokens": MAX_TOKENS}
    want, _, _ = vllm_alone(stack, "chat", messages, rules)
    assert want != vllm_alone(stack, "chat", messages, {"max_tokens": MAX_TOKENS})[0]
    got, _, _, _ = router_answer(stack.router, stack.model, "chat", messages, True, max_tokens=MAX_TOKENS, extra=rules)
    assert got == want


@pytest.mark.parametrize(
    ("rules", "field"),
    [
        ({"min_tokens": 40, "max_tokens": 8}, "min_tokens"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"token": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_bad_values_are_refused_with_the_field(stack: Stack, rules: dict[str, Any], field: str) -> None:
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=60, max_retries=0)
    body = {"max_tokens": 8, **rules}
    with pytest.raises(BadRequestError) as err:
        client.completions.create(
            model=str(stack.model), prompt=PROMPT, max_tokens=body.pop("max_tokens"), extra_body=body
        )
    assert field in str(err.value)
