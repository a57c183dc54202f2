"""The metric families the router and the decode node declare, read from their own prometheus registries (never a
hand list), the series names they export, and the naming rules Prometheus expects of them."""

from __future__ import annotations

from tilert.decode.metrics import DecodeMetrics
from tilert.metric_conventions import PREFIX
from tilert.router.metrics import RouterMetrics

# The series each family type exports (prometheus_client: a counter's family name has no ``_total``).
SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
}
UNIT_SUFFIXES = ("_seconds", "_bytes", "_tokens")  # a histogram's unit (token counts have no base unit)
TIME_WORDS = ("time", "latency", "wait", "duration")
RESERVED_SUFFIXES = ("_total", "_count", "_sum", "_bucket", "_created", "_info")
WRONG_UNITS = ("_ms", "_milliseconds", "_us", "_minutes", "_hours", "_kb", "_mb", "_gb", "_percent")


def declared() -> dict[str, dict[str, str]]:
    """``{"router": {family: type}, "node": {family: type}}``, as their registries declare them."""
    return {
        "router": {m.name: m.type for m in RouterMetrics("m").registry.collect()},
        "node": {m.name: m.type for m in DecodeMetrics("m").registry.collect()},
    }


def exported_series(families: dict[str, str]) -> set[str]:
    """Every series name ``families`` (name -> type) shows on ``/metrics``."""
    return {name + suffix for name, kind in families.items() for suffix in SERIES_SUFFIXES[kind]}


def naming_problems(families: dict[str, str]) -> list[str]:
    """What breaks Prometheus' naming rules: the prefix; a gauge or histogram named like a counter's or a
    histogram's own series; a histogram without its unit; a time without ``_seconds``; a non-base unit."""
    problems = []
    for name, kind in sorted(families.items()):
        base = name.removeprefix(PREFIX)
        if not name.startswith(PREFIX):
            problems.append(f"{name}: not under {PREFIX}")
        if kind not in SERIES_SUFFIXES:
            problems.append(f"{name}: type {kind}")
        if kind != "counter" and base.endswith(RESERVED_SUFFIXES):
            problems.append(f"{name}: a {kind} named like a counter's or a histogram's series")
        if kind == "histogram" and not base.endswith(UNIT_SUFFIXES):
            problems.append(f"{name}: a histogram without its unit ({', '.join(UNIT_SUFFIXES)})")
        if any(w in base.split("_") for w in TIME_WORDS) and not base.endswith("_seconds"):
            problems.append(f"{name}: a time not in _seconds")
        if any(f"{u}_" in base + "_" for u in WRONG_UNITS):
            problems.append(f"{name}: not a base unit")
    return problems
