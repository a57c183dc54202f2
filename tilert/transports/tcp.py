"""The embedded default transport: plain TCP sockets, loopback unless configured otherwise.

The receiver listens on the decode node's bind address, on ``port`` (option; 0, the default: a free port the
kernel picks), and its grants name the node's advertised address and that port.

The receiver serves at most ``max_connections`` connections at once (more are closed on arrival) and
closes one idle for ``idle_timeout_s``.

Each write is one frame on a pooled connection: a fixed header (grant key, offset within the grant,
length), then the payload, which the receiver reads straight into the registered buffer (``recv_into``,
no extra copy); the receiver answers one status byte once the bytes are in place. A write outside its
grant, or to a revoked grant, is refused and the connection closed; revoking a grant while a write into it
is still arriving shuts that connection down, so a stalled writer fails at once instead of holding its
staging until its own socket timeout, and the write is refused (at most the chunk being copied at that moment
still lands). The sender needs no source
registration (it copies from any memory; a device tensor is copied to the host first).
"""

from __future__ import annotations

import secrets
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import torch

from tilert.netio import recv_exact, recv_into
from tilert.transports.base import (
    Receiver,
    Sender,
    TransferError,
    Transport,
    check_bounds,
    check_receive_buffer,
    check_window,
)

log = structlog.get_logger("tilert.transports.tcp")

_HEADER = struct.Struct(">16sQQ")  # grant key, offset within the grant, nbytes
_OK, _REFUSED = b"\x01", b"\x00"


@dataclass
class _Grant:
    view: memoryview  # the granted window of the registered buffer
    writers: set[socket.socket] = field(default_factory=set)  # connections whose payload is arriving into it


class TcpReceiver(Receiver):
    def __init__(
        self,
        host: str,
        port: int = 0,
        timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 64,
        advertise: str | None = None,
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(16)
        self.host, self.port = advertise or host, self._sock.getsockname()[1]  # what grants name
        self._timeout_s = timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._regions: list[torch.Tensor] = []
        self._grants: dict[bytes, _Grant] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tilert-tcp-recv", daemon=True)
        self._thread.start()

    def register(self, buffer: torch.Tensor) -> int:
        check_receive_buffer(buffer, "tcp")
        with self._lock:
            self._regions.append(buffer)
            return len(self._regions) - 1

    def grant(self, region: int, offset: int, nbytes: int) -> dict[str, Any]:
        buf = self._regions[region]
        check_window(buf, offset, nbytes)
        key = secrets.token_bytes(16)
        view = buf.numpy().data.cast("B")[offset : offset + nbytes]
        with self._lock:
            self._grants[key] = _Grant(view)
        return {"transport": "tcp", "host": self.host, "port": self.port, "key": key.hex(), "nbytes": nbytes}

    def revoke(self, target: dict[str, Any]) -> None:
        with self._lock:
            grant = self._grants.pop(bytes.fromhex(target["key"]), None)
            writers = set(grant.writers) if grant is not None else set()
        for conn in writers:  # mid-payload: its recv_into fails now, the writer sees the reset
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("tcp_connection_refused", reason="too many connections")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="tilert-tcp-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One connection: frames until the peer leaves, a refused write, or ``idle_timeout_s`` of silence
        (the sender then reconnects). Any fault ends this connection only."""
        error: Exception | None = None
        try:
            self._frames(conn)
        except Exception as exc:  # noqa: BLE001 - nothing a peer sends may stop the receiver
            error = exc
        finally:
            conn.close()
            self._slots.release()
        if error is not None:  # after the peer saw the close: a traceback takes a while to render
            log.error("tcp_connection_failed", exc_info=error)

    def _frames(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    conn.settimeout(self._idle_timeout_s)  # a pooled connection may idle between transfers
                    key, offset, nbytes = _HEADER.unpack(recv_exact(conn, _HEADER.size))
                    conn.settimeout(self._timeout_s)
                except (ConnectionError, OSError):
                    return
                with self._lock:
                    grant = self._grants.get(key)
                    fits = grant is not None and offset + nbytes <= len(grant.view)
                    if grant is not None and fits:
                        grant.writers.add(conn)
                if grant is None or not fits:
                    log.warning("tcp_write_refused", offset=offset, nbytes=nbytes, known=grant is not None)
                    conn.sendall(_REFUSED)
                    return  # the payload follows the header: the stream cannot be resynchronised
                try:
                    recv_into(conn, grant.view[offset : offset + nbytes])
                    with self._lock:
                        grant.writers.discard(conn)
                        live = self._grants.get(key) is grant
                    if not live:  # revoked while the last bytes arrived: not vouched for
                        conn.sendall(_REFUSED)
                        return
                    conn.sendall(_OK)
                except (ConnectionError, OSError) as exc:
                    with self._lock:
                        grant.writers.discard(conn)
                    log.warning("tcp_write_broken", error=str(exc))
                    return


class TcpSender(Sender):
    def __init__(self, timeout_s: float = 30.0) -> None:
        self._timeout_s = timeout_s
        self._pool: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()

    def write(self, target: dict[str, Any], data: torch.Tensor, offset: int = 0) -> None:
        if data.device.type != "cpu" or not data.is_contiguous():
            data = data.contiguous().cpu()
        payload = data.view(torch.uint8).numpy().data.cast("B")
        check_bounds(int(target["nbytes"]), offset, len(payload))
        endpoint = (str(target["host"]), int(target["port"]))
        header = _HEADER.pack(bytes.fromhex(target["key"]), offset, len(payload))
        with self._lock:  # one write at a time per sender keeps pooled streams framed
            pooled = self._pool.pop(endpoint, None)
            if pooled is not None:
                try:
                    return self._write_on(pooled, endpoint, header, payload)
                except ConnectionError:
                    pass  # the receiver dropped the idle pooled connection: once more on a fresh one
                except OSError as exc:
                    raise TransferError(f"tcp write to {endpoint[0]}:{endpoint[1]} failed: {exc}") from exc
            try:
                sock = socket.create_connection(endpoint, timeout=self._timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._write_on(sock, endpoint, header, payload)
            except (ConnectionError, OSError) as exc:
                raise TransferError(f"tcp write to {endpoint[0]}:{endpoint[1]} failed: {exc}") from exc

    def _write_on(self, sock: socket.socket, endpoint: tuple[str, int], header: bytes, payload: memoryview) -> None:
        """One framed write; the socket goes back to the pool only after the receiver's OK."""
        try:
            sock.sendall(header)
            sock.sendall(payload)
            status = recv_exact(sock, 1)
        except OSError:
            sock.close()
            raise
        if status != _OK:
            sock.close()
            raise TransferError("receiver refused the write (grant unknown, revoked or too small)")
        self._pool[endpoint] = sock

    def close(self) -> None:
        with self._lock:
            for sock in self._pool.values():
                sock.close()
            self._pool.clear()


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"

    @classmethod
    def receiver(cls, *, host: str, options: dict[str, Any], advertise: str | None = None) -> TcpReceiver:
        return TcpReceiver(
            host,
            int(options.get("port", 0)),
            float(options.get("timeout_s", 30.0)),
            float(options.get("idle_timeout_s", 300.0)),
            int(options.get("max_connections", 64)),
            advertise=advertise,
        )

    @classmethod
    def sender(cls, *, options: dict[str, Any]) -> TcpSender:
        return TcpSender(float(options.get("timeout_s", 30.0)))
