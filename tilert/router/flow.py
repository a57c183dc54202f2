"""One client request through a decode pool, as an explicit state machine::

    RECEIVED -> QUEUED -> PREFILLING -> DECODING -> FINISHED
        \\          \\           \\            \\----> FAILED | CANCELLED
         \\          \\           \\            \\--> RESUMING -> DECODING (its node died or stalled)
         \\          \\           \\-> FINISHED (prefill's single token already ends the request)
          \\          \\-> (no TileRT slot within overflow_wait_s) -> the native pool's PREFILLING
           \\-> PREFILLING (the native pool: no slot to wait for; see :mod:`tilert.router.native`)

The pool is chosen before the flow starts (:mod:`tilert.router.routing`); the one that served is in the
response's ``x-tilert-pool`` header, in the metrics' ``pool`` label and in the request's log lines.

The decode slot is a :class:`~tilert.router.lease.NodeLease`: every path out (answer, error, timeout,
client gone) releases it exactly once, and on answered paths before the response's last byte, so a
client that sees the end of its answer also sees the slot free. The client always gets a complete
answer, an HTTP error in OpenAI's shape, or (once streaming began) a final ``data: {"error": ...}``
event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import anyio
import orjson
import structlog
from starlette.types import Send

from tilert import contracts as c
from tilert.router.config import NATIVE_POOL
from tilert.router.context import RouterContext
from tilert.router.decode_stream import DECODE_LOST
from tilert.router.detokenize import bad_words_token_ids
from tilert.router.errors import RouterError, bad_request
from tilert.router.lease import NodeLease, Overflow
from tilert.router.logprobs import ChoiceExtras, resumed_logprobs
from tilert.router.native import available_pool, native_decode, native_prefill
from tilert.router.openai_format import DONE, ResponseShape, sse, usage, with_choices
from tilert.router.output import SSE_HEADERS, ClientOutput
from tilert.router.pool import PooledNode
from tilert.router.prefill import PrefillResult, run_prefill
from tilert.router.routing import PoolChoice
from tilert.router.token_loop import Choices, Delta, TokenLoop
from tilert.router.validation import RequestPlan, continuation

_log = structlog.get_logger("tilert.router.flow")


class FlowState(enum.Enum):
    RECEIVED = "received"
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    RESUMING = "resuming"


class RequestFlow:
    def __init__(
        self,
        ctx: RouterContext,
        plan: RequestPlan,
        request_id: str,
        arrived: float,
        choice: PoolChoice,
        client_body: bytes = b"",
    ) -> None:
        self.ctx = ctx
        self.plan = plan
        self.choice = choice
        self.pool = choice.pool
        self.client_body = client_body  # as the client sent it (the native decode instance gets it)
        self.request_id = request_id
        self.arrived = arrived
        self.transfer_id = uuid.uuid4().hex
        self.state = FlowState.RECEIVED
        self.client_gone = False
        self.out: ClientOutput | None = None
        self.outcome = "ok"
        self.finish_reason: str | None = None
        self.prompt_tokens = self.completion_tokens = 0
        self.ttft_s: float | None = None
        self.node_name: str | None = None
        self.resumes = 0  # times this stream went on on another decode node
        self.log = _log.bind(
            transfer_id=self.transfer_id,
            route=plan.route,
            stream=plan.stream,
            pool=self.pool,
            pool_reason=choice.reason,
        )

    @property
    def response_done(self) -> bool:
        return self.out is not None and self.out.done

    def _to(self, state: FlowState, **fields: Any) -> None:
        final = state in (FlowState.FINISHED, FlowState.FAILED, FlowState.CANCELLED)
        (self.log.info if final else self.log.debug)(
            "request_state", state=state.value, previous=self.state.value, **fields
        )
        self.state = state

    def _elapsed(self) -> float:
        return anyio.current_time() - self.arrived

    # -- entry -------------------------------------------------------------------------------------
    async def run(self, send: Send, server_send: Send | None = None) -> None:
        """The request, answered through ``send`` (``server_send``: the server's own, for the body: ClientOutput)."""
        self.out = ClientOutput(send, self.pool, self.choice.why, server_send)
        self.ctx.metrics.running(1)
        try:
            await self._run(self.out)
        except RouterError as exc:
            self.outcome = exc.outcome
            self._to(FlowState.FAILED, status=exc.status, reason=exc.log_reason())
            await self._report(self.out, exc)
        except anyio.get_cancelled_exc_class():
            self.outcome = "client_disconnected" if self.client_gone else "cancelled"
            self._to(FlowState.CANCELLED, reason=self.outcome)
            raise
        except Exception as exc:  # noqa: BLE001 - the client must still get an answer
            self.outcome = "internal_error"
            self._to(FlowState.FAILED, status=500, reason=type(exc).__name__)
            try:
                await self._report(self.out, RouterError(500, f"internal router error: {type(exc).__name__}"))
            finally:  # the answer first: a traceback takes a while to render
                self.log.exception("request_internal_error")
        finally:
            self._account()

    def _account(self) -> None:
        e2e = self._elapsed()
        self.ctx.metrics.running(-1)
        self.ctx.metrics.request_finished(
            self.plan.route,
            self.outcome,
            self.finish_reason,
            self.prompt_tokens,
            self.completion_tokens,
            e2e,
            self.ttft_s,
            pool=self.pool,
        )
        self.log.info(
            "request_done",
            outcome=self.outcome,
            node=self.node_name,
            pool=self.pool,
            completion_tokens=self.completion_tokens,
            seconds=round(e2e, 4),
        )

    async def _report(self, out: ClientOutput, exc: RouterError) -> None:
        if self.client_gone or out.done:
            return
        if not out.started:
            await out.json(exc.status, exc.json_body(), exc.headers)
        elif self.plan.stream:
            await out.body(sse(exc.payload()) + DONE, more=False)

    # -- states ------------------------------------------------------------------------------------
    async def _run(self, out: ClientOutput) -> None:
        if self.choice.native:
            await self._native(out)
            return
        cfg = self.ctx.config
        # The native pool takes the request after overflow_wait_s (0: at once when no slot is free) if it is
        # healthy then; while it is not, the request waits on for a TileRT slot (NodeLease).
        overflow = None
        if self.choice.overflow and cfg.overflow_wait_s is not None:
            overflow = Overflow(cfg.overflow_wait_s, lambda: self.ctx.native_healthy)
        self._to(FlowState.QUEUED, queue_depth=self.ctx.pool.queue_depth)
        sampling = self._sampling()
        lease = NodeLease(
            self.ctx.pool,
            self.ctx.nodes,
            self.ctx.watches,
            self.transfer_id,
            queue_timeout_s=cfg.queue_timeout_s,
            lease_s=cfg.lease_s,
            log=self.log,
            sampling=sampling,
            overflow=overflow,
        )
        async with AsyncExitStack() as held:
            try:
                await held.enter_async_context(lease)
                self.ctx.metrics.queue_wait(lease.queued_s)
                self._to(FlowState.PREFILLING)
                pre = await lease.reserve_while(self._prefill)  # the node's reserve runs during the prefill
            except RouterError as exc:  # no TileRT slot in time (also after a node refused the reserve)
                if not lease.overflows:
                    raise
                await self._overflow(out, exc)
                return
            assert lease.node is not None
            if lease.transfer_id != self.transfer_id:  # a node refused the reserve: the retry's id
                self.transfer_id, self.log = lease.transfer_id, self.log.bind(transfer_id=lease.transfer_id)
            self.node_name = lease.node.name
            shape = self.shape(pre)
            if self.plan.parsed is not None:  # vLLM's tool / reasoning parser runs over the answer
                shape.parsing = self.plan.parsed.answer(pre)
            finish = "stop" if pre.finish_reason == "stop" else ("length" if self.plan.max_tokens == 1 else None)
            if finish is not None and self.plan.n == 1:
                await self.answer_from_prefill(out, lease, shape, pre, finish)
                return
            await self._decode(out, lease, shape, pre, sampling, finish)

    async def _decode(
        self,
        out: ClientOutput,
        lease: NodeLease,
        shape: ResponseShape,
        pre: PrefillResult,
        sampling: c.Sampling,
        first_finish: str | None = None,
    ) -> None:
        """The prefill's first token to the client, then the node's decode stream (``first_finish``: prefill's
        token already ended choice 0 of a request of several choices; the node decodes the others)."""
        self._to(
            FlowState.DECODING,
            node=self.node_name,
            slot=lease.slot,
            first_token_id=pre.first_token_id,
            prompt_tokens=pre.prompt_tokens,
        )
        request = c.DecodeRequest(
            self.transfer_id, pre.first_token_id, pre.prompt_tokens, sampling, self._prompt_ids_for_node(pre)
        )
        plan = self.plan
        loop = TokenLoop(
            self.ctx.tokenizer.tokenizer,
            pre.prompt_token_ids,
            pre.first_token_id,
            self._first_text(shape, pre, None),
            plan.stop,
            plan.include_stop_str_in_output,
            plan.skip_special_tokens,
            plan.min_tokens,
        )
        if first_finish is not None:
            loop.end(first_finish, pre.stop_reason if first_finish == "stop" else None)
        choices = Choices(loop, plan.n)
        # The node checked the sampling with the reserve; when its context also holds the request, it cannot
        # refuse the decode request for anything the client sent: stream prefill's token before asking.
        early = lease.fits(pre.prompt_tokens, sampling.max_tokens)
        if early:
            await self._first_chunk(out, shape, pre, loop)
        async with lease.client.decode(request) as lines:
            if not early:  # a refusal above is still the client's HTTP error, before any byte
                await self._first_chunk(out, shape, pre, loop)
            choices.prime()  # the detokenizers' priming, off the first token's path: the node works meanwhile
            await self._relay(out, lease, shape, pre, choices, lines)

    async def _overflow(self, out: ClientOutput, refused: RouterError) -> None:
        """No TileRT slot within overflow_wait_s: the native pool serves the request instead of a 429."""
        self.log.info("pool_overflow", to=NATIVE_POOL, reason=refused.outcome)
        self.ctx.metrics.overflowed()
        self.pool = out.pool = NATIVE_POOL
        self.log = self.log.bind(pool=self.pool, pool_reason="overflow")
        await self._native(out)

    async def _native(self, out: ClientOutput) -> None:
        """The native pool's leg: vLLM's own P/D request flow (:mod:`tilert.router.native`), in this flow's states."""
        plugin = await available_pool(self.ctx)
        self._to(FlowState.PREFILLING, pool=self.pool)
        got = await native_prefill(self.ctx, self, plugin)
        if isinstance(got, PrefillResult):  # no handoff: the prefill's one token already ended the request
            self.prompt_tokens, self.completion_tokens = got.prompt_tokens, 1
            await self.answer_from_prefill(out, None, self.shape(got), got, "stop")
            return
        self._to(FlowState.DECODING, pool=self.pool, remote_engine_id=got.remote_engine_id)
        await native_decode(self.ctx, self, plugin, got, out)
        self._to(FlowState.FINISHED, finish_reason=self.finish_reason, completion_tokens=self.completion_tokens)

    async def _prefill(self, node: PooledNode, transfer_id: str, plan: RequestPlan | None = None) -> PrefillResult:
        """vLLM's prefill (``max_tokens=1``) of ``plan`` (the request's own by default) with a claim that sends
        its KV to ``node`` as ``transfer_id``."""
        plan = plan or self.plan
        spec = node.spec
        claim = c.Claim.signed(self.ctx.config.secret, transfer_id, spec.host, spec.ctrl_port)
        t0 = anyio.current_time()
        pre = await self.ctx.prefills.call(
            lambda prefill: run_prefill(prefill, plan, claim, request_id=self.request_id),
            key=self.ctx.prefills.key(plan.body),
            request_id=self.request_id,
        )
        self.ctx.metrics.prefill(anyio.current_time() - t0)
        if plan is self.plan:
            self.prompt_tokens, self.completion_tokens = pre.prompt_tokens, 1
        return pre

    def shape(self, pre: PrefillResult) -> ResponseShape:
        route = self.plan.route
        rid = pre.response_id or f"{'chatcmpl' if route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return ResponseShape(
            route,
            rid,
            pre.created or int(time.time()),
            pre.model or self.ctx.config.model_name,
            self.plan.return_token_ids,
            ChoiceExtras.of(self.plan, pre.raw, pre.prompt_token_ids, self.ctx.tokenizer.tokenizer),
        )

    def _sampling(self, plan: RequestPlan | None = None) -> c.Sampling:
        plan = plan or self.plan
        try:
            bad_words = bad_words_token_ids(self.ctx.tokenizer.tokenizer, plan.bad_words)
        except ValueError as exc:
            raise bad_request(str(exc), "bad_words") from None
        return c.Sampling(
            max_tokens=None if plan.max_tokens is None else plan.max_tokens - 1,
            temperature=plan.temperature,
            top_p=plan.top_p,
            top_k=plan.top_k,
            seed=plan.seed,
            stop_token_ids=list(plan.stop_token_ids),
            ignore_eos=bool(plan.ignore_eos),
            min_p=plan.min_p,
            repetition_penalty=plan.repetition_penalty,
            frequency_penalty=plan.frequency_penalty,
            presence_penalty=plan.presence_penalty,
            min_tokens=plan.min_tokens,
            logit_bias=plan.logit_bias,
            allowed_token_ids=plan.allowed_token_ids,
            bad_words_token_ids=bad_words,
            grammar=plan.grammar,
            n=plan.n,
            logprobs=plan.logprobs,
        )

    def _prompt_ids_for_node(self, pre: PrefillResult) -> list[int] | None:
        """The prompt's ids when the repetition penalty (the request's or the model's default) needs them."""
        penalty = self.plan.repetition_penalty
        if penalty is None:
            penalty = self.ctx.sampling_defaults.get("repetition_penalty", 1.0)
        return pre.prompt_token_ids if penalty != 1.0 else None

    def first_token(self) -> None:
        self.ttft_s = self._elapsed()
        self.ctx.metrics.first_token(self.plan.route, self.ttft_s, self.pool)

    async def answer_from_prefill(
        self, out: ClientOutput, lease: NodeLease | None, shape: ResponseShape, pre: PrefillResult, finish: str
    ) -> None:
        """The prefill's one token is the whole answer (``lease``: the TileRT slot to free first, if any)."""
        use, ids = usage(pre.prompt_tokens, 1), [pre.first_token_id]
        stop_reason = pre.stop_reason if finish == "stop" else None
        text = self._first_text(shape, pre, finish)
        self.first_token()
        if lease is not None:
            await lease.release()
        if self.plan.stream:
            await out.start(200, list(SSE_HEADERS))
            chunk = shape.chunk(text, ids, finish, stop_reason, use if self.plan.continuous_usage else None)
            tail = sse(shape.usage_chunk(use)) if self.plan.include_usage else b""
            await out.body(sse(chunk) + tail + DONE, more=False)
        else:
            body = shape.final(text, ids, finish, stop_reason, use, pre.prompt_token_ids)
            await out.json(200, orjson.dumps(body))
        self.finish_reason = finish
        self._to(FlowState.FINISHED, finish_reason=finish, from_prefill=True)

    def _first_text(self, shape: ResponseShape, pre: PrefillResult, finish: str | None) -> str:
        """The prefill's token as text: vLLM's answer's own, or, when a parser runs over the answer, the raw text
        (the prefill's answer was parsed already)."""
        if shape.parsing is None:
            return pre.text
        return shape.parsing.first_text(self.ctx.tokenizer.tokenizer, self.plan, pre, finish)

    async def _first_chunk(self, out: ClientOutput, shape: ResponseShape, pre: PrefillResult, loop: TokenLoop) -> None:
        """Prefill's token to the client (streaming, as choice 0's first chunk) and the time to first token."""
        if self.plan.stream:
            await out.start(200, list(SSE_HEADERS))
            now = usage(pre.prompt_tokens, 1) if self.plan.continuous_usage else None
            text, ids = loop.first_delta(), [pre.first_token_id]
            await out.body(sse(shape.chunk(text, ids, loop.finish_reason, loop.stop_reason, usage_now=now)))
        self.first_token()

    async def _relay(
        self,
        out: ClientOutput,
        lease: NodeLease,
        shape: ResponseShape,
        pre: PrefillResult,
        choices: Choices,
        lines: AsyncIterator[c.TokenLine | c.ErrorLine],
    ) -> None:
        try:
            await self._relay_lines(out, shape, pre, choices, lines)
        except RouterError as exc:
            if not self._may_resume(exc, pre):
                raise
            await self._resume(out, lease, shape, pre, choices, exc)
            return
        # The node's last line came: reading to EOF keeps the connection for reuse, and at EOF the node has
        # already freed the slot (it does so before its stream ends), so no release call is needed.
        node_freed = choices.node_done and await _drain(lines)
        await self._finish(out, lease, shape, pre, choices, node_freed)

    async def _relay_lines(
        self,
        out: ClientOutput,
        shape: ResponseShape,
        pre: PrefillResult,
        choices: Choices,
        lines: AsyncIterator[c.TokenLine | c.ErrorLine],
    ) -> None:
        """The node's lines to the client until every choice ended. The stream may stay silent
        ``transfer_timeout_s`` before its first line and ``decode_idle_timeout_s`` between lines (sending to the
        client does not count): a :class:`Silence` watches it, one timer for the stream rather than one a line."""
        cfg = self.ctx.config
        with anyio.CancelScope() as scope, Silence(scope, cfg.transfer_timeout_s) as silence:
            sent_at = time.monotonic()
            while not choices.done:
                line = await self._next_line(lines, silence)
                now = time.monotonic()
                if silence.first:
                    self.ctx.metrics.transfer_wait(now - sent_at)
                delta = await self._emit(out, shape, pre, choices, line)
                self.ctx.metrics.token_gap(now - sent_at, len(delta.token_ids))
                sent_at = now
                silence.arm(cfg.decode_idle_timeout_s)
        if silence.expired:
            what = "waiting for the KV transfer and first decode step" if silence.first else "between decode tokens"
            raise RouterError(
                504, f"decode node sent nothing for {silence.limit:g} s ({what})", outcome="decode_timeout"
            )

    async def _finish(
        self,
        out: ClientOutput,
        lease: NodeLease,
        shape: ResponseShape,
        pre: PrefillResult,
        choices: Choices,
        node_freed: bool,
    ) -> None:
        use = usage(pre.prompt_tokens, choices.token_count)
        await lease.release(node_freed)  # before the last byte: a client that has its answer sees the slot free
        if self.plan.stream:
            await out.body((sse(shape.usage_chunk(use)) if self.plan.include_usage else b"") + DONE, more=False)
        else:
            answers = [
                shape.final(
                    loop.text, loop.token_ids, loop.finish_reason, loop.stop_reason, use, pre.prompt_token_ids, i
                )
                for i, loop in enumerate(choices.loops)
            ]
            await out.json(200, orjson.dumps(with_choices(answers)))
        self.finish_reason = choices.first.finish_reason
        self._to(FlowState.FINISHED, finish_reason=self.finish_reason, completion_tokens=choices.token_count)

    async def _emit(
        self, out: ClientOutput, shape: ResponseShape, pre: PrefillResult, choices: Choices, line: c.TokenLine
    ) -> Delta:
        """One node line into its choice's answer; streamed to the client at once."""
        plan = self.plan
        delta = choices.feed(line)
        self.completion_tokens = choices.token_count
        loop = choices.loops[delta.index]
        _add_logprobs(shape, line, delta, loop)
        per_token = plan.return_token_ids or plan.logprobs is not None  # a chunk for every token
        wanted = delta.text or delta.finish_reason or (delta.token_ids and per_token)
        if plan.stream and (wanted or shape.parsing is not None):  # a parser sees every delta, and may hold one
            now = usage(pre.prompt_tokens, len(loop.token_ids)) if plan.continuous_usage else None
            data = sse(
                shape.chunk(delta.text, delta.token_ids, delta.finish_reason, delta.stop_reason, now, delta.index)
            )
            if data:
                await out.body(data)
        return delta

    def _may_resume(self, exc: RouterError, pre: PrefillResult) -> bool:
        """A node that died (its stream broke) or stalled, a request that can go on elsewhere (its prompt's ids
        known), resumes left."""
        return (
            exc.outcome in (DECODE_LOST, "decode_timeout")
            and self.plan.resumable
            and bool(pre.prompt_token_ids)
            and self.resumes < self.ctx.config.decode_resumes
        )

    async def _resume(
        self,
        out: ClientOutput,
        dead: NodeLease,
        shape: ResponseShape,
        pre: PrefillResult,
        choices: Choices,
        why: RouterError,
    ) -> None:
        """The node serving this stream died or stalled: prefill the prompt and the tokens already produced again
        (vLLM's prefix cache holds most of it) for another node, and go on with the same stream from the next
        token. The dead node's slot is given back; the pool's health probe and watch take the node out and let
        it back in once it answers again."""
        self.resumes += 1  # a request of one choice: one of several is not resumed (RequestPlan.resumable)
        reason = "stalled" if why.outcome == "decode_timeout" else "lost"
        self.ctx.metrics.decode_resumed(reason)
        self._to(FlowState.RESUMING, node=self.node_name, reason=reason, tokens=choices.token_count)
        await dead.release()
        ids = [*(pre.prompt_token_ids or ()), *choices.first.token_ids]
        room = None if self.plan.max_tokens is None else self.plan.max_tokens - choices.token_count
        plan = continuation(self.plan, ids, room, choices.token_count)
        sampling = self._sampling(plan)
        self.log.warning("decode_resume", reason=reason, error=why.log_reason(), tokens=choices.token_count)
        async with NodeLease(
            self.ctx.pool,
            self.ctx.nodes,
            self.ctx.watches,
            uuid.uuid4().hex,
            queue_timeout_s=self.ctx.config.queue_timeout_s,
            lease_s=self.ctx.config.lease_s,
            log=self.log,
            sampling=sampling,
        ) as lease:
            nxt = await lease.reserve_while(lambda node, tid: self._prefill(node, tid, plan))
            assert lease.node is not None
            self.transfer_id, self.node_name = lease.transfer_id, lease.node.name
            self.log = self.log.bind(transfer_id=lease.transfer_id)
            await self._emit(out, shape, pre, choices, self._resumed_line(nxt, room))
            if choices.done:
                await self._finish(out, lease, shape, pre, choices, False)
                return
            request = c.DecodeRequest(
                lease.transfer_id, nxt.first_token_id, nxt.prompt_tokens, sampling, self._prompt_ids_for_node(nxt)
            )
            self._to(FlowState.DECODING, node=self.node_name, slot=lease.slot, resumed=self.resumes)
            async with lease.client.decode(request) as lines:
                await self._relay(out, lease, shape, pre, choices, lines)

    def _resumed_line(self, nxt: PrefillResult, room: int | None) -> c.TokenLine:
        """A resumed stream's prefill token as the node line it stands for (its finish, its logprobs)."""
        ended: c.FinishReason | None = "stop" if nxt.finish_reason == "stop" else ("length" if room == 1 else None)
        stop_id = nxt.stop_reason if isinstance(nxt.stop_reason, int) else None
        logprobs = None if self.plan.logprobs is None else [resumed_logprobs(nxt.raw, nxt.first_token_id)]
        return c.TokenLine([nxt.first_token_id], ended, stop_id, logprobs=logprobs)

    async def _next_line(self, lines: AsyncIterator[c.TokenLine | c.ErrorLine], silence: Silence) -> c.TokenLine:
        """The stream's next token line (``silence`` watches the wait); its errors as :class:`RouterError`."""
        silence.waiting = True
        try:
            line = await lines.__anext__()
        except StopAsyncIteration:
            raise RouterError(502, "decode stream ended without a finish_reason", outcome=DECODE_LOST) from None
        finally:
            silence.waiting = False
        if isinstance(line, c.ErrorLine):
            status = line.status if 400 <= line.status < 500 or line.status in (501, 504) else 502
            raise RouterError(status, f"decode failed: {line.message}", outcome="decode_error")
        if line.index >= self.plan.n:
            raise RouterError(502, f"decode node sent choice {line.index} of {self.plan.n}", outcome="decode_error")
        return line


class Silence:
    """How long a decode stream has been silent while the relay waits for its next line, as one timer a stream
    (it fires when the limit could have run out, and checks) instead of a timeout set and cleared for every line.
    Past the limit it cancels ``scope`` (:attr:`expired`)."""

    def __init__(self, scope: anyio.CancelScope, limit: float) -> None:
        self.limit = limit  # the silence allowed now
        self.since = time.monotonic()  # when the wait for the next line began (the last line came)
        self.waiting = False  # the relay is waiting for a line (not sending one to the client)
        self.first = True  # no line came yet
        self.expired = False
        self._scope = scope
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(limit, self._check)

    def __enter__(self) -> Silence:
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def arm(self, limit: float) -> None:
        """A line came (now): the next may be ``limit`` seconds away."""
        self.limit, self.since, self.first = limit, time.monotonic(), False

    def _check(self) -> None:
        left = self.since + self.limit - time.monotonic()
        if left <= 0 and self.waiting:
            self.expired = True
            self._scope.cancel()
            return
        self._timer = self._loop.call_later(left if left > 0 else self.limit, self._check)


def _add_logprobs(shape: ResponseShape, line: c.TokenLine, delta: Delta, loop: TokenLoop) -> None:
    """The logprobs of the tokens a node line added to the answer (those its delta kept), when asked."""
    logprobs = shape.extras.logprobs if shape.extras is not None else None
    if logprobs is None or not delta.token_ids:
        return
    if line.logprobs is None:
        raise RouterError(502, "the decode node sent tokens without their logprobs", outcome="decode_error")
    n = len(delta.token_ids)
    logprobs.add(delta.token_ids, line.logprobs[:n], loop.token_ids[:-n])


async def _drain(lines: AsyncIterator[c.TokenLine | c.ErrorLine]) -> bool:
    """Read the stream to its end (within 0.5 s); whether it ended cleanly."""
    with anyio.move_on_after(0.5):
        async for _ in lines:
            return False  # nothing may follow the last line
        return True
    return False
