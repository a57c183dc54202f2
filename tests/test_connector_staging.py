"""The connector's bounded staging pool and layer-pipelined sending, below vLLM, over real loopback sockets.

The connector's two halves are driven directly, as vLLM drives them: ``SchedulerSide.build_meta`` places each
claimed prompt's extent, ``WorkerSide.save_layer`` stages layer after layer, ``flush`` ends the forward,
``take_report`` -> ``SchedulerSide.update`` brings freed extents back. The decode node is a real ``SlotTable``
+ ``ControlServer`` with the real receiver of each transport (tcp, mooncake, nixl); "peer gone" kills a
decode node in its own process.

Checked: a claim that finds no room is refused at once with its reason (``busy``) and the router turns that
into 503 + ``Retry-After``; two requests staged in one step both arrive intact; the first layer's bytes are
written before the last layer is staged; and for each failure (handshake refused, extraction error, transport
error, peer gone, timeout: the forward stalls, or the node never answers) on each transport the waiting slot
fails in under a second (where the node lives) and the pool is whole again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch

from tilert import contracts as c
from tilert.connector import gather as gather_module
from tilert.connector.claims import SaveRequest, TileRTConnectorMetadata, TileRTWorkerMeta
from tilert.connector.scheduler import SchedulerSide
from tilert.connector.sender import BackgroundSender
from tilert.connector.staging import ALIGN, ExtentAllocator, bytes_per_token, pool_bytes
from tilert.connector.worker import WorkerSide
from tilert.decode.control import ControlServer
from tilert.decode.slots import SlotError, SlotState, SlotTable
from tilert.plugins import load_transport
from tilert.router.errors import RouterError
from tilert.router.prefill import _claim_result
from tilert.transports.base import Coverage, Receiver, TransferError

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any NIXL agent exists, here and in the children
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

SECRET = b"staging-test-secret-0123456789abcdef"
TRANSPORTS = ["tcp", "mooncake", "nixl"]
LAYERS, BLOCK, NUM_BLOCKS, MAX_SEQ = 4, 16, 32, 256
ROW = 576 * 4  # float32 dense MLA rows, as vLLM's CPU_MLA keeps them for a float32 model
BPT = LAYERS * ROW
POOL = 1 << 20  # room for one 100-token prompt (921,600 bytes) or a 40- and a 50-token one together
FAIL_LIMIT_S = 1.0
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = c.KVLayout("mla_dense", "float32", ROW, LAYERS)


# ---- the two halves, as vLLM drives them ----------------------------------------------------------


def _output(reqs: list[tuple[str, c.Claim, int, list[int]]]) -> Any:
    """A ``SchedulerOutput`` with new requests whose whole prompt is scheduled in this step."""
    new = [
        SimpleNamespace(
            req_id=rid,
            sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": claim.to_params()}),
            prompt_token_ids=list(range(n)),
            block_ids=(blocks,),
            num_computed_tokens=0,
        )
        for rid, claim, n, blocks in reqs
    ]
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens={r[0]: r[2] for r in reqs}
    )


def _finished(rid: str, claim: c.Claim, n: int) -> Any:
    return SimpleNamespace(
        request_id=rid, kv_transfer_params=claim.to_params(), output_token_ids=[7], num_prompt_tokens=n
    )


@dataclass
class Rig:
    """One transport's prefill side (scheduler + worker with their pool + sender) and its decode receiver."""

    transport: str
    receiver: Receiver
    sender: BackgroundSender
    worker: WorkerSide
    sched: SchedulerSide
    caches: dict[str, torch.Tensor]

    def step(
        self, meta: TileRTConnectorMetadata, before_layer: Callable[[int], None] | None = None, layers: int = LAYERS
    ) -> None:
        """The forward of one step: each layer staged in turn (``before_layer(i)`` first), then the flush."""
        for i, name in enumerate(NAMES[:layers]):
            if before_layer is not None:
                before_layer(i)
            self.worker.save_layer(meta, name)
        self.worker.flush(meta)  # wait_for_save, with the step's metadata still bound

    def report(self) -> None:
        """One step's worker -> scheduler report, as vLLM carries it."""
        self.sched.update(SimpleNamespace(kv_connector_worker_meta=self.worker.take_report()))  # type: ignore[arg-type]

    def pool_whole_within(self, limit_s: float) -> float:
        """Seconds until both halves see the pool empty again (the scheduler through the worker's reports)."""
        t0 = time.monotonic()
        while True:
            self.report()
            if not self.sched.has_pending_work() and self.worker.extents_in_use == 0:
                assert self.sched.pool.used == 0 and self.sched.pool.largest_free == self.sched.pool.capacity
                return time.monotonic() - t0
            if time.monotonic() - t0 > limit_s:
                raise AssertionError(
                    f"pool not whole after {limit_s}s: scheduler {self.sched.pool.used} bytes used, "
                    f"worker {self.worker.extents_in_use} extents; last outcome "
                    f"{self.worker.transfers[-1].outcome if self.worker.transfers else None}"
                )
            time.sleep(0.002)

    def expected_rows(self, n: int, blocks: list[int]) -> torch.Tensor:
        slots = torch.tensor(SaveRequest("r", _claim("x", 1), blocks, BLOCK, n).slot_ids())
        return torch.stack(
            [self.caches[name].reshape(-1, 576)[slots].view(torch.uint8).reshape(n, ROW) for name in NAMES]
        )


def _claim(tid: str, port: int) -> c.Claim:
    return c.Claim.signed(SECRET, tid, "127.0.0.1", port)


def _tid(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


@contextmanager
def _rig(transport: str, stage_batch_bytes: int | None = None) -> Iterator[Rig]:
    receiver = load_transport(transport).receiver(host="127.0.0.1", options={})
    sender = BackgroundSender(transport, {"timeout_s": 5, "verdict_timeout_s": 2}, SECRET, timeout_s=5.0)
    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=LAYERS)
    gen = torch.Generator().manual_seed(0)
    caches = {name: torch.randn(NUM_BLOCKS, 1, BLOCK, 576, generator=gen) for name in NAMES}  # vLLM CPU_MLA
    worker = WorkerSide(
        cfg, sender, staging_bytes=POOL, expected_bytes_per_token=BPT, stage_batch_bytes=stage_batch_bytes
    )
    worker.register(caches)
    sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=pool_bytes(POOL, BPT, 0))
    try:
        yield Rig(transport, receiver, sender, worker, sched, caches)
    finally:
        worker.close()
        receiver.close()


@pytest.fixture(scope="module", params=TRANSPORTS)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    with _rig(request.param) as made:  # caches on the CPU: each layer copied as it completes
        yield made


async def _with_node(
    rig: Rig, body: Callable[[SlotTable, int], Any], *, slots: int = 2, layout: c.KVLayout = LAYOUT
) -> None:
    """A decode node's transfer half (slots + control port) on the rig's receiver, around ``body``."""
    table = SlotTable(slots, {"mla": layout}, MAX_SEQ, rig.receiver)
    control = ControlServer(table, rig.transport, "test-node", SECRET)
    async with anyio.create_task_group() as tg:
        port = await tg.start(control.serve, "127.0.0.1", 0)
        try:
            await body(table, port)
        finally:
            tg.cancel_scope.cancel()


async def _fails_within(table: SlotTable, tid: str, limit_s: float, match: str) -> float:
    t0 = time.monotonic()
    with pytest.raises(SlotError, match=match) as exc:
        await table.wait_ready(tid, 30)
    elapsed = time.monotonic() - t0
    assert exc.value.status == 502
    assert elapsed < limit_s, f"the waiting slot failed after {elapsed:.2f}s"
    return elapsed


def _wait_for(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


# ---- units ---------------------------------------------------------------------------------------


def test_extent_allocator_first_fit_merges_and_refuses_overlaps() -> None:
    pool = ExtentAllocator(10 * ALIGN)
    a, b, d = pool.alloc(3 * ALIGN), pool.alloc(1), pool.alloc(4 * ALIGN)
    assert (a, b, d) == (0, 3 * ALIGN, 4 * ALIGN) and pool.used == 8 * ALIGN
    assert pool.alloc(3 * ALIGN) is None and pool.largest_free == 2 * ALIGN
    pool.free(a)
    assert pool.alloc(2 * ALIGN) == 0  # first fit: the hole at the start
    pool.free(0)
    pool.free(b)
    assert pool.largest_free == 4 * ALIGN  # the freed neighbours merged
    with pytest.raises(ValueError, match="not free"):
        pool.take(4 * ALIGN, 10)  # d lives there
    pool.take(0, 4 * ALIGN)
    pool.free(0)
    pool.free(d)
    assert pool.used == 0 and pool.largest_free == 10 * ALIGN
    with pytest.raises(KeyError):
        pool.free(d)


def test_coverage_and_pool_sizing() -> None:
    cov = Coverage()
    for start, end in ((10, 20), (30, 40), (0, 10), (20, 30)):
        assert not cov.covers(40)
        cov.add(start, end)
    assert cov.covers(40) and not cov.covers(41)
    assert pool_bytes(None, 1000, 100) == 4 * 102400  # four prompts of max_model_len, page-aligned
    assert pool_bytes(None, 70272, 163840) == -(-70272 * 163840 // ALIGN) * ALIGN  # one prompt beats the cap
    assert pool_bytes(None, 70272, 16384) == 4 << 30  # capped
    for bad in (0, -1, True, "1"):
        with pytest.raises(ValueError):
            pool_bytes(bad, 1, 1)


def test_one_bytes_per_token_for_both_halves() -> None:
    """The scheduler's figure (from vLLM's KV cache config) is what the worker stages; a mismatch stops
    start-up, and so does a pool that cannot be allocated or registered."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    assert bytes_per_token(config) == BPT
    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=LAYERS)
    caches = {name: torch.zeros(NUM_BLOCKS, 1, BLOCK, 576) for name in NAMES}
    sender = BackgroundSender("tcp", {}, SECRET)
    try:
        worker = WorkerSide(cfg, sender, staging_bytes=POOL, expected_bytes_per_token=bytes_per_token(config))
        worker.register(caches)
        assert worker.bytes_per_token == BPT and worker.pool is not None and worker.pool.numel() == POOL
        with pytest.raises(ValueError, match="stage 9216 bytes per token but"):
            WorkerSide(cfg, sender, staging_bytes=POOL, expected_bytes_per_token=BPT + 2).register(caches)
        with pytest.raises(RuntimeError, match="cannot allocate"):
            WorkerSide(cfg, sender, staging_bytes=1 << 62).register(caches)

        def refuse(buffer: torch.Tensor) -> None:
            raise TransferError("no such memory region")

        sender._transport.register_source = refuse  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="cannot register .* no such memory region"):
            WorkerSide(cfg, sender, staging_bytes=POOL).register(caches)
    finally:
        sender.close()


def test_worker_reports_aggregate_and_every_rank_must_free() -> None:
    sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=POOL, workers=2)
    meta = sched.build_meta(_output([("r1", _claim("t1", 1), 10, [0])]))
    offset = meta.saves[0].offset
    both = TileRTWorkerMeta([("r1", offset)]).aggregate(TileRTWorkerMeta([]))
    sched.update(SimpleNamespace(kv_connector_worker_meta=both))  # type: ignore[arg-type]
    assert sched.has_pending_work()  # one rank of two
    sched.update(SimpleNamespace(kv_connector_worker_meta=TileRTWorkerMeta([("r1", offset)])))  # type: ignore[arg-type]
    assert not sched.has_pending_work() and sched.pool.used == 0


# ---- pool exhaustion: refused at once, the router answers 503 ---------------------------------------


def test_pool_exhaustion_refuses_the_claim_at_once_and_the_router_answers_503() -> None:
    sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=POOL, retry_after_s=2)
    a, b = _claim("a", 1), _claim("b", 1)
    t0 = time.perf_counter()
    meta = sched.build_meta(_output([("ra", a, 100, list(range(7))), ("rb", b, 100, list(range(7, 14)))]))
    assert time.perf_counter() - t0 < 0.05  # decided while the step is built, nothing waits
    assert [s.req_id for s in meta.saves] == ["ra"]  # the refused claim is not staged at all
    assert sched.request_finished(_finished("ra", a, 100)) == c.ClaimResult("a", 7, 100).to_params()
    params = sched.request_finished(_finished("rb", b, 100))
    result = c.ClaimResult.from_params(params)
    assert result is not None and result.busy and result.retry_after_s == 2
    assert result.first_token_id == 7 and "staging pool full" in (result.error or "")
    with pytest.raises(RouterError) as busy:
        _claim_result({"kv_transfer_params": params}, "b")
    assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "2"}
    assert busy.value.outcome == "prefill_busy"

    # Stale view: until the worker's report arrives the scheduler counts the extent as used (a claim may be
    # refused a step early, never placed over a live extent) ...
    assert sched.build_meta(_output([("rc", _claim("c", 1), 100, list(range(7, 14)))])).saves == []
    sched.request_finished(_finished("rc", _claim("c", 1), 100))
    assert sched.has_pending_work()  # vLLM keeps stepping until the report comes
    # ... and once it has, the room is there again.
    sched.update(SimpleNamespace(kv_connector_worker_meta=TileRTWorkerMeta([("ra", meta.saves[0].offset)])))  # type: ignore[arg-type]
    assert not sched.has_pending_work()
    again = sched.build_meta(_output([("rd", _claim("d", 1), 100, list(range(7)))]))
    assert [s.req_id for s in again.saves] == ["rd"]

    # A prompt larger than the whole pool will never fit: an error (502), not "busy".
    big = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=POOL)
    assert big.build_meta(_output([("re", _claim("e", 1), 200, list(range(13)))])).saves == []
    params = big.request_finished(_finished("re", _claim("e", 1), 200))
    assert params is not None and "tilert_busy" not in params and "raise tilert_staging_bytes" in params["tilert_error"]
    with pytest.raises(RouterError) as refused:
        _claim_result({"kv_transfer_params": params}, "e")
    assert refused.value.status == 502


# ---- the handoff, per transport -------------------------------------------------------------------


def test_two_requests_staged_in_one_step_both_arrive_intact(rig: Rig) -> None:
    ta, tb = _tid("two-a"), _tid("two-b")
    specs = {ta: (40, [5, 1, 30]), tb: (50, [2, 9, 17, 4])}

    async def body(table: SlotTable, port: int) -> None:
        for tid in specs:
            table.reserve(tid)
        meta = rig.sched.build_meta(_output([(f"r-{t}", _claim(t, port), n, b) for t, (n, b) in specs.items()]))
        assert len(meta.saves) == 2 and meta.saves[0].offset != meta.saves[1].offset
        await anyio.to_thread.run_sync(rig.step, meta)
        for tid, (n, blocks) in specs.items():
            slot = await table.wait_ready(tid, 10)
            views, layouts, num_tokens = slot.tensors()
            assert num_tokens == n and layouts == {"mla": LAYOUT}
            assert torch.equal(views["mla"], rig.expected_rows(n, blocks)), f"{tid}: bytes differ"
        await anyio.to_thread.run_sync(rig.pool_whole_within, 5.0)

    anyio.run(_with_node, rig, body)
    assert all(s.outcome == "done" for s in rig.worker.transfers[-2:])


def test_first_layer_written_before_the_last_layer_is_staged(rig: Rig) -> None:
    """Layer-pipelined: the handshake and layer 0's write happen while later layers are still to come."""
    tid, n, blocks = _tid("pipelined"), 60, [8, 3, 11, 6]

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-pipe", _claim(tid, port), n, blocks)]))

        def slow_forward(i: int) -> None:
            if i == LAYERS - 1:  # before the last layer: layer 0 must already have landed on the node
                staged = rig.worker.transfers[-1]
                _wait_for(lambda: bool(staged.writes))
                assert staged.writes[0].offset == 0  # layer 0's chunk (perhaps with the next ones staged by then)

        await anyio.to_thread.run_sync(rig.step, meta, slow_forward)
        slot = await table.wait_ready(tid, 10)
        assert torch.equal(slot.tensors()[0]["mla"], rig.expected_rows(n, blocks))
        await anyio.to_thread.run_sync(rig.pool_whole_within, 5.0)

    anyio.run(_with_node, rig, body)
    staged = rig.worker.transfers[-1]
    assert staged.outcome == "done" and staged.staged_at is not None
    assert staged.writes[0].done < staged.staged_at  # written before the last layer was staged
    assert sum(w.nbytes for w in staged.writes) == n * BPT and len(staged.writes) >= 2


@pytest.mark.parametrize("layers_a_batch", [2, LAYERS + 1])
def test_layers_are_copied_in_batches_of_stage_batch_bytes(layers_a_batch: int) -> None:
    """``tilert_stage_batch_bytes``: a request's layers are copied once they hold that many bytes, the rest at
    ``wait_for_save``. Room for two layers: two copies of two layers (the first written while the forward goes on);
    room for more than the request: one copy at the end of the forward, one write. The bytes arrive intact."""
    tid, n, blocks = _tid("batched"), 60, [8, 3, 11, 6]
    with _rig("tcp", stage_batch_bytes=layers_a_batch * n * ROW) as rig:

        async def body(table: SlotTable, port: int) -> None:
            table.reserve(tid)
            meta = rig.sched.build_meta(_output([("r-batch", _claim(tid, port), n, blocks)]))
            seen: list[int] = []

            def forward(i: int) -> None:
                if i:
                    seen.append(rig.worker.transfers[-1].staged_chunks)
                if i == LAYERS - 1 and layers_a_batch == 2:
                    _wait_for(lambda: bool(rig.worker.transfers[-1].writes))  # the first batch, written

            await anyio.to_thread.run_sync(rig.step, meta, forward)
            slot = await table.wait_ready(tid, 10)
            assert torch.equal(slot.tensors()[0]["mla"], rig.expected_rows(n, blocks))
            assert seen == ([0, 2, 2] if layers_a_batch == 2 else [0, 0, 0])  # staged before layers 1, 2, 3
            await anyio.to_thread.run_sync(rig.pool_whole_within, 5.0)

        anyio.run(_with_node, rig, body)
        staged = rig.worker.transfers[-1]
        assert staged.outcome == "done"
        assert [w.nbytes for w in staged.writes] == [n * ROW * k for k in ((2, 2) if layers_a_batch == 2 else (4,))]


@pytest.mark.parametrize("layers_a_batch", [0, LAYERS + 1])
def test_a_forward_that_stops_short_fails_the_transfer(layers_a_batch: int) -> None:
    """A forward that ends before its last layer (vLLM still calls ``wait_for_save``): the layers it reached are not
    shipped as the prompt's KV; the transfer fails naming how many were staged, and the extent comes back. Copied
    layer by layer (0) and copied whole at ``wait_for_save`` (a request smaller than one batch) alike."""
    tid, n, blocks = _tid("short"), 60, [8, 3, 11, 6]
    with _rig("tcp", stage_batch_bytes=layers_a_batch * n * ROW) as rig:

        async def body(table: SlotTable, port: int) -> None:
            table.reserve(tid)
            meta = rig.sched.build_meta(_output([("r-short", _claim(tid, port), n, blocks)]))
            await anyio.to_thread.run_sync(lambda: rig.step(meta, layers=LAYERS - 1))
            await _fails_within(table, tid, FAIL_LIMIT_S, f"staged {LAYERS - 1}/{LAYERS} layers")
            await anyio.to_thread.run_sync(rig.pool_whole_within, 5.0)

        anyio.run(_with_node, rig, body)
        assert f"staged {LAYERS - 1}/{LAYERS} layers" in (rig.worker.transfers[-1].outcome or "")


def test_stale_scheduler_view_refuses_busy_while_an_extent_is_out(rig: Rig) -> None:
    """With the real worker: until the worker's report comes back the extent stays used for the scheduler."""
    ta, tb = _tid("hold"), _tid("busy")

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(ta)
        table.reserve(tb)
        meta = rig.sched.build_meta(_output([("r-hold", _claim(ta, port), 100, list(range(7)))]))
        await anyio.to_thread.run_sync(rig.step, meta)
        await table.wait_ready(ta, 10)
        _wait_for(lambda: rig.worker.extents_in_use == 0)  # the worker is done with it; no report yet
        refused = rig.sched.build_meta(_output([("r-busy", _claim(tb, port), 100, list(range(7, 14)))]))
        assert refused.saves == []
        result = c.ClaimResult.from_params(rig.sched.request_finished(_finished("r-busy", _claim(tb, port), 100)))
        assert result is not None and result.busy
        await anyio.to_thread.run_sync(rig.pool_whole_within, 5.0)
        assert table.get(tb).state is SlotState.RESERVED  # nothing was ever offered for it

    anyio.run(_with_node, rig, body)


# ---- fail fast, per transport ------------------------------------------------------------------------


def test_refused_handshake_fails_the_slot_and_frees_the_extent(rig: Rig) -> None:
    tid = _tid("refused")
    other = c.KVLayout("mla_dense", "bfloat16", 576 * 2, LAYERS)  # this node takes bf16 only

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-ref", _claim(tid, port), 30, [1, 2])]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rig.step, meta)
            await _fails_within(table, tid, FAIL_LIMIT_S, "layout mismatch")
        await anyio.to_thread.run_sync(rig.pool_whole_within, FAIL_LIMIT_S)

    anyio.run(lambda: _with_node(rig, body, layout=other))


def test_extraction_error_aborts_at_once(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    tid = _tid("extract")
    real = gather_module.take_rows
    broken = rig.caches[NAMES[2]]

    def gather(kind: str, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if cache is broken:
            raise RuntimeError("simulated gather failure")
        return real(kind, cache, index)

    monkeypatch.setattr(gather_module, "take_rows", gather)

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-ext", _claim(tid, port), 30, [1, 2])]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rig.step, meta)  # never raises into vLLM's forward
            await _fails_within(table, tid, FAIL_LIMIT_S, "simulated gather failure")
        await anyio.to_thread.run_sync(rig.pool_whole_within, FAIL_LIMIT_S)

    anyio.run(_with_node, rig, body)


def test_transport_error_aborts_at_once(rig: Rig) -> None:
    """The grant is revoked under the writer after its first layer landed: the next write fails, the sender
    aborts, the slot fails."""
    tid = _tid("transport")

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-tr", _claim(tid, port), 30, [1, 2])]))
        started: list[float] = []

        def forward(i: int) -> None:
            if i == 1:
                staged = rig.worker.transfers[-1]
                _wait_for(lambda: bool(staged.writes))
                grant = table.get(tid).grant
                assert grant is not None
                rig.receiver.revoke(dict(grant))  # behind the slot table's back: only the writer notices
                started.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rig.step, meta, forward)
            await _fails_within(table, tid, 10, "prefill side")
        assert time.monotonic() - started[0] < FAIL_LIMIT_S
        await anyio.to_thread.run_sync(rig.pool_whole_within, FAIL_LIMIT_S)

    anyio.run(_with_node, rig, body)
    assert "TransferError" in (rig.worker.transfers[-1].outcome or "")


def test_timeout_when_no_layer_comes_aborts(rig: Rig) -> None:
    """The forward stalls after one layer: after ``timeout_s`` without a staged layer the sender aborts."""
    tid = _tid("timeout")
    rig.sender.timeout_s = 0.3

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-to", _claim(tid, port), 30, [1, 2])]))
        rig.worker.save_layer(meta, NAMES[0])  # ... and nothing more for now
        await _fails_within(table, tid, 0.3 + FAIL_LIMIT_S, "no layer was staged within 0.3s")
        await anyio.to_thread.run_sync(rig.pool_whole_within, FAIL_LIMIT_S)
        await anyio.to_thread.run_sync(rig.step, meta)  # the forward resumes: nothing is staged any more

    try:
        anyio.run(_with_node, rig, body)
    finally:
        rig.sender.timeout_s = 5.0
    assert rig.worker.extents_in_use == 0


def test_timeout_when_the_decode_node_never_answers(rig: Rig) -> None:
    """A node that takes the connection and the hello, then never answers the offer (stuck): after
    ``timeout_s`` the sender gives up (with an ``Abort`` on the channel) and the extent comes back."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    frames: list[c.Message] = []

    def stuck_node() -> None:
        conn, _ = server.accept()
        with conn:
            frames.append(c.recv_msg(conn))
            c.send_msg(conn, c.HelloAck(c.PROTOCOL_VERSION, "stuck", [rig.transport]))
            frames.append(c.recv_msg(conn))  # the offer, never answered
            conn.settimeout(5)
            try:
                frames.append(c.recv_msg(conn))  # the sender's abort
            except (OSError, c.ContractError):
                pass

    thread = threading.Thread(target=stuck_node, daemon=True)
    thread.start()
    rig.sender.timeout_s = 0.3
    try:
        meta = rig.sched.build_meta(_output([("r-stuck", _claim(_tid("stuck"), server.getsockname()[1]), 30, [1, 2])]))
        t0 = time.monotonic()
        rig.step(meta)
        rig.pool_whole_within(0.3 + FAIL_LIMIT_S)
        assert time.monotonic() - t0 < 0.3 + FAIL_LIMIT_S
    finally:
        rig.sender.timeout_s = 5.0
        thread.join(5)
        server.close()
    assert [type(f) for f in frames] == [c.Hello, c.Offer, c.Abort]
    assert "timed out" in (rig.worker.transfers[-1].outcome or "")


def test_a_save_no_layer_reached_is_aborted_and_its_extent_reported(rig: Rig) -> None:
    tid = _tid("unstaged")

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(tid)
        meta = rig.sched.build_meta(_output([("r-none", _claim(tid, port), 30, [1, 2])]))
        rig.worker.flush(meta)  # a forward that never reached a registered cache layer
        await _fails_within(table, tid, FAIL_LIMIT_S, "no KV cache layer")
        await anyio.to_thread.run_sync(rig.pool_whole_within, FAIL_LIMIT_S)

    anyio.run(_with_node, rig, body)


def test_scheduler_and_worker_disagreeing_never_stage_over_a_live_extent(rig: Rig) -> None:
    """A save placed over an extent the worker still uses is aborted, not staged (and reported back)."""
    ta, tb = _tid("live"), _tid("overlap")

    async def body(table: SlotTable, port: int) -> None:
        table.reserve(ta)
        table.reserve(tb)
        meta = rig.sched.build_meta(_output([("r-live", _claim(ta, port), 30, [1, 2])]))
        offset = meta.saves[0].offset
        rig.worker.save_layer(meta, NAMES[0])  # the live extent, mid-forward
        bogus = TileRTConnectorMetadata([SaveRequest("r-bogus", _claim(tb, port), [3, 4], BLOCK, 30, offset)])
        rig.worker.save_layer(bogus, NAMES[0])
        await _fails_within(table, tb, FAIL_LIMIT_S, "not free")
        for name in NAMES[1:]:
            rig.worker.save_layer(meta, name)
        rig.worker.flush()
        slot = await table.wait_ready(ta, 10)
        assert torch.equal(slot.tensors()[0]["mla"], rig.expected_rows(30, [1, 2]))
        report = rig.worker.take_report()
        assert report is not None and ("r-bogus", offset) in report.freed
        rig.sched.update(SimpleNamespace(kv_connector_worker_meta=report))  # type: ignore[arg-type]

    anyio.run(_with_node, rig, body)
    # The bogus report names an extent the scheduler never placed for r-bogus: logged, ignored.
    rig.pool_whole_within(5.0)


def _node_process(conn: Connection, transport: str, tid: str, parent: int) -> None:
    """A decode node (receiver + slots + control port) in its own process, with ``tid`` reserved."""
    import threading

    receiver = load_transport(transport).receiver(host="127.0.0.1", options={})
    table = SlotTable(1, {"mla": LAYOUT}, MAX_SEQ, receiver)
    control = ControlServer(table, transport, "doomed-node", SECRET)

    def watchdog() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)  # never outlive the test process

    threading.Thread(target=watchdog, daemon=True).start()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            port = await tg.start(control.serve, "127.0.0.1", 0)
            table.reserve(tid)
            conn.send(port)
            await anyio.sleep_forever()

    anyio.run(main)


def test_peer_killed_mid_transfer_frees_the_extent_at_once(rig: Rig) -> None:
    tid = _tid("killed")
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_node_process, args=(child, rig.transport, tid, os.getpid()), daemon=True)
    proc.start()
    child.close()
    try:
        assert conn.poll(60), "the decode node process did not start"
        port = conn.recv()
        meta = rig.sched.build_meta(_output([("r-kill", _claim(tid, port), 30, [1, 2])]))
        killed: list[float] = []

        def forward(i: int) -> None:
            if i == 1:
                staged = rig.worker.transfers[-1]
                _wait_for(lambda: bool(staged.writes))
                assert proc.pid is not None
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
                killed.append(time.monotonic())

        rig.step(meta, forward)
        elapsed = rig.pool_whole_within(FAIL_LIMIT_S)
        print(
            f"{rig.transport}: extent back {elapsed * 1e3:.1f} ms after the forward, "
            f"{(time.monotonic() - killed[0]) * 1e3:.1f} ms after the kill"
        )
        assert rig.worker.transfers[-1].outcome != "done"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        conn.close()


def test_a_step_that_only_polls_waits_for_a_transfer_to_end_and_no_longer() -> None:
    """While a connector has work pending (our extents out: ``has_pending_push_work``) vLLM keeps stepping. A
    step with no token scheduled is marked ``poll`` and the worker waits in it until the sender frees an extent,
    at most ``poll_wait_s``, so that vLLM does not run empty steps back to back, burning the CPU the transfer
    needs. Steps with tokens never wait, nor the one that tells the workers of finished requests: vLLM runs it
    once after every request, and a request sent meanwhile would wait behind it."""
    sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=BPT, pool_bytes=POOL)
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    idle = SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={}, finished_req_ids=set()
    )
    assert sched.build_meta(idle).poll and not sched.has_pending_work()  # vLLM steps idle for another connector
    finished = SimpleNamespace(**{**vars(idle), "finished_req_ids": {"r0"}})
    assert not sched.build_meta(finished).poll  # the step after a request finished
    meta = sched.build_meta(_output([("r1", _claim("t1", 1), 30, [1, 2])]))
    assert [s.req_id for s in meta.saves] == ["r1"] and not meta.poll
    assert sched.build_meta(idle).poll and sched.has_pending_work()

    sender = BackgroundSender("tcp", {}, SECRET)
    cfg = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=LAYERS)
    caches = {name: torch.zeros(NUM_BLOCKS, 1, BLOCK, 576) for name in NAMES}
    worker = WorkerSide(cfg, sender, staging_bytes=POOL, expected_bytes_per_token=BPT, poll_wait_s=5.0)
    worker.register(caches)
    paced = WorkerSide(cfg, sender, staging_bytes=POOL, expected_bytes_per_token=BPT, poll_wait_s=0.2)
    paced.register(caches)
    t0 = time.monotonic()
    paced.flush(TileRTConnectorMetadata(poll=True))  # nothing of ours in flight: one empty step, paced
    assert 0.15 < time.monotonic() - t0 < 2.0
    try:
        assert worker._extents is not None
        worker._extents.take(meta.saves[0].offset, 30 * BPT)  # as the worker's _start takes it
        t0 = time.monotonic()
        worker.flush(TileRTConnectorMetadata())  # a step with work: no wait
        assert time.monotonic() - t0 < 0.5
        releaser = threading.Timer(0.3, worker._release, ("r1", meta.saves[0].offset))
        releaser.start()
        t0 = time.monotonic()
        worker.flush(TileRTConnectorMetadata(poll=True))
        waited = time.monotonic() - t0
        assert 0.2 < waited < 3.0, waited  # until the release, not the whole poll_wait_s
        report = worker.take_report()
        assert report is not None and report.freed == [("r1", meta.saves[0].offset)]
        sched.update(SimpleNamespace(kv_connector_worker_meta=report))
        assert not sched.has_pending_work()
    finally:
        worker.close()
