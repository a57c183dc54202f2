"""The router-overhead load in processes of its own (``--client-procs N``): each process runs a
:class:`~e2elib.load.LoadClient` on an event loop of its own (uvloop when installed, as uvicorn's servers run) and
takes its share of every run's streams and requests, so that one client process is not what caps the tokens a
second a router relays. A run's wall time spans the first process's start to the last one's end; each process
reports its own CPU time."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from dataclasses import astuple, dataclass
from multiprocessing.connection import Connection
from typing import Any

from e2elib.load import LoadClient, Sample, drive


@dataclass(frozen=True)
class ClientSpec:
    """What each client process builds its :class:`LoadClient` from."""

    model: str
    secret: bytes
    urls: dict[str, str]
    ctrl_port: int
    prompt: str
    tokens: int
    kind: str


@dataclass
class Shares:
    """One run across the client processes: every sample, the wall time, and each process's CPU time and CPU share
    (its CPU time over its own wall time)."""

    samples: list[Sample]
    wall_s: float
    cpu_s: list[float]
    cpu_share: list[float]


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop  # noqa: PLC0415 - optional: the fastest loop where it is installed
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _worker(conn: Connection, spec: ClientSpec, cpus: set[int] | None) -> None:
    """A client process: runs ``(mode, concurrency, total)`` as it is told until told ``None``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    client = LoadClient(spec.model, spec.secret, spec.urls, spec.ctrl_port, spec.prompt, spec.tokens, spec.kind)
    try:
        while (cmd := conn.recv()) is not None:
            mode, concurrency, total = cmd
            cpu0, t0 = time.process_time(), time.perf_counter()
            samples, wall = loop.run_until_complete(drive(client.path(mode), concurrency, total))
            cpu = time.process_time() - cpu0
            conn.send(([astuple(s) for s in samples], t0, t0 + wall, cpu))
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()


class ClientProcs:
    """``procs`` client processes, each pinned to one CPU of ``cpus`` in turn (None: unpinned); a context manager
    that stops them on leaving."""

    def __init__(self, spec: ClientSpec, procs: int, cpus: list[int] | None) -> None:
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for i in range(max(1, procs)):
            mine, theirs = ctx.Pipe()
            pin = {cpus[i % len(cpus)]} if cpus else None
            proc = ctx.Process(target=_worker, args=(theirs, spec, pin), name=f"load-client-{i}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def __enter__(self) -> ClientProcs:
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    @property
    def count(self) -> int:
        return len(self._procs)

    def run(self, mode: str, concurrency: int, total: int) -> Shares:
        """``total`` requests by path ``mode``, ``concurrency`` at a time, shared out over the processes (those with
        no stream get no work)."""
        streams, requests = _split(concurrency, self.count), _split(total, self.count)
        busy = [i for i in range(self.count) if streams[i] > 0]
        for i in busy:
            self._conns[i].send((mode, streams[i], max(requests[i], streams[i])))
        samples: list[Sample] = []
        starts, ends, cpu, share = [], [], [], []
        for i in busy:
            got = self._conns[i].recv()
            samples += [Sample(*fields) for fields in got[0]]
            starts.append(got[1])
            ends.append(got[2])
            cpu.append(got[3])
            share.append(got[3] / (got[2] - got[1]) if got[2] > got[1] else 0.0)
        return Shares(samples, max(ends) - min(starts), cpu, share)
