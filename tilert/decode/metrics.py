"""Prometheus metrics of one decode node (its ``GET /metrics``), named after vLLM's (own registry).

Callers use the typed methods below; nothing outside this module touches a prometheus object. Every
series carries ``model_name``; the names follow vLLM's with a ``tilert:`` prefix, like the router's
(:mod:`tilert.router.metrics`), so one dashboard reads both (tell them apart by the scrape job):

==============================================  ==========================================  =================
tilert (decode node)                            vLLM                                        fed by
==============================================  ==========================================  =================
tilert:num_requests_running                     vllm:num_requests_running                   requests
tilert:num_requests_waiting                     vllm:num_requests_waiting                   requests
tilert:generation_tokens_total                  vllm:generation_tokens_total                tokens
tilert:inter_token_latency_seconds              vllm:inter_token_latency_seconds            tokens
tilert:request_time_per_output_token_seconds    vllm:request_time_per_output_token_seconds  request_done
tilert:e2e_request_latency_seconds              vllm:e2e_request_latency_seconds            request_done
tilert:request_success_total{finished_reason}   vllm:request_success_total                  request_done
tilert:spec_decode_num_drafts_total             vllm:spec_decode_num_drafts_total           spec_decode
tilert:spec_decode_num_draft_tokens_total       vllm:spec_decode_num_draft_tokens_total     spec_decode
tilert:spec_decode_num_accepted_tokens_total    vllm:spec_decode_num_accepted_tokens_total  spec_decode
==============================================  ==========================================  =================

Differences in meaning: running is decodes on the engine (one at a time today), waiting is decodes whose KV
has landed and which wait for the engine; e2e is a decode request's life on the node (``/v1/decode``
arrival to its last line: transfer wait, engine wait and decode); generation tokens count the tokens the node
produced (the router's count adds prefill's first token); time per output token is a decode's time from its
hand-off to the engine to its last token over the tokens the node generated (the mean of its inter-token
latencies). The speculative (MTP) counts, and ``tilert:spec_decode_num_accepted_tokens_per_pos_total{position}``
(vLLM's ``vllm:spec_decode_num_accepted_tokens_per_pos_total``), are a decode's, added when it ends: drafts are
speculative steps that drafted, draft tokens the tokens they drafted, accepted tokens those the verify kept, per
position the steps that kept draft ``position`` (0-based; acceptance rate = accepted / draft tokens, mean accepted
length = 1 + accepted / drafts, as vLLM's). vLLM 0.10 renamed ``vllm:time_per_output_token_seconds`` to
``vllm:inter_token_latency_seconds``; this follows the new name.

The node's own, with no vLLM counterpart:

- ``tilert:decode_slots`` / ``tilert:decode_slots_free``: receive slots (KV buffers), all and free;
- ``tilert:kv_transfers_received_total`` / ``tilert:kv_transfers_failed_total{reason}``: KV transfers;
- ``tilert:kv_transfer_wait_seconds``: ``/v1/decode`` arrival to its KV being ready;
- ``tilert:decode_leases_expired_total``: reservations dropped because their lease ran out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tilert.metric_conventions import (
    INTER_TOKEN_LATENCY_BUCKETS,
    PREFIX,
    REQUEST_LATENCY_BUCKETS,
    WAIT_BUCKETS,
    ManyObservations,
)


class DecodeMetrics:
    """The decode node's ``/metrics``, labelled with the model it serves."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self._running = Gauge(PREFIX + "num_requests_running", "Decodes running on the engine.", m, registry=r)
        self._waiting = Gauge(
            PREFIX + "num_requests_waiting", "Decodes whose KV landed, waiting for the engine.", m, registry=r
        )
        self._slots_total = Gauge(PREFIX + "decode_slots", "Receive slots (KV buffers) of the node.", m, registry=r)
        self._slots_free = Gauge(PREFIX + "decode_slots_free", "Receive slots free to reserve.", m, registry=r)
        self._received = Counter(PREFIX + "kv_transfers_received", "KV transfers received whole.", m, registry=r)
        self._failed = Counter(
            PREFIX + "kv_transfers_failed", "KV transfers that failed, by reason.", m + ["reason"], registry=r
        )
        self._transfer_wait = Histogram(
            PREFIX + "kv_transfer_wait_seconds",
            "/v1/decode arrival to its KV being ready.",
            m,
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self._generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens the node generated.", m, registry=r)
        self._itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between generated tokens (a step's gap split over its tokens).",
            m,
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self._tpot = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per decode: hand-off to the engine to its last token, over the tokens the node generated.",
            m,
            buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "A decode request on the node: arrival to its last line.",
            m,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self._success = Counter(
            PREFIX + "request_success", "Finished decodes by finished_reason.", m + ["finished_reason"], registry=r
        )
        self._expired = Counter(PREFIX + "decode_leases_expired", "Reservations whose lease ran out.", m, registry=r)
        spec = PREFIX + "spec_decode_num_"
        self._drafts = Counter(spec + "drafts", "Speculative steps that drafted.", m, registry=r)
        self._draft_tokens = Counter(spec + "draft_tokens", "Tokens the speculative steps drafted.", m, registry=r)
        self._accepted = Counter(spec + "accepted_tokens", "Drafted tokens the verify accepted.", m, registry=r)
        self._accepted_per_pos = Counter(
            spec + "accepted_tokens_per_pos",
            "Speculative steps whose draft at this position (0-based) was accepted.",
            m + ["position"],
            registry=r,
        )
        for metric in (
            self._running,
            self._waiting,
            self._slots_total,
            self._slots_free,
            self._received,
            self._generation_tokens,
            self._expired,
            self._drafts,
            self._draft_tokens,
            self._accepted,
        ):
            metric.labels(model_name)
        # observed for every line a decode stream sends: their labelled children looked up once
        self._tokens_child = self._generation_tokens.labels(model_name)
        self._itl_many = ManyObservations(self._itl.labels(model_name))

    def requests(self, running: int, waiting: int) -> None:
        """Decodes on the engine and decodes waiting for it, now."""
        self._running.labels(self.model_name).set(running)
        self._waiting.labels(self.model_name).set(waiting)

    def slots(self, total: int, free: int) -> None:
        """The node has ``total`` receive slots, ``free`` of them reservable now."""
        self._slots_total.labels(self.model_name).set(total)
        self._slots_free.labels(self.model_name).set(free)

    def transfer_received(self) -> None:
        self._received.labels(self.model_name).inc()

    def transfer_failed(self, reason: str = "error") -> None:
        self._failed.labels(self.model_name, reason).inc()

    def transfer_wait(self, seconds: float) -> None:
        """A decode request waited ``seconds`` for its KV."""
        self._transfer_wait.labels(self.model_name).observe(seconds)

    def tokens(self, n: int, seconds: float | None = None) -> None:
        """``n`` tokens were generated ``seconds`` after the previous ones (None: the first of a decode,
        counted without a latency); each of the ``n`` gets ``seconds / n`` of inter-token latency."""
        if n <= 0:
            return
        self._tokens_child.inc(n)
        if seconds is not None:
            self._itl_many.observe(seconds / n, n)

    def request_done(self, seconds: float, finished_reason: str | None = None, tpot_s: float | None = None) -> None:
        """A decode request ended ``seconds`` after it arrived; ``finished_reason`` when it finished
        (stop, length, abort, error), ``tpot_s`` its mean time per generated token when it generated any."""
        m = self.model_name
        self._e2e.labels(m).observe(seconds)
        if finished_reason is not None:
            self._success.labels(m, finished_reason).inc()
        if tpot_s is not None:
            self._tpot.labels(m).observe(tpot_s)

    def spec_decode(self, drafts: int, draft_tokens: int, accepted_per_pos: tuple[int, ...]) -> None:
        """A decode ended that took ``drafts`` speculative steps, drafting ``draft_tokens`` tokens, of which
        ``accepted_per_pos[i]`` steps had draft ``i`` accepted."""
        m = self.model_name
        self._drafts.labels(m).inc(drafts)
        self._draft_tokens.labels(m).inc(draft_tokens)
        self._accepted.labels(m).inc(sum(accepted_per_pos))
        for pos, n in enumerate(accepted_per_pos):
            self._accepted_per_pos.labels(m, str(pos)).inc(n)

    def lease_expired(self, n: int = 1) -> None:
        if n > 0:
            self._expired.labels(self.model_name).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["DecodeMetrics"]
