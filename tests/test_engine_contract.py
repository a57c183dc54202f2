"""The engine contract's optional fast paths, and ``run_decode`` as the one owner of token-level stopping.

A real tiny engine (one-layer seeded ``deepseek_v3`` checkpoint, CPU float32, an 8-token prompt in a
24-position cache): ``run_decode`` finishes with "length" at ``max_tokens`` or at the end of the cache
(``max_tokens=None``), with "stop" on EOS (``stop_token_id`` None) or on a stop id (the id), EOS winning
when a token is both, and "cancelled"; on the pipelined greedy path, the plain per-step path and the
sampled path alike. The loop calls an optional method only when ``capabilities()`` declares it.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tilert.decode.generate import Finish, run_decode
from tilert.engines.base import Capabilities, DecodeEngine, KVLayout
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine, greedy_generate

PROMPT = 8
MAX_SEQ = 24
ROOM = MAX_SEQ - PROMPT  # new tokens the cache has room for


@dataclass(frozen=True)
class Params:
    """Duck-typed decode parameters: the attributes ``run_decode`` and ``Sampler`` read."""

    first_token_id: int
    max_tokens: int | None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Tiny:
    engine: TileRTEngine
    state: dict[str, torch.Tensor]
    layouts: dict[str, KVLayout]
    first: int
    greedy: list[int]  # every greedy token after ``first`` until the cache is full


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    from tilert.models.tiny import build_tiny_model

    path = build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("contract") / "m", seed=0, num_hidden_layers=1)
    eng = TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)
    prompt = torch.randint(8, eng.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1))
    first = int(eng.forward(prompt, 0)[-1].argmax())
    a = eng.model.args
    state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :PROMPT], "float32", a.kv_lora_rank, True)}
    greedy = greedy_generate(eng, first, PROMPT, ROOM)
    return Tiny(eng, state, eng.expected_layouts(), first, greedy)


def _run(
    t: Tiny, engine: DecodeEngine | None = None, eos: frozenset[int] = frozenset(), cancel: bool = False, **kw: Any
) -> tuple[list[int], Finish]:
    out: list[int] = []
    params = Params(t.first, **{"max_tokens": 6, **kw})
    ev = threading.Event()
    if cancel:
        ev.set()
    emitted: list[Finish | None] = []

    def emit(ids: list[int], fin: Finish | None) -> None:
        assert not emitted or emitted[-1] is None, "nothing is emitted after the finishing batch"
        out.extend(ids)
        emitted.append(fin)

    finish = run_decode(engine or t.engine, t.state, t.layouts, PROMPT, params, eos, emit, ev)
    if out:  # the last batch carries the finish (with nothing left to emit it is only returned)
        assert emitted[-1] == finish or (finish.reason != "stop" and emitted[-1] is None)
    return out, finish


def _not_pipelined(t: Tiny, monkeypatch: pytest.MonkeyPatch) -> DecodeEngine:
    """The same engine declaring no pipelined greedy: its greedy_stream must then never be called."""
    eng = t.engine
    caps = dataclasses.replace(eng.capabilities(), pipelined_greedy=False)
    monkeypatch.setattr(eng, "capabilities", lambda: caps)

    def undeclared(*a: Any) -> Any:
        raise AssertionError("greedy_stream called without Capabilities.pipelined_greedy")

    monkeypatch.setattr(eng, "greedy_stream", undeclared)
    return eng


@pytest.fixture(params=["pipelined", "per_step", "sampled_top1"])
def path_kw(request: pytest.FixtureRequest, tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The three ways the loop produces tokens, all greedy-equivalent (top-k 1 sampling is the argmax)."""
    if request.param == "pipelined":
        assert tiny.engine.capabilities().pipelined_greedy
        return {}
    if request.param == "per_step":
        return {"engine": _not_pipelined(tiny, monkeypatch)}
    return {"temperature": 1.0, "top_k": 1}


def test_length_at_max_tokens(tiny: Tiny, path_kw: dict[str, Any]) -> None:
    out, finish = _run(tiny, max_tokens=6, **path_kw)
    assert finish == Finish("length", None) and out == tiny.greedy[:6]


def test_max_tokens_none_runs_to_the_end_of_the_cache(tiny: Tiny, path_kw: dict[str, Any]) -> None:
    out, finish = _run(tiny, max_tokens=None, **path_kw)
    assert finish == Finish("length") and out == tiny.greedy and len(out) == ROOM
    out, finish = _run(tiny, max_tokens=ROOM + 5, **path_kw)  # more than the cache holds: the cache ends it
    assert finish == Finish("length") and out == tiny.greedy


def test_eos_and_stop_ids(tiny: Tiny, path_kw: dict[str, Any]) -> None:
    g = tiny.greedy
    tok = g[3]
    upto = g[: g.index(tok) + 1]  # the stop token is emitted, as the last one
    out, finish = _run(tiny, eos=frozenset({tok}), **path_kw)
    assert finish == Finish("stop", None) and out == upto
    out, finish = _run(tiny, stop_token_ids=(tok,), **path_kw)
    assert finish == Finish("stop", tok) and out == upto
    out, finish = _run(tiny, eos=frozenset({tok}), stop_token_ids=(tok,), **path_kw)
    assert finish == Finish("stop", None) and out == upto  # both EOS and a stop id: EOS, as vLLM reports it
    out, finish = _run(tiny, eos=frozenset({tok}), ignore_eos=True, **path_kw)
    assert finish == Finish("length") and out == g[:6]
    out, finish = _run(tiny, eos=frozenset({tok}), stop_token_ids=(tok,), ignore_eos=True, **path_kw)
    assert finish == Finish("stop", tok) and out == upto


def test_cancelled_before_a_step(tiny: Tiny) -> None:
    out, finish = _run(tiny, cancel=True)
    assert finish == Finish("cancelled", None) and out == []


def test_optional_paths_follow_the_declared_capabilities(tiny: Tiny) -> None:
    caps = tiny.engine.capabilities()
    assert caps.pipelined_greedy and not caps.mtp and caps.max_seq_len == MAX_SEQ  # no MTP layer here

    class Bare(DecodeEngine):
        name = "bare"

        @classmethod
        def load(
            cls, model_dir: Path, *, device: str, dtype: torch.dtype, max_seq_len: int, max_sequences: int = 1
        ) -> Bare:
            return cls()

        @property
        def vocab_size(self) -> int:
            return 4

        def capabilities(self) -> Capabilities:
            return Capabilities()

        def expected_layouts(self) -> dict[str, KVLayout]:
            return {}

        def inject(
            self,
            state: dict[str, torch.Tensor],
            layouts: dict[str, KVLayout],
            num_tokens: int,
            seq: int = 0,
            last_token_id: int | None = None,
        ) -> None:
            pass

        def forward(self, token_ids: torch.Tensor, start_pos: int, seq: int = 0) -> torch.Tensor:
            return torch.nn.functional.one_hot(token_ids + 1, 4).float()  # counts up: 1, 2, 3

    bare = Bare()
    caps = bare.capabilities()
    assert not caps.pipelined_greedy and not caps.mtp and caps.max_sequences == 1
    # The contract's default decode_step: forward() once per sequence.
    assert torch.equal(bare.decode_step([0, 2], [5, 1], [0, 1]), torch.eye(4)[[1, 3]])
    assert bare.decode_step_greedy([2, 0, 1], [0, 0, 0], [2, 0, 1]) == [3, 1, 2]
    with pytest.raises(ValueError, match="at most once"):
        bare.decode_step([0, 0], [1, 2], [1, 1])
    with pytest.raises(NotImplementedError, match="pipelined_greedy"):
        bare.greedy_stream(0, 0, 1)
    with pytest.raises(NotImplementedError, match="mtp"):
        bare.speculative_greedy_step(0, 0, 1)
    # run_decode takes the per-step path (num_draft > 0 asks for MTP, which Bare does not declare) ...
    out: list[int] = []
    finish = run_decode(
        bare, {}, {}, 1, Params(0, 3), frozenset(), lambda ids, fin: out.extend(ids), threading.Event(), 2
    )
    assert finish == Finish("length") and out == [1, 2, 3]
    # ... and needs max_tokens when the engine declares no cache size.
    with pytest.raises(ValueError, match="max_tokens"):
        run_decode(bare, {}, {}, 1, Params(0, None), frozenset(), lambda ids, fin: out.extend(ids), threading.Event())
