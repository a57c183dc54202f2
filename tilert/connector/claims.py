"""Which requests the connector claims, and what the scheduler tells the worker about them.

A request is claimed only when its ``kv_transfer_params`` carry ``tilert_host``; every other request
is left strictly alone. This module is pure data: no vLLM imports beyond the metadata base class, so
it is easy to test and to reason about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

_TRANSFER_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


class ClaimError(ValueError):
    """A request was marked for tilert but its parameters are unusable."""


@dataclass(frozen=True)
class Claim:
    """The routing facts of one claimed request, parsed from ``kv_transfer_params``."""

    transfer_id: str
    host: str
    ctrl_port: int

    @staticmethod
    def parse(params: dict[str, Any] | None) -> "Claim | None":
        """``None`` for an unmarked request; ``ClaimError`` for a marked one with bad fields."""
        if not params or "tilert_host" not in params:
            return None
        host, port, tid = params.get("tilert_host"), params.get("tilert_ctrl_port"), params.get("tilert_transfer_id")
        if not isinstance(host, str) or not host:
            raise ClaimError("tilert_host must be a non-empty string")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ClaimError("tilert_ctrl_port must be an integer port number")
        if not isinstance(tid, str) or not _TRANSFER_ID.match(tid):
            raise ClaimError("tilert_transfer_id must be 1-128 characters of [A-Za-z0-9_.:-]")
        return Claim(transfer_id=tid, host=host, ctrl_port=port)


@dataclass(frozen=True)
class SaveRequest:
    """Worker instruction: stage the prompt KV of ``req_id`` during this step's forward and ship it."""

    req_id: str
    claim: Claim
    block_ids: list[int]
    block_size: int
    num_tokens: int

    def slot_ids(self) -> list[int]:
        """Cache slot of every prompt position: ``block_id * block_size + offset``."""
        bs = self.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(self.num_tokens)]


@dataclass
class TileRTConnectorMetadata(KVConnectorMetadata):
    saves: list[SaveRequest] = field(default_factory=list)
