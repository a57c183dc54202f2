"""The router's watch on one decode node: a ``GET /v1/watch`` stream kept open for the router's life.

A node that dies (even by SIGKILL: the kernel closes its sockets), stops, or stays silent past
``node_silence_s`` (hung, or its host unreachable) ends the stream. The router then knows at once, not at its
next health probe nor when a request's prefill comes back: every request whose prefill runs for the node
(:meth:`NodeWatch.transfer`) hears it and moves on (``router.lease``; one already decoding there sees its stream
break).
The health probe admits a node only while its watch is open (:meth:`NodeWatch.opened`), so no request is leased
on a node the router could not see die.

The node also says on it when a transfer fails (``TransferFailed``): a request expecting that transfer
(:meth:`NodeWatch.transfer`) learns it at once, while vLLM may still be computing its prefill.

States: closed (opening it is tried every ``retry_s``, or at once when :meth:`opened` asks) -> open -> lost
(every transfer watched then is told) -> closed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
import structlog

from tilert import contracts as c
from tilert.router.node_client import NodeClient, NodeUnreachable

log = structlog.get_logger("tilert.router")


class TransferWatch:
    """What the node's watch stream says of one transfer while a request waits for its prefill: the node was lost
    (``lost``), or the transfer failed (``failed``: the node's reason). ``on_news`` runs once, at the first of them,
    from the watch's own task (a callback, not a task a request: nothing to cancel when the prefill answers)."""

    def __init__(self, on_news: Callable[[], None]) -> None:
        self.lost = False
        self.failed: str | None = None
        self._on_news: Callable[[], None] | None = on_news

    def _news(self) -> None:
        on_news, self._on_news = self._on_news, None
        if on_news is not None:
            on_news()


class NodeWatch:
    def __init__(self) -> None:
        self.reason = "not opened yet"  # why the stream is not open
        self._opened = anyio.Event()  # set while the stream is open (a fresh one once it is lost)
        self._wake = anyio.Event()
        self._expected: dict[str, TransferWatch] = {}

    @contextmanager
    def transfer(self, transfer_id: str, on_news: Callable[[], None]) -> Iterator[TransferWatch]:
        """While inside, the node's loss and a ``TransferFailed`` it reports for ``transfer_id`` are the yielded
        watch's news (``on_news`` runs at the first)."""
        watch = self._expected[transfer_id] = TransferWatch(on_news)
        try:
            yield watch
        finally:
            self._expected.pop(transfer_id, None)

    def _told(self, line: c.NodeBeat | c.TransferFailed) -> None:
        if isinstance(line, c.TransferFailed) and (watch := self._expected.get(line.transfer_id)) is not None:
            watch.failed = line.reason
            watch._news()

    async def run(self, client: NodeClient, silence_s: float, retry_s: float, on_lost: Callable[[str], None]) -> None:
        """Keep the node's stream open, forever; ``on_lost(reason)`` runs when an open one ends, before the
        transfers watched hear it (the pool stops granting the node before the requests on it look elsewhere)."""
        told: str | None = None
        while True:
            try:
                async with client.watch(silence_s) as lines:
                    async for line in lines:
                        if not self.is_open:  # open from its first line (a hung node sends none)
                            self._to_open()
                            told = None
                        self._told(line)
                reason = "the node closed its watch stream"
            except NodeUnreachable as exc:
                reason = str(exc)
            self.reason = reason
            if self.is_open:
                self._to_lost(on_lost)
            elif reason != told:  # once per new reason (the health probe reports an unreachable node)
                log.info("decode_node_watch_refused", node=client.spec.name, reason=reason)
                told = reason
            with anyio.move_on_after(retry_s):
                await self._wake.wait()
            self._wake = anyio.Event()

    def _to_open(self) -> None:
        self._opened.set()

    def _to_lost(self, on_lost: Callable[[str], None]) -> None:
        self._opened = anyio.Event()
        on_lost(self.reason)
        for watch in list(self._expected.values()):
            watch.lost = True
            watch._news()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    async def opened(self, timeout_s: float) -> bool:
        """Whether the stream is open, asking the loop to open it now (waiting up to ``timeout_s``) if not."""
        if not self.is_open:
            self._wake.set()
            with anyio.move_on_after(timeout_s):
                await self._opened.wait()
        return self.is_open


__all__ = ["NodeWatch", "TransferWatch"]
