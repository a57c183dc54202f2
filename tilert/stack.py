"""``tilert up``: the whole stack on one machine, as three (four) supervised child processes.

stock vLLM (prefill, with ``TileRTConnector``)  +  the decode node  +  the router.

``tilert up --prefill-instances N`` starts N prefill instances on consecutive ports from ``--prefill-port``
(``prefill``, ``prefill-2``, ...) and gives the router all of them (:mod:`tilert.router.prefill_pool`).

``tilert up --native`` adds the native decode pool (engine plugin ``vllm``): the prefill then runs vLLM's
``MultiConnector`` holding ``TileRTConnector`` beside vLLM's own ``NixlConnector``, and a second stock vLLM
instance decodes what the router sends the native way.

One shared secret binds the three (:mod:`tilert.auth`): ``tilert up`` generates it, writes it to a
file only this user can read (0600, in a private temporary directory removed at exit) and hands the
children ``TILERT_SECRET_FILE`` in their environment, never on a command line (``ps`` shows those to
everyone). The router's slot lease and the decode node's longest lease are set together.

Each child runs in its own process group, so stopping it reaches every process it spawned (vLLM
starts an engine-core process of its own). Start-up waits until each answers ``/health`` (a child that dies
meanwhile stops the stack); once up, a child that dies is started again after a backoff while the others serve
on (:class:`Supervisor`: the router answers 503 for what it cannot serve meanwhile, e.g. the native pool, and says
``degraded``). SIGINT, SIGTERM or SIGHUP (the terminal closed) stops every child and leaves no process behind;
on Linux each child also gets SIGTERM when ``tilert up`` itself dies without stopping them (SIGKILL, the OOM killer).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any, ClassVar

import httpx
import structlog

from tilert.auth import SECRET_ENV, SECRET_FILE_ENV, generate_secret
from tilert.contracts import ConnectorSettings
from tilert.cpus import allowed_cpus, parse_cpu_list
from tilert.decode.config import CTRL_PORT, DEFAULT_MAX_LEASE_S, DTYPES, ENGINE, HTTP_PORT, TRANSPORT
from tilert.engines.plugin import NativeInstance, load_native_pool
from tilert.engines.vllm import CPU_COMPILATION_CONFIG
from tilert.logs import FORMAT_ENV, LEVEL_ENV, LOG_FORMAT, LOG_LEVEL, configure, vllm_access_log_args
from tilert.models.checkpoint import context_problem
from tilert.plugins import PluginError
from tilert.router.config import (
    ENABLE_AUTO_TOOL_CHOICE,
    NATIVE_ENGINE,
    OVERFLOW_WAIT_S,
    REASONING_PARSER,
    RESERVE_LEASE_S,
    TOOL_CALL_PARSER,
    TOOL_PARSER_PLUGIN,
    default_reserve_lease_s,
    parser_problems,
    vllm_parser_args,
)
from tilert.settings import (
    LOOPBACK,
    NATIVE_PORT,
    NATIVE_SIDE_PORT,
    PREFILL_SIDE_PORT,
    UP_PREFILL_PORT,
    UP_ROUTER_PORT,
    ConfigError,
    build_config,
    check_port,
    describe,
    env_values,
    host_problem,
    is_int,
    is_number,
    is_wildcard,
    merge_values,
    setting,
)

log = structlog.get_logger("tilert.stack")


ENV_PREFIX = "TILERT_UP_"


@dataclass
class StackConfig:
    """``tilert up``'s settings: flag ``--field-name``, environment variable ``TILERT_UP_FIELD_NAME``; the settings
    it passes on to the router or the decode node are theirs (:mod:`tilert.router.config`,
    :mod:`tilert.decode.config`)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    model: Path = setting(help="checkpoint directory the prefill vLLM and the decode node both load", metavar="DIR")
    port: int = setting(UP_ROUTER_PORT, help="the router's port")
    prefill_port: int = setting(UP_PREFILL_PORT, help="the prefill vLLM's port (the first one's, with several)")
    prefill_instances: int = setting(
        1,
        help="how many prefill vLLM instances to start, on consecutive ports from prefill_port (prefill, prefill-2, "
        "...); the router spreads requests over them (its prefill_policy) and takes out one that fails",
    )
    ctrl_port: int = CTRL_PORT.field()
    decode_http_port: int = HTTP_PORT.field()
    host: str = setting(LOOPBACK, help="bind address of every process of the stack")
    advertise_host: str | None = setting(
        None,
        metavar="ADDR",
        help="the address the processes of the stack reach each other at (the router's prefill URL and decode node, "
        "the decode node's address in each claim and write grant) and the URLs printed. Default: --host, or "
        "127.0.0.1 with a --host that binds every interface (0.0.0.0, ::)",
    )
    dtype: str = setting("float32", help="dtype of the prefill vLLM and the decode node: float32 or bfloat16")
    max_model_len: int = setting(
        2048, help="longest prompt + completion (the prefill's --max-model-len, the decode node's --max-seq-len)"
    )
    kv_cache_bytes: int = setting(128 << 20, help="KV cache memory of each vLLM instance (--kv-cache-memory-bytes)")
    engine: str = ENGINE.field()
    transport: str = TRANSPORT.field()
    startup_timeout_s: float = setting(600.0, help="how long the processes may take to answer /health at start-up")
    reserve_lease_s: float | None = RESERVE_LEASE_S.field()
    native: bool = setting(
        False,
        help="also the native decode pool: the prefill runs MultiConnector (TileRTConnector beside vLLM's "
        "NixlConnector) and a stock vLLM decode instance serves requests the router sends the native way",
    )
    native_engine: str = NATIVE_ENGINE.field()
    native_port: int = setting(NATIVE_PORT, help="the native vLLM decode instance's port (--native)")
    prefill_side_port: int = setting(PREFILL_SIDE_PORT, help="the prefill's NIXL side channel (--native)")
    native_side_port: int = setting(NATIVE_SIDE_PORT, help="the native decode instance's NIXL side channel (--native)")
    overflow_wait_s: float | None = OVERFLOW_WAIT_S.field()
    # vLLM's parser flags: the router's, and every vLLM instance's (the prefill renders and validates the tools)
    tool_call_parser: str | None = TOOL_CALL_PARSER.field()
    enable_auto_tool_choice: bool = ENABLE_AUTO_TOOL_CHOICE.field()
    reasoning_parser: str | None = REASONING_PARSER.field()
    tool_parser_plugin: str | None = TOOL_PARSER_PLUGIN.field()
    secret_file: Path | None = setting(
        None,
        metavar="PATH",
        help="use this deployment secret (a file only you can read) instead of a fresh one, so that more decode "
        "nodes and routers can join the stack; it is left in place at exit (unset: a fresh secret in a private "
        "temporary file, removed at exit)",
    )
    prefill_compiled: bool = setting(
        False,
        help="run the prefill vLLM compiled (vLLM's default) instead of --enforce-eager: a longer start, a faster "
        "prefill",
    )
    prefill_in_process: bool | None = setting(
        None,
        help="run the prefill vLLM's model in its engine-core process (--distributed-executor-backend uni) instead "
        "of a worker process that spins on a CPU core after every step (unset: so on a CPU host outside --native)",
    )
    engine_process: bool | None = setting(
        None,
        help="run the decode node's engine in a process of its own (tilert decode --engine-process; unset: so on a "
        "CPU host, where the node's HTTP loop would otherwise hold the GIL the engine's step needs)",
    )
    log_dir: Path | None = setting(
        None,
        metavar="DIR",
        help="where each process of the stack writes its log (DIR/prefill.log, decode.log, router.log, up.log ...); "
        "kept at exit (unset: a fresh directory under the system's temporary directory)",
    )
    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()
    engine_cpus: str | None = setting(
        None,
        metavar="LIST",
        parse=str,
        help="CPUs given to the decode engine's worker thread alone ('1', '2-3'): every other process of the stack "
        "(the prefill with its OMP threads, the router, the node's own loops) is kept off them. Unset: on a CPU "
        "host the engine's thread on the last CPU, the prefill's OMP threads on the others, the rest unpinned; "
        "'none': nothing pinned",
    )

    @property
    def advertised(self) -> str:
        """The address the stack's processes reach each other at: ``advertise_host``, else ``host`` unless that
        binds every interface, then loopback (every process of the stack runs on this host)."""
        if self.advertise_host:
            return self.advertise_host
        return LOOPBACK if is_wildcard(self.host) else self.host

    def _port_problems(self) -> list[str]:
        d = lambda name: describe(StackConfig, name)  # noqa: E731
        problems: list[str] = []
        n = self.prefill_instances
        if not is_int(n) or n < 1:
            problems.append(f"{d('prefill_instances')} must be an integer >= 1 ({n!r})")
            n = 1
        elif n > 1 and self.native:
            problems.append(f"{d('prefill_instances')} above 1 is not available with --native (one NIXL side channel)")
        ports = ["port", "prefill_port", "ctrl_port", "decode_http_port"]
        if self.native:
            ports += ["native_port", "prefill_side_port", "native_side_port"]
        for name in ports:
            try:
                check_port(getattr(self, name), d(name))
            except ConfigError as exc:
                problems.append(str(exc))
        if problems:
            return problems
        named = [(name, getattr(self, name)) for name in ports]
        named += [(f"prefill instance {i + 1}'s port", self.prefill_port + i) for i in range(1, n)]
        if self.prefill_port + n - 1 > 65535:
            problems.append(f"{d('prefill_instances')} {n} from {d('prefill_port')} {self.prefill_port} passes 65535")
        if len({v for _, v in named}) != len(named):
            problems.append(f"the stack's ports must differ: {', '.join(f'{n} {v}' for n, v in named)}")
        return problems

    def validate(self) -> StackConfig:
        """Raise :class:`ConfigError` naming every setting the stack cannot start with; returns ``self``."""
        d = lambda name: describe(StackConfig, name)  # noqa: E731
        problems: list[str] = []
        if not (Path(self.model) / "config.json").is_file():
            problems.append(f"{d('model')}: {self.model} holds no config.json (build one with `tilert tiny-model`)")
        elif too_long := context_problem(self.model, self.max_model_len, d("max_model_len")):
            problems.append(too_long)
        problems += self._port_problems()
        problems += [p for p in (host_problem(self.host, d("host"), wildcard=True),) if p]
        if self.advertise_host is not None:
            problems += [p for p in (host_problem(self.advertise_host, d("advertise_host"), wildcard=False),) if p]
        if self.dtype not in DTYPES:
            problems.append(f"{d('dtype')} must be one of {', '.join(DTYPES)} ({self.dtype!r})")
        for name, low in (("max_model_len", 2), ("kv_cache_bytes", 1)):
            if not is_int(getattr(self, name)) or getattr(self, name) < low:
                problems.append(f"{d(name)} must be an integer >= {low} ({getattr(self, name)!r})")
        for name in ("startup_timeout_s", "reserve_lease_s"):
            value = getattr(self, name)
            if value is not None and (not is_number(value) or value <= 0):
                problems.append(f"{d(name)} must be a positive number ({value!r})")
        if self.overflow_wait_s is not None:
            if not is_number(self.overflow_wait_s) or self.overflow_wait_s < 0:
                problems.append(f"{d('overflow_wait_s')} must be a number >= 0 ({self.overflow_wait_s!r})")
            elif not self.native:
                problems.append(f"{d('overflow_wait_s')} overflows to the native pool: add --native")
        problems += parser_problems(self, StackConfig)
        if problems:
            raise ConfigError("; ".join(problems))
        return self


def load_stack_config(cli: Mapping[str, Any] | None = None) -> StackConfig:
    """``tilert up``'s config: flags (``cli``, from :func:`tilert.settings.cli_values`) > ``TILERT_UP_*`` >
    defaults (:func:`run` validates it)."""
    return build_config(StackConfig, merge_values(StackConfig, [env_values(StackConfig), cli or {}]))


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _url(host: str, port: int) -> str:
    return f"http://{_bracketed(host)}:{port}"


CPU_PREFILL_COMPILATION_CONFIG = CPU_COMPILATION_CONFIG  # vLLM's exact RoPE for MLA on CPU (see engines.vllm)


def tilert_connector(cfg: StackConfig) -> dict[str, object]:
    return {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": ConnectorSettings(transport=cfg.transport).to_extra(),
    }


def kv_transfer_config(cfg: StackConfig) -> dict[str, object]:
    """The prefill's connector: ours alone, or (native mode) ours beside the native pool's under MultiConnector."""
    if not cfg.native:
        return tilert_connector(cfg)
    native = load_native_pool(cfg.native_engine)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [tilert_connector(cfg), native.prefill_connector()]},
    }


def native_instances(cfg: StackConfig) -> tuple[NativeInstance, NativeInstance]:
    """(the prefill, the native decode) as the native pool plugin sees them; pinned to different cores."""

    def instance(port: int, side_port: int, cpu_bind: str) -> NativeInstance:
        return NativeInstance(
            model=cfg.model,
            host=cfg.host,
            port=port,
            side_channel_port=side_port,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            kv_cache_bytes=cfg.kv_cache_bytes,
            cpu_bind=cpu_bind,
        )

    return instance(cfg.prefill_port, cfg.prefill_side_port, "0"), instance(cfg.native_port, cfg.native_side_port, "1")


def native_command(cfg: StackConfig) -> list[str]:
    cmd = load_native_pool(cfg.native_engine).decode_command(native_instances(cfg)[1], cpu=not _has_cuda())
    return cmd + vllm_parser_args(cfg)  # the native pool's decode instance parses its answers itself


def prefill_ports(cfg: StackConfig) -> list[int]:
    """The prefill instances' ports: ``prefill_instances`` consecutive ones from ``prefill_port``."""
    return [cfg.prefill_port + i for i in range(cfg.prefill_instances)]


def prefill_name(index: int) -> str:
    """The process name (and log file) of the ``index``-th prefill instance: ``prefill``, ``prefill-2``, ..."""
    return "prefill" if index == 0 else f"prefill-{index + 1}"


def prefill_command(cfg: StackConfig) -> list[str]:
    """Stock vLLM's OpenAI server with the connector configured (no patch, no wrapper)."""
    kv_config = kv_transfer_config(cfg)
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cfg.model),
        "--host",
        cfg.host,
        "--port",
        str(cfg.prefill_port),
        "--dtype",
        cfg.dtype,
        "--max-model-len",
        str(cfg.max_model_len),
        *([] if cfg.prefill_compiled else ["--enforce-eager"]),
        "--kv-cache-memory-bytes",
        str(cfg.kv_cache_bytes),
        "--kv-transfer-config",
        json.dumps(kv_config),
        *vllm_access_log_args(),
        *vllm_parser_args(cfg),  # its chat template renders the tools, and it validates them as the router does
    ]
    if not _has_cuda():
        cmd += ["--compilation-config", json.dumps(CPU_PREFILL_COMPILATION_CONFIG)]
    if prefill_in_process(cfg):
        cmd += ["--distributed-executor-backend", "uni"]
    return cmd


def prefill_in_process(cfg: StackConfig) -> bool:
    """Whether the prefill runs its model in vLLM's engine-core process: ``cfg.prefill_in_process``; unset, so on a
    CPU host outside native mode. vLLM's CPU platform otherwise runs the model in a worker process that spins on
    ``sched_yield`` for a second after every step: under load it never rests, and the kernel then moves the router,
    the node and the client onto the decode engine's CPU. Native mode keeps vLLM's default:
    its two vLLM instances are placed by the native pool plugin."""
    if cfg.prefill_in_process is not None:
        return cfg.prefill_in_process
    return not cfg.native and not _has_cuda()


# ``--distributed-executor-backend uni`` (the model in the engine-core process: :func:`prefill_in_process`) is
# accepted by vLLM on CPU only with this variable, which changes nothing else for its OpenAI server.
IN_PROCESS_EXECUTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def prefill_env(cfg: StackConfig, plan: CpuPlan | None = None) -> dict[str, str]:
    """What the prefill's environment needs beside the stack's own (:func:`child_env`), on a CPU host with the CPUs
    of ``plan`` (unset: :func:`cpu_plan`) not the engine's (``rest``):

    - in-process (:func:`prefill_in_process`): vLLM's switch for it, and ``OMP_NUM_THREADS``, one OpenMP thread per
      CPU of ``rest``. vLLM sizes (and binds) its model's OpenMP threads only when it starts a worker process; in
      its engine-core process the compiled kernels take one thread per CPU, the engine's too, and they busy-wait
      between parallel regions, against every other process of the stack.
    - a worker process: ``VLLM_CPU_OMP_THREADS_BIND``, the CPUs vLLM binds that worker's OpenMP threads to.

    A variable of the caller's own wins."""
    if _has_cuda():
        return {}
    rest = (plan if plan is not None else cpu_plan(cfg)).rest
    if prefill_in_process(cfg):
        env = dict(IN_PROCESS_EXECUTOR_ENV)
        if rest and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(len(rest))
        return env
    if rest and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        return {"VLLM_CPU_OMP_THREADS_BIND": CpuPlan.text(rest)}
    return {}


@functools.cache
def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def leases(cfg: StackConfig) -> tuple[float, float]:
    """(the router's reserve_lease_s, the decode node's max_lease_s): the node always grants the router's."""
    lease = cfg.reserve_lease_s if cfg.reserve_lease_s is not None else default_reserve_lease_s()
    return lease, max(DEFAULT_MAX_LEASE_S, lease)


def engine_process(cfg: StackConfig) -> bool:
    """Whether the decode node runs its engine in a process of its own: ``cfg.engine_process``, unset: on a CPU
    host, where the node's HTTP loop would otherwise hold the GIL the engine's step needs."""
    return cfg.engine_process if cfg.engine_process is not None else not _has_cuda()


@dataclass(frozen=True)
class CpuPlan:
    """Who runs where: the decode engine's worker thread on ``engine``, the prefill's OMP threads on ``rest``;
    ``fence``: every other process of the stack kept on ``rest`` too (else the kernel places them). Empty sets:
    not pinned."""

    engine: frozenset[int] = frozenset()
    rest: frozenset[int] = frozenset()
    fence: bool = False

    @property
    def children(self) -> frozenset[int]:
        """The CPUs the stack's processes start on (empty: any); the engine's worker thread then pins itself."""
        return self.rest if self.fence else frozenset()

    @staticmethod
    def text(cpus: frozenset[int]) -> str:
        return ",".join(str(c) for c in sorted(cpus))


ENGINE_CPUS_OFF = ("", "none")


def cpu_plan(cfg: StackConfig) -> CpuPlan:
    """The stack's CPU placement.

    - **Default** (``engine_cpus`` None) on a CPU host with two CPUs or more: the engine's worker thread on the last
      CPU this process may use, the prefill's OMP threads as many as the others (:func:`prefill_env`), the rest of
      the stack (the router, the node's loops, vLLM's API server) left to the kernel. Left unpinned instead, vLLM
      binds its worker's OMP threads to every CPU, the engine's too.
    - **``--engine-cpus LIST``**: those CPUs are the engine's alone; every other process of the stack is fenced off
      them: the fastest decode for one user, a slower first token (the prefill, the router and the node share the
      rest).
    - ``""``/``"none"``, a GPU host, one CPU, or native mode (it pins its two vLLM instances itself): nothing pinned.

    ``ValueError`` for CPUs this process may not use, or for all of them (nothing would be left for the rest)."""
    if cfg.native or not hasattr(os, "sched_setaffinity"):
        return CpuPlan()
    if cfg.engine_cpus is not None and cfg.engine_cpus.strip().lower() in ENGINE_CPUS_OFF:
        return CpuPlan()
    usable = allowed_cpus()
    if cfg.engine_cpus is None:
        if len(usable) < 2 or _has_cuda():
            return CpuPlan()
        engine = frozenset({default_engine_cpu(usable)})
        return CpuPlan(engine, usable - engine, fence=False)
    engine = parse_cpu_list(cfg.engine_cpus)
    if not engine <= usable:
        raise ValueError(f"--engine-cpus {cfg.engine_cpus!r}: this process may use CPUs {CpuPlan.text(usable)}")
    if engine == usable:
        raise ValueError(
            f"--engine-cpus {cfg.engine_cpus!r} leaves no CPU for the rest of the stack "
            f"(this process may use CPUs {CpuPlan.text(usable)})"
        )
    return CpuPlan(engine, usable - engine, fence=True)


def default_engine_cpu(usable: frozenset[int] | None = None) -> int:
    """The engine's CPU in the default placement (:func:`cpu_plan`): the last of ``usable`` (unset: of the CPUs
    this process may use)."""
    return max(usable if usable is not None else allowed_cpus())


def decode_command(cfg: StackConfig, plan: CpuPlan | None = None) -> list[str]:
    """The decode node; with ``engine_process`` (unset: on a CPU host) its engine runs in a process of its own,
    its worker thread on the CPUs of ``plan`` (unset: :func:`cpu_plan`)."""
    engine_cpus = (plan if plan is not None else cpu_plan(cfg)).engine
    return [
        sys.executable,
        "-m",
        "tilert.cli",
        "decode",
        "--model",
        str(cfg.model),
        "--engine",
        cfg.engine,
        "--transport",
        cfg.transport,
        "--host",
        cfg.host,
        *(["--advertise-host", cfg.advertised] if cfg.advertised != cfg.host else []),
        "--ctrl-port",
        str(cfg.ctrl_port),
        "--http-port",
        str(cfg.decode_http_port),
        "--dtype",
        cfg.dtype,
        "--max-seq-len",
        str(cfg.max_model_len),
        "--max-lease-s",
        str(leases(cfg)[1]),
        *(["--engine-process"] if engine_process(cfg) else []),
        *(["--engine-cpus", CpuPlan.text(engine_cpus)] if engine_cpus else []),
    ]


def router_command(cfg: StackConfig) -> list[str]:
    prefills = [arg for port in prefill_ports(cfg) for arg in ("--prefill-url", _url(cfg.advertised, port))]
    cmd = [
        sys.executable,
        "-m",
        "tilert.cli",
        "router",
        *prefills,
        "--decode",
        f"{_bracketed(cfg.advertised)}:{cfg.ctrl_port}:{cfg.decode_http_port}",
        "--model",
        str(cfg.model),
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--reserve-lease-s",
        str(leases(cfg)[0]),
        *vllm_parser_args(cfg),
    ]
    if cfg.native:
        cmd += ["--native-url", _url(cfg.advertised, cfg.native_port)]
        if cfg.overflow_wait_s is not None:
            cmd += ["--overflow-wait-s", str(cfg.overflow_wait_s)]
    return cmd


def write_secret_file() -> Path:
    """A fresh secret in ``<private temp dir>/secret`` (dir 0700, file 0600); the caller removes the dir."""
    directory = Path(tempfile.mkdtemp(prefix="tilert-up-"))  # mkdtemp makes it 0700
    path = directory / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (generate_secret() + "\n").encode())
    finally:
        os.close(fd)
    return path


def child_env(secret_file: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The children's environment: ours, offline, and the secret's file (an inherited secret is dropped)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    return {
        **env,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        SECRET_FILE_ENV: str(secret_file),
    }


_OMP_VARIABLES = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND")
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # the waits before the 1st, 2nd ... restart of a child
MAX_FAILED_STARTS = 5  # a child that dies this many times in a row before it is healthy again stops the stack


class Stack:
    def __init__(self, cfg: StackConfig) -> None:
        """``ValueError`` for an ``engine_cpus`` this host cannot honour (:func:`cpu_plan`)."""
        self.cfg = cfg
        self.plan = cpu_plan(cfg)
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.secret_file: Path | None = cfg.secret_file
        self._owns_secret = cfg.secret_file is None
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir is not None else fresh_log_dir()
        self._log_files: dict[str, IO[bytes]] = {}  # each child's log, open while it may run
        self._commands: dict[str, list[str]] = {}
        self._envs: dict[str, dict[str, str]] = {}
        self.urls = {prefill_name(i): _url(cfg.advertised, port) for i, port in enumerate(prefill_ports(cfg))}
        if cfg.native:
            self.urls["native"] = _url(cfg.advertised, cfg.native_port)
        self.urls["decode"] = _url(cfg.advertised, cfg.decode_http_port)
        self.urls["router"] = _url(cfg.advertised, cfg.port)  # last: it answers once the others are up

    def commands(self) -> dict[str, list[str]]:
        ports = enumerate(prefill_ports(self.cfg))
        out = {prefill_name(i): prefill_command(replace(self.cfg, prefill_port=port)) for i, port in ports}
        if self.cfg.native:
            out["native"] = native_command(self.cfg)
        out["decode"] = decode_command(self.cfg, self.plan)
        out["router"] = router_command(self.cfg)
        return out

    def log_path(self, name: str) -> Path:
        """The file process ``name`` (``up`` for ``tilert up`` itself) writes its log to."""
        return self.log_dir / f"{name}.log"

    def tail(self, name: str, lines: int = 20) -> str:
        """The last ``lines`` lines of process ``name``'s log."""
        try:
            text = self.log_path(name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def extra_env(self, name: str) -> dict[str, str]:
        """Per child: the prefill's executor; in native mode both vLLM instances get the native pool's environment
        (NIXL side channel)."""
        own = prefill_env(self.cfg, self.plan) if name.startswith("prefill") else {}
        if not self.cfg.native or name not in ("prefill", "native"):
            return own
        prefill, native = native_instances(self.cfg)
        return {**own, **load_native_pool(self.cfg.native_engine).env(prefill if name == "prefill" else native)}

    def prepare_secret(self) -> Path:
        """Write this stack's secret file (once); :meth:`cleanup` (also run at exit) removes it."""
        if self.secret_file is None:
            self.secret_file = write_secret_file()
            self._owns_secret = True
            atexit.register(self.cleanup)
        return self.secret_file

    def child_env(self) -> dict[str, str]:
        """:func:`child_env`, with this stack's log settings for every child (vLLM's level too)."""
        return {
            **child_env(self.prepare_secret()),
            LEVEL_ENV: self.cfg.log_level,
            FORMAT_ENV: self.cfg.log_format,
            "VLLM_LOGGING_LEVEL": self.cfg.log_level.upper(),
        }

    def cleanup(self) -> None:
        if self.secret_file is not None and self._owns_secret:
            shutil.rmtree(self.secret_file.parent, ignore_errors=True)
            self.secret_file = None

    def start(self) -> None:
        """Start every child, each writing stdout and stderr to its own file under :attr:`log_dir`."""
        env, commands = self.child_env(), self.commands()
        envs = {name: {**env, **self.extra_env(name)} for name in commands}
        plan = self.plan
        omp = {k: v for k, v in envs["prefill"].items() if k in _OMP_VARIABLES}
        log.info(
            "placement",
            engine=CpuPlan.text(plan.engine) or "any",
            others=CpuPlan.text(plan.children) or "any",
            prefill_in_process=prefill_in_process(self.cfg),
            prefill_omp=omp or "vLLM's own",
        )
        self._commands, self._envs = commands, envs
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in commands:
            self.start_child(name)

    def start_child(self, name: str) -> None:
        """Start child ``name`` (again: after its process group is gone), its output appended to its log file."""
        rest = self.plan.children
        cmd = self._commands[name]
        log.info("starting", process=name, command=" ".join(cmd), cpus=CpuPlan.text(rest) or "any")
        if name in self._log_files:
            self._log_files[name].close()  # its previous run's
        out = self._log_files[name] = open(self.log_path(name), "ab")  # closed by stop()
        self.children[name] = subprocess.Popen(
            cmd,
            env=self._envs[name],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_child_setup(rest),
        )

    def wait_healthy(
        self, on_ready: Callable[[str, str, float], object] = lambda *_: None, should_stop: Callable[[], bool] = bool
    ) -> None:
        """Until every child answers ``/health``; ``on_ready(name, url, seconds)`` as each does, the router last.
        ``RuntimeError`` when a child exits, ``should_stop()`` turns true, or the start-up timeout passes."""
        started = time.monotonic()
        deadline = started + self.cfg.startup_timeout_s
        pending = dict(self.urls)
        with httpx.Client(timeout=2.0) as client:
            while pending:
                if should_stop():
                    raise RuntimeError("interrupted during start-up")
                for name, url in list(pending.items()):
                    code = self.children[name].poll()
                    if code is not None:
                        raise ChildExited(name, code)
                    if name == "router" and len(pending) > 1:
                        continue
                    if self.healthy(client, name):
                        del pending[name]
                        log.info("healthy", process=name, url=url)
                        on_ready(name, url, time.monotonic() - started)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not healthy within {self.cfg.startup_timeout_s:.0f}s: {sorted(pending)}")
                if pending:
                    time.sleep(0.2)

    def exited(self) -> dict[str, int]:
        """The children that have exited, with their status."""
        return {name: code for name, proc in self.children.items() if (code := proc.poll()) is not None}

    def healthy(self, client: httpx.Client, name: str) -> bool:
        try:
            return client.get(self.urls[name] + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after ``grace_s``."""
        for proc in self.children.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc, signal.SIGKILL)  # reaps stragglers the leader left in its group
            proc.wait()
        for out in self._log_files.values():
            out.close()
        self._log_files.clear()


class ChildExited(RuntimeError):
    """A child of the stack exited during start-up."""

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"{name} exited with status {code} during start-up")
        self.name = name


def fresh_log_dir() -> Path:
    """A new directory for one run's logs under the system's temporary directory (kept at exit)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(tempfile.mkdtemp(prefix=f"tilert-up-{stamp}-"))


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _child_setup(cpus: frozenset[int]) -> Callable[[], None]:
    """What a child runs between fork and exec: its CPUs (``cpus``; any when empty), and on Linux SIGTERM to it
    when this process dies, so that a ``tilert up`` killed outright leaves no child serving (Linux sends it when the
    thread that started the child ends: ``tilert up`` starts every child from its main thread). Only what is safe
    after a fork runs in the child: libc is looked up here, before it."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != parent:  # this process died before the request took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class _Supervised:
    """One child as the supervisor sees it: down until ``restart_at``, then started at ``started_at`` and waiting
    to answer ``/health`` (both None: running); ``failed_starts``: deaths in a row before it answered again."""

    failed_starts: int = 0
    restart_at: float | None = None
    started_at: float | None = None


class Supervisor:
    """Keeps a stack that is up running: a child that exits is started again after a backoff (:data:`RESTART_BACKOFF_S`,
    longer after each death before it answered ``/health`` again) while the others serve on (the router says
    ``degraded`` meanwhile and admits a decode node again once its watch stream is back). A child that dies
    :data:`MAX_FAILED_STARTS` times in a row before it answers stops the stack. Every death and every return is one
    line on the terminal, a death with the child's last log lines."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.children = {name: _Supervised() for name in stack.children}

    def step(self, client: httpx.Client) -> bool:
        """Look at every child once; False when the stack must stop."""
        now = time.monotonic()
        for name, code in self.stack.exited().items():
            child = self.children[name]
            if child.restart_at is not None:
                continue  # its restart is scheduled
            if child.started_at is not None:
                child.failed_starts += 1
                child.started_at = None
            if child.failed_starts >= MAX_FAILED_STARTS:
                _failed(self.stack, name, f"{name} exited {child.failed_starts} times in a row; stopping the stack")
                return False
            wait = RESTART_BACKOFF_S[min(child.failed_starts, len(RESTART_BACKOFF_S) - 1)]
            _signal_group(self.stack.children[name], signal.SIGKILL)  # whatever it left running
            _failed(self.stack, name, f"{name} exited with status {code}; starting it again in {wait:.0f} s")
            child.restart_at = now + wait
        for name, child in self.children.items():
            if child.restart_at is not None and now >= child.restart_at:
                child.restart_at, child.started_at = None, now
                self.stack.start_child(name)
            elif child.started_at is not None and self.stack.healthy(client, name):
                _say(f"{name}: {self.stack.urls[name]}  ready again in {now - child.started_at:.1f} s")
                child.started_at, child.failed_starts = None, 0
        return True


def _say(text: str, *, err: bool = False) -> None:
    """One line for the person at the terminal (stdout: what scripts read; stderr: what went wrong)."""
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


def _failed(stack: Stack, name: str, what: str) -> None:
    """Say that process ``name`` failed, with the last lines of its log."""
    _say(f"tilert up: {what}; the last lines of {stack.log_path(name)}:", err=True)
    _say(stack.tail(name) or "(empty)", err=True)


def run(cfg: StackConfig) -> int:
    """Start the stack, report each process when it is ready (``name: URL  ready in S s``, the router last), serve
    until a signal (a child that dies is started again: :class:`Supervisor`), then stop everything. The terminal
    gets nothing else unless something fails; every process's log, this one's included (``up.log``), is a file
    under the stack's log directory."""
    try:
        cfg.validate()
    except ConfigError as exc:
        print(f"tilert up: {exc}", file=sys.stderr)
        return 2
    if cfg.native:
        try:
            load_native_pool(cfg.native_engine)
        except PluginError as exc:
            print(f"tilert up: --native-engine: {exc}", file=sys.stderr)
            return 2
    try:
        stack = Stack(cfg)
        stack.log_dir.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        print(f"tilert up: {exc}", file=sys.stderr)
        return 2
    own_log = open(stack.log_path("up"), "a")  # closed when the stack has stopped
    configure(cfg.log_level, cfg.log_format, file=own_log)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        _say(f"tilert up: starting {', '.join(stack.urls)}; logs in {stack.log_dir}/")
        stack.start()
        try:
            stack.wait_healthy(lambda n, url, s: _say(f"{n}: {url}  ready in {s:.1f} s"), lambda: stopping)
        except ChildExited as exc:
            _failed(stack, exc.name, str(exc))
            return 1
        except RuntimeError as exc:
            _say(f"tilert up: {exc}", err=True)
            return 1
        _say(f"tilert up: serving at {stack.urls['router']}/v1 (Ctrl-C stops every process)")
        supervisor = Supervisor(stack)
        with httpx.Client(timeout=2.0) as client:
            while not stopping:
                if not supervisor.step(client):
                    return 1
                time.sleep(0.2)
        return 0
    finally:
        stack.stop()
        stack.cleanup()
        for sig, handler in old.items():
            signal.signal(sig, handler)
        configure(cfg.log_level, cfg.log_format)  # back to stderr before the file closes
        own_log.close()
