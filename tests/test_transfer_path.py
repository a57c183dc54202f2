"""The handoff below the HTTP layer, over real loopback sockets: protocol frames, the TCP transport,
and the decode node's slots and control port driven by the connector's real background sender."""

from __future__ import annotations

import os
import time

import anyio
import pytest
import torch
from support.waiting import await_until

from tilert import contracts as p
from tilert.connector.claims import ClaimError, SaveRequest, parse_claim
from tilert.connector.sender import BackgroundSender, Staged
from tilert.contracts import Claim
from tilert.decode.control import ControlServer
from tilert.decode.slots import SlotError, SlotState, SlotTable
from tilert.transports.base import TransferError
from tilert.transports.tcp import TcpTransport

LAYOUT = p.KVLayout("mla_dense", "float32", 576 * 4, 3)
SECRET = b"transfer-path-test-secret-0123456789"


def _claim(tid: str, port: int) -> Claim:
    return Claim.signed(SECRET, tid, "127.0.0.1", port)


def test_protocol_round_trip_and_refusals() -> None:
    offer = p.Offer("t-1", 7, {"mla": LAYOUT})
    frame = p.encode(offer)
    assert p.decode(frame[4:]) == offer
    assert offer.nbytes == 3 * 7 * 576 * 4
    with pytest.raises(p.ContractError):
        p.decode(b'{"type": "offer", "transfer_id": "x"}')
    with pytest.raises(p.ContractError):
        p.decode(b'{"type": "nonsense"}')
    with pytest.raises(p.ContractError):
        p.decode(b'{"type": "done", "transfer_id": "x", "nbytes": 1, "extra": 2}')
    with pytest.raises(p.ContractError, match="rejected"):
        p.expect(p.Reject("no"), p.Accept)


def test_save_request_slot_ids_cross_blocks() -> None:
    save = SaveRequest("r", _claim("t", 1), [7, 2, 9], 16, 35)
    slots = save.slot_ids()
    assert slots[:2] == [112, 113] and slots[16] == 32 and slots[32] == 144 and len(slots) == 35


def test_claim_parsing() -> None:
    """Only a claim signed with the deployment's secret is acted on; other connectors' keys are left alone."""
    assert parse_claim(None, SECRET) is None
    assert parse_claim({"do_remote_decode": True}, SECRET) is None
    claim = _claim("abc-1", 5556)
    assert parse_claim(claim.to_params() | {"do_remote_decode": True}, SECRET) == claim
    with pytest.raises(ClaimError, match="not signed"):
        parse_claim(claim.to_params() | {"tilert_ctrl_port": 5557}, SECRET)  # re-aimed at another port
    with pytest.raises(ClaimError, match="not signed"):
        parse_claim(claim.to_params(), b"another deployment's secret, 32 b")
    unsigned = {"tilert_host": "h", "tilert_ctrl_port": 1, "tilert_transfer_id": "t"}
    bads = (
        {},
        {"tilert_ctrl_port": 0, "tilert_auth": "x"},
        {"tilert_ctrl_port": True, "tilert_auth": "x"},
        {"tilert_transfer_id": "a/b", "tilert_auth": "x"},
        {"tilert_auth": "x", "tilert_other": 1},
    )
    for bad in bads:
        with pytest.raises(ClaimError):
            parse_claim(unsigned | bad, SECRET)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_tcp_transport_writes_only_inside_live_grants(host: str) -> None:
    receiver = TcpTransport.receiver(host=host, options={})
    sender = TcpTransport.sender(options={"timeout_s": 5})
    try:
        buf = torch.zeros(1024, dtype=torch.uint8)
        region = receiver.register(buf)
        target = receiver.grant(region, 100, 64)
        data = torch.arange(64, dtype=torch.uint8)
        sender.write(target, data)
        assert torch.equal(buf[100:164], data) and int(buf[:100].sum()) == 0 and int(buf[164:].sum()) == 0
        with pytest.raises(TransferError, match="exceeds"):
            sender.write(target, torch.zeros(65, dtype=torch.uint8))
        receiver.revoke(target)
        with pytest.raises(TransferError):
            sender.write(target, data)
        with pytest.raises(ValueError):
            receiver.grant(region, 1000, 64)
    finally:
        sender.close()
        receiver.close()


class _Node:
    """A decode node's transfer half (slots + control port) on a real loopback socket."""

    def __init__(self, slots: int = 1, lease_s: float = 30.0) -> None:
        self.receiver = TcpTransport.receiver(host="127.0.0.1", options={})
        self.table = SlotTable(slots, {"mla": LAYOUT}, 64, self.receiver, lease_s)
        self.control = ControlServer(self.table, "tcp", "test-node", SECRET)
        self.port = 0


def _staging(tokens: int) -> torch.Tensor:
    return torch.randint(0, 255, (LAYOUT.nbytes(tokens),), dtype=torch.uint8)


def _offers_seen(node: _Node) -> list[str]:
    """The transfer ids of the offers that reach ``node``'s control port from now on (in arrival order)."""
    seen: list[str] = []
    wait_reserved = node.table.wait_reserved

    async def recording(tid: str, timeout_s: float) -> None:
        seen.append(tid)
        await wait_reserved(tid, timeout_s)

    node.table.wait_reserved = recording  # type: ignore[method-assign]
    return seen


async def _with_node(node: _Node, body) -> None:  # type: ignore[no-untyped-def]
    async with anyio.create_task_group() as tg:
        node.port = await tg.start(node.control.serve, "127.0.0.1", 0)
        try:
            await body()
        finally:
            tg.cancel_scope.cancel()
            node.receiver.close()


def test_sender_to_slot_round_trip_and_slot_states() -> None:
    node = _Node()
    sender = BackgroundSender("tcp", {}, SECRET)

    async def body() -> None:
        node.table.reserve("t1")
        with pytest.raises(SlotError) as full:
            node.table.reserve("t2")
        assert full.value.status == 429
        data = _staging(10)
        fut = sender.submit(Staged.whole(_claim("t1", node.port), 10, {"mla": LAYOUT}, data))
        slot = await node.table.wait_ready("t1", 10)
        await anyio.to_thread.run_sync(fut.result)
        views, layouts, n = slot.tensors()
        assert n == 10 and layouts == {"mla": LAYOUT}
        assert torch.equal(views["mla"].reshape(-1), data)
        assert node.table.start_decode("t1").state is SlotState.DECODING
        node.table.release("t1")
        assert node.table.free == 1
        with pytest.raises(SlotError) as gone:
            node.table.get("t1")
        assert gone.value.status == 410
        with pytest.raises(SlotError) as reused:
            node.table.reserve("t1")
        assert reused.value.status == 409

    try:
        anyio.run(_with_node, node, body)
    finally:
        sender.close()


def test_bad_offer_and_abort_fail_the_waiting_request_at_once() -> None:
    node = _Node(slots=2)
    sender = BackgroundSender("tcp", {}, SECRET)

    async def body() -> None:
        node.table.reserve("wrong-layout")
        other = p.KVLayout("mla_dense", "bfloat16", 576 * 2, 3)
        wrong = Staged.whole(_claim("wrong-layout", node.port), 4, {"mla": other}, _staging(4)[: other.nbytes(4)])
        sender.submit(wrong)
        t0 = time.monotonic()
        with pytest.raises(SlotError, match="layout mismatch") as exc:
            await node.table.wait_ready("wrong-layout", 10)
        assert exc.value.status == 502 and time.monotonic() - t0 < 2
        node.table.release("wrong-layout")

        node.table.reserve("aborted")
        sender.abort(_claim("aborted", node.port), "extraction failed")
        t0 = time.monotonic()
        with pytest.raises(SlotError, match="extraction failed"):
            await node.table.wait_ready("aborted", 10)
        assert time.monotonic() - t0 < 2

        # An offer for a transfer nobody reserved reaches the node and is refused for that reason: no grant, no
        # byte written, no slot taken.
        node.control.early_offer_wait_s = 0.05  # the node's wait for a reservation that never comes
        never = Staged.whole(_claim("never-reserved", node.port), 4, {"mla": LAYOUT}, _staging(4))
        offered = _offers_seen(node)
        await anyio.to_thread.run_sync(sender.submit(never).result)
        assert offered == ["never-reserved"]
        assert never.outcome is not None and "unknown transfer: reserve a slot first" in never.outcome
        assert never.writes == [] and node.table.free == 1 and node.table.transfers_received == 0

    try:
        anyio.run(_with_node, node, body)
    finally:
        sender.close()


def test_leases_expire_and_late_transfers_are_refused() -> None:
    node = _Node(lease_s=0.05)
    sender = BackgroundSender("tcp", {}, SECRET)

    async def body() -> None:
        node.table.reserve("late")
        await anyio.sleep(0.1)  # past the 0.05 s lease: time passing is what expires it
        assert node.table.expire() == ["late"]
        assert node.table.free == 1
        fut = sender.submit(Staged.whole(_claim("late", node.port), 4, {"mla": LAYOUT}, _staging(4)))
        await anyio.to_thread.run_sync(fut.result)
        assert node.table.free == 1 and node.table.transfers_received == 0

    try:
        anyio.run(_with_node, node, body)
    finally:
        sender.close()


def test_transfer_timeout_when_prefill_never_sends() -> None:
    node = _Node()

    async def body() -> None:
        node.table.reserve("silent")
        with pytest.raises(SlotError) as exc:
            await node.table.wait_ready("silent", 0.2)
        assert exc.value.status == 504

    anyio.run(_with_node, node, body)


def test_held_reservation_outlives_its_lease() -> None:
    node = _Node(lease_s=0.05)

    async def body() -> None:
        node.table.reserve("queued-decode")
        node.table.hold("queued-decode")
        await anyio.sleep(0.1)  # past the 0.05 s lease: time passing is what would expire it
        assert node.table.expire() == []
        assert node.table.get("queued-decode").state is SlotState.RESERVED

    anyio.run(_with_node, node, body)


def test_an_offer_ahead_of_its_reservation_waits_for_it() -> None:
    """The router reserves while vLLM prefills, so an offer may reach the node first: it waits (bounded) for
    its reservation and lands; an offer whose reserve is refused ends at once; one never reserved is refused
    once the wait is over."""
    node = _Node(slots=1)
    node.control.early_offer_wait_s = 0.6
    sender = BackgroundSender("tcp", {}, SECRET)

    def staged(tid: str, tokens: int, data: torch.Tensor | None = None) -> Staged:
        return Staged.whole(_claim(tid, node.port), tokens, {"mla": LAYOUT}, _staging(tokens) if data is None else data)

    async def finished(fut: object, within_s: float) -> float:
        t0 = time.monotonic()
        await anyio.to_thread.run_sync(fut.result)  # type: ignore[attr-defined]
        took = time.monotonic() - t0
        assert took < within_s, took
        return took

    offered = _offers_seen(node)

    async def arrived(tid: str) -> None:
        await await_until(lambda: tid in offered, 5, f"the offer of {tid} at the node")

    async def body() -> None:
        data = _staging(6)
        early = staged("early", 6, data)
        fut = sender.submit(early)
        await arrived("early")
        assert not fut.done() and node.table.free == 1  # the offer waits at the node, nothing reserved
        node.table.reserve("early")
        slot = await node.table.wait_ready("early", 10)
        await finished(fut, 5)
        assert early.outcome == "done" and torch.equal(slot.tensors()[0]["mla"].reshape(-1), data)

        refused = staged("refused", 4)
        fut = sender.submit(refused)
        await arrived("refused")
        with pytest.raises(SlotError):
            node.table.reserve("refused")  # the only slot is taken
        await finished(fut, 0.3)  # not the whole wait
        assert "reserve was refused" in refused.outcome

        never = staged("never", 4)
        t0 = time.monotonic()
        await finished(sender.submit(never), 5)
        assert time.monotonic() - t0 >= 0.6 and "unknown transfer" in never.outcome
        assert node.table.free == 0 and node.table.transfers_received == 1

    try:
        anyio.run(_with_node, node, body)
    finally:
        sender.close()


def test_control_connections_are_kept_and_a_stale_one_is_replaced() -> None:
    """Transfers to one node reuse the control connection (one Hello, not one per transfer); when the node has
    closed the kept connection meanwhile (its idle timeout), the next transfer says Hello on a new one and
    lands; a failed transfer's connection is not kept."""
    node = _Node(slots=1)
    sender = BackgroundSender("tcp", {}, SECRET)

    async def one(tid: str) -> Staged:
        node.table.reserve(tid)
        staged = Staged.whole(_claim(tid, node.port), 4, {"mla": LAYOUT}, _staging(4))
        fut = sender.submit(staged)
        await node.table.wait_ready(tid, 10)
        await anyio.to_thread.run_sync(fut.result)
        node.table.release(tid)
        return staged

    async def body() -> None:
        for i in range(3):
            assert (await one(f"k{i}")).outcome == "done"
        assert sender.connections_opened == 1 and node.control.connections == 1
        node.control.idle_timeout_s = 0.05  # the node drops the kept connection once it idles
        assert (await one("k3")).outcome == "done"  # still on the kept one (the old timeout was armed)
        await await_until(lambda: node.control.connections == 0, 5, "the node to drop the idle connection")
        assert (await one("k4")).outcome == "done"  # the kept one was closed: a new one
        assert sender.connections_opened == 2
        never = Staged.whole(_claim("unknown", node.port), 4, {"mla": LAYOUT}, _staging(4))
        node.control.early_offer_wait_s = 0.05
        await anyio.to_thread.run_sync(sender.submit(never).result)
        assert "unknown transfer" in (never.outcome or "")
        assert (await one("k5")).outcome == "done"
        assert sender.connections_opened == 3  # the refused transfer's connection was not kept

    try:
        anyio.run(_with_node, node, body)
    finally:
        sender.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2+ CPUs")
def test_sender_threads_are_not_pinned_to_their_creators_core() -> None:
    """vLLM pins its forward thread to one core (OMP binding; NixlConnector re-pins it to the last core), and the
    sender's threads start from that thread: they must still run on every CPU the process may use, not on a
    core that NIXL's busy-polling UCX progress thread may fill."""
    everything = os.sched_getaffinity(0)
    one = {min(everything)}
    os.sched_setaffinity(0, one)  # as vLLM leaves its worker thread
    try:
        sender = BackgroundSender("tcp", {}, SECRET)
        try:
            assert os.sched_getaffinity(0) == one, "the caller keeps its own placement"
            assert sender.cpus == everything
            placed = sender._pool.submit(os.sched_getaffinity, 0).result(10)
            assert placed == everything
        finally:
            sender.close()
    finally:
        os.sched_setaffinity(0, everything)
