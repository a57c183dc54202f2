"""What a server did during one run: the means of its own histograms (``/metrics``) and its CPU time."""

from __future__ import annotations

import httpx

from e2elib.procs import process_cpu_s

ROUTER_SERIES = {
    "queue_ms": "tilert:request_queue_time_seconds",
    "prefill_ms": "tilert:request_prefill_time_seconds",
    "transfer_wait_ms": "tilert:kv_transfer_wait_seconds",
    "ttft_ms": "tilert:time_to_first_token_seconds",
}


# vLLM's own timings of a request (its ``/metrics``), as the router's above: from its arrival in the engine to its
# first token, waiting to be scheduled, and its prefill forward (scheduled to first token).
VLLM_SERIES = {
    "ttft_ms": "vllm:time_to_first_token_seconds",
    "queue_ms": "vllm:request_queue_time_seconds",
    "forward_ms": "vllm:request_prefill_time_seconds",
}


def scrape_metrics(url: str, prefix: str) -> dict[str, float]:
    """The ``_sum`` / ``_count`` series of the histograms named ``prefix...`` and the ``_total`` of its counters,
    summed over labels."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0]
        if line.startswith(prefix) and key.endswith(("_sum", "_count", "_total")):
            out[key] = out.get(key, 0.0) + float(value)
    return out


def series_means(
    before: dict[str, float], after: dict[str, float], series: dict[str, str], label: str
) -> dict[str, float | None]:
    """``label + name``: the mean in ms of each histogram of ``series`` over what it recorded between two
    :func:`scrape_metrics` (None: it recorded nothing)."""
    out: dict[str, float | None] = {}
    for name, metric in series.items():
        n = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        total = after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)
        out[label + name] = 1000 * total / n if n else None
    return out


class RouterProbe:
    """What the router itself did during one run: its CPU time per request and per token, and the mean of its
    own queue / prefill / transfer-wait / TTFT timings (from its ``/metrics``)."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.metrics = scrape_metrics(url, "tilert:")
        self.cpu = process_cpu_s(pid)

    def finish(self) -> dict[str, float | None]:
        cpu = process_cpu_s(self.pid) - self.cpu
        after = scrape_metrics(self.url, "tilert:")

        def delta(key: str) -> float:
            return after.get(key, 0.0) - self.metrics.get(key, 0.0)

        requests = delta("tilert:time_to_first_token_seconds_count")
        tokens = delta("tilert:generation_tokens_total")
        out: dict[str, float | None] = {
            "router_requests": requests,
            "router_tokens": tokens,
            "router_cpu_s": cpu,
            "router_cpu_ms_per_request": 1000 * cpu / requests if requests else None,
            "router_cpu_us_per_token": 1e6 * cpu / tokens if tokens else None,
        }
        return out | series_means(self.metrics, after, ROUTER_SERIES, "router_")


class VllmProbe:
    """Where the first tokens' time went inside the vLLM that computed them (the router's: the stack's prefill):
    the means of its own TTFT, queue and prefill-forward timings over one run (``VLLM_SERIES``)."""

    def __init__(self, url: str) -> None:
        self.url, self.metrics = url, scrape_metrics(url, "vllm:")

    def finish(self) -> dict[str, float | None]:
        return series_means(self.metrics, scrape_metrics(self.url, "vllm:"), VLLM_SERIES, "vllm_")
