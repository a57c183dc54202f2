"""Where a router's CPU time went (``--router-profile``): its cProfile stats (process CPU time) summed by what the
code does on the relay path, each part's own time (``tottime``) per relayed token."""

from __future__ import annotations

import pstats
from pathlib import Path
from typing import Any

# (part, path fragments of the functions it holds), first match wins; the rest is "other"
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "decode stream read (decode_stream, http1 / aiohttp)",
        (
            "tilert/router/decode_stream.py",
            "tilert/router/http1.py",
            "httptools",
            "aiohttp/streams.py",
            "aiohttp/client_proto.py",
            "aiohttp/base_protocol.py",
        ),
    ),
    ("node lines: parse and join (msgspec, contracts)", ("tilert/contracts.py", "msgspec", "node_client.py:_lines")),
    ("token loop and detokenizer", ("tilert/router/token_loop.py", "tilert/router/detokenize.py", "DecodeStream")),
    ("SSE chunk (openai_format, orjson)", ("tilert/router/openai_format.py", "orjson")),
    (
        "ASGI send (output, middleware, starlette, uvicorn)",
        ("tilert/router/output.py", "tilert/router/middleware.py", "starlette/", "uvicorn/"),
    ),
    ("metrics (prometheus_client)", ("tilert/router/metrics.py", "prometheus_client/")),
    ("logging (structlog, logging)", ("structlog/", "/logging/")),
    ("the request's flow (flow.py)", ("tilert/router/flow.py",)),
    ("per-request router code (app, validation, lease, pool, prefill, node calls)", ("tilert/router/",)),
    ("anyio", ("anyio/", "sniffio/")),
    ("other aiohttp (requests, connections)", ("aiohttp/",)),
    ("asyncio", ("asyncio/",)),
)


def _part(filename: str, name: str) -> str:
    where = f"{filename}:{name}"
    for part, marks in PARTS:
        if any(mark in where for mark in marks):
            return part
    return "other"


def summarize(path: Path, tokens: float, requests: float) -> dict[str, Any]:
    """Each part's own CPU seconds in the stats at ``path`` (a built-in's, such as ``len`` or a ``DecodeStream``
    step, counted in the part of the function that called it), and per token and per request of the run."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    seconds: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, callers) in stats.items():
        if filename != "~" or not callers:
            part = _part(filename, name)
            seconds[part] = seconds.get(part, 0.0) + tottime
            continue
        for (caller_file, _, caller_name), edge in callers.items():  # edge: (calls, calls, own time, cumulative)
            part = _part(caller_file, caller_name) if caller_file != "~" else _part(filename, name)
            seconds[part] = seconds.get(part, 0.0) + edge[2]
    total = sum(seconds.values())
    parts = sorted(seconds.items(), key=lambda kv: -kv[1])
    return {
        "seconds": total,
        "tokens": tokens,
        "requests": requests,
        "parts": [
            {"part": part, "seconds": s, "share": s / total if total else None, "us_per_token": 1e6 * s / tokens}
            for part, s in parts
        ],
    }


def profile_table(profiles: dict[str, dict[str, Any]]) -> str:
    """Markdown: each part's share of each profiled router's CPU time and its microseconds per token."""
    names = list(profiles)
    parts = [p["part"] for p in profiles[names[0]]["parts"]]
    for name in names[1:]:
        parts += [p["part"] for p in profiles[name]["parts"] if p["part"] not in parts]
    lines = [
        "| part | " + " | ".join(f"{n}: share | {n}: us / token" for n in names) + " |",
        "|---|" + "---:|---:|" * len(names),
    ]
    for part in parts:
        cells = []
        for name in names:
            row = next((p for p in profiles[name]["parts"] if p["part"] == part), None)
            cells += ["-", "-"] if row is None else [f"{100 * row['share']:.1f}%", f"{row['us_per_token']:.1f}"]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    totals = [
        cell for n in names for cell in (f"{profiles[n]['seconds']:.2f} s", f"{profiles[n]['tokens']:.0f} tokens")
    ]
    lines.append("| all (profiled CPU time; tokens relayed meanwhile) | " + " | ".join(totals) + " |")
    return "\n".join(lines)
