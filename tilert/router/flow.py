"""The per-request state machine: reserve a slot, prefill, first token, decode stream, finish or fail.

Every path out (success, error, timeout, client disconnect) runs :meth:`RequestFlow._cleanup`, shielded
from cancellation: it cancels a decode that is still running, releases the reservation on the node, and
returns the slot to the pool. On answered paths it runs before the response's last byte (bounded by
``_SETTLE_BUDGET_S``), so a client that sees the end of its answer also sees the slot free. The client always gets either a complete answer, an HTTP error with a
reason, or (once streaming began) a final ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
import structlog
from starlette.types import Send

from tilert.router.context import RouterContext
from tilert.router.decode_node import NodeFull, NodeUnreachable
from tilert.router.detokenize import IncrementalDecoder, OutputText
from tilert.router.errors import RouterError
from tilert.router.openai_format import DONE, ResponseShape, sse, usage
from tilert.router.pool import DecodeNode
from tilert.router.prefill import PrefillResult, run_prefill
from tilert.router.validation import RequestPlan

_log = structlog.get_logger("tilert.router.flow")

_SETTLE_BUDGET_S = 1.0

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
JSON_HEADERS = [(b"content-type", b"application/json")]


class State(enum.Enum):
    RECEIVED = "received"
    QUEUED = "queued"
    RESERVED = "reserved"
    PREFILLING = "prefilling"
    FIRST_TOKEN = "first_token"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RequestFlow:
    """One client request through the TileRT pool."""

    def __init__(self, ctx: RouterContext, plan: RequestPlan, request_id: str, arrived: float) -> None:
        self.ctx = ctx
        self.plan = plan
        self.request_id = request_id
        self.arrived = arrived
        self.transfer_id = uuid.uuid4().hex
        self.state = State.RECEIVED
        self.node: DecodeNode | None = None
        self.node_name: str | None = None
        self.reserved = False
        self.decode_started = False
        self.decode_finished_by_node = False
        self.response_started = False
        self.response_done = False
        self.client_gone = False
        self.outcome = "ok"
        self.completion_tokens = 0
        self.log = _log.bind(transfer_id=self.transfer_id, route=plan.route, stream=plan.stream)

    # -- bookkeeping -------------------------------------------------------------------------------
    def _to(self, state: State, **fields: Any) -> None:
        self.log.info("request_state", state=state.value, previous=self.state.value, **fields)
        self.state = state

    def _elapsed(self) -> float:
        return anyio.current_time() - self.arrived

    # -- ASGI output -------------------------------------------------------------------------------
    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.response_started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Send, data: bytes, more: bool = True) -> None:
        if not more:
            self.response_done = True
        await send({"type": "http.response.body", "body": data, "more_body": more})

    async def _send_json(self, send: Send, status: int, payload: bytes, extra: dict[str, str] | None = None) -> None:
        headers = list(JSON_HEADERS)
        for k, v in (extra or {}).items():
            headers.append((k.lower().encode(), v.encode()))
        await self._start(send, status, headers)
        await self._body(send, payload, more=False)

    # -- entry -------------------------------------------------------------------------------------
    async def run(self, send: Send) -> None:
        try:
            await self._run(send)
        except RouterError as exc:
            self.outcome = exc.outcome
            self._to(State.FAILED, status=exc.status, reason=exc.message)
            await self._settle()
            await self._report_error(send, exc)
        except anyio.get_cancelled_exc_class():
            self.outcome = "client_disconnected" if self.client_gone else "cancelled"
            self._to(State.CANCELLED, reason=self.outcome)
            raise
        except Exception as exc:  # noqa: BLE001 - the client must still get an answer
            self.outcome = "internal_error"
            self.log.exception("request_internal_error")
            self._to(State.FAILED, status=500, reason=f"{type(exc).__name__}: {exc}")
            await self._settle()
            await self._report_error(send, RouterError(500, f"internal router error: {type(exc).__name__}"))
        finally:
            with anyio.CancelScope(shield=True):
                await self._cleanup(self.ctx.config.control_timeout_s, final=True)
            self.ctx.metrics.requests.labels(self.plan.route, self.outcome).inc()
            self.log.info(
                "request_done",
                outcome=self.outcome,
                node=self.node_name,
                completion_tokens=self.completion_tokens,
                seconds=round(self._elapsed(), 4),
            )

    async def _report_error(self, send: Send, exc: RouterError) -> None:
        if self.client_gone:
            return
        if not self.response_started:
            await self._send_json(send, exc.status, exc.json_body(), exc.headers)
        elif self.plan.stream:
            await self._body(send, sse(exc.payload()) + DONE, more=False)
        else:  # pragma: no cover - non-streaming bodies are sent in one piece
            await self._body(send, b"", more=False)

    # -- states ------------------------------------------------------------------------------------
    async def _run(self, send: Send) -> None:
        cfg = self.ctx.config
        self._to(State.QUEUED, queue_depth=self.ctx.pool.queue_depth)
        deadline = anyio.current_time() + cfg.queue_timeout_s
        queued_at = anyio.current_time()
        slot = await self._reserve(deadline)
        self.ctx.metrics.queue_wait.observe(anyio.current_time() - queued_at)
        assert self.node is not None
        self._to(State.RESERVED, node=self.node.name, slot=slot)

        self._to(State.PREFILLING)
        t0 = anyio.current_time()
        pre = await run_prefill(
            self.ctx.prefill,
            self.plan,
            transfer_id=self.transfer_id,
            node_host=self.node.spec.host,
            node_ctrl_port=self.node.spec.ctrl_port,
            request_id=self.request_id,
            api_key=cfg.prefill_api_key,
        )
        self.ctx.metrics.prefill.observe(anyio.current_time() - t0)
        self.completion_tokens = 1
        self._check_context(pre.prompt_tokens)
        shape = ResponseShape(
            self.plan.route,
            pre.response_id or f"{'chatcmpl' if self.plan.route == 'chat' else 'cmpl'}-{uuid.uuid4().hex}",
            pre.created or int(time.time()),
            pre.model or cfg.model_name,
            self.plan.return_token_ids,
        )
        finish: str | None = None
        stop_reason: str | int | None = None
        if pre.finish_reason == "stop":
            finish, stop_reason = "stop", pre.stop_reason
        elif self.plan.max_tokens == 1:
            finish = "length"
        self._to(State.FIRST_TOKEN, first_token_id=pre.first_token_id, prompt_tokens=pre.prompt_tokens,
                 finish_reason=finish, prefill_s=round(anyio.current_time() - t0, 4))
        if finish is not None:
            await self._answer_from_prefill(send, shape, pre, finish, stop_reason)
            return
        await self._decode(send, shape, pre)

    def _check_context(self, prompt_tokens: int) -> None:
        """vLLM validated the prompt with max_tokens=1; apply the real budget against the context here."""
        limit = self.ctx.config.max_model_len
        if limit is None or prompt_tokens + self.plan.max_tokens <= limit:
            return
        if self.plan.max_tokens_defaulted:
            self.plan.max_tokens = max(1, limit - prompt_tokens)
            return
        raise RouterError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + self.plan.max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{self.plan.max_tokens} in the completion). Please reduce the length of the messages or completion.",
            outcome="bad_request",
            param="max_tokens",
        )

    async def _reserve(self, deadline: float) -> int | None:
        pool = self.ctx.pool
        front = False
        while True:
            node = await pool.acquire(deadline, front=front)
            self.node = node
            self.node_name = node.name
            client = self.ctx.node_client(node)
            try:
                slot = await client.reserve(self.transfer_id, self.ctx.config.reserve_lease_s)
            except NodeFull as exc:
                self.log.info("reserve_full", node=node.name, reason=str(exc))
                self.node = None
                pool.give_back(node, saturated=True)
                front = True
                continue
            except NodeUnreachable as exc:
                self.node = None
                pool.mark_unhealthy(node, str(exc))
                pool.give_back(node)
                front = True
                continue
            self.reserved = True
            return slot

    async def _answer_from_prefill(
        self, send: Send, shape: ResponseShape, pre: PrefillResult, finish: str, stop_reason: str | int | None
    ) -> None:
        use = usage(pre.prompt_tokens, 1)
        ids = [pre.first_token_id]
        if self.plan.stream:
            await self._start(send, 200, list(SSE_HEADERS))
            self.ctx.metrics.ttft.labels(self.plan.route).observe(self._elapsed())
            out = shape.chunk(pre.text, ids, finish, stop_reason, use if self.plan.continuous_usage else None)
            tail = sse(shape.usage_chunk(use)) if self.plan.include_usage else b""
            await self._body(send, sse(out))
            await self._settle()
            await self._body(send, tail + DONE, more=False)
        else:
            self.ctx.metrics.ttft.labels(self.plan.route).observe(self._elapsed())
            body = shape.final(pre.text, ids, finish, stop_reason, use, pre.prompt_token_ids)
            await self._settle()
            await self._send_json(send, 200, orjson.dumps(body))
        self.ctx.metrics.generated_tokens.inc()
        self._to(State.FINISHED, finish_reason=finish, from_prefill=True)

    async def _decode(self, send: Send, shape: ResponseShape, pre: PrefillResult) -> None:
        plan, metrics = self.plan, self.ctx.metrics
        bundle = self.ctx.tokenizer
        out = OutputText(plan.stop, plan.include_stop_str_in_output)
        out.text = pre.text  # vLLM already applied stop strings to the first token
        token_ids = [pre.first_token_id]
        if plan.stream:
            await self._start(send, 200, list(SSE_HEADERS))
            first = shape.chunk(out.delta(False), [pre.first_token_id],
                                usage_now=usage(pre.prompt_tokens, 1) if plan.continuous_usage else None)
            await self._body(send, sse(first))
        metrics.ttft.labels(plan.route).observe(self._elapsed())

        decoder = IncrementalDecoder(bundle.tokenizer, pre.prompt_token_ids, plan.skip_special_tokens)
        decoder.step(pre.first_token_id)
        stop_ids = set(plan.stop_token_ids)
        eos_ids = set() if plan.ignore_eos else set(bundle.eos_token_ids)
        finish: str | None = None
        stop_reason: str | int | None = None

        assert self.node is not None
        payload = plan.decode_body(self.transfer_id, pre.first_token_id, pre.prompt_tokens)
        self._to(State.DECODING, node=self.node.name, max_tokens=payload["max_tokens"])
        sent_at = anyio.current_time()
        self.decode_started = True
        async with self.ctx.node_client(self.node).decode(payload) as lines:
            last = sent_at
            first_line = True
            try:
                while finish is None:
                    obj = await self._next_line(lines, first_line)
                    now = anyio.current_time()
                    if "error" in obj:
                        self.decode_finished_by_node = True
                        raise self._decode_error(obj["error"])
                    new_ids = _token_ids(obj)
                    if first_line:
                        metrics.transfer_wait.observe(now - sent_at)
                        first_line = False
                    elif new_ids:
                        gap = (now - last) / len(new_ids)
                        for _ in new_ids:
                            metrics.itl.observe(gap)
                    if new_ids:
                        last = now
                    accepted: list[int] = []
                    for tid in new_ids:
                        if len(token_ids) >= plan.max_tokens:
                            finish = "length"
                            break
                        token_ids.append(tid)
                        accepted.append(tid)
                        if tid in eos_ids or tid in stop_ids:
                            # The node stops on these itself; closing the stream is enough.
                            self.decode_finished_by_node = True
                            finish = "stop"
                            stop_reason = None if tid in eos_ids else tid
                            if plan.include_stop_str_in_output:
                                out.add(decoder.step(tid))
                            break
                        hit = out.add(decoder.step(tid))
                        if hit is not None:
                            finish, stop_reason = "stop", hit
                            break
                        if len(token_ids) >= plan.max_tokens:
                            self.decode_finished_by_node = True
                            finish = "length"
                            break
                    node_finish = obj.get("finish_reason")
                    if node_finish is not None:
                        self.decode_finished_by_node = True
                        if finish is None:
                            if node_finish not in ("stop", "length"):
                                raise RouterError(502, f"decode node finished with {node_finish!r}",
                                                  outcome="decode_error")
                            finish = node_finish
                    self.completion_tokens = len(token_ids)
                    if plan.stream:
                        delta = out.delta(finish is not None)
                        if delta or finish is not None or (accepted and plan.return_token_ids):
                            chunk = shape.chunk(
                                delta,
                                accepted,
                                finish,
                                stop_reason,
                                usage(pre.prompt_tokens, len(token_ids)) if plan.continuous_usage else None,
                            )
                            await self._body(send, sse(chunk))
            finally:
                await lines.aclose()  # type: ignore[attr-defined]

        metrics.generated_tokens.inc(len(token_ids))
        self.completion_tokens = len(token_ids)
        use = usage(pre.prompt_tokens, len(token_ids))
        await self._settle()
        if plan.stream:
            tail = sse(shape.usage_chunk(use)) if plan.include_usage else b""
            await self._body(send, tail + DONE, more=False)
        else:
            body = shape.final(out.text, token_ids, finish, stop_reason, use, pre.prompt_token_ids)
            await self._send_json(send, 200, orjson.dumps(body))
        self._to(State.FINISHED, finish_reason=finish, completion_tokens=len(token_ids),
                 decode_s=round(anyio.current_time() - sent_at, 4))

    async def _next_line(self, lines: AsyncIterator[dict[str, Any]], first: bool) -> dict[str, Any]:
        cfg = self.ctx.config
        limit = cfg.transfer_timeout_s if first else cfg.decode_idle_timeout_s
        try:
            with anyio.fail_after(limit):
                return await lines.__anext__()
        except TimeoutError:
            what = "waiting for the KV transfer and first decode step" if first else "between decode tokens"
            raise RouterError(504, f"decode node sent nothing for {limit:g} s ({what})",
                              outcome="decode_timeout") from None
        except StopAsyncIteration:
            raise RouterError(502, "decode stream ended without a finish_reason", outcome="decode_error") from None

    def _decode_error(self, err: Any) -> RouterError:
        message = err.get("message") if isinstance(err, dict) else str(err)
        code = err.get("code") if isinstance(err, dict) else None
        status = code if isinstance(code, int) and (400 <= code < 500 or code in (501, 504)) else 502
        return RouterError(status, f"decode failed: {message}", outcome="decode_error")

    # -- cleanup -----------------------------------------------------------------------------------
    async def _settle(self) -> None:
        """Cancel/release before the last byte goes out; anything slower is finished by the final cleanup."""
        with anyio.CancelScope(shield=True):
            await self._cleanup(min(_SETTLE_BUDGET_S, self.ctx.config.control_timeout_s), final=False)

    async def _cleanup(self, budget_s: float, *, final: bool) -> None:
        node = self.node
        if node is None:
            return
        client = self.ctx.node_client(node)
        with anyio.move_on_after(budget_s):
            if self.decode_started and not self.decode_finished_by_node:
                try:
                    await client.cancel(self.transfer_id)
                    self.log.info("decode_cancelled", node=node.name)
                except Exception as exc:  # noqa: BLE001
                    self.log.warning("decode_cancel_failed", node=node.name, error=f"{type(exc).__name__}: {exc}")
                self.decode_finished_by_node = True
            if self.reserved:
                try:
                    await client.release(self.transfer_id)
                    self.log.debug("slot_released", node=node.name)
                except Exception as exc:  # noqa: BLE001
                    self.log.warning("slot_release_failed", node=node.name, error=f"{type(exc).__name__}: {exc}")
                self.reserved = False
        settled = not self.reserved and (not self.decode_started or self.decode_finished_by_node)
        if settled or final:
            if not settled:
                self.log.warning("slot_cleanup_timed_out", node=node.name)
            self.node = None
            self.ctx.pool.give_back(node)


def _token_ids(obj: dict[str, Any]) -> list[int]:
    ids = obj.get("token_ids")
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RouterError(502, "decode node sent token_ids that are not a list of ints", outcome="decode_error")
    return ids
