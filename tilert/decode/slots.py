"""Decode-node slots: pre-registered receive buffers, each owned by at most one transfer at a time.

Every slot moves through explicit states; every path ends in ``FREE``:

    FREE --reserve--> RESERVED --offer--> RECEIVING --done--> READY --decode--> DECODING --end--> FREE
                         |                    |                  |
                         +--------------------+------------------+--- lease expiry / release / abort --> FREE

The router reserves while vLLM prefills, so an offer may come before its reservation: the control port then
waits for it (:meth:`SlotTable.wait_reserved`, bounded; a refused or released id ends the wait at once).
A failed transfer (abort, disconnect, bad offer) keeps the slot in ``FAILED`` with its reason until
the waiting decode request reads it or the lease runs out, so the client learns *why* at once.
Freed transfer ids leave a short-lived tombstone, so a late writer or a late decode call gets a clear
answer instead of landing in someone else's slot. All methods run on the decode node's event loop.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import anyio
import structlog
import torch

from tilert.contracts import KVLayout, Offer
from tilert.engines.base import require_exact_layouts
from tilert.transports.base import Receiver, TransferError

log = structlog.get_logger("tilert.decode.slots")

TOMBSTONES = 1024
EARLY_OFFERS = 64  # offers waiting for their reservation at once (the control port serves 64 connections)


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    RECEIVING = "receiving"
    READY = "ready"
    FAILED = "failed"
    DECODING = "decoding"


class SlotError(Exception):
    """A slot operation that cannot proceed; ``status`` is the HTTP status that describes it."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Slot:
    index: int
    buffer: torch.Tensor
    region: int
    state: SlotState = SlotState.FREE
    transfer_id: str | None = None
    deadline: float = 0.0
    offer: Offer | None = None
    grant: dict[str, str | int] | None = None
    error: str | None = None
    n: int = 1  # the choices its request decodes: the slots of the table it holds
    cancel: threading.Event = field(default_factory=threading.Event)
    changed: anyio.Event = field(default_factory=anyio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, KVLayout], int]:
        """The received bytes as ``uint8 [num_layers, num_tokens, row_bytes]`` views, in offer order."""
        assert self.offer is not None
        n = self.offer.num_tokens
        return state_views(self.buffer, self.offer.layouts, n), dict(self.offer.layouts), n


def state_views(buffer: torch.Tensor, layouts: Mapping[str, KVLayout], num_tokens: int) -> dict[str, torch.Tensor]:
    """A receive buffer's prompt state as ``uint8 [num_layers, num_tokens, row_bytes]`` views, one per layout, back
    to back from the buffer's start in ``layouts``' order (as the sender wrote them)."""
    views, offset = {}, 0
    for name, lay in layouts.items():
        size = lay.nbytes(num_tokens)
        views[name] = buffer[offset : offset + size].view(lay.num_layers, num_tokens, lay.row_bytes)
        offset += size
    return views


class SlotTable:
    def __init__(
        self,
        num_slots: int,
        expected: dict[str, KVLayout],
        max_seq_len: int,
        receiver: Receiver,
        default_lease_s: float = 30.0,
        check_layouts: Callable[[Mapping[str, KVLayout]], None] | None = None,
        shared: bool = False,
    ) -> None:
        """``expected`` sizes the buffers; ``check_layouts`` (the engine's) decides which offered layouts
        are acceptable, by default exactly ``expected``; ``shared``: the buffers live in shared memory (an
        engine in another process reads them), moved there before the transport registers them."""
        if num_slots < 1:
            raise ValueError("need at least one slot")
        self.expected = expected
        self._check_layouts = check_layouts or (lambda offered: require_exact_layouts(expected, offered))
        self.max_seq_len = max_seq_len
        self.default_lease_s = default_lease_s
        self._receiver = receiver
        per_token = sum(lay.num_layers * lay.row_bytes for lay in expected.values())
        self.capacity = per_token * max_seq_len
        self.slots: list[Slot] = []
        for i in range(num_slots):
            buf = torch.empty(self.capacity, dtype=torch.uint8)
            if shared:
                buf.share_memory_()
            self.slots.append(Slot(i, buf, receiver.register(buf)))
        self._by_tid: dict[str, Slot] = {}
        # Told of every transfer that lands (its id, True, "") or fails (its id, False, why): the node's metrics, and
        # the routers watching the node (a failure ends the request at once).
        self.on_transfer: Callable[[str, bool, str], None] = lambda tid, ok, reason: None
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._awaited: dict[str, anyio.Event] = {}  # ids an early offer waits to see reserved
        self.transfers_received = 0

    # ---- queries --------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Slots free: a request of ``n`` choices holds ``n`` (its receive buffer and ``n - 1`` more), so the table
        never grants more sequences than it has slots."""
        return len(self.slots) - sum(s.n for s in self.slots if s.state is not SlotState.FREE)

    def get(self, tid: str) -> Slot:
        slot = self._by_tid.get(tid)
        if slot is not None:
            return slot
        reason = self._tombstones.get(tid)
        if reason is not None:
            raise SlotError(f"the transfer is no longer held here: {reason}", 410)
        raise SlotError("unknown transfer: reserve a slot first", 404)

    # ---- transitions ----------------------------------------------------------------------

    def reserve(self, tid: str, lease_s: float | None = None, n: int = 1) -> Slot:
        """A free slot for ``tid``, holding ``n`` slots of the table (its choices; 429 unless that many are free).
        Idempotent: a repeated reserve (a router retrying one whose answer a dropped connection lost) gets the same
        slot, its lease renewed while it still waits for data; an id released or refused before is refused (409)."""
        held = self._by_tid.get(tid)
        if held is not None:
            if held.state is SlotState.RESERVED:
                held.deadline = max(held.deadline, time.monotonic() + (lease_s or self.default_lease_s))
            log.info("slot_reserve_repeated", transfer_id=tid, slot=held.index)
            return held
        if tid in self._tombstones:
            raise SlotError("transfer id already used", 409)
        slot = next((s for s in self.slots if s.state is SlotState.FREE), None)
        if slot is None or self.free < n:
            self._tombstone(tid, "its reserve was refused: all decode slots were taken")  # an early offer stops
            raise SlotError("all decode slots are taken" if n == 1 else f"{n} slots asked, {self.free} free", 429)
        slot.state, slot.transfer_id, slot.error, slot.offer, slot.n = SlotState.RESERVED, tid, None, None, n
        slot.deadline = time.monotonic() + (lease_s or self.default_lease_s)
        slot.cancel = threading.Event()
        self._by_tid[tid] = slot
        slot.notify()
        self._settled(tid)
        log.info("slot_reserved", transfer_id=tid, slot=slot.index)
        return slot

    async def wait_reserved(self, tid: str, timeout_s: float) -> None:
        """Return once ``tid`` is reserved, released or refused here, or after ``timeout_s``: an offer that
        came before its reservation (the router reserves while the prefill runs) then meets a settled id."""
        if tid in self._by_tid or tid in self._tombstones:
            return
        if tid not in self._awaited and len(self._awaited) >= EARLY_OFFERS:
            return  # too many early offers at once: this one is answered as it stands
        event = self._awaited.setdefault(tid, anyio.Event())
        try:
            with anyio.move_on_after(timeout_s):
                await event.wait()
        finally:
            if self._awaited.get(tid) is event and not event.is_set():
                del self._awaited[tid]

    def _settled(self, tid: str) -> None:
        event = self._awaited.pop(tid, None)
        if event is not None:
            event.set()

    def accept(self, offer: Offer) -> dict[str, str | int]:
        """Check an offer against the reservation and the engine; returns the write target."""
        slot = self.get(offer.transfer_id)
        if slot.state is not SlotState.RESERVED:
            raise SlotError(f"the transfer is {slot.state.value}, not awaiting data", 409)
        problem = self._check(offer)
        if problem:
            self.fail(offer.transfer_id, problem)
            raise SlotError(problem, 400)
        slot.offer = offer
        slot.grant = self._receiver.grant(slot.region, 0, offer.nbytes)
        slot.state = SlotState.RECEIVING
        slot.notify()
        return slot.grant

    def _check(self, offer: Offer) -> str | None:
        if not 0 < offer.num_tokens < self.max_seq_len:
            return f"prompt of {offer.num_tokens} tokens does not fit max_seq_len {self.max_seq_len}"
        try:
            self._check_layouts(offer.layouts)
        except ValueError as exc:
            return str(exc)
        if offer.nbytes > self.capacity:
            return f"offer of {offer.nbytes} bytes exceeds the slot capacity {self.capacity}"
        return None

    def complete(self, tid: str, nbytes: int) -> None:
        slot = self.get(tid)
        if slot.state is not SlotState.RECEIVING or slot.offer is None or nbytes != slot.offer.nbytes:
            raise SlotError(f"done for a transfer in state {slot.state.value} ({nbytes} bytes)", 409)
        try:
            if slot.grant is not None:
                self._receiver.verify(slot.grant)  # the transport vouches for the bytes (or a late writer hit)
        except TransferError as exc:
            self.fail(tid, f"the transport cannot vouch for the received bytes: {exc}")
            raise SlotError(str(exc), 502) from None
        self._revoke(slot)
        slot.state = SlotState.READY
        self.transfers_received += 1
        self.on_transfer(tid, True, "")
        slot.notify()
        log.info("transfer_received", transfer_id=tid, nbytes=nbytes, tokens=slot.offer.num_tokens)

    def fail(self, tid: str, reason: str) -> None:
        slot = self._by_tid.get(tid)
        if slot is None or slot.state in (SlotState.DECODING, SlotState.FAILED):
            return
        self._revoke(slot)
        slot.state, slot.error = SlotState.FAILED, reason
        self.on_transfer(tid, False, reason)
        slot.notify()
        log.warning("transfer_failed", transfer_id=tid, reason=reason)

    def hold(self, tid: str) -> Slot:
        """A decode request now owns this transfer: its lease no longer expires (the request's own
        life bounds it; it releases the slot when it ends)."""
        slot = self.get(tid)
        slot.deadline = float("inf")
        return slot

    async def wait_ready(self, tid: str, timeout_s: float) -> Slot:
        """Wait until the transfer has landed; ``SlotError`` (502/504) if it failed or timed out."""
        slot = self.get(tid)
        with anyio.move_on_after(timeout_s):
            while slot.state in (SlotState.RESERVED, SlotState.RECEIVING):
                await slot.changed.wait()
        if slot.state is SlotState.READY:
            return slot
        if slot.state is SlotState.FAILED:
            raise SlotError(f"KV transfer failed: {slot.error}", 502)
        if slot.transfer_id != tid:
            raise SlotError("the transfer was released while waiting", 410)
        raise SlotError(f"KV transfer did not arrive within {timeout_s:.1f}s", 504)

    def start_decode(self, tid: str) -> Slot:
        slot = self.get(tid)
        if slot.state is not SlotState.READY:
            raise SlotError(f"the transfer is {slot.state.value}, not ready", 409)
        slot.state = SlotState.DECODING
        slot.notify()
        return slot

    def release(self, tid: str, reason: str = "released") -> bool:
        """Free the slot of ``tid`` whatever its state (idempotent); a decode in flight is cancelled.

        An id never seen is tombstoned too: a reserve that arrives after its own release (a router that
        gave up on a paused node) is then refused instead of holding a slot nobody will use."""
        slot = self._by_tid.pop(tid, None)
        self._tombstone(tid, reason)
        if slot is None:
            return False
        slot.cancel.set()
        self._revoke(slot)
        slot.state, slot.transfer_id, slot.offer, slot.error, slot.n = SlotState.FREE, None, None, None, 1
        slot.notify()
        log.info("slot_released", transfer_id=tid, slot=slot.index, reason=reason)
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Release every reservation whose lease ran out before its decode began."""
        now = time.monotonic() if now is None else now
        expired: list[str] = [
            s.transfer_id
            for s in self.slots
            if s.transfer_id and s.state not in (SlotState.FREE, SlotState.DECODING) and s.deadline < now
        ]
        for tid in expired:
            self.release(tid, "lease expired before decode started")
        return expired

    def _tombstone(self, tid: str, reason: str) -> None:
        self._settled(tid)
        self._tombstones[tid] = reason
        self._tombstones.move_to_end(tid)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _revoke(self, slot: Slot) -> None:
        if slot.grant is not None:
            self._receiver.revoke(slot.grant)
            slot.grant = None
