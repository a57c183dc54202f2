"""HTTP client of one decode node, speaking the node API of ``tilert.contracts``: reserve, release,
health, the NDJSON decode stream and the watch stream (``router.watch``). Every call carries the node API
token derived from the deployment's secret.

aiohttp rather than httpx here: these calls sit on every request's path (reserve, release) and an aiohttp call
costs a fraction of an httpx call on loopback (client and server together). The decode stream, on every token's
path, is read by :mod:`tilert.router.decode_stream` (httptools on a plain asyncio protocol), cheaper again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from tilert import auth
from tilert import contracts as c
from tilert.router.config import DecodeNodeSpec
from tilert.router.decode_stream import DECODE_LOST, HIGH_WATER, DecodeLines
from tilert.router.errors import RouterError
from tilert.router.http1 import Connections, Http1Connection, StreamBroke

_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)
# A kept-alive connection the server closed while it sat in the pool: the request never got an answer.
_STALE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientConnectionResetError)


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
    max_choices: int | None = None
    timed_out: bool = False  # no answer within the probe's timeout: inconclusive (a busy node, or a busy router)


def node_message(body: bytes, fallback: str) -> str:
    """The message of a node's ``ErrorBody`` (the node never puts transfer ids in them)."""
    try:
        return c.parse(c.ErrorBody, body).error.message
    except c.ContractError:
        return fallback


def _session(spec: DecodeNodeSpec, connect_timeout_s: float) -> aiohttp.ClientSession:
    # No cap on connections: the pool gate bounds decode streams (a capped pool is how PD proxies starve).
    # Idle connections are dropped well before the node's own keep-alive ends (a retry covers the rest).
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=c.NODE_KEEPALIVE_S / 2)
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s)
    return aiohttp.ClientSession(spec.base_url, connector=connector, timeout=timeout, auto_decompress=False)


class NodeClient:
    """One shared ``aiohttp.ClientSession`` per decode node, created in the app's lifespan."""

    def __init__(
        self,
        spec: DecodeNodeSpec,
        connect_timeout_s: float,
        control_timeout_s: float,
        secret: bytes,
        lease_s: float | None = None,
    ) -> None:
        """``lease_s``: the lease this router asks with every reserve (a node granting less is unhealthy)."""
        self.spec = spec
        self.lease_s = lease_s
        self.session = _session(spec, connect_timeout_s)
        self._timeout = aiohttp.ClientTimeout(total=control_timeout_s)
        self._headers = {"content-type": "application/json", "authorization": "Bearer " + auth.node_api_token(secret)}
        self.streams = Connections(
            spec.base_url, self._headers, connect_timeout_s, idle_s=c.NODE_KEEPALIVE_S / 2, high_water=HIGH_WATER
        )

    async def aclose(self) -> None:
        self.streams.close()
        await self.session.close()

    async def _post(self, path: str, body: c.ReserveRequest | c.ReleaseRequest) -> tuple[int, bytes]:
        """POST an idempotent call; once more on a fresh connection if a kept-alive one turned out dead (the
        node closed it while idle: the request may or may not have reached it, and repeating it is safe)."""
        try:
            return await self._post_once(path, body)
        except _STALE:
            return await self._post_once(path, body)

    async def _post_once(self, path: str, body: c.ReserveRequest | c.ReleaseRequest) -> tuple[int, bytes]:
        async with self.session.post(path, data=c.dump(body), headers=self._headers, timeout=self._timeout) as resp:
            return resp.status, await resp.read()

    async def reserve(self, transfer_id: str, lease_s: float, sampling: c.Sampling | None = None) -> c.ReserveResponse:
        """Reserve a slot, the node checking ``sampling`` first. Raises :class:`NodeFull`,
        :class:`NodeUnreachable`, or :class:`RouterError` (4xx/501) when the node refuses the sampling."""
        try:
            status, body = await self._post("/v1/reserve", c.ReserveRequest(transfer_id, lease_s, sampling))
        except _FAILURES as exc:
            raise NodeUnreachable(f"reserve failed: {type(exc).__name__}") from None
        if status == 429:
            raise NodeFull(node_message(body, "node full"))
        if status in (422, 501):  # the client's sampling, wrong for this model (a 400 is the router's fault)
            refused = 400 if status == 422 else status
            raise RouterError(refused, node_message(body, f"HTTP {status}"), outcome="decode_refused")
        if status != 200:
            raise NodeUnreachable(f"reserve answered HTTP {status}: {node_message(body, '')}")
        try:
            return c.parse(c.ReserveResponse, body)
        except c.ContractError as exc:
            raise NodeUnreachable(f"reserve answered outside the contract: {exc}") from None

    async def release(self, transfer_id: str) -> bool:
        """Free the slot and cancel its decode if one runs; idempotent. Raises on transport errors."""
        try:
            status, body = await self._post("/v1/release", c.ReleaseRequest(transfer_id))
        except _FAILURES as exc:
            raise NodeUnreachable(f"release failed: {type(exc).__name__}") from None
        if status != 200:
            raise NodeUnreachable(f"release answered HTTP {status}: {node_message(body, '')}")
        return c.parse(c.ReleaseResponse, body).released

    async def health(self, timeout_s: float) -> HealthView:
        try:
            async with self.session.get("/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                status, body = resp.status, await resp.read()
        except _FAILURES as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return HealthView(ok=False, error=error, timed_out=isinstance(exc, asyncio.TimeoutError))
        if status != 200:
            return HealthView(ok=False, error=f"health answered HTTP {status}")
        try:
            health = c.parse(c.NodeHealth, body, limit=1 << 20)
        except c.ContractError as exc:
            return HealthView(ok=False, error=f"health outside the contract: {exc}")
        if health.protocol_version != c.PROTOCOL_VERSION:
            return HealthView(ok=False, error=f"node speaks protocol v{health.protocol_version}")
        if self.lease_s is not None and health.max_lease_s is not None and health.max_lease_s < self.lease_s:
            return HealthView(
                ok=False,
                error=(
                    f"the node grants leases of at most {health.max_lease_s:g} s, this router asks {self.lease_s:g} s "
                    "(raise the node's --max-lease-s or lower the router's reserve_lease_s)"
                ),
            )
        return HealthView(
            ok=True, slots_total=health.slots_total, slots_free=health.slots_free, max_choices=health.max_choices
        )

    @asynccontextmanager
    async def watch(self, silence_s: float) -> AsyncIterator[AsyncIterator[c.NodeBeat | c.TransferFailed]]:
        """Open the node's watch stream; yields its lines. :class:`NodeUnreachable` when it cannot be opened,
        or when it breaks or stays silent ``silence_s``; the iteration ends when the node closes it."""
        timeout = aiohttp.ClientTimeout(total=None, sock_read=silence_s)
        try:
            resp = await self.session.get("/v1/watch", headers=self._headers, timeout=timeout)
        except _FAILURES as exc:
            raise NodeUnreachable(f"watch failed: {type(exc).__name__}") from None
        try:
            if resp.status != 200:
                raise NodeUnreachable(f"watch answered HTTP {resp.status}: {node_message(await resp.read(), '')}")
            yield _watch_lines(resp, silence_s)
        finally:
            resp.close()

    @asynccontextmanager
    async def decode(self, body: c.DecodeRequest) -> AsyncIterator[AsyncIterator[c.TokenLine | c.ErrorLine]]:
        """Open the decode stream; yields its lines. Leaving the block closes it (the node then stops).

        A refusal (the node checks the request before streaming) raises :class:`RouterError` with the
        node's status for 4xx and 501, else 502."""
        try:
            conn = await self.streams.post("/v1/decode", c.dump(body))
        except (OSError, TimeoutError, StreamBroke) as exc:
            raise RouterError(502, f"decode node unreachable: {type(exc).__name__}", outcome=DECODE_LOST) from None
        try:
            if conn.status != 200:
                message = node_message(await _refusal(conn), f"HTTP {conn.status}")
                refused = conn.status if 400 <= conn.status < 500 or conn.status == 501 else 502
                raise RouterError(refused, message, outcome="decode_refused")
            yield DecodeLines(conn)
        finally:
            self.streams.finish(conn)  # read to its end: kept for the next stream; else closed (the node stops)


async def _refusal(conn: Http1Connection) -> bytes:
    try:
        return await conn.read_all()
    except StreamBroke:
        return b""


async def _watch_lines(resp: aiohttp.ClientResponse, silence_s: float) -> AsyncIterator[c.NodeBeat | c.TransferFailed]:
    try:
        while line := await resp.content.readline():
            yield c.parse_watch_line(line)
    except c.ContractError as exc:
        raise NodeUnreachable(f"watch sent a line outside the contract: {exc}") from None
    except TimeoutError:
        raise NodeUnreachable(f"watch silent for {silence_s:g} s") from None
    except _FAILURES as exc:
        raise NodeUnreachable(f"watch broke: {type(exc).__name__}") from None
