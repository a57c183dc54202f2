"""The engine contract's optional fast paths, and ``run_decode`` as the one owner of token-level stopping.

A real tiny engine (one-layer seeded ``deepseek_v3`` checkpoint, CPU float32, an 8-token prompt in a
24-position cache): ``run_decode`` finishes with "length" at ``max_tokens`` or at the end of the cache
(``max_tokens=None``), with "stop" on EOS (``stop_token_id`` None) or on a stop id (the id), EOS winning
when a token is both, and "cancelled"; on the pipelined greedy path, the plain per-step path and the
sampled path alike. The loop calls an optional method only when ``capabilities()`` declares it.

The ``tilert.engines`` group's plugin contract: each plugin is loaded by the kind it declares, and one of the
other kind, of no kind or of an unknown kind is refused with the reason; the router reaches the native pool
through that contract, its modules importing one another in no cycle.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tilert.plugins
from tilert.decode.generate import Finish, run_decode
from tilert.engines.base import Capabilities, DecodeEngine, KVLayout
from tilert.engines.plugin import KINDS, NATIVE_POOL, NODE_ENGINE, NativePool, load_engine, load_native_pool
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine, greedy_generate
from tilert.engines.vllm import VllmNativePool
from tilert.plugins import ENGINES_GROUP, PluginError, names_of_kind

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
    min_p: float = 0.0
    grammar: None = None
    logprobs: None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        return False

    @property
    def needs_logits(self) -> bool:
        return False


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


# ---------------------------------------------------------------------------------------------- plugin kinds


def test_each_plugin_loads_by_its_declared_kind() -> None:
    assert TileRTEngine.kind == NODE_ENGINE and VllmNativePool.kind == NATIVE_POOL
    assert load_engine("tilert") is TileRTEngine
    assert load_native_pool("vllm") is VllmNativePool
    assert names_of_kind(ENGINES_GROUP, NODE_ENGINE, KINDS) == ["tilert"]
    assert names_of_kind(ENGINES_GROUP, NATIVE_POOL, KINDS) == ["vllm"]


def test_a_plugin_of_the_other_kind_is_refused_with_what_it_is() -> None:
    with pytest.raises(PluginError) as exc:
        load_engine("vllm")
    msg = str(exc.value)
    assert "'vllm'" in msg and "'native-pool' plugin" in msg and "native decode pool" in msg
    assert msg.endswith("'node-engine' plugins: tilert")
    with pytest.raises(PluginError) as exc:
        load_native_pool("tilert")
    msg = str(exc.value)
    assert "'node-engine' plugin" in msg and "decode node runs" in msg and msg.endswith("'native-pool' plugins: vllm")
    with pytest.raises(PluginError, match="no plugin 'nope' in tilert.engines; installed: tilert, vllm"):
        load_engine("nope")


class _NoKind:
    name = "nokind"


class _OddKind:
    name = "odd"
    kind = "gpu-engine"


class _PoolNotNativePool:  # declares the kind but does not implement the contract
    name = "fake"
    kind = "native-pool"


@dataclass(frozen=True)
class _EntryPoint:
    """Stands in for ``importlib.metadata.EntryPoint``: what ``tilert.plugins`` reads of one."""

    name: str
    value: str
    target: Callable[[], Any]

    def load(self) -> Any:
        return self.target()


def _broken() -> Any:
    raise ImportError("No module named 'missing_dependency'")


@pytest.fixture
def extra_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed engine plugins plus five faulty ones."""
    real = tilert.plugins.entry_points
    fakes = [
        _EntryPoint("nokind", "x:_NoKind", lambda: _NoKind),
        _EntryPoint("odd", "x:_OddKind", lambda: _OddKind),
        _EntryPoint("fake", "x:_PoolNotNativePool", lambda: _PoolNotNativePool),
        _EntryPoint("broken", "x:Broken", _broken),
        _EntryPoint("func", "x:func", lambda: _broken),
    ]

    def entry_points(*, group: str) -> list[Any]:
        return [*real(group=group), *(fakes if group == ENGINES_GROUP else [])]

    monkeypatch.setattr(tilert.plugins, "entry_points", entry_points)


@pytest.mark.usefixtures("extra_plugins")
def test_a_plugin_of_no_known_kind_is_refused_and_listing_skips_it() -> None:
    with pytest.raises(PluginError, match=r"'nokind' of tilert.engines declares no kind \(class attribute 'kind'"):
        load_engine("nokind")
    with pytest.raises(
        PluginError,
        match="'odd' of tilert.engines declares the unknown kind 'gpu-engine' "
        r"\(known: node-engine, native-pool\)",
    ):
        load_native_pool("odd")
    with pytest.raises(PluginError, match="'fake' of tilert.engines declares kind 'native-pool' but is no NativePool"):
        load_native_pool("fake")
    with pytest.raises(PluginError, match="'broken' of tilert.engines cannot be loaded: ImportError: No module"):
        load_engine("broken")
    with pytest.raises(PluginError, match=r"'func' of tilert.engines is not a class \(x:func\)"):
        load_engine("func")
    # Listing one kind loads each plugin's class; a faulty one is left out and the others are still listed.
    assert names_of_kind(ENGINES_GROUP, NODE_ENGINE, KINDS) == ["tilert"]
    assert names_of_kind(ENGINES_GROUP, NATIVE_POOL, KINDS) == ["fake", "vllm"]
    with pytest.raises(PluginError) as exc:
        load_engine("vllm")
    assert str(exc.value).endswith("'node-engine' plugins: tilert")


def test_native_pool_contract_is_abstract() -> None:
    """A native pool implements every step the router and ``tilert up`` take (a missing one fails at once)."""
    assert issubclass(VllmNativePool, NativePool)
    assert {name for name in dir(NativePool) if getattr(getattr(NativePool, name), "__isabstractmethod__", False)} == {
        "prefill_connector",
        "decode_connector",
        "prefill_params",
        "handoff",
        "decode_params",
        "env",
        "decode_command",
    }
    assert not getattr(VllmNativePool, "__abstractmethods__", None)


def test_decode_node_refuses_a_native_pool_engine(tmp_path: Path) -> None:
    """``tilert decode --engine vllm``: exit 2 with the reason, before the node starts anything."""
    (tmp_path / "config.json").write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    env["TILERT_SECRET"] = "0123456789abcdef0123456789abcdef"
    proc = subprocess.run(
        [sys.executable, "-m", "tilert.cli", "decode", "--model", str(tmp_path), "--engine", "vllm"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "tilert decode: plugin 'vllm' of tilert.engines is a 'native-pool' plugin" in proc.stderr
    assert "'node-engine' plugins: tilert" in proc.stderr


def _router_imports() -> dict[str, set[str]]:
    """Each ``tilert.router`` module and the ``tilert.router`` modules it imports, at any depth of its code
    (inside functions and ``TYPE_CHECKING`` blocks too)."""
    root = Path(tilert.plugins.__file__).parent / "router"
    modules = {f"tilert.router.{p.stem}": p for p in root.glob("*.py") if p.stem != "__init__"}
    modules["tilert.router"] = root / "__init__.py"
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.stem == "__init__" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
                for a in node.names:  # ``from pkg import submodule`` imports the submodule
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[mod] = {d for d in deps if d in modules and d != mod}
    return graph


def test_router_modules_import_in_no_cycle() -> None:
    graph = _router_imports()
    assert "tilert.router.native" in graph["tilert.router.flow"]  # the flow calls the native leg ...
    assert "tilert.router.flow" not in graph["tilert.router.native"]  # ... which knows nothing of the flow
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(mod) :] + [mod])}")
        if mod not in done:
            for dep in sorted(graph[mod]):
                visit(dep, [*path, mod])
            done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])


def test_shaped_stream_gives_the_per_step_samplers_tokens(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy with logits rules runs on the engine's shaped stream (the rules applied to the engine's own copy,
    advanced token by token) and gives exactly the tokens of one ``forward`` a step and the host's sampler."""
    from tilert.contracts import Sampling
    from tilert.decode.generate import SequenceRun
    from tilert.decode.sampling import DecodeParams

    eng = tiny.engine
    prompt = torch.randint(8, eng.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    rules = Sampling(
        max_tokens=ROOM,
        temperature=0.0,
        repetition_penalty=1.5,
        frequency_penalty=0.8,
        presence_penalty=0.4,
        min_tokens=4,
        logit_bias={tiny.greedy[1]: -5.0, 9: 2.0},
        bad_words_token_ids=[[tiny.greedy[2]]],
    )
    params = DecodeParams.of("t", rules, eng.vocab_size, None, tiny.first, PROMPT, prompt)
    eos = frozenset({tiny.greedy[0]})  # masked while the completion is shorter than min_tokens
    streams: list[int] = []
    shaped = eng.shaped_greedy_stream
    monkeypatch.setattr(eng, "shaped_greedy_stream", lambda *a, **k: (streams.append(1), shaped(*a, **k))[1])
    fast: list[int] = []
    finish = run_decode(
        eng, tiny.state, tiny.layouts, PROMPT, params, eos, lambda ids, _f: fast.extend(ids), threading.Event()
    )
    assert streams, "greedy with rules did not take the engine's shaped stream"

    ref: list[int] = []
    run = SequenceRun(eng, params, eos, PROMPT, lambda ids, _f: ref.extend(ids), threading.Event())
    eng.inject(tiny.state, tiny.layouts, PROMPT)
    while run.accept([run.sample(eng.forward(torch.tensor([run.token]), run.pos)[-1])]) is None:
        pass
    assert fast == ref and run.finish == finish
    assert fast[:3] != tiny.greedy[:3], "the rules changed nothing: the test shows nothing"
