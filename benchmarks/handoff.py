"""KV handoff latency and throughput per transport, through the connector's real staging and sending path.

    .venv/bin/python benchmarks/handoff.py [--tokens 1024,8192,32768] [--transports tcp,mooncake,nixl]
                                           [--reps 3] [--prefill-tok-s 16000] [--out FILE.md|DIR]

Writes ``benchmarks/results/cpu-handoff.md`` (``cpu-handoff-vllm.md`` with ``--vllm-only``) unless ``--out`` says
otherwise; the file starts with its conditions (``results_header``).

A realistic MLA layout (DeepSeek-V3: 576 bf16 values per token per layer, 61 layers: 70,272 bytes per token)
is staged by the connector's own ``WorkerSide`` out of a paged cache laid out as vLLM's CPU_MLA keeps it
(``[num_blocks, 1, 16, 576]``; all 61 layer names view one cache tensor, which changes nothing for the
copies), placed by its own ``SchedulerSide``, and shipped by its ``BackgroundSender`` to a real decode node
(``SlotTable`` + ``ControlServer`` + the transport's receiver) in the same process, on loopback.

Per transport and prompt length, the median over ``--reps`` of:

- ``bulk``: shipping only after the last layer is staged: the whole extent in one write after the
  handshake. ``tail`` = last layer staged -> state ready on the decode node (its ``Done`` verified, the slot
  ``READY``); ``GiB/s`` = bytes / tail, next to a plain in-process copy of the same bytes (``memcpy``: one libc
  ``memcpy`` of the staging extent into the node's slot buffer, measured in the same run) and the ratio of the
  two; ``torch copy_`` is the same copy through torch's intra-op threads (both cores), shown beside it;
  ``CMA`` the same bytes through the kernel's cross-process copy (``process_vm_writev``), the path UCX takes
  between two processes of one host without RDMA: what bounds NIXL on such a host.
- ``pipelined``: the connector's own path: handshake at the first layer, each layer written as soon as it is
  staged, ``Done`` after the last. A stand-in for the forward paces the layers as a prefill of
  ``--prefill-tok-s`` tokens/s would (a sleep before each layer's staging; the gathers come on top). ``tail`` as above;
  ``total`` = first layer staged -> ready (the forward's length included).

Both ends share this process and its CPUs: the numbers are an upper
bound on the protocol's own cost, not a network measurement. Mooncake runs over TCP (no RDMA NIC), NIXL over
UCX on loopback (shared memory / CMA between processes; here one process).

``--vllm`` adds, per transport, stock vLLM (the CPU build, the connector configured for that transport, as
``tilert up`` starts it) prefilling a tiny DeepSeek-V3 checkpoint (float32; 3 layers x 576 x 4 = 6,912 bytes
per token) with random prompts of the same lengths, ``max_tokens=1``: the HTTP latency of the prefill
unclaimed (a plain request) and claimed (the request carries a signed claim; a decode node's transfer half
in this process receives the KV), alternating, median of ``--vllm-reps``; and for the claimed ones when the
state was ready on the decode node relative to vLLM's response (negative: before the client had it).

By default vLLM's forward runs its OMP threads on every core (its "auto" binding) and the decode half here
shares those cores, so every byte the decode half receives is CPU taken from the prefill: a worst case no
deployment has (the decode node is another machine, or at least other cores). ``--split-cpus P:D`` runs the
measurement as the stack runs on one machine: vLLM's OMP threads bound to CPUs ``P``
(``VLLM_CPU_OMP_THREADS_BIND``, as ``benchmarks/e2e.py`` binds the stack's prefill) and this process, the decode
half, on CPUs ``D``; the connector's sender threads stay free to run on any CPU, as in the stack.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
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
from results_header import recorded, result_path, write_md  # noqa: E402

from tilert import contracts as c  # noqa: E402
from tilert.connector.scheduler import SchedulerSide  # noqa: E402
from tilert.connector.sender import BackgroundSender, Staged  # noqa: E402
from tilert.connector.worker import WorkerSide  # noqa: E402
from tilert.cpus import parse_cpu_list  # noqa: E402
from tilert.decode.control import ControlServer  # noqa: E402
from tilert.decode.slots import SlotTable  # noqa: E402
from tilert.netio import free_port  # noqa: E402
from tilert.plugins import load_transport  # noqa: E402

SECRET = b"handoff-benchmark-secret-0123456789abcdef"
LAYERS, WIDTH, BLOCK = 61, 576, 16
ROW = WIDTH * 2  # bf16
BPT = LAYERS * ROW
LAYOUT = c.KVLayout("mla_dense", "bfloat16", ROW, LAYERS)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
RECEIVER_OPTIONS: dict[str, Any] = {}  # the decode side's transport options (--receiver-options)


@dataclass
class Result:
    transport: str
    tokens: int
    nbytes: int
    memcpy_s: float
    copy2_s: float
    cma_s: float
    bulk_tail_s: float
    pipe_tail_s: float
    pipe_total_s: float
    pipe_writes: int
    forward_s: float

    def row(self) -> str:
        gib = self.nbytes / 2**30
        bulk_gbs, copy_gbs, cma_gbs = gib / self.bulk_tail_s, gib / self.memcpy_s, gib / self.cma_s
        return (
            f"| {self.transport} | {self.tokens} | {self.nbytes / 2**20:,.1f} | {copy_gbs:.2f} | "
            f"{gib / self.copy2_s:.2f} | {cma_gbs:.2f} | "
            f"{self.bulk_tail_s * 1e3:,.1f} | {bulk_gbs:.2f} | {100 * bulk_gbs / copy_gbs:.0f}% | "
            f"{100 * bulk_gbs / cma_gbs:.0f}% | "
            f"{self.forward_s * 1e3:,.0f} | {self.pipe_tail_s * 1e3:,.1f} | {self.pipe_total_s * 1e3:,.1f} | "
            f"{self.pipe_writes} |"
        )


HEADER = (
    "| transport | tokens | MiB | memcpy GiB/s | torch copy_ GiB/s | CMA GiB/s | bulk tail ms | bulk GiB/s "
    "| bulk / memcpy | bulk / CMA | stand-in forward ms | pipelined tail ms | pipelined total ms | writes |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _output(rid: str, claim: c.Claim, n: int, blocks: list[int]) -> Any:
    new = SimpleNamespace(
        req_id=rid,
        sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": claim.to_params()}),
        prompt_token_ids=range(n),
        block_ids=(blocks,),
        num_computed_tokens=0,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={rid: n})


class Bench:
    def __init__(self, transport: str, max_tokens: int, prefill_tok_s: float) -> None:
        self.transport = transport
        self.prefill_tok_s = prefill_tok_s
        self.receiver = load_transport(transport).receiver(host="127.0.0.1", options=RECEIVER_OPTIONS)
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
        if not pipelined:  # bulk: nothing leaves before the last layer is staged
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

    def memcpy_s(self, nbytes: int, reps: int, how: str = "memcpy") -> float:
        """The staging extent into the node's slot buffer in this process: ``memcpy``, one libc ``memcpy`` (one
        thread: the plain copy a transport is compared with); ``torch``, ``Tensor.copy_`` (torch's intra-op
        threads); ``cma``, the kernel's cross-process copy (``process_vm_writev``, here into this very process):
        what UCX uses between two processes of one host without RDMA, so the most NIXL can reach here."""
        assert self.worker.pool is not None
        src, dst = self.worker.pool[:nbytes], self.table.slots[0].buffer[:nbytes]
        copy = {
            "memcpy": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
            "torch": lambda: dst.copy_(src),
            "cma": lambda: _cma_copy(dst.data_ptr(), src.data_ptr(), nbytes),
        }[how]
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _cma_copy(dst: int, src: int, nbytes: int) -> None:
    """``process_vm_writev`` into this process, in the pieces the kernel takes per call (at most ~2 GiB)."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    while done < nbytes:
        local, remote = _Iovec(src + done, nbytes - done), _Iovec(dst + done, nbytes - done)
        n = libc.process_vm_writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            raise OSError(ctypes.get_errno(), "process_vm_writev failed")
        done += n


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
                copy, copy2, cma = (bench.memcpy_s(nbytes, reps, how) for how in ("memcpy", "torch", "cma"))
                med = statistics.median
                r = Result(
                    transport,
                    n,
                    nbytes,
                    copy,
                    copy2,
                    cma,
                    med(bulk),
                    med(tails),
                    med(totals),
                    int(med(writes)),
                    med(forwards),
                )
                print(r.row(), flush=True)
                results.append(r)
            tg.cancel_scope.cancel()
    finally:
        bench.close()
    return results


# ---- stock vLLM's prefill, claimed vs unclaimed -------------------------------------------------------

TINY_LAYERS, TINY_ROW = 3, 576 * 4  # the tiny deepseek_v3 checkpoint in float32, as vLLM's CPU_MLA holds it
TINY_BPT = TINY_LAYERS * TINY_ROW
VLLM_HEADER = (
    "| transport | tokens | MiB moved | unclaimed prefill ms | claimed prefill ms | claimed / unclaimed "
    "| state ready after the response ms | CPU ms unclaimed | CPU ms claimed |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


@dataclass
class VllmResult:
    transport: str
    tokens: int
    nbytes: int
    unclaimed_s: float
    claimed_s: float
    ready_after_s: float
    cpu_unclaimed_s: float  # CPU time of every vLLM process and of this one (the decode half) per request
    cpu_claimed_s: float

    def row(self) -> str:
        return (
            f"| {self.transport} | {self.tokens} | {self.nbytes / 2**20:,.1f} | {self.unclaimed_s * 1e3:,.1f} | "
            f"{self.claimed_s * 1e3:,.1f} | {self.claimed_s / self.unclaimed_s:.3f} | "
            f"{self.ready_after_s * 1e3:+,.1f} | {self.cpu_unclaimed_s * 1e3:,.1f} | {self.cpu_claimed_s * 1e3:,.1f} |"
        )


def _tiny_model(max_tokens: int) -> Path:
    from tilert.models.tiny import build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="handoff-model-")) / "tiny-deepseek-v3"
    return build_tiny_model("deepseek_v3", out, seed=0, max_position_embeddings=max(4096, max_tokens + 256))


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} during start-up")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM not healthy within {timeout_s:g}s")


def run_vllm(
    transport: str, tokens: list[int], reps: int, model: Path | None, split: tuple[str, set[int]] | None = None
) -> list[VllmResult]:
    """One stock vLLM (connector on ``transport``) and a decode node's transfer half in this process; with
    ``split`` = (vLLM's OMP CPU list, this process's CPUs) each on its own CPUs (``--split-cpus``)."""
    import httpx
    import psutil

    from tilert.auth import load_secret
    from tilert.stack import StackConfig, child_env, prefill_command, write_secret_file

    max_tokens = max(tokens)
    model = model or _tiny_model(max_tokens)
    secret_file = write_secret_file()
    secret = load_secret(secret_file)
    port = free_port()
    cfg = StackConfig(
        model=model,
        prefill_port=port,
        transport=transport,
        max_model_len=max_tokens + 64,
        kv_cache_bytes=max(134_217_728, 2 * (max_tokens + 64) * TINY_BPT),
    )
    env = {**child_env(secret_file), "UCX_NET_DEVICES": "lo", "VLLM_LOGGING_LEVEL": "WARNING"}
    mine = os.sched_getaffinity(0)
    if split is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = split[0]
        os.sched_setaffinity(0, split[1])  # the receiver's threads, made below, inherit it
    log_path = Path(tempfile.gettempdir()) / f"handoff-vllm-{transport}-{os.getpid()}.log"
    print(f"(vLLM's log: {log_path})", flush=True)
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(prefill_command(cfg), env=env, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    receiver = load_transport(transport).receiver(host="127.0.0.1", options=RECEIVER_OPTIONS)
    table = SlotTable(1, {"mla": c.KVLayout("mla_dense", "float32", TINY_ROW, TINY_LAYERS)}, max_tokens + 1, receiver)
    control = ControlServer(table, transport, "bench-node", secret)
    results: list[VllmResult] = []
    gen = torch.Generator().manual_seed(0)
    try:
        _wait_http(url, proc)
        with anyio.from_thread.start_blocking_portal() as portal, httpx.Client(timeout=900) as client:
            serving, ctrl_port = portal.start_task(control.serve, "127.0.0.1", 0)

            async def ready_at(tid: str) -> float:
                await table.wait_ready(tid, 900)
                return time.monotonic()

            procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True), psutil.Process()]

            def cpu_s() -> float:
                return sum(sum(p.cpu_times()[:2]) for p in procs)

            def prefill(ids: list[int], claimed: bool) -> tuple[float, float | None, int, float]:
                body: dict[str, Any] = {"model": str(model), "prompt": ids, "max_tokens": 1, "temperature": 0}
                ready = None
                if claimed:
                    tid = uuid.uuid4().hex
                    portal.call(table.reserve, tid)
                    body["kv_transfer_params"] = c.Claim.signed(secret, tid, "127.0.0.1", ctrl_port).to_params()
                    ready = portal.start_task_soon(ready_at, tid)
                cpu0, t0 = cpu_s(), time.monotonic()
                resp = client.post(url + "/v1/completions", json=body)
                t_resp = time.monotonic()
                resp.raise_for_status()
                if ready is None:
                    return t_resp - t0, None, 0, cpu_s() - cpu0
                params = resp.json().get("kv_transfer_params") or {}
                assert not params.get("tilert_error"), params
                t_ready = ready.result(900)
                cpu = cpu_s() - cpu0
                nbytes = table.get(tid).offer.nbytes  # type: ignore[union-attr]
                portal.call(table.release, tid)
                return t_resp - t0, t_ready - t_resp, nbytes, cpu

            vocab = 2048
            for claimed in (False, True):  # warm-up: both paths, connections and registrations
                prefill(torch.randint(8, vocab, (min(tokens),), generator=gen).tolist(), claimed)
            for n in tokens:
                plain, claimed_s, after, nbytes, cpu_plain, cpu_claimed = [], [], [], 0, [], []
                try:
                    for _ in range(reps):
                        ids = torch.randint(8, vocab, (n,), generator=gen).tolist()
                        lat, _, _, cpu = prefill(ids, False)
                        plain.append(lat)
                        cpu_plain.append(cpu)
                        lat, ready_after, nbytes, cpu = prefill(ids, True)
                        claimed_s.append(lat)
                        after.append(ready_after or 0.0)
                        cpu_claimed.append(cpu)
                except httpx.HTTPStatusError as exc:  # vLLM could not prefill it: say so, go on
                    print(
                        f"| {transport} | {n} | vLLM answered {exc.response.status_code}: "
                        f"{exc.response.text[:200]!r} (see {log_path}) |",
                        flush=True,
                    )
                    continue
                med = statistics.median
                row = VllmResult(
                    transport, n, nbytes, med(plain), med(claimed_s), med(after), med(cpu_plain), med(cpu_claimed)
                )
                print(row.row(), flush=True)
                results.append(row)
            serving.cancel()  # the control server runs until cancelled; the portal waits for its tasks
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        receiver.close()
        os.sched_setaffinity(0, mine)
        import shutil

        shutil.rmtree(secret_file.parent, ignore_errors=True)
    return results


def conditions() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
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
        f"- Python {platform.python_version()}, "
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
    ap.add_argument(
        "--prefill-tok-s",
        type=float,
        default=16000.0,
        help="the stand-in forward's pace (tokens/s of the whole prefill)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the markdown table with its conditions: a FILE.md, or a directory for cpu-handoff[-vllm].md "
        "(default: benchmarks/results/)",
    )
    ap.add_argument("--vllm", action="store_true", help="also: stock vLLM's prefill latency, claimed vs unclaimed")
    ap.add_argument("--vllm-only", action="store_true", help="only the stock vLLM measurement")
    ap.add_argument("--vllm-reps", type=int, default=3)
    ap.add_argument(
        "--receiver-options",
        type=json.loads,
        default={},
        help='the decode side\'s transport options as JSON (e.g. \'{"registration": "region"}\')',
    )
    ap.add_argument(
        "--vllm-model",
        type=Path,
        default=None,
        help="a tiny deepseek_v3 checkpoint with max_position_embeddings >= the longest prompt "
        "(default: built into a temporary directory)",
    )
    ap.add_argument(
        "--split-cpus",
        default="",
        metavar="P:D",
        help="vLLM's OMP threads on CPUs P, the decode half (this process) on CPUs D, e.g. 0:1 "
        "(default: both on every CPU; module docstring)",
    )
    args = ap.parse_args()
    split = None
    if args.split_cpus:
        p_cpus, _, d_cpus = args.split_cpus.partition(":")
        try:
            prefill_set, decode_set = parse_cpu_list(p_cpus), parse_cpu_list(d_cpus)
        except ValueError as exc:
            ap.error(f"--split-cpus {args.split_cpus!r}: {exc}")
        if not (prefill_set and decode_set):
            ap.error(f"--split-cpus {args.split_cpus!r}: want P:D, two CPU lists (e.g. 0:1)")
        split = (p_cpus, set(decode_set))
    where = f"; vLLM's OMP threads on CPUs {split[0]}, the decode half on {sorted(split[1])}" if split else ""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings and up
    tokens = [int(x) for x in args.tokens.split(",")]
    RECEIVER_OPTIONS.update(args.receiver_options)
    print(
        f"layout: {LAYERS} layers x {WIDTH} bf16 = {BPT:,} bytes per token; stand-in prefill "
        f"{args.prefill_tok_s:g} tok/s; median of {args.reps}\n\n{HEADER}",
        flush=True,
    )
    results: list[Result] = []
    transports = args.transports.split(",")
    if not args.vllm_only:
        for transport in transports:
            results += anyio.run(run_transport, transport, tokens, args.reps, args.prefill_tok_s)
    vllm_rows: list[VllmResult] = []
    if args.vllm or args.vllm_only:
        print(
            f"\nstock vLLM prefill, tiny DeepSeek-V3 (float32, {TINY_BPT:,} bytes per token), median of "
            f"{args.vllm_reps}{where}\n\n{VLLM_HEADER}",
            flush=True,
        )
        for transport in transports:
            vllm_rows += run_vllm(transport, tokens, args.vllm_reps, args.vllm_model, split)
    title = "# KV handoff on CPU: staging pool + layer-pipelined sending"
    text = f"{title}\n\n{conditions()}\n"
    if results:
        text += (
            f"- layout: DeepSeek-V3 MLA, {LAYERS} layers x {WIDTH} bf16 = {BPT:,} bytes per token; stand-in "
            f"prefill {args.prefill_tok_s:g} tok/s; median of {args.reps}\n\n{HEADER}\n"
            + "\n".join(r.row() for r in results)
            + "\n"
        )
    if vllm_rows:
        text += (
            f"\nStock vLLM prefill (tiny DeepSeek-V3, float32, {TINY_BPT:,} bytes per token), median of "
            f"{args.vllm_reps}{where}:\n\n{VLLM_HEADER}\n" + "\n".join(r.row() for r in vllm_rows) + "\n"
        )
    bench = "handoff-vllm" if args.vllm_only else "handoff"
    path = write_md(result_path("cpu", bench, ".md", args.out), text, recorded("cpu", script="handoff.py"))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
