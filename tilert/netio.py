"""Exact reads from blocking sockets, shared by the control channel and the TCP transport."""

from __future__ import annotations

import socket

_CHUNK = 1 << 22  # bound each recv so a huge payload is read in steady pieces


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``; ``ConnectionError`` if the peer closes first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got : got + _CHUNK])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)
