"""The decode node's scheduler (:mod:`tilert.decode.batch`) with a real tiny engine holding 3 sequences:
each of several concurrent sequences decodes exactly what it decodes alone, sequences join and leave
mid-stream, and a cancelled sequence frees its engine sequence at once for the next request. A job of ``n``
choices waits for ``n`` free sequences in arrival order, each choice decodes what one alone would (greedy: the
same tokens; sampled: its first token drawn from the prompt's last position with seed + index, reproducibly),
and every sequence comes back however it ends."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.sink import Sink
from support.waiting import wait_until

from tilert.decode.batch import DecodeBatch, Job
from tilert.decode.generate import Finish
from tilert.decode.sampling import DecodeParams, Sampler, seeded_generator
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine

MAX_SEQ = 64
PROMPTS = [[11, 12, 13, 14, 15], [40, 41, 42], [70, 71, 72, 73, 74, 75, 76], [100, 101, 102, 103]]

pytestmark = pytest.mark.timeout(300)


@dataclass
class Prompt:
    state: dict[str, torch.Tensor]
    num_tokens: int
    first: int
    alone: list[int]  # greedy tokens after ``first`` decoded alone until the cache is full (MAX_SEQ - n)
    ids: list[int]  # the prompt
    last_logits: torch.Tensor  # the logits of its last position (what the first token is drawn from)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert.models.tiny import build_tiny_model

    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("batch") / "m", seed=0, num_hidden_layers=2)


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[Prompt]:
    """Each prompt's KV (as vLLM lays it out) and its greedy continuation, from a single-sequence engine."""
    out = []
    for ids in PROMPTS:
        eng = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
        n = len(ids)
        last_logits = eng.forward(torch.tensor(ids), 0)[-1]
        first = int(last_logits.argmax())
        a = eng.model.args
        state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :n], "float32", a.kv_lora_rank, True)}
        alone, token = [], first
        for pos in range(n, MAX_SEQ):  # until the cache is full
            token = int(eng.forward(torch.tensor([token]), pos)[-1].argmax())
            alone.append(token)
        out.append(Prompt(state, n, first, alone, ids, last_logits))
    return out


def _job(
    engine: TileRTEngine,
    p: Prompt,
    sink: Sink,
    max_tokens: int | None,
    cancel: threading.Event | None = None,
    tid: str = "t",
) -> Job:
    params = DecodeParams(tid, p.first, p.num_tokens, max_tokens, temperature=0.0)
    return Job(
        p.state, engine.expected_layouts(), p.num_tokens, params, sink.emit, sink.done, cancel or threading.Event()
    )


def test_concurrent_sequences_decode_what_they_decode_alone(model: Path, prompts: list[Prompt]) -> None:
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=3)
    batch = DecodeBatch(engine, frozenset())
    try:
        sinks = [Sink() for _ in prompts]
        lengths = [20, 6, 30, 12]  # the 2nd leaves early; the 4th waits for a free sequence, then joins
        for p, sink, n in zip(prompts, sinks, lengths, strict=True):
            batch.submit(_job(engine, p, sink, n))
        for sink in sinks:
            assert sink.ended.wait(120)
        for p, sink, n in zip(prompts, sinks, lengths, strict=True):
            assert sink.result == Finish("length") and sink.finish[-1] == Finish("length")
            assert sink.ids == p.alone[:n]  # bit-identical greedy tokens, as alone
    finally:
        batch.close()


def test_a_cancelled_sequence_frees_its_place_at_once(model: Path, prompts: list[Prompt]) -> None:
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=2)
    batch = DecodeBatch(engine, frozenset())
    try:
        long_a, long_b, late = Sink(), Sink(), Sink()
        cancel = threading.Event()
        batch.submit(_job(engine, prompts[0], long_a, None, cancel))
        batch.submit(_job(engine, prompts[1], long_b, None))
        batch.submit(_job(engine, prompts[2], late, 5))
        wait_until(lambda: len(long_a.ids) >= 3, 30, "the first sequence's third token")
        assert batch.waiting == 1 and not late.ids  # both sequences taken: the third waits
        cancel.set()
        assert long_a.ended.wait(30) and long_a.result == Finish("cancelled")
        assert late.ended.wait(60) and late.ids == prompts[2].alone[:5]  # it got the freed sequence
        assert long_b.ended.wait(120) and long_b.ids == prompts[1].alone  # to the end of its context
        assert long_b.result == Finish("length")  # ran to the end of its context
    finally:
        batch.close()


def test_engine_thread_pinned_to_its_cpus(model: Path, prompts: list[Prompt]) -> None:
    """``--engine-cpus``: the worker thread (and so the engine's compute) runs on those CPUs only; the rest of
    the process (the node's event loop) keeps every CPU."""
    cpu = min(os.sched_getaffinity(0))
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    batch = DecodeBatch(engine, frozenset(), cpus=frozenset({cpu}))
    try:
        sink = Sink()
        batch.submit(_job(engine, prompts[0], sink, 4))
        assert sink.ended.wait(60) and sink.ids == prompts[0].alone[:4]
        assert batch._thread.native_id is not None
        assert os.sched_getaffinity(batch._thread.native_id) == {cpu}
        assert os.sched_getaffinity(0) == before  # this thread is not pinned
    finally:
        batch.close()
        torch.set_num_threads(threads)


def _choices_job(
    engine: TileRTEngine,
    p: Prompt,
    sink: Sink,
    max_tokens: int | None,
    n: int,
    cancel: threading.Event | None = None,
    **sampling: float | int | None,
) -> Job:
    """A job of ``n`` choices of ``p``, with the prompt's last token as the prefill side sends it."""
    params = DecodeParams("t", p.first, p.num_tokens, max_tokens, n=n, **sampling)  # type: ignore[arg-type]
    layouts = engine.expected_layouts()
    return Job(p.state, layouts, p.num_tokens, params, sink.emit, sink.done, cancel or threading.Event(), p.ids[-1])


def test_a_job_of_n_choices_waits_for_n_sequences_in_arrival_order(model: Path, prompts: list[Prompt]) -> None:
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=3)
    batch = DecodeBatch(engine, frozenset())
    try:
        running, choices, behind = Sink(), Sink(), Sink()
        stop_running = threading.Event()
        batch.submit(_job(engine, prompts[0], running, None, stop_running))
        wait_until(lambda: len(running.ids) >= 2, 30, "the first request decoding")
        batch.submit(_choices_job(engine, prompts[1], choices, 6, 3, temperature=0.0))
        batch.submit(_job(engine, prompts[2], behind, 5))
        wait_until(lambda: len(running.ids) >= 8, 30, "the first request decoding on")
        # Two sequences are free, but the job of 3 needs three: it waits, and the one behind it waits behind it.
        assert batch.waiting == 2 and not choices.choices and not behind.ids
        stop_running.set()
        assert running.ended.wait(30) and running.result == Finish("cancelled")
        assert choices.ended.wait(60) and behind.ended.wait(60)
        p = prompts[1]
        assert choices.result == Finish("length") and behind.result == Finish("length")
        # Greedy: every choice is prefill's token (the router has choice 0's) and the greedy tokens after it.
        assert choices.choices == {0: p.alone[:6], 1: [p.first, *p.alone[:6]], 2: [p.first, *p.alone[:6]]}
        assert choices.finishes == {i: Finish("length") for i in range(3)}
        assert behind.ids == prompts[2].alone[:5]
        assert sorted(batch._free) == [0, 1, 2] and not batch._active  # every sequence back
    finally:
        batch.close()


def test_sampled_choices_draw_their_own_first_token_reproducibly(model: Path, prompts: list[Prompt]) -> None:
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=3)
    batch = DecodeBatch(engine, frozenset())
    p, seed, sampling = prompts[2], 1234, {"temperature": 1.0, "top_k": 8}
    try:
        runs = []
        for _ in range(2):
            sink = Sink()
            batch.submit(_choices_job(engine, p, sink, 20, 3, seed=seed, **sampling))
            assert sink.ended.wait(60) and sink.result == Finish("length"), sink.result
            runs.append(sink.choices)
        one = Sink()  # choice 0 is the request's own stream: what a request of one choice decodes
        batch.submit(_choices_job(engine, p, one, 20, 1, seed=seed, **sampling))
        assert one.ended.wait(60)
    finally:
        batch.close()
    assert runs[0] == runs[1], "the same seed, the same choices"
    assert runs[0][0] == one.ids and len(runs[0][0]) == 20
    params = DecodeParams("t", p.first, p.num_tokens, 20, n=3, seed=seed, **sampling)  # type: ignore[arg-type]
    for i in (1, 2):  # its first token from the last prompt position, with vLLM's child seed (seed + index)
        want = Sampler(params, frozenset(), None, seeded_generator(seed + i), completion=[])(p.last_logits)
        assert runs[0][i][0] == want and len(runs[0][i]) == 21
    assert len({tuple(ids) for ids in runs[0].values()}) == 3, "three choices sampled apart"


def test_every_sequence_comes_back_when_a_job_of_choices_fails_or_is_cancelled(
    model: Path, prompts: list[Prompt]
) -> None:
    engine = TileRTEngine.load(model, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=2)
    batch = DecodeBatch(engine, frozenset())
    try:
        too_many, cancelled, after = Sink(), Sink(), Sink()
        batch.submit(_choices_job(engine, prompts[0], too_many, 4, 3, temperature=1.0))
        assert too_many.ended.wait(30) and isinstance(too_many.result, ValueError)
        assert "2 sequences at once" in str(too_many.result)
        unsent = Sink()
        no_last = _choices_job(engine, prompts[0], unsent, 4, 2, temperature=1.0)
        no_last.last_token_id = None  # a sampled choice needs the prompt's last token for its first
        batch.submit(no_last)
        assert unsent.ended.wait(30) and isinstance(unsent.result, ValueError) and not unsent.ids
        stop = threading.Event()
        batch.submit(_choices_job(engine, prompts[0], cancelled, None, 2, stop, temperature=1.0, seed=5))
        wait_until(lambda: all(len(cancelled.choices.get(i, [])) >= 3 for i in (0, 1)), 30, "both choices decoding")
        stop.set()
        assert cancelled.ended.wait(30) and cancelled.result == Finish("cancelled") and not cancelled.finishes
        batch.submit(_choices_job(engine, prompts[1], after, 3, 2, temperature=0.0))
        assert after.ended.wait(30) and after.choices[0] == prompts[1].alone[:3]
        assert sorted(batch._free) == [0, 1] and not batch._active
    finally:
        batch.close()
