"""HTTP client of one decode node, speaking the node API of ``tilert.contracts``: reserve, release,
health, and the NDJSON decode stream. Every call carries the node API token derived from the
deployment's secret."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx

from tilert import auth
from tilert import contracts as c
from tilert.router.config import DecodeNodeSpec
from tilert.router.errors import RouterError


class NodeFull(Exception):
    """The node answered 429 to a reservation."""


class NodeUnreachable(Exception):
    """The node could not be reached (connection refused, timeout, 5xx, a reply outside the contract)."""


@dataclass(frozen=True)
class HealthView:
    ok: bool
    slots_total: int | None = None
    slots_free: int | None = None
    error: str | None = None


def node_message(body: bytes, fallback: str) -> str:
    """The message of a node's ``ErrorBody`` (the node never puts transfer ids in them)."""
    try:
        return c.parse(c.ErrorBody, body).error.message
    except c.ContractError:
        return fallback


class NodeClient:
    """One shared ``httpx.AsyncClient`` per decode node, created in the app's lifespan."""

    def __init__(self, spec: DecodeNodeSpec, client: httpx.AsyncClient, control_timeout_s: float, secret: bytes):
        self.spec = spec
        self.client = client
        self._timeout = httpx.Timeout(control_timeout_s)
        self._headers = {"content-type": "application/json", "authorization": "Bearer " + auth.node_api_token(secret)}

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _post(self, path: str, body: c.ReserveRequest | c.ReleaseRequest) -> httpx.Response:
        return await self.client.post(path, content=c.dump(body), timeout=self._timeout, headers=self._headers)

    async def reserve(self, transfer_id: str, lease_s: float) -> int:
        """Reserve a slot; returns its number. Raises :class:`NodeFull` or :class:`NodeUnreachable`."""
        try:
            resp = await self._post("/v1/reserve", c.ReserveRequest(transfer_id, lease_s))
        except httpx.HTTPError as exc:
            raise NodeUnreachable(f"reserve failed: {type(exc).__name__}") from None
        if resp.status_code == 429:
            raise NodeFull(node_message(resp.content, "node full"))
        if resp.status_code != 200:
            raise NodeUnreachable(f"reserve answered HTTP {resp.status_code}: {node_message(resp.content, '')}")
        try:
            return c.parse(c.ReserveResponse, resp.content).slot
        except c.ContractError as exc:
            raise NodeUnreachable(f"reserve answered outside the contract: {exc}") from None

    async def release(self, transfer_id: str) -> bool:
        """Free the slot and cancel its decode if one runs; idempotent. Raises on transport errors."""
        resp = await self._post("/v1/release", c.ReleaseRequest(transfer_id))
        if resp.status_code != 200:
            raise NodeUnreachable(f"release answered HTTP {resp.status_code}: {node_message(resp.content, '')}")
        return c.parse(c.ReleaseResponse, resp.content).released

    async def health(self, timeout_s: float) -> HealthView:
        try:
            resp = await self.client.get("/health", timeout=httpx.Timeout(timeout_s))
        except httpx.HTTPError as exc:
            return HealthView(ok=False, error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if resp.status_code != 200:
            return HealthView(ok=False, error=f"health answered HTTP {resp.status_code}")
        try:
            health = c.parse(c.NodeHealth, resp.content, limit=1 << 20)
        except c.ContractError as exc:
            return HealthView(ok=False, error=f"health outside the contract: {exc}")
        if health.protocol_version != c.PROTOCOL_VERSION:
            return HealthView(ok=False, error=f"node speaks protocol v{health.protocol_version}")
        return HealthView(ok=True, slots_total=health.slots_total, slots_free=health.slots_free)

    @asynccontextmanager
    async def decode(self, body: c.DecodeRequest) -> AsyncIterator[AsyncIterator[c.TokenLine | c.ErrorLine]]:
        """Open the decode stream; yields its lines. Leaving the block closes it (the node then stops).

        A refusal (the node checks the request before streaming) raises :class:`RouterError` with the
        node's status for 4xx and 501, else 502."""
        request = self.client.build_request("POST", "/v1/decode", content=c.dump(body), headers=self._headers)
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise RouterError(502, f"decode node unreachable: {type(exc).__name__}", outcome="decode_error") from None
        try:
            if resp.status_code != 200:
                message = node_message(await resp.aread(), f"HTTP {resp.status_code}")
                status = resp.status_code if 400 <= resp.status_code < 500 or resp.status_code == 501 else 502
                raise RouterError(status, message, outcome="decode_refused")
            yield _lines(resp)
        finally:
            with anyio.move_on_after(2.0, shield=True):
                await resp.aclose()


async def _lines(resp: httpx.Response) -> AsyncIterator[c.TokenLine | c.ErrorLine]:
    try:
        async for line in resp.aiter_lines():
            if line.strip():
                yield c.parse_line(line)
    except c.ContractError as exc:
        raise RouterError(502, f"decode node sent a line outside the contract: {exc}", outcome="decode_error") from None
    except httpx.HTTPError as exc:
        raise RouterError(502, f"decode stream broke: {type(exc).__name__}", outcome="decode_error") from None
