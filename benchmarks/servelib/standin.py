"""The prefill stand-in: vLLM's OpenAI server where the router touches it, prefilling with the TileRT engine and
handing the KV off through the real connector (:mod:`servelib.prefill_side`). Its own process, a Starlette app
served by uvicorn on loopback (``gpu_serving.py --serve-standin``).

``POST /v1/completions`` and ``/v1/chat/completions`` answer the router's prefill leg as vLLM's server does: the
prompt tokenized as vLLM does (a string with the tokenizer's special tokens, token ids as they are; a chat through the
tokenizer's chat template with the generation prompt, then without special tokens), the engine's prefill
(``forward(prompt_ids, 0)``, the first token its argmax), the KV written into vLLM's paged caches and saved layer by
layer by the connector's worker half, and vLLM's non-streaming reply with ``token_ids``, ``prompt_token_ids``, usage,
and the connector's ``request_finished`` answer (the :class:`~tilert.contracts.ClaimResult`) in
``kv_transfer_params``. Asked to stream (a client calling it directly, as it would call vLLM alone), it answers
vLLM's stream of that one token: a chunk with the token, a chunk with the finish reason, ``[DONE]``. Prefills run
one at a time (vLLM's engine core steps one batch at a time; this one batches nothing). It refuses what it does not
compute: sampling (temperature > 0), ``n`` > 1, more than one token.

For the benchmark: ``POST /bench/reference`` (the engine's own tokens and speed, :mod:`servelib.reference`),
``GET /bench/timings`` (each prefill's time here, by the request's ``x-request-id``, which the router forwards:
waiting for the engine, the prefill step, the part of it in the connector's own calls, the whole handler).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from servelib.paged import MlaKind, PagedCaches
from servelib.prefill_side import ConnectorDriver
from servelib.reference import engine_speed, prompt_tokens
from tilert.auth import load_secret
from tilert.contracts import ConnectorSettings, KVLayout
from tilert.decode.config import resolve_dtype
from tilert.engines.tilert.engine import TileRTEngine
from tilert.models.checkpoint import eos_token_ids


@dataclass(frozen=True)
class StandinSpec:
    model: Path
    served_name: str
    device: str
    dtype: str
    kv_layout: MlaKind
    max_model_len: int
    max_sequences: int
    connector: ConnectorSettings


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def _refuse(message: str, status: int = 400, param: str | None = None) -> Response:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return _json({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _sse(reply: dict[str, Any], chat: bool) -> Response:
    """``reply`` as vLLM streams it: the token's chunk, the finish reason's chunk, ``[DONE]`` (one write: the token is
    known before the first byte goes out)."""
    choice = reply["choices"][0]
    head = {k: reply[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": choice["message"]["content"]}}
        last = {"index": 0, "delta": {}}
    else:
        first, last = {"index": 0, "text": choice["text"]}, {"index": 0, "text": ""}
    first |= {"logprobs": None, "finish_reason": None, "token_ids": choice["token_ids"]}
    last |= {"logprobs": None, "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"]}
    events = [orjson.dumps({**head, "choices": [c]}) for c in (first, last)]
    return Response(
        b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n", media_type="text/event-stream"
    )


class PrefillStandin:
    def __init__(self, spec: StandinSpec) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.spec = spec
        self.engine = TileRTEngine.load(
            spec.model,
            device=spec.device,
            dtype=resolve_dtype(spec.dtype, spec.device),
            max_seq_len=spec.max_model_len,
            max_sequences=spec.max_sequences,
        )
        self.tokenizer = AutoTokenizer.from_pretrained(spec.model)
        self.eos = eos_token_ids(spec.model)
        self.caches = PagedCaches.build(self.engine, spec.kv_layout, spec.max_model_len)
        hf_config = AutoConfig.from_pretrained(spec.model)
        self.driver = ConnectorDriver(self.caches, hf_config, load_secret(), spec.connector, spec.max_model_len)
        self.timings: dict[str, dict[str, float]] = {}
        # prompt -> its first token and the engine's cache rows for it (sequence 0): a prompt seen before is a
        # prefix-cache hit, as in vLLM (its pages are filled from these rows and saved through the connector)
        self._prefixes: dict[tuple[int, ...], tuple[int, list[torch.Tensor]]] = {}
        self._alone: dict[tuple[tuple[int, ...], int], dict[str, Any]] = {}  # the reference's tokens per prompt
        self._ids = itertools.count()
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/health", self._health),
                Route("/bench/reference", self._reference, methods=["POST"]),
                Route("/bench/timings", self._timings, methods=["GET"]),
            ]
        )

    def prompt_ids(self, chat: bool, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids as vLLM's OpenAI server makes them."""
        if chat:
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string or a list of token ids")
        return list(self.tokenizer(prompt).input_ids)

    def _refusal(self, body: dict[str, Any], chat: bool) -> Response | None:
        if body.get("model") != self.spec.served_name:
            return _refuse(f"The model `{body.get('model')}` does not exist.", 404, "model")
        if body.get("max_tokens") != 1:
            return _refuse("the prefill stand-in answers a prefill: max_tokens=1", param="max_tokens")
        if (body.get("temperature") or 0) > 0 or (body.get("n") or 1) != 1:
            return _refuse("the prefill stand-in prefills greedily: temperature 0, n 1", param="temperature")
        if chat and not isinstance(body.get("messages"), list):
            return _refuse("messages must be a list", param="messages")
        return None

    async def _generate(self, request: Request) -> Response:
        arrived = time.perf_counter()
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _refuse(f"malformed JSON: {exc}")
        chat = request.url.path.endswith("/chat/completions")
        refusal = self._refusal(body, chat)
        if refusal is not None:
            return refusal
        try:
            ids = self.prompt_ids(chat, body)
        except (ValueError, TypeError, KeyError) as exc:
            return _refuse(str(exc), param="messages" if chat else "prompt")
        if not ids or len(ids) >= self.spec.max_model_len:
            return _refuse(f"a prompt of {len(ids)} tokens: 1 to {self.spec.max_model_len - 1} fit", param="prompt")
        req_id = f"{'chatcmpl' if chat else 'cmpl'}-standin-{next(self._ids)}"
        params = body.get("kv_transfer_params")
        first, result, times = await anyio.to_thread.run_sync(self._prefill, req_id, ids, params)
        times["handler_ms"] = 1000 * (time.perf_counter() - arrived)
        self.timings[request.headers.get("x-request-id", req_id)] = times
        reply = self._reply(body, chat, req_id, ids, first, result)
        return _sse(reply, chat) if body.get("stream") else _json(reply)

    def _prefill(self, req_id: str, ids: list[int], params: Any) -> tuple[int, dict | None, dict[str, float]]:
        """One prefill step through the connector (one at a time): first token, ``kv_transfer_params``, times."""
        t0 = time.perf_counter()
        claim = params if isinstance(params, dict) else None
        with self.driver.lock:
            t1 = time.perf_counter()
            self.driver.connector_s.clear()
            hit = self._prefixes.get(tuple(ids))
            with self.driver.step(req_id, claim, ids, computed=hit is None):
                if hit is None:
                    first = int(self.engine.forward(torch.tensor(ids), 0)[-1].argmax())
                    self._prefixes[tuple(ids)] = (first, [c[:, : len(ids)].clone() for c in self._rows()])
                else:
                    first = hit[0]
                    for cache, saved in zip(self._rows(), hit[1], strict=True):
                        cache[:, : len(ids)] = saved
            result = self.driver.finished(req_id, claim, first, len(ids))
            t2 = time.perf_counter()
            hooks = {f"connector_{k}_ms": 1000 * v for k, v in self.driver.connector_s.items()}
        times = {"queue_ms": 1000 * (t1 - t0), "prefill_ms": 1000 * (t2 - t1), **hooks}
        times["connector_ms"] = sum(v for k, v in hooks.items() if not k.endswith("_cpu_ms"))
        return first, result, {**times, "cached": hit is not None}

    def _rows(self) -> list[torch.Tensor]:
        """The engine's caches the paged caches are filled from (sequence 0's rows first)."""
        m = self.engine.model
        return [m.kv_cache, m.index_cache] if m.index_cache.numel() else [m.kv_cache]

    def _reply(
        self, body: dict[str, Any], chat: bool, req_id: str, ids: list[int], first: int, result: dict | None
    ) -> dict[str, Any]:
        text = self.tokenizer.decode([first], skip_special_tokens=True)
        stop = (first in self.eos and not body.get("ignore_eos")) or first in (body.get("stop_token_ids") or [])
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": "stop" if stop else "length",
            "stop_reason": first if stop and first not in self.eos else None,
            "token_ids": [first],
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["prompt_token_ids"] = ids
        reply: dict[str, Any] = {
            "id": req_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
            "kv_transfer_params": result,
        }
        if chat:
            reply["prompt_token_ids"] = ids
        return reply

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _timings(self, request: Request) -> Response:
        return _json(self.timings)

    def _prompt_tokens(self, lays: dict[str, KVLayout], ids: list[int], tokens: int) -> dict[str, Any]:
        """:func:`prompt_tokens` of a prompt, once per prompt and length: a run of several node configurations asks
        for the same prompts again (the engine and its caches are the same, and so are the tokens)."""
        key = (tuple(ids), tokens)
        if key not in self._alone:
            self._alone[key] = prompt_tokens(self.caches, lays, ids, tokens)
        return self._alone[key]

    async def _reference(self, request: Request) -> Response:
        """``{"requests": [{"route", "body"}], "tokens", "users", "drafts", "accept_all", "draft_head",
        "draft_vocab"}``: each
        request's prompt ids and the engine's tokens for it, and the engine's speed per number of users."""
        ask = orjson.loads(await request.body())
        prompts = [self.prompt_ids(r["route"] == "chat", r["body"]) for r in ask["requests"]]

        def run() -> dict[str, Any]:
            with self.driver.lock:
                lays = self.driver.worker.layouts
                alone = [self._prompt_tokens(lays, ids, ask["tokens"]) for ids in prompts]
                speed = engine_speed(
                    self.caches,
                    lays,
                    prompts,
                    alone,
                    ask["users"],
                    ask["drafts"],
                    ask.get("accept_all", False),
                    ask.get("draft_head", "model"),
                    ask.get("draft_vocab"),
                )
            return {"prompts": alone, "speed": {str(k): v for k, v in speed.items()}, "mtp": self.engine.supports_mtp}

        return _json(await anyio.to_thread.run_sync(run))


def serve(spec: StandinSpec, port: int) -> None:
    standin = PrefillStandin(spec)
    poller = threading.Thread(target=standin.driver.poll_forever, name="standin-poll", daemon=True)
    poller.start()
    try:
        uvicorn.run(standin.app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        standin.driver.close()
