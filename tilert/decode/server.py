"""The decode node: a control port for the prefill-side senders and an HTTP port for the router.

HTTP API (bodies and replies are the types of ``tilert.contracts``; every 4xx/5xx is an ``ErrorBody``):

- ``POST /v1/reserve`` ``ReserveRequest`` -> ``ReserveResponse``; 429 when every slot is taken (a request of
  ``n`` choices holds ``n``); 422 / 501 when the request's sampling is wrong for this model (``n`` above the
  sequences it decodes at once included) / more than this engine can honour. Idempotent.
- ``POST /v1/release`` ``ReleaseRequest`` -> ``ReleaseResponse``: frees the slot whatever its state and
  cancels a running decode; idempotent.
- ``POST /v1/decode`` ``DecodeRequest`` -> 200 ``application/x-ndjson``: one ``TokenLine`` per step as it
  is produced, the last one with its ``finish_reason`` (this node alone decides when decoding ends: EOS,
  stop ids, ``max_tokens``, the end of the context), or an ``ErrorLine``. It waits for the transfer first (an abort
  from prefill fails it at once). Parameters are checked before the stream starts (4xx/501). Closing the
  stream cancels the decode.
- ``GET /v1/watch`` -> 200 ``application/x-ndjson`` of ``WatchLine``: a ``NodeBeat`` at once and whenever
  ``NODE_BEAT_S`` passed without a line, and a ``TransferFailed`` the moment a transfer to this node fails, for as
  long as the node runs. Each router keeps one open (``router.watch``): its closing (the node died, even by SIGKILL:
  the kernel closes the socket) or its silence (a hung or unreachable node) tells the router at once, which then
  stops sending requests here and moves the ones whose prefill is still running; a ``TransferFailed`` ends its
  request at once, while vLLM may still be computing the prefill. The node ends the streams when it begins to shut
  down, so that they do not hold its graceful shutdown.
- ``GET /health`` ``NodeHealth``; ``GET /metrics`` Prometheus text.

``/v1/*`` needs ``Authorization: Bearer <tilert.auth.node_api_token(secret)>``: only a router holding the
deployment's secret can reserve, decode or release. Up to the engine's ``max_sequences`` decode together
(:mod:`tilert.decode.batch`), each at its own position; the node has no more receive slots than that, so a
reservation it grants is a sequence that decodes at once (a request beyond them waits in the router's queue, not
inside the node with its stream silent).
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from types import FrameType
from typing import TypeVar

import anyio
import structlog
import uvicorn
from anyio.streams.memory import MemoryObjectSendStream
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from tilert import auth
from tilert import contracts as c
from tilert.decode.batch import DecodeBatch, Job
from tilert.decode.config import DecodeConfig
from tilert.decode.control import ControlServer
from tilert.decode.engine_process import EngineProcess, EngineProcessError, spec_for
from tilert.decode.generate import Finish
from tilert.decode.grammar import Grammars
from tilert.decode.metrics import DecodeMetrics
from tilert.decode.sampling import DecodeParams
from tilert.decode.slots import SlotError, SlotTable
from tilert.engines.base import DecodeEngine
from tilert.logs import AccessLog, uvicorn_options
from tilert.models.checkpoint import eos_token_ids, sampling_defaults
from tilert.netio import listening_socket
from tilert.plugins import load_transport
from tilert.settings import ConfigError, describe

log = structlog.get_logger("tilert.decode.server")

B = TypeVar("B")
_WATCH_BUFFER = 1024  # watch lines a slow watcher may fall behind by (failures are rare; beats are not queued)


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(c.error_body(message, status), status, headers, media_type="application/json")


def _ok(body: c.ReserveResponse | c.ReleaseResponse | c.NodeHealth) -> Response:
    return Response(c.dump(body), media_type="application/json")


async def _read(request: Request, cls: type[B], limit: int = c.MAX_API_BODY_BYTES) -> B:
    """The body as ``cls``; over ``limit`` bytes is 413, anything malformed 400."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise SlotError(f"request body exceeds {limit} bytes", 413)
        chunks.append(chunk)
    try:
        return c.parse(cls, b"".join(chunks), limit=limit)
    except c.ContractError as exc:
        raise SlotError(str(exc), 400) from None


def _handler(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """``SlotError`` becomes its status with an ``ErrorBody``."""

    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except SlotError as exc:
            return _error(str(exc), exc.status, {"Retry-After": "1"} if exc.status == 429 else None)

    return wrapped


class DecodeNode:
    """Everything one decode node holds: the engine, the slots, the transport receiver."""

    def __init__(self, config: DecodeConfig, engine: DecodeEngine | EngineProcess) -> None:
        """``engine``: loaded here (decoded on a thread of this process), or running in its own process."""
        self.config = config
        self.engine = engine.engine if isinstance(engine, EngineProcess) else engine
        self.node_id = f"decode-{uuid.uuid4().hex[:8]}"
        self._api_token = ("Bearer " + auth.node_api_token(config.secret)).encode()
        self.advertised = config.advertised_host()
        if self.advertised != config.host:
            log.info("transport_advertised", bind=config.host, advertise=self.advertised, transport=config.transport)
        self.receiver = load_transport(config.transport).receiver(
            host=config.host, options=dict(config.transport_options or {}), advertise=self.advertised
        )
        sequences = self.engine.capabilities().max_sequences
        if config.slots > sequences:  # an engine may hold fewer sequences than asked: a slot is one it decodes
            log.info("slots_capped", slots=config.slots, engine_sequences=sequences)
        self.table = SlotTable(
            min(config.slots, max(1, sequences)),
            self.engine.expected_layouts(),
            config.max_seq_len,
            self.receiver,
            config.lease_s,
            self.engine.check_layouts,
            shared=isinstance(engine, EngineProcess),
        )
        self.control = ControlServer(self.table, config.transport, self.node_id, config.secret)
        self.table.on_transfer = self._on_transfer
        self.eos = eos_token_ids(config.model)
        self.sampling_defaults = sampling_defaults(config.model)
        self.metrics = DecodeMetrics(str(config.model))
        self.batch: DecodeBatch | EngineProcess
        if isinstance(engine, EngineProcess):
            engine.attach([slot.buffer for slot in self.table.slots])
            self.batch = engine
        else:
            self.batch = DecodeBatch(
                engine,
                self.eos,
                config.speculative_tokens,
                config.engine_cpu_set,
                grammars=Grammars(config.model, engine.vocab_size),
                accept_all_drafts=config.accept_all_drafts,
            )
        self.decodes_completed = 0
        self._handoffs: _Handoff | None = None  # the worker's items to the decode streams (made on the loop)
        self._watchers: set[MemoryObjectSendStream[bytes]] = set()  # one per open watch stream
        self._stopping = False  # the HTTP server began to shut down: the watch streams end
        self.app = Starlette(
            routes=[
                Route("/v1/reserve", _handler(self.reserve), methods=["POST"]),
                Route("/v1/release", _handler(self.release), methods=["POST"]),
                Route("/v1/decode", _handler(self.decode), methods=["POST"]),
                Route("/v1/watch", self.watch, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_error},  # type: ignore[dict-item]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry: ``/v1/*`` only with this deployment's bearer token."""
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not auth.verify(given.decode("latin-1"), self._api_token.decode()):
                await _error("missing or invalid node API token", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        return _error(str(exc.detail), exc.status_code)

    def _on_transfer(self, tid: str, ok: bool, reason: str) -> None:
        if ok:
            self.metrics.transfer_received()
            return
        self.metrics.transfer_failed("failed")
        line = c.dump(c.TransferFailed(tid, reason[: c.MAX_REASON_CHARS])) + b"\n"
        for send in list(self._watchers):
            try:
                send.send_nowait(line)
            except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
                log.warning("watch_line_dropped", transfer_id=tid)  # a watcher far behind: it learns at decode

    def _stop_watches(self) -> None:
        self._stopping = True
        for send in list(self._watchers):
            send.close()

    # ---- HTTP handlers ----------------------------------------------------------------------

    async def reserve(self, request: Request) -> Response:
        body = await _read(request, c.ReserveRequest, c.MAX_DECODE_BODY_BYTES)
        if body.lease_s is not None and body.lease_s > self.config.max_lease_s:
            raise SlotError(f"lease_s must be at most {self.config.max_lease_s:g} on this node", 400)
        if body.sampling is not None:
            try:
                self._check_choices(body.sampling.n)
                self._check(self._sampling(body.transfer_id, body.sampling))
            except SlotError as exc:  # an offer already waiting for this reservation stops now
                self.table.release(body.transfer_id, f"its reserve was refused: {exc}")
                # 422: the client's request is wrong for this model (a 400 here is the router's own fault)
                raise SlotError(str(exc), 422 if exc.status == 400 else exc.status) from None
        slot = self.table.reserve(body.transfer_id, body.lease_s, body.sampling.n if body.sampling else 1)
        self.metrics.slots(len(self.table.slots), self.table.free)
        return _ok(c.ReserveResponse(body.transfer_id, slot.index, self.config.max_seq_len))

    async def release(self, request: Request) -> Response:
        body = await _read(request, c.ReleaseRequest)
        released = self.table.release(body.transfer_id, "released by router")
        self.metrics.slots(len(self.table.slots), self.table.free)
        return _ok(c.ReleaseResponse(released))

    async def health(self, request: Request) -> Response:
        if self.batch.failure is not None:
            return _error(f"the decode engine is gone: {self.batch.failure}", 503)
        caps = self.engine.capabilities()
        return _ok(
            c.NodeHealth(
                status="ok",
                node_id=self.node_id,
                engine=self.engine.name,
                protocol_version=c.PROTOCOL_VERSION,
                transport=self.config.transport,
                ctrl_port=self.config.ctrl_port,
                max_seq_len=self.config.max_seq_len,
                slots_total=len(self.table.slots),
                slots_free=self.table.free,
                decodes_running=self.batch.running,
                decodes_waiting=self.batch.waiting,
                transfers_received=self.table.transfers_received,
                decodes_completed=self.decodes_completed,
                capabilities=c.EngineInfo(caps.temperature, caps.top_p, caps.top_k, caps.mtp, caps.pipelined_greedy),
                max_lease_s=self.config.max_lease_s,
                max_choices=self.max_choices,
            )
        )

    async def watch(self, request: Request) -> Response:
        if self._stopping:
            return _error("the node is stopping", 503)
        beat = c.dump(c.NodeBeat(self.node_id)) + b"\n"
        send, receive = anyio.create_memory_object_stream[bytes](_WATCH_BUFFER)
        self._watchers.add(send)

        async def lines() -> AsyncIterator[bytes]:
            try:
                line = beat
                while True:
                    yield line
                    line = beat
                    with anyio.move_on_after(c.NODE_BEAT_S):
                        line = await receive.receive()
            except anyio.EndOfStream:  # the node is stopping
                return
            finally:
                self._watchers.discard(send)
                send.close()
                receive.close()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def render_metrics(self, request: Request) -> Response:
        self.metrics.slots(len(self.table.slots), self.table.free)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def decode(self, request: Request) -> Response:
        req = await _read(request, c.DecodeRequest, c.MAX_DECODE_BODY_BYTES)
        slot = self.table.hold(req.transfer_id)  # queued behind a running decode, it must not expire
        try:
            if req.sampling.n != slot.n:
                raise SlotError(f"n={req.sampling.n}, but the reservation was for n={slot.n}", 400)
            params = self._params(req)
        except SlotError:
            self.table.release(req.transfer_id, "refused")
            raise
        return StreamingResponse(self._stream(params), media_type="application/x-ndjson")

    def _params(self, req: c.DecodeRequest) -> DecodeParams:
        """The request checked against this model and node; the node alone owns the context limit."""
        if req.first_token_id >= self.engine.vocab_size:
            raise SlotError(f"first_token_id must be a token id below {self.engine.vocab_size}", 400)
        params = self._sampling(
            req.transfer_id, req.sampling, req.first_token_id, req.prompt_tokens, req.prompt_token_ids
        )
        self._check(params)
        if params.repetition_penalty != 1.0 and req.prompt_token_ids is None:
            raise SlotError("repetition_penalty needs the prompt's token ids (prompt_token_ids)", 400)
        room = c.decode_room(self.config.max_seq_len, params.prompt_tokens)
        if params.max_tokens is None:
            return replace(params, max_tokens=max(room, 0))
        if params.max_tokens > room:
            limit, asked = self.config.max_seq_len, params.prompt_tokens + 1 + params.max_tokens
            raise SlotError(
                f"This model's maximum context length is {limit} tokens. However, you requested {asked} tokens "
                f"({params.prompt_tokens} in the messages, {params.max_tokens + 1} in the completion). "
                "Please reduce the length of the messages or completion.",
                400,
            )
        return params

    def _sampling(
        self,
        tid: str,
        sampling: c.Sampling,
        first_token_id: int = 0,
        prompt_tokens: int = 1,
        prompt_token_ids: list[int] | None = None,
    ) -> DecodeParams:
        """``sampling`` checked for this model (400), with its defaults applied (a reserve has no prompt yet)."""
        try:
            return DecodeParams.of(
                tid,
                sampling,
                self.engine.vocab_size,
                self.sampling_defaults,
                first_token_id,
                prompt_tokens,
                prompt_token_ids,
            )
        except ValueError as exc:
            raise SlotError(str(exc), 400) from None

    @property
    def max_choices(self) -> int:
        """The largest ``n`` this node decodes: a choice is an engine sequence, and a slot of the table."""
        return min(self.engine.capabilities().max_sequences, len(self.table.slots))

    def _check_choices(self, n: int) -> None:
        """400 (a 422 at the reserve) when ``n`` is more than this node ever decodes at once."""
        if n > self.max_choices:
            raise SlotError(
                f"n must be at most {self.max_choices} on this decode node (the sequences it decodes at once), got {n}",
                400,
            )

    def _check(self, params: DecodeParams) -> None:
        """501 when this engine cannot honour the request's sampling."""
        unsupported = params.unsupported(self.engine.capabilities())
        if unsupported:
            raise SlotError(f"the {self.engine.name} engine cannot honour {unsupported}", 501)

    # ---- the decode stream ------------------------------------------------------------------

    async def _stream(self, params: DecodeParams) -> AsyncIterator[bytes]:
        tid = params.transfer_id
        bound = log.bind(transfer_id=tid)
        # time.monotonic, not the loop's clock: uvloop's counts whole milliseconds, coarser than a decode step
        started, outcome, progress = time.monotonic(), "error", _Progress()
        try:
            await self.table.wait_ready(tid, self.config.transfer_timeout_s)
            self.metrics.transfer_wait(time.monotonic() - started)
            finished = 0  # choices that sent their finish
            async for lines in self._run(params, bound, progress):
                for line in lines:
                    if isinstance(line, c.TokenLine) and line.finish_reason is not None:
                        finished += 1
                        if finished == params.n:
                            outcome = line.finish_reason
                            self.decodes_completed += 1
                yield c.dump_lines(lines)  # what queued meanwhile: one write
        except SlotError as exc:
            bound.warning("decode_refused", reason=str(exc))
            yield c.dump_line(c.ErrorLine(exc.status, str(exc)))
        finally:
            self.table.release(tid, "decode ended")
            self.metrics.slots(len(self.table.slots), self.table.free)
            self.metrics.requests(self.batch.running, self.batch.waiting)
            self.metrics.request_done(time.monotonic() - started, outcome, progress.time_per_token)

    async def _run(
        self, params: DecodeParams, bound: structlog.typing.FilteringBoundLogger, progress: _Progress
    ) -> AsyncIterator[list[c.TokenLine | c.ErrorLine]]:
        """Hand the request to the batch (it decodes on its worker thread, with whatever other sequences
        run); relay each step's tokens as a line the moment they exist, counting them in ``progress``. Each yield
        is what the worker handed over since the last (the token lines of a choice joined:
        ``contracts.join_runs``), so a stream that fell behind catches up in one write instead of one per step."""
        slot = self.table.start_decode(params.transfer_id)
        state, layouts, num_tokens = slot.tensors()
        if num_tokens != params.prompt_tokens:
            raise SlotError(f"prefill sent {num_tokens} prompt tokens, the router says {params.prompt_tokens}", 409)
        inbox = self._handoff().inbox()

        def emit(ids: list[int], finish: Finish | None, index: int, logprobs: list[c.TokenLogprobs] | None) -> None:
            line = (
                c.TokenLine(ids, index=index, logprobs=logprobs)
                if finish is None
                else c.TokenLine(ids, finish.reason, finish.stop_token_id, index, logprobs)  # type: ignore[arg-type]
            )
            inbox.put(line)

        last_token = slot.offer.last_token_id if slot.offer is not None else None
        try:
            self.batch.submit(
                Job(
                    state,
                    layouts,
                    num_tokens,
                    params,
                    emit,
                    self._counted(inbox.put),
                    slot.cancel,
                    last_token,
                    slot.index,
                )
            )
        except EngineProcessError as exc:
            raise SlotError(f"decode engine unavailable: {exc}", 503) from None
        self.metrics.requests(self.batch.running, self.batch.waiting)
        last, finished = time.monotonic(), 0  # choices that sent their finish
        submitted = last
        try:
            while True:
                lines: list[c.TokenLine | c.ErrorLine] = []
                for item in c.join_runs(await inbox.take()):
                    if not isinstance(item, c.TokenLine):
                        if finished < params.n:
                            lines.append(self._last_line(item, bound))
                        if lines:
                            yield lines
                        return
                    now = time.monotonic()
                    self.metrics.tokens(len(item.token_ids), now - last)
                    progress.generated(len(item.token_ids), now - submitted)
                    last, finished = now, finished + (item.finish_reason is not None)
                    lines.append(item)
                if lines:
                    yield lines
        finally:
            slot.cancel.set()  # the reader left (or the decode ended): the batch drops the sequence

    def _counted(self, done: Callable[[Finish | BaseException], None]) -> Callable[[Finish | BaseException], None]:
        """``done`` of a decode job, its speculative steps counted first (the batch's thread calls it, or the engine
        process's reader)."""

        def counted(result: Finish | BaseException) -> None:
            if isinstance(result, Finish) and result.spec is not None:
                s = result.spec
                self.metrics.spec_decode(s.drafts, s.draft_tokens, s.accepted_per_pos)
            done(result)

        return counted

    def _handoff(self) -> _Handoff:
        """The worker's hand-off to this node's event loop (made on the loop, at the first decode)."""
        if self._handoffs is None:
            self._handoffs = _Handoff(asyncio.get_running_loop())
        return self._handoffs

    @staticmethod
    def _last_line(
        result: Finish | BaseException, bound: structlog.typing.FilteringBoundLogger
    ) -> c.TokenLine | c.ErrorLine:
        """The closing line when the decode ended before each of its choices sent its finish (the batch sends the
        finish of every choice that ends by stop or length): it failed or was cancelled."""
        if isinstance(result, BaseException):
            bound.error("decode_failed", error=f"{type(result).__name__}: {result}")
            return c.ErrorLine(500, f"decode engine failed: {type(result).__name__}")
        if result.reason == "cancelled":
            return c.ErrorLine(500, "decode cancelled")
        return c.ErrorLine(500, "decode ended before each of its choices sent its finish")

    # ---- lifecycle ----------------------------------------------------------------------------

    async def _sweep_leases(self) -> None:
        while True:
            await anyio.sleep(0.5)
            expired = self.table.expire()
            for tid in expired:
                log.warning("lease_expired", transfer_id=tid)
            self.metrics.lease_expired(len(expired))

    async def serve(self, sockets: NodeSockets) -> None:
        """Serve until stopped, on ``sockets`` (the config's ports, bound at start-up: :func:`bind_sockets`)."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        server = _Server(
            uvicorn.Config(
                AccessLog(self),
                host=cfg.host,
                port=cfg.http_port,
                lifespan="off",
                limit_concurrency=cfg.max_http_connections,
                timeout_keep_alive=int(c.NODE_KEEPALIVE_S),
                **uvicorn_options(),
            ),
            on_exit=lambda: loop.call_soon_threadsafe(self._stop_watches),
        )
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self.control.serve, cfg.host, cfg.ctrl_port, sockets.ctrl)
                tg.start_soon(self._sweep_leases)
                log.info(
                    "decode_node_ready",
                    ctrl=f"{cfg.host}:{cfg.ctrl_port}",
                    http=f"{cfg.host}:{cfg.http_port}",
                    advertise=self.advertised,
                    engine=self.engine.name,
                    transport=cfg.transport,
                    slots=len(self.table.slots),
                )
                await server.serve(sockets=[sockets.http])
                tg.cancel_scope.cancel()
        finally:
            self.batch.close()
            self.receiver.close()


class _Server(uvicorn.Server):
    """uvicorn's server, telling the node when a signal starts its shutdown (uvicorn waits for open responses
    before it stops; the node's watch streams would otherwise never end)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], object]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._on_exit()  # in a signal handler: it only schedules the work on the loop


def build_node(config: DecodeConfig) -> DecodeNode:
    spec = spec_for(config, eos_token_ids(config.model))
    return DecodeNode(config, EngineProcess(spec) if config.engine_process else spec.load())


@dataclass
class NodeSockets:
    """The node's control and HTTP listening sockets, bound before its engine loads."""

    ctrl: socket.socket
    http: socket.socket

    def close(self) -> None:
        self.ctrl.close()
        self.http.close()


def bind_sockets(config: DecodeConfig) -> NodeSockets:
    """Bind the node's two ports now: a port another process holds is refused at start-up (:class:`ConfigError`,
    naming the setting), not after the engine has loaded, and no other process can take it meanwhile."""
    bound: list[socket.socket] = []
    try:
        for name in ("ctrl_port", "http_port"):
            port = getattr(config, name)
            try:
                bound.append(listening_socket(config.host, port))
            except OSError as exc:
                raise ConfigError(
                    f"{describe(DecodeConfig, name)}: cannot listen on {config.host}:{port} ({exc.strerror or exc})"
                ) from None
    except BaseException:
        for sock in bound:
            sock.close()
        raise
    return NodeSockets(*bound)


def serve(config: DecodeConfig) -> None:
    """One process, one engine (``--tp 1``; ``tilert.decode.tp.serve_tp`` serves several ranks)."""
    sockets = bind_sockets(config)
    try:
        run_node(build_node(config), sockets)
    finally:
        sockets.close()


def run_node(node: DecodeNode, sockets: NodeSockets) -> None:
    """Serve ``node`` on ``sockets`` until it stops, on uvloop's event loop where it is installed (as uvicorn runs the
    router): its socket writes and wake-ups from the worker thread cost each line of a decode stream less than
    asyncio's."""
    anyio.run(node.serve, sockets, backend_options={"use_uvloop": importlib.util.find_spec("uvloop") is not None})


_Item = c.TokenLine | Finish | BaseException  # what the batch's worker thread hands a decode stream


@dataclass
class _Progress:
    """One decode's tokens so far, and the time from its hand-off to the engine to the last of them."""

    tokens: int = 0
    seconds: float = 0.0

    def generated(self, n: int, since_submit_s: float) -> None:
        if n > 0:
            self.tokens += n
            self.seconds = since_submit_s

    @property
    def time_per_token(self) -> float | None:
        """Mean time per generated token (None: it generated none)."""
        return self.seconds / self.tokens if self.tokens else None


class _Handoff:
    """What the batch's worker thread hands the decode streams of one node, onto the event loop. The thread puts
    each item in its stream's :class:`_Inbox`; one ``call_soon_threadsafe`` delivers everything that queued until the
    loop ran it (the lines of a step of several sequences: one wake-up of the loop for the step, not one a line)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: collections.deque[tuple[_Inbox, _Item]] = collections.deque()
        self._pending = False  # a delivery is scheduled on the loop and has not begun

    def inbox(self) -> _Inbox:
        return _Inbox(self)

    def put(self, inbox: _Inbox, item: _Item) -> None:
        """From the worker thread."""
        self._queue.append((inbox, item))
        if not self._pending:
            self._pending = True
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        self._pending = False  # before taking: an item put from now on schedules the next delivery
        queue = self._queue
        while queue:
            inbox, item = queue.popleft()
            inbox.items.append(item)
            waiter = inbox.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


class _Inbox:
    """One decode stream's items from the worker (delivered by :class:`_Handoff`), taken by the stream in batches."""

    __slots__ = ("_handoff", "items", "waiter")

    def __init__(self, handoff: _Handoff) -> None:
        self._handoff = handoff
        self.items: list[_Item] = []
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        """From the worker thread (``Job.emit``'s lines, ``Job.done``'s result)."""
        self._handoff.put(self, item)

    async def take(self) -> list[_Item]:
        """Every item delivered since the last take (at least one)."""
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items
