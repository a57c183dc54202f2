"""``make demo``: start ``tilert up``, stream one chat answer through the router, then keep serving.

Ctrl-C reaches ``tilert up`` (same foreground process group), which stops all three processes.
``tilert up`` makes the deployment's shared secret itself; when the router's client API key is configured
(``$TILERT_ROUTER_API_KEY`` or ``$TILERT_ROUTER_API_KEY_FILE``, which the router inherits), the demo sends it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from tilert.router.config import API_KEY_ENV, API_KEY_FILE_ENV, ConfigError, read_key_file


def _client_api_key() -> str:
    """The key the router will ask for (the same variables it reads), or a placeholder when it asks none."""
    path = os.environ.get(API_KEY_FILE_ENV, "").strip()
    if path:
        try:
            return read_key_file(path, "the API key file")
        except ConfigError:
            return "unused"  # the router refuses to start with the same reason; `tilert up` reports it
    return os.environ.get(API_KEY_ENV, "").strip() or "unused"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()

    up = subprocess.Popen(
        [sys.executable, "-m", "tilert.cli", "up", "--model", str(args.model), "--port", str(args.port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert up.stdout is not None
    urls: dict[str, str] = {}
    try:
        for line in up.stdout:
            print(line, end="", flush=True)
            name, _, url = line.strip().partition(": ")
            if name in ("prefill", "decode", "router"):
                urls[name] = url
            if len(urls) == 3:
                break
        if len(urls) < 3:
            return up.wait() or 1

        from openai import OpenAI

        client = OpenAI(base_url=urls["router"] + "/v1", api_key=_client_api_key())
        print("\nuser: Write a Python function that adds two numbers.\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=str(args.model),
            messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}],
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                print(chunk.choices[0].delta.content, end="", flush=True)
        print(
            "\n\n(a tiny random model: the words are noise, the path is real)\n"
            f"Serving. OpenAI base URL: {urls['router']}/v1  -- Ctrl-C stops all three processes.",
            flush=True,
        )
        for line in up.stdout:
            print(line, end="", flush=True)
        return up.wait()
    except KeyboardInterrupt:
        return up.wait()
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait()


if __name__ == "__main__":
    sys.exit(main())
