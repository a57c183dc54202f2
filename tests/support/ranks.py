"""Two (or more) ranks of a tensor-parallel test as spawned processes, with their result and a bounded wait."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from support.stack import free_port


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
