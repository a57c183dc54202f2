"""The prefill leg: one non-streaming ``max_tokens=1`` request to stock vLLM, carrying the TileRT claim."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from tilert.contracts import Claim, ClaimResult, ContractError
from tilert.router.errors import RouterError, upstream_message
from tilert.router.http1 import Connections, ConnectTimeout, StreamBroke, header_lines
from tilert.router.validation import RequestPlan


@dataclass
class PrefillResult:
    """What the router needs from vLLM's answer."""

    raw: dict[str, Any]
    response_id: str
    created: int
    model: str
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    first_token_id: int
    prompt_tokens: int
    prompt_token_ids: list[int] | None


DEFAULT_BUSY_RETRY_AFTER_S = 1


def _fail(message: str) -> RouterError:
    return RouterError(502, message, outcome="prefill_error")


class InstanceFailed(RouterError):
    """The prefill instance itself failed the call: unreachable, HTTP 5xx, or no answer in time. Its circuit breaker
    counts it (:mod:`tilert.router.prefill_pool`); ``retry``: nothing of the call can have reached the instance's
    connector in a way that outlives it, so the call may run again on another instance (a timeout may not: the
    instance may still be working on it)."""

    def __init__(self, status: int, message: str, *, outcome: str, retry: bool) -> None:
        super().__init__(status, message, outcome=outcome)
        self.retry = retry


def _unreachable(what: str, exc: Exception) -> InstanceFailed:
    return InstanceFailed(502, f"{what}: {type(exc).__name__}", outcome="prefill_error", retry=True)


# vLLM's server closes a kept-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default) idle. The router
# drops its own sooner, so that it never sends a request down a connection the server is closing: a prefill cannot
# simply be sent again (it may have run, and handed its KV off).
VLLM_KEEPALIVE_S = 4.0


def _auth(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


def vllm_session(base_url: str, timeout: aiohttp.ClientTimeout, api_key: str | None) -> aiohttp.ClientSession:
    """A client of a vLLM server (aiohttp, as for the decode nodes), sending ``api_key`` with every call. No cap on
    connections: concurrency is vLLM's to schedule."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=VLLM_KEEPALIVE_S)
    return aiohttp.ClientSession(base_url, connector=connector, timeout=timeout, headers=_auth(api_key))


@dataclass(eq=False)
class PrefillClient:
    """The router's clients of one prefill vLLM: the prefill POST, on every request's path, on kept-alive HTTP/1.1
    connections of :mod:`tilert.router.http1` (``posts``); health checks and the relayed calls (``/tokenize``) on
    aiohttp (``session``). ``timeout_s``: a prefill's whole call, connecting included."""

    session: aiohttp.ClientSession
    posts: Connections
    timeout_s: float

    async def aclose(self) -> None:
        self.posts.close()
        await self.session.close()


_ANSWER_HIGH_WATER = 1 << 20  # a prefill answer's bytes read before the reader takes them (it takes them at once)


def prefill_client(base_url: str, timeout_s: float, connect_timeout_s: float, api_key: str | None) -> PrefillClient:
    """The router's clients of the prefill vLLM at ``base_url``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
    fixed = {"content-type": "application/json"} | _auth(api_key)
    posts = Connections(base_url, fixed, connect_timeout_s, idle_s=VLLM_KEEPALIVE_S, high_water=_ANSWER_HIGH_WATER)
    return PrefillClient(vllm_session(base_url, timeout, api_key), posts, timeout_s)


async def post_prefill(
    client: PrefillClient,
    plan: RequestPlan,
    kv_transfer_params: dict[str, Any],
    *,
    request_id: str,
) -> dict[str, Any]:
    """POST the ``max_tokens=1`` prefill carrying ``kv_transfer_params``; vLLM's JSON answer.

    vLLM's 4xx reach the client as they are, 5xx and transport errors are 502/504."""
    request = orjson.dumps(plan.prefill_body(kv_transfer_params))
    try:
        async with asyncio.timeout(client.timeout_s):
            status, body = await client.posts.call(plan.path, request, header_lines({"x-request-id": request_id}))
    except ConnectTimeout as exc:  # never connected: nothing was sent
        raise _unreachable("prefill server unreachable", exc) from None
    except TimeoutError:
        raise InstanceFailed(504, "prefill timed out", outcome="prefill_timeout", retry=False) from None
    except (OSError, StreamBroke) as exc:
        raise _unreachable("prefill server unreachable", exc) from None
    if 400 <= status < 500:
        message = upstream_message(body, f"prefill rejected the request with HTTP {status}")
        raise RouterError(
            status,
            message,
            outcome="prefill_rejected",
            body=body if _is_json_object(body) else None,
            upstream=True,
        )
    if status >= 500:
        raise InstanceFailed(502, f"prefill failed with HTTP {status}", outcome="prefill_error", retry=True)
    if status != 200:
        raise _fail(f"prefill failed with HTTP {status}")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _fail("prefill returned a body that is not JSON") from None
    if not isinstance(data, dict):
        raise _fail("prefill returned a JSON value that is not an object")
    return data


async def relay(client: PrefillClient, path: str, body: bytes, *, request_id: str) -> tuple[int, bytes]:
    """POST ``body`` as it is to the prefill vLLM's ``path`` (``/tokenize``, ``/detokenize``): vLLM's status and
    body, whatever they are; a timeout is 504, an unreachable server 502 (:class:`InstanceFailed` both)."""
    try:
        async with client.session.post(path, data=body, headers=_headers(request_id)) as resp:
            return resp.status, await resp.read()
    except aiohttp.ConnectionTimeoutError as exc:
        raise _unreachable(f"prefill server unreachable for {path}", exc) from None
    except TimeoutError:
        message = f"prefill server timed out on {path}"
        raise InstanceFailed(504, message, outcome="prefill_timeout", retry=False) from None
    except aiohttp.ClientError as exc:
        raise _unreachable(f"prefill server unreachable for {path}", exc) from None


def _headers(request_id: str) -> dict[str, str]:
    return {"content-type": "application/json", "x-request-id": request_id}


async def run_prefill(client: PrefillClient, plan: RequestPlan, claim: Claim, *, request_id: str) -> PrefillResult:
    """The TileRT pool's prefill: :func:`post_prefill` with the claim, the connector's answer checked."""
    data = await post_prefill(client, plan, claim.to_params(), request_id=request_id)
    return parse_prefill_response(data, plan, claim.transfer_id)


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


def _claim_result(data: dict[str, Any], transfer_id: str) -> ClaimResult:
    """The connector's answer inside vLLM's response, checked against the contract and this request."""
    try:
        kv = ClaimResult.from_params(data.get("kv_transfer_params"))
    except ContractError as exc:
        raise _fail(f"prefill answered kv_transfer_params outside the contract: {exc}") from None
    if kv is not None and kv.busy:
        # Transient: the prefill node had no staging room. Nothing has been sent to the client yet, and the
        # lease (the decode slot) is released on the way out, so the client may simply retry.
        retry_after = kv.retry_after_s if kv.retry_after_s is not None else DEFAULT_BUSY_RETRY_AFTER_S
        raise RouterError(
            503,
            "the prefill node is busy handing off other requests' KV; retry shortly",
            outcome="prefill_busy",
            headers={"Retry-After": str(max(1, retry_after))},
        )
    if kv is not None and kv.error:
        raise _fail(f"the TileRT connector refused the claim: {kv.error}")
    if kv is None or kv.first_token_id is None:
        raise _fail(
            "prefill response has no TileRT kv_transfer_params: the TileRT connector is not loaded in vLLM, "
            "does not share this router's secret, or did not claim the request (check --kv-transfer-config)"
        )
    if kv.transfer_id not in (None, transfer_id):
        raise _fail("prefill answered for another transfer")
    return kv


def _choice(data: dict[str, Any], route: str) -> tuple[dict[str, Any], str]:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail("prefill response has no choices")
    choice = choices[0]
    message = choice.get("message") if route == "chat" else None
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return choice, text if isinstance(text, str) else ""


def parse_prefill_response(data: Any, plan: RequestPlan, transfer_id: str) -> PrefillResult:
    if not isinstance(data, dict):
        raise _fail("prefill returned a JSON value that is not an object")
    kv = _claim_result(data, transfer_id)
    assert kv.first_token_id is not None
    return prefill_result(data, plan, kv.first_token_id, kv.prompt_tokens)


def prefill_result(
    data: dict[str, Any], plan: RequestPlan, first: int | None, prompt_tokens: int | None = None
) -> PrefillResult:
    """vLLM's one-token answer as a :class:`PrefillResult`; ``first`` (the sampled token id, as the connector
    reported it) defaults to the answer's own ``token_ids[0]`` (the prefill asks for token ids)."""
    choice, text = _choice(data, plan.route)
    usage_raw = data.get("usage")
    usage: dict[str, Any] = usage_raw if isinstance(usage_raw, dict) else {}
    if prompt_tokens is None:
        prompt_tokens = usage.get("prompt_tokens")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        raise _fail("prefill response carries no prompt token count")
    token_ids = choice.get("token_ids")
    if first is None:
        if not (isinstance(token_ids, list) and token_ids and isinstance(token_ids[0], int)):
            raise _fail("prefill response carries no token_ids")
        first = token_ids[0]
    if isinstance(token_ids, list) and token_ids and token_ids[0] != first:
        raise _fail(f"prefill token_ids[0]={token_ids[0]} disagrees with tilert_first_token_id={first}")
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", None):
        raise _fail(f"prefill ended with finish_reason={finish!r}")
    return PrefillResult(
        raw=data,
        response_id=str(data.get("id") or ""),
        created=int(data.get("created") or 0),
        model=str(data.get("model") or ""),
        text=text,
        finish_reason=finish,
        stop_reason=choice.get("stop_reason"),
        first_token_id=first,
        prompt_tokens=prompt_tokens,
        prompt_token_ids=prompt_ids if isinstance(prompt_ids, list) else None,
    )
