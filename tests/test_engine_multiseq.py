"""Several sequences in one engine (CPU, float32): ``decode_step`` over independent sequences that join and
leave between steps, each row bit for bit what decoding that sequence alone in a fresh single-sequence engine
gives; ``inject`` into a slot in use replaces that sequence only; ``greedy_stream`` / ``speculative_greedy_step``
on any slot; the per-sequence methods' argument checks.

Checkpoints: ``tilert tiny-model`` families with 2 layers (one dense, one MoE), ``deepseek_v32`` with a DSA
top-k of 16 so that the decoded positions cross from dense to sparse attention, and a ``deepseek_v3`` copy with
an MTP module (the last layer copied as the MTP block, random MTP-only weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tilert.engines.base import KVLayout
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine, greedy_generate
from tilert.models.tiny import add_mtp_layer

MAX_SEQ = 64
PROMPTS = (9, 23, 14)  # prompt lengths of sequences 0, 1, 2 (DSA top-k 16: some decode dense, some sparse)
STEPS = 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tilert.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("multiseq")
    out = {
        "deepseek_v3": build_tiny_model("deepseek_v3", root / "v3", seed=0, num_hidden_layers=2),
        "deepseek_v32": build_tiny_model(
            "deepseek_v32", root / "v32", seed=1, num_hidden_layers=2, index_topk=16, index_n_heads=8
        ),
    }
    out["deepseek_v3_mtp"] = add_mtp_layer(out["deepseek_v3"], root / "v3_mtp")
    return out


def _load(path: Path, max_sequences: int = 1) -> TileRTEngine:
    return TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=max_sequences)


Prompt = tuple[dict[str, torch.Tensor], dict[str, KVLayout], int, int]  # state, layouts, length, first token


def _prompt(path: Path, length: int, seed: int) -> Prompt:
    """A prompt's KV as vLLM hands it over (from a single-sequence engine's own prefill) and its greedy token."""
    eng = _load(path)
    a = eng.model.args
    ids = torch.randint(8, a.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    first = int(eng.forward(ids, 0)[-1].argmax())
    state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :length], "float32", a.kv_lora_rank, True)}
    if a.dsa:
        state["indexer"] = layouts.encode_dsa_indexer(
            eng.model.index_cache[:, :length], a.qk_rope_head_dim, a.indexer_rope_interleave
        )
    return state, eng.expected_layouts(), length, first


def _alone(path: Path, prompt: Prompt, tokens: list[int]) -> torch.Tensor:
    """Logits of feeding ``tokens`` one by one after ``prompt`` in a fresh single-sequence engine."""
    state, lay, length, _ = prompt
    eng = _load(path)
    eng.inject(state, lay, length)
    return torch.cat([eng.forward(torch.tensor([t]), length + i) for i, t in enumerate(tokens)])


def _schedule(step: int) -> list[int]:
    """Active sequences at each step: 0 throughout, 1 leaves after step 5, 2 joins at step 3."""
    return [s for s, on in ((0, True), (1, step < 6), (2, step >= 3)) if on]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
@pytest.mark.parametrize("greedy_api", [False, True], ids=["decode_step", "decode_step_greedy"])
def test_decode_step_equals_each_sequence_alone(ckpts: dict[str, Path], arch: str, greedy_api: bool) -> None:
    path = ckpts[arch]
    prompts = [_prompt(path, n, seed=10 + i) for i, n in enumerate(PROMPTS)]
    eng = _load(path, max_sequences=3)
    caps = eng.capabilities()
    assert caps.max_sequences == 3 and eng.cpu_kernels  # the CPU fast path, as the decode node runs it
    fed: dict[int, list[int]] = {s: [] for s in range(3)}  # tokens fed to each sequence, in order
    rows: dict[int, list[torch.Tensor]] = {s: [] for s in range(3)}
    nxt = {s: p[3] for s, p in enumerate(prompts)}
    for step in range(STEPS):
        active = _schedule(step)
        for s in active:
            if not fed[s]:  # joins: its prompt arrives now
                state, lay, length, _ = prompts[s]
                eng.inject(state, lay, length, seq=s)
        if step % 2:
            active = active[::-1]  # the order of the rows does not matter
        toks = [nxt[s] for s in active]
        pos = [prompts[s][2] + len(fed[s]) for s in active]
        if greedy_api:
            got = eng.decode_step_greedy(toks, pos, active)
        else:
            logits = eng.decode_step(toks, pos, active)
            assert logits.dtype == torch.float32 and logits.shape == (len(active), eng.vocab_size)
            got = logits.argmax(-1).tolist()
            for i, s in enumerate(active):
                rows[s].append(logits[i])
        for i, s in enumerate(active):
            fed[s].append(toks[i])
            nxt[s] = got[i]
    for s in range(3):
        want = _alone(path, prompts[s], fed[s])
        assert fed[s][1:] == want.argmax(-1).tolist()[:-1], s  # the same greedy tokens
        assert nxt[s] == int(want[-1].argmax())
        if not greedy_api:
            assert torch.equal(torch.stack(rows[s]), want), s  # and the same logits, bit for bit
    assert [len(fed[s]) for s in range(3)] == [STEPS, 6, STEPS - 3]
    if arch == "deepseek_v32":  # both attention regimes were decoded
        a = eng.model.args
        assert any(p + len(fed[s]) > a.index_topk for s, (_, _, p, _) in enumerate(prompts))
        assert any(p < a.index_topk for _, _, p, _ in prompts)


def test_inject_into_a_slot_in_use_replaces_that_sequence_only(ckpts: dict[str, Path]) -> None:
    path = ckpts["deepseek_v32"]
    p = [_prompt(path, n, seed=20 + i) for i, n in enumerate((12, 30, 7))]
    new = _prompt(path, 19, seed=99)
    eng = _load(path, max_sequences=3)
    for s in range(3):
        eng.inject(p[s][0], p[s][1], p[s][2], seq=s)
    toks = {s: [p[s][3]] for s in range(3)}

    def step(seqs: list[int], start: dict[int, int]) -> None:
        got = eng.decode_step_greedy([toks[s][-1] for s in seqs], [start[s] + len(toks[s]) - 1 for s in seqs], seqs)
        for s, t in zip(seqs, got, strict=True):
            toks[s].append(t)

    start = {s: p[s][2] for s in range(3)}
    for _ in range(4):
        step([0, 1, 2], start)
    eng.inject(new[0], new[1], new[2], seq=1)  # slot 1 now holds another sequence
    toks[1], start[1] = [new[3]], new[2]
    for _ in range(5):
        step([2, 1, 0], start)
    for s, prompt in ((0, p[0]), (1, new), (2, p[2])):
        want = _alone(path, prompt, toks[s][:-1]).argmax(-1).tolist()
        assert toks[s][1:] == want, s


def test_greedy_stream_and_forward_on_any_slot(ckpts: dict[str, Path]) -> None:
    path = ckpts["deepseek_v3"]
    p = [_prompt(path, n, seed=30 + i) for i, n in enumerate((5, 17))]
    eng = _load(path, max_sequences=2)
    for s in (1, 0):
        eng.inject(p[s][0], p[s][1], p[s][2], seq=s)
    streams = [eng.greedy_stream(p[s][3], p[s][2], 10, seq=s) for s in range(2)]
    got: list[list[int]] = [[], []]
    for _ in range(10):  # interleaved: the two sequences' streams do not disturb each other
        for s in range(2):
            got[s].append(next(streams[s]))
    for s in range(2):
        alone = _load(path)
        alone.inject(p[s][0], p[s][1], p[s][2])
        assert got[s] == greedy_generate(alone, p[s][3], p[s][2], 10), s
    logits = eng.forward(torch.tensor([got[1][-1]]), p[1][2] + 10, seq=1)
    assert torch.equal(logits[0], eng.decode_step([got[1][-1]], [p[1][2] + 10], [1])[0])  # rewrite, same row


def test_speculative_step_on_any_slot(ckpts: dict[str, Path]) -> None:
    path = ckpts["deepseek_v3_mtp"]
    p = [_prompt(path, n, seed=40 + i) for i, n in enumerate((11, 6, 20))]
    eng = _load(path, max_sequences=3)
    assert eng.supports_mtp
    for s in range(3):
        eng.inject(p[s][0], p[s][1], p[s][2], seq=s)
    out: dict[int, list[int]] = {s: [] for s in range(3)}
    state = {s: (p[s][3], p[s][2]) for s in range(3)}
    drafted = 0
    for _ in range(8):  # speculative on slots 0 and 2, plain decode_step on slot 1, interleaved
        for s in (0, 2):
            tok, pos = state[s]
            res = eng.speculative_greedy_step(tok, pos, 2, seq=s)
            drafted += res.num_drafted
            out[s].extend(res.tokens)
            state[s] = res.tokens[-1], pos + len(res.tokens)
        tok, pos = state[1]
        [nxt] = eng.decode_step_greedy([tok], [pos], [1])
        out[1].append(nxt)
        state[1] = nxt, pos + 1
    assert drafted > 0
    for s in range(3):
        alone = _load(path)
        alone.inject(p[s][0], p[s][1], p[s][2])
        assert out[s] == greedy_generate(alone, p[s][3], p[s][2], len(out[s])), s


def test_argument_checks(ckpts: dict[str, Path]) -> None:
    eng = _load(ckpts["deepseek_v3"], max_sequences=2)
    state, lay, length, first = _prompt(ckpts["deepseek_v3"], 4, seed=1)
    with pytest.raises(ValueError, match="seq"):
        eng.inject(state, lay, length, seq=2)
    with pytest.raises(ValueError, match="seq"):
        eng.forward(torch.tensor([first]), length, seq=-1)
    with pytest.raises(ValueError, match="at most once"):
        eng.decode_step([1, 2], [4, 4], [0, 0])
    with pytest.raises(ValueError, match="seq"):
        eng.decode_step([1], [4], [5])
    with pytest.raises(ValueError, match="outside the cache"):
        eng.decode_step([1], [MAX_SEQ], [0])
    with pytest.raises(ValueError, match="one token, position and sequence"):
        eng.decode_step([1, 2], [4], [0, 1])
    with pytest.raises(ValueError, match="one token, position and sequence"):
        eng.decode_step_greedy([], [], [])
    with pytest.raises(ValueError, match="max_sequences"):
        _load(ckpts["deepseek_v3"], max_sequences=0)
    assert _load(ckpts["deepseek_v3"]).capabilities().max_sequences == 1


def _flat(eng: TileRTEngine) -> TileRTEngine:
    """The engine addressing its caches as on CUDA (flat rows + each token's first row, ``decode_step`` rows in one
    model call per attention regime), computing with the reference ops: the CUDA path's bookkeeping, on the CPU."""
    from tilert.engines.tilert import ops

    eng.flat = True
    eng.model.use_kernels(ops)
    return eng


@pytest.mark.parametrize("arch", ["deepseek_v32", "deepseek_v3_mtp"])
def test_flat_addressing_on_cpu(ckpts: dict[str, Path], arch: str) -> None:
    """CUDA's flat addressing (run on the CPU, not bit for bit there: CPU BLAS rounds batches differently) gives
    every sequence the tokens it gets alone: decode_step with dense and DSA rows in one call, forward, and the MTP
    speculative step on a slot > 0."""
    path = ckpts[arch]
    prompts = [_prompt(path, n, seed=50 + i) for i, n in enumerate(PROMPTS)]
    eng = _flat(_load(path, max_sequences=3))
    for s, (state, lay, length, _) in enumerate(prompts):
        eng.inject(state, lay, length, seq=s)
    fed: dict[int, list[int]] = {s: [] for s in range(3)}
    nxt = {s: p[3] for s, p in enumerate(prompts)}
    for step in range(8):
        active = [2, 0, 1] if step % 2 else [0, 1, 2]
        got = eng.decode_step_greedy([nxt[s] for s in active], [prompts[s][2] + len(fed[s]) for s in active], active)
        for s, t in zip(active, got, strict=True):
            fed[s].append(nxt[s])
            nxt[s] = t
    for s in range(3):
        want = _alone(path, prompts[s], fed[s])
        assert fed[s][1:] + [nxt[s]] == want.argmax(-1).tolist(), s
    if eng.supports_mtp:  # slot 1 continues speculatively, from its own hidden states
        tok, pos = nxt[1], prompts[1][2] + len(fed[1])
        out: list[int] = []
        drafted = 0
        while len(out) < 10:
            res = eng.speculative_greedy_step(tok, pos, 2, seq=1)
            drafted += res.num_drafted
            out += res.tokens
            tok, pos = res.tokens[-1], pos + len(res.tokens)
        alone = _load(path)
        alone.inject(*prompts[1][:3])
        plain = greedy_generate(alone, prompts[1][3], prompts[1][2], len(fed[1]) + 10)
        assert drafted > 0 and out[:10] == plain[len(fed[1]) : len(fed[1]) + 10]


def test_greedy_batch_stream_gives_each_sequence_its_greedy_tokens(ckpts: dict[str, Path]) -> None:
    path = ckpts["deepseek_v3"]
    p = [_prompt(path, n, seed=50 + i) for i, n in enumerate((9, 4, 14))]
    eng = _load(path, max_sequences=3)
    for s in range(3):
        eng.inject(p[s][0], p[s][1], p[s][2], seq=s)
    order = [2, 0, 1]
    stream = eng.greedy_batch_stream([p[s][3] for s in order], [p[s][2] for s in order], order, 8)
    steps = [next(stream) for _ in range(5)]
    stream.close()  # stopped early: the sequences go on from the tokens read
    steps += list(eng.greedy_batch_stream(steps[-1], [p[s][2] + 5 for s in order], order, 3))
    for i, s in enumerate(order):
        alone = _load(path)
        alone.inject(p[s][0], p[s][1], p[s][2])
        assert [step[i] for step in steps] == greedy_generate(alone, p[s][3], p[s][2], 8), s
    end = eng.max_seq_len - 3  # the stream ends where the first cache does
    assert len(list(eng.greedy_batch_stream([1, 2], [end, 4], [0, 1], 10))) == 3
