"""DSA indexer and MTP payloads through every transport into the engine.

vLLM on CPU produces neither a DSA indexer cache nor an MTP draft layer's cache, so the prefill side's
caches are built here exactly as vLLM lays them out on GPU for DeepSeek-V3.2 with
``speculative-config`` method ``mtp``: block size 64, per layer an MLA
page tensor (dense bf16 / fp32 ``[num_blocks, 64, 576]`` with the rope pairs interleaved, or
``fp8_ds_mla`` ``[num_blocks, 64, 656]`` uint8), a block-major fp8 indexer page tensor
``[num_blocks, 64 * (D + 4)]`` per layer, and the MTP layer's own MLA + indexer caches under vLLM's name
``model.layers.{N}.mtp_block...``. They are filled from the engine's own prefill of a prompt (its main
and MTP cache rows, the MTP rows computed from the prompt's hidden states and the first sampled token,
as vLLM's MTP proposer computes them) and scattered through a shuffled block table.

They then go through the real connector (``SchedulerSide`` places the extent, ``WorkerSide.save_layer``
stages layer by layer as vLLM calls ``save_kv_layer``, ``BackgroundSender`` ships) and the real transport
(tcp, Mooncake, NIXL on loopback) into a decode node's real transfer half (``SlotTable`` +
``ControlServer``) and its decode scheduler (``DecodeBatch``, MTP-speculative greedy) on a fresh engine.

The oracle: the engine's own continuation of the same prompt, from caches holding the values vLLM's cache
holds (fp8 keys and latents are lossy: the reference engine holds the same dequantised values, as
``test_engine_reference`` does): greedy tokens equal, logits close; and with the MTP layer's KV present
the engine drafts, and accepts, at the very first decode step.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch
from support.waiting import await_until

from tilert import contracts as c
from tilert.connector.claims import SaveRequest
from tilert.connector.scheduler import SchedulerSide
from tilert.connector.sender import BackgroundSender
from tilert.connector.worker import WorkerSide
from tilert.decode.batch import DecodeBatch, Job
from tilert.decode.control import ControlServer
from tilert.decode.generate import Finish
from tilert.decode.sampling import DecodeParams
from tilert.decode.slots import SlotTable
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine
from tilert.plugins import load_transport

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

pytestmark = pytest.mark.timeout(300)

SECRET = b"dsa-mtp-handoff-secret-0123456789abcdef"
TRANSPORTS = ["tcp", "mooncake", "nixl"]
MLA_LAYOUTS = ["dense_bf16", "dense_fp32", "fp8_ds_mla"]
PROMPT, GEN, DRAFT, MAX_SEQ = 80, 16, 2, 128
BLOCK, NUM_BLOCKS = 64, 6  # vLLM's block size for DSA models; the prompt spans blocks 4 and 1
BLOCK_TABLE = [4, 1]
TOPK = 16  # < PROMPT: the decode runs DSA sparse attention over the handed-off indexer keys


@dataclass
class Prefilled:
    """The engine's own prefill of the prompt: its cache rows (engine layout) and first token."""

    path: Path
    prompt: torch.Tensor
    first: int
    main: torch.Tensor  # [N, P, 576] latent rows
    mtp: torch.Tensor  # [P, 576] the MTP layer's latent rows
    index: torch.Tensor  # [N_idx, P, D] indexer keys
    mtp_index: torch.Tensor  # [P, D]


@pytest.fixture(scope="module")
def prefilled(tmp_path_factory: pytest.TempPathFactory) -> Prefilled:
    from tilert.models.tiny import add_mtp_layer, build_tiny_model

    root = tmp_path_factory.mktemp("dsa-mtp")
    base = build_tiny_model("deepseek_v32", root / "v32", seed=1, num_hidden_layers=2, index_topk=TOPK, index_n_heads=8)
    # A module that predicts the (near-bigram) main model's next token, so its drafts get accepted; the main
    # model still reads its KV (attention outputs scaled by 1e-3: zeroing 60 of the prompt's KV rows moves
    # the logits by ~0.05, four orders of magnitude above the tolerance below).
    path = add_mtp_layer(base, root / "v32-mtp", predictive=True, main_scale=1e-3)
    eng = _engine(path)
    a = eng.model.args
    assert eng.supports_mtp and a.dsa and a.mtp_indexer
    prompt = torch.randint(8, a.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3))
    first = int(eng.forward(prompt, 0)[-1].argmax())
    # vLLM's MTP proposer in the prefill step: MTP rows r = (h_r, t_{r+1}) for r < P, t_P the sampled token.
    eng.speculative_greedy_step(first, PROMPT, DRAFT)
    m = eng.model
    return Prefilled(
        path,
        prompt,
        first,
        m.kv_cache[:, :PROMPT].clone(),
        m.mtp_kv_cache[0, :PROMPT].clone(),
        m.index_cache[:, :PROMPT].clone(),
        m.mtp_index_cache[0, :PROMPT].clone(),
    )


def _engine(path: Path) -> TileRTEngine:
    return TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ)


# ---- the prefill side's caches, as vLLM lays them out ------------------------------------------------


def _mla_rows(latent: torch.Tensor, kind: str, lora: int) -> torch.Tensor:
    """Engine-layout latent rows -> vLLM's per-token bytes (rope pairs interleaved)."""
    if kind == "fp8_ds_mla":
        return layouts.encode_fp8_ds_mla(latent, lora, rope_interleaved=True)
    return layouts.encode_mla_dense(
        latent,
        kind.removeprefix("dense_").replace("bf16", "bfloat16").replace("fp32", "float32"),
        lora,
        rope_interleaved=True,
    )


def _paged_mla(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """One layer's page tensor with ``rows [P, row_bytes]`` at the block table's slots, the rest noise."""
    gen = torch.Generator().manual_seed(rows.shape[-1])
    if kind == "fp8_ds_mla":
        cache = torch.randint(0, 256, (NUM_BLOCKS, BLOCK, rows.shape[-1]), dtype=torch.uint8, generator=gen)
        flat = cache.view(-1, rows.shape[-1])
    else:
        dtype = torch.bfloat16 if kind == "dense_bf16" else torch.float32
        cache = torch.randn(NUM_BLOCKS, BLOCK, 576, generator=gen).to(dtype)
        flat = cache.view(-1, 576).view(torch.uint8)
    flat[_slots()] = rows
    return cache


def _paged_indexer(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """One layer's block-major indexer pages ``[num_blocks, 64 * (D + 4)]`` holding ``rows [P, D + 4]``."""
    blocks = layouts.dsa_indexer_rows_to_blocks(rows, head_dim)
    cache = torch.randint(
        0, 256, (NUM_BLOCKS, blocks.shape[1]), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)
    )
    for i, b in enumerate(BLOCK_TABLE):
        cache[b] = blocks[i]
    return cache


def _slots() -> torch.Tensor:
    return torch.tensor(SaveRequest("r", c.Claim("t", "h", 1, "x"), BLOCK_TABLE, BLOCK, PROMPT).slot_ids())


@dataclass
class VllmCaches:
    caches: dict[str, torch.Tensor]  # layer name -> page tensor, in vLLM's registration order
    held: dict[str, torch.Tensor]  # what vLLM's cache holds, decoded back to engine layout (the reference)


def vllm_caches(pre: Prefilled, kind: str, a: Any) -> VllmCaches:
    n, lora, rope, d = a.num_layers, a.kv_lora_rank, a.qk_rope_head_dim, a.index_head_dim
    latent = torch.cat([pre.main, pre.mtp[None]])  # [N + 1, P, 576]
    keys = torch.cat([pre.index, pre.mtp_index[None]])  # [N_idx + 1, P, D]
    mla = _mla_rows(latent, kind, lora)
    idx = layouts.encode_dsa_indexer(keys, rope, a.indexer_rope_interleave)
    caches: dict[str, torch.Tensor] = {}
    for i in range(n + 1):
        prefix = f"model.layers.{i}." + ("mtp_block." if i == n else "")
        caches[prefix + "self_attn.attn"] = _paged_mla(mla[i], kind)
        caches[prefix + "self_attn.indexer.k_cache"] = _paged_indexer(idx[i], d)
    dtype = "float32" if kind == "dense_fp32" else "bfloat16"
    held_latent = (
        layouts.decode_fp8_ds_mla(mla, lora, rope)
        if kind == "fp8_ds_mla"
        else layouts.decode_mla_dense(mla, dtype, lora, rope)
    )
    held = {"latent": held_latent, "keys": layouts.decode_dsa_indexer(idx, d, rope, a.indexer_rope_interleave)}
    return VllmCaches(caches, held)


# ---- the reference: the engine's own continuation --------------------------------------------------


@dataclass
class Continuation:
    tokens: list[int]
    logits: torch.Tensor  # [GEN, V]: the logits of each greedy step (input first, then each new token)


def reference(pre: Prefilled, held: dict[str, torch.Tensor]) -> Continuation:
    """The engine's own prefill of the prompt with its caches holding what vLLM's cache holds, then plain
    greedy steps."""
    eng = _engine(pre.path)
    eng.forward(pre.prompt, 0)
    m, n_idx = eng.model, len(eng.model.args.index_layers)
    m.kv_cache[:, :PROMPT] = held["latent"][:-1]
    m.index_cache[:, :PROMPT] = held["keys"][:n_idx]
    return _greedy(eng, pre.first)


def _greedy(eng: TileRTEngine, first: int) -> Continuation:
    tokens, rows, tok = [], [], first
    for pos in range(PROMPT, PROMPT + GEN):
        logits = eng.forward(torch.tensor([tok]), pos)[-1]
        tok = int(logits.argmax())
        tokens.append(tok)
        rows.append(logits)
    return Continuation(tokens, torch.stack(rows))


# ---- the handoff ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any]]:
    receiver = load_transport(request.param).receiver(host="127.0.0.1", options={})
    yield request.param, receiver
    receiver.close()


@dataclass
class Received:
    state: dict[str, torch.Tensor]
    layouts: dict[str, c.KVLayout]
    offer: c.Offer
    tokens: list[int]  # what the decode node's scheduler decoded (MTP-speculative greedy)
    finish: Finish | BaseException | None


def handoff(pre: Prefilled, vc: VllmCaches, name: str, receiver: Any, engine: TileRTEngine) -> Received:
    """Prefill side -> transport -> decode node, then the node's decode scheduler on ``engine``."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(pre.path)
    sender = BackgroundSender(name, {"timeout_s": 5, "verdict_timeout_s": 2}, SECRET, timeout_s=5.0)
    worker = WorkerSide(hf, sender, staging_bytes=4 << 20)
    worker.register(vc.caches)
    sched = SchedulerSide(BLOCK, SECRET, bytes_per_token=worker.bytes_per_token, pool_bytes=4 << 20)
    tid = f"dsa-mtp-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}

    async def node() -> None:
        table = SlotTable(1, engine.expected_layouts(), MAX_SEQ, receiver, check_layouts=engine.check_layouts)
        control = ControlServer(table, name, "dsa-mtp-node", SECRET)
        async with anyio.create_task_group() as tg:
            port = await tg.start(control.serve, "127.0.0.1", 0)
            table.reserve(tid)
            claim = c.Claim.signed(SECRET, tid, "127.0.0.1", port)
            meta = sched.build_meta(_new_request(claim, pre.prompt.tolist()))
            assert len(meta.saves) == 1

            def forward() -> None:  # vLLM's forward: save_kv_layer per attention layer, then wait_for_save
                for layer in vc.caches:
                    if "indexer" not in layer:  # vLLM never calls save_kv_layer for an indexer's cache
                        worker.save_layer(meta, layer)
                worker.flush(meta)

            await anyio.to_thread.run_sync(forward)
            slot = await table.wait_ready(tid, 10)
            out["state"], out["layouts"], num_tokens = slot.tensors()
            out["offer"] = slot.offer
            assert num_tokens == PROMPT
            # the sender's verdict needs the node's Ack, which follows the slot's readiness: the node serves on
            staged = worker.transfers[-1]
            await await_until(lambda: staged.outcome is not None, 10, "the sender's verdict on the transfer")
            tg.cancel_scope.cancel()

    try:
        anyio.run(node)
    finally:
        worker.close()
    assert worker.transfers[-1].outcome == "done"
    offer: c.Offer = out["offer"]
    tokens, finish = _decode_on_node(engine, out["state"], out["layouts"], offer, pre.first)
    return Received(out["state"], out["layouts"], offer, tokens, finish)


def _new_request(claim: c.Claim, prompt: list[int]) -> Any:
    """vLLM's ``SchedulerOutput`` for one new request whose whole prompt is scheduled in this step."""
    new = SimpleNamespace(
        req_id="r-0",
        sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": claim.to_params()}),
        prompt_token_ids=prompt,
        block_ids=(BLOCK_TABLE,),
        num_computed_tokens=0,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached, num_scheduled_tokens={"r-0": PROMPT})


def _decode_on_node(
    engine: TileRTEngine, state: dict[str, torch.Tensor], lays: dict[str, c.KVLayout], offer: c.Offer, first: int
) -> tuple[list[int], Finish | BaseException | None]:
    """The decode node's scheduler, as its server submits a request (``Job`` with the offer's last token)."""
    batch = DecodeBatch(engine, frozenset(), num_draft=DRAFT)
    ids: list[int] = []
    ended = threading.Event()
    result: list[Finish | BaseException] = []

    def done(r: Finish | BaseException) -> None:
        result.append(r)
        ended.set()

    params = DecodeParams(offer.transfer_id, first, PROMPT, GEN, temperature=0.0)
    try:
        batch.submit(
            Job(
                state,
                lays,
                PROMPT,
                params,
                lambda new, fin, index, logprobs: ids.extend(new),
                done,
                threading.Event(),
                offer.last_token_id,
            )
        )
        assert ended.wait(120), "the decode did not end"
    finally:
        batch.close()
    return ids, result[0] if result else None


@pytest.mark.parametrize("kind", MLA_LAYOUTS)
def test_dsa_and_mtp_kv_through_each_transport_continue_as_the_engine_itself(
    prefilled: Prefilled, transport: tuple[str, Any], kind: str
) -> None:
    name, receiver = transport
    engine = _engine(prefilled.path)
    a = engine.model.args
    vc = vllm_caches(prefilled, kind, a)
    got = handoff(prefilled, vc, name, receiver, engine)

    # What travelled: vLLM's layouts, the MTP layer last in each group, and the prompt's last token.
    mla_kind = "fp8_ds_mla" if kind == "fp8_ds_mla" else "mla_dense"
    assert got.layouts["mla"].kind == mla_kind and got.layouts["mla"].num_layers == a.num_layers + 1
    assert got.layouts["indexer"].kind == "dsa_indexer"
    assert got.layouts["indexer"].num_layers == len(a.index_layers) + 1
    assert got.offer.last_token_id == int(prefilled.prompt[-1])
    for group in ("mla", "indexer"):
        sent = torch.stack([_gathered(vc.caches, group, i) for i in range(got.layouts[group].num_layers)])
        assert torch.equal(got.state[group], sent), f"{group} bytes differ after the {name} transport"

    # The decode node's continuation == the engine's own continuation of the same prompt.
    want = reference(prefilled, vc.held)
    assert isinstance(got.finish, Finish) and (got.finish.reason, got.finish.stop_token_id) == ("length", None)
    assert got.tokens == want.tokens
    spec = got.finish.spec  # its speculative steps, as the node's metrics count them
    assert spec is not None and spec.drafts >= 1 and spec.drafts < GEN <= spec.drafts * (DRAFT + 1)
    assert spec.draft_tokens == DRAFT * spec.drafts and spec.accepted_tokens <= spec.draft_tokens
    assert len(spec.accepted_per_pos) <= DRAFT and list(spec.accepted_per_pos) == sorted(spec.accepted_per_pos)[::-1]

    # Logits: the same engine, injected with what arrived, stepped plainly.
    engine.inject(got.state, got.layouts, PROMPT, last_token_id=got.offer.last_token_id)
    assert torch.equal(engine.model.mtp_kv_cache[0, :PROMPT], vc.held["latent"][-1])
    assert torch.equal(engine.model.mtp_index_cache[0, :PROMPT], vc.held["keys"][-1])
    plain = _greedy(engine, prefilled.first)
    assert plain.tokens == want.tokens
    torch.testing.assert_close(plain.logits, want.logits, rtol=0, atol=1e-5)

    # With the MTP layer's KV present the engine drafts, and accepts, at the very first decode step.
    engine.inject(got.state, got.layouts, PROMPT, last_token_id=got.offer.last_token_id)
    step = engine.speculative_greedy_step(prefilled.first, PROMPT, DRAFT)
    assert step.num_drafted == DRAFT and step.num_accepted >= 1
    assert step.tokens == want.tokens[: len(step.tokens)]
    assert engine._seqs[0].mtp_lo == 0  # the drafts attended over the handed-off MTP rows of the whole prompt


def _gathered(caches: dict[str, torch.Tensor], group: str, i: int) -> torch.Tensor:
    """Layer ``i`` of ``group`` (the MTP layer last) gathered through the block table, as vLLM holds it."""
    names = [n for n in caches if ("indexer" in n) == (group == "indexer")]
    cache = caches[names[i]]
    if group == "indexer":
        rows = layouts.dsa_indexer_blocks_to_rows(cache[BLOCK_TABLE], PROMPT, cache.shape[1] // BLOCK - 4)
        return rows
    flat = cache.reshape(-1, cache.shape[-1])
    return flat[_slots()].view(torch.uint8).reshape(PROMPT, -1)
