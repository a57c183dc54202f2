"""HTTP client of one decode node: reserve, release, cancel, health, and the NDJSON decode stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import orjson

from tilert.router.config import DecodeNodeSpec
from tilert.router.errors import RouterError, upstream_message


class NodeFull(Exception):
    """The node answered 429 to a reservation."""


class NodeUnreachable(Exception):
    """The node could not be reached (connection refused, timeout, 5xx)."""


@dataclass
class NodeHealth:
    ok: bool
    slots_total: int | None = None
    slots_free: int | None = None
    error: str | None = None
    raw: dict[str, Any] | None = None


class DecodeNodeClient:
    """One shared ``httpx.AsyncClient`` per decode node, created in the app's lifespan."""

    def __init__(self, spec: DecodeNodeSpec, client: httpx.AsyncClient, control_timeout_s: float) -> None:
        self.spec = spec
        self.client = client
        self._control_timeout = httpx.Timeout(control_timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        return await self.client.post(path, content=orjson.dumps(payload), timeout=self._control_timeout,
                                      headers={"content-type": "application/json"})

    async def reserve(self, transfer_id: str, lease_s: float) -> int | None:
        """Reserve a slot; returns the slot number. Raises :class:`NodeFull` or :class:`NodeUnreachable`."""
        try:
            resp = await self._post("/v1/reserve", {"transfer_id": transfer_id, "lease_s": lease_s})
        except httpx.HTTPError as exc:
            raise NodeUnreachable(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code == 429:
            raise NodeFull(upstream_message(resp.content, "node full"))
        if resp.status_code != 200:
            raise NodeUnreachable(f"reserve answered HTTP {resp.status_code}: {upstream_message(resp.content, '')}")
        try:
            data = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            raise NodeUnreachable("reserve answered a body that is not JSON") from None
        slot = data.get("slot") if isinstance(data, dict) else None
        return slot if isinstance(slot, int) else None

    async def release(self, transfer_id: str) -> None:
        """Idempotent; errors are the caller's to log."""
        resp = await self._post("/v1/release", {"transfer_id": transfer_id})
        if resp.status_code >= 500:
            raise NodeUnreachable(f"release answered HTTP {resp.status_code}")

    async def cancel(self, transfer_id: str) -> None:
        resp = await self._post("/v1/cancel", {"transfer_id": transfer_id})
        if resp.status_code >= 500:
            raise NodeUnreachable(f"cancel answered HTTP {resp.status_code}")

    async def health(self, timeout_s: float) -> NodeHealth:
        try:
            resp = await self.client.get("/health", timeout=httpx.Timeout(timeout_s))
        except httpx.HTTPError as exc:
            return NodeHealth(ok=False, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        try:
            data = orjson.loads(resp.content)
        except orjson.JSONDecodeError:
            data = None
        if resp.status_code != 200 or not isinstance(data, dict) or data.get("status") != "ok":
            return NodeHealth(ok=False, error=f"health answered HTTP {resp.status_code}", raw=data if isinstance(data, dict) else None)
        total = data.get("slots_total")
        free = data.get("slots_free")
        return NodeHealth(
            ok=True,
            slots_total=total if isinstance(total, int) and not isinstance(total, bool) else None,
            slots_free=free if isinstance(free, int) and not isinstance(free, bool) else None,
            raw=data,
        )

    @asynccontextmanager
    async def decode(self, payload: dict[str, Any]) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Open the decode stream; yields an iterator of NDJSON objects. Closing it cancels on the node.

        A non-200 answer raises :class:`RouterError`: 4xx and 501 (option the engine cannot honour) as-is
        with the node's message, others as 502.
        """
        request = self.client.build_request(
            "POST", "/v1/decode", content=orjson.dumps(payload), headers={"content-type": "application/json"}
        )
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise RouterError(502, f"decode node {self.spec.name} unreachable: {type(exc).__name__}",
                              outcome="decode_error") from None
        try:
            if resp.status_code != 200:
                body = await resp.aread()
                message = upstream_message(body, f"HTTP {resp.status_code}")
                status = resp.status_code if 400 <= resp.status_code < 500 or resp.status_code == 501 else 502
                raise RouterError(status, f"decode node refused the request: {message}", outcome="decode_error")
            yield _ndjson(resp)
        finally:
            # Closing the stream tells the node to stop; do it even when the caller is being cancelled.
            with anyio.move_on_after(2.0, shield=True):
                await resp.aclose()


async def _ndjson(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    try:
        async for line in resp.aiter_lines():
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                raise RouterError(502, f"decode node sent a line that is not JSON: {line[:200]!r}",
                                  outcome="decode_error") from None
            if not isinstance(obj, dict):
                raise RouterError(502, "decode node sent a JSON line that is not an object", outcome="decode_error")
            yield obj
    except httpx.HTTPError as exc:
        raise RouterError(502, f"decode stream broke: {type(exc).__name__}", outcome="decode_error") from None
