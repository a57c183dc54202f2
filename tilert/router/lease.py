"""A decode slot held for one request: the pool's grant plus the node's reservation.

``async with NodeLease(...) as lease`` waits (FIFO, bounded) for a node with room in the pool;
``await lease.reserve_while(work)`` reserves the slot on that node *while* ``work`` (the prefill, whose claim
names the node) runs, so the reserve's round trip is off the request's critical path: a prefill takes longer
than a reserve, and a sender whose offer reaches the node first waits there for the reservation
(``decode.slots``). Should the node refuse (full, unreachable) or be lost meanwhile (its watch stream ended:
``router.watch``), the work is cancelled and both run again on another node under a new transfer id (vLLM's
prefix cache makes the second prefill cheap), or the request fails at once when no node is left. Leaving the
block releases the slot exactly once, whatever happened inside (answer, error, timeout, client gone); the
node's one release call also cancels a decode still running there, so there is no separate cancel to forget.
:meth:`NodeLease.release` may be called earlier (before the response's last byte, so a client that has its
answer also sees the slot free); later calls do nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

import anyio
import structlog

from tilert import contracts as c
from tilert.router.errors import RouterError
from tilert.router.node_client import NodeClient, NodeFull, NodeUnreachable
from tilert.router.pool import DecodePool, PooledNode
from tilert.router.watch import NodeWatch

RELEASE_BUDGET_S = 1.0
NO_SLOT_OUTCOMES = ("queue_full", "queue_timeout")  # the pool's 429s: what an overflow serves instead


@dataclass(frozen=True)
class Overflow:
    """Where a request that waits too long for a slot may go instead (the native pool): after ``after_s`` in
    the queue, when ``ready()`` says so; while it does not, the request waits on for a slot, asking again
    every ``recheck_s``."""

    after_s: float
    ready: Callable[[], bool]
    recheck_s: float = 0.25


T = TypeVar("T")


class NodeLease:
    def __init__(
        self,
        pool: DecodePool,
        clients: dict[str, NodeClient],
        watches: dict[str, NodeWatch],
        transfer_id: str,
        *,
        queue_timeout_s: float,
        lease_s: float,
        log: structlog.typing.FilteringBoundLogger,
        sampling: c.Sampling | None = None,
        overflow: Overflow | None = None,
    ) -> None:
        self._pool = pool
        self._sampling = sampling  # the node checks it with the reserve
        self._need = sampling.n if sampling is not None else 1  # slots: one a choice, on the node and in the pool
        self._clients = clients
        self._watches = watches
        self.transfer_id = transfer_id
        self._queue_timeout_s = queue_timeout_s
        self._overflow = overflow
        self._overflow_at = 0.0
        self.overflows = False  # the wait ended for the overflow: no slot, and its fallback ready
        self._lease_s = lease_s
        self._log = log
        self.node: PooledNode | None = None
        self.slot: int | None = None
        self.max_seq_len: int | None = None  # the node's context, from its reserve answer
        self.queued_s = 0.0
        self._since = 0.0
        self._deadline = 0.0
        self._released = False

    @property
    def client(self) -> NodeClient:
        assert self.node is not None, "no node is leased"
        return self._clients[self.node.name]

    async def __aenter__(self) -> NodeLease:
        start = anyio.current_time()
        self._deadline = start + self._queue_timeout_s
        if self._overflow is not None:
            self._overflow_at = start + min(self._overflow.after_s, self._queue_timeout_s)
        self.node = await self._acquire()
        self._since = anyio.current_time()
        self.queued_s = self._since - start
        return self

    async def _acquire(self, front: bool = False) -> PooledNode:
        """The pool's grant, waiting until the queue's deadline. With an :class:`Overflow`, a wait past its
        ``after_s`` ends in the pool's no-slot error as soon as the fallback is ready (checked then, and every
        ``recheck_s`` after it while it is not: the request keeps its place meanwhile)."""
        while True:
            overflow = self._overflow
            if overflow is None:
                return await self._pool.acquire(self._deadline, front=front, need=self._need)
            now = anyio.current_time()
            if now < self._overflow_at:
                until = self._overflow_at
            else:  # past after_s: a slot free now, else the fallback if it is ready, else wait a little longer
                until = now if overflow.ready() else now + overflow.recheck_s
            try:
                return await self._pool.acquire(min(until, self._deadline), front=front, need=self._need)
            except RouterError as exc:
                if exc.outcome in NO_SLOT_OUTCOMES and overflow.ready():
                    self.overflows = True  # the caller serves the request there instead
                    raise
                if exc.outcome != "queue_timeout" or anyio.current_time() >= self._deadline:
                    raise
                front = True  # the fallback is not ready: wait on for a slot, first in line

    async def reserve_while(self, work: Callable[[PooledNode, str], Awaitable[T]]) -> T:
        """Reserve the slot on the leased node while ``work(node, transfer_id)`` runs; its result once both
        are done. A node that refuses the reserve is given back (saturated) or marked unhealthy, the work is
        cancelled, and both run again on the next node the pool grants, under a new transfer id."""
        while True:
            node = self.node
            assert node is not None, "reserve_while inside the lease's block only"
            done = await self._attempt(node, work)
            if done is not None:
                self._since = anyio.current_time()
                return done[0]
            self.transfer_id = uuid.uuid4().hex
            self.node = await self._acquire(front=True)

    async def _attempt(self, node: PooledNode, work: Callable[[PooledNode, str], Awaitable[T]]) -> tuple[T] | None:
        """Reserve on ``node`` while the work runs: ``(its result,)``, or None when the node refused or was
        lost meanwhile (its watch stream ended: it died, stopped or hung; the work is then cancelled). The work
        goes out first (it is the longer of the two). Its failure cancels the reserve and is raised as it is, as
        are the node's refusal of the request's sampling and its report that the transfer failed (anyio's task
        group would wrap any of them in an exception group). A reserve that already answered when the work
        returns is not waited for: the result goes on at once."""
        result: list[T] = []
        failed: list[Exception] = []
        refused: list[bool] = []
        reserved = anyio.Event()

        async def reserve() -> None:
            try:  # started after the work's first step, which writes the prefill's request on a kept connection
                if await self._reserve(node):
                    refused.append(True)
                    tg.cancel_scope.cancel()
            except RouterError as exc:
                failed.append(exc)
                tg.cancel_scope.cancel()
            finally:
                reserved.set()

        def news() -> None:  # from the node's watch: it was lost, or the transfer failed
            if told.failed is not None:
                failed.append(RouterError(502, f"KV transfer failed: {told.failed}", outcome="transfer_failed"))
            tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            with self._watches[node.name].transfer(self.transfer_id, news) as told:
                tg.start_soon(reserve)
                try:
                    result.append(await work(node, self.transfer_id))
                    if not reserved.is_set():
                        await reserved.wait()
                except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                    failed.append(exc)
                tg.cancel_scope.cancel()
        if told.lost:
            await self._lost(node)
            return None
        if failed:
            raise failed[0]
        return None if refused else (result[0],)

    async def _lost(self, node: PooledNode) -> None:
        """The node was lost while the request's prefill ran (the pool already knows): give it back; a slot the
        reserve may have taken there is released (tombstoned) should the node be alive after all (hung)."""
        self._log.warning("decode_node_lost_during_prefill", node=node.name)
        if self.node is node:
            self._pool.give_back(node, need=self._need)
            self.node = None
            await self._forget(node)

    async def _reserve(self, node: PooledNode) -> bool:
        """The node's reservation; True when it refused (the node is given back, ``self.node`` is unset).
        Cancelled (the work failed first): the lease's release tombstones the id on the node."""
        try:
            reply = await self._clients[node.name].reserve(self.transfer_id, self._lease_s, self._sampling)
            self.slot, self.max_seq_len = reply.slot, reply.max_seq_len
            return False
        except NodeFull as exc:
            self._log.info("reserve_full", node=node.name, reason=str(exc))
            self._pool.give_back(node, saturated=True, need=self._need)
        except NodeUnreachable as exc:
            self._pool.mark_unhealthy(node, str(exc))
            self._pool.give_back(node, need=self._need)
            await self._forget(node)
        self.node = None
        return True

    def fits(self, prompt_tokens: int, max_tokens: int | None) -> bool:
        """Whether the node's context holds ``max_tokens`` more after the prompt (``contracts.decode_room``),
        i.e. the node will not refuse the decode request for its length."""
        room = c.decode_room(self.max_seq_len, prompt_tokens) if self.max_seq_len is not None else -1
        return room >= 0 and (max_tokens is None or max_tokens <= room)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.release()

    async def release(self, node_freed: bool = False) -> None:
        """Free the slot on the node (cancelling its decode) and return it to the pool; once only.
        ``node_freed``: the node already freed it (its decode stream ended cleanly), no call is needed."""
        if self._released or self.node is None:
            return
        self._released = True
        node = self.node
        if node_freed:
            self._pool.give_back(node, held_s=anyio.current_time() - self._since, need=self._need)
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_BUDGET_S) as scope:
            try:
                await self._clients[node.name].release(self.transfer_id)
            except Exception as exc:  # noqa: BLE001 - the node's lease expiry frees it at the latest
                self._log.warning("slot_release_failed", node=node.name, error=f"{type(exc).__name__}: {exc}")
        if scope.cancelled_caught:
            self._log.warning("slot_release_timed_out", node=node.name)
        self._pool.give_back(node, held_s=anyio.current_time() - self._since, need=self._need)

    async def _forget(self, node: PooledNode) -> None:
        """A reserve whose answer never came may still land on a paused node: releasing the id there
        tombstones it, so that late reserve is refused instead of holding a slot for its whole lease.
        (The request is sent even if its answer does not come within the budget.)"""
        with anyio.move_on_after(RELEASE_BUDGET_S):
            try:
                await self._clients[node.name].release(self.transfer_id)
            except Exception:  # noqa: BLE001 - best effort; the node is already marked unhealthy
                pass


__all__ = ["NodeLease", "Overflow"]
