"""Locust load test: streaming chat completions through the tilert router.

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 8 -r 2 -t 2m

The router is the one of ``tilert up`` / ``make demo`` unless ``--host`` names another.
Env: TILERT_MODEL (default: first id from /v1/models), TILERT_API_KEY, TILERT_MAX_TOKENS (128),
TILERT_PROMPT_WORDS (200). Besides the request itself it reports "TTFT" and "TPOT" pseudo-requests
(milliseconds) so Locust's percentiles show them. A 429 from admission is counted as a failure named
"rejected (429)" rather than an error of the endpoint.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from tilert.settings import LOOPBACK, UP_ROUTER_PORT

try:
    from locust import HttpUser, between, task
except ImportError:  # pragma: no cover - lets the file be imported (checked) without locust installed

    class HttpUser:  # type: ignore[no-redef]
        client: Any
        environment: Any
        host: str | None = None

    def between(lo: float, hi: float) -> Any:  # type: ignore[no-redef]
        return lambda *_: random.uniform(lo, hi)

    def task(fn: Any) -> Any:  # type: ignore[no-redef]
        return fn


WORDS = "the quick brown fox jumps over a lazy dog while routers stream tokens from prefill to decode".split()


def _prompt(n_words: int) -> str:
    rng = random.Random()
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


class RouterUser(HttpUser):
    host = f"http://{LOOPBACK}:{UP_ROUTER_PORT}"  # `tilert up`'s router; --host overrides it
    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        self.headers: dict[str, str] = {"content-type": "application/json"}
        key = os.environ.get("TILERT_API_KEY")
        if key:
            self.headers["authorization"] = f"Bearer {key}"
        self.max_tokens = int(os.environ.get("TILERT_MAX_TOKENS", "128"))
        self.prompt_words = int(os.environ.get("TILERT_PROMPT_WORDS", "200"))
        self.model = os.environ.get("TILERT_MODEL") or self._first_model()

    def _first_model(self) -> str:
        resp = self.client.get("/v1/models", headers=self.headers, name="/v1/models")
        try:
            return str(resp.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError):
            return "default"

    def _report(self, name: str, ms: float) -> None:
        self.environment.events.request.fire(
            request_type="METRIC", name=name, response_time=ms, response_length=0, exception=None, context={}
        )

    @task
    def chat_stream(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": _prompt(self.prompt_words)}],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start = time.perf_counter()
        first: float | None = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions", json=body, headers=self.headers, stream=True, catch_response=True,
            name="chat stream",
        ) as resp:
            if resp.status_code == 429:
                resp.failure("rejected (429)")
                return
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for raw in resp.iter_lines():
                if not raw or not raw.startswith(b"data: "):
                    continue
                data = raw[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    resp.failure(f"stream error: {event['error'].get('message')}")
                    return
                if event.get("usage"):
                    tokens = int(event["usage"].get("completion_tokens", tokens))
                if first is None and event.get("choices"):
                    first = time.perf_counter()
            resp.success()
        end = time.perf_counter()
        if first is not None:
            self._report("TTFT", (first - start) * 1000)
            if tokens > 1:
                self._report("TPOT", (end - first) * 1000 / (tokens - 1))
