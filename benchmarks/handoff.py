"""KV handoff latency and throughput per transport, through the connector's real staging and sending path.

    .venv/bin/python benchmarks/handoff.py [--tokens 1024,8192,32768] [--transports tcp,mooncake,nixl]
                                           [--reps 3] [--prefill-tok-s 16000] [--out FILE.md]

A realistic MLA layout (DeepSeek-V3: 576 bf16 values per token per layer, 61 layers: 70,272 bytes per token)
is staged by the connector's own ``WorkerSide`` out of a paged cache laid out as vLLM's CPU_MLA keeps it
(``[num_blocks, 1, 16, 576]``; all 61 layer names view one cache tensor, which changes nothing for the
copies), placed by its own ``SchedulerSide``, and shipped by its ``BackgroundSender`` to a real decode node
(``SlotTable`` + ``ControlServer`` + the transport's receiver) in the same process, on loopback.

Per transport and prompt length, the median over ``--reps`` of:

- ``bulk``: the old behaviour, shipping only after the last layer: the whole extent in one write after the
  handshake. ``tail`` = last layer staged -> state ready on the decode node (its ``Done`` verified, the slot
  ``READY``); ``GiB/s`` = bytes / tail, next to a plain in-process copy of the same bytes (``memcpy``, the
  staging extent into the node's slot buffer, measured in the same run) and the ratio of the two.
- ``pipelined``: the connector as it is: handshake at the first layer, each layer written as soon as it is
  staged, ``Done`` after the last. A stand-in for the forward paces the layers as a prefill of
  ``--prefill-tok-s`` tokens/s would (a sleep before each layer's staging; the gathers come on top). ``tail`` as above;
  ``total`` = first layer staged -> ready (the forward's length included).

Both ends share this process and its CPUs (2 cores on the development machines): the numbers are an upper
bound on the protocol's own cost, not a network measurement. Mooncake runs over TCP (no RDMA NIC), NIXL over
UCX on loopback (shared memory / CMA between processes; here one process).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "30")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

import anyio  # noqa: E402
import structlog  # noqa: E402
import torch  # noqa: E402

from tilert import contracts as c  # noqa: E402
from tilert.connector.scheduler import SchedulerSide  # noqa: E402
from tilert.connector.sender import BackgroundSender, Staged  # noqa: E402
from tilert.connector.worker import WorkerSide  # noqa: E402
from tilert.decode.control import ControlServer  # noqa: E402
from tilert.decode.slots import SlotTable  # noqa: E402
from tilert.plugins import load_transport  # noqa: E402

SECRET = b"handoff-benchmark-secret-0123456789abcdef"
LAYERS, WIDTH, BLOCK = 61, 576, 16
ROW = WIDTH * 2  # bf16
BPT = LAYERS * ROW
LAYOUT = c.KVLayout("mla_dense", "bfloat16", ROW, LAYERS)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@dataclass
class Result:
    transport: str
    tokens: int
    nbytes: int
    memcpy_s: float
    bulk_tail_s: float
    pipe_tail_s: float
    pipe_total_s: float
    pipe_writes: int
    forward_s: float

    def row(self) -> str:
        gib = self.nbytes / 2**30
        bulk_gbs, copy_gbs = gib / self.bulk_tail_s, gib / self.memcpy_s
        return (
            f"| {self.transport} | {self.tokens} | {self.nbytes / 2**20:,.1f} | {copy_gbs:.2f} | "
            f"{self.bulk_tail_s * 1e3:,.1f} | {bulk_gbs:.2f} | {100 * bulk_gbs / copy_gbs:.0f}% | "
            f"{self.forward_s * 1e3:,.0f} | {self.pipe_tail_s * 1e3:,.1f} | {self.pipe_total_s * 1e3:,.1f} | "
            f"{self.pipe_writes} |"
        )


HEADER = (
    "| transport | tokens | MiB | memcpy GiB/s | bulk tail ms | bulk GiB/s | bulk / memcpy | stand-in forward ms "
    "| pipelined tail ms | pipelined total ms | writes |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _output(rid: str, claim: c.Claim, n: int, blocks: list[int]) -> Any:
    new = SimpleNamespace(
        req_id=rid, sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": claim.to_params()}),
        prompt_token_ids=range(n), block_ids=(blocks,), num_computed_tokens=0,
    )  # fmt: skip
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: n})


class Bench:
    def __init__(self, transport: str, max_tokens: int, prefill_tok_s: float) -> None:
        self.transport = transport
        self.prefill_tok_s = prefill_tok_s
        self.receiver = load_transport(transport).receiver(host="127.0.0.1", options={})
        self.table = SlotTable(1, {"mla": LAYOUT}, max_tokens + 1, self.receiver)
        self.control = ControlServer(self.table, transport, "bench-node", SECRET)
        self.sender = BackgroundSender(transport, {"timeout_s": 60, "verdict_timeout_s": 30}, SECRET, timeout_s=60)
        num_blocks = -(-max_tokens // BLOCK)
        cache = torch.randn(num_blocks, 1, BLOCK, WIDTH).to(torch.bfloat16)
        self.caches = dict.fromkeys(NAMES, cache)
        cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=LAYERS)
        pool = -(-max_tokens * BPT // 4096) * 4096
        self.worker = WorkerSide(cfg, self.sender, staging_bytes=pool, expected_bytes_per_token=BPT)
        self.worker.register(self.caches)
        self.sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=pool)
        self.port = 0

    def close(self) -> None:
        self.worker.close()
        self.receiver.close()

    def _report(self) -> None:
        self.sched.update(SimpleNamespace(kv_connector_worker_meta=self.worker.take_report()))  # type: ignore[arg-type]

    def forward(self, tid: str, n: int, *, pipelined: bool) -> Staged:
        """One prefill step of an ``n``-token prompt claimed for ``tid``, through the connector's two halves."""
        claim = c.Claim.signed(SECRET, tid, "127.0.0.1", self.port)
        meta = self.sched.build_meta(_output("r-" + tid, claim, n, list(range(-(-n // BLOCK)))))
        assert meta.saves, "the pool refused the claim"
        real_submit = self.sender.submit
        held: list[Staged] = []
        if not pipelined:  # the old path: nothing leaves before the last layer is staged
            self.sender.submit = held.append  # type: ignore[method-assign,assignment]
        layer_s = n / self.prefill_tok_s / LAYERS if pipelined else 0.0
        try:
            for name in NAMES:
                if layer_s:
                    time.sleep(layer_s)  # the layer's compute, then vLLM calls save_kv_layer
                self.worker.save_layer(meta, name)
            self.worker.flush()
        finally:
            self.sender.submit = real_submit  # type: ignore[method-assign]
        for item in held:
            real_submit(item)
        return self.worker.transfers[-1]

    async def handoff(self, n: int, *, pipelined: bool) -> tuple[Staged, float, float]:
        """(staged, first layer about to be staged, state ready on the node) for one claimed prompt."""
        tid = uuid.uuid4().hex
        self.table.reserve(tid)
        ready: list[float] = []

        async def wait() -> None:
            await self.table.wait_ready(tid, 600)
            ready.append(time.monotonic())

        t_first = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            staged = await anyio.to_thread.run_sync(lambda: self.forward(tid, n, pipelined=pipelined))
        t_ready = ready[0]
        assert staged.outcome in (None, "done"), staged.outcome
        self.table.release(tid)
        deadline = time.monotonic() + 10
        while self.sched.has_pending_work():
            self._report()
            assert time.monotonic() < deadline, "the extent did not come back"
            await anyio.sleep(0.001)
        return staged, t_first, t_ready

    def memcpy_s(self, nbytes: int, reps: int) -> float:
        assert self.worker.pool is not None
        src, dst = self.worker.pool[:nbytes], self.table.slots[0].buffer[:nbytes]
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


async def run_transport(transport: str, tokens: list[int], reps: int, prefill_tok_s: float) -> list[Result]:
    bench = Bench(transport, max(tokens), prefill_tok_s)
    results = []
    try:
        async with anyio.create_task_group() as tg:
            bench.port = await tg.start(bench.control.serve, "127.0.0.1", 0)
            await bench.handoff(min(tokens), pipelined=True)  # warm: connections, metadata, registrations
            for n in tokens:
                nbytes = n * BPT
                bulk, tails, totals, writes, forwards = [], [], [], [], []
                for _ in range(reps):
                    staged, _, ready = await bench.handoff(n, pipelined=False)
                    assert staged.staged_at is not None
                    bulk.append(ready - staged.staged_at)
                    staged, first, ready = await bench.handoff(n, pipelined=True)
                    assert staged.staged_at is not None
                    tails.append(ready - staged.staged_at)
                    totals.append(ready - first)
                    forwards.append(staged.staged_at - first)
                    writes.append(len(staged.writes))
                copy = bench.memcpy_s(nbytes, reps)
                med = statistics.median
                r = Result(transport, n, nbytes, copy, med(bulk), med(tails), med(totals), int(med(writes)),
                           med(forwards))  # fmt: skip
                print(r.row(), flush=True)
                results.append(r)
            tg.cancel_scope.cancel()
    finally:
        bench.close()
    return results


def conditions() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    versions = []
    for mod in ("torch", "mooncake", "nixl_cu12"):
        try:
            from importlib.metadata import version

            dist = {"mooncake": "mooncake-transfer-engine-non-cuda", "nixl_cu12": "nixl-cu12"}.get(mod, mod)
            versions.append(f"{dist} {version(dist)}")
        except Exception:  # noqa: BLE001
            pass
    load = os.getloadavg()
    return (
        f"- date {date.today()}, git {commit} (plus the working tree), Python {platform.python_version()}, "
        f"{', '.join(versions)}\n- CPU: {cpu}, {os.cpu_count()} cores, load average at the end "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; no GPU, no RDMA NIC\n"
        f"- env UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES')}, MC_TRANSFER_TIMEOUT="
        f"{os.environ.get('MC_TRANSFER_TIMEOUT')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1024,8192,32768")
    ap.add_argument("--transports", default="tcp,mooncake,nixl")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-tok-s", type=float, default=16000.0,
                    help="the stand-in forward's pace (tokens/s of the whole prefill)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="write the table with its conditions (markdown)")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    tokens = [int(x) for x in args.tokens.split(",")]
    print(f"layout: {LAYERS} layers x {WIDTH} bf16 = {BPT:,} bytes per token; stand-in prefill "
          f"{args.prefill_tok_s:g} tok/s; median of {args.reps}\n\n{HEADER}", flush=True)  # fmt: skip
    results: list[Result] = []
    for transport in args.transports.split(","):
        results += anyio.run(run_transport, transport, tokens, args.reps, args.prefill_tok_s)
    if args.out is not None:
        cmd = "python benchmarks/handoff.py " + " ".join(sys.argv[1:])
        args.out.write_text(
            f"# KV handoff on CPU: staging pool + layer-pipelined sending ({date.today()})\n\n"
            f"`{cmd}`\n\n{conditions()}\n- layout: DeepSeek-V3 MLA, {LAYERS} layers x {WIDTH} bf16 = {BPT:,} bytes "
            f"per token; stand-in prefill {args.prefill_tok_s:g} tok/s; median of {args.reps}\n\n"
            f"{HEADER}\n" + "\n".join(r.row() for r in results) + "\n"
        )
        print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
