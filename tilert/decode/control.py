"""The decode node's control port: speaks ``tilert.protocol`` with the prefill-side senders.

One task per connection, on the decode node's event loop (so slot state needs no locks). The bytes
themselves never pass through here: the transport's receiver writes them straight into the slot's
registered buffer, and the sender's ``Done`` (sent only after its writes landed) completes the slot.
A connection that drops while a transfer is in flight fails that transfer at once.
"""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from tilert import protocol as p
from tilert.decode.slots import SlotError, SlotTable

log = structlog.get_logger("tilert.decode.control")


class ControlServer:
    def __init__(self, table: SlotTable, transport: str, node_id: str) -> None:
        self.table = table
        self.transport = transport
        self.node_id = node_id

    async def serve(self, host: str, port: int, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("control_listening", host=host, port=bound)
        task_status.started(bound)
        await listener.serve(self._handle)

    async def _handle(self, stream: SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        in_flight: set[str] = set()
        try:
            hello = await p.arecv_msg(reader)
            if not isinstance(hello, p.Hello) or hello.version != p.PROTOCOL_VERSION:
                await self._send(stream, p.Reject(f"expected hello v{p.PROTOCOL_VERSION}, got {hello}"))
                return
            if hello.transport != self.transport:
                await self._send(stream, p.Reject(f"this node receives over {self.transport!r}, not {hello.transport!r}"))
                return
            await self._send(stream, p.HelloAck(p.PROTOCOL_VERSION, self.node_id, [self.transport]))
            while True:
                msg = await p.arecv_msg(reader)
                await self._dispatch(stream, msg, in_flight)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
            pass
        except p.ProtocolError as exc:
            log.warning("control_protocol_error", error=str(exc))
            await self._send(stream, p.Reject(str(exc)))
        finally:
            for tid in in_flight:
                self.table.fail(tid, "prefill sender disconnected mid-transfer")
            await stream.aclose()

    async def _dispatch(self, stream: SocketStream, msg: p.Message, in_flight: set[str]) -> None:
        if isinstance(msg, p.Offer):
            try:
                target = self.table.accept(msg)
            except SlotError as exc:
                await self._send(stream, p.Reject(str(exc), msg.transfer_id))
                return
            in_flight.add(msg.transfer_id)
            await self._send(stream, p.Accept(msg.transfer_id, target))
        elif isinstance(msg, p.Done):
            in_flight.discard(msg.transfer_id)
            try:
                self.table.complete(msg.transfer_id, msg.nbytes)
            except SlotError as exc:
                await self._send(stream, p.Reject(str(exc), msg.transfer_id))
                return
            await self._send(stream, p.Ack(msg.transfer_id))
        elif isinstance(msg, p.Abort):
            in_flight.discard(msg.transfer_id)
            self.table.fail(msg.transfer_id, msg.reason)
        else:
            raise p.ProtocolError(f"unexpected {msg.type} on the control channel")

    @staticmethod
    async def _send(stream: SocketStream, msg: p.Message) -> None:
        try:
            await stream.send(p.encode(msg))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
