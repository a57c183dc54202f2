"""The settings layer: each setting declared once, every one listed by its command's --help, and ``tilert up``
read like the others (flag > ``TILERT_UP_*`` > default). Fast and offline."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from tilert import cli, stack
from tilert.decode.config import DecodeConfig
from tilert.router.config import RouterConfig
from tilert.settings import ConfigError, Setting, env_var, setting, specs
from tilert.stack import StackConfig

REPO = Path(__file__).resolve().parents[1]
COMMANDS: dict[str, type] = {"router": RouterConfig, "decode": DecodeConfig, "up": StackConfig}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TILERT_"):
            monkeypatch.delenv(name)


def redeclared(classes: Iterable[type]) -> list[str]:
    """Settings declared more than once: two declaration objects with the same environment variable, or the same
    meaning (help text), across ``classes``."""
    by_env: dict[str, dict[int, str]] = {}
    by_help: dict[str, dict[int, str]] = {}
    for cls in classes:
        for name, spec in specs(cls).items():
            where = f"{cls.__name__}.{name}"
            var = env_var(cls, name)
            if var:
                by_env.setdefault(var, {}).setdefault(id(spec.setting), where)
            by_help.setdefault(spec.setting.help, {}).setdefault(id(spec.setting), where)
    out = [f"${var}: {sorted(seen.values())}" for var, seen in by_env.items() if len(seen) > 1]
    return out + [f"{help!r}: {sorted(seen.values())}" for help, seen in by_help.items() if len(seen) > 1]


def test_each_setting_is_declared_once() -> None:
    assert redeclared(COMMANDS.values()) == []


def test_the_check_catches_a_setting_typed_twice() -> None:
    @dataclass
    class A:
        ENV_PREFIX: ClassVar[str] = "TILERT_A_"
        port: int = setting(1, help="a port", env="TILERT_PORT")

    @dataclass
    class B:
        ENV_PREFIX: ClassVar[str] = "TILERT_B_"
        other: int = setting(1, help="another port", env="TILERT_PORT")
        copy: int = setting(1, help="a port")

    found = redeclared([A, B])
    assert len(found) == 2 and "$TILERT_PORT" in found[0] and "'a port'" in found[1], found
    shared = Setting(default=1, help="a port", env="TILERT_PORT")

    @dataclass
    class C:
        ENV_PREFIX: ClassVar[str] = "TILERT_C_"
        port: int = shared.field()

    @dataclass
    class D:
        ENV_PREFIX: ClassVar[str] = "TILERT_D_"
        port: int = shared.field()

    assert redeclared([C, D]) == []


@pytest.mark.parametrize(
    "command,name,other,other_name",
    [
        ("router", "secret_file", "decode", "secret_file"),  # tilert.settings.SECRET_FILE
        ("up", "ctrl_port", "decode", "ctrl_port"),
        ("up", "decode_http_port", "decode", "http_port"),
        ("up", "engine", "decode", "engine"),
        ("up", "transport", "decode", "transport"),
        ("up", "reserve_lease_s", "router", "reserve_lease_s"),
        ("up", "overflow_wait_s", "router", "overflow_wait_s"),
        ("up", "native_engine", "router", "native_engine"),
    ],
)
def test_what_up_passes_on_is_its_childs_own_declaration(command: str, name: str, other: str, other_name: str) -> None:
    assert specs(COMMANDS[command])[name].setting is specs(COMMANDS[other])[other_name].setting


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_lists_every_setting_with_its_flags_and_variable(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside a flag
    with pytest.raises(SystemExit):
        cli.parser().parse_args([command, "--help"])
    text = capsys.readouterr().out
    cls = COMMANDS[command]
    for name, spec in specs(cls).items():
        var = env_var(cls, name)
        assert var is None or var in text, (name, var)
        if spec.setting.cli:
            for flag in spec.flags:
                assert f"{flag} " in text or f"{flag}," in text, (name, flag)
        if spec.setting.secret_flag:  # refused, so not offered
            assert f"{spec.setting.secret_flag} " not in text


def test_a_secret_flag_is_refused_naming_the_ways_to_give_it(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, advice in [
        (["decode", "--secret", "s"], "use --secret-file PATH, $TILERT_SECRET_FILE or $TILERT_SECRET"),
        (
            ["router", "--prefill-api-key", "k"],
            "use --prefill-api-key-file PATH, $TILERT_ROUTER_PREFILL_API_KEY_FILE or $TILERT_ROUTER_PREFILL_API_KEY",
        ),
    ]:
        with pytest.raises(SystemExit) as exc:
            cli.parser().parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "never go on a command line" in err and advice in err, err


def up(argv: list[str]) -> StackConfig:
    return cli.up_config(cli.parser().parse_args(["up", *argv]))


def test_up_reads_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILERT_UP_MODEL", str(tmp_path))
    monkeypatch.setenv("TILERT_UP_PREFILL_PORT", "9100")
    monkeypatch.setenv("TILERT_UP_RESERVE_LEASE_S", "900")
    monkeypatch.setenv("TILERT_UP_ENGINE_PROCESS", "false")
    monkeypatch.setenv("TILERT_UP_ENGINE_CPUS", "none")
    monkeypatch.setenv("TILERT_UP_HOST", "")  # empty: unset
    cfg = up([])
    assert cfg.model == tmp_path and cfg.prefill_port == 9100 and cfg.reserve_lease_s == 900.0
    assert cfg.engine_process is False and cfg.engine_cpus == "none" and cfg.host == "127.0.0.1"
    assert up(["--prefill-port", "9200", "--engine-process"]).prefill_port == 9200  # the flag wins
    # and the children get it
    assert "http://127.0.0.1:9100" in stack.router_command(cfg)
    node = stack.decode_command(cfg)
    assert node[node.index("--max-lease-s") + 1] == "3600.0" and "--engine-process" not in node
    assert "--engine-cpus" not in node


def test_up_refuses_a_bad_setting_naming_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TILERT_UP_PREFILL_PORT", "soon")
    with pytest.raises(ConfigError, match=r"\$TILERT_UP_PREFILL_PORT: expected an integer"):
        up(["--model", str(tmp_path)])
    monkeypatch.delenv("TILERT_UP_PREFILL_PORT")
    assert cli.main(["up"]) == 2
    assert "model (--model, $TILERT_UP_MODEL) is required" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("TILERT_UP_MODEL", str(tmp_path))
    monkeypatch.setenv("TILERT_UP_OVERFLOW_WAIT_S", "1")
    monkeypatch.setenv("TILERT_UP_PORT", "5556")
    assert cli.main(["up", "--max-model-len", "1"]) == 2  # refused before anything starts
    err = capsys.readouterr().err
    assert "add --native" in err and "ports must differ" in err and "--max-model-len" in err, err


def test_lower_layers_do_not_import_the_router() -> None:
    code = (
        "import sys, tilert.settings, tilert.metric_conventions, tilert.decode.config, tilert.decode.metrics\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('tilert.router'))\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
