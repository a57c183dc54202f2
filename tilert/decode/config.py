"""Decode node configuration: :class:`DecodeConfig`, one dataclass field per setting (:mod:`tilert.settings`).

Each setting has a flag ``--field-name`` on ``tilert decode`` (``num_slots`` keeps its historical ``--slots``) and
an environment variable ``TILERT_DECODE_FIELD_NAME``; the flag wins over the variable, the variable over the
default. :func:`load_decode_config` is the one loader.

The deployment's shared secret (:mod:`tilert.auth`) comes from ``--secret-file`` / ``$TILERT_SECRET_FILE`` /
``$TILERT_SECRET`` into ``DecodeConfig.secret``; the node refuses to start without one.

``resolve_device`` / ``resolve_dtype`` turn ``device`` / ``dtype`` into what the engine loads with
(torch is imported only there, so reading a config stays cheap).
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tilert.cpus import allowed_cpus, parse_cpu_list
from tilert.engines.plugin import DRAFT_HEADS, draft_vocab_problem
from tilert.logs import LOG_FORMAT, LOG_LEVEL
from tilert.models.checkpoint import MTP_LAYERS_KEY, context_problem, mtp_layers, read_json
from tilert.settings import (
    LOOPBACK,
    NODE_CTRL_PORT,
    NODE_HTTP_PORT,
    SECRET_FILE,
    ConfigError,
    Setting,
    build_config,
    check_port,
    describe,
    env_values,
    host_problem,
    is_int,
    is_number,
    is_wildcard,
    merge_values,
    secret_problem,
    setting,
    try_load_secret,
)

if TYPE_CHECKING:
    import torch

ENV_PREFIX = "TILERT_DECODE_"
DEFAULT_MAX_LEASE_S = 3600.0
DTYPES = ("auto", "float32", "bfloat16", "float16")
TP_ALLREDUCE = ("nccl", "symm_one_shot", "symm_two_shot")  # tilert.engines.tilert.parallel.ALLREDUCE_KINDS
DEFAULT_CPU_SEQUENCES = 8
DEFAULT_GPU_SEQUENCES = 4
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


# Settings `tilert up` (tilert.stack.StackConfig) passes on to its decode node: declared once, here.
ENGINE = Setting(default="tilert", help="the decode engine plugin (tilert.engines group)")
TRANSPORT = Setting(default="tcp", help="the KV transfer transport plugin (tilert.transports group)")
CTRL_PORT = Setting(
    default=NODE_CTRL_PORT, help="the decode node's control port: transfer handshakes from the prefill side"
)
HTTP_PORT = Setting(
    default=NODE_HTTP_PORT, help="the decode node's HTTP port: the router's reserve / decode / release API"
)


@dataclass(frozen=True)
class DecodeConfig:
    ENV_PREFIX: ClassVar[str] = ENV_PREFIX

    model: Path = setting(help="checkpoint directory (config.json, weights, tokenizer)", metavar="DIR")
    engine: str = ENGINE.field()
    transport: str = TRANSPORT.field()
    transport_options: dict[str, Any] = setting(
        default_factory=dict, help="JSON object passed to the transport", metavar="JSON"
    )
    host: str = setting(LOOPBACK, help="bind address of the control, HTTP and transport ports")
    advertise_host: str | None = setting(
        None,
        metavar="ADDR",
        help="the address the prefill side reaches this node's transport at, named in each write grant (tcp's "
        "host, mooncake's session; nixl keeps UCX on lo for a loopback one). Default: --host; with a --host that "
        "binds every interface (0.0.0.0, ::), the address this host's name resolves to",
    )
    ctrl_port: int = CTRL_PORT.field()
    http_port: int = HTTP_PORT.field()
    device: str = setting("auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    dtype: str = setting("auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    max_seq_len: int = setting(4096, help="longest prompt + completion a slot holds")
    max_sequences: int | None = setting(
        None,
        help="sequences decoded together in one engine step (each at its own position, bit-identical to decoding it "
        f"alone); more requests wait for a free one in arrival order. Default: {DEFAULT_CPU_SEQUENCES} on a CPU host, "
        f"{DEFAULT_GPU_SEQUENCES} on a GPU",
    )
    num_slots: int | None = setting(
        None,
        flag="--slots",
        aliases=("--num-slots",),
        help="receive buffers, each held by one request from reserve to the end of its decode; the router admits "
        "this many. At most max_sequences (its default): a reservation is granted only when a sequence is free to "
        "decode it, so a request beyond them waits in the router's queue, not silent inside the node",
    )
    lease_s: float = setting(30.0, help="slot lease when a reserve names none")
    max_lease_s: float = setting(
        DEFAULT_MAX_LEASE_S, help="longest lease a reserve may ask for (the router's reserve_lease_s must fit)"
    )
    transfer_timeout_s: float = setting(15.0, help="a decode request waits this long for its KV transfer")
    num_speculative_tokens: int | None = setting(
        None,
        help="MTP drafts per step for greedy requests (0: off); more than 0 needs a checkpoint with an MTP layer. "
        "Default: 1 when the checkpoint has one, else off",
    )
    accept_all_drafts: bool = setting(
        False,
        help="benchmarks only: every MTP draft is accepted whatever the main model says (the tokens are then not "
        "the greedy ones), to measure the serving path at full acceptance; needs num_speculative_tokens > 0, not "
        "with --tp",
    )
    draft_head: str = setting(
        "model",
        help="what the MTP drafts' vocabulary head reads: model (the checkpoint's head, as the verify step) or fp8 "
        "(a block-FP8 copy made at load, half the bytes a draft reads; the verify step keeps the model's head, so "
        "the tokens are the same and only how many drafts are accepted may change); fp8 needs a checkpoint with an "
        "MTP layer, num_speculative_tokens > 0 and --tp 1",
    )
    draft_vocab: str | None = setting(
        None,
        metavar="FILE",
        help="a JSON list of token ids, the only tokens the MTP drafts may propose (e.g. the most frequent ones of "
        "your traffic): a draft reads only their rows of the head, so it reads fewer bytes, and a token outside "
        "them is never drafted (the verify step decides every token as before, so the tokens are the same). "
        "Needs what --draft-head fp8 needs. Default: every token",
    )
    engine_cpus: str | None = setting(
        None,
        metavar="LIST",
        help="CPUs the engine's worker thread (and its torch threads) run on, e.g. '1' or '2-3' (Linux; like "
        "vLLM's VLLM_CPU_OMP_THREADS_BIND: the node's HTTP and control loop stay free to run elsewhere). "
        "Default: no pinning",
    )
    engine_process: bool = setting(
        False,
        help="run the engine (and its decode batch) in a process of its own, as vLLM runs its EngineCore, so "
        "the node's HTTP loop never holds the engine's GIL (tilert.decode.engine_process); not with --tp",
    )
    tp: int = setting(
        1,
        help="ranks (one process per GPU: cuda:0..N-1) that share the model, tensor parallel; rank 0 "
        "serves the ports and the others follow its steps (tilert.decode.tp)",
    )
    tp_allreduce: str = setting(
        "nccl",
        help="the all-reduce inside the captured steps with --tp > 1: nccl (the process group's own; gloo "
        "on CPU), symm_one_shot or symm_two_shot (PyTorch symmetric memory, CUDA only)",
    )
    max_http_connections: int = setting(
        1024, help="concurrent HTTP connections the node serves (uvicorn's limit_concurrency; 503 beyond)"
    )
    secret_file: str | None = SECRET_FILE.field()
    log_level: str = LOG_LEVEL.field()
    log_format: str = LOG_FORMAT.field()
    # Filled at load time from secret_file / $TILERT_SECRET_FILE / $TILERT_SECRET (tilert.auth.load_secret).
    secret: bytes = field(default=b"", repr=False)

    @property
    def engine_cpu_set(self) -> frozenset[int]:
        """``engine_cpus`` as a set of CPU numbers (empty: no pinning)."""
        return parse_cpu_list(self.engine_cpus or "")

    def advertised_host(self) -> str:
        """The address write grants name: ``advertise_host``, else ``host`` unless that binds every interface,
        then the address this host's name resolves to."""
        if self.advertise_host:
            return self.advertise_host
        if not is_wildcard(self.host):
            return self.host
        return socket.gethostbyname(socket.gethostname())

    @property
    def speculative_tokens(self) -> int:
        """``num_speculative_tokens``, or 1 (the engine drafts only when the checkpoint has an MTP layer)."""
        return 1 if self.num_speculative_tokens is None else self.num_speculative_tokens

    @property
    def slots(self) -> int:
        """Receive slots: ``num_slots``, or :attr:`sequences` (never more: a reservation is a sequence to decode)."""
        return self.num_slots if self.num_slots is not None else self.sequences

    @property
    def sequences(self) -> int:
        """``max_sequences``, or its default for the device: 8 on a CPU host, 4 on a GPU."""
        if self.max_sequences is not None:
            return self.max_sequences
        return DEFAULT_GPU_SEQUENCES if _on_cuda(self.device) else DEFAULT_CPU_SEQUENCES

    def validate(self) -> DecodeConfig:
        """Raise :class:`ConfigError` naming every setting the node cannot start with; returns ``self``."""
        d = lambda name: describe(DecodeConfig, name)  # noqa: E731
        problems: list[str] = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        need((Path(self.model) / "config.json").is_file(), f"{d('model')} must hold a config.json ({self.model})")
        given = self.max_sequences
        sequences_ok = given is None or (is_int(given) and 1 <= given <= 64)
        need(sequences_ok, f"{d('max_sequences')} must be in 1..64 ({self.max_sequences})")
        need(
            self.num_slots is None or (is_int(self.num_slots) and self.num_slots >= 1),
            f"{d('num_slots')} must be >= 1 ({self.num_slots})",
        )
        slots = self.num_slots
        if sequences_ok and isinstance(slots, int) and slots > self.sequences:
            problems.append(
                f"{d('num_slots')} must be at most the sequences decoded at once, {d('max_sequences')} "
                f"({slots} > {self.sequences}): a reservation beyond them would wait inside the node, its "
                "decode stream silent past the router's transfer timeout"
            )
        need(
            is_int(self.max_seq_len) and self.max_seq_len >= 2, f"{d('max_seq_len')} must be >= 2 ({self.max_seq_len})"
        )
        need(
            self.num_speculative_tokens is None
            or (is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 8),
            f"{d('num_speculative_tokens')} must be in 0..8 ({self.num_speculative_tokens})",
        )
        heads = ", ".join(DRAFT_HEADS)
        need(self.draft_head in DRAFT_HEADS, f"{d('draft_head')} must be one of {heads} ({self.draft_head!r})")
        # the MTP settings that only a node drafting on one rank can honour (the name as the refusal shows it)
        for name, asked in (
            (d("accept_all_drafts"), self.accept_all_drafts),
            (f"{d('draft_head')} {self.draft_head}", self.draft_head != "model"),
            (d("draft_vocab"), self.draft_vocab is not None),
        ):
            need(
                not asked or (self.speculative_tokens > 0 and self.tp == 1),
                f"{name} needs {d('num_speculative_tokens')} > 0 and {d('tp')} 1",
            )
        problems += self._checkpoint_problems() + self._draft_vocab_problems()
        for name in ("lease_s", "max_lease_s", "transfer_timeout_s"):
            value = getattr(self, name)
            need(is_number(value) and value > 0, f"{d(name)} must be > 0 ({value})")
        if is_number(self.lease_s) and is_number(self.max_lease_s):
            need(self.lease_s <= self.max_lease_s, f"{d('lease_s')} must not exceed max_lease_s ({self.max_lease_s})")
        need(
            is_int(self.max_http_connections) and self.max_http_connections >= 1,
            f"{d('max_http_connections')} must be >= 1 ({self.max_http_connections})",
        )
        for name in ("ctrl_port", "http_port"):
            try:
                check_port(getattr(self, name), d(name))
            except ConfigError as exc:
                problems.append(str(exc))
        need(self.ctrl_port != self.http_port, f"ctrl_port and http_port must differ ({self.ctrl_port})")
        problems += [p for p in (host_problem(self.host, d("host"), wildcard=True),) if p]
        if self.advertise_host is not None:
            problems += [p for p in (host_problem(self.advertise_host, d("advertise_host"), wildcard=False),) if p]
        need(isinstance(self.transport_options, dict), f"{d('transport_options')} must be a JSON object")
        need(
            isinstance(self.device, str) and bool(_DEVICE_RE.match(self.device)),
            f"{d('device')} must be auto, cpu, cuda or cuda:N ({self.device!r})",
        )
        need(is_int(self.tp) and 1 <= self.tp <= 64, f"{d('tp')} must be in 1..64 ({self.tp})")
        need(
            not (self.engine_process and self.tp > 1),
            f"{d('engine_process')} runs one engine; with {d('tp')} {self.tp} rank 0 serves in the node's process",
        )
        need(
            self.tp_allreduce in TP_ALLREDUCE,
            f"{d('tp_allreduce')} must be one of {', '.join(TP_ALLREDUCE)} ({self.tp_allreduce!r})",
        )
        need(
            self.tp_allreduce == "nccl" or self.device != "cpu",
            f"{d('tp_allreduce')} {self.tp_allreduce} needs CUDA devices",
        )
        need(self.dtype in DTYPES, f"{d('dtype')} must be one of {', '.join(DTYPES)} ({self.dtype!r})")
        try:
            cpus = self.engine_cpu_set
            usable = allowed_cpus()
            need(
                cpus <= usable,
                f"{d('engine_cpus')} names CPUs this process may not use: "
                f"{sorted(cpus - usable)} (usable: {sorted(usable)})",
            )
        except ValueError as exc:
            problems.append(f"{d('engine_cpus')}: {exc}")
        problem = secret_problem(self.secret, self.secret_file)
        if problem:
            problems.append(problem)
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    def _checkpoint_problems(self) -> list[str]:
        """What the checkpoint's config.json cannot honour: more positions than it has, MTP drafts without an
        MTP layer (read here, before the engine allocates anything)."""
        d = lambda name: describe(DecodeConfig, name)  # noqa: E731
        model = Path(self.model)
        if not (model / "config.json").is_file():
            return []  # said above
        too_long = context_problem(model, self.max_seq_len, d("max_seq_len"))
        problems = [too_long] if too_long else []
        drafts = self.num_speculative_tokens
        if mtp_layers(model) != 0:  # has one (or does not say)
            return problems
        config = model / "config.json"
        none = f"needs an MTP layer, but the checkpoint has none ({MTP_LAYERS_KEY} "
        none += f"{read_json(config).get(MTP_LAYERS_KEY, 'absent')} in {config})"
        if drafts is not None and is_int(drafts) and drafts > 0:
            problems.append(f"{d('num_speculative_tokens')} {drafts} {none}; use 0")
        if self.draft_head != "model":
            problems.append(f"{d('draft_head')} {self.draft_head} {none}")
        if self.draft_vocab is not None:
            problems.append(f"{d('draft_vocab')} {none}")
        return problems

    def _draft_vocab_problems(self) -> list[str]:
        """What is wrong with the ``draft_vocab`` file (against the checkpoint's vocabulary when it has one)."""
        try:
            self.draft_vocab_ids()
        except ValueError as exc:
            return [f"{describe(DecodeConfig, 'draft_vocab')}: {exc}"]
        return []

    def draft_vocab_ids(self) -> tuple[int, ...] | None:
        """The token ids of the ``draft_vocab`` file (validated at start-up), or ``None``."""
        if self.draft_vocab is None:
            return None
        config = Path(self.model) / "config.json"
        return read_draft_vocab(self.draft_vocab, read_json(config).get("vocab_size") if config.is_file() else None)


def read_draft_vocab(path: str, vocab_size: int | None) -> tuple[int, ...]:
    """The token ids of a ``--draft-vocab`` file: a JSON list of distinct integers in ``0..vocab_size - 1``, at least
    one; ValueError naming what is not."""
    try:
        ids = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read a JSON list from {path} ({exc})") from None
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        raise ValueError(f"{path} must hold a non-empty JSON list of token ids (integers)")
    problem = draft_vocab_problem(ids, vocab_size if isinstance(vocab_size, int) else None)
    if problem:
        raise ValueError(f"{path}: {problem}")
    return tuple(ids)


def load_decode_config(cli: Mapping[str, Any] | None = None) -> DecodeConfig:
    """The node's config: flags (``cli``, from :func:`tilert.settings.cli_values`) > environment >
    defaults, with the shared secret loaded; validated."""
    values = merge_values(DecodeConfig, [env_values(DecodeConfig), cli or {}])
    secret = try_load_secret(values.get("secret_file"))
    return build_config(DecodeConfig, values, secret=secret).validate()


def _on_cuda(device: str) -> bool:
    """Whether ``device`` (as given: auto, cpu, cuda, cuda:N) means a GPU."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {device} asked for, but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype!r}") from None


__all__ = [
    "DEFAULT_MAX_LEASE_S",
    "ConfigError",
    "DecodeConfig",
    "load_decode_config",
    "resolve_device",
    "resolve_dtype",
]
