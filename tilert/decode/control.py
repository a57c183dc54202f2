"""The decode node's control port: speaks the control frames of ``tilert.contracts`` with the
prefill-side senders.

One task per connection, on the decode node's event loop (so slot state needs no locks). The bytes
themselves never pass through here: the transport's receiver writes them straight into the slot's
registered buffer, and the sender's ``Done`` (sent only after its writes landed) completes the slot.
A connection that drops while a transfer is in flight fails that transfer at once.

Nothing a peer sends can stop this server: a connection must say a signed ``Hello`` within
``hello_timeout_s``, frames are size-capped, an idle connection is closed after ``idle_timeout_s``, at
most ``max_connections`` are served at once (more are closed on arrival), and any fault in one
connection ends that connection only. An offer that arrives before its reservation (the router reserves while
vLLM prefills) waits up to ``early_offer_wait_s`` for it.
"""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import structlog
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from tilert import contracts as c
from tilert.decode.slots import SlotError, SlotTable

log = structlog.get_logger("tilert.decode.control")


class ControlServer:
    def __init__(
        self,
        table: SlotTable,
        transport: str,
        node_id: str,
        secret: bytes,
        *,
        max_connections: int = 64,
        hello_timeout_s: float = 5.0,
        idle_timeout_s: float = 60.0,
        early_offer_wait_s: float = 2.0,
    ) -> None:
        self.table = table
        self.transport = transport
        self.node_id = node_id
        self._secret = secret
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.early_offer_wait_s = early_offer_wait_s  # an offer ahead of its reservation waits this long for it
        self.connections = 0

    async def serve(
        self,
        host: str,
        port: int,
        sock: socket.socket | None = None,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve on ``host:port``, or on ``sock`` (bound and listening already: ``netio.listening_socket``)."""
        if sock is not None:
            listener: anyio.abc.Listener[SocketStream] = await anyio.abc.SocketListener.from_socket(sock)
        else:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        log.info("control_listening", host=host, port=bound)
        task_status.started(bound)
        await listener.serve(self._guarded)

    async def _guarded(self, stream: SocketStream) -> None:
        """Whatever happens in one connection stays there."""
        if self.connections >= self.max_connections:
            log.warning("control_connection_refused", reason="too many connections", limit=self.max_connections)
            await stream.aclose()
            return
        self.connections += 1
        in_flight: set[str] = set()
        error: Exception | None = None
        try:
            await self._handle(stream, BufferedByteReceiveStream(stream), in_flight)
        except Exception as exc:  # noqa: BLE001 - a bug in one connection must not stop the node
            error = exc
        finally:
            self.connections -= 1
            for tid in in_flight:
                self.table.fail(tid, "prefill sender disconnected mid-transfer")
            if error is not None:  # after the slots failed: a traceback takes a while to render
                log.error("control_connection_failed", exc_info=error)
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    async def _handle(self, stream: SocketStream, reader: BufferedByteReceiveStream, in_flight: set[str]) -> None:
        try:
            with anyio.fail_after(self.hello_timeout_s):
                hello = await c.arecv_msg(reader)
            problem = self._check_hello(hello)
            if problem:
                log.warning("control_hello_refused", reason=problem)
                await self._send(stream, c.Reject(problem))
                return
            await self._send(stream, c.HelloAck(c.PROTOCOL_VERSION, self.node_id, [self.transport]))
            while True:
                with anyio.fail_after(self.idle_timeout_s):
                    msg = await c.arecv_msg(reader)
                await self._dispatch(stream, msg, in_flight)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ConnectionError):
            pass
        except TimeoutError:
            log.info("control_connection_idle", seconds=self.idle_timeout_s)
        except c.ContractError as exc:
            log.warning("control_protocol_error", error=str(exc))
            await self._send(stream, c.Reject(str(exc)))

    def _check_hello(self, hello: c.Message) -> str | None:
        if not isinstance(hello, c.Hello):
            return f"expected hello v{c.PROTOCOL_VERSION}, got {type(hello).__name__}"
        if hello.version != c.PROTOCOL_VERSION:
            return f"this node speaks protocol v{c.PROTOCOL_VERSION}, the sender v{hello.version}"
        if not hello.verified(self._secret):
            return "hello not signed with this deployment's secret"
        if hello.transport != self.transport:
            return f"this node receives over {self.transport!r}, not {hello.transport!r}"
        return None

    async def _dispatch(self, stream: SocketStream, msg: c.Message, in_flight: set[str]) -> None:
        if isinstance(msg, c.Offer):
            await self.table.wait_reserved(msg.transfer_id, self.early_offer_wait_s)
            try:
                target = self.table.accept(msg)
            except SlotError as exc:
                await self._send(stream, c.Reject(str(exc), msg.transfer_id))
                return
            in_flight.add(msg.transfer_id)
            await self._send(stream, c.Accept(msg.transfer_id, target))
        elif isinstance(msg, c.Done):
            in_flight.discard(msg.transfer_id)
            try:
                self.table.complete(msg.transfer_id, msg.nbytes)
            except SlotError as exc:
                await self._send(stream, c.Reject(str(exc), msg.transfer_id))
                return
            await self._send(stream, c.Ack(msg.transfer_id))
        elif isinstance(msg, c.Abort):
            in_flight.discard(msg.transfer_id)
            self.table.fail(msg.transfer_id, msg.reason)
        else:
            raise c.ContractError(f"unexpected {type(msg).__name__} on the control channel")

    @staticmethod
    async def _send(stream: SocketStream, msg: c.Message) -> None:
        try:
            await stream.send(c.encode(msg))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass
