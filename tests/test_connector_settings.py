"""``TileRTConnector``'s ``kv_connector_extra_config`` is a typed contract: every key known, every value checked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tilert.connector import TileRTConnector
from tilert.contracts import DEFAULT_POLL_WAIT_S, ConnectorSettings, ContractError


def test_defaults_and_round_trip() -> None:
    s = ConnectorSettings.from_extra(None)
    assert (s.transport, s.staging_bytes, s.staging_device, s.poll_wait_s) == ("tcp", None, "cpu", DEFAULT_POLL_WAIT_S)
    assert s.to_extra() == {}
    given = {
        "tilert_transport": "nixl",
        "tilert_transport_options": {"net_devices": ["lo"], "lanes": 2, "timeout_s": 5.0},
        "tilert_staging_bytes": 1 << 20,
        "tilert_staging_device": "cache",
        "tilert_secret_file": "/run/secret",
    }
    s = ConnectorSettings.from_extra(given)
    assert s.transport == "nixl" and s.staging_bytes == 1 << 20 and s.transport_options["net_devices"] == ["lo"]
    assert s.to_extra() == given
    assert set(given) <= set(ConnectorSettings.keys())


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"tilert_staging_byte": 1 << 20}, "tilert_staging_byte"),  # a typo is refused, not ignored
        ({"tilert_staging_bytes": 0}, "tilert_staging_bytes"),
        ({"tilert_staging_bytes": "1024"}, "tilert_staging_bytes"),
        ({"tilert_staging_bytes": True}, "tilert_staging_bytes"),
        ({"tilert_staging_device": "gpu"}, "tilert_staging_device"),
        ({"tilert_sender_threads": 0}, "tilert_sender_threads"),
        ({"tilert_timeout_s": -1}, "tilert_timeout_s"),
        ({"tilert_poll_wait_s": 60}, "tilert_poll_wait_s"),
        ({"tilert_transport_options": {"nested": {"a": 1}}}, "tilert_transport_options"),
    ],
)
def test_a_wrong_key_or_value_is_refused_with_its_name(extra: dict[str, object], named: str) -> None:
    with pytest.raises(ContractError, match=named):
        ConnectorSettings.from_extra(extra)


def test_the_connector_reads_its_settings_through_the_contract() -> None:
    assert TileRTConnector.settings({"tilert_transport": "mooncake"}).transport == "mooncake"
    with pytest.raises(ContractError, match="tilert_transprt"):
        TileRTConnector.settings({"tilert_transprt": "mooncake"})


EMBEDDED_LOGS = """
import logging, sys, time
import structlog
from tilert.logs import configure_embedded
root = list(logging.getLogger().handlers)
configure_embedded()
assert logging.getLogger().handlers == root, "the host's logging is its own"
log = structlog.get_logger("tilert.connector")
log.info("below_the_level")
try:
    raise RuntimeError("boom")
except RuntimeError:
    t0 = time.monotonic()
    log.exception("staging_failed", transfer_id="t-1")
    print(f"rendered in {time.monotonic() - t0:.3f}s", file=sys.stdout)
"""


def test_the_connector_logs_follow_tilerts_settings_inside_its_host() -> None:
    """In vLLM's process the connector's lines take ``TILERT_LOG_LEVEL`` / ``TILERT_LOG_FORMAT`` (the stack sets
    them), leave vLLM's :mod:`logging` alone, and render an exception as plain text (structlog's default rich
    traceback holds the logging thread, vLLM's forward, for a large part of a second). A wrong value refuses."""
    env = {"TILERT_LOG_LEVEL": "warning", "TILERT_LOG_FORMAT": "json", "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", EMBEDDED_LOGS], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["staging_failed"]
    assert lines[0]["transfer_id"] == "t-1" and "RuntimeError: boom" in lines[0]["exception"]
    assert float(proc.stdout.split()[2].rstrip("s")) < 0.1, proc.stdout
    env = {"TILERT_LOG_FORMAT": "xml"}
    bad = subprocess.run([sys.executable, "-c", EMBEDDED_LOGS], capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0 and "the log format must be one of console, json" in bad.stderr
