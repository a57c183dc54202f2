"""``TileRTConnector``'s ``kv_connector_extra_config`` is a typed contract: every key known, every value checked."""

from __future__ import annotations

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
