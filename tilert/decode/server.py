"""The decode node: a control port for the prefill-side senders and an HTTP port for the router.

HTTP API (JSON bodies; errors are ``{"error": {"message", "code"}}`` with a 4xx/5xx status):

- ``POST /v1/reserve {"transfer_id", "lease_s"?}`` -> ``{"transfer_id", "slot"}``; 429 when full.
- ``POST /v1/release {"transfer_id"}`` -> ``{"released": bool}`` (idempotent).
- ``POST /v1/decode {"transfer_id", "first_token_id", "prompt_tokens", "max_tokens", "temperature",
  "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos"}`` -> 200 ``application/x-ndjson``: one
  ``{"token_ids": [...]}`` line per step as it is produced, then ``{"finish_reason": ...}`` or
  ``{"error": {...}}``. Waits for the transfer first (an abort from prefill fails it at once).
  Closing the stream cancels the decode.
- ``POST /v1/cancel {"transfer_id"}``; ``GET /health``.

Decodes run one at a time on the engine; with several slots, the next request's transfer lands while
the current one decodes.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import structlog
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tilert.decode.control import ControlServer
from tilert.decode.generate import run_decode
from tilert.decode.sampling import DecodeParams
from tilert.decode.slots import SlotError, SlotTable
from tilert.engines.base import DecodeEngine
from tilert.models.checkpoint import eos_token_ids, sampling_defaults
from tilert.plugins import load_engine, load_transport

log = structlog.get_logger("tilert.decode.server")


@dataclass(frozen=True)
class DecodeConfig:
    model: Path
    engine: str = "tilert"
    transport: str = "tcp"
    transport_options: dict[str, Any] | None = None
    host: str = "127.0.0.1"
    ctrl_port: int = 5556
    http_port: int = 5557
    device: str = "auto"
    dtype: str = "auto"
    max_seq_len: int = 4096
    num_slots: int = 2
    lease_s: float = 30.0
    transfer_timeout_s: float = 15.0
    num_speculative_tokens: int = 1


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {device} asked for, but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise SystemExit(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype!r}") from None


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise SlotError(f"invalid JSON: {exc}", 400) from exc
    if not isinstance(body, dict):
        raise SlotError("body must be a JSON object", 400)
    return body


def _transfer_id(body: dict[str, Any]) -> str:
    tid = body.get("transfer_id")
    if not isinstance(tid, str) or not tid:
        raise SlotError("transfer_id must be a non-empty string", 400)
    return tid


class DecodeNode:
    """Everything one decode node holds: the engine, the slots, the transport receiver."""

    def __init__(self, config: DecodeConfig, engine: DecodeEngine) -> None:
        self.config = config
        self.engine = engine
        self.node_id = f"decode-{uuid.uuid4().hex[:8]}"
        self.receiver = load_transport(config.transport).receiver(
            host=config.host, options=dict(config.transport_options or {})
        )
        self.table = SlotTable(
            config.num_slots, engine.expected_layouts(), config.max_seq_len, self.receiver, config.lease_s,
            engine.check_layouts,
        )  # fmt: skip
        self.control = ControlServer(self.table, config.transport, self.node_id)
        self.eos = eos_token_ids(config.model)
        self.sampling_defaults = sampling_defaults(config.model)
        self.engine_lock = anyio.Lock()
        self.decodes_completed = 0
        self.app = Starlette(
            routes=[
                Route("/v1/reserve", self.reserve, methods=["POST"]),
                Route("/v1/release", self.release, methods=["POST"]),
                Route("/v1/cancel", self.cancel, methods=["POST"]),
                Route("/v1/decode", self.decode, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    # ---- HTTP handlers ----------------------------------------------------------------------

    async def reserve(self, request: Request) -> Response:
        try:
            body = await _json(request)
            tid = _transfer_id(body)
            lease = body.get("lease_s")
            if lease is not None and (not isinstance(lease, (int, float)) or not 0 < lease <= 600):
                raise SlotError("lease_s must be a number in (0, 600]", 400)
            slot = self.table.reserve(tid, lease)
        except SlotError as exc:
            resp = _error(str(exc), exc.status)
            if exc.status == 429:
                resp.headers["Retry-After"] = "1"
            return resp
        return JSONResponse({"transfer_id": tid, "slot": slot.index})

    async def release(self, request: Request) -> Response:
        try:
            tid = _transfer_id(await _json(request))
        except SlotError as exc:
            return _error(str(exc), exc.status)
        return JSONResponse({"released": self.table.release(tid, "released by router")})

    async def cancel(self, request: Request) -> Response:
        try:
            tid = _transfer_id(await _json(request))
        except SlotError as exc:
            return _error(str(exc), exc.status)
        return JSONResponse({"cancelled": self.table.release(tid, "cancelled")})

    async def health(self, request: Request) -> Response:
        caps = self.engine.capabilities()
        return JSONResponse(
            {
                "status": "ok",
                "node_id": self.node_id,
                "engine": self.engine.name,
                "model": str(self.config.model),
                "transport": self.config.transport,
                "ctrl_port": self.config.ctrl_port,
                "slots_total": len(self.table.slots),
                "slots_free": self.table.free,
                "transfers_received": self.table.transfers_received,
                "decodes_completed": self.decodes_completed,
                "capabilities": {k: v for k, v in vars(caps).items() if k != "notes"},
            }
        )

    async def decode(self, request: Request) -> Response:
        try:
            params = DecodeParams.parse(await _json(request), self.engine.vocab_size, self.sampling_defaults)
            self.table.hold(params.transfer_id)  # queued behind a running decode, it must not expire
        except SlotError as exc:
            return _error(str(exc), exc.status)
        except ValueError as exc:
            return _error(str(exc), 400)
        unsupported = params.unsupported(self.engine.capabilities())
        if unsupported:
            self.table.release(params.transfer_id, "refused")
            return _error(f"the {self.engine.name} engine cannot honour {unsupported}", 501)
        if params.prompt_tokens + 1 + params.max_tokens > self.config.max_seq_len:
            self.table.release(params.transfer_id, "refused")
            return _error(
                f"prompt ({params.prompt_tokens}) + max_tokens exceeds the decode node's max_seq_len "
                f"{self.config.max_seq_len}",
                400,
            )
        return StreamingResponse(self._stream(params), media_type="application/x-ndjson")

    # ---- the decode stream ------------------------------------------------------------------

    async def _stream(self, params: DecodeParams) -> AsyncIterator[bytes]:
        tid = params.transfer_id
        bound = log.bind(transfer_id=tid)
        try:
            slot = await self.table.wait_ready(tid, self.config.transfer_timeout_s)
            async with self.engine_lock:
                slot = self.table.start_decode(tid)
                state, layouts, num_tokens = slot.tensors()
                if num_tokens != params.prompt_tokens:
                    raise SlotError(
                        f"prefill sent {num_tokens} prompt tokens, the router says {params.prompt_tokens}", 409
                    )
                send, receive = anyio.create_memory_object_stream[list[int]](math.inf)
                result: dict[str, str] = {}
                cancel = slot.cancel

                def emit(ids: list[int]) -> None:
                    anyio.from_thread.run_sync(send.send_nowait, ids)

                def work() -> None:
                    try:
                        result["finish"] = run_decode(
                            self.engine, state, layouts, num_tokens, params, self.eos, emit, cancel,
                            self.config.num_speculative_tokens,
                        )  # fmt: skip
                    except Exception as exc:
                        if cancel.is_set():  # the reader left: emitting into a closed stream fails
                            result["finish"] = "cancelled"
                        else:  # the engine failed: end this request visibly
                            bound.exception("decode_failed")
                            result["error"] = f"decode engine failed: {exc}"
                    finally:
                        anyio.from_thread.run_sync(send.close)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, work)
                    try:
                        async with receive:
                            async for ids in receive:
                                yield orjson.dumps({"token_ids": ids}) + b"\n"
                    finally:
                        cancel.set()
                if "error" in result:
                    yield orjson.dumps({"error": {"message": result["error"], "code": 500}}) + b"\n"
                else:
                    self.decodes_completed += 1
                    yield orjson.dumps({"finish_reason": result.get("finish", "cancelled")}) + b"\n"
                    bound.info("decode_finished", finish_reason=result.get("finish"))
        except SlotError as exc:
            bound.warning("decode_refused", reason=str(exc))
            yield orjson.dumps({"error": {"message": str(exc), "code": exc.status}}) + b"\n"
        finally:
            self.table.release(tid, "decode ended")

    # ---- lifecycle ----------------------------------------------------------------------------

    async def _sweep_leases(self) -> None:
        while True:
            await anyio.sleep(0.5)
            for tid in self.table.expire():
                log.warning("lease_expired", transfer_id=tid)

    async def serve(self) -> None:
        cfg = self.config
        server = uvicorn.Server(
            uvicorn.Config(self.app, host=cfg.host, port=cfg.http_port, log_level="warning", lifespan="off")
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.control.serve, cfg.host, cfg.ctrl_port)
                tg.start_soon(self._sweep_leases)
                log.info(
                    "decode_node_ready", ctrl=f"{cfg.host}:{cfg.ctrl_port}", http=f"{cfg.host}:{cfg.http_port}",
                    engine=self.engine.name, transport=cfg.transport, slots=len(self.table.slots),
                )
                await server.serve()
                tg.cancel_scope.cancel()
        finally:
            self.receiver.close()


def build_node(config: DecodeConfig) -> DecodeNode:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    engine_cls = load_engine(config.engine)
    engine = engine_cls.load(config.model, device=device, dtype=dtype, max_seq_len=config.max_seq_len)
    return DecodeNode(config, engine)


def serve(config: DecodeConfig) -> None:
    node = build_node(config)
    anyio.run(node.serve)
