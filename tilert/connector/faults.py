"""TEST-ONLY fault injection for the connector's fail-fast paths. Off unless ``TILERT_TEST_FAULTS`` is set.

Some failures the connector must handle cannot be made to happen on demand by the real parts in a whole stack:
an extraction error inside vLLM's forward, a transport error in the middle of a transfer, a forward that
stalls past the sender's timeout, a forward slow enough to kill the decode node between two layers. The
stack tests arm them one transfer at a time through this hook; every other path they exercise is real.

- Enabled only when the environment variable ``TILERT_TEST_FAULTS`` names a directory **when the connector
  starts** (``FaultHook.from_env``); without it there is no hook object at all and nothing is checked.
  Enabling it logs a warning at start-up.
- A fault is armed by writing its name to ``<dir>/next``; the next claimed transfer the worker starts
  takes the file (renames it away, so exactly one transfer gets it). When the fault strikes, the hook
  writes the wall-clock time to ``<dir>/struck``, so a test can time what follows from that moment.
  Nothing in a request selects a fault: a client cannot reach it, only whoever controls the prefill node's
  environment and that directory.

Faults (:data:`FAULTS`): ``extraction_error`` (staging the transfer's second layer raises);
``transport_error`` (the sender's transport write raises ``TransferError``, after the handshake: the node
holds a grant); ``timeout`` (the forward stalls ``STALL_S`` before the second layer, and the sender's wait
for the next staged layer is ``TIMEOUT_S`` for this transfer); ``stall`` (the forward stalls ``STALL_S``
before the second layer: time to kill the peer mid-transfer).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from tilert.transports.base import TransferError

log = structlog.get_logger("tilert.connector.faults")

ENV = "TILERT_TEST_FAULTS"
FAULTS = ("extraction_error", "transport_error", "timeout", "stall")
STALL_S = 1.0  # the forward's stall before the second layer ("timeout", "stall"): well past TIMEOUT_S, so that a
# sender slow to begin its wait on a loaded host still times out inside the stall
TIMEOUT_S = 0.3  # the sender's wait for the next staged layer under "timeout"
AT_LAYER = 1  # faults strike before staging this layer (the first layer is staged, and written, before)


@dataclass(frozen=True)
class Fault:
    """One transfer's armed fault."""

    name: str
    struck: Path  # where the moment it strikes is written (time.time())

    def before_layer(self, index: int) -> None:
        """Called by the worker before staging the transfer's ``index``-th layer (inside the forward)."""
        if index != AT_LAYER:
            return
        if self.name == "extraction_error":
            self._strike()
            raise RuntimeError("injected extraction error (TILERT_TEST_FAULTS)")
        if self.name in ("timeout", "stall"):
            self._strike()
            time.sleep(STALL_S)

    def before_write(self) -> None:
        """Called by the sender before each transport write of the transfer."""
        if self.name == "transport_error":
            self._strike()
            raise TransferError("injected transport error (TILERT_TEST_FAULTS)")

    def _strike(self) -> None:
        tmp = self.struck.with_name(self.struck.name + ".tmp")
        tmp.write_text(repr(time.time()))
        os.replace(tmp, self.struck)

    def timeout_s(self, default: float) -> float:
        return TIMEOUT_S if self.name == "timeout" else default


class FaultHook:
    """Hands armed faults to transfers; exists only when :data:`ENV` names a directory at start-up."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def from_env(cls) -> FaultHook | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        directory = Path(value)
        if not directory.is_dir():
            raise ValueError(f"{ENV}={value!r} is not a directory")
        log.warning(
            "test_fault_hook_enabled", env=ENV, directory=str(directory), note="test-only: never set this in production"
        )
        return cls(directory)

    def take(self, transfer_id: str) -> Fault | None:
        """The armed fault, if any, now owned by this transfer (the file is renamed away atomically)."""
        armed, taken = self.directory / "next", self.directory / f"taken-{transfer_id}"
        try:
            os.rename(armed, taken)
        except FileNotFoundError:
            return None
        name = taken.read_text().strip()
        taken.unlink(missing_ok=True)
        if name not in FAULTS:
            log.error("test_fault_unknown", fault=name, known=list(FAULTS))
            return None
        log.warning("test_fault_armed", transfer_id=transfer_id, fault=name)
        return Fault(name, self.directory / "struck")


def struck_at(directory: Path) -> float | None:
    """When the last armed fault struck (``time.time()``), or ``None`` if it has not."""
    try:
        return float((directory / "struck").read_text())
    except (FileNotFoundError, ValueError):
        return None


def arm(directory: Path, name: str) -> None:
    """Arm ``name`` for the next claimed transfer (what a test calls; atomic: write, then rename)."""
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
    (directory / "struck").unlink(missing_ok=True)
    tmp = directory / f".arming-{os.getpid()}"
    tmp.write_text(name)
    os.replace(tmp, directory / "next")
