"""Two (or more) ranks of a tensor-parallel test as spawned processes, with their result and a bounded wait."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from support.stack import free_port

T = TypeVar("T")


def run_ranks(target: Callable[..., None], args: tuple[Any, ...], *, ranks: int = 2, timeout_s: float = 360) -> Any:
    """Run ``target(rank, port, *args, results)`` in ``ranks`` spawned processes (``port``: a free one for their
    process group) and return what rank 0 puts on ``results``; every process is joined (killed past a minute)
    and must exit 0."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in range(ranks)]
    for p in procs:
        p.start()
    try:
        got = results.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * ranks
    return got


def run_ranks_beside(
    target: Callable[..., None], args: tuple[Any, ...], beside: Callable[[], T], *, timeout_s: float = 360
) -> tuple[Any, T]:
    """:func:`run_ranks` (two ranks), with ``beside()`` run in this process meanwhile (a one-rank reference: the
    ranks spend part of their time importing and waiting on each other, so the machine has room for it); returns
    what rank 0 put and what ``beside()`` returned."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        ranks = pool.submit(run_ranks, target, args, timeout_s=timeout_s)
        mine = beside()
        return ranks.result(), mine
