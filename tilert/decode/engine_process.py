"""The engine in a process of its own (``tilert decode --engine-process``), as vLLM runs its EngineCore.

In one process the decode node's HTTP loop and the engine's thread share one GIL: every token the loop relays
(a line encoded, a chunk written) is Python the engine's step then waits for between its ATen calls. On the
2-core CPU demo that cost the engine a third of its speed. Here a child process owns the engine and its
:class:`~tilert.decode.batch.DecodeBatch`; the node keeps the slots, the transports and HTTP, and talks to
the child over a pipe in the typed messages of :mod:`tilert.contracts` (part 5):

    node (EngineProcess)                     engine process (_serve)
                                        <-  EngineReady(name, vocab, capabilities, layouts)
    the receive buffers (shared memory) ->  mapped once, by torch's tensor sharing
    EngineSubmit(job, slot, layouts...) ->  DecodeBatch.submit
                                        <-  EngineTokens(job, ids[, finish, choice]) ... EngineJobDone(job, ...)
                                            (finish | error; a step of several sequences: their tokens in one
                                            EngineStep)
    EngineCancel(job)                   ->  the job's cancel flag (checked between steps)
    EngineCheck(call, layouts)          ->  <- EngineCheckResult(call, error)
    EngineStop / the pipe closed        ->  the batch closes, the process ends

The prompt state never crosses the pipe: the receive buffers are allocated in shared memory
(``SlotTable(shared=True)``) before the transport registers them, and a submit names the slot.

Faults end requests fast: if the engine process dies, every job in it ends with an error at once, the node's
``/health`` answers 503 and new decodes are refused; a check that gets no answer within
``CALL_TIMEOUT_S`` fails the offer.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import torch

from tilert import contracts as c
from tilert.decode.batch import DecodeBatch, Job
from tilert.decode.config import resolve_device, resolve_dtype
from tilert.decode.generate import Finish, SpecCounts
from tilert.decode.grammar import Grammars
from tilert.decode.sampling import DecodeParams
from tilert.decode.slots import state_views
from tilert.engines.base import Capabilities, DecodeEngine, KVLayout
from tilert.engines.plugin import load_engine

if TYPE_CHECKING:
    from tilert.decode.config import DecodeConfig

log = structlog.get_logger("tilert.decode.engine_process")

START_TIMEOUT_S = 600.0  # loading (and compiling) a model
CALL_TIMEOUT_S = 10.0
_POLL_S = 0.005  # the node's reader: how often it looks for cancelled jobs while jobs are live and no event comes


class EngineProcessError(RuntimeError):
    """The engine process is gone (or never started): what it held ended with this."""


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads: the arguments of ``DecodeEngine.load`` and of its ``DecodeBatch``."""

    engine: str
    model: str
    device: str
    dtype: str
    max_seq_len: int
    max_sequences: int
    eos_token_ids: tuple[int, ...]
    num_draft: int
    cpus: tuple[int, ...]
    accept_all_drafts: bool = False
    draft_head: str = "model"
    draft_vocab: tuple[int, ...] | None = None

    def load(self) -> DecodeEngine:
        """The engine, loaded in the calling process (the node's own, or the engine process), and warmed up."""
        device = resolve_device(self.device)
        engine = load_engine(self.engine).load(
            Path(self.model),
            device=device,
            dtype=resolve_dtype(self.dtype, device),
            max_seq_len=self.max_seq_len,
            max_sequences=self.max_sequences,
        )
        engine.warm_up(self.num_draft, self.accept_all_drafts, self.draft_head, self.draft_vocab)
        return engine


def params_to_wire(p: DecodeParams) -> c.EngineParams:
    fields = asdict(p)
    for name in ("stop_token_ids", "prompt_token_ids"):
        fields[name] = list(fields[name])
    fields["allowed_token_ids"] = None if p.allowed_token_ids is None else list(p.allowed_token_ids)
    fields["bad_words_token_ids"] = [list(w) for w in p.bad_words_token_ids]
    fields["grammar"] = p.grammar  # a struct: asdict copied it as it is
    return c.EngineParams(**fields)


def params_from_wire(w: c.EngineParams) -> DecodeParams:
    fields = msgspec.structs.asdict(w)
    for name in ("stop_token_ids", "prompt_token_ids"):
        fields[name] = tuple(fields[name])
    fields["allowed_token_ids"] = None if w.allowed_token_ids is None else tuple(w.allowed_token_ids)
    fields["bad_words_token_ids"] = tuple(tuple(word) for word in w.bad_words_token_ids)
    return DecodeParams(**fields)


class RemoteEngine(DecodeEngine):
    """The engine as the node sees it when the engine runs in its own process: its facts, and ``check_layouts``
    asked of the engine itself. It computes nothing here (the node hands decodes to :class:`EngineProcess`)."""

    def __init__(self, ready: c.EngineReady, check: Callable[[Mapping[str, KVLayout]], None]) -> None:
        caps = ready.capabilities
        self.name = ready.name  # type: ignore[misc]
        self._vocab = ready.vocab_size
        self._caps = Capabilities(**{**msgspec.structs.asdict(caps), "notes": tuple(caps.notes)})
        self._layouts = dict(ready.layouts)
        self._check = check

    @classmethod
    def load(cls, *args: Any, **kwargs: Any) -> DecodeEngine:
        raise NotImplementedError("started by EngineProcess")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def capabilities(self) -> Capabilities:
        return self._caps

    def expected_layouts(self) -> dict[str, KVLayout]:
        return dict(self._layouts)

    def check_layouts(self, layouts: Mapping[str, KVLayout]) -> None:
        self._check(layouts)

    def inject(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("the engine runs in its own process")

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("the engine runs in its own process")


class EngineProcess:
    """The node's side: the engine process, started and ready, with :class:`DecodeBatch`'s interface
    (``submit``, ``running``, ``waiting``, ``close``) and the engine's facts (:attr:`engine`)."""

    def __init__(self, spec: EngineSpec) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_main, args=(child, spec), name="tilert-engine", daemon=True)
        self._proc.start()
        child.close()
        self.max_sequences = max(1, spec.max_sequences)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._cancelled: set[int] = set()
        self._calls: dict[int, tuple[threading.Event, list[str | None]]] = {}
        self._ids = itertools.count()
        self.failure: str | None = None
        self._closing = False
        if not self._conn.poll(START_TIMEOUT_S):
            self._kill()
            raise EngineProcessError(f"the engine process did not start within {START_TIMEOUT_S:g} s")
        try:
            ready = c.parse_engine_event(self._conn.recv_bytes())
        except EOFError:
            self._kill()
            code = self._proc.exitcode
            raise EngineProcessError(f"the engine process exited while loading (exit code {code})") from None
        if not isinstance(ready, c.EngineReady):
            self._kill()
            raise EngineProcessError(f"the engine process said {type(ready).__name__} before it was ready")
        self.engine = RemoteEngine(ready, self._check)
        self._reader: threading.Thread | None = None

    def attach(self, buffers: list[torch.Tensor]) -> None:
        """Hand the engine the receive buffers (shared memory: ``SlotTable(shared=True)``), slot by slot; then
        the node may submit."""
        if any(not b.is_shared() for b in buffers):
            raise ValueError("the receive buffers must be in shared memory (SlotTable(shared=True))")
        self._conn.send(buffers)  # torch's tensor sharing: the child maps the same memory
        self._reader = threading.Thread(target=self._read, name="tilert-engine-events", daemon=True)
        self._reader.start()

    # ---- DecodeBatch's interface ------------------------------------------------------------------

    @property
    def running(self) -> int:
        return min(len(self._jobs), self.max_sequences)

    @property
    def waiting(self) -> int:
        return max(0, len(self._jobs) - self.max_sequences)

    def submit(self, job: Job) -> None:
        if self.failure is not None:
            raise EngineProcessError(self.failure)
        if job.slot < 0:
            raise ValueError("a job for the engine process names its receive slot")
        key = next(self._ids)
        msg = c.EngineSubmit(
            key, job.slot, job.num_tokens, dict(job.layouts), params_to_wire(job.params), job.last_token_id
        )
        with self._lock:
            self._jobs[key] = job
        self._send(msg)

    def close(self) -> None:
        self._closing = True
        try:
            self._send(c.EngineStop())
        except (OSError, EngineProcessError):
            pass
        self._proc.join(timeout=10)
        self._kill()  # the reader sees the pipe's end and stops
        if self._reader is not None:
            self._reader.join(timeout=2)
        self._conn.close()

    # ---- internals ----------------------------------------------------------------------------------

    def _send(self, msg: c.EngineCommand) -> None:
        try:
            with self._send_lock:
                self._conn.send_bytes(c.dump_engine(msg))
        except OSError as exc:
            raise EngineProcessError(f"the engine process is gone: {exc}") from None

    def _check(self, layouts: Mapping[str, KVLayout]) -> None:
        if self.failure is not None:
            raise ValueError(f"the engine process is gone: {self.failure}")
        key, done = next(self._ids), threading.Event()
        answer: list[str | None] = [None]
        with self._lock:
            self._calls[key] = (done, answer)
        try:
            self._send(c.EngineCheck(key, dict(layouts)))
            if not done.wait(CALL_TIMEOUT_S):
                raise ValueError(f"the engine process did not answer a layout check within {CALL_TIMEOUT_S:g} s")
        finally:
            with self._lock:
                self._calls.pop(key, None)
        if answer[0] is not None:
            raise ValueError(answer[0])

    def _read(self) -> None:
        """Events from the engine to each job's callbacks; cancelled jobs to the engine; the engine's end.
        While jobs are live it looks for cancels every ``_POLL_S``; with none it sleeps until the engine speaks
        (a job submitted meanwhile is live from the engine's first event on, one step later; a cancel before that
        costs the engine that step), so an idle node does not wake."""
        try:
            while True:
                self._forward_cancels()
                with self._lock:
                    live = bool(self._jobs)
                if self._conn.poll(_POLL_S if live else None):
                    self._dispatch(c.parse_engine_event(self._conn.recv_bytes()))
        except (EOFError, OSError, c.ContractError, EngineProcessError) as exc:
            self._proc.join(timeout=1)
            code = self._proc.exitcode
            reason = f"the engine process exited (code {code})" if code is not None else f"engine pipe: {exc}"
            self._fail(reason)

    def _forward_cancels(self) -> None:
        with self._lock:
            newly = [k for k, j in self._jobs.items() if j.cancel.is_set() and k not in self._cancelled]
            self._cancelled.update(newly)
        for key in newly:
            self._send(c.EngineCancel(key))

    def _dispatch(self, ev: c.EngineEvent) -> None:
        if isinstance(ev, c.EngineStep):
            for tokens in ev.tokens:
                self._dispatch(tokens)
            return
        if isinstance(ev, c.EngineCheckResult):
            with self._lock:
                call = self._calls.get(ev.call)
            if call is not None:
                call[1][0] = ev.error
                call[0].set()
            return
        with self._lock:
            job = self._jobs.get(ev.job) if isinstance(ev, c.EngineTokens | c.EngineJobDone) else None
            if isinstance(ev, c.EngineJobDone):
                self._jobs.pop(ev.job, None)
                self._cancelled.discard(ev.job)
        if job is None:
            return
        if isinstance(ev, c.EngineTokens):
            finish = None if ev.finish is None else Finish(ev.finish, ev.stop_token_id)
            job.emit(ev.token_ids, finish, ev.index, ev.logprobs)
        elif isinstance(ev, c.EngineJobDone):
            s = ev.spec
            spec = None if s is None else SpecCounts(s.drafts, s.draft_tokens, tuple(s.accepted_per_pos))
            job.done(
                EngineProcessError(ev.error)
                if ev.error is not None
                else Finish(ev.finish or "cancelled", ev.stop_token_id, spec)
            )

    def _fail(self, reason: str) -> None:
        """The engine is gone: every job in it ends now (its stream gets an error line), later ones are refused."""
        self.failure = reason
        if not self._closing:
            log.error("engine_process_lost", reason=reason)
        with self._lock:
            jobs, self._jobs = list(self._jobs.values()), {}
            calls = list(self._calls.values())
        for job in jobs:
            job.done(EngineProcessError(reason))
        for done, answer in calls:
            answer[0] = f"the engine process is gone: {reason}"
            done.set()

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)


# ---- the engine process ------------------------------------------------------------------------------


def _main(conn: Connection, spec: EngineSpec) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the node, which stops this process
    engine = spec.load()
    caps = engine.capabilities()
    conn.send_bytes(
        c.dump_engine(
            c.EngineReady(
                engine.name,
                engine.vocab_size,
                c.EngineCaps(**{**asdict(caps), "notes": list(caps.notes)}),
                engine.expected_layouts(),
            )
        )
    )
    buffers: list[torch.Tensor] = conn.recv()
    send = EventSender(conn)
    batch = DecodeBatch(
        engine,
        frozenset(spec.eos_token_ids),
        spec.num_draft,
        frozenset(spec.cpus),
        send.step,
        Grammars(spec.model, engine.vocab_size),
        spec.accept_all_drafts,
    )
    try:
        _serve(conn, engine, batch, buffers, send)
    finally:
        batch.close()


class EventSender:
    """The engine's events to the node, one pipe message each; inside :meth:`step` (the batch thread's emits of
    one step of several sequences) their tokens go as one :class:`~tilert.contracts.EngineStep` at its end: a pipe
    write, and a wake-up of the node, costs the engine's thread tens of microseconds each."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._held: list[c.EngineTokens] | None = None  # set only on the batch thread, inside step()

    def __call__(self, msg: c.EngineEvent) -> None:
        if self._held is not None and isinstance(msg, c.EngineTokens):  # tokens come from the batch thread only
            self._held.append(msg)
            return
        self._write(msg)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self._write(held[0] if len(held) == 1 else c.EngineStep(held))

    def _write(self, msg: c.EngineEvent) -> None:
        with self._lock:
            self._conn.send_bytes(c.dump_engine(msg))


def _serve(
    conn: Connection,
    engine: DecodeEngine,
    batch: DecodeBatch,
    buffers: list[torch.Tensor],
    send: EventSender,
) -> None:
    cancels: dict[int, threading.Event] = {}

    def job_for(cmd: c.EngineSubmit) -> Job:
        key, cancel = cmd.job, threading.Event()
        cancels[key] = cancel

        def emit(ids: list[int], finish: Finish | None, index: int, logprobs: list[c.TokenLogprobs] | None) -> None:
            send(
                c.EngineTokens(key, ids, None, None, index, logprobs)
                if finish is None
                else c.EngineTokens(key, ids, finish.reason, finish.stop_token_id, index, logprobs)  # type: ignore[arg-type]
            )

        def done(result: Finish | BaseException) -> None:
            cancels.pop(key, None)
            if isinstance(result, Finish):
                s = result.spec
                tally = None if s is None else c.SpecTally(s.drafts, s.draft_tokens, list(s.accepted_per_pos))
                send(c.EngineJobDone(key, result.reason, result.stop_token_id, spec=tally))
            else:
                send(c.EngineJobDone(key, error=f"{type(result).__name__}: {result}"[: c.MAX_REASON_CHARS]))

        state = state_views(buffers[cmd.slot], cmd.layouts, cmd.num_tokens)
        return Job(
            state,
            dict(cmd.layouts),
            cmd.num_tokens,
            params_from_wire(cmd.params),
            emit,
            done,
            cancel,
            cmd.last_token_id,
            cmd.slot,
        )

    while True:
        try:
            cmd = c.parse_engine_command(conn.recv_bytes())
        except EOFError:  # the node is gone
            return
        if isinstance(cmd, c.EngineStop):
            return
        if isinstance(cmd, c.EngineSubmit):
            if cmd.slot >= len(buffers):
                send(c.EngineJobDone(cmd.job, error=f"no receive slot {cmd.slot}"))
                continue
            batch.submit(job_for(cmd))
        elif isinstance(cmd, c.EngineCancel):
            event = cancels.get(cmd.job)
            if event is not None:
                event.set()
        elif isinstance(cmd, c.EngineCheck):
            try:
                engine.check_layouts(cmd.layouts)
                send(c.EngineCheckResult(cmd.call))
            except ValueError as exc:
                send(c.EngineCheckResult(cmd.call, str(exc)[: c.MAX_REASON_CHARS]))


def spec_for(config: DecodeConfig, eos: frozenset[int]) -> EngineSpec:
    """The engine process's spec from a :class:`~tilert.decode.config.DecodeConfig`."""
    return EngineSpec(
        engine=config.engine,
        model=str(config.model),
        device=config.device,
        dtype=config.dtype,
        max_seq_len=config.max_seq_len,
        max_sequences=config.sequences,
        eos_token_ids=tuple(sorted(eos)),
        num_draft=config.speculative_tokens,
        cpus=tuple(sorted(config.engine_cpu_set)),
        accept_all_drafts=config.accept_all_drafts,
        draft_head=config.draft_head,
        draft_vocab=config.draft_vocab_ids(),
    )
