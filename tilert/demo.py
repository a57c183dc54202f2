"""``make demo``: the whole stack on this machine, one question answered by the TileRT pool and by vLLM alone.

It starts ``tilert up`` (which prints one line per process when it is ready, and writes every process's log to a
file), then streams the same greedy answer twice with the OpenAI client: through the router (stock vLLM prefill,
TileRT decode) and from the very same vLLM instance alone (prefill and decode); with ``--native`` a third time
through the native pool (vLLM prefill, vLLM decode over NixlConnector). Each answer is measured as a client sees
it: time to the first token and per-user tokens/s after it, side by side with the ratio. Then it prints the OpenAI
base URL with a ``curl`` and a Python example, and serves until Ctrl-C, which reaches ``tilert up`` (same
foreground process group) and stops every process. SIGTERM or SIGHUP to the demo alone stops ``tilert up`` too.

``tilert up`` makes the deployment's shared secret itself; when the router's client API key is configured
(``$TILERT_ROUTER_API_KEY`` or ``$TILERT_ROUTER_API_KEY_FILE``, which the router inherits), the demo sends it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tilert.router.config import RouterConfig
from tilert.settings import UP_ROUTER_PORT, ConfigError, env_values, read_key_file

QUESTION = "Write a Python function that adds two numbers."
MAX_TOKENS = 64
PROCESSES = ("prefill", "native", "decode", "router")


def _client_api_key() -> str:
    """The key the router will ask for (read from the variables it reads), or a placeholder when it asks none."""
    try:
        given = env_values(RouterConfig)
        path = given.get("api_key_file")
        return read_key_file(path, "the API key file") if path else given.get("api_key") or "unused"
    except ConfigError:
        return "unused"  # the router refuses to start with the same reason; `tilert up` reports it


@dataclass
class Answer:
    """One streamed answer as the client saw it."""

    text: str
    tokens: int
    ttft_s: float
    decode_s: float  # first token to last

    @property
    def tok_s(self) -> float:
        """Per-user speed after the first token."""
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else float("nan")


def ask(base_url: str, model: str, pool: str | None = None, show: bool = True) -> Answer:
    """Stream one greedy chat answer from ``base_url`` (an OpenAI ``/v1`` URL), through ``pool`` when given, printing
    it as it arrives when ``show``."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=_client_api_key(), max_retries=0)
    start = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    tokens = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        extra_headers={"x-tilert-pool": pool} if pool else None,
    )
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].delta.content)
            if show:
                print(chunk.choices[0].delta.content.replace("\n", " "), end="", flush=True)
    if show:
        print(flush=True)
    return Answer("".join(parts), tokens, first - start, last - first)


def _table(rows: dict[str, Answer]) -> list[str]:
    """The measured speeds side by side, with each pool's ratio to vLLM alone."""
    base = rows["vLLM alone"]
    out = [f"{'':34}{'first token':>12}{'per user':>14}{'vs vLLM alone':>15}"]
    for name, a in rows.items():
        ratio = "" if name == "vLLM alone" else f"{a.tok_s / base.tok_s:.2f}x"
        out.append(f"{name:34}{a.ttft_s * 1e3:>9.1f} ms{a.tok_s:>9.0f} tok/s{ratio:>15}")
    return out


def _python() -> str:
    """This interpreter (it has the OpenAI client), relative to the working directory when it lies below it."""
    rel = os.path.relpath(sys.executable)
    return sys.executable if rel.startswith("..") else rel


def _examples(router: str, model: str) -> list[str]:
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'
    return [
        f"Serving. OpenAI base URL: {router}/v1   (Ctrl-C stops every process)",
        f"  curl -s {router}/v1/chat/completions -H 'content-type: application/json' -d '{body}'",
        f"  {_python()} -c \"from openai import OpenAI; c = OpenAI(base_url='{router}/v1', api_key='unused'); "
        f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], "
        'max_tokens=32).choices[0].message.content)"',
    ]


def _wait_ready(up: subprocess.Popen[str]) -> dict[str, str]:
    """Echo ``tilert up``'s lines until the router is ready; the URLs by process (empty if it stopped first)."""
    out: IO[str] | None = up.stdout
    assert out is not None
    urls: dict[str, str] = {}
    for line in out:
        print(line, end="", flush=True)
        name, _, rest = line.strip().partition(": ")
        if name in PROCESSES and rest:
            urls[name] = rest.split()[0]
        if line.startswith("tilert up: serving"):
            return urls
    return {}


def _show(model: str, urls: dict[str, str], native: bool) -> None:
    """Both (three) answers, streamed, then their speeds."""
    routes: dict[str, tuple[str, str | None]] = {
        "TileRT pool (vLLM prefill, TileRT decode)": (urls["router"], "tilert")
    }
    if native:
        routes["native pool (vLLM prefill, vLLM decode)"] = (urls["router"], "vllm")
    routes["vLLM alone"] = (urls["prefill"], None)
    for url, pool in routes.values():  # warm-up, not shown: the first request of a process pays for its start
        ask(url + "/v1", model, pool, show=False)
    print(f"\nuser: {QUESTION}  (greedy, {MAX_TOKENS} tokens)")
    answers: dict[str, Answer] = {}
    for name, (url, pool) in routes.items():
        print(f"\n{name}:", flush=True)
        answers[name.split(" (")[0]] = ask(url + "/v1", model, pool)
    print()
    print("\n".join(_table(answers)))
    texts = {a.text for a in answers.values()}
    print("The same tokens from every path." if len(texts) == 1 else "The answers differ (see the logs).")
    print("(a tiny random model: the words are noise; the path and the speeds are real)\n")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--port", type=int, default=UP_ROUTER_PORT)
    ap.add_argument("--native", action="store_true", help="also the native vLLM decode pool")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "tilert.cli", "up", "--model", str(args.model), "--port", str(args.port)]
    for sig in (signal.SIGTERM, signal.SIGHUP):  # as Ctrl-C: through the ``finally`` below, which stops the stack
        signal.signal(sig, _interrupt)
    up = subprocess.Popen(cmd + (["--native"] if args.native else []), stdout=subprocess.PIPE, text=True)
    try:
        urls = _wait_ready(up)
        if not urls:
            return up.wait() or 1
        try:
            _show(str(args.model), urls, args.native)
        except Exception as exc:  # the client's error, said in one line; the processes' logs say more
            print(f"\ndemo: a request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        print("\n".join(_examples(urls["router"], str(args.model))), flush=True)
        return up.wait()
    except KeyboardInterrupt:  # Ctrl-C reached ``tilert up`` too; a signal to this process alone did not
        up.terminate()
        return up.wait()
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait()


if __name__ == "__main__":
    sys.exit(main())
