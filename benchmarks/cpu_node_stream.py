"""The decode node's CPU per streamed token outside the engine, this checkout against an earlier one.

A real ``tilert decode`` serves a seeded tiny DeepSeek-V3 (one layer: the engine's step is cheap, so what the node
does around it shows) on loopback; ``--streams`` greedy decodes at once (each reserved, its prompt's KV sent over the
TCP transport as the prefill side sends it, then its NDJSON stream read to its end). Per run it records the node
process's CPU time per generated token, by thread (``/proc``): the event loop (the main thread: the streams, their
lines, HTTP) and the others (with the engine in its own process, ``--mode process``: the pipe's reader, which hands
the engine's tokens to the streams; in the node's process, ``--mode thread``: the batch's worker thread, the engine's
compute included), the tokens per line and the tokens a second the engine got out meanwhile. ``--baseline DIR``
runs a second node from DIR's ``tilert`` (``git archive`` of an earlier commit) in the same rounds, each mode's two
nodes alternating. The machine's other work shows in the figures: compare the two in one run.

Writes ``results/cpu-node-stream.md`` and ``.json`` (``--out`` / ``--name`` elsewhere).

Example::

    git archive HEAD~3 tilert | tar -x -C /tmp/before
    python benchmarks/cpu_node_stream.py --streams 1,8 --rounds 3 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from e2elib.procs import supervised, wait_healthy
from results_header import recorded, result_path, write_json, write_md

from tilert import auth
from tilert import contracts as c
from tilert.netio import free_port

SECRET = "node-stream-bench-" + "0123456789abcdef" * 2
PROMPT = 16  # prompt tokens (their KV sent to the node)
MAX_SEQ = 1024


def _model(root: Path) -> tuple[Path, Any, dict[str, Any], int]:
    """The tiny checkpoint (built once under ``root``), a prompt's KV as the transport sends it, its layouts and
    its first token."""
    import torch

    from tilert.engines.tilert import layouts
    from tilert.engines.tilert.engine import TileRTEngine
    from tilert.models.tiny import build_tiny_model

    model = root / "tiny-deepseek-v3-1layer"
    if not (model / "config.json").exists():
        build_tiny_model("deepseek_v3", model, seed=0, num_hidden_layers=1)
    eng = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    args = eng.model.args
    ids = torch.randint(8, args.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    first = int(eng.forward(ids, 0)[-1].argmax())
    mla = layouts.encode_mla_dense(eng.model.kv_cache[:, :PROMPT], "float32", args.kv_lora_rank, True)
    return model, mla.reshape(-1).contiguous(), eng.expected_layouts(), first


def _thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of process ``pid``: the scheduler's own count, in nanoseconds
    (``/proc/PID/task/TID/schedstat``; ``stat``'s ticks are too coarse for a run of a second)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue  # the thread ended
    return out


class Node:
    """One ``tilert decode`` and the client driving it."""

    def __init__(self, name: str, url: str, ctrl: int, pid: int) -> None:
        self.name, self.url, self.ctrl, self.pid = name, url, ctrl, pid
        self.headers = {"authorization": "Bearer " + auth.node_api_token(SECRET.encode())}

    async def decode(self, client: httpx.AsyncClient, sender: Any, kv: tuple[Any, ...], tid: str) -> tuple[int, int]:
        """One decode to its end: its tokens and lines."""
        from tilert.connector.sender import Staged

        state, lay, first, tokens = kv
        resp = await client.post(self.url + "/v1/reserve", json={"transfer_id": tid}, headers=self.headers)
        resp.raise_for_status()
        claim = c.Claim.signed(SECRET.encode(), tid, "127.0.0.1", self.ctrl)
        await asyncio.wrap_future(sender.submit(Staged.whole(claim, PROMPT, lay, state)))
        body = {
            "transfer_id": tid,
            "first_token_id": first,
            "prompt_tokens": PROMPT,
            "sampling": {"max_tokens": tokens, "temperature": 0, "ignore_eos": True},
        }
        got = lines = 0
        async with client.stream("POST", self.url + "/v1/decode", json=body, headers=self.headers) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.strip():
                    lines += 1
                    got += len(orjson.loads(line)["token_ids"])
        if got != tokens:
            raise RuntimeError(f"{self.name}: {got} of {tokens} tokens")
        return got, lines

    async def run(self, streams: int, sender: Any, kv: tuple[Any, ...], tag: str) -> dict[str, Any]:
        """``streams`` decodes at once; the node's CPU per token by thread."""
        async with httpx.AsyncClient(timeout=600) as client:
            cpu0, t0 = _thread_cpu(self.pid), time.perf_counter()
            done = await asyncio.gather(*(self.decode(client, sender, kv, f"{tag}-{i}") for i in range(streams)))
            wall, cpu1 = time.perf_counter() - t0, _thread_cpu(self.pid)
        tokens, lines = sum(d[0] for d in done), sum(d[1] for d in done)
        spent = {tid: cpu1[tid] - cpu0.get(tid, 0.0) for tid in cpu1}
        loop = spent.pop(self.pid, 0.0)  # the main thread runs the event loop
        return {
            "tokens": tokens,
            "lines": lines,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "tokens_per_line": tokens / lines,
            "loop_us_per_token": 1e6 * loop / tokens,
            "other_us_per_token": 1e6 * sum(spent.values()) / tokens,
            "node_us_per_token": 1e6 * (loop + sum(spent.values())) / tokens,
        }


def _command(model: Path, mode: str, streams: int, ctrl: int, http: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tilert.cli",
        "decode",
        "--model",
        str(model),
        "--device",
        "cpu",
        "--ctrl-port",
        str(ctrl),
        "--http-port",
        str(http),
        "--max-seq-len",
        str(MAX_SEQ),
        "--max-sequences",
        str(streams),
        "--slots",
        str(streams),
        "--engine-process" if mode == "process" else "--no-engine-process",
    ]


def measure(a: argparse.Namespace, kv: tuple[Any, ...], model: Path, log_dir: Path) -> list[dict[str, Any]]:
    from tilert.connector.sender import BackgroundSender

    versions = {"node": None, **({"baseline": a.baseline.resolve()} if a.baseline else {})}
    rows: list[dict[str, Any]] = []
    sender = BackgroundSender("tcp", {}, SECRET.encode())
    env = {**os.environ, auth.SECRET_ENV: SECRET, "OMP_NUM_THREADS": "1", "TILERT_LOG_LEVEL": "warning"}
    env.pop(auth.SECRET_FILE_ENV, None)
    try:
        for mode in a.mode:
            with supervised(log_dir) as procs:
                nodes = {}
                for name, tree in versions.items():
                    ctrl, http = free_port(), free_port()
                    node_env = {**env, "PYTHONPATH": str(tree)} if tree else env
                    procs.start(f"{name}-{mode}", _command(model, mode, max(a.streams), ctrl, http), node_env)
                    nodes[name] = Node(name, f"http://127.0.0.1:{http}", ctrl, procs.procs[f"{name}-{mode}"].pid)
                wait_healthy(procs, {n.name + "-" + mode: n.url for n in nodes.values()}, 600)
                for node in nodes.values():  # warm: connections, the engine's first steps
                    asyncio.run(node.run(max(a.streams), sender, kv, f"warm-{mode}"))
                for r in range(a.rounds):
                    for streams in a.streams:
                        order = list(nodes.values()) if r % 2 == 0 else list(nodes.values())[::-1]
                        for node in order:
                            row = asyncio.run(node.run(streams, sender, kv, f"{mode}-{r}-{streams}"))
                            rows.append({"version": node.name, "mode": mode, "streams": streams, "round": r, **row})
                            print(
                                f"  {mode:<7} streams {streams:<3} {node.name:<8} round {r}: "
                                f"{row['tokens_per_s']:6.0f} tok/s, {row['tokens_per_line']:.2f} tokens/line, node "
                                f"CPU {row['node_us_per_token']:.1f} us/token (loop {row['loop_us_per_token']:.1f}, "
                                f"other threads {row['other_us_per_token']:.1f})",
                                flush=True,
                            )
    finally:
        sender.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = ("tokens_per_s", "tokens_per_line", "loop_us_per_token", "other_us_per_token", "node_us_per_token")
    lines = [
        "The median over rounds. `engine`: in a process of its own (`--engine-process`, `tilert up`'s on a CPU "
        "host) or on the node's worker thread; `node`: this checkout, `baseline`: `--baseline`'s; tokens/s: what the "
        "node got out meanwhile (the engine's speed, less what the node's own work took from it); event loop: the "
        "node's main thread (the streams, their lines, HTTP); other threads: the pipe's reader (own process) or the "
        "batch's worker thread, the engine's compute included (node thread); node process: all of the node's "
        "process (not the engine's own), each per generated token.",
        "",
        "| engine | streams | node | tokens/s | tokens / line | event loop us / token | other threads us / token "
        "| node process us / token |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    seen = sorted({(r["mode"], r["streams"], r["version"]) for r in rows}, key=lambda k: (k[0], k[1], k[2] != "node"))
    for mode, streams, version in seen:
        group = [r for r in rows if (r["mode"], r["streams"], r["version"]) == (mode, streams, version)]
        med = {k: statistics.median(r[k] for r in group) for k in keys}
        lines.append(
            f"| {'own process' if mode == 'process' else 'node thread'} | {streams} | {version} "
            f"| {med['tokens_per_s']:.0f} | {med['tokens_per_line']:.2f} | {med['loop_us_per_token']:.1f} "
            f"| {med['other_us_per_token']:.1f} | {med['node_us_per_token']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--streams", type=ints, default=[1, 8], help="comma list of decodes at once (default 1,8)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=MAX_SEQ - PROMPT - 2, help="tokens per decode")
    ap.add_argument(
        "--mode",
        type=lambda text: [m for m in text.split(",") if m],
        default=["process", "thread"],
        help="comma list: the engine in its own process (tilert up's on CPU), in the node's (default: both)",
    )
    ap.add_argument("--baseline", type=Path, default=None, help="a second node from this checkout's tilert")
    ap.add_argument("--out", type=Path, default=None, help="directory for NAME.md / NAME.json")
    ap.add_argument("--name", default="cpu-node-stream")
    a = ap.parse_args()
    root = Path(tempfile.gettempdir()) / "tilert-bench"
    log_dir = Path(tempfile.mkdtemp(prefix="tilert-node-stream-"))
    model, state, lay, first = _model(root)
    rows = measure(a, (state, lay, first, a.tokens), model, log_dir)
    text = table(rows)
    print("\n" + text)
    rec = recorded("cpu", cpus=os.cpu_count(), loadavg=os.getloadavg())
    stem = a.name.removeprefix("cpu-")
    md = write_md(
        result_path("cpu", stem, ".md", a.out),
        f"# CPU decode node: CPU per streamed token outside the engine\n\n{text}\n",
        rec,
    )
    js = write_json(
        result_path("cpu", stem, ".json", a.out), {"settings": vars(a) | {"out": str(a.out)}, "runs": rows}, rec
    )
    print(f"\nwrote {md}, {js}; logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
