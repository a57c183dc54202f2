"""What a transport is: something that moves bytes into a region its receiver registered up front.

Transports know nothing of requests, layouts or engines. The decode node's ``Receiver`` registers its
buffers once at start, then *grants* a window of one region per accepted transfer; the grant becomes
the ``target`` of the protocol's ``Accept`` message. The prefill side's ``Sender`` writes a staged
buffer into that target (one-sided, like an RDMA write) and returns only when the bytes have landed,
so the sender may then announce ``Done`` on the control channel. A revoked grant refuses late writers.

Transports are plugins: registered under the ``tilert.transports`` entry-point group.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class TransferError(RuntimeError):
    """A write could not be completed (peer gone, grant revoked, out of bounds, timeout)."""


class Receiver(ABC):
    """Decode side: owns registered memory and hands out write grants."""

    @abstractmethod
    def register(self, buffer: torch.Tensor) -> int:
        """Register a contiguous uint8 buffer once; returns its region id."""

    @abstractmethod
    def grant(self, region: int, offset: int, nbytes: int) -> dict[str, Any]:
        """Allow one peer to write ``nbytes`` at ``offset`` of ``region``; returns the write target."""

    @abstractmethod
    def revoke(self, target: dict[str, Any]) -> None:
        """Withdraw a grant: later writes to it fail. Idempotent."""

    @abstractmethod
    def close(self) -> None: ...


class Sender(ABC):
    """Prefill side: writes staged bytes into a granted target."""

    @abstractmethod
    def write(self, target: dict[str, Any], data: torch.Tensor) -> None:
        """Write contiguous uint8 ``data`` to ``target``; returns once it has landed, else raises
        ``TransferError``."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    """A named factory for the two ends."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def receiver(cls, *, host: str, options: dict[str, Any]) -> Receiver: ...

    @classmethod
    @abstractmethod
    def sender(cls, *, options: dict[str, Any]) -> Sender: ...
