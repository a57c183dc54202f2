"""Scheduler half of the connector (lives in vLLM's EngineCore process).

It never changes scheduling: it reports no external tokens, keeps no blocks alive, and only notes
which claimed request's prompt completes in the step being built, so the worker stages it then.
``request_finished`` returns the first sampled token and the prompt length to the router, inside the
``kv_transfer_params`` of the non-streaming HTTP response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from tilert.connector.claims import Claim, ClaimError, SaveRequest, TileRTConnectorMetadata, parse_claim
from tilert.contracts import ClaimResult

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = structlog.get_logger("tilert.connector.scheduler")


@dataclass
class _Pending:
    claim: Claim
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)


class SchedulerSide:
    def __init__(self, block_size: int, secret: bytes) -> None:
        self.block_size = block_size
        self._secret = secret
        self._pending: dict[str, _Pending] = {}  # claimed, prompt not yet fully computed

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
            pending = _Pending(claim, len(new.prompt_token_ids or []), list(new.block_ids[0]))
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
        return meta

    def _maybe_save(self, meta: TileRTConnectorMetadata, req_id: str, computed: int, out: SchedulerOutput) -> None:
        """Emit the save in the step whose scheduled tokens complete the prompt (chunked prefill)."""
        pending = self._pending[req_id]
        if computed + out.num_scheduled_tokens.get(req_id, 0) < pending.num_prompt_tokens:
            return
        del self._pending[req_id]
        meta.saves.append(
            SaveRequest(req_id, pending.claim, pending.block_ids, self.block_size, pending.num_prompt_tokens)
        )
        log.info("save_scheduled", req_id=req_id, transfer_id=pending.claim.transfer_id,
                 tokens=pending.num_prompt_tokens)  # fmt: skip

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        self._pending.pop(request.request_id, None)
        try:
            claim = parse_claim(request.kv_transfer_params, self._secret)
        except ClaimError as exc:
            return ClaimResult(error=str(exc)).to_params()
        if claim is None:
            return None
        out = request.output_token_ids
        return ClaimResult(
            transfer_id=claim.transfer_id,
            first_token_id=int(out[0]) if len(out) else None,
            prompt_tokens=int(request.num_prompt_tokens),
        ).to_params()
