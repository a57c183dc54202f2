"""The result tables (markdown): end to end per target and concurrency, the router / vLLM-alone ratios, where the
router path's and the first token's time goes; the router overhead, direct against routed."""

from __future__ import annotations

import statistics
from typing import Any

from e2elib.targets import TARGET_LABELS


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pct_str(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def fmt(v: float | None, digits: int = 1) -> str:
    """``v`` to ``digits`` decimals; ``-`` for a missing value."""
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio_table(agg: dict[tuple[str, int], dict[str, Any]], ref: str, concurrencies: list[int]) -> list[str]:
    lines = [
        "",
        f"Router / {TARGET_LABELS[ref]} (latencies above 1x: the router path is slower; tok/s below 1x: slower; an "
        "ITL ratio is left out where vLLM's median ITL is under 0.1 ms, i.e. its tokens came in bursts):",
        "",
        "| C | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | tok/s per user | e2e tok/s per user |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        r, v = agg.get(("router", c)), agg.get((ref, c))
        if r is None or v is None:
            continue
        cells = [
            _ratio(r[k], v[k]) if k not in ("median_itl_ms", "p99_itl_ms") or (v[k] or 0) >= 0.1 else None
            for k in (
                "median_ttft_ms",
                "p99_ttft_ms",
                "median_tpot_ms",
                "p99_tpot_ms",
                "median_itl_ms",
                "p99_itl_ms",
                "tok_s_per_user",
                "e2e_tok_s_per_user",
            )
        ]
        lines.append(f"| {c} | " + " | ".join(f"{fmt(x, 2)}x" if x is not None else "-" for x in cells) + " |")
    return lines


def e2e_tables(agg: dict[tuple[str, int], dict[str, Any]], targets: list[str], concurrencies: list[int]) -> str:
    lines = [
        "`tok/s per user` = 1000 / median TPOT; `e2e` = output tokens / median end-to-end latency (prompt included; "
        "not fooled by tokens that arrive in bursts); `burst`: share of tokens that reached the client within "
        "0.5 ms of the previous one (a server that sends several at once: its ITL and TPOT flatter it).",
        "",
        "| C | target | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | ITL p50 ms | ITL p99 ms "
        "| tok/s per user | (rounds' range) | e2e tok/s per user | burst | output tok/s | completed | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        for t in targets:
            a = agg.get((t, c))
            if a is None:
                continue
            rng = a["tok_s_per_user_range"]
            lines.append(
                f"| {c} | {t} | {fmt(a['median_ttft_ms'])} | {fmt(a['p99_ttft_ms'])} | {fmt(a['median_tpot_ms'], 2)} "
                f"| {fmt(a['p99_tpot_ms'], 2)} | {fmt(a['median_itl_ms'], 2)} | {fmt(a['p99_itl_ms'], 2)} "
                f"| {fmt(a['tok_s_per_user'])} | {'-' if not rng else f'{rng[0]:.0f}-{rng[1]:.0f}'} "
                f"| {fmt(a['e2e_tok_s_per_user'])} | {_pct_str(a['burst_share'])} "
                f"| {fmt(a['output_throughput'])} | {a['completed']} | {a['failed']} |"
            )
    for ref in ("vllm", "vllm1"):
        if "router" in targets and ref in targets:
            lines += _ratio_table(agg, ref, concurrencies)
    if "router" in targets:
        lines += [
            "",
            "Where the router path's time goes (means from the router's own `/metrics` over each run, bench's "
            "ready-check and warm-up requests included; `prefill` next to it: bench's TTFT of the prefill vLLM "
            "alone; CPU: the router process's user + system time):",
            "",
            "| C | client TTFT p50 | router TTFT (mean) | slot queue wait | prefill leg | prefill vLLM alone TTFT p50 "
            "| KV transfer + first decode step | router CPU per request | router CPU per token |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in concurrencies:
            r = agg.get(("router", c))
            if r is None:
                continue
            p = agg.get(("prefill", c)) or {}
            lines.append(
                f"| {c} | {fmt(r['median_ttft_ms'])} ms | {fmt(r['router_ttft_ms'])} ms "
                f"| {fmt(r['router_queue_ms'])} ms "
                f"| {fmt(r['router_prefill_ms'])} ms | {fmt(p.get('median_ttft_ms'))} ms "
                f"| {fmt(r['router_transfer_wait_ms'])} ms | {fmt(r['router_cpu_ms_per_request'], 2)} ms "
                f"| {fmt(r['router_cpu_us_per_token'], 0)} us |"
            )
    lines += _first_token_table(agg, targets, concurrencies)
    return "\n".join(lines)


def _first_token_table(
    agg: dict[tuple[str, int], dict[str, Any]], targets: list[str], concurrencies: list[int]
) -> list[str]:
    """Each target's first token split at the vLLM that computed it (the router's: the stack's prefill)."""
    lines = [
        "",
        "Where the first token's time goes, from the `/metrics` of the vLLM that computed it (means over each run; "
        "`router`: the stack's prefill; `outside vLLM`: the client's TTFT p50 less vLLM's own TTFT: HTTP, "
        "tokenizing, and the router's hops):",
        "",
        "| C | target | client TTFT p50 | vLLM TTFT (mean) | queue | prefill forward | outside vLLM |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for c in concurrencies:
        for t in targets:
            a = agg.get((t, c))
            if a is None or a.get("vllm_ttft_ms") is None:
                continue
            client, inside = a.get("median_ttft_ms"), a["vllm_ttft_ms"]
            lines.append(
                f"| {c} | {t} | {fmt(client)} ms | {fmt(inside)} ms | {fmt(a.get('vllm_queue_ms'))} ms "
                f"| {fmt(a.get('vllm_forward_ms'))} ms | {fmt(client - inside if client is not None else None)} ms |"
            )
    return lines


def overhead_table(rows: list[dict[str, Any]], concurrencies: list[int], gaps_ms: list[float], modes: list[str]) -> str:
    """The router-overhead table: each path (``modes``: ``direct``, ``router``, ``baseline``) at each of the decode
    stand-in's gaps and each concurrency, the median over rounds, and what the router adds to ``direct``."""
    keys = (
        "ttfb_p50_ms",
        "ttfb_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tokens_per_s",
        "nominal_tokens_per_s",
        "tokens_per_event",
        "client_cpu_ms_per_request",
        "router_cpu_ms_per_request",
        "router_cpu_us_per_token",
        "router_cpu_share",
        "client_cpu_share_max",
        "standin_decode_cpu_share",
        "router_tokens_per_cpu_s",
        "router_queue_ms",
        "router_prefill_ms",
        "router_ttft_ms",
    )
    agg: dict[tuple[str, float, int], dict[str, Any]] = {}
    for mode in modes:
        for gap in gaps_ms:
            for c in concurrencies:
                group = [r for r in rows if r["mode"] == mode and r["concurrency"] == c and r["gap_ms"] == gap]
                if group:
                    a: dict[str, Any] = {k: median([r.get(k) for r in group]) for k in keys}
                    a["errors"] = sum(r["errors"] for r in group)
                    a["requests"] = sum(r["requests"] for r in group)
                    agg[(mode, gap, c)] = a
    lines = [
        "Stand-ins answer at once; the decode stand-in emits one token every `gap` ms (0: a step per event-loop "
        "turn), the lines that queued while its stream wrote joined into one, as the node's stream does. `direct`: "
        "the client makes the router's calls itself (reserve, then TTFB of the prefill POST; token gaps of the decode "
        "stream, the first counted from the prefill reply). `router`: the same request through `tilert router` "
        "(first SSE event; gaps between SSE events); `baseline`: through the router of `--baseline-router`'s "
        "checkout. Added = router - direct. Where tokens/s falls short of the nominal rate (streams x 1000 / gap), "
        "the machine (client, router and stand-ins together) is saturated and the latencies are queueing; `direct` "
        "then costs the client processes more (it makes four HTTP calls per request where `router` makes one: see "
        "client CPU), so there the router's CPU time per token, not `added`, is its cost. Tokens per event: the "
        "tokens of an answer over its SSE events with a choice (1: a chunk per token). Router CPU share: its CPU "
        "time over the run's wall time (near 1: the router's core was the bottleneck; then tokens/s is what its one "
        "core relays); client / stand-in CPU share: the busiest load-client process's and the decode stand-in's (near "
        "1: that process, not the router, capped the run); tokens per router CPU second: 1 / its CPU time per token, "
        "what one core of it relays at that cost.",
        "",
        "| gap ms | streams | path | TTFB p50 ms | TTFB p99 ms | ITL p50 ms | ITL p99 ms | tokens/s (nominal) "
        "| tokens / event | requests | errors | client CPU / request | router CPU / request | router CPU / token "
        "| router CPU share | CPU share: busiest client / decode stand-in | tokens per router CPU second "
        "| router's own means: slot wait + reserve / prefill leg / TTFT |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for gap in gaps_ms:
        for c in concurrencies:
            lines += _overhead_rows(agg, modes, gap, c)
    return "\n".join(lines)


def _overhead_rows(
    agg: dict[tuple[str, float, int], dict[str, Any]], modes: list[str], gap: float, c: int
) -> list[str]:
    """The table's rows at one gap and concurrency: each path's, and what the router adds to ``direct``."""
    lines = []
    for mode in modes:
        m = agg.get((mode, gap, c))
        if m:
            shares = f"{fmt(m['client_cpu_share_max'], 2)} / {fmt(m['standin_decode_cpu_share'], 2)}"
            extra = (
                f"{fmt(m['router_cpu_ms_per_request'], 2)} ms | {fmt(m['router_cpu_us_per_token'], 1)} us "
                f"| {fmt(m['router_cpu_share'], 2)} | {shares} | {fmt(m['router_tokens_per_cpu_s'], 0)} "
                f"| {fmt(m['router_queue_ms'], 2)} / {fmt(m['router_prefill_ms'], 2)} / "
                f"{fmt(m['router_ttft_ms'], 2)} ms"
                if mode != "direct"
                else f" | | | {shares} | | "
            )
            lines.append(
                f"| {gap:g} | {c} | {mode} | {fmt(m['ttfb_p50_ms'], 2)} | {fmt(m['ttfb_p99_ms'], 2)} "
                f"| {fmt(m['itl_p50_ms'], 2)} | {fmt(m['itl_p99_ms'], 2)} | {fmt(m['tokens_per_s'], 0)} "
                f"({fmt(m['nominal_tokens_per_s'], 0)}) | {fmt(m['tokens_per_event'], 2)} | {m['requests']} "
                f"| {m['errors']} | {fmt(m['client_cpu_ms_per_request'], 2)} ms | {extra} |"
            )
    d, r = agg.get(("direct", gap, c)), agg.get(("router", gap, c))
    if d and r:
        diff = [
            None if r[k] is None or d[k] is None else r[k] - d[k]
            for k in ("ttfb_p50_ms", "ttfb_p99_ms", "itl_p50_ms", "itl_p99_ms")
        ]
        lines.append(
            f"| {gap:g} | {c} | **added** | **{fmt(diff[0], 2)}** | **{fmt(diff[1], 2)}** | **{fmt(diff[2], 2)}** "
            f"| **{fmt(diff[3], 2)}** | | | | | | | | | | | |"
        )
    return lines
