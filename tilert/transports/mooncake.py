"""The Mooncake Transfer Engine transport: one-sided writes into the decode node's registered buffers.

Both ends run a real ``mooncake.engine.TransferEngine`` with ``P2PHANDSHAKE`` metadata (no metadata
server: a peer's segment is fetched from its own RPC port). The protocol is an option: ``"tcp"`` (the
default, and what any machine without an RDMA NIC gets whatever is asked) or ``"rdma"`` with ``device``
naming the NICs (``"mlx5_0,mlx5_1"``; empty: Mooncake's topology discovery). Same code either way.

Grant and target. A grant is a window ``[offset, offset + nbytes)`` of a registered buffer; its target is
``{"transport": "mooncake", "session": "HOST:RPC_PORT", "addr": window start, "nbytes", "key"}``: the
receiver engine's session id, the absolute address to write at, and a random grant key. The sender writes
(the whole grant, or pieces of it at offsets) with ``transfer_submit_write`` and a sleeping poll of its
status, then rewrites the piece's last byte with ``transfer_sync(..., Write, TransferNotify("tilert",
"KEY:OFFSET:NBYTES"))``, so every completed write is followed by a completion notification the receiver
checks against its live grants; it vouches for a grant once notifications covered every byte of it.

Registration (option ``registration``) decides what the library itself refuses:

- ``"grant"`` (the default with ``protocol="tcp"``): ``register`` only records the buffer; each grant
  registers exactly its window with the engine and ``revoke`` unregisters it. Mooncake's receiving side
  refuses any write that is not inside a registered window, so a write past the grant or to a revoked
  grant fails in the library (``-1`` at the sender) and no byte lands. The library checks addresses, not
  keys: once the same window is granted again (a slot's next transfer), a late writer of the old grant
  lands, and only its notification tells (``verify`` then refuses the new grant). Registration is
  cheap bookkeeping on TCP.
- ``"region"`` (the default with RDMA): each buffer is registered once, up front, as one memory region (an
  RDMA registration pins memory and costs too much per transfer). The library then refuses only writes
  outside the buffer; the sender refuses writes larger than its grant, and the receiver's completion
  notifications are the check: ``verify`` refuses a grant whose window a late writer of a revoked grant
  overlapped, or for which no completed write was seen.

Source registration: ``register_source`` registers the prefill side's staging buffer with the engine once
(host memory only: this package has no GPU support), and writes from inside it need no registration of
their own; a write from elsewhere registers its source for the write's duration when the protocol needs it
(RDMA), and not at all on TCP.

Errors: the engine returns ``-1`` instead of raising; every return code is checked and turned into
``TransferError`` with the reason. After a failed write the sender probes the peer's RPC port
(a TCP connect bounded by 0.5 s; Mooncake's ``send_probe`` can wait a minute) to tell "receiver
unreachable" from "refused by the receiver", and remembers an unreachable session: Mooncake backs off
reconnecting to a dead peer for about a second per write, so later writes to it probe first and fail in
under a millisecond. A write to a live but stuck peer (a stopped process) ends after ``MC_TRANSFER_TIMEOUT``
(the library's own timeout, at least 5 s; set from ``timeout_s`` unless the environment sets it).

Closing: ``close()`` ends the sender's or receiver's engine then and there (a closed one refuses work with
``TransferError``). The engine's destructor removes its segment from the metadata and pauses the process for a
noticeable time (``removeSegmentDesc`` in its log); left to the garbage collector, that pause would land in
whatever ran next.

Known limits of ``mooncake-transfer-engine-non-cuda==0.3.13.post1``: its RPC (``0.0.0.0``) and TCP data
(``*``) listeners bind every interface whatever host is given (``MC_TCP_BIND_ADDRESS`` did not change that
here), with no authentication: anyone who can reach them may write into a registered window. Grant
registration keeps such windows exactly as large and as long-lived as the grants. A late writer whose bytes
land in a re-granted window after that grant was verified (the slot already in use) is logged, not
prevented: the library cannot refuse it and its notification comes too late.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import structlog
import torch

from tilert.transports.base import (
    Coverage,
    Receiver,
    Sender,
    TransferError,
    Transport,
    check_bounds,
    check_receive_buffer,
    check_window,
    target_field,
)

NAME = "mooncake"

log = structlog.get_logger("tilert.transports.mooncake")

NOTIFY_NAME = "tilert"
_REVOKED_KEPT = 4096  # revoked grants remembered, to recognise (and report) their late writers
_ERR_OVERLAP = -7  # register_memory: the range overlaps a registered one
_POLL_FIRST_S, _POLL_MAX_S = 50e-6, 500e-6  # the sender's poll of a write's status, doubling


def _engine(hostname: str, protocol: str, device: str, timeout_s: float) -> Any:
    """A started ``TransferEngine`` (P2P handshake, no metadata server)."""
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, math.ceil(timeout_s))))
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransferError(
            "the mooncake transport needs mooncake-transfer-engine (pip install 'tilert[mooncake]') and "
            f"Debian's libibverbs1: {exc}"
        ) from exc
    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransferError(f"mooncake engine failed to start ({protocol} on {hostname}, device {device!r}): rc={rc}")
    return engine


def _advertised(host: str, hostname: object) -> str:
    """The address peers reach this engine at: ``hostname`` if given, else the bind host unless wildcard."""
    name = str(hostname or host)
    if name in ("", "0.0.0.0", "::"):
        name = socket.gethostbyname(socket.gethostname())
    return name


def _probe(session: str, timeout_s: float) -> str | None:
    """``None`` if the peer's RPC port takes a connection within ``timeout_s``, else why not. (Mooncake's own
    ``send_probe`` waits about a minute on a peer that accepts but never answers, e.g. a stopped process.)"""
    host, _, port = session.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _cpu_bytes(data: torch.Tensor) -> torch.Tensor:
    if data.device.type != "cpu" or not data.is_contiguous():
        data = data.contiguous().cpu()
    return data


@dataclass
class _Grant:
    key: str
    region: int
    start: int  # absolute address of the window
    nbytes: int
    registered: bool  # the window itself is registered with the engine ("grant" registration)
    landed: Coverage = field(default_factory=Coverage)  # bytes completed writes were notified for
    tainted: str | None = None

    def overlaps(self, other: _Grant) -> bool:
        return self.start < other.start + other.nbytes and other.start < self.start + self.nbytes


def _parse_notify(note: Any) -> tuple[str, int, int] | None:
    """``(key, offset, nbytes)`` of a completion notification (``KEY:OFFSET:NBYTES``, or ``KEY:NBYTES`` for a
    write at offset 0); ``None`` for anything else."""
    if note.name != NOTIFY_NAME:
        return None
    parts = str(note.msg).split(":")
    if len(parts) == 2:
        parts.insert(1, "0")
    if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return parts[0], int(parts[1]), int(parts[2])


class MooncakeReceiver(Receiver):
    def __init__(
        self,
        host: str,
        *,
        protocol: str = "tcp",
        device: str = "",
        registration: str | None = None,
        hostname: str | None = None,
        timeout_s: float = 30.0,
        verify_grace_s: float = 0.05,
    ) -> None:
        registration = registration or ("grant" if protocol == "tcp" else "region")
        if registration not in ("grant", "region"):
            raise ValueError(f"mooncake registration must be 'grant' or 'region', not {registration!r}")
        advertised = _advertised(host, hostname)
        self._engine = _engine(advertised, protocol, device, timeout_s)
        self.session = f"{advertised}:{self._engine.get_rpc_port()}"
        self.protocol, self.registration = protocol, registration
        self._verify_grace_s = verify_grace_s
        self._regions: list[torch.Tensor] = []
        self._grants: dict[str, _Grant] = {}
        self._revoked: OrderedDict[str, _Grant] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        log.info("mooncake_receiver_ready", session=self.session, protocol=protocol, registration=registration)

    def register(self, buffer: torch.Tensor) -> int:
        check_receive_buffer(buffer, "mooncake")
        with self._lock:
            if self._closed:
                raise TransferError("mooncake receiver is closed")
            if self.registration == "region":
                rc = self._engine.register_memory(buffer.data_ptr(), buffer.numel())
                if rc != 0:
                    raise TransferError(f"mooncake refused to register a {buffer.numel()}-byte buffer: rc={rc}")
            self._regions.append(buffer)
            return len(self._regions) - 1

    def grant(self, region: int, offset: int, nbytes: int) -> dict[str, Any]:
        buf = self._regions[region]
        check_window(buf, offset, nbytes)
        key = secrets.token_hex(16)
        start = buf.data_ptr() + offset
        with self._lock:
            if self._closed:
                raise TransferError("mooncake receiver is closed")
            self._drain()
            registered = False
            if self.registration == "grant" and nbytes > 0:
                rc = self._engine.register_memory(start, nbytes)
                if rc != 0:
                    why = ": it overlaps a live grant" if rc == _ERR_OVERLAP else ""
                    raise TransferError(f"mooncake refused to register the grant's window (rc={rc}){why}")
                registered = True
            self._grants[key] = _Grant(key, region, start, nbytes, registered)
        return {"transport": "mooncake", "session": self.session, "addr": start, "nbytes": nbytes, "key": key}

    def revoke(self, target: dict[str, Any]) -> None:
        with self._lock:
            self._drain()  # this grant's own completion is not a late write
            grant = self._grants.pop(str(target.get("key")), None)
            if grant is None:
                return
            self._revoked[grant.key] = grant
            while len(self._revoked) > _REVOKED_KEPT:
                self._revoked.popitem(last=False)
            if grant.registered and not self._closed:
                rc = self._engine.unregister_memory(grant.start)
                if rc != 0:  # the window stays writable: say so loudly, there is nothing else to do
                    log.error("mooncake_unregister_failed", rc=rc, nbytes=grant.nbytes)

    def verify(self, target: dict[str, Any]) -> None:
        """The grant must be live, untainted, and a completed write must have covered it. Mooncake delivers
        the notification before the writer's call returns, so it is normally here already; a short grace
        (``verify_grace_s``) covers a notification still in flight."""
        key = str(target.get("key"))
        deadline = time.monotonic() + self._verify_grace_s
        while True:
            with self._lock:
                self._drain()
                grant = self._grants.get(key)
                if grant is None:
                    raise TransferError("the grant was revoked: its bytes are not trusted")
                if grant.tainted:
                    raise TransferError(grant.tainted)
                if grant.landed.covers(grant.nbytes):
                    return
            if time.monotonic() >= deadline:
                raise TransferError(f"no completed write of {grant.nbytes} bytes was notified for this grant")
            time.sleep(50e-6)

    def _drain(self) -> None:
        """Match completion notifications to grants (caller holds the lock)."""
        if self._closed:
            return
        for note in self._engine.get_notifies():
            parsed = _parse_notify(note)
            if parsed is None:
                log.warning("mooncake_foreign_notify", name=str(note.name)[:64])
                continue
            key, offset, count = parsed
            grant = self._grants.get(key)
            if grant is not None:
                if offset + count > grant.nbytes:  # possible with "region" registration only
                    grant.tainted = f"a write of {count} bytes at {offset} overran this {grant.nbytes}-byte grant"
                grant.landed.add(offset, offset + count)
                continue
            old = self._revoked.get(key)
            log.warning("mooncake_late_write", known_grant=old is not None, nbytes=count)
            if old is None:
                continue
            for live in self._grants.values():  # its bytes landed: a live window it overlapped is spoiled
                if live.region == old.region and live.overlaps(old):
                    live.tainted = "a late writer of a revoked grant overwrote this grant's window"

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for grant in self._grants.values():
                if grant.registered:
                    self._engine.unregister_memory(grant.start)
            if self.registration == "region":
                for buf in self._regions:
                    self._engine.unregister_memory(buf.data_ptr())
            self._grants.clear()
            self._closed = True
            engine, self._engine = self._engine, None
        del engine  # the engine ends here (module docstring: "Closing")


class MooncakeSender(Sender):
    def __init__(
        self,
        *,
        protocol: str = "tcp",
        device: str = "",
        hostname: str = "127.0.0.1",
        register_source: bool | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._engine = _engine(hostname, protocol, device, timeout_s)
        from mooncake.engine import TransferNotify, TransferOpcode

        self._notify, self._write_op = TransferNotify, TransferOpcode.Write
        # TCP reads the source from plain memory; RDMA needs it registered (for the write's duration).
        self._register_source = protocol != "tcp" if register_source is None else bool(register_source)
        self._sources: dict[int, int] = {}  # registered source address -> writes using it
        self._staging: list[tuple[int, int]] = []  # [start, end) of buffers registered by register_source
        self._unreachable: set[str] = set()
        self._probe_timeout_s = min(0.5, timeout_s)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False

    def register_source(self, buffer: torch.Tensor) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise TransferError(
                "the mooncake sender reads contiguous host memory only (this mooncake package has no GPU "
                f"support): cannot register a {buffer.device.type} staging buffer; stage in host memory"
            )
        start, n = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        with self._lock:
            if self._closed:
                raise TransferError("mooncake sender is closed")
            rc = self._engine.register_memory(start, n)
            if rc != 0:
                raise TransferError(f"mooncake refused to register the {n}-byte staging buffer: rc={rc}")
            self._staging.append((start, start + n))

    def write(self, target: dict[str, Any], data: torch.Tensor, offset: int = 0) -> None:
        if self._closed:
            raise TransferError("mooncake sender is closed")
        session, key = target_field(target, "session", str, NAME), target_field(target, "key", str, NAME)
        addr, nbytes = target_field(target, "addr", int, NAME), target_field(target, "nbytes", int, NAME)
        data = _cpu_bytes(data)
        n = data.numel() * data.element_size()
        check_bounds(nbytes, offset, n)
        if n == 0:
            return
        with self._lock:
            known_down = session in self._unreachable
        if known_down:
            self._check_reachable(session, n)
        src = data.data_ptr()
        self._hold_source(src, n)
        try:
            rc = self._write(session, src, addr + offset, n, f"{key}:{offset}:{n}")
        finally:
            self._release_source(src)
        if rc != 0:
            self._check_reachable(session, n)
            raise TransferError(
                f"mooncake write of {n} bytes to {session} failed (rc={rc}): refused by the receiver (grant revoked, "
                "window not registered there) or timed out (MC_TRANSFER_TIMEOUT)"
            )

    def _write(self, session: str, src: int, dst: int, n: int, note: str) -> int:
        """Write ``n`` bytes, then notify the receiver: 0, or the library's failure code.

        ``transfer_sync`` would do both, but it waits for the data by spinning on the transfer's status (the
        calling thread took as much CPU as the write took time, beside the prefill). So the data goes with
        ``transfer_submit_write`` and a sleeping poll, and the notification with a one-byte ``transfer_sync``
        of the data's last byte (rewritten, same value): sent only after the data completed, and refused,
        like any write, by a receiver that unregistered the window meanwhile."""
        batch = self._engine.transfer_submit_write(session, src, dst, n)
        if batch in (-1, 2**64 - 1):  # -1 as the library's unsigned batch id: the segment or the submit failed
            return -1
        delay, deadline = _POLL_FIRST_S, time.monotonic() + self._timeout_s
        while (status := self._engine.transfer_check_status(batch)) == 0:
            if time.monotonic() > deadline:  # the library never times a submitted write out: we do
                log.warning("mooncake_write_timed_out", nbytes=n, timeout_s=self._timeout_s)
                return -2  # the library keeps the batch's bookkeeping (it frees it only once the write ends)
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        if status != 1:  # -1 failed, -2 timed out
            return status
        note_src = src + n - 1
        return int(
            self._engine.transfer_sync(
                session, note_src, dst + n - 1, 1, self._write_op, self._notify(NOTIFY_NAME, note)
            )
        )

    def _check_reachable(self, session: str, n: int) -> None:
        problem = _probe(session, self._probe_timeout_s)
        with self._lock:
            if problem is None:
                self._unreachable.discard(session)
                return
            self._unreachable.add(session)
        raise TransferError(f"mooncake write of {n} bytes failed: receiver {session} unreachable ({problem})")

    def _in_staging(self, src: int, n: int) -> bool:
        return any(start <= src and src + n <= end for start, end in self._staging)

    def _hold_source(self, src: int, n: int) -> None:
        if not self._register_source:
            return
        with self._lock:
            if self._in_staging(src, n):
                return
            if src in self._sources:
                self._sources[src] += 1
                return
            rc = self._engine.register_memory(src, n)
            if rc != 0:
                raise TransferError(f"mooncake refused to register the {n}-byte source buffer: rc={rc}")
            self._sources[src] = 1

    def _release_source(self, src: int) -> None:
        if not self._register_source:
            return
        with self._lock:
            if src not in self._sources or self._closed:
                return  # inside a staging buffer (registered once, for good), or the engine is gone
            left = self._sources[src] - 1
            if left:
                self._sources[src] = left
                return
            del self._sources[src]
            rc = self._engine.unregister_memory(src)
        if rc != 0:
            log.warning("mooncake_source_unregister_failed", rc=rc)

    def close(self) -> None:
        """Staging buffers are unregistered and the engine ends now (nothing is pooled per peer); a write after
        this fails with ``TransferError``."""
        with self._lock:
            if self._closed:
                return
            staging, self._staging = self._staging, []
            for start, _ in staging:
                rc = self._engine.unregister_memory(start)
                if rc != 0:
                    log.warning("mooncake_source_unregister_failed", rc=rc)
            self._closed = True
            engine, self._engine = self._engine, None
        del engine  # the engine ends here (module docstring: "Closing")


class MooncakeTransport(Transport):
    """Options (decode node's ``--transport-options`` / connector's ``tilert_transport_options``):
    ``protocol`` ("tcp" | "rdma"), ``device`` (RDMA NIC names), ``hostname`` (the address peers reach this
    engine at: the receiver's default is the decode node's advertised address, the sender's 127.0.0.1),
    ``registration`` ("grant" | "region", receiver), ``register_source`` (sender),
    ``timeout_s``, ``verify_grace_s``."""

    name: ClassVar[str] = NAME

    @classmethod
    def receiver(cls, *, host: str, options: dict[str, Any], advertise: str | None = None) -> MooncakeReceiver:
        return MooncakeReceiver(
            advertise or host,
            protocol=str(options.get("protocol", "tcp")),
            device=str(options.get("device", "")),
            registration=options.get("registration"),
            hostname=options.get("hostname"),
            timeout_s=float(options.get("timeout_s", 30.0)),
            verify_grace_s=float(options.get("verify_grace_s", 0.05)),
        )

    @classmethod
    def sender(cls, *, options: dict[str, Any]) -> MooncakeSender:
        register_source = options.get("register_source")
        return MooncakeSender(
            protocol=str(options.get("protocol", "tcp")),
            device=str(options.get("device", "")),
            hostname=str(options.get("hostname", "127.0.0.1")),
            register_source=None if register_source is None else bool(register_source),
            timeout_s=float(options.get("timeout_s", 30.0)),
        )
