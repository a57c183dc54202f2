"""The connector's background sender: control-channel handshake plus a transport write per request.

Runs off vLLM's forward path on a small thread pool, so a claimed request never blocks the next
prefill step. Any fault (refused connection, rejected offer, failed write) is reported to the decode
node with an explicit ``Abort`` when the control channel is up, so the waiting request fails within
about a second instead of timing out.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import structlog
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from tilert import contracts as p
from tilert.connector.claims import Claim
from tilert.plugins import load_transport
from tilert.transports.base import TransferError

log = structlog.get_logger("tilert.connector.sender")


class BackgroundSender:
    def __init__(
        self, transport: str, options: dict[str, Any], secret: bytes, timeout_s: float = 10.0, workers: int = 4
    ) -> None:
        self.transport_name = transport
        self._secret = secret
        self._transport = load_transport(transport).sender(options=options)
        self._timeout_s = timeout_s
        self._sender_id = f"prefill-{uuid.uuid4().hex[:8]}"
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tilert-send")

    def submit(
        self,
        claim: Claim,
        num_tokens: int,
        layouts: dict[str, p.KVLayout],
        staging: Any,
        wait_ready: Callable[[], None] | None = None,
    ) -> Future[None]:
        """Ship ``staging`` (uint8, the layouts' tensors back to back in ``layouts`` order)."""
        return self._pool.submit(self._send, claim, num_tokens, layouts, staging, wait_ready)

    def abort(self, claim: Claim, reason: str) -> Future[None]:
        return self._pool.submit(self._abort, claim, reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._transport.close()

    @retry(
        retry=retry_if_exception_type(ConnectionRefusedError),
        wait=wait_exponential(multiplier=0.02, max=0.2),
        stop=stop_after_delay(1.0),
        reraise=True,
    )
    def _connect(self, claim: Claim) -> socket.socket:
        sock = socket.create_connection((claim.host, claim.ctrl_port), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        p.send_msg(sock, p.Hello.signed(self._secret, self.transport_name, self._sender_id))
        ack = p.expect(p.recv_msg(sock), p.HelloAck)
        if ack.version != p.PROTOCOL_VERSION:
            sock.close()
            raise p.ProtocolError(f"decode node speaks protocol v{ack.version}, this sender v{p.PROTOCOL_VERSION}")
        return sock

    def _send(
        self,
        claim: Claim,
        num_tokens: int,
        layouts: dict[str, p.KVLayout],
        staging: Any,
        wait_ready: Callable[[], None] | None,
    ) -> None:
        tid = claim.transfer_id
        bound = log.bind(transfer_id=tid, host=claim.host, ctrl_port=claim.ctrl_port)
        try:
            sock = self._connect(claim)
        except (OSError, p.ProtocolError) as exc:
            bound.error("transfer_connect_failed", error=str(exc))
            return
        with sock:
            try:
                offer = p.Offer(tid, num_tokens, layouts)
                p.send_msg(sock, offer)
                accept = p.expect(p.recv_msg(sock), p.Accept)
                if wait_ready is not None:
                    wait_ready()
                self._transport.write(accept.target, staging)
                p.send_msg(sock, p.Done(tid, offer.nbytes))
                p.expect(p.recv_msg(sock), p.Ack)
                bound.info("transfer_done", nbytes=offer.nbytes, tokens=num_tokens)
            except (OSError, p.ProtocolError, TransferError) as exc:
                bound.error("transfer_failed", error=str(exc))
                try:
                    p.send_msg(sock, p.Abort(tid, f"prefill side: {exc}"))
                except OSError:
                    pass

    def _abort(self, claim: Claim, reason: str) -> None:
        try:
            with self._connect(claim) as sock:
                p.send_msg(sock, p.Abort(claim.transfer_id, reason))
        except (OSError, p.ProtocolError) as exc:
            log.error("abort_not_delivered", transfer_id=claim.transfer_id, error=str(exc))
