"""Settings: one definition per setting, the same flag / env var / TOML key in every launch mode.

Fast and offline: no vLLM, no server (``tilert up``'s children are checked from their command lines).
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tilert import cli, stack
from tilert.decode import config as decode_config
from tilert.decode.config import DEFAULT_MAX_LEASE_S, DecodeConfig
from tilert.router.config import (
    RouterConfig,
    default_reserve_lease_s,
    load_config,
    load_config_from_env,
)
from tilert.settings import ConfigError

SECRET = "s" * 40
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TILERT_* variable from the caller's shell leaks in; a valid shared secret by default."""
    for name in list(os.environ):
        if name.startswith("TILERT_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TILERT_SECRET", SECRET)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def router_args(model: Path, *extra: str) -> list[str]:
    return [
        "router",
        "--prefill-url",
        "http://127.0.0.1:8000",
        "--decode",
        "127.0.0.1:5556:5557",
        "--model",
        str(model),
        *extra,
    ]


def router_from_cli(argv: list[str]) -> RouterConfig:
    return cli.router_config(cli.parser().parse_args(argv))


def decode_from_cli(argv: list[str]) -> DecodeConfig:
    return cli.decode_config(cli.parser().parse_args(argv))


def up_from_cli(argv: list[str]) -> stack.StackConfig:
    return cli.up_config(cli.parser().parse_args(argv))


def write_toml(tmp_path: Path, model: Path, body: str = "") -> Path:
    p = tmp_path / "router.toml"
    p.write_text(
        f'prefill_url = "http://127.0.0.1:8000"\nmodel_dir = "{model}"\ndecode = ["127.0.0.1:5556:5557"]\n' + body
    )
    return p


# -- precedence ------------------------------------------------------------------------------------


def test_router_precedence_flag_env_toml_default(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    toml = write_toml(tmp_path, model, "max_queue = 10\nqueue_timeout_s = 5.0\nport = 1111\n")
    monkeypatch.setenv("TILERT_ROUTER_MAX_QUEUE", "20")
    monkeypatch.setenv("TILERT_ROUTER_QUEUE_TIMEOUT_S", "7")
    cfg = router_from_cli(router_args(model, "--config", str(toml), "--max-queue", "30"))
    assert cfg.max_queue == 30  # flag over env over TOML
    assert cfg.queue_timeout_s == 7.0  # env over TOML
    assert cfg.port == 1111  # TOML over default
    assert cfg.retry_after_s == 1  # default
    # The TOML file may come from $TILERT_ROUTER_CONFIG as well.
    monkeypatch.setenv("TILERT_ROUTER_CONFIG", str(toml))
    assert router_from_cli(router_args(model)).port == 1111


def test_router_required_settings_from_env_alone(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`uvicorn tilert.router:app` may be configured by the environment without a TOML file."""
    monkeypatch.setenv("TILERT_ROUTER_PREFILL_URL", "http://10.0.0.1:8000/")
    monkeypatch.setenv("TILERT_ROUTER_DECODE_NODES", "10.0.0.2:5556:5557,[::1]:6556:6557")
    monkeypatch.setenv("TILERT_ROUTER_MODEL_DIR", str(model))
    monkeypatch.setenv("TILERT_ROUTER_DEFAULT_MAX_TOKENS", "64")
    cfg = load_config_from_env()
    assert cfg.prefill_urls == ["http://10.0.0.1:8000"]
    assert [n.host for n in cfg.decode_nodes] == ["10.0.0.2", "::1"]
    assert cfg.default_max_tokens == 64
    assert cfg.secret == SECRET.encode()
    # and the same variables reach `tilert router`, whose flags still win
    assert router_from_cli(["router", "--default-max-tokens", "8"]).default_max_tokens == 8


def test_env_app_without_any_config_names_the_ways_to_give_it() -> None:
    with pytest.raises(ConfigError, match="TILERT_ROUTER_CONFIG") as err:
        load_config_from_env()
    assert "--prefill-url" in str(err.value) and "TILERT_ROUTER_PREFILL_URL" in str(err.value)


def test_decode_precedence_flag_env_default(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_DECODE_NUM_SLOTS", "4")
    monkeypatch.setenv("TILERT_DECODE_MAX_SEQ_LEN", "128")
    monkeypatch.setenv("TILERT_DECODE_MODEL", str(model))
    cfg = decode_from_cli(["decode", "--slots", "3", "--transport-options", '{"a": 1}'])
    assert cfg.num_slots == 3 and cfg.max_seq_len == 128 and cfg.model == model
    assert cfg.transport_options == {"a": 1}
    assert cfg.lease_s == 30.0 and cfg.max_lease_s == DEFAULT_MAX_LEASE_S
    assert cfg.secret == SECRET.encode()


def test_decode_sequences_default_follows_the_device(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``--max-sequences``: 8 on a CPU host, 4 on a GPU (``auto`` asks CUDA); given, it wins; the receive
    slots follow (as many); out of range is refused, and more slots than sequences."""
    import torch

    monkeypatch.setenv("TILERT_DECODE_MODEL", str(model))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = decode_from_cli(["decode"])
    assert cpu.max_sequences is None and cpu.sequences == 8 and cpu.slots == 8
    assert decode_from_cli(["decode", "--device", "cuda"]).sequences == 4  # as given, checked when loading
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert decode_from_cli(["decode"]).sequences == 4 and decode_from_cli(["decode", "--device", "cpu"]).sequences == 8
    given = decode_from_cli(["decode", "--max-sequences", "3"])
    assert given.sequences == 3 and given.slots == 3
    with pytest.raises(ConfigError, match="must be in 1..64"):
        decode_from_cli(["decode", "--max-sequences", "0"])
    assert decode_from_cli(["decode", "--max-sequences", "3", "--slots", "2"]).slots == 2
    with pytest.raises(ConfigError, match=r"--slots.* must be at most the sequences decoded at once.*\(4 > 3\)"):
        decode_from_cli(["decode", "--max-sequences", "3", "--slots", "4"])


# -- secrets ----------------------------------------------------------------------------------------


def test_api_key_never_a_flag(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parser().parse_args(router_args(model, "--api-key", "k"))
    assert exc.value.code == 2


def test_api_key_from_env_in_the_cli_path(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert router_from_cli(router_args(model)).api_key is None
    monkeypatch.setenv("TILERT_ROUTER_API_KEY", "from-env")
    cfg = router_from_cli(router_args(model))
    assert cfg.api_key == "from-env"
    assert "from-env" not in repr(cfg) and SECRET not in repr(cfg)
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert router_from_cli(router_args(model, "--api-key-file", str(key_file))).api_key == "from-file"  # flag wins
    monkeypatch.delenv("TILERT_ROUTER_API_KEY")
    monkeypatch.setenv("TILERT_ROUTER_API_KEY_FILE", str(key_file))
    assert router_from_cli(router_args(model)).api_key == "from-file"
    monkeypatch.setenv("TILERT_ROUTER_PREFILL_API_KEY", "to-vllm")
    assert router_from_cli(router_args(model)).prefill_api_key == "to-vllm"


def test_api_key_from_env_in_the_toml_path(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    toml = write_toml(tmp_path, model, f'api_key_file = "{key_file}"\n')
    assert load_config(toml).api_key == "from-file"
    monkeypatch.setenv("TILERT_ROUTER_API_KEY", "from-env")
    assert load_config(toml).api_key == "from-env"  # env over TOML, whichever form each uses
    monkeypatch.setenv("TILERT_ROUTER_CONFIG", str(toml))
    assert load_config_from_env().api_key == "from-env"  # the uvicorn mode
    toml.write_text(toml.read_text() + 'api_key = "inline"\n')
    with pytest.raises(ConfigError, match="api_key does not belong in"):
        load_config(toml)


def test_both_forms_of_a_key_in_one_place_are_refused(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k\n")
    monkeypatch.setenv("TILERT_ROUTER_API_KEY", "a")
    monkeypatch.setenv("TILERT_ROUTER_API_KEY_FILE", str(key_file))
    with pytest.raises(ConfigError, match="TILERT_ROUTER_API_KEY_FILE"):
        router_from_cli(router_args(model))


def test_missing_secret_is_refused_at_start_up(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TILERT_SECRET")
    assert cli.main(router_args(model)) == 2
    err = capsys.readouterr().err
    assert "tilert router: " in err and "no shared secret" in err and "TILERT_SECRET_FILE" in err
    assert cli.main(["decode", "--model", str(model)]) == 2
    assert "no shared secret" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no shared secret"):
        RouterConfig(prefill_urls=["http://h:1"], decode_nodes=[], model_dir=str(model)).validate()


def test_secret_file_flag(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TILERT_SECRET")
    secret = tmp_path / "secret"
    secret.write_text("f" * 32 + "\n")
    assert router_from_cli(router_args(model, "--secret-file", str(secret))).secret == b"f" * 32
    assert decode_from_cli(["decode", "--model", str(model), "--secret-file", str(secret)]).secret == b"f" * 32
    with pytest.raises(ConfigError, match="cannot read the secret file"):
        router_from_cli(router_args(model, "--secret-file", str(tmp_path / "missing")))


# -- bad values ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command,var,value",
    [
        ("router", "TILERT_ROUTER_MAX_QUEUE", "lots"),
        ("router", "TILERT_ROUTER_PREFILL_TIMEOUT_S", "soon"),
        ("router", "TILERT_ROUTER_DECODE_NODES", "host:5556"),
        ("decode", "TILERT_DECODE_NUM_SLOTS", "two"),
        ("decode", "TILERT_DECODE_TRANSPORT_OPTIONS", "[1]"),
    ],
)
def test_bad_env_value_exits_2_naming_the_variable(
    command: str,
    var: str,
    value: str,
    model: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(var, value)
    argv = router_args(model) if command == "router" else ["decode", "--model", str(model)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"${var}" in err and "Traceback" not in err, err


def test_bad_values_are_all_named_at_once(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["decode", "--model", str(model), "--slots", "0", "--max-seq-len", "1", "--dtype", "f8"]) == 2
    err = capsys.readouterr().err
    assert "--slots" in err and "--max-seq-len" in err and "--dtype" in err


def test_engine_cpus_parsed_and_refused_with_a_reason(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    usable = sorted(os.sched_getaffinity(0))
    cfg = decode_from_cli(["decode", "--model", str(model), "--engine-cpus", f"{usable[0]}-{usable[-1]}"])
    assert cfg.engine_cpu_set == frozenset(range(usable[0], usable[-1] + 1))
    assert decode_from_cli(["decode", "--model", str(model)]).engine_cpu_set == frozenset()
    for bad, why in [("1-0", "empty CPU range"), ("x", "not a CPU number"), ("4096", "may not use")]:
        assert cli.main(["decode", "--model", str(model), "--engine-cpus", bad]) == 2
        err = capsys.readouterr().err
        assert "--engine-cpus" in err and why in err, err


# -- leases ------------------------------------------------------------------------------------------------


def test_reserve_lease_outlives_prefill_and_transfer(model: Path) -> None:
    cfg = router_from_cli(router_args(model, "--prefill-timeout-s", "100", "--transfer-timeout-s", "20"))
    assert cfg.reserve_lease_s == 150.0
    assert router_from_cli(router_args(model)).reserve_lease_s == default_reserve_lease_s() == 660.0
    with pytest.raises(ConfigError, match="reserve_lease_s .* shorter than prefill_timeout_s"):
        router_from_cli(router_args(model, "--prefill-timeout-s", "100", "--reserve-lease-s", "60"))
    assert (
        router_from_cli(router_args(model, "--prefill-timeout-s", "100", "--reserve-lease-s", "130")).reserve_lease_s
        == 130
    )


def test_decode_lease_cap(model: Path) -> None:
    assert decode_from_cli(["decode", "--model", str(model), "--max-lease-s", "900"]).max_lease_s == 900
    with pytest.raises(ConfigError, match="lease_s"):
        decode_from_cli(["decode", "--model", str(model), "--lease-s", "100", "--max-lease-s", "50"])


def test_max_tokens_and_body_defaults(model: Path) -> None:
    cfg = router_from_cli(router_args(model))
    assert cfg.default_max_tokens is None and cfg.max_body_bytes == 16 << 20
    with pytest.raises(ConfigError, match="default_max_tokens"):
        router_from_cli(router_args(model, "--default-max-tokens", "0"))


# -- tilert up ---------------------------------------------------------------------------------------------


def test_up_children_carry_no_secret_and_agree(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    monkeypatch.setenv("TILERT_SECRET", "inherited-" + SECRET)  # the parent's own secret must not leak through
    st = stack.Stack(stack.StackConfig(model=model))
    try:
        env = st.child_env()
        secret_file = Path(env["TILERT_SECRET_FILE"])
        secret = secret_file.read_text().strip()
        assert len(secret) >= 32 and "TILERT_SECRET" not in env
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
        commands = st.commands()
        assert set(commands) == {"prefill", "decode", "router"}
        for name, cmd in commands.items():
            line = " ".join(cmd)
            assert secret not in line and SECRET not in line, name
            assert "secret" not in line.lower() and "api-key" not in line, name
        # The children's flags parse, and with the environment they get, agree on the lease.
        monkeypatch.delenv("TILERT_SECRET")
        monkeypatch.setenv("TILERT_SECRET_FILE", str(secret_file))
        router = router_from_cli(commands["router"][3:])
        decode = decode_from_cli(commands["decode"][3:])
        assert router.secret == decode.secret == secret.encode()
        assert router.reserve_lease_s is not None and router.reserve_lease_s <= decode.max_lease_s
    finally:
        st.cleanup()
    assert not secret_file.parent.exists()


def test_up_lease_option_moves_the_node_cap() -> None:
    cfg = stack.StackConfig(model=Path("/m"), reserve_lease_s=5000.0)
    router_lease, node_cap = stack.leases(cfg)
    assert router_lease == 5000.0 and node_cap == 5000.0
    cmd = stack.decode_command(cfg)
    assert cmd[cmd.index("--max-lease-s") + 1] == "5000.0"


def test_up_advertised_address_is_what_its_processes_dial(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound to every interface, the stack's processes still reach each other (and print their URLs) at loopback,
    or at ``--advertise-host``: the router's prefill URL and decode node, and the node's write grants."""
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    for argv, dialled in (
        ([], "127.0.0.1"),
        (["--host", "0.0.0.0"], "127.0.0.1"),
        (["--host", "0.0.0.0", "--advertise-host", "10.1.2.3"], "10.1.2.3"),
        (["--host", "10.1.2.3"], "10.1.2.3"),
    ):
        cfg = up_from_cli(["up", "--model", str(model), *argv]).validate()
        router = router_from_cli(stack.router_command(cfg)[3:])
        decode = decode_from_cli(stack.decode_command(cfg)[3:])
        assert router.prefill_urls == [f"http://{dialled}:8100"], argv
        assert [n.name for n in router.decode_nodes] == [f"{dialled}:5556:5557"], argv
        assert decode.host == cfg.host and decode.advertised_host() == dialled, argv
        assert router.host == cfg.host, argv
        st = stack.Stack(cfg)
        assert st.urls["router"] == f"http://{dialled}:8000" and st.urls["decode"] == f"http://{dialled}:5557", argv


@pytest.mark.parametrize(
    "argv,reason",
    [
        (["up", "--advertise-host", "0.0.0.0"], "advertise_host (--advertise-host, $TILERT_UP_ADVERTISE_HOST) is an"),
        (["up", "--advertise-host", "::"], "is an address peers dial"),
        (["up", "--host", "not a host"], "host (--host, $TILERT_UP_HOST) must be an IP address or a host name"),
        (["decode", "--advertise-host", "0.0.0.0"], "advertise_host (--advertise-host, $TILERT_DECODE_ADVERTISE_HOST)"),
        (["decode", "--advertise-host", "300.1.1.1"], "must be an IP address or a host name, got '300.1.1.1'"),
    ],
)
def test_addresses_peers_dial_are_refused_when_they_name_none(model: Path, argv: list[str], reason: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(reason)):
        if argv[0] == "up":
            up_from_cli([*argv[:1], "--model", str(model), *argv[1:]]).validate()
        else:
            decode_from_cli([*argv[:1], "--model", str(model), *argv[1:]])


def test_router_refuses_a_decode_node_at_every_interface(model: Path) -> None:
    """The router writes the node's address into each claim: the prefill must be able to dial it."""
    with pytest.raises(ConfigError, match="0.0.0.0 \\(every interface\\) names none"):
        router_from_cli(
            ["router", "--prefill-url", "http://127.0.0.1:1", "--decode", "0.0.0.0:1:2", "--model", str(model)]
        )


def test_up_prefill_in_process_runs_the_model_in_the_engine_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU host ``tilert up`` runs the prefill's model in vLLM's engine-core process (the in-process executor
    and the variable vLLM needs for it), with one OpenMP thread per CPU not the engine's; ``--no-prefill-in-process``
    keeps vLLM's worker process, whose OpenMP threads vLLM binds itself; native mode and a GPU host keep vLLM's
    default. The session stack of the e2e tests runs the default for real."""
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    monkeypatch.setattr(stack, "allowed_cpus", lambda: frozenset({0, 1, 2}))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert up_from_cli(["up", "--model", "/m"]).prefill_in_process is None
    assert up_from_cli(["up", "--model", "/m", "--no-prefill-in-process"]).prefill_in_process is False
    cfg = stack.StackConfig(model=Path("/m"))
    cmd = stack.prefill_command(cfg)
    assert cmd[cmd.index("--distributed-executor-backend") + 1] == "uni"
    st = stack.Stack(cfg)
    assert st.extra_env("prefill") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2"}
    assert st.extra_env("decode") == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the caller's own count wins
    assert "OMP_NUM_THREADS" not in st.extra_env("prefill")
    unpinned = stack.StackConfig(model=Path("/m"), engine_cpus="none")  # no plan: vLLM's own thread count
    assert stack.Stack(unpinned).extra_env("prefill") == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    worker = stack.StackConfig(model=Path("/m"), prefill_in_process=False)
    assert "--distributed-executor-backend" not in stack.prefill_command(worker)
    assert stack.Stack(worker).extra_env("prefill") == {"VLLM_CPU_OMP_THREADS_BIND": "0,1"}
    assert not stack.prefill_in_process(stack.StackConfig(model=Path("/m"), native=True))
    monkeypatch.setattr(stack, "_has_cuda", lambda: True)
    assert not stack.prefill_in_process(cfg) and stack.prefill_env(cfg) == {}


def test_up_engine_process_reaches_the_decode_node(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default on a CPU host, off by default with a GPU; either way the flag decides."""
    assert up_from_cli(["up", "--model", "/m", "--engine-process"]).engine_process is True
    assert up_from_cli(["up", "--model", "/m", "--no-engine-process"]).engine_process is False
    assert up_from_cli(["up", "--model", "/m"]).engine_process is None
    cmd = stack.decode_command(stack.StackConfig(model=model, engine_process=True))
    assert "--engine-process" in cmd and decode_from_cli(cmd[3:]).engine_process
    assert "--engine-process" not in stack.decode_command(stack.StackConfig(model=model, engine_process=False))
    for cuda in (False, True):
        monkeypatch.setattr(stack, "_has_cuda", lambda cuda=cuda: cuda)
        default = stack.decode_command(stack.StackConfig(model=model))
        assert ("--engine-process" in default) is not cuda


def test_up_engine_cpus_keeps_the_rest_of_the_stack_off_them(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--engine-cpus``: the engine's worker thread there, every other process of the stack (the prefill's OMP
    threads included) on the other CPUs this process may use; "" / "none" or native mode: nothing pinned; CPUs
    this process may not use, or all of them, are refused at start-up."""
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(stack, "allowed_cpus", lambda: frozenset({0, 1, 2, 3}))
    monkeypatch.setattr(decode_config, "allowed_cpus", lambda: frozenset({0, 1, 2, 3}))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert up_from_cli(["up", "--model", "/m", "--engine-cpus", "3"]).engine_cpus == "3"
    assert up_from_cli(["up", "--model", "/m", "--engine-cpus", "none"]).engine_cpus == "none"  # not "unset"
    cfg = stack.StackConfig(model=model, engine_cpus="3")
    assert stack.cpu_plan(cfg) == stack.CpuPlan(frozenset({3}), frozenset({0, 1, 2}), fence=True)
    assert stack.cpu_plan(cfg).children == {0, 1, 2}  # every process of the stack starts there
    cmd = stack.decode_command(cfg)
    assert cmd[cmd.index("--engine-cpus") + 1] == "3" and decode_from_cli(cmd[3:]).engine_cpu_set == {3}
    assert stack.Stack(cfg).extra_env("prefill")["OMP_NUM_THREADS"] == "3"  # in-process: a thread per CPU of its own
    worker = replace(cfg, prefill_in_process=False)
    assert stack.Stack(worker).extra_env("prefill")["VLLM_CPU_OMP_THREADS_BIND"] == "0,1,2"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")  # the caller's own binding wins
    assert "VLLM_CPU_OMP_THREADS_BIND" not in stack.Stack(worker).extra_env("prefill")
    assert stack.cpu_plan(replace(cfg, engine_cpus="1-2")) == stack.CpuPlan(frozenset({1, 2}), frozenset({0, 3}), True)
    for off in (replace(cfg, engine_cpus=""), replace(cfg, engine_cpus="none"), replace(cfg, native=True)):
        assert stack.cpu_plan(off) == stack.CpuPlan() and "--engine-cpus" not in stack.decode_command(off)
    with pytest.raises(ValueError, match="may use CPUs 0,1,2,3"):
        stack.cpu_plan(replace(cfg, engine_cpus="7"))
    with pytest.raises(ValueError, match="leaves no CPU for the rest of the stack"):
        stack.cpu_plan(replace(cfg, engine_cpus="0-3"))
    assert stack.run(replace(cfg, engine_cpus="7")) == 2  # refused before anything starts


def test_up_default_placement_on_a_cpu_host(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``--engine-cpus`` on a CPU host: the engine's worker thread on the last CPU this process may use, the
    prefill's OpenMP threads as many as the other CPUs (a worker process's bound to them), every process started
    where the kernel likes; on a GPU host or with one CPU, nothing pinned."""
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(stack, "allowed_cpus", lambda: frozenset({0, 2, 5}))
    monkeypatch.setattr(decode_config, "allowed_cpus", lambda: frozenset({0, 2, 5}))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cfg = stack.StackConfig(model=model)
    plan = stack.cpu_plan(cfg)
    assert plan == stack.CpuPlan(frozenset({5}), frozenset({0, 2}), fence=False) and plan.children == frozenset()
    cmd = stack.decode_command(cfg)
    assert cmd[cmd.index("--engine-cpus") + 1] == "5" and decode_from_cli(cmd[3:]).engine_cpu_set == {5}
    assert stack.Stack(cfg).extra_env("prefill")["OMP_NUM_THREADS"] == "2"
    worker = replace(cfg, prefill_in_process=False)
    assert stack.Stack(worker).extra_env("prefill")["VLLM_CPU_OMP_THREADS_BIND"] == "0,2"
    monkeypatch.setattr(stack, "_has_cuda", lambda: True)
    assert stack.cpu_plan(cfg) == stack.CpuPlan() and "--engine-cpus" not in stack.decode_command(cfg)
    monkeypatch.setattr(stack, "_has_cuda", lambda: False)
    monkeypatch.setattr(stack, "allowed_cpus", lambda: frozenset({3}))
    assert stack.cpu_plan(cfg) == stack.CpuPlan()


# -- metrics -------------------------------------------------------------------------------------------------


def _families(text: bytes) -> dict[str, list[tuple[str, dict[str, str]]]]:
    out: dict[str, list[tuple[str, dict[str, str]]]] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for sample in fam.samples:
            out.setdefault(sample.name, []).append((sample.name, dict(sample.labels)))
    return out


def test_router_metrics_follow_vllm_names() -> None:
    from tilert.router.metrics import RouterMetrics

    m = RouterMetrics("tiny")
    m.running(1)
    m.waiting(2)
    m.queue_wait(0.01)
    m.prefill(0.2)
    m.first_token("chat", 0.25)
    m.transfer_wait(0.05)
    m.token_gap(0.02, 2)
    m.token_gap(0.01, 0)
    m.request_finished("chat", "ok", "stop", 7, 3, 1.0, 0.25, None)
    m.request_finished("completions", "bad_request", None, 0, 0, 0.001, None, None)
    m.slots_in_use("127.0.0.1:5556:5557", 1)
    m.node_healthy("127.0.0.1:5556:5557", True)
    samples = _families(m.render())
    for name in [
        "tilert:time_to_first_token_seconds_count",
        "tilert:e2e_request_latency_seconds_count",
        "tilert:request_time_per_output_token_seconds_count",
        "tilert:inter_token_latency_seconds_count",
        "tilert:num_requests_running",
        "tilert:num_requests_waiting",
        "tilert:request_success_total",
        "tilert:prompt_tokens_total",
        "tilert:generation_tokens_total",
        "tilert:requests_total",
        "tilert:request_queue_time_seconds_count",
        "tilert:request_prefill_time_seconds_count",
        "tilert:kv_transfer_wait_seconds_count",
        "tilert:decode_slots_in_use",
        "tilert:decode_node_healthy",
    ]:
        assert name in samples, name
        assert all(labels.get("model_name") == "tiny" for _, labels in samples[name]), name
    assert samples["tilert:request_success_total"][0][1]["finished_reason"] == "stop"
    assert {lab["outcome"] for _, lab in samples["tilert:requests_total"]} == {"ok", "bad_request"}
    text = m.render().decode()
    assert 'tilert:request_time_per_output_token_seconds_sum{model_name="tiny"} 0.375' in text  # (1-0.25)/2
    assert 'tilert:generation_tokens_total{model_name="tiny"} 3.0' in text
    assert 'tilert:inter_token_latency_seconds_count{model_name="tiny"} 2.0' in text


def test_decode_metrics_follow_vllm_names() -> None:
    from tilert.decode.metrics import DecodeMetrics

    m = DecodeMetrics("tiny")
    m.requests(running=1, waiting=2)
    m.slots(total=2, free=1)
    m.transfer_received()
    m.transfer_failed("timeout")
    m.transfer_wait(0.01)
    m.tokens(1)
    m.tokens(2, 0.01)
    m.request_done(0.5, "length", 0.005)
    m.lease_expired()
    m.spec_decode(4, 12, (3, 1))  # 4 steps of 3 drafts: 3 kept the first, 1 the first two
    samples = _families(m.render())
    for name in [
        "tilert:num_requests_running",
        "tilert:num_requests_waiting",
        "tilert:decode_slots",
        "tilert:decode_slots_free",
        "tilert:kv_transfers_received_total",
        "tilert:kv_transfers_failed_total",
        "tilert:generation_tokens_total",
        "tilert:inter_token_latency_seconds_count",
        "tilert:request_time_per_output_token_seconds_count",
        "tilert:e2e_request_latency_seconds_count",
        "tilert:request_success_total",
        "tilert:kv_transfer_wait_seconds_count",
        "tilert:decode_leases_expired_total",
        "tilert:spec_decode_num_drafts_total",
        "tilert:spec_decode_num_draft_tokens_total",
        "tilert:spec_decode_num_accepted_tokens_total",
        "tilert:spec_decode_num_accepted_tokens_per_pos_total",
    ]:
        assert name in samples, name
        assert all(labels.get("model_name") == "tiny" for _, labels in samples[name]), name
    text = m.render().decode()
    assert 'tilert:generation_tokens_total{model_name="tiny"} 3.0' in text
    assert 'tilert:num_requests_waiting{model_name="tiny"} 2.0' in text
    assert 'tilert:spec_decode_num_drafts_total{model_name="tiny"} 4.0' in text
    assert 'tilert:spec_decode_num_draft_tokens_total{model_name="tiny"} 12.0' in text
    assert 'tilert:spec_decode_num_accepted_tokens_total{model_name="tiny"} 4.0' in text
    assert 'tilert:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 1.0' in text
    assert m.content_type.startswith("text/plain")


# -- lazy app ------------------------------------------------------------------------------------------------


def _python(code: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")} | env_vars
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


def test_importing_the_config_builds_no_app() -> None:
    proc = _python(
        "import sys, tilert.settings, tilert.router.config, tilert.decode.config, tilert.stack, tilert.cli\n"
        "loaded = [m for m in ('tilert.router.app', 'starlette.applications', 'torch') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_uvicorn_target_is_still_the_asgi_app() -> None:
    proc = _python(
        "import importlib\n"
        "from starlette.applications import Starlette\n"
        "pkg = importlib.import_module('tilert.router')\n"
        "app = getattr(pkg, 'app')\n"  # what `uvicorn tilert.router:app` does
        "assert isinstance(app, Starlette), type(app)\n"
        "import tilert.router.app as _  # loading the submodule of the same name keeps the attribute\n"
        "assert pkg.app is app\n",
        TILERT_ROUTER_PREFILL_URL="http://127.0.0.1:1",
        TILERT_ROUTER_DECODE_NODES="127.0.0.1:2:3",
        TILERT_ROUTER_MODEL_DIR=str(REPO),
        TILERT_SECRET="s" * 32,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_uvicorn_target_refuses_a_config_it_cannot_start_with() -> None:
    """What ``uvicorn tilert.router:app`` meets when the config cannot hold: the reason in one line, status 2, no
    traceback (uvicorn imports the app before it serves)."""
    proc = _python(
        "import tilert.router\ntilert.router.app\n",
        TILERT_ROUTER_CONFIG=str(REPO / "config" / "router.example.toml"),
        TILERT_ROUTER_MODEL_DIR="/nonexistent/model",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("tilert router: ") and "Traceback" not in proc.stderr, proc.stderr
    assert "'/nonexistent/model' is not a directory" in proc.stderr and "no shared secret" in proc.stderr


def test_allowed_cpus_is_the_cpuset_not_the_current_pinning() -> None:
    """A process pinned to one CPU (as ``tilert up`` starts the decode node) may still pin its engine's thread to
    another CPU of its cpuset: the node validates ``--engine-cpus`` against the cpuset."""
    from tilert.cpus import allowed_cpus

    every = allowed_cpus()
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(every)})
        assert allowed_cpus() == every and os.sched_getaffinity(0) == {min(every)}  # and it leaves the pinning
    finally:
        os.sched_setaffinity(0, mine)


def test_free_ports_are_below_the_ephemeral_range_and_free() -> None:
    """A port handed out for a process to bind later is never one the kernel may give an outgoing connection
    meanwhile (below ``ip_local_port_range``), nothing listens on it, and no other caller in the process has it."""
    import socket
    from pathlib import Path

    from tilert.netio import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    handed = [free_port() for _ in range(200)]
    ports = set(handed)
    assert len(ports) == len(handed), "a process is never handed the same port twice"
    assert low <= 21000 or all(20000 <= p < low for p in ports)  # a kernel that leaves no room below: any free port
    with socket.socket() as s:
        s.bind(("127.0.0.1", next(iter(ports))))
