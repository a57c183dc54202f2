"""The connector's view of vLLM's caches (shapes as vLLM allocates them) must be exactly what the engine
takes: same layout descriptors, and rows gathered through the block table equal to the tokens' rows."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tilert import contracts as p
from tilert.connector.claims import SaveRequest
from tilert.connector.gather import Group, KVCopier, RequestRows, geometry, row_index, take_rows
from tilert.connector.sender import BackgroundSender
from tilert.connector.worker import WorkerSide
from tilert.contracts import Claim
from tilert.decode.slots import SlotTable
from tilert.engines.tilert import layouts
from tilert.engines.tilert.engine import TileRTEngine
from tilert.models.tiny import build_tiny_model
from tilert.transports.tcp import TcpTransport


@pytest.fixture(scope="module")
def v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("deepseek_v32", tmp_path_factory.mktemp("v32") / "m", num_hidden_layers=2)


def _vllm_gpu_caches(cfg, num_blocks: int, block: int = 64) -> dict[str, torch.Tensor]:
    """Per layer as vLLM lays them out on GPU for V3.2 (bf16 dense MLA + block-major fp8 indexer)."""
    caches = {}
    for i in range(cfg.num_hidden_layers):
        caches[f"model.layers.{i}.self_attn.attn"] = torch.zeros(num_blocks, block, 576, dtype=torch.bfloat16)
        caches[f"model.layers.{i}.self_attn.indexer.k_cache"] = torch.zeros(
            num_blocks, block * (cfg.index_head_dim + 4), dtype=torch.uint8
        )
    return caches


def test_connector_layouts_are_what_the_engine_expects(v32: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(v32)
    sender = BackgroundSender("tcp", {}, b"layouts-test-secret-0123456789ab")
    worker = WorkerSide(cfg, sender, staging_bytes=1 << 20)
    try:
        worker.register(_vllm_gpu_caches(cfg, num_blocks=4))
        engine = TileRTEngine.load(v32, device="cpu", dtype=torch.bfloat16, max_seq_len=256)
        receiver = TcpTransport.receiver(host="127.0.0.1", options={})
        try:
            table = SlotTable(1, engine.expected_layouts(), 256, receiver)
            table.reserve("t")
            offer = p.Offer("t", 100, dict(worker._layouts))
            assert table.accept(offer)["nbytes"] == offer.nbytes  # no layout mismatch, nothing refused
        finally:
            receiver.close()
    finally:
        sender.close()


def test_indexer_rows_gathered_through_the_block_table() -> None:
    head_dim, n = 32, 70
    rows = torch.randint(0, 255, (n, head_dim + 4), dtype=torch.uint8)
    blocks = layouts.dsa_indexer_rows_to_blocks(rows, head_dim)  # [2, 64*(D+4)], tokens 0..69 in order
    shuffled = torch.zeros(5, blocks.shape[1], dtype=torch.uint8)
    shuffled[3], shuffled[1] = blocks[0], blocks[1]  # the request's block table is [3, 1]
    slots = torch.tensor(SaveRequest("r", Claim("t", "h", 1, "unsigned"), [3, 1], 64, n).slot_ids())
    got = take_rows("dsa_indexer", shuffled, row_index("dsa_indexer", head_dim + 4, shuffled, slots, 64))
    assert torch.equal(got, rows)


@pytest.mark.parametrize(("blocks", "block_size", "tokens"), [([3, 1], 64, 70), ([4, 0, 2], 16, 48), ([7], 16, 1)])
def test_request_slots_are_the_slot_list(blocks: list[int], block_size: int, tokens: int) -> None:
    save = SaveRequest("r", Claim("t", "h", 1, "unsigned"), blocks, block_size, tokens)
    got = RequestRows(save.block_ids, tokens, block_size, torch.device("cpu")).slots()
    assert got.dtype == torch.long and got.tolist() == save.slot_ids()


@pytest.mark.parametrize(
    ("kind", "row_bytes", "cache"),
    [
        ("fp8_ds_mla", 656, torch.randint(0, 255, (6, 16, 656), dtype=torch.uint8)),  # vLLM GPU fp8_ds_mla
        ("mla_dense", 1152, torch.randn(6, 16, 576).to(torch.bfloat16)),  # vLLM GPU bf16
        ("mla_dense", 2304, torch.randn(6, 1, 16, 576)),  # vLLM CPU_MLA, fp32
        ("dsa_indexer", 132, torch.randint(0, 255, (6, 16, 132), dtype=torch.uint8)),  # vLLM's indexer pages
        ("dsa_indexer", 132, torch.randint(0, 255, (6, 16 * 132), dtype=torch.uint8)),  # the same, one row a block
    ],
)
def test_page_geometry_addresses_the_reference_rows(kind: str, row_bytes: int, cache: torch.Tensor) -> None:
    """The GPU copy addresses a token's row by :func:`geometry` (whole 4-byte words): read that way, through a
    shuffled block table, the bytes are the reference gather's."""
    table, tokens = [4, 0, 5], 40
    rows = RequestRows(table, tokens, 16, torch.device("cpu"))
    want = take_rows(kind, cache, row_index(kind, row_bytes, cache, rows.slots(), 16))
    geo = geometry(kind, row_bytes, cache)
    assert geo is not None and geo.words() is not None
    flat = cache.reshape(cache.shape[0], -1).view(torch.uint8).reshape(-1)
    got = []
    for t in range(tokens):
        page, offset = table[t // 16] * geo.block_stride, t % 16
        a = page + offset * geo.a_stride
        b = page + geo.b_base + offset * geo.b_stride
        got.append(torch.cat([flat[a : a + geo.a_bytes], flat[b : b + geo.b_bytes]]))
    assert torch.equal(torch.stack(got), want)


def test_the_copier_fills_the_extent_group_after_group_in_runs_of_items() -> None:
    """Items go decoder layer by decoder layer (a forward's completed layers are one run); the extent holds the groups
    one after the other, each ``[layers, T, row]``: copied in any split of runs, through a shuffled block table, every
    byte is the token's row of its layer, and the chunks tile the extent in that order."""
    layers, tokens, table = 3, 40, [4, 0, 5]
    mla = [torch.randint(0, 255, (6, 16, 656), dtype=torch.uint8) for _ in range(layers)]
    indexer = [torch.randint(0, 255, (6, 16, 132), dtype=torch.uint8) for _ in range(layers)]
    copier = KVCopier([Group("mla", "fp8_ds_mla", 656, mla), Group("indexer", "dsa_indexer", 132, indexer)])
    assert copier.items == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)] and copier.item_of["indexer", 1] == 3
    assert copier.chunk_of == [0, 3, 1, 4, 2, 5]  # the extent's order: every MLA layer, then every indexer layer
    rows = RequestRows(table, tokens, 16, torch.device("cpu"))
    extent = torch.zeros(tokens * layers * (656 + 132), dtype=torch.uint8)
    for first, count in ((0, 1), (1, 4), (5, 1)):
        copier.copy(rows, extent, first, count)
    slots = rows.slots()
    want = [take_rows("fp8_ds_mla", c, slots) for c in mla]
    want += [take_rows("dsa_indexer", c, row_index("dsa_indexer", 132, c, slots, 16)) for c in indexer]
    chunks = copier.extent_chunks(tokens)
    assert [c[0] for c in chunks] == list(itertools.accumulate([0] + [c[1] for c in chunks[:-1]]))
    for (offset, nbytes), rows_of_layer in zip(chunks, want, strict=True):
        assert torch.equal(extent[offset : offset + nbytes].view(tokens, -1), rows_of_layer)


@pytest.mark.parametrize(("table", "tokens"), [([4, 0], 40), ([4, 6, 0], 40)])
def test_a_block_table_that_does_not_fit_the_cache_is_refused_before_any_copy(table: list[int], tokens: int) -> None:
    """Too few blocks for the tokens, or a block past the cache's end: refused with the reason before anything is
    read (on a GPU the kernel would read out of bounds), so the worker aborts that transfer and nothing else."""
    copier = KVCopier([Group("mla", "fp8_ds_mla", 656, [torch.zeros(6, 16, 656, dtype=torch.uint8)])])
    extent = torch.zeros(tokens * 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="block table of"):
        copier.copy(RequestRows(table, tokens, 16, torch.device("cpu")), extent, 0, 1)


def test_pages_that_are_not_whole_rows_are_left_to_the_reference() -> None:
    assert geometry("mla_dense", 1152, torch.zeros(6, 16, 576, dtype=torch.bfloat16)[:, :, :576]) is not None
    assert geometry("fp8_ds_mla", 656, torch.zeros(6, 16, 656 * 2, dtype=torch.uint8)[:, :, ::2]) is None  # strided
    assert geometry("fp8_ds_mla", 656, torch.zeros(6, 2, 16, 656, dtype=torch.uint8)) is None  # two token axes
    odd = geometry("mla_dense", 6, torch.zeros(6, 16, 3, dtype=torch.float16))
    assert odd is not None and odd.words() is None  # 6-byte rows: not whole words


def test_dense_rows_gathered_through_the_block_table() -> None:
    cache = torch.randn(6, 1, 16, 576)  # vLLM CPU_MLA: [num_blocks, 1, 16, 576]
    save = SaveRequest("r", Claim("t", "h", 1, "unsigned"), [4, 0, 2], 16, 40)
    got = take_rows("mla_dense", cache, row_index("mla_dense", 576 * 4, cache, torch.tensor(save.slot_ids()), 16))
    flat = cache.reshape(-1, 576)
    want = torch.cat([flat[64:80], flat[0:16], flat[32:40]]).view(torch.uint8).reshape(40, -1)
    assert torch.equal(got, want)


def test_fp8_ds_mla_prefill_is_accepted_and_wrong_layouts_are_refused_with_a_reason(v32: Path) -> None:
    """vLLM's sparse-MLA cache (``--kv-cache-dtype fp8_ds_mla``: 656-byte rows) is taken by the engine;
    a layout it cannot convert is refused before any byte moves, with the engine's reason."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(v32)
    caches = _vllm_gpu_caches(cfg, num_blocks=4)
    for i in range(cfg.num_hidden_layers):
        caches[f"model.layers.{i}.self_attn.attn"] = torch.zeros(4, 64, 656, dtype=torch.uint8)
    sender = BackgroundSender("tcp", {}, b"layouts-test-secret-0123456789ab")
    worker = WorkerSide(cfg, sender, staging_bytes=1 << 20)
    engine = TileRTEngine.load(v32, device="cpu", dtype=torch.bfloat16, max_seq_len=256)
    receiver = TcpTransport.receiver(host="127.0.0.1", options={})
    try:
        worker.register(caches)
        assert worker._layouts["mla"].kind == "fp8_ds_mla"
        table = SlotTable(2, engine.expected_layouts(), 256, receiver, check_layouts=engine.check_layouts)
        table.reserve("fp8")
        table.accept(p.Offer("fp8", 100, dict(worker._layouts)))
        table.reserve("bad")
        bad = dict(worker._layouts) | {"mla": p.KVLayout("mla_dense", "float8_e5m2", 576, cfg.num_hidden_layers)}
        with pytest.raises(Exception, match="unsupported dtype"):
            table.accept(p.Offer("bad", 100, bad))
    finally:
        receiver.close()
        sender.close()
