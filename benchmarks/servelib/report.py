"""One row per number of users, from the client's streams, the stand-in's timings and the engine's reference;
the printed table."""

from __future__ import annotations

from typing import Any

from servelib.clients import Stream, med, pct, steady_tok_s


def _added_ms(s: Stream, t: dict[str, float]) -> float:
    """What the serving path adds to a first token over the prefill server's own work: the client's TTFT less the
    stand-in's time answering the prefill, plus the connector's own calls inside that time (its scheduler and
    worker hooks, which run in vLLM's step: the transfer's part of the prefill)."""
    return 1000 * s.ttft_s - t["handler_ms"] + t.get("connector_ms", 0.0)


def row(users: int, streams: list[Stream], reference: dict[str, Any], timings: dict[str, dict[str, float]]) -> dict:
    """``client_tok_s``: the median user's tokens after the first over the time from the first token to the last
    (1000 / TPOT); ``client_steady_tok_s``: the median user's tok/s while every stream decodes (after the last
    prefill and transfer: on one GPU the stand-in's prefills of users joining share it with the decodes running);
    ``engine_tok_s``: the engine's own per-user speed on the node's path for that many sequences;
    ``ttft_added_ms``: :func:`_added_ms`; ``same_tokens``: every stream equals the engine's greedy tokens
    from the prompt's KV as the prefill's cache holds it (with MTP: the engine's tokens on that path, every draft
    accepted or not); ``engine_spec_same_as_stream``: MTP's tokens are the plain stream's;
    ``engine_tokens_per_step``: with MTP, the engine's tokens per speculative step (its accepted length);
    ``same_as_engine_prefill``: ... from the engine's own
    prefill cache (may differ where the cache quantises: ``fp8_ds_mla``, the DSA indexer's fp8 keys);
    ``kv_latent_max_err`` / ``kv_indexer_max_err``: the largest difference between the users' prompt KV as handed
    off (decoded back by the engine) and the engine's own (0 for the dense latent)."""
    ok = [s for s in streams if s.error is None]
    errors = [s.error for s in streams if s.error is not None]
    prompts = reference["prompts"]
    speed = reference["speed"][str(users)]
    per_user = [(len(s.token_ids) - 1) / s.decode_s for s in ok if s.decode_s > 0]
    tpot = [1000 * s.decode_s / (len(s.token_ids) - 1) for s in ok if len(s.token_ids) > 1]
    gaps = [1000 * g for s in ok for g in s.gaps_s()]
    mine = [timings[s.request_id] for s in ok if s.request_id in timings]
    added = [_added_ms(s, timings[s.request_id]) for s in ok if s.request_id in timings]
    client = med(per_user)
    rounds: dict[str, list[Stream]] = {}  # the streams of one run of the row (request ids "{tag}-u{user}")
    for s in ok:
        rounds.setdefault(s.request_id.rsplit("-u", 1)[0], []).append(s)
    steady = med([x for g in rounds.values() if len(g) == users and (x := steady_tok_s(g)) is not None])
    engine = float(speed["tok_s"])
    want = [prompts[u]["handed"] for u in range(users)]
    if "tokens" in speed:  # MTP: the engine's tokens on that path
        want[0] = speed["tokens"]
    chunks = sum(len(s.arrivals) for s in ok)
    return {
        "users": users,
        "requests": len(streams),
        "errors": len(errors),
        "error_samples": errors[:3],
        "client_tok_s": client,
        "engine_tok_s": engine,
        "client_over_engine": client / engine if client else None,
        "client_steady_tok_s": steady,
        "steady_over_engine": steady / engine if steady else None,
        "engine_path": speed["path"],
        "engine_greedy_stream_tok_s": speed.get("stream_tok_s"),
        "engine_batch_same": speed.get("batch_same"),
        "ttft_ms": med([1000 * s.ttft_s for s in ok]),
        "ttft_p99_ms": pct([1000 * s.ttft_s for s in ok], 99),
        "standin_prefill_ms": med([t["prefill_ms"] for t in mine]),
        "standin_queue_ms": med([t["queue_ms"] for t in mine]),
        "ttft_added_ms": med(added),
        "tpot_ms": med(tpot),
        "itl_p50_ms": pct(gaps, 50),
        "itl_p99_ms": pct(gaps, 99),
        "tokens_per_chunk": sum(len(s.token_ids) for s in ok) / chunks if chunks else None,
        "kv_latent_max_err": max(prompts[u]["latent_max_err"] for u in range(users)),
        "kv_indexer_max_err": max(prompts[u]["indexer_max_err"] for u in range(users)),
        "engine_tokens_per_step": speed.get("tokens_per_step"),
        "engine_spec_same_as_stream": speed.get("spec_same_as_stream"),
        "same_tokens": not errors and all(s.token_ids == want[s.user] for s in streams),
        "same_as_engine_prefill": not errors and all(s.token_ids == prompts[s.user]["own"] for s in streams),
    }


ROUTER_LEGS = ("tilert:time_to_first_token_seconds", "tilert:request_prefill_time_seconds")


def router_own_ms(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float | None:
    """The router's mean time from a request's arrival to its first token, outside its prefill call, between two
    readings of its :data:`ROUTER_LEGS` histograms (None when it served no request in between)."""
    means = []
    for name in ROUTER_LEGS:
        total, count = (a - b for a, b in zip(after.get(name, (0.0, 0.0)), before.get(name, (0.0, 0.0)), strict=True))
        if count <= 0:
            return None
        means.append(1000 * total / count)
    return means[0] - means[1]


def ttft(
    routed: list[Stream], direct: list[Stream], timings: dict[str, dict[str, float]], router_own: float | None = None
) -> dict[str, Any]:
    """Time to first token through the router against calling the prefill directly, at the client, the same prompt
    (a prefix-cache hit) in turns. ``added_ms``: what the router, the node and the transfer add to a first token over
    the prefill server called alone: the routed TTFT less the direct one, less the difference in the stand-in's own
    work between them (the connector's calls count as added: ``*_outside_ms`` differ, plus
    ``routed_connector_ms``); ``added_outside_prefill_ms``: :func:`_added_ms` (the routed TTFT less the stand-in's
    own work: also the client's and HTTP's part, which a direct call has too); ``added_over_direct_ms``: the routed
    TTFT less the direct one as they are (with the stand-in writing the prompt's pages again for the connector to
    save, which vLLM's prefix cache would not, and a direct request skips); ``*_outside_ms``: each path's TTFT less
    the stand-in's time answering it (the hops and the client); ``router_own_ms``: :func:`router_own_ms`."""
    ok_r = [s for s in routed if s.error is None]
    ok_d = [s for s in direct if s.error is None]

    def ms(streams: list[Stream]) -> list[float]:
        return [1000 * s.ttft_s for s in streams]

    def handler(streams: list[Stream]) -> list[float]:
        return [timings[s.request_id]["handler_ms"] for s in streams if s.request_id in timings]

    def outside(streams: list[Stream]) -> list[float]:
        return [1000 * s.ttft_s - timings[s.request_id]["handler_ms"] for s in streams if s.request_id in timings]

    def connector(streams: list[Stream]) -> list[float]:
        return [timings[s.request_id].get("connector_ms", 0.0) for s in streams if s.request_id in timings]

    timed_r = [timings[s.request_id] for s in ok_r if s.request_id in timings]
    routed_ms, direct_ms = med(ms(ok_r)), med(ms(ok_d))
    out_r, out_d, conn = med(outside(ok_r)), med(outside(ok_d)), med(connector(ok_r))
    return {
        "pairs": len(routed),
        "errors": len(routed) + len(direct) - len(ok_r) - len(ok_d),
        "error_samples": [s.error for s in routed + direct if s.error is not None][:3],
        "routed_ttft_ms": routed_ms,
        "routed_ttft_p90_ms": pct(ms(ok_r), 90),
        "direct_ttft_ms": direct_ms,
        "direct_ttft_p90_ms": pct(ms(ok_d), 90),
        "added_over_direct_ms": routed_ms - direct_ms if routed_ms is not None and direct_ms is not None else None,
        "routed_handler_ms": med(handler(ok_r)),
        "direct_handler_ms": med(handler(ok_d)),
        "added_ms": None if out_r is None or out_d is None or conn is None else out_r - out_d + conn,
        "router_own_ms": router_own,
        "added_outside_prefill_ms": med([_added_ms(s, timings[s.request_id]) for s in ok_r if s.request_id in timings]),
        "routed_connector_ms": conn,
        "routed_connector_hooks_ms": {
            k.removeprefix("connector_").removesuffix("_ms"): med([t[k] for t in timed_r])
            for k in sorted({k for t in timed_r for k in t})
            if k.startswith("connector_") and k != "connector_ms" and all(k in t for t in timed_r)
        },
        "routed_outside_ms": out_r,
        "direct_outside_ms": out_d,
        "routed_ms": ms(ok_r),
        "direct_ms": ms(ok_d),
    }


def ttft_table(t: dict[str, Any]) -> str:
    """:func:`ttft` as a markdown table."""

    def f(key: str) -> str:
        return "-" if t.get(key) is None else f"{t[key]:.2f}"

    return "\n".join(
        [
            "| path | TTFT p50 ms | TTFT p90 ms | stand-in's handler ms | its connector calls ms | outside it ms |",
            "|---|---:|---:|---:|---:|---:|",
            f"| router | {f('routed_ttft_ms')} | {f('routed_ttft_p90_ms')} | {f('routed_handler_ms')} | "
            f"{f('routed_connector_ms')} | {f('routed_outside_ms')} |",
            f"| direct | {f('direct_ttft_ms')} | {f('direct_ttft_p90_ms')} | {f('direct_handler_ms')} | - | "
            f"{f('direct_outside_ms')} |",
            f"\nTTFT added by the router, the node and the transfer over the prefill alone ({t['pairs']} pairs, p50s: "
            f"router's outside - direct's outside + the connector's calls): **{f('added_ms')} ms**; routed TTFT less "
            f"the stand-in's own work: {f('added_outside_prefill_ms')} ms; routed p50 less direct p50 as they are: "
            f"{f('added_over_direct_ms')} ms; the router's own time outside its prefill call (its metrics, mean): "
            f"{f('router_own_ms')} ms",
        ]
    )


COLUMNS = (
    ("node", "node", "{}"),
    ("users", "users", "{}"),
    ("client_tok_s", "client tok/s", "{:.1f}"),
    ("engine_tok_s", "engine tok/s", "{:.1f}"),
    ("client_over_engine", "client/engine", "{:.3f}"),
    ("client_steady_tok_s", "client steady tok/s", "{:.1f}"),
    ("steady_over_engine", "steady/engine", "{:.3f}"),
    ("ttft_ms", "TTFT ms", "{:.1f}"),
    ("standin_prefill_ms", "prefill ms", "{:.1f}"),
    ("ttft_added_ms", "TTFT added ms", "{:.1f}"),
    ("tpot_ms", "TPOT ms", "{:.2f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.2f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.2f}"),
    ("engine_tokens_per_step", "engine tok/step", "{:.2f}"),
    ("tokens_per_chunk", "client tok/chunk", "{:.2f}"),
    ("same_tokens", "same tokens", "{}"),
    ("errors", "errors", "{}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""

    def cell(r: dict[str, Any], key: str, fmt: str) -> str:
        return "-" if r.get(key) is None else fmt.format(r[key])

    head = "| " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    rule = "|" + "|".join("---:" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(cell(r, k, f) for k, _, f in COLUMNS) + " |" for r in rows]
    return "\n".join([head, rule, *body])
