"""Errors the router answers with, in OpenAI's error shape (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from typing import Any

import orjson

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    501: "NotImplementedError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


class RouterError(Exception):
    """A failure with the HTTP status the client should see and a human-readable reason.

    ``body`` (raw bytes) lets an upstream 4xx reach the client verbatim, with its own message.
    ``upstream`` marks a message written by vLLM, which may quote the prompt: it goes to the client,
    never into a log line (:meth:`log_reason`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        outcome: str = "error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        body: bytes | None = None,
        upstream: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.outcome = outcome
        self.param = param
        self.headers = headers or {}
        self.body = body
        self.upstream = upstream

    def log_reason(self) -> str:
        """The reason as it may appear in a log: upstream text (possibly quoting the prompt) withheld."""
        return f"(upstream message of {len(self.message)} chars withheld)" if self.upstream else self.message

    def payload(self) -> dict[str, Any]:
        return error_payload(self.status, self.message, self.param)

    def json_body(self) -> bytes:
        return self.body if self.body is not None else orjson.dumps(self.payload())


def error_payload(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError"),
            "param": param,
            "code": status,
        }
    }


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, outcome="bad_request", param=param)


def unsupported(param: str, why: str) -> RouterError:
    return RouterError(
        400,
        f"'{param}' is not supported by the TileRT decode pool: {why}",
        outcome="unsupported",
        param=param,
    )


def upstream_message(body: bytes, fallback: str) -> str:
    """Pull the human message out of an upstream JSON error (OpenAI, vLLM old and new shapes)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return text[:500] or fallback
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(data.get("message"), str):
            return data["message"]
        if isinstance(data.get("detail"), str):
            return data["detail"]
    return fallback
