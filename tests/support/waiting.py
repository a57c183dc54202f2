"""Bounded waits on a condition: how a test waits for something to have happened (never a fixed sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.005) -> T:
    """Polls ``cond`` until it returns something true, and returns that; ``AssertionError`` naming ``what`` if it
    has not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(interval_s)
    return value


async def await_until(cond: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.005) -> T:
    """:func:`wait_until` inside an event loop: polls without blocking the loop's other tasks."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await anyio.sleep(interval_s)
    return value
