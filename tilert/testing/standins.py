"""Stand-in prefill vLLM and decode node for the router: Starlette apps that speak the router's protocols.

- :class:`PrefillStandin`: vLLM's OpenAI server where the router touches it, the prefill leg (a non-streaming
  ``max_tokens=1`` completion or chat completion carrying a signed :class:`~tilert.contracts.Claim`), answered with
  the first token and, in ``kv_transfer_params``, the :class:`~tilert.contracts.ClaimResult` the TileRT connector
  hands back (first token id, prompt length). It refuses any other request (400 with the reason): the router sends
  nothing else to its prefill.
- :class:`DecodeStandin`: the decode node's HTTP API (``tilert.decode.server``): reserve, release, decode (NDJSON
  token lines), the watch stream and health, every body parsed and dumped with the types of :mod:`tilert.contracts`,
  every ``/v1/*`` call checked for the node API token.

Both "generate" from one :class:`Script`. Their behaviour is plain attributes, changed between requests by a test
(refusals, delays, gaps, a hung watch) or set once by a benchmark (token gap, slots); ``reset()`` restores the
settings they were built with and clears what they recorded. No engine, no KV transfer: the decode answers as if
the transfer had landed.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import AsyncIterator
from copy import copy
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

import anyio
import anyio.lowlevel
import msgspec
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from tokenizers import Tokenizer

from tilert import auth
from tilert import contracts as c

STANDIN = "standin"  # the node id and engine name the decode stand-in reports
B = TypeVar("B")


@dataclass
class Script:
    """What every request "generates": prefill answers ``ids[0]``; the decode continues with ``ids[1:]`` and then
    the script from its start again, until EOS (``eos_id``, unless the request ignores it), one of the request's
    stop ids, its ``max_tokens`` or the end of the node's context."""

    tokenizer: Tokenizer
    ids: list[int]
    eos_id: int | None = None

    def __post_init__(self) -> None:
        if not self.ids:
            raise ValueError("a script needs at least one token id")

    def first(self) -> int:
        return self.ids[0]

    def decoded(self, step: int) -> int:
        """The token the decode emits at ``step`` (0: the one after prefill's)."""
        return self.ids[(step + 1) % len(self.ids)]

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def printable_ids(tokenizer: Tokenizer, count: int = 64) -> list[int]:
    """``count`` token ids whose text alone is printable ASCII, not blank: each one becomes one SSE event through
    the router (the detokenizer holds nothing back)."""
    ids: list[int] = []
    for i in range(32, tokenizer.get_vocab_size()):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text.strip() and text.isascii() and text.isprintable():
            ids.append(i)
            if len(ids) == count:
                return ids
    raise ValueError(f"the tokenizer has only {len(ids)} printable ASCII tokens, {count} asked")


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def _error(message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(c.error_body(message, status), status, headers, media_type="application/json")


# ---- the prefill vLLM ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class PrefillBehaviour:
    """``mode``: ``ok``; ``no_kv`` (the reply lacks ``kv_transfer_params``, as from a vLLM without the connector);
    ``http_500`` (an engine failure). ``delay_s``: how long each prefill takes."""

    mode: Literal["ok", "no_kv", "http_500"] = "ok"
    delay_s: float = 0.0


class PrefillStandin(PrefillBehaviour):
    """vLLM's non-streaming reply to the router's prefill leg (``app``); records each request body (``bodies``) and
    each transfer's prompt (``prompts``, by transfer id)."""

    def __init__(
        self, script: Script, secret: bytes, model_name: str, behaviour: PrefillBehaviour | None = None
    ) -> None:
        self.script, self.secret, self.model_name = script, secret, model_name
        self.defaults = behaviour or PrefillBehaviour()
        self.bodies: list[dict[str, Any]] = []
        self.prompts: dict[str, str] = {}
        self._ids = itertools.count()
        self.reset()
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
                Route("/health", self._health),
            ]
        )

    def reset(self) -> None:
        for f in fields(PrefillBehaviour):
            setattr(self, f.name, copy(getattr(self.defaults, f.name)))
        self.bodies.clear()
        self.prompts.clear()

    @staticmethod
    def _protocol_fault(body: dict[str, Any]) -> str | None:
        """What makes ``body`` something other than the router's prefill leg (None: it is one)."""
        if body.get("max_tokens") != 1 or body.get("stream") is not False or body.get("return_token_ids") is not True:
            return "the prefill leg is max_tokens=1, stream=false, return_token_ids=true"
        for key in ("max_completion_tokens", "stream_options"):
            if key in body:
                return f"the prefill leg carries no {key}"
        return None

    async def _generate(self, request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _json({"error": {"message": f"malformed JSON: {exc}", "type": "BadRequestError", "code": 400}}, 400)
        chat = request.url.path.endswith("/chat/completions")
        self.bodies.append(body)
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        if body.get("model") != self.model_name:
            message = f"The model `{body.get('model')}` does not exist."
            return _json({"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}}, 404)
        if self.mode == "http_500":
            return _json({"error": {"message": "engine dead", "code": 500}}, 500)
        claim, fault = self._claim(body.get("kv_transfer_params"))
        fault = self._protocol_fault(body) or fault
        if claim is None or fault is not None:
            return _json({"error": {"message": fault, "type": "BadRequestError", "code": 400}}, 400)
        return _json(self._reply(body, chat, claim.transfer_id))

    def _claim(self, params: dict[str, Any] | None) -> tuple[c.Claim | None, str | None]:
        """The request's claim, or why there is none the router would send (it signs every claim)."""
        try:
            claim = c.Claim.from_params(params)
        except c.ContractError as exc:
            return None, str(exc)
        if claim is None or not claim.verified(self.secret):
            return None, "the prefill leg carries a claim signed with the deployment's secret"
        return claim, None

    def _reply(self, body: dict[str, Any], chat: bool, tid: str) -> dict[str, Any]:
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages", [])) if chat else body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            prompt_ids = list(prompt)  # token ids: the prompt as it is, as vLLM takes it
        else:
            prompt_ids = self.script.tokenizer.encode(str(prompt)).ids or [self.script.first()]
        first = self.script.first()
        text = self.script.text([first])
        finish, stop_reason = ("stop" if first == self.script.eos_id else "length"), None
        stops = body.get("stop") or []
        for s in [stops] if isinstance(stops, str) else stops:
            if s in text:
                text, finish, stop_reason = text[: text.index(s)], "stop", s
                break
        self.prompts[tid] = str(prompt)
        choice: dict[str, Any] = {
            "index": 0,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": [first],
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
            choice["prompt_token_ids"] = prompt_ids
        n = len(prompt_ids)
        resp: dict[str, Any] = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{STANDIN}-{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1},
        }
        if chat:
            resp["prompt_token_ids"] = prompt_ids
        if self.mode != "no_kv":
            resp["kv_transfer_params"] = c.ClaimResult(tid, first, n).to_params()
        return resp

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)


# ---- the decode node ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class NodeBehaviour:
    """How the decode stand-in answers.

    ``slots``: reservations it holds at once (429 beyond); ``token_gap_s``: the wait before each token line;
    ``tokens_per_line``: tokens a line carries (more than one: as an MTP engine sends them); ``join_behind``: the
    decode runs as a task of its own (one step per event-loop turn when the gap is 0, a decode that answers at once)
    and the lines that queued while the stream was writing go out as one, as the node's stream joins them
    (``contracts.join_runs``); ``max_seq_len``: its
    context, as its reserve answers it; ``max_lease_s``: the longest lease it grants, as its health says it
    (None: not said; a longer lease asked is refused, 400). Faults: ``reserve_refusal`` / ``decode_refusal``
    (status, message) answers every reserve / decode so; ``error_after``: an ``ErrorLine`` after that many tokens;
    ``hang_after``: silence after that many tokens; ``hold``: each decode waits (before its first token) while set;
    ``gate``: each decode request is answered only once the event is set (10 s at most); ``watch_silent``: the watch
    stream stays open without a beat (a hung node); ``fail_transfers``: every reservation is told failed on the
    watch stream with this reason."""

    slots: int = 2
    token_gap_s: float = 0.002
    tokens_per_line: int = 1
    join_behind: bool = False
    max_seq_len: int = 4096
    max_lease_s: float | None = None
    ctrl_port: int = 1  # what its health reports; the stand-in has no control port
    reserve_refusal: tuple[int, str] | None = None
    decode_refusal: tuple[int, str] | None = None
    error_after: int | None = None
    hang_after: int | None = None
    hold: bool = False
    gate: threading.Event | None = None
    watch_silent: bool = False
    fail_transfers: str | None = None


class DecodeStandin(NodeBehaviour):
    """The decode node's API (``app``). Records, for a test to read: ``reservations`` (transfer id -> slot; guard a
    change from another thread with ``lock``), ``reserve_bodies`` and ``decode_bodies`` (as builtins),
    ``decode_calls`` (transfer ids decoded, in order), ``releases``, ``cancels`` (releases of a running decode),
    ``closed_streams`` (decode streams that ended, however), ``transfers`` and ``completed`` (decodes begun and
    finished, as its health counts them)."""

    def __init__(self, script: Script, secret: bytes, behaviour: NodeBehaviour | None = None) -> None:
        self.script = script
        self.defaults = behaviour or NodeBehaviour()
        self._token = "Bearer " + auth.node_api_token(secret)
        self.lock = threading.Lock()
        self.reservations: dict[str, int] = {}
        self.reserve_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.decode_calls: list[str] = []
        self.releases: list[str] = []
        self.cancels: list[str] = []
        self.closed_streams: list[str] = []
        self.transfers = self.completed = 0
        self._running: dict[str, anyio.Event] = {}  # decoding transfer id -> set when released (cancelled)
        self.reset()
        self.app = Starlette(
            routes=[
                Route("/v1/reserve", self._reserve, methods=["POST"]),
                Route("/v1/release", self._release, methods=["POST"]),
                Route("/v1/decode", self._decode, methods=["POST"]),
                Route("/v1/watch", self._watch, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    def reset(self) -> None:
        for f in fields(NodeBehaviour):
            setattr(self, f.name, copy(getattr(self.defaults, f.name)))
        with self.lock:
            self.reservations.clear()
        for records in (
            self.reserve_bodies,
            self.decode_bodies,
            self.decode_calls,
            self.releases,
            self.cancels,
            self.closed_streams,
        ):
            records.clear()
        self.transfers = self.completed = 0

    def _free(self, tid: str) -> bool:
        with self.lock:
            return self.reservations.pop(tid, None) is not None

    def _authorised(self, request: Request) -> bool:
        return auth.verify(request.headers.get(c.NODE_AUTH_HEADER, ""), self._token)

    async def _body(self, request: Request, cls: type[B]) -> B | Response:
        if not self._authorised(request):
            return _error("missing or invalid node API token", 401)
        try:
            return c.parse(cls, await request.body())
        except c.ContractError as exc:
            return _error(str(exc), 400)

    async def _reserve(self, request: Request) -> Response:
        body = await self._body(request, c.ReserveRequest)
        if isinstance(body, Response):
            return body
        self.reserve_bodies.append(msgspec.to_builtins(body))
        if self.max_lease_s is not None and body.lease_s is not None and body.lease_s > self.max_lease_s:
            return _error(f"lease_s must be at most {self.max_lease_s:g} on this node", 400)
        if self.reserve_refusal is not None:
            return _error(self.reserve_refusal[1], self.reserve_refusal[0])
        with self.lock:
            slot = self.reservations.get(body.transfer_id)  # idempotent per transfer id
            if slot is None:
                if len(self.reservations) >= self.slots:
                    return _error("all decode slots are taken", 429, {"Retry-After": "1"})
                taken = set(self.reservations.values())
                slot = self.reservations[body.transfer_id] = next(i for i in itertools.count() if i not in taken)
        return Response(
            c.dump(c.ReserveResponse(body.transfer_id, slot, self.max_seq_len)), media_type="application/json"
        )

    async def _release(self, request: Request) -> Response:
        body = await self._body(request, c.ReleaseRequest)
        if isinstance(body, Response):
            return body
        tid = body.transfer_id
        self.releases.append(tid)
        running = self._running.get(tid)
        if running is not None:  # as the node does: a release cancels a running decode
            self.cancels.append(tid)
            running.set()
        return Response(c.dump(c.ReleaseResponse(self._free(tid))), media_type="application/json")

    def _refusal(self, req: c.DecodeRequest) -> tuple[int, str] | None:
        if req.transfer_id not in self.reservations:
            return 404, "unknown transfer: reserve a slot first"
        if self.decode_refusal is not None:
            return self.decode_refusal
        room = c.decode_room(self.max_seq_len, req.prompt_tokens)
        if req.sampling.max_tokens is not None and req.sampling.max_tokens > room:
            return 400, f"This model's maximum context length is {self.max_seq_len} tokens."
        return None

    async def _decode(self, request: Request) -> Response:
        req = await self._body(request, c.DecodeRequest)
        if isinstance(req, Response):
            return req
        if self.gate is not None:
            await anyio.to_thread.run_sync(self.gate.wait, 10.0)
        refused = self._refusal(req)
        if refused is not None:
            self._free(req.transfer_id)
            return _error(refused[1], refused[0])
        self.decode_calls.append(req.transfer_id)
        self.decode_bodies.append(msgspec.to_builtins(req))
        self.transfers += 1
        cancelled = self._running[req.transfer_id] = anyio.Event()
        if self.join_behind:
            return _JoinedLines(self._lines(req, cancelled))
        return StreamingResponse(_dumped(self._lines(req, cancelled)), media_type="application/x-ndjson")

    async def _lines(self, req: c.DecodeRequest, cancelled: anyio.Event) -> AsyncIterator[c.DecodeLine]:
        """One line every ``token_gap_s`` as the script says; a release ends it as the node's cancel does."""
        tid, sampling = req.transfer_id, req.sampling
        limit = (
            sampling.max_tokens
            if sampling.max_tokens is not None
            else c.decode_room(self.max_seq_len, req.prompt_tokens)
        )
        stop_ids = set(sampling.stop_token_ids)

        async def cancelled_after(seconds: float) -> bool:
            """Sleep ``seconds`` (a release cuts it short); True when the decode was cancelled."""
            with anyio.move_on_after(seconds):
                await cancelled.wait()
            return cancelled.is_set()

        cancel_line = c.ErrorLine(500, "decode cancelled")
        try:
            while self.hold:
                if await cancelled_after(0.005):
                    yield cancel_line
                    return
            pending: list[int] = []
            for step in range(limit):
                if self.error_after is not None and step >= self.error_after:
                    yield c.ErrorLine(500, "injected decode failure")
                    return
                if self.hang_after is not None and step >= self.hang_after and await cancelled_after(3600):
                    yield cancel_line
                    return
                tok = self.script.decoded(step)
                pending.append(tok)
                eos = tok == self.script.eos_id and not sampling.ignore_eos
                last = eos or tok in stop_ids or step == limit - 1
                if last or len(pending) >= self.tokens_per_line:
                    if self.token_gap_s:
                        await anyio.sleep(self.token_gap_s)  # cheaper than a cancellable wait: seen after the gap
                    elif self.join_behind:
                        await anyio.lowlevel.checkpoint()  # the next step on the loop's next turn
                    if cancelled.is_set():
                        yield cancel_line
                        return
                    finish: c.FinishReason | None = ("stop" if eos or tok in stop_ids else "length") if last else None
                    yield c.TokenLine(pending, finish, tok if finish == "stop" and not eos else None)
                    pending = []
                    if last:
                        self.completed += 1
                        return
            yield c.TokenLine([], "length")  # max_tokens 0 (the node's context was already full)
            self.completed += 1
        finally:
            self._running.pop(tid, None)
            self.closed_streams.append(tid)
            self._free(tid)

    async def _watch(self, request: Request) -> Response:
        if not self._authorised(request):
            return _error("missing or invalid node API token", 401)

        async def lines() -> AsyncIterator[bytes]:
            told: set[str] = set()
            beat = c.dump(c.NodeBeat(STANDIN)) + b"\n"
            last = -float("inf")
            while True:
                if not self.watch_silent and anyio.current_time() - last >= c.NODE_BEAT_S:
                    last = anyio.current_time()
                    yield beat
                reason = self.fail_transfers
                with self.lock:
                    failing = [tid for tid in self.reservations if tid not in told] if reason else []
                for tid in failing:
                    told.add(tid)
                    last = anyio.current_time()
                    yield c.dump(c.TransferFailed(tid, reason or "")) + b"\n"
                await anyio.sleep(0.05)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def _health(self, request: Request) -> Response:
        with self.lock:
            used = len(self.reservations)
        health = c.NodeHealth(
            status="ok",
            node_id=STANDIN,
            engine=STANDIN,
            protocol_version=c.PROTOCOL_VERSION,
            transport="tcp",
            ctrl_port=self.ctrl_port,
            max_seq_len=self.max_seq_len,
            slots_total=self.slots,
            slots_free=max(self.slots - used, 0),
            decodes_running=len(self._running),
            decodes_waiting=0,
            transfers_received=self.transfers,
            decodes_completed=self.completed,
            capabilities=c.EngineInfo(temperature=True, top_p=True, top_k=True, mtp=False),
            max_lease_s=self.max_lease_s,
            max_choices=1,  # it decodes one choice a request (n > 1 is the router's 400)
        )
        return Response(c.dump(health), media_type="application/json")


async def _dumped(lines: AsyncIterator[c.DecodeLine]) -> AsyncIterator[bytes]:
    async for line in lines:
        yield c.dump_line(line)


class _JoinedLines(Response):
    """The NDJSON decode stream of ``lines`` made by a task of their own; the lines that queued while the previous
    write was under way go out as one write, their token lines joined (``contracts.join_runs``), as the node's stream
    sends them."""

    def __init__(self, lines: AsyncIterator[c.DecodeLine]) -> None:
        self._lines = lines
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", b"application/x-ndjson")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        tx, rx = anyio.create_memory_object_stream[c.DecodeLine](math.inf)

        async def produce() -> None:
            async with tx:
                async for line in self._lines:
                    tx.send_nowait(line)

        async with anyio.create_task_group() as tg, rx:
            tg.start_soon(produce)
            async for first in rx:
                batch = [first]
                with contextlib.suppress(anyio.WouldBlock, anyio.EndOfStream):
                    while True:
                        batch.append(rx.receive_nowait())
                body = b"".join(c.dump_line(line) for line in c.join_runs(batch))
                await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@dataclass
class Standins:
    """A prefill and a decode stand-in on one script (as a test runs them, in one process)."""

    script: Script
    prefill: PrefillStandin
    node: DecodeStandin
    ids: list[int] = field(default_factory=list)  # the script as built, restored by reset()

    @classmethod
    def build(
        cls,
        script: Script,
        secret: bytes,
        model_name: str,
        node: NodeBehaviour | None = None,
        prefill: PrefillBehaviour | None = None,
    ) -> Standins:
        return cls(
            script,
            PrefillStandin(script, secret, model_name, prefill),
            DecodeStandin(script, secret, node),
            list(script.ids),
        )

    def reset(self) -> None:
        self.script.ids = list(self.ids)
        self.prefill.reset()
        self.node.reset()
