"""TileRT reference engine vs transformers on tiny seeded checkpoints with unusual dims (CPU, float32).

Covers: logits (prompt at once and token by token) and 64-step greedy equality for deepseek_v3 (incl.
q_lora=None and YaRN), deepseek_v32 and glm_moe_dsa (shared indexer layer); injection of vLLM-layout
KV; the KV layout decoders; MTP speculative greedy == plain greedy.

The reference models and the DSA note: ``tests/support/hf_reference.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_reference import COMMON, FAMILIES, PROMPT_LEN, VOCAB, hf_model, prompt_ids, rel_err

from tilert.engines.base import KVLayout
from tilert.engines.tilert import fp8, layouts, ops
from tilert.engines.tilert.engine import TileRTEngine, greedy_generate, speculative_generate
from tilert.models.tiny import add_mtp_layer

GEN = 64
MAX_SEQ = 128

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Case:
    """A saved checkpoint plus transformers' reference outputs for the prompt."""

    def __init__(self, model: torch.nn.Module, path: Path, with_generate: bool) -> None:
        self.path = path
        model.save_pretrained(path)
        self.prompt = prompt_ids()
        with torch.no_grad():
            self.logits = model(self.prompt[None]).logits[0].float()
            self.generated: list[int] = []
            if with_generate:
                out = model.generate(
                    self.prompt[None], max_new_tokens=GEN, do_sample=False, use_cache=True, pad_token_id=0
                )
                self.generated = out[0, PROMPT_LEN:].tolist()

    def engine(self, path: Path | None = None) -> TileRTEngine:
        return TileRTEngine.load(path or self.path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: Case(hf_model(arch), root / arch, with_generate=True) for arch in FAMILIES}


# ------------------------------------------------------------------------------ logits / greedy


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers(cases: dict[str, Case], arch: str) -> None:
    case = cases[arch]
    eng = case.engine()
    at_once = eng.forward(case.prompt, 0)
    assert at_once.dtype == torch.float32 and at_once.shape == (PROMPT_LEN, VOCAB)
    for pos in (0, 5, 17, 30, PROMPT_LEN - 1):
        assert rel_err(at_once[pos], case.logits[pos]) <= 1e-4, pos
    eng2 = case.engine()
    steps = torch.stack([eng2.forward(case.prompt[i : i + 1], i)[0] for i in range(PROMPT_LEN)])
    assert rel_err(steps, case.logits) <= 1e-4


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_matches_transformers_generate(cases: dict[str, Case], arch: str) -> None:
    case = cases[arch]
    eng = case.engine()
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    ours = [first] + greedy_generate(eng, first, PROMPT_LEN, GEN - 1)
    assert ours == case.generated


@pytest.mark.parametrize("arch", FAMILIES)
def test_cpu_fast_path_is_the_tested_path(cases: dict[str, Case], arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines above compute with the CPU kernels (``ops.cpu``, what the decode node runs on CPU); with
    ``TILERT_CPU_FAST=0`` they keep the dispatched reference ops, and both agree (logits to float32 rounding,
    the same greedy tokens)."""
    from tilert.engines.tilert import ops
    from tilert.engines.tilert.ops import cpu

    case = cases[arch]
    fast = case.engine()
    assert fast.cpu_kernels and fast.model.layers[0].attn.k is cpu and fast.model.k is cpu
    monkeypatch.setenv("TILERT_CPU_FAST", "0")
    ref = case.engine()
    assert not ref.cpu_kernels and ref.model.layers[0].attn.k is ops and ref.model.layers[-1].mlp.k is ops
    got, want = fast.forward(case.prompt, 0), ref.forward(case.prompt, 0)
    assert rel_err(got, want) <= 1e-5
    first = int(want[-1].argmax())
    assert list(fast.greedy_stream(first, PROMPT_LEN, 24)) == list(ref.greedy_stream(first, PROMPT_LEN, 24))


def test_cache_hints_name_the_weights_read_next(cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's cache hints (``tilert::l2_prefetch``), two a layer in a captured step (here: any step): once the
    attention's projections are done, ``W_o`` and the router's gate; before the MLP, the shared experts' slots and
    the next layer's ``W_a`` / ``W_b``. The hints change nothing: the logits are those without them."""
    from types import SimpleNamespace

    from tilert.engines.tilert import model as model_module
    from tilert.engines.tilert.ops import cpu

    case = cases["deepseek_v32"]
    eng = case.engine()
    model = eng.model
    want = eng.forward(case.prompt[:4], 0)
    monkeypatch.setattr(model_module, "_captured", lambda x: True)
    calls: list[tuple[list[torch.Tensor], list[str]]] = []
    table = SimpleNamespace(**{name: getattr(cpu, name) for name in cpu.__all__})
    table.l2_prefetch = lambda tensors, sites: calls.append((tensors, sites.split(",")))
    model.use_kernels(table)
    got = eng.forward(case.prompt[:4], 0)
    assert torch.equal(got, want)
    layers = list(model.layers)
    assert len(calls) == 2 * len(layers)
    for i, layer in enumerate(layers):
        (early, early_sites), (late, late_sites) = calls[2 * i], calls[2 * i + 1]
        mlp, e = layer.mlp, model.args.n_routed_experts
        assert early[0] is layer.attn.wo and early_sites == ["wo"] + (["gate"] if mlp.routed else [])
        if mlp.routed:
            assert early[1] is mlp.gate
        shared = [t for t, site in zip(late, late_sites, strict=True) if site == "shared"]
        if mlp.routed:
            assert [t.data_ptr() for t in shared] == [mlp.w13[e].data_ptr(), mlp.w2[e].data_ptr()]
            assert [t.shape[0] for t in shared] == [model.args.n_shared_experts] * 2
        nxt = [t for t, site in zip(late, late_sites, strict=True) if site == "wa_next"]
        if i + 1 < len(layers):
            assert nxt[0] is layers[i + 1].attn.wa and nxt[-1] is layers[i + 1].attn.wb
        else:
            assert nxt == []


def test_a_dense_step_leaves_the_indexer_scores_out(cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    """Below ``index_topk`` a step attends every row, so it computes neither the indexer's queries (``W_b``'s last
    rows) nor its head weights (``W_a``'s): its GEMVs read the rows it uses, a sparse step's all of them. The
    indexer's key is still written to its cache (the sparse steps read it: the token-by-token logits above cross
    from dense to sparse steps)."""
    from types import SimpleNamespace

    from tilert.engines.tilert.ops import cpu

    case = cases["deepseek_v32"]
    eng = case.engine()
    model, a = eng.model, eng.model.args
    attn = model.layers[0].attn
    assert attn.has_indexer and a.q_lora_rank is not None and not a.fp8
    rows: dict[int, list[int]] = {attn.wa.data_ptr(): [], attn.wb.data_ptr(): []}
    heads: list[int] = []
    table = SimpleNamespace(**{name: getattr(cpu, name) for name in cpu.__all__})

    def gemv(x: torch.Tensor, w: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        rows.get(w.data_ptr(), []).append(w.shape[0])
        return cpu.gemv(x, w, *args, **kw)

    def mla_prep(*args: Any) -> tuple[torch.Tensor, ...]:
        heads.append(args[14])
        return cpu.mla_prep(*args)

    table.gemv, table.mla_prep = gemv, mla_prep
    model.use_kernels(table)
    eng.forward(case.prompt[:4], 0)  # positions 0..3: dense
    eng.forward(case.prompt[4:16], 4)  # up to position 15: past index_topk, sparse
    wa_rows, wb_rows = a.wa_rows(True), a.wb_rows(True)
    assert rows[attn.wa.data_ptr()] == [wa_rows - a.index_n_heads, wa_rows]
    assert rows[attn.wb.data_ptr()] == [a.q_width, wb_rows] and a.q_width < wb_rows
    n = len(model.layers)
    assert heads == [0] * n + [a.index_n_heads] * n


@pytest.mark.parametrize(
    "variant",
    [{"q_lora_rank": None}, {"rope_parameters": YARN}, {"rope_interleave": False}],
    ids=["no_q_lora", "yarn", "half_split_rope"],
)
def test_deepseek_v3_variants(tmp_path: Path, variant: dict[str, Any]) -> None:
    case = Case(hf_model("deepseek_v3", seed=3, **variant), tmp_path / "m", with_generate=False)
    eng = case.engine()
    assert rel_err(eng.forward(case.prompt, 0), case.logits) <= 1e-4
    if "rope_parameters" in variant:
        base = (COMMON["qk_nope_head_dim"] + COMMON["qk_rope_head_dim"]) ** -0.5
        assert eng.model.args.softmax_scale != pytest.approx(base)
        assert eng.model.args.rope_attention_scaling != pytest.approx(1.0)


# ------------------------------------------------------------------------------------ injection


def _vllm_state(eng: TileRTEngine, n: int) -> tuple[dict[str, torch.Tensor], dict[str, KVLayout]]:
    """Encode the engine's own cache rows ``[0, n)`` the way vLLM would hand them over."""
    a = eng.model.args
    lay = eng.expected_layouts()
    state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :n], "float32", a.kv_lora_rank, True)}
    if a.dsa:
        state["indexer"] = layouts.encode_dsa_indexer(
            eng.model.index_cache[:, :n], a.qk_rope_head_dim, a.indexer_rope_interleave
        )
    return state, lay


@pytest.mark.parametrize("arch", FAMILIES)
def test_inject_vllm_layout_then_decode(cases: dict[str, Case], arch: str) -> None:
    case = cases[arch]
    src = case.engine()
    first = int(src.forward(case.prompt, 0)[-1].argmax())
    state, lay = _vllm_state(src, PROMPT_LEN)
    assert state["mla"].shape == (3, PROMPT_LEN, lay["mla"].row_bytes)
    if src.model.args.dsa:
        # fp8 indexer keys are lossy: the reference is the source engine holding the same dequantised keys.
        a = src.model.args
        src.model.index_cache[:, :PROMPT_LEN] = layouts.decode_dsa_indexer(
            state["indexer"], a.index_head_dim, a.qk_rope_head_dim, a.indexer_rope_interleave
        )
    dst = case.engine()
    dst.inject(state, lay, PROMPT_LEN)
    assert torch.equal(dst.model.kv_cache[:, :PROMPT_LEN], src.model.kv_cache[:, :PROMPT_LEN])
    want = greedy_generate(src, first, PROMPT_LEN, 24)
    assert greedy_generate(dst, first, PROMPT_LEN, 24) == want
    if arch == "deepseek_v3":
        assert [first] + want == case.generated[:25]


def test_inject_refuses_unknown_layouts(cases: dict[str, Case]) -> None:
    eng = cases["deepseek_v32"].engine()
    rows = torch.zeros(3, 4, 56 * 4, dtype=torch.uint8)
    idx = torch.zeros(3, 4, 36, dtype=torch.uint8)
    good = eng.expected_layouts()
    with pytest.raises(ValueError, match="unknown MLA KV layout"):
        eng.inject({"mla": rows, "indexer": idx}, {**good, "mla": KVLayout("paged_weird", "float32", 224, 3)}, 4)
    with pytest.raises(ValueError, match="unknown indexer"):
        eng.inject({"mla": rows, "indexer": idx}, {**good, "indexer": KVLayout("fp8_ds_mla", "x", 36, 3)}, 4)
    with pytest.raises(ValueError, match="indexer"):
        eng.inject({"mla": rows}, good, 4)  # DSA needs the indexer KV
    with pytest.raises(ValueError, match="unsupported dtype"):
        eng.inject({"mla": rows, "indexer": idx}, {**good, "mla": KVLayout("mla_dense", "fp8_e4m3", 224, 3)}, 4)
    with pytest.raises(ValueError, match="bytes"):
        eng.inject({"mla": rows[..., :100], "indexer": idx}, good, 4)
    with pytest.raises(ValueError, match="rope_interleaved"):
        eng.inject({"mla": rows, "indexer": idx}, {**good, "indexer": KVLayout("dsa_indexer", "x", 36, 3, True)}, 4)


# -------------------------------------------------------------------------------- layout codecs


def test_rope_permutation_roundtrip() -> None:
    perm, inv = layouts.rope_deinterleave_perm(64), layouts.rope_interleave_perm(64)
    assert perm.tolist() == list(range(0, 64, 2)) + list(range(1, 64, 2))
    x = torch.arange(64)
    assert torch.equal(x[perm][inv], x)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_dense_decode(dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(2, 5, 576, generator=g)
    tdt = torch.float32 if dtype == "float32" else torch.bfloat16
    # Build vLLM rows by hand: rope pairs interleaved, i.e. vllm[2i] = engine[i], vllm[2i+1] = engine[32+i].
    rope = latent[..., 512:]
    vrope = torch.stack([rope[..., :32], rope[..., 32:]], dim=-1).reshape(2, 5, 64)
    rows = torch.cat([latent[..., :512], vrope], -1).to(tdt).contiguous().view(torch.uint8)
    assert rows.shape[-1] == 576 * torch.empty((), dtype=tdt).element_size()
    got = layouts.decode_mla_dense(rows, dtype, 512, 64, rope_interleaved=True)
    torch.testing.assert_close(got, latent.to(tdt).float(), rtol=0, atol=0)
    assert torch.equal(layouts.encode_mla_dense(latent, dtype, 512, True), rows)


def test_fp8_ds_mla_decode() -> None:
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(3, 7, 576, generator=g) * torch.tensor([0.01, 1.0, 30.0, 0.5]).repeat_interleave(144)
    rows = layouts.encode_fp8_ds_mla(latent, 512, rope_interleaved=True)
    assert rows.shape == (3, 7, 656) and rows.dtype == torch.uint8
    # Byte-level checks of the format: scales at 512..527, rope bf16 (interleaved) at 528..655.
    scales = rows[..., 512:528].contiguous().view(torch.float32)
    want_s = (latent[..., :512].reshape(3, 7, 4, 128).abs().amax(-1) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, want_s)
    rope_v = rows[..., 528:].contiguous().view(torch.bfloat16).float()
    assert torch.equal(rope_v[..., 0::2], latent[..., 512:544].to(torch.bfloat16).float())
    got = layouts.decode_fp8_ds_mla(rows, 512, 64, rope_interleaved=True)
    err = (got[..., :512] - latent[..., :512]).abs().reshape(3, 7, 4, 128).amax(-1)
    assert (err <= scales * 448.0 * 2**-3).all()  # e4m3 has 3 mantissa bits
    torch.testing.assert_close(got[..., 512:], latent[..., 512:].to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_dsa_indexer_decode_rows_and_blocks(interleaved: bool) -> None:
    g = torch.Generator().manual_seed(2)
    n = 100  # two blocks of 64, the second partial
    keys = torch.randn(n, 128, generator=g) * 3
    # Hand-built block-major cache (vLLM): per 8448-byte block, 64x128 fp8 bytes then 64 fp32 scales.
    vk = keys.clone()
    if interleaved:
        rope = keys[:, :64]
        vk[:, :64] = torch.stack([rope[:, :32], rope[:, 32:]], -1).reshape(n, 64)
    s = (vk.abs().amax(-1) / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
    q8 = (vk / s[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    blocks = torch.zeros(2, 8448, dtype=torch.uint8)
    for t in range(n):
        b, j = divmod(t, 64)
        blocks[b, j * 128 : (j + 1) * 128] = q8[t]
        blocks[b, 8192 + 4 * j : 8192 + 4 * j + 4] = s[t : t + 1].view(torch.uint8)
    rows = layouts.dsa_indexer_blocks_to_rows(blocks, n)
    assert rows.shape == (n, 132)
    assert torch.equal(layouts.dsa_indexer_rows_to_blocks(rows)[:, : 64 * 132], blocks[:, : 64 * 132]) or n % 64
    assert torch.equal(rows, layouts.encode_dsa_indexer(keys, 64, interleaved))
    got = layouts.decode_dsa_indexer_blocks(blocks, n, 128, 64, interleaved)
    assert ((got - keys).abs() <= s[:, None] * 448.0 * 2**-3).all()
    want = layouts.decode_dsa_indexer(rows, 128, 64, interleaved)
    assert torch.equal(got, want)


# ------------------------------------------------------------------------------------------ MTP


def _add_mtp(case: Case, out: Path, predictive: bool = False, main_scale: float = 1e-3) -> Path:
    """The case's checkpoint plus an MTP module (see ``tilert.models.tiny.add_mtp_layer``)."""
    return add_mtp_layer(case.path, out, predictive=predictive, main_scale=main_scale)


def test_mtp_verify_stays_in_one_attention_regime(cases: dict[str, Case], tmp_path: Path) -> None:
    """A verify batch never straddles index_topk (dense below, DSA from it, as plain steps): near the
    boundary the step drafts fewer tokens, and the output is still plain greedy."""
    case = cases["deepseek_v32"]
    eng = case.engine(_add_mtp(case, tmp_path / "mtp"))
    topk = eng.model.args.index_topk
    assert topk < PROMPT_LEN
    start = topk - 3
    first = int(eng.forward(case.prompt[:start], 0)[-1].argmax())
    plain = greedy_generate(eng, first, start, 8)
    eng.forward(case.prompt[:start], 0)
    steps = []
    tok, pos = first, start
    while pos < start + 8:
        res = eng.speculative_greedy_step(tok, pos, 3)
        steps.append((pos, res.num_drafted))
        tok, pos = res.tokens[-1], pos + len(res.tokens)
    assert all(p + d < topk or p >= topk for p, d in steps), steps
    assert steps[0] == (start, 2)  # positions topk-3..topk-1: two drafts, not three
    eng.forward(case.prompt[:start], 0)
    assert speculative_generate(eng, first, start, 8, num_draft=3)[0] == plain


def test_greedy_stream_equals_greedy(cases: dict[str, Case]) -> None:
    """The engine's pipelined greedy stream (the decode node's greedy path) yields greedy_generate's tokens;
    stopping it early leaves the engine ready to continue from the last token read."""
    case = cases["deepseek_v32"]
    eng = case.engine()
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    want = greedy_generate(eng, first, PROMPT_LEN, 24)
    assert list(eng.greedy_stream(first, PROMPT_LEN, 24)) == want
    stream = eng.greedy_stream(first, PROMPT_LEN, 24)
    head = [next(stream) for _ in range(10)]
    stream.close()
    assert head + greedy_generate(eng, head[-1], PROMPT_LEN + 10, 14) == want
    assert list(eng.greedy_stream(first, eng.max_seq_len - 2, 10)).__len__() == 2  # stops at capacity


@pytest.mark.parametrize("arch", FAMILIES)
def test_mtp_speculative_equals_plain_greedy(cases: dict[str, Case], arch: str, tmp_path: Path) -> None:
    case = cases[arch]
    path = _add_mtp(case, tmp_path / "mtp")
    eng = case.engine(path)
    assert eng.supports_mtp and eng.capabilities().mtp
    assert not case.engine().supports_mtp
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    plain = greedy_generate(eng, first, PROMPT_LEN, GEN)
    assert [first] + plain[: GEN - 1] == case.generated  # the MTP layer does not change the main model
    for k in (1, 2, 3):
        eng.forward(case.prompt, 0)  # rewind to the prompt (MTP rows are recomputed from hidden states)
        spec, drafted, _ = speculative_generate(eng, first, PROMPT_LEN, GEN, num_draft=k)
        assert spec == plain, k
        assert drafted > 0
    # After an injection (no MTP KV, no hidden states): the MTP cache starts empty, output unchanged.
    state, lay = _vllm_state(eng, PROMPT_LEN)
    if eng.model.args.dsa:
        a = eng.model.args
        eng.model.index_cache[:, :PROMPT_LEN] = layouts.decode_dsa_indexer(
            state["indexer"], a.index_head_dim, a.qk_rope_head_dim, a.indexer_rope_interleave
        )
        plain = greedy_generate(eng, first, PROMPT_LEN, 32)
    dst = case.engine(path)
    dst.inject(state, lay, PROMPT_LEN)
    st = dst._seqs[0]
    assert st.mtp_upto <= st.mtp_lo == PROMPT_LEN  # no valid MTP row: the range starts after the prompt
    spec, _, _ = speculative_generate(dst, first, PROMPT_LEN, 32, num_draft=2)
    assert spec == plain[:32]
    assert int(dst._mtp_from) == dst._seqs[0].mtp_lo  # the device copy the MTP graphs read follows the range


@pytest.mark.parametrize("main_scale", [1e-3, 0.3], ids=["near_bigram", "partial"])
def test_mtp_acceptance_with_predictive_module(tmp_path: Path, main_scale: float) -> None:
    """A module that predicts well is accepted (all drafts for a near-bigram main model, some otherwise,
    which exercises partial acceptance + rewind); output still equals plain greedy."""
    model = hf_model("deepseek_v3", seed=5)
    case = Case(model, tmp_path / "base", with_generate=False)
    path = _add_mtp(case, tmp_path / "mtp", predictive=True, main_scale=main_scale)
    eng = case.engine(path)
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    plain = greedy_generate(eng, first, PROMPT_LEN, GEN)
    eng.forward(case.prompt, 0)
    spec, drafted, accepted = speculative_generate(eng, first, PROMPT_LEN, GEN, num_draft=3)
    assert spec == plain
    if main_scale < 0.01:
        assert accepted > 0.5 * drafted
    else:
        assert 0 < accepted < drafted


def test_fp8_draft_head_drafts_from_its_copy_and_keeps_the_tokens(tmp_path: Path) -> None:
    """warm_up(draft_head="fp8"): the drafts' logits are the block-FP8 copy's (the verify step keeps the model's
    head), a module that predicts well is still accepted, and the tokens are plain greedy's; a checkpoint without an
    MTP layer, or a head the engine does not know, is refused."""
    model = hf_model("deepseek_v3", seed=5)
    case = Case(model, tmp_path / "base", with_generate=False)
    eng = case.engine(_add_mtp(case, tmp_path / "mtp", predictive=True, main_scale=1e-3))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    plain = greedy_generate(eng, first, PROMPT_LEN, GEN)
    eng.warm_up(2, draft_head="fp8")
    m = eng.model
    mtp = m.mtp[0]
    assert mtp.draft_head is not None and mtp.draft_head.dtype == torch.float8_e4m3fn
    head = mtp.head if mtp.head is not None else m.lm_head
    copy = fp8.dequant(mtp.draft_head, mtp.draft_head_scale, torch.float32)
    assert 0 < (copy - head.float()).abs().max() <= head.float().abs().max() / 16  # e4m3's rounding, not the head
    h = torch.randn(2, m.args.hidden_size, generator=torch.Generator().manual_seed(0)).to(head.dtype)
    logits = ops.reference.gemv(h, mtp.draft_head, mtp.head_norm, m.args.rms_norm_eps, None, True, mtp.draft_head_scale)
    want = ops.reference.gemv(h, copy.to(head.dtype), mtp.head_norm, m.args.rms_norm_eps, None, True)
    assert torch.equal(logits, want)
    eng.forward(case.prompt, 0)
    spec, drafted, accepted = speculative_generate(eng, first, PROMPT_LEN, GEN, num_draft=3)
    assert spec == plain and accepted > 0.5 * drafted
    eng.use_draft_head("model")
    assert mtp.draft_head is None and mtp.draft_head_scale is None
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP layer"):
        case.engine().warm_up(1, draft_head="fp8")
    with pytest.raises(ValueError, match="draft_head must be one of model, fp8"):
        eng.warm_up(1, draft_head="int4")


@pytest.mark.parametrize("draft_head", ["model", "fp8"])
def test_draft_vocab_drafts_only_its_tokens_and_keeps_the_tokens(tmp_path: Path, draft_head: str) -> None:
    """warm_up(draft_vocab=ids): drafts read only those rows of the head (as they are, or their FP8 copy) and
    propose only those tokens. A subset holding greedy's tokens is still accepted; one without them never is; the
    tokens are plain greedy's either way. Ids that repeat or fall outside the vocabulary are refused."""
    model = hf_model("deepseek_v3", seed=5)
    case = Case(model, tmp_path / "base", with_generate=False)
    eng = case.engine(_add_mtp(case, tmp_path / "mtp", predictive=True, main_scale=1e-3))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    plain = greedy_generate(eng, first, PROMPT_LEN, GEN)
    others = [t for t in range(VOCAB) if t not in set(plain)]
    mtp = eng.model.mtp[0]
    for vocab, accepted_some in ((sorted(set(plain)) + others[::3], True), (others[::2], False)):
        eng.warm_up(3, draft_head=draft_head, draft_vocab=vocab)
        assert mtp.draft_head is not None and mtp.draft_head.shape[0] == len(vocab)
        assert mtp.draft_vocab is not None and mtp.draft_vocab.tolist() == vocab
        eng.forward(case.prompt, 0)
        spec, drafted, accepted = speculative_generate(eng, first, PROMPT_LEN, GEN, num_draft=3)
        assert spec == plain
        assert accepted > 0.5 * drafted if accepted_some else accepted == 0, (accepted, drafted)
    eng.use_draft_head()
    assert mtp.draft_head is None and mtp.draft_vocab is None
    for bad in ([1, 1], [VOCAB], []):
        with pytest.raises(ValueError, match="draft_vocab must be distinct token ids"):
            eng.use_draft_head(draft_head, bad)


@pytest.mark.parametrize("main_scale", [1e-3, 0.3], ids=["near_bigram", "partial"])
def test_speculative_stream_equals_step_by_step(tmp_path: Path, main_scale: float) -> None:
    """The speculative stream (the decode node's MTP path), whose steps run from state kept on the device once
    their shape no longer depends on where they start, gives step for step what speculative_greedy_step gives
    (drafts accepted in part, all, and with every draft taken); stopped, the engine goes on from the last step
    read."""
    model = hf_model("deepseek_v3", seed=5)
    case = Case(model, tmp_path / "base", with_generate=False)
    eng = case.engine(_add_mtp(case, tmp_path / "mtp", predictive=True, main_scale=main_scale))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    from_device = []
    run = eng._spec_run
    eng._spec_run = lambda *a, **kw: from_device.append(a) or run(*a, **kw)  # counts the steps it runs

    def steps(streamed: int, accept_all: bool) -> list[Any]:
        eng.forward(case.prompt, 0)
        out, tok, pos = [], first, PROMPT_LEN
        stream = eng.speculative_stream(first, PROMPT_LEN, 3, accept_all=accept_all)
        while len(out) < streamed:
            out.append(next(stream))
            tok, pos = out[-1].tokens[-1], pos + len(out[-1].tokens)
        stream.close()
        while len(out) < 14:
            res = eng.speculative_greedy_step(tok, pos, 3, accept_all=accept_all)
            out.append(res)
            tok, pos = res.tokens[-1], pos + len(res.tokens)
        return out

    for accept_all in (False, True):
        want = steps(0, accept_all)
        assert not from_device
        assert steps(10, accept_all) == want
        assert len(from_device) >= 8, len(from_device)  # all but the first steps ran from the device's state
        from_device.clear()
    assert [r.num_accepted for r in want] == [3] * 14


@pytest.mark.parametrize("accept_all", [False, True])
def test_warm_up_runs_the_speculative_steps_and_leaves_the_engine_as_loaded(
    cases: dict[str, Case], tmp_path: Path, accept_all: bool
) -> None:
    """The decode node's warm-up (on CUDA it captures what the first requests would wait for) runs the speculative
    steps a request takes in each attention regime, the last ones from the device's state, and leaves nothing
    behind: afterwards an injected prompt decodes speculatively to plain greedy's tokens."""
    case = cases["deepseek_v32"]
    eng = case.engine(_add_mtp(case, tmp_path / "mtp"))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    state, lay = _vllm_state(eng, PROMPT_LEN)
    a = eng.model.args
    eng.model.index_cache[:, :PROMPT_LEN] = layouts.decode_dsa_indexer(
        state["indexer"], a.index_head_dim, a.qk_rope_head_dim, a.indexer_rope_interleave
    )
    plain = greedy_generate(eng, first, PROMPT_LEN, 24)  # from the prompt's rows as the injection writes them
    fresh = case.engine(_add_mtp(case, tmp_path / "mtp2"))
    regimes = []
    run = fresh._spec_run
    fresh._spec_run = lambda *a, **kw: regimes.append(a[1]) or run(*a, **kw)  # the regime of each such step
    fresh._warm_steps(2, accept_all)
    assert set(regimes) == {False, True}, regimes  # dense and DSA steps from the device's state
    assert all(vars(st) == vars(type(st)()) for st in fresh._seqs)  # the bookkeeping as loaded
    fresh.inject(state, lay, PROMPT_LEN)
    assert speculative_generate(fresh, first, PROMPT_LEN, 24, num_draft=2)[0] == plain


@pytest.mark.parametrize("num_draft", [0, 2])
def test_decode_loop_speculative_and_stops(cases: dict[str, Case], tmp_path: Path, num_draft: int) -> None:
    """The decode node's loop: MTP-speculative greedy emits exactly plain greedy; a stop token inside a
    multi-token step ends the stream at that token; sampling with a seed is reproducible."""
    import threading

    from tilert.decode.generate import Finish, run_decode
    from tilert.decode.sampling import DecodeParams

    case = cases["deepseek_v3"]
    eng = case.engine(_add_mtp(case, tmp_path / "mtp"))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    state, lay = _vllm_state(eng, PROMPT_LEN)

    def run(**kw: Any) -> tuple[list[int], Finish]:
        out: list[int] = []
        params = DecodeParams("t", first, PROMPT_LEN, **{"max_tokens": 24, "temperature": 0.0, **kw})
        finish = run_decode(
            eng,
            state,
            lay,
            PROMPT_LEN,
            params,
            frozenset(),
            lambda ids, fin: out.extend(ids),
            threading.Event(),
            num_draft,
        )
        return out, finish

    plain, finish = run()
    assert finish == Finish("length") and len(plain) == 24
    assert plain == case.generated[1:25]
    stop_at = plain[10]
    stopped, finish = run(stop_token_ids=(stop_at,))
    assert finish == Finish("stop", stop_at) and stopped == plain[: plain.index(stop_at) + 1]
    sampled_a, _ = run(temperature=1.0, top_k=5, seed=7)
    sampled_b, _ = run(temperature=1.0, top_k=5, seed=7)
    assert sampled_a == sampled_b and len(sampled_a) == 24
    greedy_via_topk, _ = run(temperature=1.0, top_k=1, seed=3)
    assert greedy_via_topk == plain


def test_mtp_accept_all_takes_every_draft(cases: dict[str, Case], tmp_path: Path) -> None:
    """The benchmark switch: every draft is accepted and the step's last token is the main model's after the last
    draft, so the sequence goes on as if it had been fed those tokens (its next greedy tokens are those of a
    forward over them)."""
    case = cases["deepseek_v32"]
    eng = case.engine(_add_mtp(case, tmp_path / "mtp"))
    first = int(eng.forward(case.prompt, 0)[-1].argmax())
    tok, pos, fed = first, PROMPT_LEN, [first]
    for _ in range(3):
        res = eng.speculative_greedy_step(tok, pos, 3, accept_all=True)
        if pos > PROMPT_LEN:  # the first step has no hidden state for the prompt's last position: no drafts
            assert res.num_drafted == res.num_accepted == 3 and len(res.tokens) == 4
        fed += res.tokens
        tok, pos = res.tokens[-1], pos + len(res.tokens)
    after = greedy_generate(eng, tok, pos, 4)
    ref = case.engine()
    logits = ref.forward(torch.cat([case.prompt, torch.tensor(fed[:-1])]), 0)
    assert logits[-1].argmax().item() == fed[-1]  # the last token is the main model's after the drafts
    assert greedy_generate(ref, fed[-1], pos, 4) == after
