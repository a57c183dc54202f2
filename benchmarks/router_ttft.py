"""The time to first token the router adds over its prefill: one user, one request at a time, long prompts.

The stand-ins of :mod:`tilert.testing.standins` (``e2e.py --standin``: vLLM's non-streaming prefill reply, the
decode node's API; the decode answers at once, the prefill after ``--prefill-ms``) on loopback, the real router
(``tilert router``) in between, and, with ``--baseline-router DIR``, a second router run from DIR's ``tilert`` (e.g.
``git archive`` of an earlier commit) against the same stand-ins in the same rounds. Each request is a greedy
streaming request of ``--tokens`` tokens after a ``--prompt-tokens``-token prompt, of each kind of ``--kinds``:

- ``ids``: a completion whose prompt is the token ids of a text (code-like words);
- ``random``: a completion whose prompt is seeded random token ids, as ``gpu_serving.py`` sends, whose text has no
  clean tail (no last 4 to 23 tokens decode without U+FFFD): the router's detokenizer then primes with the whole
  prompt, as vLLM's did;
- ``text``: a completion whose prompt is the text of ``ids``;
- ``chat``: a chat completion with that text as one user message;

sent by each client of ``--clients``:

- ``httpx``: httpx with the body encoded once (what the serving path costs, the client's own cost near none);
- ``sdk``: the OpenAI SDK's ``AsyncOpenAI`` (what a user's client adds: it checks and copies every field of the
  request, the prompt's token ids one by one, before it sends it).

Paths: ``direct`` is the router's prefill call made by the client itself (the same body with ``max_tokens=1``,
not streamed, the router's claim): its time to the answer; ``router`` / ``baseline`` the request through a router:
the time to its first SSE event that carries a choice (the stream is then read to its end). ``added`` = router -
direct: what the router and its extra hop add to the prefill's own time (the prefill stand-in's time is in both).

A run is ``--requests`` requests of each path one after another, the paths taking turns request by request (their
order alternating), so a spell of load on the shared machine meets them alike; each round runs every kind and
client. The table shows, per kind and client, the median over rounds of each run's p50 and p90, and the router's
own means from its ``/metrics`` (time to first token, prefill leg) and its CPU time per request.

Writes ``NAME.json`` and ``NAME.md`` (default ``benchmarks/results/cpu-router-ttft``; ``--out DIR``, ``--name``).

    python benchmarks/router_ttft.py                                     # this checkout's router alone
    python benchmarks/router_ttft.py --baseline-router /tmp/before       # against an earlier one, same rounds
    python benchmarks/router_ttft.py --prefill-ms 10                     # the router idle while the prefill works
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
from e2elib.conditions import DEFAULT_MODEL_DIR, conditions, ensure_model
from e2elib.load import overhead_prompt
from e2elib.probes import RouterProbe
from e2elib.procs import Procs, parse_cpus, supervised, wait_healthy
from e2elib.tables import fmt
from openai import AsyncOpenAI
from results_header import RESULTS_DIR, recorded, write_json, write_md
from tokenizers import Tokenizer

from tilert import contracts as c
from tilert.auth import SECRET_ENV, generate_secret
from tilert.netio import free_port

KINDS = ("ids", "random", "text", "chat")
CLIENTS = ("httpx", "sdk")
E2E = Path(__file__).resolve().parent / "e2e.py"


def _names(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"a comma list of {', '.join(allowed)}")
        return names

    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="tiny checkpoint (built there if missing)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16, help="tokens each request streams (max_tokens)")
    ap.add_argument("--kinds", type=_names(KINDS), default=list(KINDS), help="comma list of " + ",".join(KINDS))
    ap.add_argument("--clients", type=_names(CLIENTS), default=list(CLIENTS), help="comma list of " + ",".join(CLIENTS))
    ap.add_argument("--requests", type=int, default=40, help="requests per run, one at a time")
    ap.add_argument(
        "--prefill-ms",
        type=float,
        default=0.0,
        help="how long the prefill stand-in takes a prefill (0: it answers at once); the router sits idle meanwhile, "
        "as while vLLM works, so its code after the answer runs cold, as it does in service",
    )
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-router", type=Path, default=None, help="a second router from DIR's tilert")
    ap.add_argument("--router-cpus", default="", help="CPU set of the router process(es) (default: unpinned)")
    ap.add_argument("--startup-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None, help="directory of NAME.json / NAME.md (default: results/)")
    ap.add_argument("--name", default="cpu-router-ttft")
    ap.add_argument("--note", default=None, help="a line put at the top of the markdown")
    return ap


class Prompt:
    """The prompt of every request: ``ids`` (``--prompt-tokens`` of them), their text, and as many random ids."""

    def __init__(self, model: Path, tokens: int) -> None:
        tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        words = tokens
        while len(ids := tokenizer.encode(overhead_prompt(words)).ids) < tokens:
            words *= 2
        self.ids: list[int] = ids[:tokens]
        self.text: str = tokenizer.decode(self.ids)
        special = set(tokenizer.get_added_tokens_decoder())
        allowed = [i for i in range(tokenizer.get_vocab_size()) if i not in special]
        for seed in range(1000):  # the first seed whose ids have no clean tail
            self.random: list[int] = [int(i) for i in np.random.default_rng(seed).choice(allowed, tokens)]
            tails = (tokenizer.decode(self.random[-n:], skip_special_tokens=False) for n in range(4, 24))
            if all("\ufffd" in tail for tail in tails):
                break

    def fields(self, kind: str) -> tuple[str, dict[str, Any]]:
        """The route's path and the prompt's fields of a request of ``kind``."""
        if kind == "chat":
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": self.text}]}
        return "/v1/completions", {"prompt": {"ids": self.ids, "random": self.random, "text": self.text}[kind]}


class Paths:
    """One request of each (path, kind, client), timed from the client: seconds to its first token."""

    def __init__(self, model: str, urls: dict[str, str], prompt: Prompt, tokens: int, secret: bytes, ctrl: int):
        self.model, self.urls, self.prompt, self.tokens = model, urls, prompt, tokens
        self.secret, self.ctrl = secret, ctrl
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        self.sdk = {
            name: AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
            for name, url in urls.items()
            if name != "decode"
        }

    async def aclose(self) -> None:
        await self.http.aclose()
        for sdk in self.sdk.values():
            await sdk.close()

    def one(self, path: str, kind: str, client: str) -> Callable[[], Awaitable[float]]:
        if path == "direct":
            return lambda: self._direct(kind, client)
        if client == "sdk":
            return lambda: self._routed_sdk(path, kind)
        route, fields = self.prompt.fields(kind)
        body = orjson.dumps(
            {
                **fields,
                "model": self.model,
                "max_tokens": self.tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        return lambda: self._routed_httpx(self.urls[path] + route, body)

    async def _routed_httpx(self, url: str, body: bytes) -> float:
        t0 = time.perf_counter()
        first, rest = None, b""
        async with self.http.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for chunk in r.aiter_raw():
                if first is None and b'"choices":[{' in chunk:
                    first = time.perf_counter() - t0
                rest = (rest + chunk)[-4096:]
        return self._checked(first, rest)

    def _checked(self, first: float | None, tail: bytes) -> float:
        """``first``, once the stream's end said it carried every token asked."""
        want = f'"completion_tokens":{self.tokens},'.encode()
        if first is None or want not in tail or not tail.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"incomplete stream: {tail[-300:]!r}")
        return first

    async def _routed_sdk(self, path: str, kind: str) -> float:
        sdk, fields = self.sdk[path], self.prompt.fields(kind)[1]
        common: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"ignore_eos": True},
        }
        t0 = time.perf_counter()
        first, tokens = None, 0
        if kind == "chat":
            stream: Any = await sdk.chat.completions.create(messages=fields["messages"], **common)
        else:
            stream = await sdk.completions.create(prompt=fields["prompt"], **common)
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - t0
            elif chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if first is None or tokens != self.tokens:
            raise RuntimeError(f"incomplete stream: {tokens} of {self.tokens} tokens")
        return first

    def _claim(self) -> dict[str, Any]:
        return c.Claim.signed(self.secret, uuid.uuid4().hex, "127.0.0.1", self.ctrl).to_params()

    async def _direct(self, kind: str, client: str) -> float:
        """The router's prefill call made by the client: seconds to the prefill's answer (its claim result checked)."""
        route, fields = self.prompt.fields(kind)
        leg = {"max_tokens": 1, "stream": False, "return_token_ids": True, "kv_transfer_params": self._claim()}
        t0 = time.perf_counter()
        if client == "sdk":
            sdk, extra = self.sdk["prefill"], {"ignore_eos": True, **leg}
            del extra["max_tokens"], extra["stream"]
            common = {"model": self.model, "max_tokens": 1, "temperature": 0, "stream": False, "extra_body": extra}
            if kind == "chat":
                answer: Any = await sdk.chat.completions.create(messages=fields["messages"], **common)
            else:
                answer = await sdk.completions.create(prompt=fields["prompt"], **common)
            took, params = time.perf_counter() - t0, (answer.model_extra or {}).get("kv_transfer_params")
        else:
            body = orjson.dumps({**fields, "model": self.model, "temperature": 0, "ignore_eos": True, **leg})
            r = await self.http.post(
                self.urls["prefill"] + route, content=body, headers={"content-type": "application/json"}
            )
            took = time.perf_counter() - t0
            params = orjson.loads(r.content).get("kv_transfer_params") if r.status_code == 200 else None
        result = c.ClaimResult.from_params(params)
        if result is None or result.first_token_id is None:
            raise RuntimeError("the prefill answered without its claim result")
        return took


def _start(args: argparse.Namespace, procs: Procs, secret: str) -> tuple[dict[str, str], dict[str, str], int]:
    """The stand-ins and the router(s): ``router`` from this checkout, ``baseline`` from ``--baseline-router``'s
    ``tilert``. Returns their URLs, their commands and the decode stand-in's control port (named in claims)."""
    ports = {name: free_port() for name in ("prefill", "decode", "ctrl", "router", "baseline")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_SECRET")}
    env.update({SECRET_ENV: secret, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    me = [sys.executable, str(E2E), "--model", str(args.model)]
    commands = {
        "prefill": [*me, "--standin", "prefill", "--port", str(ports["prefill"]), "--prefill-ms", str(args.prefill_ms)],
        "decode": [*me, "--standin", "decode", "--port", str(ports["decode"]), "--gap-ms", "0"],
    }
    routers = {"router": env}
    if args.baseline_router:
        routers["baseline"] = {**env, "PYTHONPATH": str(args.baseline_router.resolve())}
    for name in routers:
        commands[name] = [
            *(sys.executable, "-m", "tilert.cli", "router"),
            *("--prefill-url", f"http://127.0.0.1:{ports['prefill']}"),
            *("--decode", f"127.0.0.1:{ports['ctrl']}:{ports['decode']}"),
            *("--model", str(args.model), "--port", str(ports[name])),
        ]
    for name, cmd in commands.items():
        procs.start(name, cmd, routers.get(name, env), cpus=parse_cpus(args.router_cpus) if name in routers else None)
    urls = {name: f"http://127.0.0.1:{ports[name]}" for name in commands}
    wait_healthy(procs, urls, args.startup_timeout_s)
    return urls, {n: " ".join(cmd) for n, cmd in commands.items()}, ports["ctrl"]


def cpu_ns(pid: int) -> int:
    """CPU time of every thread of process ``pid`` so far, in ns (the scheduler's count, finer than stat's ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def _runs(paths: dict[str, Callable[[], Awaitable[float]]], requests: int) -> dict[str, list[float]]:
    """``requests`` requests of each path, the paths taking turns request by request (their order alternating), so
    that a spell of load on the shared machine meets each alike: each path's times to first token, in ms."""
    times: dict[str, list[float]] = {path: [] for path in paths}
    order = list(paths)
    for i in range(requests):
        for path in order if i % 2 == 0 else order[::-1]:
            times[path].append(1000 * await paths[path]())
    return times


async def measure(args: argparse.Namespace, procs: Procs, urls: dict[str, str], ctrl: int, secret: str) -> list[dict]:
    """Every round: each kind and client, a run of ``--requests`` of each path taking turns; a row per path."""
    paths = [p for p in ("direct", "router", "baseline") if p == "direct" or p in urls]
    client = Paths(str(args.model), urls, Prompt(args.model, args.prompt_tokens), args.tokens, secret.encode(), ctrl)
    pids = {path: procs.procs[path].pid for path in paths if path != "direct"}
    rows: list[dict[str, Any]] = []
    try:
        for kind in args.kinds:  # warm every path: connections, caches
            for name in args.clients:
                await _runs({path: client.one(path, kind, name) for path in paths}, 5)
        for r in range(args.rounds):
            for kind in args.kinds:
                for name in args.clients:
                    probes = {path: (RouterProbe(urls[path], pid), cpu_ns(pid)) for path, pid in pids.items()}
                    times = await _runs({path: client.one(path, kind, name) for path in paths}, args.requests)
                    for path, ms in times.items():
                        kept = [round(x, 3) for x in ms]  # each request's, to the microsecond
                        row = {"round": r, "kind": kind, "client": name, "path": path, "ttft_ms": kept}
                        row.update(p50_ms=_pct(ms, 50), p90_ms=_pct(ms, 90))
                        if path in probes:  # CPU per request: its whole stream, not its first token alone
                            probe, cpu0 = probes[path]
                            row.update(probe.finish())
                            row["router_cpu_ms_per_request"] = (cpu_ns(pids[path]) - cpu0) / 1e6 / args.requests
                        rows.append(row)
                    print(
                        f"  round {r} {kind:<4} {name:<5} "
                        + "  ".join(f"{p} p50 {_pct(ms, 50):6.2f} ms" for p, ms in times.items()),
                        flush=True,
                    )
                procs.check()
    finally:
        await client.aclose()
    return rows


def table(rows: list[dict[str, Any]], kinds: list[str], clients: list[str]) -> str:
    """Per kind and client: each path's median over rounds of its p50 / p90, added over ``direct``, and the
    router's own means."""
    paths = [p for p in ("direct", "router", "baseline") if any(r["path"] == p for r in rows)]
    out = [
        "| prompt | client | path | TTFT p50 ms | TTFT p90 ms | added p50 ms | router's own TTFT / prefill leg, "
        "mean ms | router CPU / request ms |",
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    for kind in kinds:
        for name in clients:
            agg: dict[str, dict[str, float | None]] = {}
            for path in paths:
                group = [r for r in rows if (r["kind"], r["client"], r["path"]) == (kind, name, path)]
                keys = ("p50_ms", "p90_ms", "router_ttft_ms", "router_prefill_ms", "router_cpu_ms_per_request")
                agg[path] = {k: _median([r.get(k) for r in group]) for k in keys}
            for path in paths:
                a = agg[path]
                added = a["p50_ms"] - agg["direct"]["p50_ms"] if path != "direct" else None  # type: ignore[operator]
                own = f"{fmt(a['router_ttft_ms'], 2)} / {fmt(a['router_prefill_ms'], 2)}" if path != "direct" else ""
                out.append(
                    f"| {kind} | {name} | {path} | {fmt(a['p50_ms'], 2)} | {fmt(a['p90_ms'], 2)} | "
                    f"{'**' + fmt(added, 2) + '**' if added is not None else ''} | {own} | "
                    f"{fmt(a['router_cpu_ms_per_request'], 2)} |"
                )
    return "\n".join(out)


def _median(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def markdown(result: dict[str, Any], note: str | None) -> str:
    cond, s = result["conditions"], result["settings"]
    head = [
        "# CPU router time to first token: one user, one request at a time, 1K-token prompts",
        "",
        *([f"> {note}", ""] if note else []),
        "## Conditions",
        "",
        f"- host CPU: {cond['cpu_model']}, {cond['cpus']} cores ({cond['cpus_usable']} usable), "
        f"{cond['memory_gib']} GiB; load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.2f}' for x in cond['loadavg_start'])}, at end "
        f"{'/'.join(f'{x:.2f}' for x in cond['loadavg_end'])}",
        f"- git commit {cond['git_commit'][:12]}{' (working tree modified)' if cond['git_dirty'] else ''}; Python "
        f"{cond['python']}; " + ", ".join(f"{k} {v}" for k, v in cond["versions"].items() if v),
        "- stand-ins `tilert.testing.standins` (`benchmarks/e2e.py --standin`, one process each, "
        + (f"each prefill taking {s['prefill_ms']:g} ms); " if s.get("prefill_ms") else "answering at once); ")
        + f"prompt {s['prompt_tokens']} tokens, {s['tokens']} tokens streamed, greedy; {s['requests']} requests a run "
        f"one at a time, {s['rounds']} rounds; router CPUs {s['router_cpus'] or 'unpinned'}"
        + (f"; `baseline`: the router of `{s['baseline_router']}`" if s["baseline_router"] else ""),
        "",
        "## Results",
        "",
        result["table"],
    ]
    return "\n".join(head) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.model = ensure_model(args.model.resolve())
    cond = conditions()
    cond["command"] = " ".join(["python", "benchmarks/router_ttft.py", *(argv or sys.argv[1:])])
    log_dir = Path(tempfile.mkdtemp(prefix="tilert-ttft-"))
    secret = generate_secret()
    with supervised(log_dir) as procs:
        urls, commands, ctrl = _start(args, procs, secret)
        rows = asyncio.run(measure(args, procs, urls, ctrl, secret))
    cond["loadavg_end"] = os.getloadavg()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"conditions": cond, "settings": settings, "servers": commands, "runs": rows}
    result["table"] = table(rows, args.kinds, args.clients)
    print("\n" + result["table"])
    rec = recorded("cpu", mode="router-ttft")
    out = args.out or RESULTS_DIR
    paths = (
        write_json(out / f"{args.name}.json", result, rec),
        write_md(out / f"{args.name}.md", markdown(result, args.note), rec),
    )
    print("\nwrote " + ", ".join(map(str, paths)) + f"\nlogs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
