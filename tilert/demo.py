"""``make demo``: start ``tilert up``, stream one chat answer through each decode pool, then keep serving.

With ``--native`` (what ``make demo`` runs) the stack has both pools: one stock vLLM prefill under
``MultiConnector``, the TileRT decode node and a native vLLM decode instance; the same question is asked
once through each pool (header ``x-tilert-pool``), and the pool that answered is printed from the response.
Ctrl-C reaches ``tilert up`` (same foreground process group), which stops every process.
``tilert up`` makes the deployment's shared secret itself; when the router's client API key is configured
(``$TILERT_ROUTER_API_KEY`` or ``$TILERT_ROUTER_API_KEY_FILE``, which the router inherits), the demo sends it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from tilert.router.config import RouterConfig
from tilert.settings import UP_ROUTER_PORT, ConfigError, env_values, read_key_file


def _client_api_key() -> str:
    """The key the router will ask for (read from the variables it reads), or a placeholder when it asks none."""
    try:
        given = env_values(RouterConfig)
        path = given.get("api_key_file")
        return read_key_file(path, "the API key file") if path else given.get("api_key") or "unused"
    except ConfigError:
        return "unused"  # the router refuses to start with the same reason; `tilert up` reports it


QUESTION = "Write a Python function that adds two numbers."


def _ask(router: str, model: str, pool: str | None) -> None:
    """Stream one chat answer through the router (through ``pool`` when given) and say which pool served it."""
    from openai import OpenAI

    client = OpenAI(base_url=router + "/v1", api_key=_client_api_key())
    headers = {"x-tilert-pool": pool} if pool else None
    print(f"\n[{pool or 'default'} pool] user: {QUESTION}\nassistant: ", end="", flush=True)
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_headers=headers,
    )
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print(f"\n(served by the {raw.headers.get('x-tilert-pool')} pool)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--port", type=int, default=UP_ROUTER_PORT)
    ap.add_argument("--native", action="store_true", help="both pools: TileRT and native vLLM decode")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "tilert.cli", "up", "--model", str(args.model), "--port", str(args.port)]
    up = subprocess.Popen(cmd + (["--native"] if args.native else []), stdout=subprocess.PIPE, text=True)
    assert up.stdout is not None
    urls: dict[str, str] = {}
    try:
        for line in up.stdout:
            print(line, end="", flush=True)
            name, _, url = line.strip().partition(": ")
            if name in ("prefill", "native", "decode", "router"):
                urls[name] = url
            if "router" in urls:  # `tilert up` prints the router's URL last
                break
        if "router" not in urls:
            return up.wait() or 1

        for pool in ("tilert", "vllm") if args.native else (None,):
            _ask(urls["router"], str(args.model), pool)
        print(
            "\n(a tiny random model: the words are noise, the path is real)\n"
            f"Serving. OpenAI base URL: {urls['router']}/v1  -- Ctrl-C stops every process.",
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
