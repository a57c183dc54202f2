"""Hosts on one machine: Linux network namespaces, one per part, each with one veth into a bridge that lives in a
namespace of its own. Private addresses only (``SUBNET``), no route anywhere else; names unique per run, and
everything removed on exit (the veths go with their namespaces), also when the body fails."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET = "10.77.0"  # /24, inside the namespaces only: the host's own interfaces never see it
DEVICE = "eth0"  # each host's one interface, in its own namespace
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _ip(*args: str) -> None:
    proc = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces here (``None`` when it can): not root, no ``ip``, or
    ``ip netns add`` refused."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not Path(IP).is_file():
        return f"no iproute2 here ({IP})"
    probe = f"tilert-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"this machine forbids network namespaces: {exc}"
    with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
        _ip("netns", "del", probe)
    return None


@dataclass
class Lan:
    """Hosts by name -> (namespace, address)."""

    prefix: str
    hosts: dict[str, tuple[str, str]] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return self.hosts[host][0]

    def addr(self, host: str) -> str:
        return self.hosts[host][1]

    def popen(self, host: str, cmd: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """``cmd`` in ``host``'s namespace (``ip netns exec`` keeps the environment), in a process group of its
        own that :func:`lan` ends."""
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [IP, "netns", "exec", self.ns(host), *cmd],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def call(self, host: str, fn: Callable[[], T], timeout_s: float = 300.0) -> T:
        """``fn()`` on a thread that entered ``host``'s namespace (sockets it opens live there); its result, or
        its exception raised here."""
        out: list[Any] = []

        def run() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                fd = os.open(f"/var/run/netns/{self.ns(host)}", os.O_RDONLY)
                try:
                    if libc.setns(fd, _CLONE_NEWNET) != 0:
                        raise OSError(ctypes.get_errno(), "setns")
                finally:
                    os.close(fd)
                out.append(("ok", fn()))
            except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
                out.append(("err", exc))

        thread = threading.Thread(target=run, name=f"netns-{host}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not out:
            raise TimeoutError(f"{fn!r} in {host}'s namespace ran past {timeout_s}s")
        kind, value = out[0]
        if kind == "err":
            raise value
        return value  # type: ignore[no-any-return]

    def rx_bytes(self, host: str) -> int:
        """Bytes ``host``'s interface has received (the kernel's counter)."""
        proc = subprocess.run(
            [IP, "-n", self.ns(host), "-s", "-j", "link", "show", "dev", DEVICE],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(json.loads(proc.stdout)[0]["stats64"]["rx"]["bytes"])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every process group started here, SIGKILL those still running after ``grace_s``."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the group: what the process started too
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


@contextlib.contextmanager
def lan(names: Sequence[str]) -> Iterator[Lan]:
    """One namespace per name, addresses ``SUBNET.2`` onward in order, joined by a bridge in one more namespace."""
    net = Lan(f"tilert-{os.getpid()}-{secrets.token_hex(3)}")
    made: list[str] = []
    try:
        hub = f"{net.prefix}-hub"
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns, addr = f"{net.prefix}-{name}", f"{SUBNET}.{i + 2}"
            _ip("netns", "add", ns)
            made.append(ns)
            port = f"p{i}"
            _ip("link", "add", DEVICE, "netns", ns, "type", "veth", "peer", "name", port, "netns", hub)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", DEVICE)
            _ip("-n", ns, "link", "set", DEVICE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            net.hosts[name] = (ns, addr)
        yield net
    finally:
        net.stop()
        for ns in reversed(made):
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                _ip("netns", "del", ns)
