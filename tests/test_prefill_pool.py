"""The prefill instances' chooser and circuit breakers, without servers: the two policies, prefix stickiness, every
breaker transition, the one retry on another instance, the 503 when none is left; and the settings that configure
them (the router's and ``tilert up``'s), refused with their reason when wrong."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from tilert import stack
from tilert.router.config import RouterConfig, load_router_config
from tilert.router.errors import RouterError
from tilert.router.metrics import RouterMetrics
from tilert.router.prefill import InstanceFailed
from tilert.router.prefill_pool import Breaker, BreakerState, PrefillPool, prefix_key
from tilert.settings import ConfigError, cli_values

A, B, C = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
SECRET = b"0123456789abcdef0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pool(*urls: str, clock: Clock | None = None, **kw: Any) -> tuple[PrefillPool, RouterMetrics]:
    """A pool whose "session" for an instance is its URL (the work functions below read it)."""
    metrics = RouterMetrics("m")
    pool = PrefillPool(list(urls), lambda url: url, metrics, clock=clock or Clock(), **kw)  # type: ignore[arg-type,return-value]
    return pool, metrics


def _by_url(pool: PrefillPool) -> dict[str, Any]:
    return {i.url: i for i in pool.instances}


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return value


# ---------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------


def test_least_loaded_picks_the_fewest_in_flight_and_spreads_ties() -> None:
    pool, _ = _pool(A, B, C)
    inst = _by_url(pool)
    inst[A].in_flight, inst[B].in_flight, inst[C].in_flight = 2, 0, 1
    assert {pool.choose().url for _ in range(10)} == {B}  # type: ignore[union-attr]
    inst[B].in_flight = 2
    assert {pool.choose().url for _ in range(10)} == {C}  # type: ignore[union-attr]
    inst[C].in_flight = 2
    assert {pool.choose().url for _ in range(10)} == {A, B, C}  # type: ignore[union-attr]
    assert pool.choose(exclude=[inst[A], inst[B]]) is inst[C]


def test_prefix_hash_keeps_a_prefix_on_one_instance_and_spreads_prefixes() -> None:
    pool, _ = _pool(A, B, policy="prefix_hash", prefix_chars=64, slack=2)
    system = "You are a careful assistant. " * 4
    shared = [
        pool.key({"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]})
        for i in range(20)
    ]
    assert len(set(shared)) == 1  # the first 64 characters are the system prompt's
    homes = {pool.choose(key).url for key in shared}  # type: ignore[union-attr]
    assert len(homes) == 1
    spread = {pool.choose(pool.key({"prompt": f"{i} different start"})).url for i in range(40)}  # type: ignore[union-attr]
    assert spread == {A, B}
    assert pool.key(None) is None and _pool(A)[0].key({"prompt": "x"}) is None  # least_loaded: no key


def test_prefix_hash_falls_back_to_least_loaded_when_home_is_out_or_much_busier() -> None:
    pool, _ = _pool(A, B, policy="prefix_hash", slack=2)
    inst = _by_url(pool)
    key = prefix_key({"prompt": "def f(x):"}, 256)
    home = pool.choose(key)
    assert home is not None
    other = inst[B] if home is inst[A] else inst[A]
    home.in_flight = 2  # within the slack of the idle other: still home
    assert pool.choose(key) is home
    home.in_flight = 3  # beyond it: the least loaded
    assert pool.choose(key) is other
    home.in_flight = 0
    for _ in range(3):
        home.breaker.failed("HTTP 500")
    assert home.breaker.state is BreakerState.OPEN and pool.choose(key) is other


# ---------------------------------------------------------------------------------------------------
# The breaker
# ---------------------------------------------------------------------------------------------------


def test_breaker_transitions() -> None:
    clock, seen = Clock(), []
    br = Breaker("a", failures_to_open=3, open_s=5.0, on_change=seen.append, clock=clock)
    br.failed("x")
    br.failed("x")
    br.succeeded()  # not in a row: still closed
    br.failed("x")
    br.failed("x")
    assert br.state is BreakerState.CLOSED and br.admits()
    br.failed("connection refused")
    assert br.state is BreakerState.OPEN and not br.admits() and br.reason == "connection refused"
    assert not br.probe_due() and br.retry_after_s() == 5.0
    clock.now += 5.0
    assert br.probe_due()
    br.probed(False, "still down")  # waits open_s again
    assert br.state is BreakerState.OPEN and not br.probe_due() and br.reason == "still down"
    clock.now += 5.0
    br.probed(True)
    assert br.state is BreakerState.HALF_OPEN and br.admits()
    br.started()  # the trial: one at a time
    assert not br.admits()
    br.no_verdict()  # cancelled: another trial may go
    assert br.admits()
    br.started()
    br.failed("HTTP 503")  # the trial failed: open again at once
    assert br.state is BreakerState.OPEN and not br.admits()
    clock.now += 5.0
    br.probed(True)
    br.started()
    br.succeeded()
    assert br.state is BreakerState.CLOSED and br.admits() and br.failures == 0 and br.reason is None
    assert [s.value for s in seen] == ["open", "half_open", "open", "half_open", "closed"]
    br.probed(True)  # a probe of a closed breaker changes nothing
    assert br.state is BreakerState.CLOSED


# ---------------------------------------------------------------------------------------------------
# Calls through the pool
# ---------------------------------------------------------------------------------------------------

Work = Callable[[Any], Awaitable[str]]


def _work(fail: dict[str, Exception], calls: list[str]) -> Work:
    async def work(url: Any) -> str:
        calls.append(url)
        await anyio.sleep(0)
        if url in fail:
            raise fail[url]
        return f"answer of {url}"

    return work


def _unreachable() -> InstanceFailed:
    return InstanceFailed(502, "prefill server unreachable: ClientConnectorError", outcome="prefill_error", retry=True)


def test_a_call_its_instance_failed_runs_once_more_on_the_other() -> None:
    pool, metrics = _pool(A, B, failures_to_open=2)
    calls: list[str] = []

    async def main() -> list[str]:
        return [await pool.call(_work({A: _unreachable()}, calls)) for _ in range(6)]

    answers = anyio.run(main)
    assert answers == [f"answer of {B}"] * 6  # no failure reaches the caller
    assert calls.count(A) == 2 and calls.count(B) == 6  # A is taken out after its second failure
    inst = _by_url(pool)
    assert inst[A].breaker.state is BreakerState.OPEN and inst[A].in_flight == inst[B].in_flight == 0
    assert _sample(metrics, "tilert:prefill_retries_total") == 2
    assert _sample(metrics, "tilert:prefill_requests_total", instance=A, outcome="failed") == 2
    assert _sample(metrics, "tilert:prefill_requests_total", instance=B, outcome="ok") == 6
    assert _sample(metrics, "tilert:prefill_instance_state", instance=A, state="open") == 1
    assert _sample(metrics, "tilert:prefill_instance_state", instance=A, state="closed") == 0
    assert _sample(metrics, "tilert:prefill_instance_state", instance=B, state="closed") == 1


def test_what_is_not_retried() -> None:
    """A timeout (the instance may still be working on it), an answer of the instance's (a 4xx, a busy connector),
    and a success are never run again; a failure with no other instance left is the caller's."""
    pool, _ = _pool(A, B)
    timeout = InstanceFailed(504, "prefill timed out", outcome="prefill_timeout", retry=False)
    rejected = RouterError(400, "bad prompt", outcome="prefill_rejected")
    for fail in (timeout, rejected):
        calls: list[str] = []
        with pytest.raises(RouterError) as err:
            anyio.run(pool.call, _work({A: fail, B: fail}, calls))
        assert err.value is fail and len(calls) == 1
    alone, _ = _pool(A)
    calls = []
    with pytest.raises(InstanceFailed):
        anyio.run(alone.call, _work({A: _unreachable()}, calls))
    assert calls == [A]
    calls = []
    assert anyio.run(pool.call, _work({}, calls)) in (f"answer of {A}", f"answer of {B}") and len(calls) == 1
    both, _ = _pool(A, B)
    calls = []
    with pytest.raises(InstanceFailed):
        anyio.run(both.call, _work({A: _unreachable(), B: _unreachable()}, calls))
    assert sorted(calls) == [A, B]  # once each, never more


def test_a_relayed_5xx_counts_as_a_failure_and_is_retried() -> None:
    pool, _ = _pool(A, B, failures_to_open=1)
    calls: list[str] = []

    async def relay(url: Any) -> tuple[int, str]:
        calls.append(url)
        return (500 if url == A else 200), url

    def failure(answer: tuple[int, str]) -> str | None:
        return f"HTTP {answer[0]}" if answer[0] >= 500 else None

    got = [anyio.run(lambda: pool.call(relay, failure=failure)) for _ in range(3)]
    assert got == [(200, B)] * 3 and calls.count(A) == 1
    assert _by_url(pool)[A].breaker.state is BreakerState.OPEN


def test_no_instance_left_is_a_fast_503_with_retry_after_and_none_is_leaked() -> None:
    clock = Clock()
    pool, _ = _pool(A, B, clock=clock, failures_to_open=1, open_s=7.0)
    for inst in pool.instances:
        inst.breaker.failed("refused")
    calls: list[str] = []
    with pytest.raises(RouterError) as err:
        anyio.run(pool.call, _work({}, calls))
    assert err.value.status == 503 and err.value.outcome == "prefill_unavailable" and calls == []
    assert "no prefill instance is available" in err.value.message and err.value.headers["Retry-After"] == "7"

    async def cancelled() -> None:
        with anyio.move_on_after(0.05):
            await pool.call(_slow)

    clock.now += 7.0
    for inst in pool.instances:
        inst.breaker.probed(True)  # half-open: a trial each
    anyio.run(cancelled)  # the trial is cancelled: no verdict, nothing in flight, the trial may go again
    assert all(i.in_flight == 0 and i.breaker.admits() for i in pool.instances)


async def _slow(url: Any) -> str:
    await anyio.sleep(10)
    return "never"


# ---------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------


def _config(tmp_path: Path, **kw: Any) -> RouterConfig:
    return RouterConfig(decode_nodes=[], model_dir=str(tmp_path), secret=SECRET, **kw)


def test_router_settings_take_one_or_several_prefill_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"model_dir": str(tmp_path), "decode": ["127.0.0.1:5:6"]}
    monkeypatch.setenv("TILERT_SECRET", SECRET.decode())
    one = load_router_config(toml_data={**base, "prefill_url": "http://p:1/"})
    assert one.prefill_urls == ["http://p:1"] and one.prefill_policy == "least_loaded"
    two = load_router_config(toml_data={**base, "prefill_urls": [A, B], "prefill_policy": "prefix_hash"})
    assert two.prefill_urls == [A, B] and two.prefill_policy == "prefix_hash"
    monkeypatch.setenv("TILERT_ROUTER_PREFILL_URL", f"{A},{B}")
    assert load_router_config(toml_data=base).prefill_urls == [A, B]
    from tilert.cli import parser

    args = parser().parse_args(
        ["router", "--prefill-url", A, "--prefill-url", B, "--decode", "h:5:6", "--model", str(tmp_path)]
    )
    assert cli_values(RouterConfig, args)["prefill_urls"] == [A, B]


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"prefill_urls": []}, "at least one prefill instance is required"),
        ({"prefill_urls": [A, A + "/"]}, "duplicate prefill instances"),
        ({"prefill_urls": [A, "ftp://x"]}, "must be an http(s) URL"),
        ({"prefill_urls": [A + "/v1"]}, "without /v1"),
        ({"prefill_urls": ["http://u:secret@127.0.0.1:8000"]}, "must carry no credentials"),
        ({"prefill_urls": [A + "/?x=1"]}, "without a query or fragment"),
        ({"prefill_urls": ["http://127.0.0.1:99999"]}, "has no valid port"),
        ({"prefill_urls": [A], "prefill_policy": "random"}, "prefill_policy (--prefill-policy"),
        ({"prefill_urls": [A], "prefill_breaker_failures": 0}, "prefill_breaker_failures"),
        ({"prefill_urls": [A], "prefill_breaker_open_s": 0}, "prefill_breaker_open_s"),
        ({"prefill_urls": [A], "prefill_prefix_chars": 0}, "prefill_prefix_chars"),
    ],
)
def test_bad_prefill_settings_are_refused_with_the_reason(tmp_path: Path, kw: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, **kw).validate()
    assert reason in str(err.value)


def test_a_prefill_url_with_credentials_is_refused_without_repeating_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, prefill_urls=["http://user:pa55word@127.0.0.1:8000"]).validate()
    assert "credentials" in str(err.value) and "pa55word" not in str(err.value)


def test_tilert_up_starts_n_prefill_instances_on_consecutive_ports(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    cfg = stack.StackConfig(model=tmp_path, prefill_port=9100, prefill_instances=3, engine_cpus="none")
    assert stack.prefill_ports(cfg) == [9100, 9101, 9102]
    st = stack.Stack(cfg)
    commands = st.commands()
    assert [n for n in commands if n.startswith("prefill")] == ["prefill", "prefill-2", "prefill-3"]
    assert [c[c.index("--port") + 1] for n, c in commands.items() if n.startswith("prefill")] == [
        "9100",
        "9101",
        "9102",
    ]
    router = commands["router"]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--prefill-url"] == [
        "http://127.0.0.1:9100",
        "http://127.0.0.1:9101",
        "http://127.0.0.1:9102",
    ]
    assert list(st.urls)[:3] == ["prefill", "prefill-2", "prefill-3"]
    for bad, reason in (
        ({"prefill_instances": 0}, "prefill_instances (--prefill-instances, $TILERT_UP_PREFILL_INSTANCES) must be"),
        ({"prefill_instances": 2, "port": 9101}, "the stack's ports must differ"),
        ({"prefill_instances": 2, "native": True}, "not available with --native"),
        ({"prefill_instances": 3, "prefill_port": 65534}, "passes 65535"),
    ):
        with pytest.raises(ConfigError, match="prefill") as err:
            stack.StackConfig(model=tmp_path, **{"prefill_port": 9100, **bad}).validate()
        assert reason in str(err.value)
