"""The ASGI response of one client request, as the router's legs write it.

The response's head goes through the app's middleware (which adds the request id and notes the status); once it has,
the body's messages, one or more a token, go straight to the server's own ``send`` (:data:`SERVER_SEND`, kept in
the request's scope by the app): none of the middleware reads them, and each wrapper of ``send`` is a Python call
a token on the relay's path. A middleware that rewrites bodies would have to be put outside the app.
"""

from __future__ import annotations

from starlette.types import Message, Send

from tilert.router.routing import POOL_HEADER, REASON_HEADER

__all__ = ["SERVER_SEND", "SSE_HEADERS", "ClientOutput"]

SERVER_SEND = "tilert.server_send"  # the scope key of the server's own send

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ClientOutput:
    """The ASGI response of one request, remembering how far it got."""

    def __init__(
        self, send: Send, pool: str | None = None, pool_reason: str | None = None, server_send: Send | None = None
    ) -> None:
        self._send = send
        self._body_send = server_send or send  # once the head went through send
        self.started = False
        self.done = False
        self.pool = pool  # the x-tilert-pool header of the response (the pool serving the request)
        self.pool_reason = pool_reason  # the x-tilert-pool-reason header: why not the pool the policy chose
        self._head: Message | None = None  # the response start, held until the first body goes with it

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Begin the response; its head goes out with the first body (one write to the client, not two)."""
        self.started = True
        if self.pool is not None:
            headers = [*headers, (POOL_HEADER.encode(), self.pool.encode())]
        if self.pool_reason is not None:
            headers = [*headers, (REASON_HEADER.encode(), self.pool_reason.encode("ascii", "replace"))]
        self._head = {"type": "http.response.start", "status": status, "headers": headers}

    async def body(self, data: bytes, more: bool = True) -> None:
        self.done = not more
        if self._head is not None:
            head, self._head = self._head, None
            await self._send(head)
        await self._body_send({"type": "http.response.body", "body": data, "more_body": more})

    async def json(self, status: int, payload: bytes, extra: dict[str, str] | None = None) -> None:
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in (extra or {}).items()]
        await self.start(status, headers)
        await self.body(payload, more=False)
