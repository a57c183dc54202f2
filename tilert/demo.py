"""``make demo``: start ``tilert up``, stream one chat answer through the router, then keep serving.

Ctrl-C reaches ``tilert up`` (same foreground process group), which stops all three processes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


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

        client = OpenAI(base_url=urls["router"] + "/v1", api_key="unused")
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
