"""Every metric the router and the decode node declare moves under real traffic through the session stack (a streamed
chat completion and a completion through the router, with the real OpenAI client), and its name follows Prometheus'
rules; the few that move only on a fault, or only on a node that drafts with an MTP layer (the session stack's
checkpoint has none), are listed with their reason, and exercised where that happens."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from support.metrics import declared, naming_problems
from support.stack import Stack
from support.waiting import wait_until

from tilert import auth

# Families that move only on a fault or with MTP: family -> why, and where that is made.
_MTP = "moves only on a node that drafts with an MTP layer (tests/test_gpu_serving_smoke.py reads them)"
MOVES_ELSEWHERE = {
    "router": {
        "tilert:pool_overflows": "a TileRT-pool request overflows only when no decode slot frees within "
        "overflow_wait_s (tests/test_pools.py)",
        "tilert:prefill_retries": "a prefill call runs again only when its instance failed it "
        "(tests/test_prefill_instances.py)",
        "tilert:decode_resumes": "a stream resumes only when its decode node dies or stalls "
        "(tests/test_stream_survives.py)",
    },
    "node": {
        "tilert:kv_transfers_failed": "a KV transfer fails only on a fault (tests/test_e2e_transports.py)",
        "tilert:decode_leases_expired": "a reservation whose lease runs out (test_an_expired_lease_is_counted)",
        "tilert:spec_decode_num_drafts": _MTP,
        "tilert:spec_decode_num_draft_tokens": _MTP,
        "tilert:spec_decode_num_accepted_tokens": _MTP,
        "tilert:spec_decode_num_accepted_tokens_per_pos": _MTP,
    },
}


def _scrape(url: str) -> dict[str, tuple[str, dict[str, float]]]:
    """``/metrics`` of ``url``: family -> (type, {sample name: value summed over its label sets})."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        sums: dict[str, float] = {}
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        out[family.name] = (family.type, sums)
    return out


def _moved(name: str, kind: str, before: dict[str, float], after: dict[str, float]) -> bool:
    """A histogram observed, a counter incremented, a gauge present."""
    if kind == "gauge":
        return name in after
    series = name + ("_count" if kind == "histogram" else "_total")
    return after.get(series, 0.0) > before.get(series, 0.0)


def _traffic(stack: Stack) -> None:
    client = OpenAI(base_url=stack.router + "/v1", api_key="unused", timeout=120, max_retries=0)
    chunks = client.chat.completions.create(
        model=str(stack.model),
        messages=[{"role": "user", "content": "Say something about metrics."}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 1
    done = client.completions.create(model=str(stack.model), prompt="def add(a, b):", max_tokens=8, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens > 1


@pytest.mark.stack
def test_every_declared_metric_moves_under_real_traffic(stack: Stack) -> None:
    urls = {"router": stack.router, "node": stack.decode}
    families = declared()
    for role in urls:
        assert not naming_problems(families[role]), naming_problems(families[role])
        assert set(MOVES_ELSEWHERE[role]) <= set(families[role]), "a metric listed here that is no longer declared"
    before = {role: _scrape(url) for role, url in urls.items()}
    _traffic(stack)
    after = {role: _scrape(url) for role, url in urls.items()}
    for role, kinds in families.items():
        seen = after[role]
        # the text format shows a counter's or histogram's ``_created`` series as a family of its own
        created = {name + "_created" for name in kinds}
        shown = {name: kind for name, (kind, _) in seen.items() if name not in created}
        assert not naming_problems(shown), (role, naming_problems(shown))
        assert set(shown) == set(kinds), f"{role} /metrics: families the code does not declare"
        for name, kind in kinds.items():
            assert name in seen and seen[name][0] == kind, f"{role} /metrics: {name} ({kind}) missing or mistyped"
            if name in MOVES_ELSEWHERE[role]:
                continue
            was = before[role].get(name, (kind, {}))[1]
            assert _moved(name, kind, was, seen[name][1]), f"{role} /metrics: {name} did not move"


def _node_headers(stack: Stack) -> dict[str, str]:
    assert stack.secret_file is not None
    return {"authorization": "Bearer " + auth.node_api_token(auth.load_secret(stack.secret_file))}


def _expired(stack: Stack) -> float:
    return _scrape(stack.decode)["tilert:decode_leases_expired"][1].get("tilert:decode_leases_expired_total", 0.0)


@pytest.mark.stack
def test_an_expired_lease_is_counted(stack: Stack) -> None:
    """A slot reserved and never used is dropped when its lease runs out, and counted."""
    before = _expired(stack)
    body: dict[str, Any] = {"transfer_id": f"lease-{uuid.uuid4().hex}", "lease_s": 0.2}
    resp = httpx.post(stack.decode + "/v1/reserve", json=body, headers=_node_headers(stack), timeout=10)
    assert resp.status_code == 200, resp.text
    wait_until(lambda: _expired(stack) > before, 15, "the expired lease counted", interval_s=0.2)
    health = httpx.get(stack.decode + "/health", timeout=10).json()
    wait_until(
        lambda: httpx.get(stack.decode + "/health", timeout=10).json()["slots_free"] == health["slots_total"],
        15,
        "the slot free again",
        interval_s=0.2,
    )
