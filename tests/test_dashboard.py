"""``config/grafana/tilert.json`` reads only series the router and the decode node export (their own registries say
which), covers every family they declare, and has a panel for each key family: TTFT, TPOT, ITL (p50 and p99),
queue, slots, transfer, errors, pool split, request rate."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from support.metrics import declared, exported_series

DASHBOARD = Path(__file__).resolve().parents[1] / "config" / "grafana" / "tilert.json"
DATASOURCE = "${DS_PROMETHEUS}"
NAME = re.compile(r"\btilert:[A-Za-z_][A-Za-z0-9_]*")

# key -> families of which one at least must be on a panel; latencies must show p50 and p99.
KEY_FAMILIES = {
    "TTFT": {"tilert:time_to_first_token_seconds"},
    "TPOT": {"tilert:request_time_per_output_token_seconds"},
    "ITL": {"tilert:inter_token_latency_seconds"},
    "queue": {"tilert:num_requests_waiting", "tilert:request_queue_time_seconds"},
    "slots": {"tilert:decode_slots_in_use", "tilert:decode_slots", "tilert:decode_slots_free"},
    "transfer": {"tilert:kv_transfer_wait_seconds"},
    "errors": {"tilert:requests", "tilert:kv_transfers_failed"},
    "pool": {"tilert:pool_overflows"},
    "request rate": {"tilert:requests"},
}
QUANTILES = ("TTFT", "TPOT", "ITL")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> dict[str, list[str]]:
    """Panel title -> its PromQL expressions (template variables' queries under ``$name``)."""
    board = _dashboard()
    out = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in _panels(board["panels"])}
    for var in board["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            out["$" + var["name"]] = [query["query"] if isinstance(query, dict) else query]
    return out


def _family(series: str, families: set[str]) -> str:
    """The family a series belongs to (``x_bucket`` -> ``x``)."""
    for suffix in ("_bucket", "_count", "_sum", "_total", "_created"):
        if series.endswith(suffix) and series.removesuffix(suffix) in families:
            return series.removesuffix(suffix)
    return series


def _declared() -> tuple[set[str], set[str]]:
    """Every family the router and the node declare, and every series they export."""
    families = declared()
    return set(families["router"]) | set(families["node"]), exported_series(families["router"]) | exported_series(
        families["node"]
    )


def test_the_dashboard_reads_only_exported_series() -> None:
    families, exported = _declared()
    exprs = _exprs()
    unknown = {title: sorted(set(NAME.findall(" ".join(es))) - exported) for title, es in exprs.items()}
    assert not {t: names for t, names in unknown.items() if names}, "names the code does not export"
    used = {_family(s, families) for es in exprs.values() for s in NAME.findall(" ".join(es))}
    assert families <= used, f"declared families on no panel: {sorted(families - used)}"


def test_every_key_family_has_a_panel() -> None:
    families, _ = _declared()
    exprs = _exprs()
    for key, wanted in KEY_FAMILIES.items():
        assert wanted <= families, f"{key}: {sorted(wanted - families)} no longer declared"
        on = [t for t, es in exprs.items() if wanted & {_family(s, families) for s in NAME.findall(" ".join(es))}]
        assert on, f"no panel for {key}"
        if key in QUANTILES:
            text = " ".join(e for t in on for e in exprs[t])
            for q in ("0.5", "0.99"):
                assert f"histogram_quantile({q}," in text, f"{key}: no histogram_quantile({q}, ...) panel"


def test_every_panel_reads_the_datasource_variable() -> None:
    board = _dashboard()
    assert any(v["name"] == "DS_PROMETHEUS" and v["type"] == "datasource" for v in board["templating"]["list"])
    for panel in _panels(board["panels"]):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == DATASOURCE, panel["title"]
        assert panel["targets"] and all(t["datasource"]["uid"] == DATASOURCE for t in panel["targets"]), panel["title"]
