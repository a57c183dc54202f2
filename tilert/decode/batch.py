"""Several sequences on one engine: the decode node's scheduler.

One worker thread owns the engine. Requests join (:meth:`DecodeBatch.submit`) and leave (finish, cancel)
between steps; up to ``Capabilities.max_sequences`` decode at once, each at its own position in its own
engine sequence (cache rows), the rest wait their turn in arrival order.

- **Alone**, a sequence runs on the engine's fastest path for it (MTP speculation, the pipelined greedy
  stream: :func:`~tilert.decode.generate.decode_alone`), checking between steps whether another joined.
- **With company**, every active sequence advances by one token per engine step
  (``engine.decode_step``, or ``decode_step_greedy`` when all of them are greedy). The engine's kernels are
  batch-invariant, so each sequence's tokens are exactly those it would get alone.

A job of ``n`` choices (``DecodeParams.n``) takes ``n`` engine sequences at once, each injected with the same
prompt state and sampled on its own: it is admitted when ``n`` sequences are free, in arrival order (the jobs
behind it wait behind it, so none starves), and gives every sequence back as its choices end. Choice 0 goes on
from prefill's first token; the others draw their own first token from the prompt's last position (recomputed
from the handed-off state and the prompt's last token) with their own random stream, seeded ``seed + index`` as
vLLM seeds a parallel-sampling request's children (greedy: prefill's token is every choice's).

Each job reports through its callbacks, from this thread: ``emit(ids, finish, index, logprobs)`` for choice ``index`` as
in :class:`~tilert.decode.generate.SequenceRun` (every choice that ends by stop or length sends its finish, on
an empty line when it had no token left to send), then ``done(finish)`` once all its choices ended
(``done(exception)`` when the engine failed: every sequence of that step ends with it, and the thread serves on).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

import structlog
import torch

from tilert.contracts import TokenLogprobs
from tilert.decode.generate import Emit, Finish, SequenceRun, SpecCounts, decode_alone
from tilert.decode.grammar import Grammars
from tilert.decode.sampling import DecodeParams, Sampler, seeded_generator
from tilert.engines.base import DecodeEngine, KVLayout

log = structlog.get_logger("tilert.decode.batch")

# (new ids, finish, choice index, the ids' logprobs when the request asks for them)
ChoiceEmit = Callable[[list[int], Finish | None, int, list[TokenLogprobs] | None], None]


@dataclass
class Job:
    """One decode request, its handed-off prompt state and its callbacks."""

    state: dict[str, torch.Tensor]
    layouts: dict[str, KVLayout]
    num_tokens: int
    params: DecodeParams
    emit: ChoiceEmit
    done: Callable[[Finish | BaseException], None]
    cancel: threading.Event
    last_token_id: int | None = None  # the prompt's last token, when the prefill side sent it
    slot: int = -1  # the receive slot holding ``state`` (an engine in another process reads it from there)


@dataclass(eq=False)
class _Running:
    """A job in the engine: the sequence of each of its choices, the choices that sent their finish, and how many
    are still decoding."""

    job: Job
    seqs: list[int]
    left: int = 0
    finished: set[int] = field(default_factory=set)
    cancelled: bool = False
    spec: SpecCounts = field(default_factory=SpecCounts)  # its choices' speculative steps, as they end

    def emit_for(self, index: int) -> Emit:
        def emit(ids: list[int], finish: Finish | None, logprobs: list[TokenLogprobs] | None = None, /) -> None:
            if finish is not None:
                self.finished.add(index)
            self.job.emit(ids, finish, index, logprobs)

        return emit


class DecodeBatch:
    def __init__(
        self,
        engine: DecodeEngine,
        eos_token_ids: frozenset[int],
        num_draft: int = 0,
        cpus: frozenset[int] = frozenset(),
        step_scope: Callable[[], AbstractContextManager[object]] = nullcontext,
        grammars: Grammars | None = None,
        accept_all_drafts: bool = False,
    ) -> None:
        self.engine = engine
        self.accept_all_drafts = accept_all_drafts  # benchmarks only (DecodeConfig.accept_all_drafts)
        self.grammars = grammars  # structured outputs (None: a request with a grammar fails)
        # Around the emits of one step of several sequences: the engine process sends them as one message.
        self._step_scope = step_scope
        self.cpus = cpus  # the worker thread's CPUs (empty: not pinned)
        self.eos = eos_token_ids
        self.num_draft = num_draft
        self.max_sequences = max(1, engine.capabilities().max_sequences)
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: dict[int, tuple[_Running, SequenceRun]] = {}  # by engine sequence
        self._free = list(range(self.max_sequences))
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="tilert-decode-batch", daemon=True)
        self._thread.start()

    # ---- the event loop's side ------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why this batch can decode nothing more (None while it can): as :class:`EngineProcess` says it."""
        return None if self._thread.is_alive() or self._closed else "its worker thread ended"

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the decode batch is closed")
            self._waiting.append(job)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # ---- the worker thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        if self.cpus:  # on Linux this pins the calling thread only; torch's threads start from it
            os.sched_setaffinity(0, self.cpus)
            torch.set_num_threads(len(self.cpus))
        while True:
            with self._cv:
                while not (self._waiting or self._active or self._closed):
                    self._cv.wait()
                if self._closed:
                    return
            try:
                self._admit()
                self._reap()
                if len(self._active) == 1 and not self._waiting_for_room():
                    _, run = next(iter(self._active.values()))
                    decode_alone(self.engine, run, self.num_draft, self._waiting_for_room, self.accept_all_drafts)
                elif self._active:
                    self._step_all()
            except Exception as exc:  # noqa: BLE001 - the sequences of this step end with it; serve on
                sequences = len(self._active)
                self._fail_all(exc)  # before the traceback is rendered: the requests end at once
                log.exception("decode_step_failed", sequences=sequences)
            self._reap()

    def _waiting_for_room(self) -> bool:
        """A request is waiting and the sequences it needs are free (or it can never have them: it is refused
        then): leave the single-sequence fast path."""
        if not self._waiting:
            return False
        n = self._waiting[0].params.n
        return n > self.max_sequences or len(self._free) >= n

    def _admit(self) -> None:
        """Start the waiting jobs, in arrival order, while the first has the sequences it needs."""
        while True:
            with self._cv:
                if not self._waiting_for_room():
                    return
                job = self._waiting.popleft()
            if job.params.n > self.max_sequences:
                job.done(ValueError(f"n={job.params.n}: this engine decodes {self.max_sequences} sequences at once"))
                continue
            running = _Running(job, [self._free.pop(0) for _ in range(job.params.n)])
            try:
                runs = self._start(running)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                self._free.extend(running.seqs)
                job.done(exc)
                log.exception("decode_admit_failed", transfer_id=job.params.transfer_id)
                continue
            for run in runs:
                self._active[run.seq] = (running, run)
            running.left = len(runs)

    def _start(self, running: _Running) -> list[SequenceRun]:
        """Each choice's run, its first token and its sequence injected with the prompt state (a choice whose
        first token already ends it is sent its finish here)."""
        job, seqs = running.job, running.seqs
        p = job.params
        first = SequenceRun(
            self.engine, p, self.eos, job.num_tokens, running.emit_for(0), job.cancel, seqs[0], self.grammars
        )
        runs = [first]
        for i, (token, generator) in enumerate(self._first_tokens(job, first, seqs), start=1):
            child = replace(p, first_token_id=token, seed=None if p.seed is None else p.seed + i)
            emit = running.emit_for(i)
            run = SequenceRun(
                self.engine, child, self.eos, job.num_tokens, emit, job.cancel, seqs[i], self.grammars, generator
            )
            if token in run.eos or token in run.stop_ids:
                run.finish = Finish("stop", None if token in run.eos else token)
            emit([token], run.finish)  # its first token: the router has prefill's for choice 0 only
            runs.append(run)
        for seq in seqs:
            self.engine.inject(job.state, job.layouts, job.num_tokens, seq=seq, last_token_id=job.last_token_id)
        return runs

    def _first_tokens(self, job: Job, first: SequenceRun, seqs: list[int]) -> list[tuple[int, torch.Generator | None]]:
        """The first token of choices 1..n-1 and the random stream each goes on with. Greedy: prefill's token.
        Sampled: drawn from the logits of the prompt's last position, recomputed in choice 1's sequence from the
        prompt state and the prompt's last token (its row is written again with the same token; every sequence is
        injected afresh after this), each choice with the rules of an empty completion and its own stream."""
        p = job.params
        if p.n == 1 or p.greedy:
            return [(p.first_token_id, None)] * (p.n - 1)
        if job.last_token_id is None:
            raise ValueError("n > 1 with sampling needs the prompt's last token, which the prefill side did not send")
        self.engine.inject(job.state, job.layouts, job.num_tokens, seq=seqs[1])
        logits = self.engine.forward(torch.tensor([job.last_token_id], dtype=torch.long), job.num_tokens - 1, seqs[1])
        stop = first.eos | first.stop_ids
        out: list[tuple[int, torch.Generator | None]] = []
        for i in range(1, p.n):
            generator = seeded_generator(None if p.seed is None else p.seed + i)  # vLLM: child i's seed is seed + i
            matcher = None if self.grammars is None or p.grammar is None else self.grammars.matcher(p.grammar, stop)
            out.append((Sampler(p, stop, matcher, generator, completion=[])(logits[-1]), generator))
        return out

    def _reap(self) -> None:
        for seq, (running, run) in list(self._active.items()):
            if run.check_cancel():
                del self._active[seq]
                self._free.append(seq)
                self._ended(running, run, running.seqs.index(seq))

    def _ended(self, running: _Running, run: SequenceRun, index: int) -> None:
        """Choice ``index`` of ``running`` ended: its finish sent (if it had no token left to carry it), and the
        job done once every choice has ended."""
        finish = run.finish
        assert finish is not None
        if finish.reason == "cancelled":
            running.cancelled = True
        elif index not in running.finished:
            running.emit_for(index)([], finish)
        running.left -= 1
        running.spec += run.spec
        if running.left == 0:
            done = Finish("cancelled") if running.cancelled else finish
            running.job.done(replace(done, spec=running.spec) if running.spec.drafts else done)

    def _fail_all(self, exc: BaseException) -> None:
        failed: dict[int, _Running] = {}
        for seq, (running, _) in list(self._active.items()):
            del self._active[seq]
            self._free.append(seq)
            failed[id(running)] = running
        for running in failed.values():
            running.job.done(exc)

    def _step_all(self) -> None:
        """One token for every active sequence in one engine step."""
        items = [(running, run) for running, run in self._active.values() if not run.check_cancel()]
        if not items:
            return
        tokens, positions, seqs = [r.token for _, r in items], [r.pos for _, r in items], [r.seq for _, r in items]
        if all(r.params.greedy and not r.params.needs_logits for _, r in items):
            if self.engine.capabilities().pipelined_greedy:
                self._stream_all([run for _, run in items])
                return
            new = self.engine.decode_step_greedy(tokens, positions, seqs)
        else:
            logits = self.engine.decode_step(tokens, positions, seqs)
            new = [run.sample(logits[i]) for i, (_, run) in enumerate(items)]
        with self._step_scope():
            for (_, run), token in zip(items, new, strict=True):
                run.accept([token])

    def _stream_all(self, runs: list[SequenceRun]) -> None:
        """Plain greedy sequences together on the engine's pipelined stream, one token each per step, until one of
        them ends or is cancelled or a waiting request can join (the next step has then already run; its rows are
        rewritten when the sequences go on)."""
        left = min(run.limit - run.produced for run in runs)
        steps = self.engine.greedy_batch_stream(
            [run.token for run in runs], [run.pos for run in runs], [run.seq for run in runs], left
        )
        try:
            for new in steps:
                with self._step_scope():
                    for run, token in zip(runs, new, strict=True):
                        run.accept([token])
                if any(run.done or run.check_cancel() for run in runs) or self._waiting_for_room():
                    return
        finally:
            steps.close()
