"""Tensor parallel decoding on the CPU: two ranks on gloo against one rank, on the tiny checkpoints of
the three families (and DeepSeek-V3 with an MTP module), through the same leader / follower protocol that
``tilert decode --tp N`` runs; then ``tilert decode --tp 2`` serving a request end to end.

The two ranks run in spawned processes (rank 0 drives a :class:`~tilert.decode.tp.LeaderEngine`, rank 1 runs
:func:`~tilert.decode.tp.follow`); the one-rank reference is a plain engine in this process, fed the same calls.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
from support.ranks import run_ranks_beside
from support.stack import free_port, wait_healthy

from tilert import auth
from tilert.engines.base import DecodeEngine, KVLayout
from tilert.engines.tilert import layouts, parallel, sharding
from tilert.engines.tilert.engine import TileRTEngine
from tilert.engines.tilert.model import ModelArgs
from tilert.models.tiny import add_mtp_layer

pytestmark = pytest.mark.timeout(300)

MAX_SEQ = 96
PROMPT = 24  # prompt length of sequence 1 (injected)
PREFILL = 70  # prompt of sequence 0, run through forward (more tokens than a header carries inline)
STEPS = 6
FAMILIES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "deepseek_v3_mtp"]
SECRET = "tp-test-secret-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tilert.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tp")
    dsa = {"index_topk": 16}  # decode past index_topk: the sparse path runs
    out = {
        "deepseek_v3": build_tiny_model("deepseek_v3", root / "v3", seed=0),
        "deepseek_v32": build_tiny_model("deepseek_v32", root / "v32", seed=1, **dsa),
        "glm_moe_dsa": build_tiny_model(
            "glm_moe_dsa", root / "glm", seed=2, indexer_types=["full", "shared", "full"], **dsa
        ),
    }
    out["deepseek_v3_mtp"] = add_mtp_layer(out["deepseek_v3"], root / "v3_mtp")
    return out


def _load(path: Path) -> TileRTEngine:
    return TileRTEngine.load(path, device="cpu", dtype=torch.float32, max_seq_len=MAX_SEQ, max_sequences=2)


def _prompt_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, KVLayout], int]:
    """Sequence 1's prompt KV as vLLM hands it over (from a one-rank engine's own prefill), its first token."""
    eng = _load(path)
    a = eng.model.args
    ids = torch.randint(8, a.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    first = int(eng.forward(ids, 0)[-1].argmax())
    state = {"mla": layouts.encode_mla_dense(eng.model.kv_cache[:, :PROMPT], "float32", a.kv_lora_rank, True)}
    if a.dsa:
        state["indexer"] = layouts.encode_dsa_indexer(
            eng.model.index_cache[:, :PROMPT], a.qk_rope_head_dim, a.indexer_rope_interleave
        )
    return state, eng.expected_layouts(), first


def scenario(
    eng: DecodeEngine, vocab: int, state: dict[str, torch.Tensor], lay: dict[str, KVLayout], first: int
) -> dict[str, Any]:
    """Every call the decode node makes: a long forward, an injection, batched steps (logits and greedy), a
    refused call, speculative steps when the model has MTP. Returns the logits and tokens it saw."""
    ids = torch.randint(8, vocab, (PREFILL,), generator=torch.Generator().manual_seed(3))
    out: dict[str, Any] = {"prefill": eng.forward(ids, 0)[-5:]}
    eng.inject(state, lay, PROMPT, seq=1)
    nxt, pos = [int(out["prefill"][-1].argmax()), first], [PREFILL, PROMPT]
    steps, tokens = [], []
    for step in range(STEPS):
        if step < STEPS // 2:
            logits = eng.decode_step(nxt, pos, [0, 1])
            steps.append(logits)
            nxt = logits.argmax(-1).tolist()
        else:
            nxt = eng.decode_step_greedy(nxt, pos, [0, 1])
        tokens.append(nxt)
        pos = [p + 1 for p in pos]
    out["steps"], out["tokens"] = torch.stack(steps), tokens
    with pytest.raises(ValueError, match="outside"):
        eng.decode_step([1], [0], [5])  # refused on every rank, before any collective
    if eng.capabilities().mtp:
        spec, tok, p = [], nxt[1], pos[1]
        while len(spec) < 10:
            res = eng.speculative_greedy_step(tok, p, 2, seq=1)
            spec += res.tokens
            tok, p = res.tokens[-1], p + len(res.tokens)
        out["spec"] = spec
    out["after"] = eng.forward(torch.tensor([nxt[0]]), pos[0])  # one step on the view path after the batch
    return out


def _rank(rank: int, port: int, paths: dict[str, str], states: dict[str, Any], results: Any) -> None:
    """One of two ranks: rank 0 runs :func:`scenario` through a LeaderEngine, rank 1 follows."""
    torch.set_num_threads(1)
    from tilert.decode.tp import FollowerState, LeaderEngine, follow, load_rank

    pg, ctrl = parallel.init_process_group(rank, 2, port, "cpu")
    got = {}
    for name, path in paths.items():
        eng, channel = load_rank(Path(path), pg, ctrl, torch.device("cpu"), torch.float32, MAX_SEQ, 2)
        assert eng.model.args.num_heads == 2 and eng.model.args.tp_size == 2  # half of the 4 heads
        if rank == 0:
            leader = LeaderEngine(eng, channel)
            state, lay, first = states[name]
            got[name] = {
                k: v.tolist() if isinstance(v, torch.Tensor) else v
                for k, v in scenario(leader, eng.vocab_size, state, lay, first).items()
            }
            leader.close()
        else:
            assert follow(eng, channel) is FollowerState.STOPPED
    if rank == 0:
        results.put(got)
    torch.distributed.destroy_process_group()


def test_two_ranks_equal_one_rank(ckpts: dict[str, Path]) -> None:
    """Logits within float32 rounding of the one-rank engine's (the ranks sum partials in another order) and
    the same greedy tokens, on every family, for every call the decode node makes."""
    states = {name: _prompt_state(ckpts[name]) for name in FAMILIES}
    torch.set_num_threads(1)

    def one_rank() -> dict[str, dict[str, Any]]:
        return {name: scenario(_load(ckpts[name]), _load(ckpts[name]).vocab_size, *states[name]) for name in FAMILIES}

    paths = {name: str(ckpts[name]) for name in FAMILIES}
    got, refs = run_ranks_beside(_rank, (paths, states), one_rank, timeout_s=240)
    for name in FAMILIES:
        ref = refs[name]
        two = got[name]
        for key in ("prefill", "steps", "after"):
            want, have = ref[key], torch.tensor(two[key])
            assert have.shape == want.shape
            err = float((have - want).abs().max() / want.abs().max())
            assert err < 1e-5, (name, key, err)
        assert two["tokens"] == ref["tokens"], name
        assert two.get("spec") == ref.get("spec"), name
        assert ("spec" in ref) == name.endswith("mtp")


def _args(**over: Any) -> ModelArgs:
    base = dict(
        arch="deepseek_v3",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_layers=2,
        num_heads=4,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        mlp_layer_types=["dense", "sparse"],
        rms_norm_eps=1e-6,
        attention_bias=False,
        rope_interleave=True,
        softmax_scale=0.25,
        rope_inv_freq=[1.0] * 4,
        rope_attention_scaling=1.0,
    )
    return ModelArgs(**{**base, **over})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("size", "over", "says"),
    [
        (3, {}, "4 attention heads"),
        (2, {"n_routed_experts": 6, "num_heads": 6}, None),
        (4, {"moe_intermediate_size": 18}, "experts' width 18"),
        (4, {"intermediate_size": 50}, "dense MLP width 50"),
        (2, {"vocab_size": 63}, "vocabulary of 63"),
        (0, {}, ">= 1"),
    ],
)
def test_degree_that_does_not_divide_is_refused(size: int, over: dict[str, Any], says: str | None) -> None:
    args = _args(**over)
    if says is None:
        assert sharding.local_args(args, 1, size).num_heads == args.num_heads // size
        return
    with pytest.raises(ValueError, match=says):
        sharding.local_args(args, 0, size)


def test_decode_refuses_tp_that_does_not_divide(
    ckpts: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clear start-up error (exit 2), before any rank starts."""
    from tilert.cli import main

    monkeypatch.setenv(auth.SECRET_ENV, SECRET)
    monkeypatch.delenv(auth.SECRET_FILE_ENV, raising=False)
    argv = ["decode", "--model", str(ckpts["deepseek_v3"]), "--tp", "3", "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--tp 3" in err and "4 attention heads" in err, err
    assert main([*argv[:-4], "--tp", "2", "--tp-allreduce", "symm_one_shot", "--device", "cpu"]) == 2
    assert "needs CUDA devices" in capsys.readouterr().err


def _post(url: str, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    token = auth.node_api_token(SECRET.encode())
    return httpx.post(url + path, json=body, headers={"authorization": f"Bearer {token}"}, timeout=60, **kw)


def test_decode_tp2_serves_a_request(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """``tilert decode --tp 2`` on the CPU: reserve, the KV over the TCP transport, a streamed greedy decode
    equal to the one-rank engine's; SIGINT stops rank 0 and its follower."""
    from tilert.connector.sender import BackgroundSender, Staged
    from tilert.contracts import Claim
    from tilert.engines.tilert.engine import greedy_generate

    path = ckpts["deepseek_v3"]
    ctrl, http = free_port(), free_port()
    log = tmp_path / "decode.log"
    env = {**os.environ, auth.SECRET_ENV: SECRET, "OMP_NUM_THREADS": "1"}
    env.pop(auth.SECRET_FILE_ENV, None)
    cmd = [
        sys.executable,
        "-m",
        "tilert.cli",
        "decode",
        "--model",
        str(path),
        "--tp",
        "2",
        "--device",
        "cpu",
        "--ctrl-port",
        str(ctrl),
        "--http-port",
        str(http),
        "--max-seq-len",
        str(MAX_SEQ),
        "--max-sequences",
        "1",
        "--slots",
        "1",
    ]
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=err, stderr=err)
    sender = BackgroundSender("tcp", {}, SECRET.encode())
    try:
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, proc, 180, log)
        followers = psutil.Process(proc.pid).children(recursive=True)  # rank 1 (and spawn's resource tracker)
        assert followers
        health = httpx.get(url + "/health", timeout=10).json()
        assert not health["capabilities"]["pipelined_greedy"], health  # the leader announces each step
        state, lay, first = _prompt_state(path)
        assert _post(url, "/v1/reserve", {"transfer_id": "tp-1"}).status_code == 200
        claim = Claim.signed(SECRET.encode(), "tp-1", "127.0.0.1", ctrl)
        sender.submit(Staged.whole(claim, PROMPT, lay, state["mla"].reshape(-1).contiguous())).result(timeout=60)
        body = {
            "transfer_id": "tp-1",
            "first_token_id": first,
            "prompt_tokens": PROMPT,
            "sampling": {"max_tokens": 12, "temperature": 0, "ignore_eos": True},
        }
        resp = _post(url, "/v1/decode", body)
        assert resp.status_code == 200, resp.text
        lines = [json.loads(x) for x in resp.text.splitlines() if x.strip()]
        tokens = [t for line in lines for t in line["token_ids"]]
        assert lines[-1]["finish_reason"] == "length", lines
        ref = _load(path)
        ref.inject(state, lay, PROMPT)
        assert tokens == greedy_generate(ref, first, PROMPT, 12)
    finally:
        sender.close()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("tilert decode --tp 2 did not stop on SIGINT:\n" + log.read_text()[-3000:])
    _, alive = psutil.wait_procs(followers, timeout=20)  # rank 1 got STOP; the resource tracker sees EOF
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
def test_width_split_moe_ops(kernels: str) -> None:
    """The ops the tensor-parallel MoE uses: ``router`` is ``moe_block``'s routing; ``moe_partial`` writes
    ``residual + experts`` (or the experts alone) into an output apart from its input; two ranks' halves of every
    expert's width (``sharding.shard_state_dict``) sum to the whole block."""
    from tilert.engines.tilert import ops
    from tilert.engines.tilert.ops import cpu, reference

    k = cpu if kernels == "cpu" else ops
    g = torch.Generator().manual_seed(0)
    e, s, i, d = 8, 1, 12, 16
    h = torch.randn(1, d, generator=g)
    norm = 1 + 0.1 * torch.randn(d, generator=g)
    gate, bias = torch.randn(e, d, generator=g) / 4, 0.05 * torch.randn(e, generator=g)
    w13, w2 = torch.randn(e + s, 2 * i, d, generator=g) / 4, torch.randn(e + s, d, i, generator=g) / 4
    route = (2, 2, 1, 2.5, True)  # top_k, n_group, topk_group, scale, norm_topk
    ids, wts = k.router(h, norm, 1e-6, gate, bias, *route, s)
    whole = h.clone()
    want_ids, _ = reference.moe_block(whole, norm, 1e-6, gate, bias, *route, s, w13, w2)
    assert torch.equal(ids, want_ids)
    args = _args(
        hidden_size=d,
        moe_intermediate_size=i,
        n_routed_experts=e,
        n_shared_experts=s,
        mlp_layer_types=["sparse"],
        num_layers=1,
    )
    total = torch.zeros(1, d)
    for rank in range(2):
        local = sharding.shard_state_dict({"l.mlp.w13": w13, "l.mlp.w2": w2}, args, rank, 2)
        out = torch.full_like(h, float("nan"))
        k.moe_partial(out, h, norm, 1e-6, ids, wts, local["l.mlp.w13"], local["l.mlp.w2"], h if rank == 0 else None)
        total += out
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_symmetric_memory_partials_alternate_halves() -> None:
    """The symmetric-memory path's bookkeeping (no GPU here: the buffer is a plain tensor and the reduction a
    stand-in): each rank's share goes to a buffer apart from h, rank 0's on top of h (the base), consecutive
    partials use different halves (a slower peer may still read the previous one), the reduction lands in h, and
    what does not fit goes to NCCL (in h itself)."""
    calls: list[tuple[int, int]] = []

    class Fake(parallel.Group):
        def _reduce_symm(self, buf: torch.Tensor, out: torch.Tensor) -> None:
            calls.append((buf.data_ptr(), out.data_ptr()))
            out.copy_(buf * 2)

    for rank in (0, 1):
        g = object.__new__(Fake)
        g.rank, g.size, g.kind, g._turn = rank, 2, "symm_one_shot", 0
        g._symm = torch.zeros(2 * 8)
        h = torch.arange(1.0, 5.0).view(1, 4)
        first, base = g.partial(h)
        assert first.data_ptr() != h.data_ptr() and first.shape == h.shape
        assert base is (h if rank == 0 else None)
        share = torch.ones_like(h)
        first.copy_(share if base is None else base + share)  # what the kernel writes
        g.reduce_into(h, first)
        assert torch.equal(h, 2 * (torch.arange(1.0, 5.0).view(1, 4) * (rank == 0) + 1))
        assert calls[-1][1] == h.data_ptr()
        second, _ = g.partial(h)
        assert second.data_ptr() != first.data_ptr()  # the other half
        assert g.partial(h)[0].data_ptr() == first.data_ptr()
        big = torch.zeros(1, 9)
        assert g.partial(big)[0] is big  # larger than a half: NCCL reduces it in place
