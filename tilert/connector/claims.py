"""Which requests the connector claims, what the scheduler tells the worker about them, and what the
worker tells the scheduler back (staging extents it is done with).

A request is claimed only when its ``kv_transfer_params`` carry a ``tilert_*`` claim signed with the
deployment's secret; every other request is left strictly alone. This module is pure data: no vLLM
imports beyond the metadata base class, so it is easy to test and to reason about.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from tilert.contracts import Claim, ContractError

__all__ = ["Claim", "ClaimError", "SaveRequest", "TileRTConnectorMetadata", "TileRTWorkerMeta", "parse_claim"]


class ClaimError(ValueError):
    """A request carries ``tilert_*`` keys the connector will not act on (malformed or unsigned)."""


def parse_claim(params: dict[str, Any] | None, secret: bytes) -> Claim | None:
    """``None`` for a request that is not ours; ``ClaimError`` for a malformed or unsigned claim.

    Only a claim signed with the deployment's secret (the router's) is acted on: a client that sends
    ``tilert_*`` keys straight to vLLM cannot make the prefill node connect anywhere."""
    try:
        claim = Claim.from_params(params)
    except ContractError as exc:
        raise ClaimError(str(exc)) from None
    if claim is not None and not claim.verified(secret):
        raise ClaimError("claim not signed with this deployment's secret")
    return claim


@dataclass(frozen=True)
class SaveRequest:
    """Worker instruction: stage the prompt KV of ``req_id`` during this step's forward, into the staging
    pool's extent at byte ``offset`` (placed by the scheduler), and ship it."""

    req_id: str
    claim: Claim
    block_ids: list[int]
    block_size: int
    num_tokens: int
    offset: int = 0
    last_token_id: int | None = None  # the prompt's last token (the offer carries it to the engine)

    def slot_ids(self) -> list[int]:
        """Cache slot of every prompt position: ``block_id * block_size + offset``."""
        bs = self.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(self.num_tokens)]


@dataclass
class TileRTConnectorMetadata(KVConnectorMetadata):
    """``saves``: the prompts to stage in this step. ``poll``: the step schedules no token and tells the workers of
    no finished request: vLLM runs it only because a connector has work pending (our transfers in flight,
    ``has_pending_push_work``, or NixlConnector's blocks held for a remote decode); the worker paces such steps
    (see ``WorkerSide.flush``)."""

    saves: list[SaveRequest] = field(default_factory=list)
    poll: bool = False


@dataclass
class TileRTWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step that has news: the staging extents (``(req_id, offset)``) whose
    transfer is over, whatever its outcome, so the scheduler may place new extents there. vLLM aggregates
    the workers' metadata of a step (one per rank) with :meth:`aggregate` before the scheduler sees it."""

    freed: list[tuple[str, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, TileRTWorkerMeta):
            return TileRTWorkerMeta(self.freed + other.freed)
        return self
