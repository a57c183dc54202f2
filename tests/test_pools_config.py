"""The two-pool policy without vLLM: routing rules, config refusals, the native plugin and the stack's commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tilert.router.config import RouterConfig
from tilert.router.errors import RouterError
from tilert.router.routing import choose_pool
from tilert.settings import ConfigError

SECRET = b"0123456789abcdef0123456789abcdef"


def _config(tmp_path: Path, **kw: object) -> RouterConfig:
    urls = ["http://127.0.0.1:1"]
    cfg = RouterConfig(prefill_urls=urls, decode_nodes=[], model_dir=str(tmp_path), secret=SECRET, **kw)  # type: ignore[arg-type]
    from tilert.router.config import parse_decode_nodes

    cfg.decode_nodes = parse_decode_nodes("127.0.0.1:1:2")
    return cfg.validate()


def test_header_then_model_then_default(tmp_path: Path) -> None:
    cfg = _config(
        tmp_path,
        native_url="http://127.0.0.1:9",
        pool_models={"fast": "tilert", "bulk": "vllm"},
        default_pool="vllm",
        overflow_wait_s=0.5,
    )
    assert (choose_pool(cfg, "tilert", "bulk").pool, choose_pool(cfg, "tilert", "bulk").reason) == ("tilert", "header")
    assert choose_pool(cfg, " VLLM ", "fast").pool == "vllm"
    assert (choose_pool(cfg, None, "fast").pool, choose_pool(cfg, None, "fast").reason) == ("tilert", "model")
    assert choose_pool(cfg, None, "bulk").pool == "vllm"
    assert (choose_pool(cfg, None, "other").pool, choose_pool(cfg, None, "other").reason) == ("vllm", "default")
    assert choose_pool(cfg, None, "fast").overflow and not choose_pool(cfg, None, "bulk").overflow
    with pytest.raises(RouterError) as bad:
        choose_pool(cfg, "gpu", None)
    assert bad.value.status == 400 and "tilert, vllm" in bad.value.message


def test_native_header_without_native_pool_is_400(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    assert choose_pool(cfg, None, "m").pool == "tilert" and not choose_pool(cfg, None, "m").overflow
    with pytest.raises(RouterError) as bad:
        choose_pool(cfg, "vllm", "m")
    assert bad.value.status == 400 and "no native decode pool" in bad.value.message


def test_what_the_tilert_pool_cannot_serve_goes_native(tmp_path: Path) -> None:
    from tilert.router.errors import unsupported

    refusal = unsupported("n", "one choice per request")
    cfg = _config(tmp_path, native_url="http://127.0.0.1:9")
    choice = choose_pool(cfg, None, "m", refusal)
    assert (choice.pool, choice.reason, choice.overflow) == ("vllm", "unsupported", False)
    assert choice.why is not None and "'n'" in choice.why
    assert choose_pool(cfg, "vllm", "m", refusal).reason == "header"  # asked for: no reason to give
    with pytest.raises(RouterError) as asked:  # the TileRT pool named by the header: the field's 400
        choose_pool(cfg, "tilert", "m", refusal)
    assert asked.value is refusal
    for off in (_config(tmp_path), _config(tmp_path, native_url="http://127.0.0.1:9", unsupported_to_native=False)):
        with pytest.raises(RouterError) as refused:
            choose_pool(off, None, "m", refusal)
        assert refused.value.status == 400 and refused.value.param == "n"


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"default_pool": "vllm"}, "no native pool is configured"),
        ({"default_pool": "fast"}, "default_pool must be one of tilert, vllm"),
        ({"native_url": "http://127.0.0.1:9", "pool_models": {"m": "gpu"}}, "pool_models['m'] must be one of"),
        ({"overflow_wait_s": 1.0}, "set native_url"),
        ({"native_url": "http://127.0.0.1:9", "overflow_wait_s": -1.0}, "must be a number >= 0"),
        ({"native_url": "http://127.0.0.1:9/v1"}, "without /v1"),
        ({"native_url": "127.0.0.1:9"}, "http(s) server root"),
    ],
)
def test_bad_pool_settings_are_refused(tmp_path: Path, kw: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError) as exc:
        _config(tmp_path, **kw)
    assert reason in str(exc.value)


def _refused(args: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")} | {"TILERT_SECRET": SECRET.decode()}
    proc = subprocess.run(
        [sys.executable, "-m", "tilert.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.stderr


def test_start_up_refusals(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    router = ["router", "--prefill-url", "http://127.0.0.1:1", "--decode", "127.0.0.1:1:2", "--model", str(tmp_path)]
    assert "set native_url" in _refused([*router, "--overflow-wait-s", "1"])
    assert "--pool-models: expected a JSON object" in _refused([*router, "--pool-models", "[1]"])
    assert "add --native" in _refused(["up", "--model", str(tmp_path), "--overflow-wait-s", "1"])
    assert "native decode pool" in _refused(["decode", "--model", str(tmp_path), "--engine", "vllm"])


def test_native_plugin_and_stack_commands(tmp_path: Path) -> None:
    """The plugin is found through the entry-point group; the stack wires MultiConnector and both sides' NIXL."""
    from tilert.engines.plugin import load_native_pool
    from tilert.plugins import available
    from tilert.stack import Stack, StackConfig

    assert {"tilert", "vllm"} <= set(available("tilert.engines"))
    plugin = load_native_pool("vllm")
    cfg = StackConfig(
        model=tmp_path,
        native=True,
        native_port=8201,
        prefill_side_port=5611,
        native_side_port=5612,
        overflow_wait_s=0.25,
    )
    stack = Stack(cfg)
    cmds = stack.commands()
    assert list(cmds) == ["prefill", "native", "decode", "router"]
    kv = json.loads(cmds["prefill"][cmds["prefill"].index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "MultiConnector" and kv["kv_role"] == "kv_producer"
    children = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in children] == ["TileRTConnector", "NixlConnector"]
    assert all(c["kv_role"] == "kv_producer" for c in children)
    native_kv = json.loads(cmds["native"][cmds["native"].index("--kv-transfer-config") + 1])
    assert native_kv == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert "--disable-hybrid-kv-cache-manager" in cmds["native"]
    assert cmds["router"][cmds["router"].index("--native-url") + 1] == "http://127.0.0.1:8201"
    assert cmds["router"][cmds["router"].index("--overflow-wait-s") + 1] == "0.25"
    assert stack.extra_env("prefill")["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert stack.extra_env("native")["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5612"
    assert (
        stack.extra_env("prefill")["VLLM_CPU_OMP_THREADS_BIND"]
        != stack.extra_env("native")["VLLM_CPU_OMP_THREADS_BIND"]
    )
    assert stack.extra_env("decode") == {}
    assert plugin.prefill_params()["do_remote_decode"] is True
    plain = Stack(StackConfig(model=tmp_path)).commands()
    assert list(plain) == ["prefill", "decode", "router"] and "--native-url" not in plain["router"]
    assert json.loads(plain["prefill"][plain["prefill"].index("--kv-transfer-config") + 1])["kv_connector"] == (
        "TileRTConnector"
    )


def test_native_handoff_contract() -> None:
    from tilert.contracts import ContractError, NativeHandoff

    answer = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[3, 4]],
        "remote_engine_id": "e1",
        "remote_request_id": "cmpl-x",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    handoff = NativeHandoff.from_params(answer)
    assert handoff is not None and handoff.raw == answer
    assert NativeHandoff.from_params(None) is None and NativeHandoff.from_params({"tilert_error": "x"}) is None
    for bad in ({"remote_port": "5600"}, {"remote_block_ids": [["3"]]}, {"do_remote_prefill": False}):
        with pytest.raises(ContractError):
            NativeHandoff.from_params(answer | bad)


def test_multiconnector_rebuilds_the_tilert_connector_stats() -> None:
    """Under MultiConnector vLLM's API server rebuilds each sub-connector's stats by looking the class up by name
    in vLLM's connector registry: importing the connector registers it (else every request fails with a 500)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    import tilert.connector  # noqa: F401 - the import registers it
    from tilert.connector.stats import TileRTConnectorStats

    data = {"capacity_bytes": 1024, "used_bytes": 0, "in_flight": 0}
    stats = MultiConnector.build_kv_connector_stats(data={"TileRTConnector": data})
    assert stats is not None
    rebuilt = stats.data["TileRTConnector"]
    assert isinstance(rebuilt, TileRTConnectorStats) and rebuilt.reduce() == data
