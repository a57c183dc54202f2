"""The benchmark's servers as child processes: each in its own process group, all stopped on leaving, on an
error and on Ctrl-C / SIGTERM; health polling, CPU sets and per-process CPU time."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tilert.cpus import parse_cpu_list


class Interrupted(KeyboardInterrupt):
    """SIGTERM / SIGHUP, turned into the same unwinding as Ctrl-C."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


class Procs:
    """Started children by name; :meth:`stop_all` (also at exit) ends every process group."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str], cpus: set[int] | None = None) -> None:
        log = self.log_dir / f"{name}.log"
        self.logs[name] = log

        def pin() -> None:  # runs in the child before exec
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(log, "ab") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            self.procs[name] = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=pin if cpus else None,
                cwd=self.log_dir,
            )

    def check(self, names: list[str] | None = None) -> None:
        for name in names or list(self.procs):
            code = self.procs[name].poll()
            if code is not None:
                raise RuntimeError(f"{name} exited with status {code}; its log: {self.logs[name]}\n{self.tail(name)}")

    def tail(self, name: str, chars: int = 3000) -> str:
        try:
            return self.logs[name].read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        _killpg(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        _killpg(proc, signal.SIGKILL)  # the group's stragglers (vLLM's engine core and workers)
        proc.wait()

    def stop_all(self, grace_s: float = 10.0) -> None:
        procs = list(self.procs.items())
        self.procs.clear()
        for _, proc in procs:
            _killpg(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for _, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _killpg(proc, signal.SIGKILL)
            proc.wait()


def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.contextmanager
def supervised(log_dir: Path) -> Iterator[Procs]:
    """A :class:`Procs` whose children are all stopped on leaving, Ctrl-C and SIGTERM included."""
    procs = Procs(log_dir)
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield procs
    finally:
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up
        try:
            procs.stop_all()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            for s, handler in old.items():
                signal.signal(s, handler)


def wait_healthy(procs: Procs, urls: dict[str, str], timeout_s: float) -> dict[str, float]:
    """Poll each ``URL/health`` until 200; a child that dies fails at once. Returns seconds to healthy."""
    start = time.monotonic()
    ready: dict[str, float] = {}
    with httpx.Client(timeout=2.0) as client:
        while len(ready) < len(urls):
            procs.check()
            for name, url in urls.items():
                if name in ready:
                    continue
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/health").status_code == 200:
                        ready[name] = time.monotonic() - start
                        print(f"  {name}: healthy after {ready[name]:.0f} s ({url})", flush=True)
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"not healthy within {timeout_s:.0f} s: {sorted(set(urls) - set(ready))}")
            if len(ready) < len(urls):
                time.sleep(1.0)
    return ready


def parse_cpus(text: str) -> set[int] | None:
    """``"1"``, ``"0-3"``, ``"0,2"`` -> a CPU set (:func:`tilert.cpus.parse_cpu_list`); ``""`` -> None (not pinned)."""
    return set(parse_cpu_list(text)) or None


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
