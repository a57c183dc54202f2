"""``seed`` on the TileRT pool: a sampled request (temperature 1) with a seed gives the same answer every time,
streamed or not, as vLLM's seeded sampling does; another seed gives another answer.

Through the router (stock vLLM prefill samples the first token with the seed, the decode node the rest).
"""

from __future__ import annotations

import pytest
from support.oracle import router_answer
from support.stack import Stack

TOKENS = 32


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_seed_repeats_its_answer(stack: Stack, kind: str) -> None:
    prompt = "def add(a, b):" if kind == "completion" else [{"role": "user", "content": "Tell me a story."}]

    def answer(seed: int, stream: bool) -> list[int]:
        extra = {"temperature": 1.0, "seed": seed, "ignore_eos": True}
        ids, _, usage, pool = router_answer(
            stack.router, stack.model, kind, prompt, stream, max_tokens=TOKENS, extra=extra
        )
        assert pool == "tilert" and usage["completion_tokens"] == TOKENS == len(ids)
        return ids

    first = answer(1234, stream=False)
    assert answer(1234, stream=True) == first
    assert answer(1234, stream=False) == first
    assert answer(99, stream=False) != first  # sampled: a different seed, a different answer
