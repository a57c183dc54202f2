"""The decode node's scheduler (:mod:`tilert.decode.batch`) with a real tiny engine holding 3 sequences:
each of several concurrent sequences decodes exactly what it decodes alone, sequences join and leave
mid-stream, and a cancelled sequence frees its engine sequence at once for the next request."""

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
from tilert.decode.sampling import DecodeParams
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
        first = int(eng.forward(torch.tensor(ids), 0)[-1].argmax())
        a = eng.model.args
        state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :n], "float32", a.kv_lora_rank, True)}
        alone, token = [], first
        for pos in range(n, MAX_SEQ):  # until the cache is full
            token = int(eng.forward(torch.tensor([token]), pos)[-1].argmax())
            alone.append(token)
        out.append(Prompt(state, n, first, alone))
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
