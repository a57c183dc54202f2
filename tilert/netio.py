"""Exact reads from blocking sockets, shared by the control channel and the TCP transport; a free port to listen
on, and a listening socket bound now for a server that starts serving later."""

from __future__ import annotations

import random
import socket
from pathlib import Path

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


_PORTS = random.Random()
_GIVEN: set[int] = set()  # ports this process has handed out (not handed out twice: the first may not be bound yet)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now on ``host``, for a process that binds it a little later. Taken below the
    kernel's ephemeral range: a port from that range (what binding port 0 gives) can become the local end of any
    outgoing connection before that process binds it, and its bind then fails with "Address already in use" (a
    stack's decode node binds its ports only after vLLM has started). Never the same port twice in one process."""
    low = _ephemeral_low()
    for _ in range(200):
        port = _PORTS.randrange(20000, low) if low > 21000 else 0
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = int(s.getsockname()[1])
        _GIVEN.add(port)
        return port
    raise OSError(f"no free port on {host} below the ephemeral range")


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for a server to serve from later: a server that binds its
    ports when it starts learns then that one is taken (and holds it), not after a long load."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and anyio bind
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock
