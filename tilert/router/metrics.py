"""Prometheus metrics of one router instance, named after vLLM's (own registry: several apps per process).

Callers use the typed methods below; nothing outside this module touches a prometheus object. Every
series carries ``model_name`` (the served model name), as vLLM's do. A dashboard built for vLLM reads the
router by swapping the ``vllm:`` prefix for ``tilert:``:

==============================================  ==========================================  ==================
tilert (router)                                 vLLM                                        fed by
==============================================  ==========================================  ==================
tilert:time_to_first_token_seconds{route,pool}  vllm:time_to_first_token_seconds            first_token
tilert:e2e_request_latency_seconds{route,pool}  vllm:e2e_request_latency_seconds            request_finished
tilert:request_time_per_output_token_seconds    vllm:request_time_per_output_token_seconds  request_finished
tilert:inter_token_latency_seconds              vllm:inter_token_latency_seconds            token_gap
tilert:num_requests_running                     vllm:num_requests_running                   running
tilert:num_requests_waiting                     vllm:num_requests_waiting                   waiting
tilert:request_success_total{finished_reason}   vllm:request_success_total                  request_finished
tilert:prompt_tokens_total                      vllm:prompt_tokens_total                    request_finished
tilert:generation_tokens_total                  vllm:generation_tokens_total                request_finished
tilert:request_prompt_tokens                    vllm:request_prompt_tokens                  request_finished
tilert:request_generation_tokens                vllm:request_generation_tokens              request_finished
tilert:request_queue_time_seconds               vllm:request_queue_time_seconds             queue_wait
tilert:request_prefill_time_seconds             vllm:request_prefill_time_seconds           prefill
==============================================  ==========================================  ==================

Differences in meaning, where the router sees a request differently from vLLM's engine:

- running: admitted by the router and not finished (queued for a slot, prefilling or decoding); waiting:
  queued for a decode slot (vLLM: waiting for its scheduler);
- queue time: the wait for a decode slot; prefill time: the whole ``max_tokens=1`` round trip to vLLM;
- request_success counts every finished request by ``finished_reason`` (stop, length, abort, error), as
  vLLM's does; prompt/generation token totals are added once, when the request finishes;
- time per output token is vLLM's definition: (e2e - ttft) / (generation tokens - 1), requests with more
  than one token only.

The router's own, with no vLLM counterpart:

- ``tilert:requests_total{route,outcome,pool}``: every request, failures included (``ok``, ``bad_request``,
  ``queue_timeout``, ``decode_error``, ``client_disconnected``, ...); ``pool`` is the decode pool that served
  it (``tilert``, ``vllm``; ``none`` for a request refused before a pool was chosen), as the response's
  ``x-tilert-pool`` header says; a request that overflowed counts under ``vllm``;
- ``tilert:pool_overflows_total``: TileRT-pool requests sent to the native pool for want of a slot;
- ``tilert:kv_transfer_wait_seconds``: decode request sent to its first line (KV transfer + first step);
- ``tilert:decode_slots_in_use{node}``: slots this router holds per decode node;
- ``tilert:decode_node_healthy{node}``: 1 while the node passes its health probe;
- ``tilert:prefill_requests_in_flight{instance}``: calls in flight to each prefill vLLM (prefills and relays);
- ``tilert:prefill_requests_total{instance,outcome}``: calls to each prefill vLLM by outcome (``ok``: it answered,
  ``failed``: unreachable, HTTP 5xx or timed out, ``cancelled``);
- ``tilert:prefill_instance_state{instance,state}``: 1 for the circuit breaker state each prefill instance is in
  (``closed``, ``open``, ``half_open``), 0 for the others;
- ``tilert:prefill_retries_total``: calls run again on another prefill instance after theirs failed them.
- ``tilert:decode_resumes_total{reason}``: streams continued on another decode node after theirs died or
  stalled (``lost``: its stream broke or ended early; ``stalled``: it sent nothing for ``decode_idle_timeout_s``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tilert.metric_conventions import (
    INTER_TOKEN_LATENCY_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    WAIT_BUCKETS,
    ManyObservations,
)


class RouterMetrics:
    """The router's ``/metrics``; one instance per app, labelled with the served model name."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._declare_latencies(["model_name"])
        self._declare_counts(["model_name"])
        self._overflows = self._overflow_counter()
        self._declare_prefill(["model_name"])
        # Series that exist from the start (a dashboard sees 0, not "no data").
        series = (self._running, self._waiting, self._prompt_tokens, self._generation_tokens, self._overflows)
        for metric in (*series, self._prefill_retries):
            metric.labels(model_name)
        self._itl_many = ManyObservations(self._itl.labels(model_name))  # observed for every relayed chunk

    def _declare_latencies(self, m: list[str]) -> None:
        hist = self._histogram
        self._ttft = hist(
            "time_to_first_token_seconds",
            "Arrival at the router to the first token sent to the client.",
            m + ["route", "pool"],
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self._e2e = hist(
            "e2e_request_latency_seconds",
            "Arrival at the router to the request's end, failures included.",
            m + ["route", "pool"],
            REQUEST_LATENCY_BUCKETS,
        )
        self._tpot = hist(
            "request_time_per_output_token_seconds",
            "Per request: (e2e - ttft) / (generation tokens - 1), as vLLM defines it.",
            m,
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._itl = hist(
            "inter_token_latency_seconds",
            "Time between decode tokens arriving at the router (a batch's gap split evenly).",
            m,
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self._queue = hist("request_queue_time_seconds", "Wait for a decode slot.", m, WAIT_BUCKETS)
        self._prefill = hist(
            "request_prefill_time_seconds", "Prefill round trip to vLLM (max_tokens=1).", m, TIME_TO_FIRST_TOKEN_BUCKETS
        )
        self._transfer = hist(
            "kv_transfer_wait_seconds",
            "Decode request sent to its first line (KV transfer wait + first step).",
            m,
            WAIT_BUCKETS,
        )

    def _declare_counts(self, m: list[str]) -> None:
        hist, count, gauge = self._histogram, self._counter, self._gauge
        self._running = gauge(
            "num_requests_running", "Requests admitted and not finished (queued for a slot, prefilling or decoding).", m
        )
        self._waiting = gauge("num_requests_waiting", "Requests queued for a decode slot.", m)
        self._success = count(
            "request_success",
            "Finished requests by finished_reason (stop, length, abort, error).",
            m + ["finished_reason"],
        )
        self._requests = count(
            "requests", "Every request by route and outcome (failures included).", m + ["route", "outcome", "pool"]
        )
        self._prompt_tokens = count("prompt_tokens", "Prompt tokens of finished requests.", m)
        self._generation_tokens = count("generation_tokens", "Completion tokens sent to clients.", m)
        self._prompt_hist = hist("request_prompt_tokens", "Prompt tokens per finished request.", m, TOKEN_COUNT_BUCKETS)
        self._generation_hist = hist(
            "request_generation_tokens", "Completion tokens per finished request.", m, TOKEN_COUNT_BUCKETS
        )
        self._slots = gauge("decode_slots_in_use", "Decode slots this router holds, per node.", m + ["node"])
        self._healthy = gauge("decode_node_healthy", "1 while the decode node passes its health probe.", m + ["node"])

    def _declare_prefill(self, m: list[str]) -> None:
        self._prefill_flight = self._gauge(
            "prefill_requests_in_flight", "Calls in flight to each prefill instance.", m + ["instance"]
        )
        self._prefill_requests = self._counter(
            "prefill_requests",
            "Calls to each prefill instance by outcome (ok, failed: unreachable / 5xx / timed out, cancelled).",
            m + ["instance", "outcome"],
        )
        self._prefill_state = self._gauge(
            "prefill_instance_state",
            "1 for the circuit breaker state of each prefill instance (closed, open, half_open), 0 for the others.",
            m + ["instance", "state"],
        )
        self._prefill_retries = self._counter(
            "prefill_retries", "Calls run again on another prefill instance after theirs failed them.", m
        )
        self._resumes = self._counter(
            "decode_resumes",
            "Streams continued on another decode node after theirs died (lost) or stalled.",
            m + ["reason"],
        )

    def _histogram(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: list[str]) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def _overflow_counter(self) -> Counter:
        doc = "TileRT-pool requests sent to the native pool for want of a decode slot."
        return self._counter("pool_overflows", doc, ["model_name"])

    # -- per request -------------------------------------------------------------------------------
    def first_token(self, route: str, seconds: float, pool: str = "tilert") -> None:
        """The first token reached the client ``seconds`` after the request arrived (once per request)."""
        self._ttft.labels(self.model_name, route, pool).observe(seconds)

    def overflowed(self) -> None:
        """A TileRT-pool request went to the native pool (no decode slot within overflow_wait_s)."""
        self._overflows.labels(self.model_name).inc()

    def token_gap(self, seconds: float, n: int = 1) -> None:
        """``n`` decode tokens arrived ``seconds`` after the previous ones: ``n`` gaps of ``seconds / n``."""
        if n > 0:
            self._itl_many.observe(seconds / n, n)

    def request_finished(
        self,
        route: str,
        outcome: str,
        finished_reason: str | None = None,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        e2e_s: float | None = None,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        pool: str = "tilert",
    ) -> None:
        """A request ended (answered, refused or failed): counts, token totals, latency.

        ``finished_reason`` is the OpenAI finish reason when it finished (None when it was refused before
        being served); ``tpot_s`` defaults to vLLM's (e2e - ttft) / (completion_tokens - 1). TTFT itself is
        recorded by :meth:`first_token`, not here.
        """
        m = self.model_name
        self._requests.labels(m, route, outcome, pool).inc()
        if finished_reason is not None:
            self._success.labels(m, finished_reason).inc()
        if e2e_s is not None:
            self._e2e.labels(m, route, pool).observe(e2e_s)
        if prompt_tokens > 0:
            self._prompt_tokens.labels(m).inc(prompt_tokens)
            self._prompt_hist.labels(m).observe(prompt_tokens)
        if completion_tokens > 0:
            self._generation_tokens.labels(m).inc(completion_tokens)
            self._generation_hist.labels(m).observe(completion_tokens)
        if tpot_s is None and e2e_s is not None and ttft_s is not None and completion_tokens > 1:
            tpot_s = (e2e_s - ttft_s) / (completion_tokens - 1)
        if tpot_s is not None:
            self._tpot.labels(m).observe(tpot_s)

    def queue_wait(self, seconds: float) -> None:
        """A request waited ``seconds`` for a decode slot."""
        self._queue.labels(self.model_name).observe(seconds)

    def prefill(self, seconds: float) -> None:
        """A prefill round trip to vLLM took ``seconds``."""
        self._prefill.labels(self.model_name).observe(seconds)

    def transfer_wait(self, seconds: float) -> None:
        """The first decode line arrived ``seconds`` after the decode request was sent."""
        self._transfer.labels(self.model_name).observe(seconds)

    # -- state -------------------------------------------------------------------------------------
    def running(self, delta: int) -> None:
        """A request started (+1) or ended (-1)."""
        self._running.labels(self.model_name).inc(delta)

    def waiting(self, n: int) -> None:
        """``n`` requests are queued for a decode slot now."""
        self._waiting.labels(self.model_name).set(n)

    def slots_in_use(self, node: str, n: int) -> None:
        """This router holds ``n`` slots on ``node`` now."""
        self._slots.labels(self.model_name, node).set(n)

    def node_healthy(self, node: str, ok: bool) -> None:
        self._healthy.labels(self.model_name, node).set(1 if ok else 0)

    def prefill_in_flight(self, instance: str, n: int) -> None:
        """``n`` calls are in flight to prefill ``instance`` now."""
        self._prefill_flight.labels(self.model_name, instance).set(n)

    def prefill_request(self, instance: str, outcome: str) -> None:
        """A call to prefill ``instance`` ended: ``ok``, ``failed`` or ``cancelled``."""
        self._prefill_requests.labels(self.model_name, instance, outcome).inc()

    def prefill_state(self, instance: str, state: str, states: tuple[str, ...]) -> None:
        """Prefill ``instance``'s circuit breaker is in ``state`` now (one of ``states``)."""
        for each in states:
            self._prefill_state.labels(self.model_name, instance, each).set(1 if each == state else 0)

    def decode_resumed(self, reason: str) -> None:
        """A stream continues on another decode node: ``lost`` or ``stalled``."""
        self._resumes.labels(self.model_name, reason).inc()

    def prefill_retried(self) -> None:
        """A call runs again on another prefill instance."""
        self._prefill_retries.labels(self.model_name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["RouterMetrics"]
