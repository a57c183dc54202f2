"""A decode slot held for one request: the pool's grant plus the node's reservation.

``async with NodeLease(...) as lease`` waits (FIFO, bounded) for a node with room and reserves a slot on
it; leaving the block releases it exactly once, whatever happened inside (answer, error, timeout, client
gone). The node's one release call also cancels a decode still running there, so there is no separate
cancel to forget. :meth:`NodeLease.release` may be called earlier (before the response's last byte,
so a client that has its answer also sees the slot free); later calls do nothing.
"""

from __future__ import annotations

from types import TracebackType

import anyio
import structlog

from tilert.router.node_client import NodeClient, NodeFull, NodeUnreachable
from tilert.router.pool import DecodePool, PooledNode

RELEASE_BUDGET_S = 1.0


class NodeLease:
    def __init__(
        self,
        pool: DecodePool,
        clients: dict[str, NodeClient],
        transfer_id: str,
        *,
        queue_timeout_s: float,
        lease_s: float,
        log: structlog.typing.FilteringBoundLogger,
    ) -> None:
        self._pool = pool
        self._clients = clients
        self.transfer_id = transfer_id
        self._queue_timeout_s = queue_timeout_s
        self._lease_s = lease_s
        self._log = log
        self.node: PooledNode | None = None
        self.slot: int | None = None
        self.queued_s = 0.0
        self._since = 0.0
        self._released = False

    @property
    def client(self) -> NodeClient:
        assert self.node is not None, "no node is leased"
        return self._clients[self.node.name]

    async def __aenter__(self) -> NodeLease:
        start = anyio.current_time()
        deadline, front = start + self._queue_timeout_s, False
        while True:
            node = await self._pool.acquire(deadline, front=front)
            try:
                self.slot = await self._clients[node.name].reserve(self.transfer_id, self._lease_s)
            except NodeFull as exc:
                self._log.info("reserve_full", node=node.name, reason=str(exc))
                self._pool.give_back(node, saturated=True)
            except NodeUnreachable as exc:
                self._pool.mark_unhealthy(node, str(exc))
                self._pool.give_back(node)
                await self._forget(node)
            except BaseException:
                self._pool.give_back(node)
                raise
            else:
                self.node, self._since = node, anyio.current_time()
                self.queued_s = self._since - start
                return self
            front = True

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
            self._pool.give_back(node, held_s=anyio.current_time() - self._since)
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_BUDGET_S) as scope:
            try:
                await self._clients[node.name].release(self.transfer_id)
            except Exception as exc:  # noqa: BLE001 - the node's lease expiry frees it at the latest
                self._log.warning("slot_release_failed", node=node.name, error=f"{type(exc).__name__}: {exc}")
        if scope.cancelled_caught:
            self._log.warning("slot_release_timed_out", node=node.name)
        self._pool.give_back(node, held_s=anyio.current_time() - self._since)

    async def _forget(self, node: PooledNode) -> None:
        """A reserve whose answer never came may still land on a paused node: releasing the id there
        tombstones it, so that late reserve is refused instead of holding a slot for its whole lease.
        (The request is sent even if its answer does not come within the budget.)"""
        with anyio.move_on_after(RELEASE_BUDGET_S):
            try:
                await self._clients[node.name].release(self.transfer_id)
            except Exception:  # noqa: BLE001 - best effort; the node is already marked unhealthy
                pass


__all__ = ["NodeLease"]
