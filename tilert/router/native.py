"""The native pool's leg of a request: vLLM's own P/D request flow, relayed by the router.

1. Prefill on the shared stock vLLM (``max_tokens=1``, not streamed) with the native pool plugin's
   ``kv_transfer_params`` (vLLM's built-in P/D connector, a child of the prefill's ``MultiConnector``);
   the TileRT connector leaves such a request alone.
2. The prefill's answer carries the handoff (:class:`~tilert.contracts.NativeHandoff`); with none (the first
   token already ended the request: EOS or a stop) the router answers from the prefill, as for the TileRT pool.
3. The client's own request, plus the handoff, goes to the native vLLM decode instance, which pulls the KV and
   decodes. Its answer is relayed event by event (SSE) or whole (JSON), byte for byte; the router adds what
   it adds on every pool: the ``x-tilert-pool`` header, timeouts (first event within ``transfer_timeout_s``,
   then at most ``decode_idle_timeout_s`` between events), and a terminal ``data: {"error": ...}`` event and
   ``[DONE]`` when the decode instance fails or vanishes mid-stream.

The router always asks the decode instance for the usage chunk (its token counts feed the metrics) and drops
it when the client did not ask for it.

The request's state machine is the flow's (:mod:`tilert.router.flow`): it calls :func:`available_pool`,
:func:`native_prefill` and :func:`native_decode` in turn, and they report the request's token counts, finish
reason and first token through :class:`NativeRequest`. The pool itself is reached only through the
:class:`~tilert.engines.plugin.NativePool` contract of the plugin the router was configured with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import anyio
import orjson

from tilert.contracts import ContractError, NativeHandoff
from tilert.engines.plugin import NativePool
from tilert.router.context import RouterContext
from tilert.router.errors import RouterError, upstream_message
from tilert.router.openai_format import DONE
from tilert.router.output import SSE_HEADERS, ClientOutput
from tilert.router.prefill import PrefillResult, post_prefill, prefill_result
from tilert.router.validation import RequestPlan

__all__ = ["NativeRequest", "available_pool", "native_decode", "native_prefill"]


class NativeRequest(Protocol):
    """What the native leg reads of a request, and what it reports back for the request's accounting."""

    plan: RequestPlan
    request_id: str
    client_body: bytes  # as the client sent it: the decode instance gets it
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    outcome: str

    def first_token(self) -> None:
        """The first token reached the client (time to first token)."""


async def available_pool(ctx: RouterContext) -> type[NativePool]:
    """The native pool's plugin, or 503 before any prefill when the pool is missing or down."""
    if ctx.native_plugin is None or ctx.native is None:
        raise RouterError(503, "this router has no native decode pool", outcome="no_native_pool")
    if not ctx.native_healthy and not (await ctx.check_native() or {}).get("ok"):
        # Refused before the prefill: blocks kept for a decode that cannot come would wait out vLLM's lease.
        raise RouterError(
            503,
            "the native decode pool is unavailable",
            outcome="native_unreachable",
            headers={"Retry-After": str(max(1, ctx.config.retry_after_s))},
        )
    return ctx.native_plugin


async def native_prefill(
    ctx: RouterContext, req: NativeRequest, plugin: type[NativePool]
) -> NativeHandoff | PrefillResult:
    """Step 1: the prefill, keeping the KV for the pool. Its handoff, or (none: the prefill's one token already
    ended the request) the prefill's result to answer from."""
    t0 = anyio.current_time()
    data = await ctx.prefills.call(
        lambda prefill: post_prefill(prefill, req.plan, plugin.prefill_params(), request_id=req.request_id),
        key=ctx.prefills.key(req.plan.body),
        request_id=req.request_id,
    )
    ctx.metrics.prefill(anyio.current_time() - t0)
    handoff = _handoff(plugin, data)
    if handoff is not None:
        return handoff
    pre = prefill_result(data, req.plan, None)
    if pre.finish_reason == "length":
        raise RouterError(
            502,
            "the prefill returned no native handoff: its --kv-transfer-config has no "
            f"{plugin.connector} (MultiConnector beside TileRTConnector)",
            outcome="prefill_error",
        )
    return pre


async def native_decode(
    ctx: RouterContext, req: NativeRequest, plugin: type[NativePool], handoff: NativeHandoff, out: ClientOutput
) -> None:
    """Step 3: the client's request with the handoff to the decode instance, its answer relayed to ``out``."""
    resp = await _post_decode(ctx, req, _decode_body(req, plugin, handoff))
    async with resp:
        if not req.plan.stream:
            raw = await _read(resp, ctx.config.prefill_timeout_s)
            _account_json(req, raw)
            req.first_token()
            await out.json(200, raw)
        else:
            await out.start(200, list(SSE_HEADERS))
            await _relay(ctx, req, out, resp)


async def _post_decode(ctx: RouterContext, req: NativeRequest, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """The decode request to the native instance; its 200 response (not read yet), else a RouterError."""
    cfg, plan, session = ctx.config, req.plan, ctx.native
    assert session is not None
    headers = {"content-type": "application/json", "x-request-id": req.request_id}
    try:
        with anyio.fail_after(cfg.transfer_timeout_s if plan.stream else cfg.prefill_timeout_s):
            resp = await session.post(plan.path, data=orjson.dumps(body), headers=headers)
    except TimeoutError:
        raise RouterError(504, "native decode instance did not answer in time", outcome="decode_timeout") from None
    except aiohttp.ClientConnectorError as exc:
        raise RouterError(
            503,
            f"native decode instance unreachable: {type(exc).__name__}",
            outcome="native_unreachable",
            headers={"Retry-After": "1"},
        ) from None
    except aiohttp.ClientError as exc:
        raise RouterError(502, f"native decode instance failed: {type(exc).__name__}", outcome="decode_error") from None
    if resp.status == 200:
        return resp
    async with resp:
        raw = await _read(resp, cfg.decode_idle_timeout_s)
    if 400 <= resp.status < 500:
        raise RouterError(
            resp.status,
            upstream_message(raw, f"native decode refused with {resp.status}"),
            outcome="decode_rejected",
            upstream=True,
        )
    raise RouterError(502, f"native decode failed with HTTP {resp.status}", outcome="decode_error")


def _handoff(plugin: type[NativePool], data: dict[str, Any]) -> NativeHandoff | None:
    params = data.get("kv_transfer_params")
    try:
        return plugin.handoff(params if isinstance(params, dict) else None)
    except ContractError as exc:
        raise RouterError(
            502, f"prefill answered a native handoff outside the contract: {exc}", outcome="prefill_error"
        ) from None


def _decode_body(req: NativeRequest, plugin: type[NativePool], handoff: NativeHandoff) -> dict[str, Any]:
    """The client's request as it sent it, plus the handoff (and the usage chunk the router counts with)."""
    body: dict[str, Any] = orjson.loads(req.client_body)
    body["kv_transfer_params"] = plugin.decode_params(handoff)
    if req.plan.stream:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return body


async def _read(resp: aiohttp.ClientResponse, timeout_s: float) -> bytes:
    try:
        with anyio.fail_after(timeout_s):
            return await resp.read()
    except TimeoutError:
        raise RouterError(504, "native decode instance sent nothing in time", outcome="decode_timeout") from None
    except aiohttp.ClientError as exc:
        raise RouterError(502, f"native decode instance failed: {type(exc).__name__}", outcome="decode_error") from None


def _account_json(req: NativeRequest, raw: bytes) -> None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise RouterError(502, "native decode returned a body that is not JSON", outcome="decode_error") from None
    _take_usage(req, data.get("usage") if isinstance(data, dict) else None)
    choices = data.get("choices") if isinstance(data, dict) else None
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        req.finish_reason = choices[0].get("finish_reason")


def _take_usage(req: NativeRequest, usage: Any) -> None:
    if isinstance(usage, dict):
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and isinstance(completion, int):
            req.prompt_tokens, req.completion_tokens = prompt, completion


async def _relay(ctx: RouterContext, req: NativeRequest, out: ClientOutput, resp: aiohttp.ClientResponse) -> None:
    """vLLM's SSE events to the client as they come; a stream that breaks off ends in an error event."""
    plan, cfg = req.plan, ctx.config
    first = True
    try:
        async for data in _events(resp, cfg.transfer_timeout_s, cfg.decode_idle_timeout_s):
            if data == b"[DONE]":
                await out.body(DONE, more=False)
                return
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                raise RouterError(502, "native decode sent an event that is not JSON", outcome="decode_error") from None
            if not isinstance(obj, dict):
                raise RouterError(502, "native decode sent an event that is not an object", outcome="decode_error")
            if "error" in obj and not obj.get("choices"):
                req.outcome = "decode_error"
            _take_usage(req, obj.get("usage"))
            choices = obj.get("choices")
            if choices == [] and "usage" in obj and not plan.include_usage:
                continue  # the usage chunk the router asked for itself
            for choice in choices if isinstance(choices, list) else []:
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    req.finish_reason = choice["finish_reason"]
            if first:
                first = False
                req.first_token()
            await out.body(b"data: " + data + b"\n\n")
    except aiohttp.ClientError as exc:
        raise RouterError(
            502, f"native decode instance failed mid-stream: {type(exc).__name__}", outcome="decode_error"
        ) from None
    raise RouterError(502, "native decode stream ended without [DONE]", outcome="decode_error")


async def _events(resp: aiohttp.ClientResponse, first_s: float, idle_s: float) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of an SSE stream; the first within ``first_s``, each next within ``idle_s``."""
    limit = first_s
    while True:
        try:
            with anyio.fail_after(limit):
                line = await resp.content.readline()
        except TimeoutError:
            raise RouterError(504, f"native decode sent nothing for {limit:g} s", outcome="decode_timeout") from None
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            limit = idle_s
            yield line[5:].strip()
