"""What a run writes: the whole result as JSON, and a markdown page (conditions, servers, tables, runs), each with
``results_header``'s header."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from results_header import recorded, write_json, write_md

from e2elib.tables import fmt


def markdown(result: dict[str, Any], note: str | None) -> str:
    """The markdown page of an end-to-end or router-overhead result."""
    cond, s = result["conditions"], result["settings"]
    v = cond["versions"]
    title = (
        "CPU end to end: tilert router vs vLLM alone, measured with `vllm bench serve`"
        if result["mode"] == "e2e"
        else "CPU router overhead: stand-in prefill and decode, the real router"
    )
    out = [f"# {title}", ""]
    if note:
        out += [f"> {note}", ""]
    out += [
        "## Conditions",
        "",
        f"- date: {cond['date_utc']}; host CPU: {cond['cpu_model']}, {cond['cpus']} cores "
        f"({cond['cpus_usable']} usable), {cond['memory_gib']} GiB",
        f"- load average (1/5/15 min) at start {_load(cond['loadavg_start'])}, at end {_load(cond.get('loadavg_end'))}",
        f"- git commit {cond['git_commit'][:12]}{' (working tree modified)' if cond['git_dirty'] else ''}; "
        f"Python {cond['python']}; " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- command: `{cond['command']}`",
    ]
    if result["mode"] == "e2e":
        out += [
            f"- model: tiny DeepSeek-V3 (`tilert tiny-model --arch deepseek_v3 --seed 0`), dtype {s['dtype']}; "
            f"random dataset, input {s['input_len']} / output {s['output_len']} tokens, `--ignore-eos`, temperature "
            f"0, backend `{s['backend']}`, bench seed {s['seed']}; prompts per run: "
            f"{s['num_prompts'] or 'max(8, 4 x C)'}, C warm-up requests each",
            f"- {s['rounds']} interleaved round(s): for each round, for each concurrency, every target (order "
            "rotating each round); the table shows the median over rounds of each statistic `vllm bench serve` "
            "reports; tok/s per user = 1000 / median TPOT",
            "- placement (each server's CPUs and binding: Servers below): the stack "
            + (
                "fenced, as `tilert up --engine-cpus`"
                if s["stack_pin"]
                else "unpinned, as `tilert up --engine-cpus none`"
                if s["decode_cpus"] == "none"
                else f"with the engine thread on CPUs `{s['decode_cpus']}`"
                if s["decode_cpus"]
                else "as `tilert up` places it by default"
            )
            + (f"; vLLM alone kept off CPUs `{s['vllm_cpus']}`" if s["stack_pin"] else "; vLLM alone unpinned")
            + " (in-process: vLLM binds no OpenMP thread); decode node "
            "max-sequences " + str(s["decode_max_sequences"] or "default (the node's --max-sequences)"),
            "- startup (s): " + ", ".join(f"{k} {val:.0f}" for k, val in result["startup_s"].items()),
            "- agreement (one greedy 32-token completion, vs "
            + result["agreement"]["reference"]
            + "): "
            + ", ".join(f"{k} {val}" for k, val in result["agreement"]["agree"].items()),
            "",
            "Servers:",
            "",
        ]
        for name, info in result["servers"].items():
            env = " ".join(f"{k}={val}" for k, val in info.get("env", {}).items())
            cpus = f" (CPUs {info['cpus']})" if info.get("cpus") else ""
            out.append(f"- {name}{cpus}: `{env + ' ' if env else ''}{shlex.join(['python', *info['command'][1:]])}`")
        out += [
            "",
            "## Results",
            "",
            result["table"],
            "",
            "## Per run (ms)",
            "",
            "| round | C | target | order | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 | failed |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["runs"]:
            out.append(
                f"| {r['round']} | {r['concurrency']} | {r['target']} | {r['order']} "
                f"| {fmt(r['median_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} | {fmt(r['median_tpot_ms'], 2)} "
                f"| {fmt(r['p99_tpot_ms'], 2)} | {fmt(r['median_itl_ms'], 2)} | {fmt(r['p99_itl_ms'], 2)} "
                f"| {r['failed']} |"
            )
    else:
        out += [
            "- stand-ins: `tilert.testing.standins` served by `benchmarks/e2e.py --standin` (Starlette + uvicorn, one "
            f"process each: the prefill and {s.get('standin_decode_procs', 1)} decode node(s) of the router's pool); "
            "decode gap "
            f"{', '.join(f'{g:g}' for g in s['gap_ms'])} ms, "
            f"{s['overhead_tokens']} tokens per request, prompt of {s['overhead_prompt_words']} "
            f"words; router `tilert router` (log level {s['router_log_level'] or 'default'}, CPUs "
            f"{s['router_cpus'] or 'unpinned'}); " + _placement(s),
            f"- {s['rounds']} round(s), "
            + ("the router path(s)" if s.get("skip_direct") else "direct and the router path(s)")
            + " interleaved at each concurrency (order alternating each round); the table shows the median over "
            "rounds" + (f"; `baseline`: the router of `{s['baseline_router']}`" if s.get("baseline_router") else ""),
            "",
            "## Results",
            "",
            result["table"],
        ]
    return "\n".join(out) + "\n"


def _placement(s: dict[str, Any]) -> str:
    """Where the load client and the stand-ins ran (results of before these settings: httpx in one process)."""
    kind, procs = s.get("client", "httpx"), s.get("client_procs", 1)
    client = f"load client: {kind} in {procs} process{'es' if procs != 1 else ''}"
    client += f" (CPUs {s['client_cpus']}, one each)" if s.get("client_cpus") else ""
    standins = f"stand-ins on CPUs {s['standin_cpus']}" if s.get("standin_cpus") else "stand-ins unpinned"
    return f"{client}; {standins}; the rest shares the machine's cores"


def _load(values: Any) -> str:
    return "-" if not values else "/".join(f"{x:.2f}" for x in values)


def write_outputs(result: dict[str, Any], out_dir: Path, name: str, note: str | None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {**result, "note": note}
    rec = recorded("cpu", command=result["conditions"]["command"], mode=result["mode"])
    json_path = write_json(out_dir / f"{name}.json", result, rec)
    md_path = write_md(out_dir / f"{name}.md", markdown(result, note), rec)
    return json_path, md_path
