"""Scheduler half of the connector (lives in vLLM's EngineCore process).

It never changes scheduling: it reports no external tokens, keeps no blocks alive, and only notes which
claimed request's prompt completes in the step being built, so the worker stages it then.
``request_finished`` returns the first sampled token and the prompt length to the router, inside the
``kv_transfer_params`` of the non-streaming HTTP response.

It also accounts the worker's staging pool (see :mod:`tilert.connector.staging`): in the step that
completes a claimed prompt it places the prompt's extent (first fit) and tells the worker where
(``SaveRequest.offset``). A claim that finds no room is not staged at all, and ``request_finished`` says so
(``busy``): the router answers 503 with ``Retry-After`` before anything reached its client. Extents come
back when the worker reports them freed (``update_connector_output``); until then the scheduler counts them
as used, so its view may be stale only in the safe direction (a claim refused a step early, never two
requests in one extent), and ``has_pending_push_work`` keeps vLLM stepping while any is out, so the reports
arrive even when no new request does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from tilert.connector.claims import (
    Claim,
    ClaimError,
    SaveRequest,
    TileRTConnectorMetadata,
    TileRTWorkerMeta,
    parse_claim,
)
from tilert.connector.staging import ExtentAllocator
from tilert.contracts import ClaimResult

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = structlog.get_logger("tilert.connector.scheduler")


@dataclass
class _Pending:
    claim: Claim
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    last_token_id: int | None = None


@dataclass(frozen=True)
class _Refusal:
    reason: str
    busy: bool


class SchedulerSide:
    def __init__(
        self,
        block_size: int,
        secret: bytes,
        *,
        bytes_per_token: int,
        pool_bytes: int,
        workers: int = 1,
        retry_after_s: int = 1,
    ) -> None:
        """``workers``: how many worker ranks stage each save (each reports its extents freed once; an
        extent is free again when all of them have)."""
        self.block_size = block_size
        self._secret = secret
        self.bytes_per_token = bytes_per_token
        self.pool = ExtentAllocator(pool_bytes)
        self._workers = max(1, workers)
        self._retry_after_s = retry_after_s
        self._pending: dict[str, _Pending] = {}  # claimed, prompt not yet fully computed
        self._extents: dict[tuple[str, int], int] = {}  # (req_id, offset) -> workers that freed it so far
        self._refused: dict[str, _Refusal] = {}  # claimed but not staged, until request_finished

    def claim_of(self, req_id: str, params: dict[str, Any] | None) -> Claim | None:
        """Marked requests with unusable or unsigned fields are not claimed; ``request_finished`` says why."""
        try:
            return parse_claim(params, self._secret)
        except ClaimError as exc:
            log.warning("claim_refused", req_id=req_id, reason=str(exc))
            return None

    def build_meta(self, out: SchedulerOutput) -> TileRTConnectorMetadata:
        meta = TileRTConnectorMetadata()
        for new in out.scheduled_new_reqs:
            extra = new.sampling_params.extra_args if new.sampling_params else None
            claim = self.claim_of(new.req_id, (extra or {}).get("kv_transfer_params"))
            if claim is None:
                continue
            prompt = new.prompt_token_ids or []
            last = int(prompt[-1]) if len(prompt) else None
            pending = _Pending(claim, len(prompt), list(new.block_ids[0]), last)
            self._pending[new.req_id] = pending
            self._maybe_save(meta, new.req_id, new.num_computed_tokens, out)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            found = self._pending.get(req_id)
            if found is None:
                continue
            pending = found
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    pending.block_ids = list(new_blocks[0])
                else:
                    pending.block_ids.extend(new_blocks[0])
            self._maybe_save(meta, req_id, cached.num_computed_tokens[i], out)
        # A step that schedules no token and finishes no request runs only because a connector has work pending:
        # paced (WorkerSide.flush). The one after a request finished tells the workers so, and is not: nothing
        # holds it back, and a request arriving meanwhile must not wait behind it (unclaimed ones included).
        meta.poll = not meta.saves and not any(out.num_scheduled_tokens.values()) and not out.finished_req_ids
        return meta

    def _maybe_save(self, meta: TileRTConnectorMetadata, req_id: str, computed: int, out: SchedulerOutput) -> None:
        """Emit the save in the step whose scheduled tokens complete the prompt (chunked prefill), into an
        extent of the staging pool; without room, refuse the claim at once."""
        pending = self._pending[req_id]
        if computed + out.num_scheduled_tokens.get(req_id, 0) < pending.num_prompt_tokens:
            return
        del self._pending[req_id]
        tid, tokens = pending.claim.transfer_id, pending.num_prompt_tokens
        nbytes = tokens * self.bytes_per_token
        if nbytes > self.pool.capacity:
            self._refuse(
                req_id,
                tid,
                busy=False,
                reason=(
                    f"a prompt of {tokens} tokens needs {nbytes} bytes of KV staging, more than the whole "
                    f"{self.pool.capacity}-byte pool (raise tilert_staging_bytes)"
                ),
            )
            return
        offset = self.pool.alloc(nbytes)
        if offset is None:
            self._refuse(
                req_id,
                tid,
                busy=True,
                reason=(
                    f"KV staging pool full: {self.pool.used} of {self.pool.capacity} bytes held by "
                    f"{self.pool.live} transfers in flight, {nbytes} needed"
                ),
            )
            return
        self._extents[(req_id, offset)] = 0
        meta.saves.append(
            SaveRequest(
                req_id, pending.claim, pending.block_ids, self.block_size, tokens, offset, pending.last_token_id
            )
        )

    def _refuse(self, req_id: str, tid: str, *, busy: bool, reason: str) -> None:
        self._refused[req_id] = _Refusal(reason, busy)
        log.warning("claim_not_staged", req_id=req_id, transfer_id=tid, busy=busy, reason=reason)

    def update(self, output: KVConnectorOutput) -> None:
        """The workers' reports of a step: extents they are done with go back to the pool."""
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, TileRTWorkerMeta):
            return
        for req_id, offset in meta.freed:
            key = (req_id, offset)
            reports = self._extents.get(key)
            if reports is None:
                log.error("staging_extent_unknown", req_id=req_id, offset=offset)
                continue
            if reports + 1 < self._workers:
                self._extents[key] = reports + 1
                continue
            del self._extents[key]
            self.pool.free(offset)

    def pool_snapshot(self) -> dict[str, int]:
        """The pool as this half accounts it (the keys of ``tilert.connector.stats.GAUGES``)."""
        return {"capacity_bytes": self.pool.capacity, "used_bytes": self.pool.used, "in_flight": self.pool.live}

    def has_pending_work(self) -> bool:
        """Extents still out: vLLM must keep stepping so the workers' reports come back."""
        return bool(self._extents)

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        self._pending.pop(request.request_id, None)
        refusal = self._refused.pop(request.request_id, None)
        try:
            claim = parse_claim(request.kv_transfer_params, self._secret)
        except ClaimError as exc:
            return ClaimResult(error=str(exc)).to_params()
        if claim is None:
            return None
        out = request.output_token_ids
        result = ClaimResult(
            transfer_id=claim.transfer_id,
            first_token_id=int(out[0]) if len(out) else None,
            prompt_tokens=int(request.num_prompt_tokens),
        )
        if refusal is not None:
            result.error = refusal.reason
            if refusal.busy:
                result.busy, result.retry_after_s = True, self._retry_after_s
        return result.to_params()
