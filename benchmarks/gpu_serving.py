"""Per-user speed through the whole serving path (router + decode node + KV transfer) against the engine's own.

    python benchmarks/gpu_serving.py --model DIR [--device cuda|cpu] [--users 1,2,4,8] [--tokens 256]
                                     [--prompt-len 1024] [--api completions|chat] [--transport tcp] [--out DIR]
    python benchmarks/gpu_serving.py --smoke --device cpu          # a tiny DSA model built on the spot, users 1,2
    python benchmarks/gpu_serving.py --synthetic lite-v32 --tokenizer DIR [--synthetic-dir DIR] ...

``--synthetic NAME`` (``engine_configs.SYNTHETIC``: ``lite-v32``, ``tiny-v32`` for the CPU) serves a synthetic
block-FP8 checkpoint of that configuration with its MTP layer, written in DeepSeek's HF format on the spot and
converted by ``tilert convert`` (:mod:`servelib.synthetic`), kept in ``--synthetic-dir`` when given (a later run can
then pass its ``converted/`` as ``--model``).

Everything after the prefill is the product: the real decode node (``tilert decode --device ...``) and the real
router (``tilert router``), started as ``tilert up`` starts them, on loopback, with one shared secret. The prefill is
a stand-in (stock vLLM does not run on the GPU machine) that plays vLLM's part exactly where it touches the product
(:mod:`servelib.standin`): it answers the router's prefill leg as vLLM's OpenAI server does, prefills with the TileRT
engine (``TileRTEngine.load(...).forward(prompt_ids, 0)``), writes the prompt's KV into paged caches in vLLM's
layouts for the device (:mod:`servelib.paged`: on the CPU vLLM's CPU MLA latent; on CUDA ``fp8_ds_mla`` pages and
the DSA indexer's pages for a DSA model) and hands them to the real ``TileRTConnector`` halves as vLLM calls them
(:mod:`servelib.prefill_side`): the claim comes signed from the router, the KV goes over the node's transport.

Clients: the OpenAI SDK's ``AsyncOpenAI``, ``--users`` streams at once, each greedy (``ignore_eos``) for ``--tokens``
tokens after a ``--prompt-len``-token prompt (token ids for ``completions``; for ``chat`` their text as one message,
which the stand-in tokenizes through the chat template). Per number of users, one row: the client's per-user tok/s
(1000 / TPOT), the engine's own per-user speed on the node's path for that many sequences, measured in the same run
on the same checkpoint in the stand-in's process, on the node's device unless ``--prefill-device`` names another
(:mod:`servelib.reference`: ``greedy_stream`` alone, MTP speculative steps when the node drafts,
``greedy_batch_stream`` over several), their ratio, TTFT (and what it adds to
the stand-in's own time answering that prefill), TPOT, ITL p50 / p99 (between chunks carrying tokens), and
``same_tokens``: every stream equals the engine's own greedy tokens for its prompt (from the prompt's KV as the
prefill's cache holds it; ``same_as_engine_prefill``: as the engine's own prefill cache holds it).

Writes ``<machine>-serving.json`` under ``benchmarks/results/`` (``--out``: elsewhere) and prints one table; the
parts' logs stay in the directory printed first. The work is in ``benchmarks/servelib/``, one module per concern.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import httpx  # noqa: E402
import torch  # noqa: E402
from e2elib.procs import supervised  # noqa: E402
from engine_configs import SYNTHETIC  # noqa: E402
from results_header import machine_kind, recorded, result_path, write_json  # noqa: E402
from servelib import clients, parts, report  # noqa: E402
from servelib.paged import default_kind  # noqa: E402

from tilert import stack  # noqa: E402
from tilert.contracts import ConnectorSettings  # noqa: E402
from tilert.models.checkpoint import read_json  # noqa: E402

DEFAULTS = {"users": [1, 2, 4, 8], "tokens": 256, "prompt_len": 1024, "rounds": 1, "ttft_pairs": 20}
# what --smoke changes, unless given; its prompt passes the tiny DSA model's index_topk (64): the node's decode
# steps then select rows with the handed-off indexer keys
SMOKE = {"users": [1, 2], "tokens": 8, "prompt_len": 72, "rounds": 1, "ttft_pairs": 3}


def _ints(text: str) -> list[int]:
    return sorted({int(x) for x in text.split(",") if x.strip()})


def _node_configs(text: str) -> list[tuple[int, bool, str, int | None]]:
    """``"0,3all,3all+fp8,3all+fp8+v32768"`` -> ``[(0, False, "model", None), (3, True, "model", None), (3, True,
    "fp8", None), (3, True, "fp8", 32768)]`` (drafts, every draft accepted, the drafts' head, the first token ids
    they may propose)."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        node, *extra = item.split("+")
        count = node.removesuffix("all")
        vocab = [int(e[1:]) for e in extra if e[:1] == "v" and e[1:].isdigit() and int(e[1:]) > 0]
        ok = count.isdigit() and not (node.endswith("all") and int(count) == 0)
        ok = ok and len(vocab) + extra.count("fp8") == len(extra) and len(vocab) <= 1 and extra.count("fp8") <= 1
        if not ok or (extra and int(count) == 0):
            raise argparse.ArgumentTypeError(
                f"{item!r}: a number of drafts, or 'Nall' with N > 0, then optionally '+fp8' and '+vM'"
            )
        out.append(
            (int(count), node.endswith("all"), "fp8" if "fp8" in extra else "model", vocab[0] if vocab else None)
        )
    return out


def node_label(drafts: int | None, accept_all: bool, draft_head: str = "model", draft_vocab: int | None = None) -> str:
    if drafts is None:
        return "default"
    if not drafts:
        return "MTP off"
    head = ", FP8 draft head" if draft_head == "fp8" else ""
    head += f", drafts among the first {draft_vocab} tokens" if draft_vocab else ""
    return f"MTP {drafts}" + (" all accepted" if accept_all else "") + head


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="checkpoint directory (--smoke without it: a tiny deepseek_v32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda, cuda:N")
    ap.add_argument(
        "--prefill-device",
        default=None,
        help="the stand-in's (and the engine reference's) device, e.g. cuda:1 beside a node on cuda:0 (default: "
        "--device; on one GPU the prefills of users joining share it with the decodes running)",
    )
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: float32 on the CPU, else bfloat16)")
    ap.add_argument(
        "--kv-layout",
        choices=["auto", "dense", "fp8_ds_mla"],
        default="auto",
        help="the prefill's MLA cache (auto: fp8_ds_mla for a DSA model on CUDA, else the dense latent; "
        "fp8_ds_mla on the CPU runs vLLM's CUDA layout through the same path)",
    )
    ap.add_argument("--transport", default="tcp", help="the KV transport (the node's --transport)")
    ap.add_argument("--transport-options", type=json.loads, default={}, help="the connector's, as JSON")
    ap.add_argument("--users", type=_ints, help="concurrent users, one row each (default 1,2,4,8)")
    ap.add_argument("--tokens", type=int, help="tokens each user streams, max_tokens (default 256)")
    ap.add_argument("--prompt-len", type=int, help="prompt tokens per user (default 1024)")
    ap.add_argument("--api", choices=["completions", "chat"], default="completions")
    ap.add_argument("--rounds", type=int, help="runs of every row, pooled (default 1)")
    ap.add_argument(
        "--drafts",
        type=_node_configs,
        default=None,
        help="the node's --num-speculative-tokens, one node per item, e.g. 0,1,3all: the first at every --users, the "
        "others (MTP serves a sequence alone) at one user; 'Nall': N drafts and --accept-all-drafts (benchmarks "
        "only: the serving path at full acceptance); '+fp8' after either: the node's --draft-head fp8; '+vM': its "
        "--draft-vocab of token ids 0..M-1. Default: the node's own",
    )
    ap.add_argument(
        "--ttft-pairs",
        type=int,
        help="time to first token: this many requests of one user through the router, each followed by the same "
        "request sent to the prefill stand-in directly (as to vLLM alone), on the first node (0: none; default 20)",
    )
    ap.add_argument("--no-warmup", action="store_true", help="no untimed run of each row first")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    ap.add_argument("--startup-timeout-s", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None, help="a directory or FILE.json (default: benchmarks/results/)")
    ap.add_argument("--smoke", action="store_true", help=f"a quick run: {SMOKE} unless given otherwise")
    ap.add_argument(
        "--synthetic",
        choices=sorted(SYNTHETIC),
        help="serve a synthetic block-FP8 checkpoint of this configuration, written and converted first",
    )
    ap.add_argument(
        "--tokenizer",
        type=Path,
        help="with --synthetic: the tokenizer directory copied into the checkpoint (default: one trained here; "
        "for lite-v32 that takes minutes)",
    )
    ap.add_argument(
        "--synthetic-dir",
        type=Path,
        help="with --synthetic: where the checkpoint (hf/) and its conversion (converted/) are written and kept "
        "(default: a temporary directory, removed at the end)",
    )
    ap.add_argument("--serve-standin", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-sequences", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.ttft_pairs < 0:
        ap.error("--ttft-pairs >= 0")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.prefill_device = args.prefill_device or args.device
    if args.tokens < 2 or args.prompt_len < 1 or not args.users or not 1 <= min(args.users) <= max(args.users) <= 64:
        ap.error("--tokens >= 2, --prompt-len >= 1 and --users in 1..64 (the node's --max-sequences)")
    if args.model is None and not args.smoke and not args.synthetic and args.serve_standin is None:
        ap.error("--model DIR is required (or --smoke, or --synthetic NAME)")
    if args.synthetic and args.model is not None:
        ap.error("--synthetic writes its own checkpoint: no --model")
    if not args.synthetic and (args.tokenizer is not None or args.synthetic_dir is not None):
        ap.error("--tokenizer and --synthetic-dir go with --synthetic")
    if args.synthetic_dir is not None and args.synthetic_dir.exists() and any(args.synthetic_dir.iterdir()):
        ap.error(f"--synthetic-dir {args.synthetic_dir} is not empty (its converted/ can be served with --model)")
    return args


def serve_standin(args: argparse.Namespace) -> None:
    from servelib.standin import StandinSpec, serve

    settings = ConnectorSettings.from_extra(
        {"tilert_transport": args.transport, "tilert_transport_options": args.transport_options}
    )
    spec = StandinSpec(
        args.model,
        str(args.model),
        args.device,
        args.dtype,
        args.kv_layout,
        args.max_model_len,
        args.max_sequences,
        settings,
    )
    serve(spec, args.serve_standin)


def prompts(model: Path, count: int, length: int, seed: int) -> tuple[list[list[int]], list[str]]:
    """``count`` prompts of ``length`` token ids (no special token), seeded, and their text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    vocab = min(tok.get_vocab_size(), int(read_json(model / "config.json").get("vocab_size") or 1 << 30))
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    ids = [allowed[torch.randint(len(allowed), (length,), generator=gen)].tolist() for _ in range(count)]
    return ids, [tok.decode(p) for p in ids]


def measure(
    args: argparse.Namespace,
    urls: dict[str, str],
    model: Path,
    lay: parts.Layout,
    users: list[int],
    users_at: clients.Clients,
    bodies: list[dict[str, Any]],
) -> dict[str, Any]:
    """The reference, then every row's streams (after an untimed run of it), for the node ``lay`` starts; user
    ``u`` sends ``bodies[u]``."""
    n = len(bodies)
    drafts = 1 if lay.drafts is None else lay.drafts  # the node's default (it drafts only with an MTP layer)
    ask = {
        "requests": [{"route": args.api, "body": b} for b in bodies],
        "tokens": args.tokens,
        "users": users,
        "drafts": drafts,
        "accept_all": lay.accept_all_drafts,
        "draft_head": lay.draft_head,
        "draft_vocab": lay.draft_vocab,
    }
    t0 = time.monotonic()
    reference = httpx.post(urls["standin"] + "/bench/reference", json=ask, timeout=None).raise_for_status().json()
    print(f"  engine reference: {time.monotonic() - t0:.0f} s", flush=True)
    streams: dict[int, list[clients.Stream]] = {k: [] for k in users}
    if not args.no_warmup:  # every client process streams once (its first request builds the SDK's parsers)
        users_at.run_users(urls["router"], args.api, str(model), bodies, min(args.tokens, 16), n, "warm-all")
    for r in range(args.rounds):
        for k in users:
            if r == 0 and not args.no_warmup:
                tokens = min(args.tokens, 16)
                users_at.run_users(urls["router"], args.api, str(model), bodies, tokens, k, f"warm-k{k}")
            got = users_at.run_users(urls["router"], args.api, str(model), bodies, args.tokens, k, f"r{r}-k{k}")
            streams[k] += got
    timings = httpx.get(urls["standin"] + "/bench/timings", timeout=30).raise_for_status().json()
    label = node_label(lay.drafts, lay.accept_all_drafts, lay.draft_head, lay.draft_vocab)
    spec = node_spec(urls["decode"])  # every stream of this node's life, warm-ups included
    rows = [{"node": label, **report.row(k, streams[k], reference, timings), **spec} for k in users]
    return {"rows": rows, "reference": reference, "streams": streams, "timings": timings}


def measure_ttft(
    args: argparse.Namespace, urls: dict[str, str], model: Path, users_at: clients.Clients, body: dict[str, Any]
) -> dict[str, Any]:
    """One user's time to first token through the router (two tokens streamed) and calling the stand-in directly
    (its one token streamed), request by request in turns, the same prompt (a prefix-cache hit in both)."""
    routed: list[clients.Stream] = []
    direct: list[clients.Stream] = []
    legs: dict[str, tuple[float, float]] = {}
    for i in range(args.ttft_pairs + 1):  # the first pair untimed
        got_r = users_at.run_users(urls["router"], args.api, str(model), [body], 2, 1, f"ttft{i}-router")
        got_d = users_at.run_users(urls["standin"], args.api, str(model), [body], 1, 1, f"ttft{i}-direct")
        if i:
            routed += got_r
            direct += got_d
        else:
            legs = router_legs(urls["router"])
    timings = httpx.get(urls["standin"] + "/bench/timings", timeout=30).raise_for_status().json()
    return report.ttft(routed, direct, timings, report.router_own_ms(legs, router_legs(urls["router"])))


def router_legs(router: str) -> dict[str, tuple[float, float]]:
    """The router's own histograms of a request's first token and its prefill call (``report.ROUTER_LEGS``): each
    one's (sum of seconds, count) over every label."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(router + "/metrics", timeout=30).raise_for_status().text
    sums = {name: [0.0, 0.0] for name in report.ROUTER_LEGS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, _, part = sample.name.rpartition("_")
            if name in sums and part in ("sum", "count"):
                sums[name][part == "count"] += sample.value
    return {name: (v[0], v[1]) for name, v in sums.items()}


def node_spec(node: str) -> dict[str, Any]:
    """The decode node's own speculative counts (its ``tilert:spec_decode_*`` counters), as ``node_spec_*`` fields
    (``node_spec_accepted_per_pos``: by draft position)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(node + "/metrics", timeout=30).raise_for_status().text
    out: dict[str, Any] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for part in ("drafts", "draft_tokens", "accepted_tokens"):
                if sample.name == f"tilert:spec_decode_num_{part}_total":
                    out[f"node_spec_{part}"] = sample.value
            if sample.name == "tilert:spec_decode_num_accepted_tokens_per_pos_total":
                per_pos[int(sample.labels["position"])] = sample.value
    out["node_spec_accepted_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def _smoke_model() -> Path:
    from tilert.models.tiny import build_tiny_model

    return build_tiny_model("deepseek_v32", Path(tempfile.mkdtemp(prefix="gpu-serving-model-")) / "tiny-v32")


def _gpus(args: argparse.Namespace) -> int:
    """GPUs the run holds: the node's, and the stand-in's when it is another one."""
    cuda = {d if ":" in d else d + ":0" for d in (args.device, args.prefill_device) if d.startswith("cuda")}
    return max(1, len(cuda))


def run(args: argparse.Namespace, model: Path, synthetic: dict[str, Any] | None = None) -> int:
    config = read_json(model / "config.json")
    dsa = bool(config.get("index_topk"))
    kind = default_kind(args.prefill_device, dsa) if args.kv_layout == "auto" else args.kv_layout
    slack = 64 + (args.prompt_len if args.api == "chat" else 0)  # the chat template's tokens, a re-tokenized text
    lay = parts.Layout(
        model,
        args.device,
        args.prefill_device,
        args.dtype,
        kind,
        args.transport,
        args.transport_options,
        args.prompt_len + args.tokens + slack,
        max(args.users),
        None,
    )
    nodes = [
        replace(lay, drafts=d, accept_all_drafts=a, draft_head=h, draft_vocab=v)
        for d, a, h, v in (args.drafts or [(None, False, "model", None)])
    ]
    log_dir = Path(tempfile.mkdtemp(prefix="gpu-serving-logs-"))
    print(
        f"logs: {log_dir}\nmodel: {model} ({config.get('model_type')}), node on {args.device}, prefill stand-in on "
        f"{args.prefill_device}, {args.dtype}, prefill cache {kind}, transport {args.transport}",
        flush=True,
    )
    secret_file = stack.write_secret_file()
    script = Path(__file__).resolve()
    results = []
    ttft: dict[str, Any] | None = None
    ids, texts = prompts(model, max(args.users), args.prompt_len, args.seed)
    bodies = [clients.request_body(args.api, i, text) for i, text in zip(ids, texts, strict=True)]
    users_at = clients.Clients(max(args.users))
    try:
        with supervised(log_dir) as procs:
            cfg, urls = parts.start(procs, nodes[0], script, secret_file, args.startup_timeout_s)
            for i, node in enumerate(nodes):
                if i:
                    label = node_label(node.drafts, node.accept_all_drafts, node.draft_head, node.draft_vocab)
                    print(f"node: {label}", flush=True)
                    parts.restart_node(procs, node, cfg, script, secret_file, args.startup_timeout_s)
                users = args.users if i == 0 else [1]
                results.append(measure(args, urls, model, node, users, users_at, bodies))
                if i == 0 and args.ttft_pairs:
                    ttft = measure_ttft(args, urls, model, users_at, bodies[0])
                procs.check()
    finally:
        users_at.close()
        shutil.rmtree(secret_file.parent, ignore_errors=True)
    rows = [r for result in results for r in result["rows"]]
    print("\n" + report.table(rows) + "\n", flush=True)
    if ttft is not None:
        print(report.ttft_table(ttft) + "\n", flush=True)
    for r in rows:
        if r["errors"]:
            print(f"users {r['users']}: {r['errors']} failed streams, e.g. {r['error_samples']}", flush=True)
    conditions = {
        "model": str(model),
        "model_type": config.get("model_type"),
        "device": args.device,
        "prefill_device": args.prefill_device,
        "dtype": args.dtype,
        "prefill_kv_layout": kind,
        "transport": args.transport,
        "api": args.api,
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "users": args.users,
        "rounds": args.rounds,
        "engine_mtp": results[0]["reference"]["mtp"],
        "commands": parts.commands(nodes[0], cfg, script),
        "decode_commands": [parts.commands(node, cfg, script)["decode"] for node in nodes],
        "logs": str(log_dir),
    }
    if synthetic is not None:
        conditions["synthetic"] = synthetic
    streams = {
        f"{node_label(node.drafts, node.accept_all_drafts, node.draft_head, node.draft_vocab)}, {k}": [
            s.summary() for s in v
        ]
        for node, result in zip(nodes, results, strict=True)
        for k, v in result["streams"].items()
    }
    machine = machine_kind(_gpus(args), args.device)
    path = result_path(machine, "serving", ".json", args.out)
    rec = recorded(machine, script="gpu_serving.py")
    body = {"conditions": conditions, "rows": rows, "ttft": ttft, "streams": streams}
    print(f"written: {write_json(path, body, rec)}")
    same = all(r["same_tokens"] for r in rows)
    print("The same tokens as the engine's own greedy on every stream." if same else "TOKENS DIFFER (see same_tokens)")
    failed = any(r["errors"] for r in rows) or (ttft is not None and ttft["errors"])
    return 0 if same and not failed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.serve_standin is not None:
        serve_standin(args)
        return 0
    if args.synthetic:
        from servelib import synthetic

        root = args.synthetic_dir or Path(tempfile.mkdtemp(prefix="gpu-serving-synthetic-"))
        try:
            model, facts = synthetic.build(args.synthetic, root, args.tokenizer, args.device)
            return run(args, model.resolve(), facts)
        finally:
            if args.synthetic_dir is None:
                shutil.rmtree(root, ignore_errors=True)
    built = None if args.model else _smoke_model()
    try:
        return run(args, (args.model or built).resolve())
    finally:
        if built is not None:
            shutil.rmtree(built.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
