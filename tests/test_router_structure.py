"""Structural rules of the router package, and the pool's Retry-After, checked without servers."""

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
