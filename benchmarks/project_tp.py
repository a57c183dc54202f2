"""Projected per-user decode speed of full-size DeepSeek-V3.2 and GLM-5 at tensor parallel degree N, from a
measured rank step and a measured (or given) all-reduce latency. Every row it writes is marked ``projected``.

    python3 benchmarks/project_tp.py --rank-json benchmarks/results/h200-decode-tp8-rank.json \
        --allreduce-json benchmarks/results/h200x2-tp2.json
    python3 benchmarks/project_tp.py --rank-json RANK.json --allreduce-us 8.5 --allgather-us 12 --out DIR

Inputs:

- ``--rank-json``: ``decode_speed.py --configs v32-tp8-rank,glm5-tp8-rank`` output: per (config, context) the
  captured step of one rank's share of the model, without collectives (``ms_per_step``), and at the first context
  the rank's speculative step (``mtp_verify``: MTP catch-up + ``K`` chained drafts + verify of ``K+1`` tokens, one
  graph) for ``K = 1, 2, 3``.
- the collectives: ``--allreduce-json`` (``tp_decode.py``'s ``collectives`` rows: the all-reduce of one token's
  hidden state of the width given, ``--kind``; the logits all-gather) or ``--allreduce-us`` / ``--allgather-us``.

The model (one user, batch 1; ``L`` layers; ``a`` = all-reduce latency of one token's hidden state, ``g`` = the
logits all-gather's):

- a plain step (MTP off): ``t = t_rank(ctx) + 2 L a + g``: the rank's step, plus two all-reduces per layer (after
  attention's ``W_o``, after the MoE / MLP) and one all-gather of the logits, none overlapped with compute.
  ``tok/s = 1 / t``.
- a speculative step with ``K`` drafts: ``t = t_spec(K, ctx) + (2 L + 2 (K + 1)) a + (K + 2) g``: the verify
  pass of the main model (two all-reduces per layer; its ``K+1`` rows in each), ``K + 1`` passes of the MTP layer
  (the catch-up row and ``K`` drafts; two all-reduces each), an all-gather of logits per MTP pass and for the verify.
  ``t_spec`` is measured at the first context; at a longer one it grows as the plain step does:
  ``t_spec(K, ctx) = t_spec(K, ctx0) + t_rank(ctx) - t_rank(ctx0)`` (the verify reads the cache once more per
  context length, as a plain step does). ``tok/s = A / t`` at mean accepted length ``A`` (tokens a step yields,
  the bonus token included), with the smallest ``K`` that can yield ``A`` (``K = A - 1``, at least 1).
- an all-reduce of ``K+1`` rows costs what one row's does (latency-bound at these sizes).

Writes ``benchmarks/results/<machine>-project-tp<N>.json`` (the machine the rank step was measured on, e.g.
``h200-project-tp8``; ``--out DIR`` or ``--out FILE.json`` elsewhere), starting with ``results_header``'s
``"recorded"`` (date, commit, machine, command). Rows: ``config``, ``context``, ``weights``, ``mtp`` (``off`` or
the drafts ``K``), ``accepted_len``, ``ms_per_step``, ``tok_s``, ``collective_ms``, ``rank_ms``,
``projected: true``, and the inputs they came from.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from results_header import machine_of_gpu, recorded, result_path, write_json

# rank config -> transformers config class of the full-size model (its layers and hidden width)
MODELS = {"v32-tp8-rank": "DeepseekV32Config", "glm5-tp8-rank": "GlmMoeDsaConfig"}
ACCEPTED = (1.0, 2.0, 3.0, 4.0)


def dims_of(config: str) -> tuple[int, int]:
    """``(decoder layers, hidden width)`` of the full-size model."""
    import transformers

    cfg = getattr(transformers, MODELS[config])()
    return int(cfg.num_hidden_layers), int(cfg.hidden_size)


def collectives_from(path: str, kind: str, width: int) -> tuple[float, float]:
    """``(all-reduce us, all-gather us)`` from ``tp_decode.py``'s JSON: the ``kind`` all-reduce of the given width
    (the closest width recorded), the logits all-gather."""
    with open(path) as f:
        rows = json.load(f)["collectives"]
    ar = [r for r in rows if r.get("op") == "all_reduce" and r.get("kind") == kind and "us" in r]
    if not ar:
        raise ValueError(f"{path}: no {kind} all-reduce measured")
    a = min(ar, key=lambda r: abs(r["width"] - width))["us"]
    ag = [r["us"] for r in rows if r.get("op") == "all_gather" and "us" in r]
    if not ag:
        raise ValueError(f"{path}: no logits all-gather measured")
    return float(a), float(ag[0])


def project(rank: dict[str, Any], collectives: Callable[[int], tuple[float, float]]) -> list[dict[str, Any]]:
    """The projected rows (module docstring) from decode_speed.py's JSON ``rank``; ``collectives(hidden)`` gives
    ``(all-reduce us, all-gather us)`` for a model of that hidden width."""
    out: list[dict[str, Any]] = []
    for config in MODELS:
        runs = sorted((r for r in rank.get("runs", []) if r.get("config") == config), key=lambda r: r["context"])
        if not runs:
            continue
        n_layers, hidden = dims_of(config)
        allreduce_us, allgather_us = collectives(hidden)
        a, g = allreduce_us / 1e3, allgather_us / 1e3
        spec = rank.get("mtp_verify", {}).get(config)
        ctx0 = runs[0]["context"]
        for r in runs:
            t_rank = r["ms_per_step"]
            base = dict(
                config=config.replace("-rank", ""),
                context=r["context"],
                weights=r["weights"],
                projected=True,
                rank_config=config,
                allreduce_us=allreduce_us,
                allgather_us=allgather_us,
                layers=n_layers,
            )
            coll = 2 * n_layers * a + g
            out.append(
                dict(
                    base,
                    mtp="off",
                    accepted_len=1.0,
                    rank_ms=t_rank,
                    collective_ms=coll,
                    ms_per_step=t_rank + coll,
                    tok_s=1e3 / (t_rank + coll),
                )
            )
            if not spec:
                continue
            for acc in ACCEPTED:
                k = max(1, int(acc) - 1)
                step = spec["steps"].get(str(k)) or spec["steps"].get(k)
                if step is None:
                    continue
                t_spec = step["graph_ms"] + t_rank - next(x["ms_per_step"] for x in runs if x["context"] == ctx0)
                coll = (2 * n_layers + 2 * (k + 1)) * a + (k + 2) * g
                out.append(
                    dict(
                        base,
                        mtp=k,
                        accepted_len=acc,
                        rank_ms=t_spec,
                        collective_ms=coll,
                        ms_per_step=t_spec + coll,
                        tok_s=acc * 1e3 / (t_spec + coll),
                    )
                )
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank-json", required=True, help="decode_speed.py's JSON with the rank configs")
    ap.add_argument("--allreduce-json", default="", help="tp_decode.py's JSON with its collectives rows")
    ap.add_argument("--kind", default="symm_one_shot", help="which all-reduce of --allreduce-json (nccl, symm_*)")
    ap.add_argument("--allreduce-us", type=float, default=None, help="the all-reduce latency, when not measured")
    ap.add_argument("--allgather-us", type=float, default=None, help="the logits all-gather latency")
    ap.add_argument("--out", default=None, help="a directory (or FILE.json) for the JSON (default: the current result)")
    opts = ap.parse_args(argv)
    with open(opts.rank_json) as f:
        rank = json.load(f)
    coll: Callable[[int], tuple[float, float]]
    if opts.allreduce_json:
        path, kind = opts.allreduce_json, opts.kind

        def coll(hidden: int) -> tuple[float, float]:
            return collectives_from(path, kind, hidden)

        source = f"{opts.allreduce_json} ({opts.kind})"
    elif opts.allreduce_us is not None:
        given = (opts.allreduce_us, opts.allgather_us if opts.allgather_us is not None else opts.allreduce_us)

        def coll(hidden: int) -> tuple[float, float]:
            return given

        source = "given on the command line"
    else:
        ap.error("give --allreduce-json or --allreduce-us")
    rows = project(rank, coll)
    if not rows:
        ap.error(f"{opts.rank_json} has no rows of {', '.join(MODELS)}")
    doc = dict(
        conditions="projected from a measured rank step without collectives plus the collectives' latency "
        "(model in benchmarks/project_tp.py's docstring)",
        rank_json=opts.rank_json,
        collectives=source,
        gpu=rank.get("gpu"),
        rows=rows,
    )
    machine = rank.get("recorded", {}).get("machine") or machine_of_gpu(rank.get("gpu"))
    tp = next((r["tp"] for r in rank.get("runs", []) if r.get("tp")), 8)
    path = result_path(machine, f"project-tp{tp}", ".json", opts.out)
    write_json(path, doc, recorded(machine, argv=["project_tp.py", *(argv if argv is not None else sys.argv[1:])]))
    print(f"{'config':<9} {'ctx':>6} {'MTP':>4} {'A':>4} {'rank ms':>8} {'coll ms':>8} {'ms/step':>8} {'tok/s':>7}")
    for r in rows:
        print(
            f"{r['config']:<9} {r['context']:>6} {r['mtp']!s:>4} {r['accepted_len']:>4.1f} {r['rank_ms']:>8.3f} "
            f"{r['collective_ms']:>8.3f} {r['ms_per_step']:>8.3f} {r['tok_s']:>7.1f}  (projected)"
        )
    return rows


if __name__ == "__main__":
    main()
