"""Decode node pool: health view, least-loaded choice, and fair (FIFO) bounded admission.

``Retry-After`` on a 429 is computed from the queue: how long the requests ahead would take to clear the
slots at the average time a request has held one (an exponential moving average of recent holds).

A request of ``n`` choices takes ``n`` slots of one node (the node decodes each choice as a sequence of its own,
and counts its slots the same way); it waits, in arrival order, for a node with that many free, and a node's
``max_choices`` (from its health report) bounds the ``n`` it is granted.

The pool only counts slots this router holds; the node's own ``/v1/reserve`` is the authority. When a
node answers 429 although the local count said it had room, it is marked saturated until one of our
slots on it is given back or its health report shows a free slot.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import anyio
import structlog

from tilert.router.config import DecodeNodeSpec
from tilert.router.errors import RouterError
from tilert.router.metrics import RouterMetrics

log = structlog.get_logger("tilert.router.pool")


PROBE_TIMEOUTS_TO_FAIL = 2  # health probes in a row without an answer that take a node out


@dataclass
class ProbeTimeouts:
    """A probed target's health probes in a row that got no answer in time. One alone is inconclusive (a busy
    target, or a busy router): a target counted healthy stays so until :data:`PROBE_TIMEOUTS_TO_FAIL` have."""

    in_a_row: int = 0

    def ignore(self, ok: bool, timed_out: bool, healthy: bool) -> bool:
        """Count one probe's result; True when it failed but must not count (yet)."""
        self.in_a_row = self.in_a_row + 1 if not ok and timed_out else 0
        return 0 < self.in_a_row < PROBE_TIMEOUTS_TO_FAIL and healthy


@dataclass(eq=False)
class PooledNode:
    spec: DecodeNodeSpec
    healthy: bool = True
    slots_total: int = 1
    slots_free: int | None = None
    in_use: int = 0
    saturated: bool = False
    last_error: str | None = None
    max_choices: int | None = None  # the largest n the node decodes (None: not reported yet)
    probe_timeouts: ProbeTimeouts = field(default_factory=ProbeTimeouts)

    @property
    def name(self) -> str:
        return self.spec.name

    def has_room(self, need: int = 1) -> bool:
        """Room for a request of ``need`` choices (slots)."""
        fits = self.max_choices is None or need <= self.max_choices
        return self.healthy and not self.saturated and fits and self.in_use + need <= self.slots_total


@dataclass(eq=False)
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    node: PooledNode | None = None
    error: RouterError | None = None
    need: int = 1  # slots: the request's choices


class DecodePool:
    """Grants decode nodes to requests first come, first served."""

    def __init__(
        self,
        specs: list[DecodeNodeSpec],
        *,
        max_queue: int,
        retry_after_s: int,
        metrics: RouterMetrics,
    ) -> None:
        self.nodes = [PooledNode(spec) for spec in specs]
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s
        self._metrics = metrics
        self._waiters: deque[_Waiter] = deque()
        self._rr = 0
        self._hold_s = float(max(1, retry_after_s))  # moving average of how long a request holds a slot
        for node in self.nodes:
            metrics.node_healthy(node.name, True)
            metrics.slots_in_use(node.name, 0)

    # -- views -------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    def any_healthy(self) -> bool:
        return any(n.healthy for n in self.nodes)

    def choices_refusal(self, n: int) -> RouterError | None:
        """Why no node of this pool can ever decode ``n`` choices (a 400 naming ``n``: the native pool may serve
        the request), or None when one can (or no node has reported yet: the node's reserve then decides)."""
        known = [node.max_choices for node in self.nodes if node.max_choices is not None]
        if n == 1 or not known or n <= max(known):
            return None
        return RouterError(
            400,
            f"n must be at most {max(known)} on the TileRT decode pool (the sequences its decode nodes decode at "
            f"once), got {n}",
            outcome="unsupported",
            param="n",
        )

    def _pick(self, need: int = 1) -> PooledNode | None:
        candidates = [n for n in self.nodes if n.has_room(need)]
        if not candidates:
            return None
        # Least loaded by fraction, then by count; rotate the start so ties spread out.
        self._rr = (self._rr + 1) % len(self.nodes)
        order = {id(n): (i - self._rr) % len(self.nodes) for i, n in enumerate(self.nodes)}
        return min(candidates, key=lambda n: (n.in_use / max(n.slots_total, 1), n.in_use, order[id(n)]))

    def _take(self, node: PooledNode, need: int = 1) -> PooledNode:
        node.in_use += need
        self._metrics.slots_in_use(node.name, node.in_use)
        return node

    def _dispatch(self) -> None:
        while self._waiters:
            node = self._pick(self._waiters[0].need)  # the first in line first, whatever it needs
            if node is None:
                break
            waiter = self._waiters.popleft()
            waiter.node = self._take(node, waiter.need)
            waiter.event.set()
        self._metrics.waiting(len(self._waiters))

    def _fail_waiters(self, error: RouterError) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            waiter.error = error
            waiter.event.set()
        self._metrics.waiting(0)

    # -- admission ---------------------------------------------------------------------------------
    def retry_after_s_now(self) -> int:
        """Seconds until a slot is likely free for a request joining the queue now (1 to 600)."""
        slots = sum(n.slots_total for n in self.nodes if n.healthy) or 1
        return min(600, max(1, math.ceil(self._hold_s * (len(self._waiters) + 1) / slots)))

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s_now())}

    async def acquire(self, deadline: float, *, front: bool = False, need: int = 1) -> PooledNode:
        """Wait (FIFO, until the ``anyio.current_time()`` ``deadline``) for a node with ``need`` free slots.

        ``front`` puts a request that already waited (and lost its slot to a stale view) back at the head.
        Raises :class:`RouterError`: 503 no healthy node, 429 queue full or queue timeout.
        """
        if not self.any_healthy():
            raise RouterError(503, "no healthy decode node", outcome="no_healthy_node", headers=self._retry_after())
        if front or not self._waiters:
            node = self._pick(need)
            if node is not None:
                return self._take(node, need)
        if not front and len(self._waiters) >= self.max_queue:
            raise RouterError(
                429,
                f"all decode slots are busy and the queue is full ({self.max_queue} waiting)",
                outcome="queue_full",
                headers=self._retry_after(),
            )
        waiter = _Waiter(need=need)
        if front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        self._metrics.waiting(len(self._waiters))
        try:
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await waiter.event.wait()
        except BaseException:
            # Cancelled (client gone): leave the queue, and hand back a grant that raced in.
            self._leave(waiter)
            if waiter.node is not None:
                self.give_back(waiter.node, need=need)
            raise
        self._leave(waiter)
        if waiter.node is not None:
            return waiter.node
        if waiter.error is not None:
            raise waiter.error
        raise RouterError(
            429,
            "timed out waiting for a free decode slot",
            outcome="queue_timeout",
            headers=self._retry_after(),
        )

    def _leave(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._metrics.waiting(len(self._waiters))

    def give_back(
        self, node: PooledNode, *, saturated: bool = False, held_s: float | None = None, need: int = 1
    ) -> None:
        """Return the ``need`` slots taken by :meth:`acquire` (held for ``held_s``); wakes the next waiter."""
        if held_s is not None:
            self._hold_s += 0.2 * (held_s - self._hold_s)
        node.in_use = max(0, node.in_use - need)
        node.saturated = saturated
        self._metrics.slots_in_use(node.name, node.in_use)
        self._dispatch()

    # -- health ------------------------------------------------------------------------------------
    def mark_unhealthy(self, node: PooledNode, reason: str) -> None:
        if node.healthy:
            log.warning("decode_node_unhealthy", node=node.name, reason=reason)
        node.healthy = False
        node.last_error = reason
        self._metrics.node_healthy(node.name, False)
        if not self.any_healthy():
            self._fail_waiters(RouterError(503, "no healthy decode node", outcome="no_healthy_node"))

    def update_health(
        self,
        node: PooledNode,
        ok: bool,
        *,
        slots_total: int | None,
        slots_free: int | None,
        error: str | None,
        max_choices: int | None = None,
        timed_out: bool = False,
    ) -> None:
        """One health probe's result. A refusal, an error or a broken connection takes the node out at once; a probe
        that only timed out does so when :data:`PROBE_TIMEOUTS_TO_FAIL` have in a row (a node that stopped
        answering is lost sooner through its watch stream: ``router.watch``)."""
        if node.probe_timeouts.ignore(ok, timed_out, node.healthy):
            log.info("decode_node_probe_timed_out", node=node.name, in_a_row=node.probe_timeouts.in_a_row)
            return
        if not ok:
            self.mark_unhealthy(node, error or "health check failed")
            return
        if not node.healthy:
            log.info("decode_node_healthy", node=node.name)
        node.healthy = True
        node.last_error = None
        if slots_total is not None and slots_total >= 0:
            node.slots_total = slots_total
        if max_choices is not None:
            node.max_choices = max_choices
        node.slots_free = slots_free
        if slots_free is not None and slots_free > 0:
            node.saturated = False
        self._metrics.node_healthy(node.name, True)
        self._dispatch()
