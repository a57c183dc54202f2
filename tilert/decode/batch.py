"""Several sequences on one engine: the decode node's scheduler.

One worker thread owns the engine. Requests join (:meth:`DecodeBatch.submit`) and leave (finish, cancel)
between steps; up to ``Capabilities.max_sequences`` decode at once, each at its own position in its own
engine sequence (cache rows), the rest wait their turn in arrival order.

- **Alone**, a sequence runs on the engine's fastest path for it (MTP speculation, the pipelined greedy
  stream: :func:`~tilert.decode.generate.decode_alone`), checking between steps whether another joined.
- **With company**, every active sequence advances by one token per engine step
  (``engine.decode_step``, or ``decode_step_greedy`` when all of them are greedy). The engine's kernels are
  batch-invariant, so each sequence's tokens are exactly those it would get alone.

Each job reports through its callbacks, from this thread: ``emit(ids, finish)`` as in
:class:`~tilert.decode.generate.SequenceRun`, then ``done(finish)`` (or ``done(exception)`` when the engine
failed: every sequence of that step ends with it, and the thread serves on).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import structlog
import torch

from tilert.decode.generate import Emit, Finish, SequenceRun, decode_alone
from tilert.decode.grammar import Grammars
from tilert.decode.sampling import DecodeParams
from tilert.engines.base import DecodeEngine, KVLayout

log = structlog.get_logger("tilert.decode.batch")


@dataclass
class Job:
    """One decode request, its handed-off prompt state and its callbacks."""

    state: dict[str, torch.Tensor]
    layouts: dict[str, KVLayout]
    num_tokens: int
    params: DecodeParams
    emit: Emit
    done: Callable[[Finish | BaseException], None]
    cancel: threading.Event
    last_token_id: int | None = None  # the prompt's last token, when the prefill side sent it
    slot: int = -1  # the receive slot holding ``state`` (an engine in another process reads it from there)


class DecodeBatch:
    def __init__(
        self,
        engine: DecodeEngine,
        eos_token_ids: frozenset[int],
        num_draft: int = 0,
        cpus: frozenset[int] = frozenset(),
        step_scope: Callable[[], AbstractContextManager[object]] = nullcontext,
        grammars: Grammars | None = None,
    ) -> None:
        self.engine = engine
        self.grammars = grammars  # structured outputs (None: a request with a grammar fails)
        # Around the emits of one step of several sequences: the engine process sends them as one message.
        self._step_scope = step_scope
        self.cpus = cpus  # the worker thread's CPUs (empty: not pinned)
        self.eos = eos_token_ids
        self.num_draft = num_draft
        self.max_sequences = max(1, engine.capabilities().max_sequences)
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: dict[int, tuple[Job, SequenceRun]] = {}
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
                    decode_alone(self.engine, run, self.num_draft, self._waiting_for_room)
                elif self._active:
                    self._step_all()
            except Exception as exc:  # noqa: BLE001 - the sequences of this step end with it; serve on
                log.exception("decode_step_failed", sequences=len(self._active))
                self._fail_all(exc)
            self._reap()

    def _waiting_for_room(self) -> bool:
        """A request is waiting and a sequence is free for it: leave the single-sequence fast path."""
        return bool(self._waiting) and bool(self._free)

    def _admit(self) -> None:
        while self._free:
            with self._cv:
                if not self._waiting:
                    return
                job = self._waiting.popleft()
            seq = self._free.pop(0)
            try:
                run = SequenceRun(
                    self.engine, job.params, self.eos, job.num_tokens, job.emit, job.cancel, seq, self.grammars
                )
                self.engine.inject(job.state, job.layouts, job.num_tokens, seq=seq, last_token_id=job.last_token_id)
            except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                log.exception("decode_admit_failed", transfer_id=job.params.transfer_id)
                self._free.append(seq)
                job.done(exc)
                continue
            self._active[seq] = (job, run)

    def _reap(self) -> None:
        for seq, (job, run) in list(self._active.items()):
            if run.check_cancel():
                del self._active[seq]
                self._free.append(seq)
                assert run.finish is not None
                job.done(run.finish)

    def _fail_all(self, exc: BaseException) -> None:
        for seq, (job, _) in list(self._active.items()):
            del self._active[seq]
            self._free.append(seq)
            job.done(exc)

    def _step_all(self) -> None:
        """One token for every active sequence in one engine step."""
        items = [(job, run) for job, run in self._active.values() if not run.check_cancel()]
        if not items:
            return
        tokens, positions, seqs = [r.token for _, r in items], [r.pos for _, r in items], [r.seq for _, r in items]
        if all(r.params.greedy and not r.params.needs_logits for _, r in items):
            new = self.engine.decode_step_greedy(tokens, positions, seqs)
        else:
            logits = self.engine.decode_step(tokens, positions, seqs)
            new = [run.sample(logits[i]) for i, (_, run) in enumerate(items)]
        with self._step_scope():
            for (_, run), token in zip(items, new, strict=True):
                run.accept([token])
