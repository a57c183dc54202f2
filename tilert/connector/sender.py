"""The connector's background sender: control-channel handshake plus layer-pipelined transport writes.

Runs off vLLM's forward path on a small thread pool, so a claimed request never blocks the next prefill
step. A transfer is handed over as soon as its first layer is about to be staged (:class:`Staged`): the
sender connects, says ``Hello``, ``Offer``s the request's layouts and gets the decode node's ``Accept``
while the forward still computes, then writes each layer's chunk of the staging extent at its offset in
the grant as soon as the worker marks it staged (consecutive staged chunks go in one write), and sends
``Done`` after the last one. On GPU a chunk is "staged" once the CUDA event recorded after its copy has
completed; on CPU the copy is synchronous.

Fail fast: a refused handshake, a staging (extraction) failure, a transport error, a peer gone, or no new
layer within ``timeout_s`` ends the transfer at once; the decode node is told with an explicit ``Abort``
whenever the control channel is up (its waiting request fails at once instead of timing out), and on every
exit path the staging extent goes back to the pool (:meth:`Staged.release`, exactly once).

CPU placement: the sender's threads run on every CPU this process may use (:func:`~tilert.cpus.allowed_cpus`),
never on the one core vLLM's worker thread happens to be pinned to when the pool starts them. Threads inherit their
creator's affinity, and the creator here is vLLM's forward thread: on CPU, ``VLLM_CPU_OMP_THREADS_BIND``
pins it to the OpenMP cores, and vLLM's ``NixlConnector`` (a sibling under ``MultiConnector``) re-pins it to
the last core of each NUMA node in its worker's ``__init__``. On a small machine that core may be shared
with NIXL's UCX progress threads, which busy-poll a whole core each (NIXL's Python API starts them with no
poll delay); a sender pinned there got too little CPU to finish a handshake or a write within its timeout.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from tilert import contracts as p
from tilert.connector.claims import Claim
from tilert.connector.faults import Fault
from tilert.cpus import allowed_cpus
from tilert.plugins import load_transport
from tilert.transports.base import TransferError

log = structlog.get_logger("tilert.connector.sender")


class StagingError(RuntimeError):
    """The worker could not stage the request's KV (extraction failed, layers missing, no layer in time)."""


@dataclass(frozen=True)
class WriteRecord:
    """One transport write of a transfer: bytes ``[offset, offset + nbytes)`` of the extent, landed at ``done``
    (``time.monotonic()``)."""

    offset: int
    nbytes: int
    done: float


class Staged:
    """One claimed request's extent of the staging pool: filled layer by layer by the worker inside the
    forward, shipped chunk by chunk by the sender as the layers complete.

    ``buffer`` is the extent (contiguous uint8); ``chunks`` are ``(offset, nbytes)`` within it, in byte
    order, back to back (one per cache layer). ``on_release`` returns the extent to the pool."""

    def __init__(
        self,
        claim: Claim,
        num_tokens: int,
        layouts: dict[str, p.KVLayout],
        buffer: torch.Tensor,
        chunks: list[tuple[int, int]],
        on_release: Callable[[], None],
        last_token_id: int | None = None,
    ) -> None:
        self.claim, self.num_tokens, self.layouts = claim, num_tokens, layouts
        self.last_token_id = last_token_id
        self.fault: Fault | None = None  # armed through the test-only hook (tilert.connector.faults)
        self.buffer, self.chunks = buffer, chunks
        self._on_release = on_release
        self._ready: queue.SimpleQueue[tuple[list[int], Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.failure: str | None = None
        self.released = threading.Event()
        self._staged: set[int] = set()
        self.staged_at: float | None = None  # when the worker staged the last chunk (time.monotonic())
        self.writes: list[WriteRecord] = []
        self.outcome: str | None = None  # "done", or why the transfer failed

    @classmethod
    def whole(
        cls,
        claim: Claim,
        num_tokens: int,
        layouts: dict[str, p.KVLayout],
        buffer: torch.Tensor,
        on_release: Callable[[], None] = lambda: None,
    ) -> Staged:
        """An already complete staging (one chunk, staged): shipped in one write, without pipelining."""
        staged = cls(claim, num_tokens, layouts, buffer, [(0, buffer.numel())], on_release)
        staged.ready([0])
        return staged

    # ---- the worker's side ----------------------------------------------------------------------

    def ready(self, indices: list[int], event: Any = None) -> None:
        """Chunks ``indices`` are staged (on GPU: once ``event``, recorded after their copies, completes)."""
        with self._lock:
            self._staged.update(indices)
            if len(self._staged) == len(self.chunks) and self.staged_at is None:
                self.staged_at = time.monotonic()
        self._ready.put((indices, event))

    def fail(self, reason: str) -> None:
        """Staging failed: the sender aborts the transfer (the first reason wins)."""
        with self._lock:
            if self.failure is None:
                self.failure = reason
        self._ready.put(None)

    @property
    def staged_chunks(self) -> int:
        """How many chunks the worker has marked staged so far."""
        with self._lock:
            return len(self._staged)

    @property
    def closed(self) -> bool:
        """The sender is done with the extent: staging into it is pointless (and it may be reused)."""
        return self.released.is_set()

    # ---- the sender's side ----------------------------------------------------------------------

    def next_ready(self, timeout_s: float) -> list[tuple[list[int], Any]]:
        """Block until at least one more chunk is staged; every chunk staged by then. ``StagingError`` when
        the worker failed, or none came within ``timeout_s``."""
        try:
            first = self._ready.get(timeout=timeout_s)
        except queue.Empty:
            raise StagingError(f"no layer was staged within {timeout_s:g}s") from None
        items = [first]
        while True:
            try:
                items.append(self._ready.get_nowait())
            except queue.Empty:
                break
        if any(item is None for item in items) or self.failure is not None:
            raise StagingError(self.failure or "staging failed")
        return [item for item in items if item is not None]

    def release(self) -> None:
        with self._lock:
            if self.released.is_set():
                return
            self.released.set()
        self._on_release()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


class BackgroundSender:
    """Ships staged transfers on a small pool of threads. Control connections are kept: a transfer that ended
    with the node's ``Ack`` leaves its connection (Hello already said) for the next transfer to that node, idle
    at most ``IDLE_CONNECTION_S`` (below the node's own idle timeout) and ``workers`` per node; one that went
    wrong in any way is closed. A kept connection the node closed meanwhile fails at its first frame, and the
    transfer then says Hello on a new one."""

    IDLE_CONNECTION_S = 20.0

    def __init__(
        self, transport: str, options: dict[str, Any], secret: bytes, timeout_s: float = 10.0, workers: int = 4
    ) -> None:
        self.transport_name = transport
        self._workers = workers
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._idle_lock = threading.Lock()
        self.connections_opened = 0
        self._secret = secret
        self._transport = load_transport(transport).sender(options=options)
        self.timeout_s = timeout_s
        self._sender_id = f"prefill-{uuid.uuid4().hex[:8]}"
        self.cpus = allowed_cpus()
        self._pool = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="tilert-send", initializer=_place_thread, initargs=(self.cpus,)
        )

    def register_source(self, buffer: torch.Tensor) -> None:
        """Register the staging pool with the transport (once, at start-up); ``TransferError`` if it cannot."""
        self._transport.register_source(buffer)

    def submit(self, staged: Staged) -> Future[None]:
        """Start shipping ``staged``: the handshake now, each chunk as soon as it is staged."""
        return self._pool.submit(self._send, staged)

    def abort(self, claim: Claim, reason: str) -> Future[None]:
        return self._pool.submit(self._abort, claim, reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._idle_lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _ in conns:
                sock.close()
        self._transport.close()

    def _checkout(self, claim: Claim) -> tuple[socket.socket, bool]:
        """A control connection to the claim's node: a kept one (``True``) or a new one, Hello said."""
        now = time.monotonic()
        with self._idle_lock:
            conns = self._idle.get((claim.host, claim.ctrl_port), [])
            while conns:
                sock, since = conns.pop()
                if now - since < self.IDLE_CONNECTION_S:
                    return sock, True
                sock.close()
        return self._connect(claim), False

    def _checkin(self, claim: Claim, sock: socket.socket) -> None:
        with self._idle_lock:
            conns = self._idle.setdefault((claim.host, claim.ctrl_port), [])
            if len(conns) < self._workers:
                conns.append((sock, time.monotonic()))
                return
        sock.close()

    @staticmethod
    def _offer(sock: socket.socket, offer: p.Offer) -> p.Accept:
        p.send_msg(sock, offer)
        return p.expect(p.recv_msg(sock), p.Accept)

    @retry(
        retry=retry_if_exception_type(ConnectionRefusedError),
        wait=wait_exponential(multiplier=0.02, max=0.2),
        stop=stop_after_delay(1.0),
        reraise=True,
    )
    def _connect(self, claim: Claim) -> socket.socket:
        sock = socket.create_connection((claim.host, claim.ctrl_port), timeout=self.timeout_s)
        self.connections_opened += 1
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            p.send_msg(sock, p.Hello.signed(self._secret, self.transport_name, self._sender_id))
            ack = p.expect(p.recv_msg(sock), p.HelloAck)
            if ack.version != p.PROTOCOL_VERSION:
                raise p.ContractError(f"decode node speaks protocol v{ack.version}, this sender v{p.PROTOCOL_VERSION}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _send(self, staged: Staged) -> None:
        tid = staged.claim.transfer_id
        bound = log.bind(transfer_id=tid, host=staged.claim.host, ctrl_port=staged.claim.ctrl_port)
        sock: socket.socket | None = None
        start, phase = time.monotonic(), "connect"  # where a failure happened, and after how long (logs)
        try:
            offer = p.Offer(tid, staged.num_tokens, staged.layouts, staged.last_token_id)
            if offer.nbytes != staged.nbytes:
                raise StagingError(f"the offer's {offer.nbytes} bytes differ from the {staged.nbytes} staged")
            sock, kept = self._checkout(staged.claim)
            phase = "offer"
            try:
                accept = self._offer(sock, offer)
            except ConnectionError as exc:  # BrokenPipeError, ConnectionResetError among them
                sock.close()
                sock = None
                if not kept:
                    raise
                bound.info("control_connection_stale", error=str(exc))  # the node closed the kept one
                phase = "connect"
                sock = self._connect(staged.claim)
                phase = "offer"
                accept = self._offer(sock, offer)
            phase = "write"
            self._stream(staged, accept.target)
            phase = "done"
            p.send_msg(sock, p.Done(tid, offer.nbytes))
            p.expect(p.recv_msg(sock), p.Ack)
            staged.outcome = "done"
            self._checkin(staged.claim, sock)
            sock = None  # kept for the next transfer to this node
            bound.info(
                "transfer_done",
                nbytes=offer.nbytes,
                tokens=staged.num_tokens,
                writes=len(staged.writes),
                seconds=round(time.monotonic() - start, 4),
            )
        except Exception as exc:  # noqa: BLE001 - every failure ends the same way: Abort, extent back
            staged.outcome = f"{type(exc).__name__}: {exc}"
            control_up, seconds = sock is not None, round(time.monotonic() - start, 4)
            if sock is not None:  # the node hears first; the log (a traceback is slow to render) after
                try:
                    p.send_msg(sock, p.Abort(tid, f"prefill side: {exc}"[: p.MAX_REASON_CHARS]))
                except OSError:
                    pass
            if isinstance(exc, (OSError, p.ContractError, TransferError, StagingError)):
                bound.error(
                    "transfer_failed",
                    error=staged.outcome,
                    control_up=control_up,
                    phase=phase,
                    writes=len(staged.writes),
                    seconds=seconds,
                )
            else:
                bound.exception("transfer_failed_unexpectedly")
        finally:
            if sock is not None:
                sock.close()
            staged.release()

    def _stream(self, staged: Staged, target: dict[str, Any]) -> None:
        """Write each chunk as soon as it is staged; runs of consecutive staged chunks in one write."""
        remaining = set(range(len(staged.chunks)))
        fault = staged.fault
        timeout_s = fault.timeout_s(self.timeout_s) if fault is not None else self.timeout_s
        while remaining:
            batch = staged.next_ready(timeout_s)
            for _, event in batch:
                if event is not None:
                    event.synchronize()  # the chunks' copies into the staging extent have completed
            staged_now = {i for indices, _ in batch for i in indices}
            for start, end in _runs(sorted(staged_now & remaining), staged.chunks):
                if fault is not None:
                    fault.before_write()
                self._transport.write(target, staged.buffer[start:end], offset=start)
                staged.writes.append(WriteRecord(start, end - start, time.monotonic()))
            remaining -= staged_now

    def _abort(self, claim: Claim, reason: str) -> None:
        try:
            with self._connect(claim) as sock:
                p.send_msg(sock, p.Abort(claim.transfer_id, reason[: p.MAX_REASON_CHARS]))
        except (OSError, p.ContractError) as exc:
            log.error("abort_not_delivered", transfer_id=claim.transfer_id, error=str(exc))


def _place_thread(cpus: frozenset[int]) -> None:
    """Each sender thread, as it starts: free to run on ``cpus`` (not on its creator's pinned core)."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.warning("sender_thread_not_placed", cpus=sorted(cpus), error=str(exc))


def _runs(indices: list[int], chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` covering sorted chunk ``indices``, consecutive chunks merged."""
    runs: list[tuple[int, int]] = []
    prev = -2
    for i in indices:
        offset, n = chunks[i]
        if i == prev + 1 and runs and runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], offset + n)
        else:
            runs.append((offset, offset + n))
        prev = i
    return runs
