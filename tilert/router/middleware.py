"""Pure ASGI middleware: X-Request-Id in/out bound into structlog's context, and bearer-token auth."""

from __future__ import annotations

import hmac
import re
import uuid
from collections.abc import Callable

import orjson
import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tilert.router.errors import error_payload

REQUEST_ID_SCOPE_KEY = "tilert.request_id"
_VALID_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


class RequestIdMiddleware:
    """Echo a sane client ``X-Request-Id`` (or mint one) and bind it to every log line of the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for key, value in scope.get("headers", []):
            if key == b"x-request-id":
                rid = value.decode("latin-1").strip()
                break
        if not _VALID_ID.match(rid):
            rid = uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = rid
        header = (b"x-request-id", rid.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append(header)
                message = {**message, "headers": headers}
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=rid):
            await self.app(scope, receive, send_with_id)


class BearerAuthMiddleware:
    """Require ``Authorization: Bearer <api_key>`` on ``/v1/*`` (health and metrics stay open)."""

    def __init__(self, app: ASGIApp, api_key: Callable[[], str | None]) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.api_key()
        if key and scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            given = b""
            for k, v in scope.get("headers", []):
                if k == b"authorization":
                    given = v
                    break
            expected = b"Bearer " + key.encode()
            if not hmac.compare_digest(given, expected):
                structlog.get_logger("tilert.router").info("auth_rejected", path=scope.get("path"))
                body = orjson.dumps(error_payload(401, "missing or invalid API key (Authorization: Bearer ...)"))
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
