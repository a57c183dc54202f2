"""The end-to-end oracle: what stock vLLM answers alone (greedy, float32), and what a router answers for the same
request through the real OpenAI client; the prompts both are given."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any, Protocol

import httpx
from openai import OpenAI
from transformers import AutoTokenizer

MAX_TOKENS = 32


class Prefilling(Protocol):
    """What :func:`vllm_alone` needs of a stack: vLLM's URL and the model it serves."""

    @property
    def prefill(self) -> str: ...

    @property
    def model(self) -> Path: ...


def source_text(n_tokens: int, model: Path, offset: int = 0) -> str:
    """About ``n_tokens`` tokens of real Python source (the stdlib is always on disk)."""
    tok = AutoTokenizer.from_pretrained(model)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[offset:]
    ids = tok(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tok.decode(ids)


def prompts(model: Path) -> list[tuple[str, Any]]:
    """(kind, prompt-or-messages): short, ~100 tokens (several 16-token blocks), ~500 tokens."""
    return [
        ("completion", "def add(a, b):"),
        ("completion", "Hello"),
        ("completion", source_text(100, model)),
        ("completion", source_text(500, model, offset=3000)),
        ("chat", [{"role": "user", "content": "Write a function that reverses a list."}]),
        ("chat", [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "import os"}]),
        ("chat", [{"role": "user", "content": source_text(120, model, offset=500)}]),
        (
            "chat",
            [
                {"role": "user", "content": source_text(250, model, offset=6000)},
                {"role": "assistant", "content": "Noted."},
                {"role": "user", "content": source_text(230, model, offset=9000)},
            ],
        ),
    ]


def request_body(kind: str, prompt: Any, model: Path) -> dict[str, Any]:
    key = "messages" if kind == "chat" else "prompt"
    return {"model": str(model), key: prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}


def vllm_alone(
    stack: Prefilling, kind: str, prompt: Any, extra: dict[str, Any] | None = None
) -> tuple[list[int], str, int]:
    """(token ids, text, prompt tokens) of vLLM's own answer to an unmarked request (no connector involved);
    ``extra``: more request fields (sampling rules, ``max_tokens``)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = {**request_body(kind, prompt, stack.model), **(extra or {})}
    r = httpx.post(stack.prefill + path, json=body, timeout=120)
    r.raise_for_status()
    data = r.json()
    assert data["kv_transfer_params"] is None, "an unmarked request must not be claimed by the connector"
    choice = data["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return choice["token_ids"], text, data["usage"]["prompt_tokens"]


POOL_HEADER = "x-tilert-pool"


def router_call(
    router: str, model: Path, kind: str, prompt: Any, stream: bool
) -> tuple[list[int], str, dict[str, int]]:
    """(token ids, text, usage) of the router's answer, through the OpenAI client, streamed or not."""
    ids, text, usage, _ = router_answer(router, model, kind, prompt, stream)
    return ids, text, usage


def router_answer(
    router: str,
    model: Path,
    kind: str,
    prompt: Any,
    stream: bool,
    *,
    pool: str | None = None,
    max_tokens: int = MAX_TOKENS,
    extra: dict[str, Any] | None = None,
) -> tuple[list[int], str, dict[str, int], str | None]:
    """(token ids, text, usage, the pool that served it: the ``x-tilert-pool`` header) of the router's answer,
    through the OpenAI client, streamed or not; ``pool`` asks for a pool with the same header; ``extra``: more
    request fields (sent as the client's ``extra_body``)."""
    client = OpenAI(base_url=router + "/v1", api_key="unused", timeout=120, max_retries=0)
    kwargs: dict[str, Any] = {
        "model": str(model),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "extra_body": {"return_token_ids": True, **(extra or {})},
        "extra_headers": {POOL_HEADER: pool} if pool else None,
    }
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    api = client.chat.completions if kind == "chat" else client.completions
    raw = api.with_raw_response.create(**({"messages": prompt} if kind == "chat" else {"prompt": prompt}), **kwargs)
    served = raw.headers.get(POOL_HEADER)
    resp = raw.parse()
    if not stream:
        choice = resp.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return list(choice.model_extra["token_ids"]), text or "", resp.usage.model_dump(), served
    ids: list[int] = []
    parts: list[str] = []
    usage: dict[str, int] = {}
    for chunk in resp:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            ids.extend((choice.model_extra or {}).get("token_ids") or [])
            parts.append((choice.delta.content if kind == "chat" else choice.text) or "")
    return ids, "".join(parts), usage, served
