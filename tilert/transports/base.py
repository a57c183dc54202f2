"""What a transport is: something that moves bytes into a region its receiver registered up front.

Transports know nothing of requests, layouts or engines. The decode node's ``Receiver`` registers its
buffers once at start, then *grants* a window of one region per accepted transfer; the grant becomes
the ``target`` of the protocol's ``Accept`` message. The prefill side's ``Sender`` writes staged bytes
into that target (one-sided, like an RDMA write), whole or in pieces at offsets inside the grant (one
layer at a time while prefill still computes the next), and each ``write`` returns only when its bytes
have landed, so the sender may announce ``Done`` on the control channel after the last one. A revoked
grant refuses late writers. The sender registers its staging memory once (``register_source``), as an
RDMA NIC needs its source registered.

Transports are plugins: registered under the ``tilert.transports`` entry-point group.
"""

from __future__ import annotations

import bisect
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

    def verify(self, target: dict[str, Any]) -> None:
        """Before the bytes of a live grant are trusted (the sender's ``Done``): raise ``TransferError`` when
        this receiver cannot vouch for them, i.e. it saw no completion of a write to the grant, or a late
        writer of a revoked grant overlapped its window. The default trusts the sender's ``Done``: right for
        transports whose ``write`` succeeds only once the receiver has put the bytes in a live grant (tcp)."""
        return None

    @abstractmethod
    def close(self) -> None: ...


class Sender(ABC):
    """Prefill side: writes staged bytes into a granted target."""

    def register_source(self, buffer: torch.Tensor) -> None:
        """Register a staging buffer that later writes read from, once, at start-up (an RDMA NIC reads
        only registered memory; registering per write costs too much). Raises ``TransferError`` when the
        transport cannot register it. The default has nothing to do (a transport that copies, like tcp)."""
        return None

    @abstractmethod
    def write(self, target: dict[str, Any], data: torch.Tensor, offset: int = 0) -> None:
        """Write contiguous uint8 ``data`` at byte ``offset`` of ``target``'s grant; returns once it has
        landed, else raises ``TransferError``. ``[offset, offset + len(data))`` must lie inside the grant
        (:func:`check_bounds`); several writes at different offsets may fill one grant."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    """A named factory for the two ends."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def receiver(cls, *, host: str, options: dict[str, Any], advertise: str | None = None) -> Receiver:
        """The decode side: ``host`` is the address it binds, ``advertise`` the one its write targets name for
        the sender to reach it at (unset: ``host``; a decode node bound to every interface gives it)."""

    @classmethod
    @abstractmethod
    def sender(cls, *, options: dict[str, Any]) -> Sender: ...


def target_field(target: dict[str, Any], name: str, kind: type, transport: str) -> Any:
    """``target[name]`` (a grant's write target) if it is a ``kind`` (never a bool), else ``TransferError``."""
    value = target.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TransferError(f"{transport} target lacks a valid {name!r}")
    return value


def check_bounds(grant_nbytes: int, offset: int, n: int) -> None:
    """A write of ``n`` bytes at ``offset`` must stay inside a grant of ``grant_nbytes``."""
    if offset < 0 or n < 0:
        raise TransferError(f"write of {n} bytes at offset {offset}: negative offset or size")
    if offset + n > grant_nbytes:
        what = f"write of {n} bytes" + (f" at offset {offset}" if offset else "")
        raise TransferError(f"{what} exceeds the {grant_nbytes}-byte grant")


def check_receive_buffer(buffer: torch.Tensor, transport: str) -> None:
    """What a receiver registers: one contiguous uint8 host buffer."""
    if buffer.device.type != "cpu" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise ValueError(f"{transport} transport registers contiguous uint8 CPU buffers only")


def check_window(buffer: torch.Tensor, offset: int, nbytes: int) -> None:
    """A grant's window must lie inside its registered region."""
    if offset < 0 or nbytes < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"grant [{offset}, {offset + nbytes}) outside region of {buffer.numel()} bytes")


class Coverage:
    """Which bytes of a grant completed writes have covered: a union of ``[start, end)`` ranges, for
    receivers that vouch for a grant only once every byte of it was reported written (``verify``)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)  # first range that ends at or after ``start``
        j = bisect.bisect_right(self._starts, end)  # ranges [i, j) touch [start, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def covers(self, nbytes: int) -> bool:
        """Whether ``[0, nbytes)`` is covered."""
        return nbytes <= 0 or (bool(self._starts) and self._starts[0] == 0 and self._ends[0] >= nbytes)

    @property
    def extent(self) -> int:
        """The end of the furthest byte written (0 when nothing was)."""
        return self._ends[-1] if self._ends else 0
