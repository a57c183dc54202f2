"""Structural rules of the router package, and the pool's Retry-After and its slots for requests of several
choices, checked without servers."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from support.waiting import await_until

from tilert.router.config import DecodeNodeSpec
from tilert.router.errors import RouterError
from tilert.router.metrics import RouterMetrics
from tilert.router.pool import DecodePool

ROUTER = Path(__file__).resolve().parents[1] / "tilert" / "router"


def test_every_router_function_is_under_50_lines() -> None:
    long = [
        f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"  # type: ignore[operator]
        for path in ROUTER.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 >= 50  # type: ignore[operator]
    ]
    assert not long


def test_retry_after_follows_the_queue() -> None:
    """Retry-After grows with the queue ahead and the time requests hold a slot."""

    async def main() -> list[int]:
        pool = DecodePool([DecodeNodeSpec("127.0.0.1", 1, 2)], max_queue=1, retry_after_s=1, metrics=RouterMetrics("m"))
        pool.nodes[0].slots_total = 1
        node = await pool.acquire(anyio.current_time() + 1)
        for _ in range(20):  # requests have been holding their slot for ~10 s
            pool.give_back(node, held_s=10.0)
            node = await pool.acquire(anyio.current_time() + 1)
        seen = [pool.retry_after_s_now()]
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, anyio.current_time() + 5)  # one waits in the queue
            await await_until(lambda: pool.queue_depth == 1, 5, "the second request in the queue")
            seen.append(pool.retry_after_s_now())
            with pytest.raises(RouterError) as full:
                await pool.acquire(anyio.current_time() + 1)
            seen.append(int(full.value.headers["Retry-After"]))
            tg.cancel_scope.cancel()
        return seen

    alone, one_ahead, refused = anyio.run(main)
    assert 9 <= alone <= 11 and one_ahead >= 2 * alone - 1 and refused == one_ahead


def test_a_request_of_n_choices_takes_n_slots_in_arrival_order() -> None:
    """A request of 3 choices waits for 3 free slots of one node; one of 1 behind it waits behind it although a slot
    is free; giving back frees what was taken; more choices than any node decodes is the pool's 400 naming ``n``."""

    async def main() -> None:
        pool = DecodePool([DecodeNodeSpec("127.0.0.1", 1, 2)], max_queue=4, retry_after_s=1, metrics=RouterMetrics("m"))
        node = pool.nodes[0]
        pool.update_health(node, True, slots_total=4, slots_free=4, error=None, max_choices=3)
        first = await pool.acquire(anyio.current_time() + 1, need=2)
        assert node.in_use == 2
        got: list[str] = []

        async def take(name: str, need: int) -> None:
            await pool.acquire(anyio.current_time() + 5, need=need)
            got.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(take, "three", 3)
            await await_until(lambda: pool.queue_depth == 1, 5, "the request of 3 in the queue")
            tg.start_soon(take, "one", 1)
            await await_until(lambda: pool.queue_depth == 2, 5, "the request of 1 behind it")
            assert got == [] and node.in_use == 2  # two slots free, but the first in line needs three
            pool.give_back(first, need=2)
            await await_until(lambda: got == ["three", "one"], 5, "both granted, in arrival order")
        assert node.in_use == 4
        assert pool.choices_refusal(3) is None and pool.choices_refusal(1) is None
        refused = pool.choices_refusal(4)
        assert refused is not None and (refused.status, refused.param) == (400, "n") and "at most 3" in refused.message

    anyio.run(main)


def test_overflow_is_decided_when_the_wait_ends_and_waits_on_while_the_fallback_is_down() -> None:
    """A lease that may overflow ends in the pool's 429 after ``after_s`` only when the fallback is ready then;
    while it is not, the request keeps waiting for a slot (and gets one that frees), or overflows as soon as the
    fallback comes back; with neither, it is the queue's timeout."""
    import structlog

    from tilert.router.lease import NodeLease, Overflow

    async def lease_outcome(
        ready: Callable[[], bool], free_at: float | None, up_at: float | None, after_s: float = 0.1
    ) -> tuple[str, float]:
        pool = DecodePool([DecodeNodeSpec("127.0.0.1", 1, 2)], max_queue=4, retry_after_s=1, metrics=RouterMetrics("m"))
        held = await pool.acquire(anyio.current_time() + 1)  # the node's one slot is taken
        flag = {"up": False}
        lease = NodeLease(
            pool, {}, {}, "t", queue_timeout_s=2.0, lease_s=5.0, log=structlog.get_logger("test"),
            overflow=Overflow(after_s, lambda: ready() or flag["up"], recheck_s=0.05),
        )  # fmt: skip
        t0 = anyio.current_time()
        async with anyio.create_task_group() as tg:
            if free_at is not None:
                tg.start_soon(lambda: _later(free_at, lambda: pool.give_back(held)))
            if up_at is not None:
                tg.start_soon(lambda: _later(up_at, lambda: flag.update(up=True)))
            try:
                await lease.__aenter__()
                outcome = "slot"
            except RouterError as exc:
                outcome = "overflow" if lease.overflows else exc.outcome
            tg.cancel_scope.cancel()
        return outcome, anyio.current_time() - t0

    async def _later(delay: float, fn: Callable[[], object]) -> None:
        await anyio.sleep(delay)
        fn()

    outcome, took = anyio.run(lease_outcome, lambda: True, None, None, 0.0)
    assert outcome == "overflow" and took < 0.05  # after_s 0: at once
    outcome, took = anyio.run(lease_outcome, lambda: True, None, None)
    assert outcome == "overflow" and 0.09 <= took < 1.0  # fallback ready: overflow after 0.1 s
    outcome, took = anyio.run(lease_outcome, lambda: False, 0.5, None)
    assert outcome == "slot" and 0.45 <= took < 1.5  # fallback down: waited on, got the slot freed at 0.5 s
    outcome, took = anyio.run(lease_outcome, lambda: False, None, 0.5)
    assert outcome == "overflow" and 0.45 <= took < 1.5  # fallback back at 0.5 s: overflow then
    outcome, took = anyio.run(lease_outcome, lambda: False, None, None)
    assert outcome == "queue_timeout" and took >= 1.95  # neither: the queue's own timeout


def test_one_probe_that_times_out_does_not_take_a_node_out() -> None:
    """A health probe that only timed out is inconclusive (a busy node or a busy router): the node stays in until
    ``PROBE_TIMEOUTS_TO_FAIL`` in a row; a probe's error takes it out at once; an answer resets the count."""
    from tilert.router.pool import PROBE_TIMEOUTS_TO_FAIL

    pool = DecodePool([DecodeNodeSpec("127.0.0.1", 1, 2)], max_queue=1, retry_after_s=1, metrics=RouterMetrics("m"))
    node = pool.nodes[0]
    probe = {"slots_total": 1, "slots_free": 1, "error": None}
    timeout = {"slots_total": None, "slots_free": None, "error": "TimeoutError", "timed_out": True}
    for _ in range(PROBE_TIMEOUTS_TO_FAIL - 1):
        pool.update_health(node, False, **timeout)
    assert node.healthy
    pool.update_health(node, True, **probe)
    pool.update_health(node, False, **timeout)
    assert node.healthy, "an answer in between starts the count again"
    for _ in range(PROBE_TIMEOUTS_TO_FAIL - 1):
        pool.update_health(node, False, **timeout)
    assert not node.healthy and node.last_error == "TimeoutError"
    pool.update_health(node, True, **probe)
    pool.update_health(node, False, slots_total=None, slots_free=None, error="health answered HTTP 503")
    assert not node.healthy and node.last_error == "health answered HTTP 503"
