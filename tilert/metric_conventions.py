"""What the router's and the decode node's ``/metrics`` share: the name prefix, vLLM's histogram buckets, and
:class:`ManyObservations` (the inter-token gaps of a line of several tokens observed at once).

Both name their series after vLLM's, with ``tilert:`` for ``vllm:``, so one dashboard reads vLLM, the router
(:mod:`tilert.router.metrics`) and the decode nodes (:mod:`tilert.decode.metrics`).
"""

from __future__ import annotations

import bisect
from typing import Any

from prometheus_client import Histogram

PREFIX = "tilert:"

# vLLM's bucket families (vllm/v1/metrics/buckets.py); inter-token latency gets a finer low end, since a
# decode node steps in a few milliseconds.
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
WAIT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
TOKEN_COUNT_BUCKETS = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
    100000,
    200000,
    500000,
    1000000,
)


class ManyObservations:
    """``n`` observations of one value at once into a histogram (its child, labels applied): the sum and the bucket
    ``observe`` counts (the first bound at or above the value) grow as by ``n`` calls of ``observe``, in one step
    (prometheus_client observes one value at a time)."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        parts: list[Any] = [getattr(histogram, name, None) for name in ("_buckets", "_upper_bounds", "_sum")]
        self._parts = None if None in parts else parts  # not the layout this relies on: one by one

    def observe(self, value: float, n: int) -> None:
        """``n`` observations of ``value`` (one included: prometheus_client's own ``observe`` walks the bounds in
        Python, this bisects them)."""
        if self._parts is None:
            for _ in range(n):
                self._histogram.observe(value)
            return
        buckets, bounds, total = self._parts
        total.inc(value * n)
        buckets[bisect.bisect_left(bounds, value)].inc(n)
