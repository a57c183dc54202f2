"""The byte movers against their contract, with the real libraries, receiver and sender in two processes.

For tcp, Mooncake (TCP on these machines; ``registration`` "grant", its default there, and "region", the
RDMA default) and NIXL (UCX on loopback): a write lands exactly inside its grant, pieces written at
offsets from a registered staging buffer fill a grant (vouched for only once complete), a write larger than the
grant is refused (by the sender, and by the receiver when the target lies about the size), a write to a
revoked grant fails, a late writer of a revoked grant never gets its bytes trusted, a killed receiver
fails the next writes with ``TransferError`` in under a second, and 64 KiB / 8 MiB writes report their
speed. The receiver lives in a spawned process (so "killed" is a real SIGKILL and exit codes are checked:
UCX's exit-time crash would show as 139), driven over a pipe.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from support.waiting import wait_until

from tilert import contracts as c
from tilert.plugins import available, load_transport
from tilert.transports.base import Sender, TransferError
from tilert.transports.tcp import _HEADER, TcpReceiver

os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before any NIXL agent exists, here and in the children
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")  # Mooncake's own write timeout (s; its minimum)

FILL = 0xA5
CALL_TIMEOUT_S = 30.0
DEAD_WRITE_LIMIT_S = 1.0


@dataclass(frozen=True)
class Case:
    """A transport and what it can promise on its own, at the writer (``write`` raises) and in memory."""

    transport: str
    options: dict[str, Any] = field(default_factory=dict)
    refuses_oversize: bool = True  # a target that overstates the grant: the receiver side refuses
    refuses_revoked: bool = True  # a write to a revoked grant fails at the writer
    refuses_late_in_reused: bool = True  # ... even when the window was granted again to someone else
    guards_window: bool = True  # a refused write leaves the receiver's memory untouched
    verifies: bool = True  # the receiver checks completions itself (Receiver.verify)

    @property
    def id(self) -> str:
        return self.transport + "".join(f"-{v}" for v in self.options.values())


CASES = [
    Case("tcp", verifies=False),  # the receiver reads every byte itself: it never lets a refused one in
    # "grant" registration: Mooncake's receiving side refuses writes outside the live windows; a late writer
    # of a window granted again is told apart only by its completion notification (verify).
    Case("mooncake", refuses_late_in_reused=False),
    # "region" registration (the RDMA default): the library guards the buffer, the notifications the grants.
    Case(
        "mooncake",
        {"registration": "region"},
        refuses_oversize=False,
        refuses_revoked=False,
        refuses_late_in_reused=False,
        guards_window=False,
    ),
    # UCX lands the bytes wherever the registration allows; the receiver's verdict refuses them.
    Case("nixl", guards_window=False),
]


# ---- the receiver's process ------------------------------------------------------------------------


def _serve(conn: Connection, transport: str, options: dict[str, Any], parent: int) -> None:
    from tilert.plugins import load_transport

    rx = load_transport(transport).receiver(host="127.0.0.1", options=options)
    buffers: list[torch.Tensor] = []
    conn.send(("ok", os.getpid()))
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                return  # the test process is gone: never outlive it
            continue
        try:
            op, args = conn.recv()
        except EOFError:
            return
        try:
            if op == "register":
                size, fill = args
                buffers.append(torch.full((size,), fill, dtype=torch.uint8))
                result: Any = rx.register(buffers[-1])
            elif op == "grant":
                result = rx.grant(*args)
            elif op == "revoke":
                rx.revoke(args[0])
                result = None
            elif op == "verify":
                rx.verify(args[0])
                result = None
            elif op == "read":
                region, offset, n = args
                result = buffers[region][offset : offset + n].numpy().tobytes()
            elif op == "close":
                rx.close()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(op)
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            conn.send(("err", f"{type(exc).__name__}: {exc}"))


class RemoteReceiver:
    def __init__(self, case: Case) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, case.transport, case.options, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.pid = self._reply(60.0)

    def _reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the receiver process did not answer")
        status, value = self.conn.recv()
        if status == "err":
            raise ReceiverError(value)
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.conn.send((op, args))
        return self._reply(CALL_TIMEOUT_S)

    def kill(self) -> None:
        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> int | None:
        """Graceful stop; returns the exit code (0 expected: no crash at interpreter exit)."""
        if self.proc.is_alive():
            try:
                self.call("close")
            except (OSError, EOFError, TimeoutError, ReceiverError):
                pass
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
        return self.proc.exitcode


class ReceiverError(Exception):
    """An exception raised inside the receiver's process (its type and message)."""


# ---- fixtures -------------------------------------------------------------------------------------

_senders: dict[str, Sender] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_senders() -> Iterator[None]:
    yield
    for sender in _senders.values():
        sender.close()
    _senders.clear()


def sender_for(transport: str) -> Sender:
    if transport not in _senders:
        _senders[transport] = load_transport(transport).sender(options={})
    return _senders[transport]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.id)
def case(request: pytest.FixtureRequest) -> Case:
    case: Case = request.param
    return case


@pytest.fixture(scope="module")
def rx(case: Case) -> Iterator[RemoteReceiver]:
    remote = RemoteReceiver(case)
    yield remote
    assert remote.close() == 0, "the receiver process did not exit cleanly"


def payload(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    data[data == FILL] = 0  # no payload byte looks like an untouched one
    return data


# ---- the contract ---------------------------------------------------------------------------------


def test_plugins_registered() -> None:
    assert {"tcp", "mooncake", "nixl"} <= set(available("tilert.transports"))


@pytest.mark.timeout(120)
def test_write_lands_exactly_inside_its_grant(case: Case, rx: RemoteReceiver) -> None:
    region = rx.call("register", 1 << 20, FILL)
    offset, n, margin = 4096 + 3, 65536 + 5, 64
    target = rx.call("grant", region, offset, n)
    frame = c.encode(c.Accept("t-1", target))  # the target travels in a control frame, strictly typed
    assert len(frame) < c.MAX_FRAME_BYTES and c.decode(frame[4:]) == c.Accept("t-1", target)
    data = payload(n, 1)
    sender_for(case.transport).write(target, data)
    rx.call("verify", target)
    got = rx.call("read", region, offset - margin, n + 2 * margin)
    assert got[margin:-margin] == data.numpy().tobytes()
    assert got[:margin] == bytes([FILL]) * margin and got[-margin:] == bytes([FILL]) * margin
    rx.call("revoke", target)
    rx.call("revoke", target)  # idempotent


_sources: list[torch.Tensor] = []  # registered staging buffers stay alive as long as their senders


@pytest.mark.timeout(120)
def test_writes_at_offsets_fill_a_grant_from_a_registered_source(case: Case, rx: RemoteReceiver) -> None:
    """Layer-pipelined sending: pieces of one staging buffer (registered once) land at their offsets in the
    grant, in any order; the receiver vouches for the grant only once every byte of it was written; a piece
    that would cross the grant's end is refused."""
    region = rx.call("register", 1 << 20, FILL)
    offset, n, margin = 8192 + 5, 3 * 40000 + 7, 64
    target = rx.call("grant", region, offset, n)
    sender = sender_for(case.transport)
    staging = payload(1 << 18, 12)
    _sources.append(staging)
    sender.register_source(staging)
    data = staging[1000 : 1000 + n]  # inside the registered buffer: no per-write registration
    pieces = [(40000, 80000), (0, 40000), (80000, n)]
    for start, end in pieces:
        if case.verifies:
            with pytest.raises(ReceiverError, match="no completed write"):
                rx.call("verify", target)  # not every byte written yet
        sender.write(target, data[start:end], offset=start)
    rx.call("verify", target)
    got = rx.call("read", region, offset - margin, n + 2 * margin)
    assert got[margin:-margin] == data.numpy().tobytes()
    assert got[:margin] == bytes([FILL]) * margin and got[-margin:] == bytes([FILL]) * margin
    with pytest.raises(TransferError, match="exceeds"):
        sender.write(target, data[:100], offset=n - 99)
    with pytest.raises(TransferError, match="negative"):
        sender.write(target, data[:100], offset=-1)
    rx.call("revoke", target)


@pytest.mark.timeout(120)
def test_write_larger_than_grant_is_refused(case: Case, rx: RemoteReceiver) -> None:
    region = rx.call("register", 1 << 16, FILL)
    offset, n = 1024, 4096
    target = rx.call("grant", region, offset, n)
    sender = sender_for(case.transport)
    with pytest.raises(TransferError, match="exceeds"):
        sender.write(target, payload(n + 1, 2))
    assert rx.call("read", region, 0, 1 << 16) == bytes([FILL]) * (1 << 16)
    # A writer that overstates the grant's size is refused by the receiver's side too.
    forged = {**target, "nbytes": n + 1}
    if case.refuses_oversize:
        with pytest.raises(TransferError):
            sender.write(forged, payload(n + 1, 3))
    else:
        sender.write(forged, payload(n + 1, 3))
    if case.guards_window:
        assert rx.call("read", region, 0, 1 << 16) == bytes([FILL]) * (1 << 16)
    if case.verifies:
        with pytest.raises(ReceiverError, match="TransferError"):
            rx.call("verify", target)  # and the decode node would not trust the window
    rx.call("revoke", target)


@pytest.mark.timeout(120)
def test_write_to_revoked_grant_fails(case: Case, rx: RemoteReceiver) -> None:
    region = rx.call("register", 1 << 16, FILL)
    target = rx.call("grant", region, 0, 8192)
    rx.call("revoke", target)
    sender = sender_for(case.transport)
    if case.refuses_revoked:
        with pytest.raises(TransferError):
            sender.write(target, payload(8192, 4))
    else:
        sender.write(target, payload(8192, 4))  # an RDMA-style region: only the notification tells
    if case.guards_window:
        assert rx.call("read", region, 0, 1 << 16) == bytes([FILL]) * (1 << 16)
    if case.verifies:
        with pytest.raises(ReceiverError, match="revoked"):
            rx.call("verify", target)


@pytest.mark.timeout(120)
def test_late_writer_never_trusted_in_a_reused_window(case: Case, rx: RemoteReceiver) -> None:
    """Grant A, revoke it, grant B over the same window (a slot's next transfer), B's writer writes, then
    A's late writer writes: if A's bytes can land on B's, B is never vouched for."""
    region = rx.call("register", 1 << 16, FILL)
    sender = sender_for(case.transport)
    a = rx.call("grant", region, 0, 8192)
    rx.call("revoke", a)
    b = rx.call("grant", region, 0, 8192)
    good = payload(8192, 5)
    sender.write(b, good)
    rx.call("verify", b)
    if case.refuses_late_in_reused:
        with pytest.raises(TransferError):
            sender.write(a, payload(8192, 6))
    else:
        sender.write(a, payload(8192, 6))
    if case.refuses_late_in_reused and case.guards_window:
        assert rx.call("read", region, 0, 8192) == good.numpy().tobytes()
        rx.call("verify", b)
    else:
        with pytest.raises(ReceiverError, match="late writer"):
            rx.call("verify", b)
    rx.call("revoke", b)


@pytest.mark.timeout(120)
def test_dead_receiver_fails_the_write_fast(case: Case) -> None:
    remote = RemoteReceiver(case)
    try:
        region = remote.call("register", 1 << 16, FILL)
        first = remote.call("grant", region, 0, 4096)
        second = remote.call("grant", region, 8192, 4096)
        sender = sender_for(case.transport)
        sender.write(first, payload(4096, 7))  # connected and warm
        remote.kill()
        for target in (second, first, second):
            start = time.perf_counter()
            with pytest.raises(TransferError):
                sender.write(target, payload(4096, 8))
            elapsed = time.perf_counter() - start
            print(f"{case.id}: write to a killed receiver failed in {elapsed * 1e3:.2f} ms")
            assert elapsed < DEAD_WRITE_LIMIT_S
    finally:
        remote.close()


def _wait_stopped(pid: int, limit_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (SIGSTOP takes effect asynchronously)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


STUCK_TIMEOUT_S = {"tcp": 2.0, "mooncake": 5.0, "nixl": 2.0}  # Mooncake's minimum is 5 s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", sorted(STUCK_TIMEOUT_S))
def test_stuck_receiver_times_the_write_out(transport: str) -> None:
    """A receiver that is alive but answers nothing (SIGSTOP): the write gives up after its timeout."""
    limit = STUCK_TIMEOUT_S[transport]
    remote = RemoteReceiver(Case(transport))
    sender = load_transport(transport).sender(options={"timeout_s": limit, "verdict_timeout_s": limit})
    try:
        region = remote.call("register", 1 << 16, FILL)
        warm, target = remote.call("grant", region, 0, 4096), remote.call("grant", region, 8192, 4096)
        sender.write(warm, payload(4096, 10))
        assert remote.proc.pid is not None
        os.kill(remote.proc.pid, signal.SIGSTOP)
        _wait_stopped(remote.proc.pid)  # else a fast write (tcp) may still be answered before the stop lands
        start = time.perf_counter()
        with pytest.raises(TransferError):
            sender.write(target, payload(4096, 11))
        elapsed = time.perf_counter() - start
        print(f"{transport}: write to a stopped receiver gave up after {elapsed:.2f} s (timeout {limit:g} s)")
        assert elapsed < limit + 2.0
    finally:
        sender.close()
        remote.kill()  # SIGKILL ends a stopped process too
        remote.close()


@pytest.mark.timeout(180)
def test_throughput(case: Case, rx: RemoteReceiver) -> None:
    sender = sender_for(case.transport)
    region = rx.call("register", 8 << 20, FILL)
    for n, reps in ((64 << 10, 30), (8 << 20, 8)):
        data = payload(n, 9)
        times = []
        for _ in range(reps + 1):
            target = rx.call("grant", region, 0, n)
            start = time.perf_counter()
            sender.write(target, data)
            times.append(time.perf_counter() - start)
            rx.call("revoke", target)
        p50 = statistics.median(times[1:])  # the first write pays for the connection
        print(f"{case.id}: {n >> 10} KiB write p50 {p50 * 1e6:.0f} us, {n / p50 / 2**30:.2f} GiB/s")
    assert rx.call("read", region, 0, 16) == data[:16].numpy().tobytes()


@pytest.mark.timeout(60)
def test_tcp_revoke_cuts_off_a_writer_stalled_mid_payload() -> None:
    """A tcp writer whose payload stops arriving (its process starved or wedged) while the receiver stays alive
    must not hold the grant's window, nor its own staging, until a socket timeout: revoking the grant (what the
    decode node does when it gives up on a transfer) shuts the connection at once, and no later byte lands.
    The writer is a raw socket, because the real sender cannot be made to stall between its bytes on demand."""
    receiver = TcpReceiver("127.0.0.1", timeout_s=30.0)
    try:
        buf = torch.full((1 << 16,), FILL, dtype=torch.uint8)
        target = receiver.grant(receiver.register(buf), 0, 8192)
        before = set(threading.enumerate())  # the receiver serves each connection on a thread of its own
        with socket.create_connection((target["host"], target["port"]), timeout=5.0) as raw:
            raw.sendall(_HEADER.pack(bytes.fromhex(target["key"]), 0, 8192) + bytes([7]) * 100)
            wait_until(lambda: bytes(buf[:100].tolist()) == bytes([7]) * 100, 5.0, "the first bytes in")  # mid-payload
            serving = [t for t in threading.enumerate() if t.name == "tilert-tcp-conn" and t not in before]
            assert len(serving) == 1, serving
            start = time.perf_counter()
            receiver.revoke(target)
            raw.settimeout(2.0)
            try:
                answer = raw.recv(1)  # EOF (b"") or a reset: either way not an OK
            except ConnectionResetError:
                answer = b""
            cut_after = time.perf_counter() - start
            assert answer in (b"", b"\x00"), answer
            assert cut_after < 1.0, cut_after
            with contextlib.suppress(OSError):
                raw.sendall(bytes([9]) * 8092)  # the rest of the payload, too late
        serving[0].join(5.0)  # the connection's thread has ended: no byte can land after this
        assert not serving[0].is_alive()
        assert bytes(buf[100:8192].tolist()) == bytes([FILL]) * 8092
    finally:
        receiver.close()


@pytest.mark.timeout(120)
def test_nixl_large_write_goes_in_pieces_over_several_agents() -> None:
    """A write of at least ``split_bytes`` is cut into one piece per lane (a NIXL agent each), written side by
    side: every byte lands inside the grant and the receiver vouches for it; against a revoked grant every piece
    is refused and the write fails only after all of them ended."""
    rx = RemoteReceiver(Case("nixl"))
    sender = load_transport("nixl").sender(options={"lanes": 3, "split_bytes": 1 << 16})
    try:
        region = rx.call("register", 1 << 20, FILL)
        offset, n, margin = 4096 + 3, 300_001, 64  # three uneven pieces, the last one short
        target = rx.call("grant", region, offset, n)
        data = payload(n, 21)
        sender.write(target, data)
        rx.call("verify", target)
        got = rx.call("read", region, offset - margin, n + 2 * margin)
        assert got[margin:-margin] == data.numpy().tobytes()
        assert got[:margin] == bytes([FILL]) * margin and got[-margin:] == bytes([FILL]) * margin
        rx.call("revoke", target)
        with pytest.raises(TransferError, match="revoked"):
            sender.write(target, data)
    finally:
        sender.close()
        rx.close()


@pytest.mark.timeout(60)
def test_closed_mooncake_ends_its_engines_at_close_and_refuses_further_use() -> None:
    """Closing a Mooncake sender or receiver ends its engine there and then (its destructor pauses the process
    up to a second: left to the garbage collector, that pause once landed inside a later test's 1 s fault
    deadline); a closed one refuses work with ``TransferError`` instead of touching a dead engine."""
    import weakref

    transport = load_transport("mooncake")
    receiver = transport.receiver(host="127.0.0.1", options={})
    sender = transport.sender(options={})
    engines = [weakref.ref(receiver._engine), weakref.ref(sender._engine)]  # type: ignore[attr-defined]
    buf = torch.zeros(4096, dtype=torch.uint8)
    region = receiver.register(buf)
    target = receiver.grant(region, 0, 64)
    sender.close()
    receiver.close()
    assert [e() for e in engines] == [None, None]
    with pytest.raises(TransferError, match="closed"):
        sender.write(target, torch.ones(64, dtype=torch.uint8))
    with pytest.raises(TransferError, match="closed"):
        receiver.grant(region, 0, 64)
    with pytest.raises(TransferError, match="closed"):
        receiver.register(torch.zeros(4096, dtype=torch.uint8))
    sender.close()  # idempotent
    receiver.close()
