"""The engine in a process of its own (:mod:`tilert.decode.engine_process`), with a real tiny engine: several
concurrent sequences decode exactly what they decode alone, a cancel frees the sequence at once, the engine's own
``check_layouts`` answers the node, and an engine process that dies ends every request in it at once.

The whole stack with ``TILERT_DECODE_ENGINE_PROCESS=1`` passes ``tests/test_e2e_stack.py`` as well (router tokens
equal vLLM alone's); this file covers what only a separate process can get wrong.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.sink import Sink
from support.waiting import wait_until

from tilert import contracts as c
from tilert.decode.batch import Job
from tilert.decode.engine_process import EngineProcess, EngineProcessError, EngineSpec, params_to_wire
from tilert.decode.generate import Finish
from tilert.decode.sampling import DecodeParams
from tilert.decode.slots import state_views
from tilert.engines.base import KVLayout
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine

MAX_SEQ = 64
PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42], [70, 71, 72, 73, 74, 75, 76], [100, 101, 102, 103]]

pytestmark = pytest.mark.timeout(300)


@dataclass
class Prompt:
    buffer: torch.Tensor  # the prompt state in a receive buffer of shared memory, as a transport leaves it
    layouts: dict[str, KVLayout]
    num_tokens: int
    first: int
    alone: list[int]  # greedy tokens after ``first`` decoded alone until the cache is full


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert.models.tiny import build_tiny_model

    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("eproc") / "m", seed=0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[Prompt]:
    out = []
    for ids in PROMPTS:
        eng = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
        n = len(ids)
        first = int(eng.forward(torch.tensor(ids), 0)[-1].argmax())
        a = eng.model.args
        mla = layouts.encode_mla_dense(eng.model.kv_cache[:, :n], "float32", a.kv_lora_rank, True)
        lays = eng.expected_layouts()
        buffer = torch.zeros(1 << 20, dtype=torch.uint8).share_memory_()
        state_views(buffer, lays, n)["mla"].copy_(mla)
        alone, token = [], first
        for pos in range(n, MAX_SEQ):
            token = int(eng.forward(torch.tensor([token]), pos)[-1].argmax())
            alone.append(token)
        out.append(Prompt(buffer, lays, n, first, alone))
    return out


def _spec(model: Path, max_sequences: int) -> EngineSpec:
    return EngineSpec("tilert", str(model), "cpu", "float32", MAX_SEQ, max_sequences, (), 0, ())


def _job(
    p: Prompt,
    slot: int,
    sink: Sink,
    max_tokens: int | None,
    cancel: threading.Event | None = None,
    logprobs: int | None = None,
) -> Job:
    params = DecodeParams(f"t{slot}", p.first, p.num_tokens, max_tokens, temperature=0.0, logprobs=logprobs)
    state = state_views(p.buffer, p.layouts, p.num_tokens)
    return Job(state, p.layouts, p.num_tokens, params, sink.emit, sink.done, cancel or threading.Event(), None, slot)


def test_sequences_in_the_engine_process_decode_what_they_decode_alone(model: Path, prompts: list[Prompt]) -> None:
    proc = EngineProcess(_spec(model, 3))
    try:
        assert proc.engine.vocab_size > 0 and proc.engine.capabilities().max_sequences == 3
        proc.attach([p.buffer for p in prompts])
        sinks = [Sink() for _ in prompts]
        lengths = [20, 6, 30, 12]  # the 2nd leaves early; the 4th waits for a free sequence, then joins
        for slot, (p, sink, n) in enumerate(zip(prompts, sinks, lengths, strict=True)):
            proc.submit(_job(p, slot, sink, n, logprobs=3 if slot % 2 else None))  # with and without logprobs
        for sink in sinks:
            assert sink.ended.wait(120)
        for slot, (p, sink, n) in enumerate(zip(prompts, sinks, lengths, strict=True)):
            assert sink.result == Finish("length") and sink.finish[-1] == Finish("length")
            assert sink.ids == p.alone[:n]  # bit-identical greedy tokens, as alone in this process
            # each token's logprobs crossed the pipe with it: greedy, the token is the most likely one
            assert [(lp.rank, lp.top_ids[0], len(lp.top_ids)) for lp in sink.logprobs] == (
                [(1, t, 3) for t in sink.ids] if slot % 2 else []
            )
    finally:
        proc.close()


def test_the_choices_of_a_job_cross_the_process_boundary_each_on_its_own(model: Path, prompts: list[Prompt]) -> None:
    """A job of 3 choices: each choice's tokens and finish come back under its index, greedy ones as alone."""
    proc = EngineProcess(_spec(model, 3))
    try:
        proc.attach([p.buffer for p in prompts])
        p, sink = prompts[1], Sink()
        params = DecodeParams("t", p.first, p.num_tokens, 7, temperature=0.0, n=3)
        state = state_views(p.buffer, p.layouts, p.num_tokens)
        proc.submit(Job(state, p.layouts, p.num_tokens, params, sink.emit, sink.done, threading.Event(), None, 1))
        assert sink.ended.wait(60) and sink.result == Finish("length")
        assert sink.choices == {0: p.alone[:7], 1: [p.first, *p.alone[:7]], 2: [p.first, *p.alone[:7]]}
        assert sink.finishes == {i: Finish("length") for i in range(3)}
    finally:
        proc.close()


def test_a_cancel_reaches_the_engine_process_and_frees_the_sequence(model: Path, prompts: list[Prompt]) -> None:
    proc = EngineProcess(_spec(model, 1))
    try:
        proc.attach([p.buffer for p in prompts])
        long, late, cancel = Sink(), Sink(), threading.Event()
        proc.submit(_job(prompts[0], 0, long, None, cancel))
        proc.submit(_job(prompts[2], 2, late, 5))
        wait_until(lambda: len(long.ids) >= 3, 30, "the first sequence's third token")
        assert proc.waiting == 1 and not late.ids  # one sequence, taken: the second request waits
        cancel.set()
        assert long.ended.wait(5) and long.result == Finish("cancelled")
        assert late.ended.wait(60) and late.ids == prompts[2].alone[:5]  # it got the freed sequence
        if proc._reader is not None and os.path.exists(f"/proc/self/task/{proc._reader.native_id}/status"):
            # Nothing live: the node's reader sleeps until the engine speaks, it does not wake to look for cancels.
            wait_until(lambda: proc.running == 0 and proc.waiting == 0, 5, "no job left in the engine process")
            before = _switches(proc._reader.native_id)
            time.sleep(0.5)  # the quiet half second is the behaviour under test: the reader must not wake in it
            assert _switches(proc._reader.native_id) - before <= 5
    finally:
        proc.close()


def _switches(tid: int | None) -> int:
    """A thread's voluntary context switches so far (Linux): how often it went to sleep."""
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_layouts_are_checked_by_the_engine_itself(model: Path, prompts: list[Prompt]) -> None:
    proc = EngineProcess(_spec(model, 1))
    try:
        proc.attach([prompts[0].buffer])
        proc.engine.check_layouts(prompts[0].layouts)  # what the engine takes passes
        wrong = {"mla": c.KVLayout("mla_dense", "float32", 8, prompts[0].layouts["mla"].num_layers)}
        with pytest.raises(ValueError, match="mla rows of 8 bytes"):
            proc.engine.check_layouts(wrong)
    finally:
        proc.close()


def test_an_engine_process_that_dies_ends_every_request_at_once(model: Path, prompts: list[Prompt]) -> None:
    proc = EngineProcess(_spec(model, 2))
    try:
        proc.attach([p.buffer for p in prompts])
        sinks = [Sink(), Sink()]
        for slot, sink in enumerate(sinks):
            proc.submit(_job(prompts[slot], slot, sink, None))
        wait_until(lambda: all(s.ids for s in sinks), 30, "a first token of both sequences")
        pid = proc._proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for sink in sinks:
            assert sink.ended.wait(5)
            assert isinstance(sink.result, EngineProcessError) and "exited" in str(sink.result)
        assert time.monotonic() - killed < 1.0
        assert proc.failure is not None and proc.running == 0
        with pytest.raises(EngineProcessError):
            proc.submit(_job(prompts[2], 2, Sink(), 3))
        with pytest.raises(ValueError, match="gone"):
            proc.engine.check_layouts(prompts[0].layouts)
    finally:
        proc.close()


def test_decode_params_cross_the_pipe_field_for_field() -> None:
    """``EngineParams`` mirrors ``DecodeParams``: a field added to one and not the other fails here."""
    params = DecodeParams("x", 3, 7, 11, 0.5, 0.9, 4, 1234, (5, 6), True)
    wire = c.parse_engine_command(c.dump_engine(c.EngineSubmit(1, 0, 7, {}, params_to_wire(params))))
    assert isinstance(wire, c.EngineSubmit)
    from tilert.decode.engine_process import params_from_wire

    assert params_from_wire(wire.params) == params
    assert [f.name for f in dataclasses.fields(DecodeParams)] == list(c.EngineParams.__struct_fields__)


def test_a_steps_tokens_cross_the_pipe_as_one_message() -> None:
    """Inside ``EventSender.step`` the tokens of the step's sequences go as one ``EngineStep`` at its end (one
    pipe write for the engine's thread), in emit order; a lone token and every other event go at once."""
    import multiprocessing

    from tilert.decode.engine_process import EventSender

    mine, theirs = multiprocessing.Pipe()
    send = EventSender(mine)
    send(c.EngineTokens(1, [5]))
    assert c.parse_engine_event(theirs.recv_bytes()) == c.EngineTokens(1, [5])
    with send.step():
        send(c.EngineTokens(1, [6]))
        send(c.EngineCheckResult(9))  # not a token: goes at once, as from the node's serving thread
        send(c.EngineTokens(2, [7], "length"))
        assert c.parse_engine_event(theirs.recv_bytes()) == c.EngineCheckResult(9) and not theirs.poll(0.05)
    got = c.parse_engine_event(theirs.recv_bytes())
    assert got == c.EngineStep([c.EngineTokens(1, [6]), c.EngineTokens(2, [7], "length")]) and not theirs.poll(0.05)
    with send.step():
        send(c.EngineTokens(3, [8]))
    assert c.parse_engine_event(theirs.recv_bytes()) == c.EngineTokens(3, [8])  # one token: no wrapper
    with send.step():
        pass
    assert not theirs.poll(0.05)  # an empty step sends nothing


def test_a_jobs_speculative_counts_cross_the_pipe_with_its_end() -> None:
    """What the node's spec-decode metrics count comes back from the engine process with the job's end."""
    from tilert.decode.generate import SpecCounts

    spec = SpecCounts().step(3, 2).step(3, 0).step(0, 0).step(3, 3)
    assert (spec.drafts, spec.draft_tokens, spec.accepted_per_pos, spec.accepted_tokens) == (3, 9, (2, 2, 1), 5)
    done = c.EngineJobDone(
        7, "stop", None, spec=c.SpecTally(spec.drafts, spec.draft_tokens, list(spec.accepted_per_pos))
    )
    back = c.parse_engine_event(c.dump_engine(done))
    assert back == done and isinstance(back, c.EngineJobDone) and back.spec is not None
    assert SpecCounts(back.spec.drafts, back.spec.draft_tokens, tuple(back.spec.accepted_per_pos)) == spec
    assert c.parse_engine_event(c.dump_engine(c.EngineJobDone(8, "length"))) == c.EngineJobDone(8, "length")
    too_many = c.EngineJobDone(9, "stop", spec=c.SpecTally(1, 1, [1] * (c.MAX_DRAFTS + 1)))
    with pytest.raises(c.ContractError):
        c.parse_engine_event(c.dump_engine(too_many))
