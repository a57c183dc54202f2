"""CPU lists and placement: which CPUs a process may run on, and Linux CPU-list text (``"1"``, ``"0,2-3"``).

The stack pins its latency-critical threads (the decode engine's worker, ``tilert up``'s placement) and frees
others (the connector's sender threads) from the CPU their creator was pinned to; both need the CPUs this
process *may* use (its cgroup cpuset), not the ones it is pinned to now.
"""

from __future__ import annotations

import os
import re


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list (``"1"``, ``"0,2-3"``) as a set; ``ValueError`` naming what is wrong."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a CPU number or range (e.g. '1' or '2-3')")
        lo, hi = int(m[1]), int(m[2] or m[1])
        if hi < lo:
            raise ValueError(f"empty CPU range {part!r}")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def allowed_cpus() -> frozenset[int]:
    """Every CPU this process may run on (its cpuset), whatever the calling thread is pinned to now: the kernel
    intersects a request for every CPU with the cpuset. Without CPU affinity (not Linux): every CPU."""
    if not hasattr(os, "sched_setaffinity"):
        return frozenset(range(os.cpu_count() or 1))
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return frozenset(mine)
    finally:
        os.sched_setaffinity(0, mine)  # the calling thread keeps its own placement
