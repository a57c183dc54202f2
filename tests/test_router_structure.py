"""Structural rules of the router package, and the pool's Retry-After and its slots for requests of several
choices, checked without servers."""

from __future__ import annotations

import ast
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
