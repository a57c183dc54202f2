"""The prefill instances behind one router: which one a request's prefill goes to, and a circuit breaker per instance.

Every call to a prefill vLLM goes through :meth:`PrefillPool.call`: the TileRT pool's prefill, the native pool's,
and the ``/tokenize`` / ``/detokenize`` relays. It picks an instance by the configured policy:

- ``least_loaded``: the fewest requests in flight (ties rotate);
- ``prefix_hash``: the instance a request's leading prompt characters hash to (rendezvous hashing over every
  configured instance, so the same prefix lands on the same instance and hits its prefix cache, and an instance
  that goes or comes moves only its own share), unless that instance admits nothing now or has
  ``prefill_prefix_slack`` more requests in flight than the least loaded: then the least loaded.

Each instance's :class:`Breaker` is the one owner of its state::

    CLOSED --prefill_breaker_failures in a row--> OPEN --prefill_breaker_open_s passed, /health answers 200--> HALF_OPEN
      ^                                            ^                                                        |
      |                                            +------------------- the trial request failed -----------+
      +-------------------------------------------- the trial request succeeded ----------------------------+

A failure is the instance's own (:class:`~tilert.router.prefill.InstanceFailed`: unreachable, HTTP 5xx, timed
out); a 4xx, a busy connector or a cancelled call is an answer, or no verdict, never a failure. An open instance
gets no request; a half-open one gets one at a time (the trial). A call its instance failed before it could run
(``InstanceFailed.retry``) runs once more on another instance that admits it, which is before any byte reached the
client, and never after a prefill succeeded. With no instance to admit a request, it is answered 503 at once with
the reason and a ``Retry-After``.
"""

from __future__ import annotations

import enum
import hashlib
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import anyio
import orjson
import structlog

from tilert.router.errors import RouterError
from tilert.router.metrics import RouterMetrics
from tilert.router.prefill import InstanceFailed, PrefillClient

log = structlog.get_logger("tilert.router.prefill_pool")

T = TypeVar("T")
LEAST_LOADED, PREFIX_HASH = "least_loaded", "prefix_hash"


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


STATES = tuple(s.value for s in BreakerState)


class Breaker:
    """One instance's circuit breaker; every transition goes through :meth:`_to` (logged, reported)."""

    def __init__(
        self,
        name: str,
        failures_to_open: int,
        open_s: float,
        on_change: Callable[[BreakerState], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failures_to_open = failures_to_open
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.failures = 0  # in a row
        self.reason: str | None = None  # the last failure's
        self.trial = False  # half-open: the trial request is in flight
        self._opened_at = 0.0
        self._on_change = on_change
        self._clock = clock

    def admits(self) -> bool:
        """Whether a new request may go to the instance now."""
        return self.state is BreakerState.CLOSED or (self.state is BreakerState.HALF_OPEN and not self.trial)

    def started(self) -> None:
        """A request was sent (in half-open, it is the trial)."""
        if self.state is BreakerState.HALF_OPEN:
            self.trial = True

    def succeeded(self) -> None:
        """The instance answered (any answer but its own failure)."""
        self.failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self._to(BreakerState.CLOSED, "its trial request succeeded")

    def failed(self, reason: str) -> None:
        """The instance failed a request: unreachable, HTTP 5xx, timed out."""
        self.failures += 1
        self.reason = reason
        if self.state is BreakerState.HALF_OPEN:
            self._to(BreakerState.OPEN, f"its trial request failed: {reason}")
        elif self.state is BreakerState.CLOSED and self.failures >= self.failures_to_open:
            self._to(BreakerState.OPEN, f"{self.failures} requests in a row failed, the last: {reason}")

    def no_verdict(self) -> None:
        """A request ended saying nothing of the instance (cancelled): a half-open trial may be tried again."""
        self.trial = False

    def probe_due(self) -> bool:
        """Open, and waited ``open_s`` since it opened or was last probed: its /health is asked now."""
        return self.state is BreakerState.OPEN and self._clock() - self._opened_at >= self.open_s

    def probed(self, ok: bool, reason: str | None = None) -> None:
        """The answer of the /health probe of an open instance: 200 lets one trial request in, else it waits again."""
        if self.state is not BreakerState.OPEN:
            return
        if ok:
            self._to(BreakerState.HALF_OPEN, "its /health answers")
        else:
            self.reason = reason or self.reason
            self._opened_at = self._clock()

    def retry_after_s(self) -> float:
        """Seconds until the instance may be probed (0 unless open)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at + self.open_s - self._clock())

    def _to(self, state: BreakerState, why: str) -> None:
        previous, self.state, self.trial = self.state, state, False
        if state is BreakerState.OPEN:
            self._opened_at = self._clock()
        elif state is BreakerState.CLOSED:
            self.failures, self.reason = 0, None
        (log.warning if state is BreakerState.OPEN else log.info)(
            "prefill_breaker", instance=self.name, state=state.value, previous=previous.value, why=why
        )
        self._on_change(state)


@dataclass(eq=False)
class PrefillInstance:
    """One prefill vLLM: its clients, breaker and load as this router sees them."""

    url: str
    client: PrefillClient
    breaker: Breaker
    in_flight: int = 0
    requests: int = 0  # calls sent to it
    last_probe: dict[str, Any] = field(default_factory=dict)


def prefix_key(body: dict[str, Any], chars: int) -> str:
    """The first ``chars`` characters of the request's prompt, or of its chat messages, as JSON."""
    prompt = body.get("messages", body.get("prompt"))
    return orjson.dumps(prompt)[: 4 * chars].decode("utf-8", "ignore")[:chars]


def _score(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest(), "big")


class PrefillPool:
    """The router's prefill instances, the policy that picks one, and the calls made through them."""

    def __init__(
        self,
        urls: Sequence[str],
        client: Callable[[str], PrefillClient],
        metrics: RouterMetrics,
        *,
        policy: str = LEAST_LOADED,
        prefix_chars: int = 256,
        slack: int = 4,
        failures_to_open: int = 3,
        open_s: float = 5.0,
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.prefix_chars = prefix_chars
        self.slack = slack
        self.retry_after_s = retry_after_s
        self._metrics = metrics
        self._rr = 0
        self.instances = [
            PrefillInstance(url, client(url), Breaker(url, failures_to_open, open_s, self._reporter(url), clock))
            for url in urls
        ]
        for inst in self.instances:
            metrics.prefill_state(inst.url, BreakerState.CLOSED.value, STATES)
            metrics.prefill_in_flight(inst.url, 0)

    def _reporter(self, url: str) -> Callable[[BreakerState], None]:
        return lambda state: self._metrics.prefill_state(url, state.value, STATES)

    # -- choice ------------------------------------------------------------------------------------
    def choose(self, key: str | None = None, exclude: Sequence[PrefillInstance] = ()) -> PrefillInstance | None:
        """The instance a request goes to (None: none admits it now); ``key``: its prefix (:func:`prefix_key`)."""
        open_ = [i for i in self.instances if i.breaker.admits() and i not in exclude]
        if not open_:
            return None
        least = self._least_loaded(open_)
        if self.policy != PREFIX_HASH or key is None:
            return least
        home = max(self.instances, key=lambda i: _score(key, i.url))
        if home in open_ and home.in_flight <= least.in_flight + self.slack:
            return home
        return least

    def _least_loaded(self, candidates: list[PrefillInstance]) -> PrefillInstance:
        self._rr = (self._rr + 1) % len(self.instances)
        order = {id(inst): (n - self._rr) % len(self.instances) for n, inst in enumerate(self.instances)}
        return min(candidates, key=lambda i: (i.in_flight, order[id(i)]))

    def require(self, request_id: str = "") -> None:
        """Refuse at once (503) when no instance admits a request now: before it waits for anything else."""
        if not any(i.breaker.admits() for i in self.instances):
            raise self._unavailable(request_id)

    def key(self, body: dict[str, Any] | None) -> str | None:
        """The request's prefix key under ``prefix_hash`` (None under ``least_loaded``, or without a body)."""
        return prefix_key(body, self.prefix_chars) if body is not None and self.policy == PREFIX_HASH else None

    # -- calls -------------------------------------------------------------------------------------
    async def call(
        self,
        work: Callable[[PrefillClient], Awaitable[T]],
        *,
        key: str | None = None,
        request_id: str = "",
        failure: Callable[[T], str | None] = lambda _: None,
    ) -> T:
        """``work(client)`` on the instance the policy picks; once more on another one when the first failed
        before it could run. ``failure(result)``: a result that is the instance's own failure (a relayed 5xx)."""
        tried: list[PrefillInstance] = []
        while True:
            inst = self.choose(key, tried)
            if inst is None:
                raise self._unavailable(request_id)
            tried.append(inst)
            try:
                return await self._one(inst, work, failure, request_id)
            except InstanceFailed as exc:
                if not (exc.retry and len(tried) == 1 and self.choose(key, tried) is not None):
                    raise
                log.warning("prefill_retry", request_id=request_id, failed=inst.url, reason=exc.message)
                self._metrics.prefill_retried()
            except _FailedResult as res:
                if len(tried) > 1 or self.choose(key, tried) is None:
                    return res.result
                log.warning("prefill_retry", request_id=request_id, failed=inst.url, reason=res.reason)
                self._metrics.prefill_retried()

    async def _one(
        self,
        inst: PrefillInstance,
        work: Callable[[PrefillClient], Awaitable[T]],
        failure: Callable[[T], str | None],
        request_id: str,
    ) -> T:
        """One call on ``inst``, counted in flight, its outcome given to the instance's breaker."""
        inst.breaker.started()
        inst.requests += 1
        self._load(inst, +1)
        outcome = "cancelled"
        try:
            try:
                result = await work(inst.client)
            except InstanceFailed as exc:
                outcome = "failed"
                inst.breaker.failed(exc.message)
                raise
            except RouterError:
                outcome = "ok"  # the instance answered (a 4xx, a busy connector, a body outside the contract)
                inst.breaker.succeeded()
                raise
            reason = failure(result)
            if reason is not None:
                outcome = "failed"
                inst.breaker.failed(reason)
                raise _FailedResult(result, reason)
            outcome = "ok"
            inst.breaker.succeeded()
            return result
        finally:
            if outcome == "cancelled":
                inst.breaker.no_verdict()
            self._load(inst, -1)
            self._metrics.prefill_request(inst.url, outcome)
            log.debug("prefill_call", request_id=request_id, instance=inst.url, outcome=outcome)

    def _load(self, inst: PrefillInstance, delta: int) -> None:
        inst.in_flight += delta
        self._metrics.prefill_in_flight(inst.url, inst.in_flight)

    def _unavailable(self, request_id: str) -> RouterError:
        states = {i.url: (i.breaker.state.value, i.breaker.reason) for i in self.instances}
        log.warning("prefill_unavailable", request_id=request_id, instances=states)
        wait = min((i.breaker.retry_after_s() for i in self.instances), default=0.0)
        out = sum(1 for i in self.instances if i.breaker.state is BreakerState.OPEN)
        return RouterError(
            503,
            f"no prefill instance is available: {out} of {len(self.instances)} taken out after failing, the rest "
            "busy with a trial request; retry shortly",
            outcome="prefill_unavailable",
            headers={"Retry-After": str(max(self.retry_after_s, math.ceil(wait)))},
        )

    # -- probes ------------------------------------------------------------------------------------
    async def probe(self, inst: PrefillInstance, timeout_s: float) -> dict[str, Any]:
        """Ask ``inst``'s /health; an open instance's breaker hears the answer when its wait is over."""
        try:
            async with inst.client.session.get("/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                ok, error = resp.status == 200, None if resp.status == 200 else f"HTTP {resp.status}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        if inst.breaker.probe_due():
            inst.breaker.probed(ok, error)
        inst.last_probe = {"ok": ok, "error": error}
        return self.view(inst)

    def view(self, inst: PrefillInstance) -> dict[str, Any]:
        """What ``/health`` shows of an instance."""
        return {
            "url": inst.url,
            "ok": bool(inst.last_probe.get("ok")),
            "error": inst.last_probe.get("error"),
            "state": inst.breaker.state.value,
            "in_flight": inst.in_flight,
            "requests": inst.requests,
            "failures_in_a_row": inst.breaker.failures,
            "last_failure": inst.breaker.reason,
        }

    async def check(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every instance's /health at once (``/health`` of the router)."""
        out: dict[str, dict[str, Any]] = {}

        async def one(inst: PrefillInstance) -> None:
            out[inst.url] = await self.probe(inst, timeout_s)

        async with anyio.create_task_group() as tg:
            for inst in self.instances:
                tg.start_soon(one, inst)
        return [out[i.url] for i in self.instances]

    async def run(self, timeout_s: float) -> None:
        """For the router's life: probe each open instance whose wait is over (a tick a fraction of that wait)."""
        tick = min(1.0, max(0.05, min(i.breaker.open_s for i in self.instances) / 4))
        while True:
            for inst in self.instances:
                if inst.breaker.probe_due():
                    await self.probe(inst, timeout_s)
            await anyio.sleep(tick)

    async def aclose(self) -> None:
        for inst in self.instances:
            await inst.client.aclose()


class _FailedResult(Exception):
    """A call whose result is the instance's own failure (``failure(result)`` said why)."""

    def __init__(self, result: Any, reason: str) -> None:
        super().__init__(reason)
        self.result = result
        self.reason = reason


__all__ = ["LEAST_LOADED", "PREFIX_HASH", "Breaker", "BreakerState", "PrefillInstance", "PrefillPool", "prefix_key"]
