"""The Starlette app: routes, lifespan (config, clients, background work) and the flow-running response."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tilert.logs import AccessLog, uvicorn_options
from tilert.router.config import RouterConfig, load_config_from_env
from tilert.router.context import RouterContext
from tilert.router.errors import RouterError, error_payload
from tilert.router.flow import RequestFlow
from tilert.router.metrics import RouterMetrics
from tilert.router.middleware import REQUEST_ID_SCOPE_KEY, BearerAuthMiddleware, RequestIdMiddleware
from tilert.router.openai_format import models_list
from tilert.router.output import SERVER_SEND
from tilert.router.prefill import relay
from tilert.router.routing import POOL_HEADER, choose_pool
from tilert.router.tools import prepare_chat
from tilert.router.validation import Route as ApiRoute
from tilert.router.validation import build_plan

log = structlog.get_logger("tilert.router")


class _Holder:
    """Where the lifespan puts the running context (config known only at start-up for the env app)."""

    def __init__(self, config: RouterConfig | None) -> None:
        self.config = config
        self.ctx: RouterContext | None = None

    def api_key(self) -> str | None:
        return self.ctx.config.api_key if self.ctx else (self.config.api_key if self.config else None)


def _ctx(request: Request) -> RouterContext:
    holder: _Holder = request.app.state.holder
    if holder.ctx is None:  # pragma: no cover - requests arrive only after start-up
        raise RuntimeError("router not started")
    return holder.ctx


def _json(data: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json", headers=headers)


def _error(exc: RouterError) -> Response:
    return Response(exc.json_body(), status_code=exc.status, media_type="application/json", headers=exc.headers)


class FlowResponse(Response):
    """Runs a :class:`RequestFlow` as the ASGI response, cancelling it when the client disconnects."""

    def __init__(self, flow: RequestFlow) -> None:
        self.flow = flow
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        flow = self.flow
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        if flow.response_done:
                            return  # the server reports disconnect once the response is complete
                        flow.client_gone = True
                        flow.log.info("client_disconnected", state=flow.state.value)
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            try:
                await flow.run(send, scope.get(SERVER_SEND))
            finally:
                tg.cancel_scope.cancel()


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes (read no further than that)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds {limit} bytes", outcome="bad_request")
        chunks.append(chunk)
    return b"".join(chunks)


async def _completion(request: Request, route: ApiRoute) -> Response:
    arrived = anyio.current_time()
    ctx = _ctx(request)
    rid: str = request.scope.get(REQUEST_ID_SCOPE_KEY, "")
    try:
        raw = await _body(request, ctx.config.max_body_bytes)
        plan = build_plan(
            route,
            raw,
            default_max_tokens=ctx.config.default_max_tokens,
            max_body_bytes=ctx.config.max_body_bytes,
            sampling_defaults=ctx.sampling_defaults,
        )
        plan = prepare_chat(plan, raw, ctx.parsers)  # tools and reasoning: what vLLM's parsers make of the request
        refusal = plan.fast_pool_refusal or ctx.pool.choices_refusal(plan.n)  # more choices than a node decodes
        choice = choose_pool(ctx.config, request.headers.get(POOL_HEADER), plan.body.get("model"), refusal)
        ctx.prefills.require(rid)  # no prefill instance to take it: 503 now, not after a wait for a decode slot
    except RouterError as exc:
        ctx.metrics.request_finished(
            route, exc.outcome, None, 0, 0, anyio.current_time() - arrived, None, None, pool="none"
        )
        log.info("request_refused", route=route, status=exc.status, reason=exc.log_reason())
        return _error(exc)
    return FlowResponse(RequestFlow(ctx, plan, rid, arrived, choice, raw))


async def chat_completions(request: Request) -> Response:
    return await _completion(request, "chat")


async def completions(request: Request) -> Response:
    return await _completion(request, "completions")


async def prefill_relay(request: Request) -> Response:
    """``POST /tokenize`` and ``/detokenize``: relayed to the prefill vLLM's same path, its answer and status
    returned as they are. Open without the API key, as vLLM's own are (it guards ``/v1`` alone): ``vllm bench
    serve`` probes them without one."""
    ctx = _ctx(request)
    rid: str = request.scope.get(REQUEST_ID_SCOPE_KEY, "")
    path = request.url.path
    try:
        raw = await _body(request, ctx.config.max_body_bytes)
        status, body = await ctx.prefills.call(
            lambda prefill: relay(prefill, path, raw, request_id=rid),
            request_id=rid,
            failure=lambda answer: f"HTTP {answer[0]}" if answer[0] >= 500 else None,
        )
    except RouterError as exc:
        log.warning("relay_failed", path=path, status=exc.status, reason=exc.log_reason())
        return _error(exc)
    return Response(body, status_code=status, media_type="application/json")


async def list_models(request: Request) -> Response:
    ctx = _ctx(request)
    return _json(models_list(ctx.config.model_name, ctx.started_at, ctx.config.model_dir))


async def health(request: Request) -> Response:
    """``ok``: every prefill instance (answering, its circuit breaker not open), every decode node and the native pool
    (if any) answer; ``degraded`` (still 200): a prefill instance and at least one pool (a decode node or the native
    instance) do; ``unavailable`` (503): nothing can be served. ``prefill`` lists each instance with its breaker
    state, requests in flight and requests sent."""
    ctx = _ctx(request)
    prefill: list[dict[str, object]] = []
    nodes: list[dict[str, object]] = []
    native: dict[str, object] = {}

    async def check_prefill() -> None:
        prefill.extend(await ctx.check_prefill())

    async def check_nodes() -> None:
        nodes.extend(await ctx.check_nodes())

    async def check_native() -> None:
        native.update(await ctx.check_native() or {})

    async with anyio.create_task_group() as tg:
        tg.start_soon(check_prefill)
        tg.start_soon(check_nodes)
        tg.start_soon(check_native)
    healthy = sum(1 for n in nodes if n["ok"])
    native_ok = bool(native.get("ok"))
    prefill_ok = [p["ok"] and p["state"] != "open" for p in prefill]
    ok = any(prefill_ok) and (healthy > 0 or native_ok)  # a prefill instance and some pool serve
    all_ok = ok and all(prefill_ok) and healthy == len(nodes) and (not native or native_ok)
    status = "ok" if all_ok else ("degraded" if ok else "unavailable")
    body = {
        "status": status,
        "prefill": prefill,
        "decode": nodes,
        "native": native or None,
        "default_pool": ctx.config.default_pool,
        "queue_depth": ctx.pool.queue_depth,
        "model": ctx.config.model_name,
    }
    return _json(body, status=200 if ok else 503)


async def _http_error(request: Request, exc: Exception) -> Response:
    """404, 405 and the like in OpenAI's error shape, as every other error of the router."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal router error"
    headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
    return Response(
        orjson.dumps(error_payload(status, str(detail))),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


async def metrics(request: Request) -> Response:
    metrics = _ctx(request).metrics
    return Response(metrics.render(), media_type=metrics.content_type)


def _freeze_startup_heap() -> None:
    """What start-up built (modules, the app, the tokenizer, vLLM's parsers) lives as long as the router: it is
    moved out of the garbage collector's generations (``gc.freeze``, as vLLM's server does), so that a full
    collection during a request walks what requests made, not the whole heap, and no request's first token waits
    for a walk of it."""
    gc.collect()
    gc.freeze()


def _lifespan(holder: _Holder, own_process: bool) -> Any:
    """The app's lifespan: the context started (``holder``'s config, else the environment's), its background work
    run while the app serves, everything closed on the way out."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            cfg = holder.config if holder.config is not None else load_config_from_env()
            holder.ctx = await RouterContext.start(cfg, RouterMetrics(cfg.model_name))
        except Exception as exc:
            log.error("router_startup_refused", reason=str(exc))
            raise RuntimeError(f"tilert router refused to start: {exc}") from exc
        if own_process:
            _freeze_startup_heap()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(holder.ctx.run)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            await holder.ctx.aclose()
            log.info("router_stopped")

    return lifespan


class _RouterApp(Starlette):
    """The router's Starlette app, keeping the server's own ``send`` in each request's scope (:data:`SERVER_SEND`:
    what a response's body goes through once its head went through the middleware, :mod:`tilert.router.output`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(config: RouterConfig | None = None, *, own_process: bool = False) -> Starlette:
    """The router app. Without ``config`` it is read at start-up from ``$TILERT_ROUTER_CONFIG``.

    A given ``config`` is validated now, so a caller (the CLI) gets :class:`ConfigError` before serving.
    ``own_process``: the process serves this router alone (``tilert router``, ``uvicorn tilert.router:app``): what
    its start-up built is then frozen out of the garbage collector (:func:`_freeze_startup_heap`).
    """
    if config is not None:
        config.validate()
    holder = _Holder(config)
    app = _RouterApp(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/tokenize", prefill_relay, methods=["POST"]),
            Route("/detokenize", prefill_relay, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[
            Middleware(RequestIdMiddleware),
            Middleware(AccessLog),  # inside the request id's binding: its line carries the id
            Middleware(BearerAuthMiddleware, api_key=holder.api_key),
        ],
        lifespan=_lifespan(holder, own_process),
        exception_handlers={HTTPException: _http_error, Exception: _http_error},
    )
    app.state.holder = holder
    return app


def serve(config: RouterConfig, **uvicorn_kwargs: Any) -> None:
    """Run the router with uvicorn on ``config.host:config.port`` (blocking)."""
    import uvicorn

    uvicorn.run(
        build_app(config, own_process=True),
        host=config.host,
        port=config.port,
        **{**uvicorn_options(), **uvicorn_kwargs},
    )


__all__ = ["FlowResponse", "build_app", "serve"]
