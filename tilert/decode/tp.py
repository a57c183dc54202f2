"""The tensor-parallel decode node (``tilert decode --tp N``): one process per rank; rank 0 serves, the others
follow its steps.

Rank 0 runs the ordinary decode node (HTTP and control ports, slots, transport, batch) over a
:class:`LeaderEngine`: its own rank's :class:`~tilert.engines.tilert.engine.TileRTEngine` behind a proxy that
announces every call that computes to the other ranks before making it: a fixed-size int64 header on the gloo
control group (op, sequence, position, token count, drafts, then the tokens / positions / sequences inline),
and for :meth:`LeaderEngine.inject` the prompt state, broadcast over the data group (NCCL on CUDA: the one rank
that received it from prefill hands it to the others over NVLink; gloo on CPU). Every rank then makes the same
engine call with the same inputs, so all ranks run the same model steps and the same collectives in the same
order (a CUDA graph is captured by every rank at the same call). The ranks' results agree (the logits are
all-gathered: every rank takes the same argmax and keeps the same bookkeeping); rank 0's are used.

A follower (:func:`follow`) moves through explicit states::

    WAITING --header--> RUNNING(op) --the call returns--> WAITING
       |                    +------ the call raises ValueError ------> WAITING (rank 0 raised it too, and reports it)
       +--STOP, or rank 0 gone (the control group fails)--> STOPPED

Every engine call validates its inputs before its first collective, so a refused call is refused by every rank
alike. The leader does not declare ``pipelined_greedy``: a plain greedy request decodes through ``forward``, one
announced step at a time (the pipelined stream would need the followers to know when rank 0 stops reading).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tilert.decode.config import DecodeConfig, resolve_device, resolve_dtype
from tilert.decode.server import DecodeNode, bind_sockets, run_node
from tilert.engines.base import Capabilities, DecodeEngine, KVLayout, SpecStepResult
from tilert.engines.tilert import parallel, sharding
from tilert.engines.tilert.engine import GRAPH_MAX_TOKENS, TileRTEngine
from tilert.engines.tilert.ops import register_device_kernels
from tilert.engines.tilert.parallel import Group
from tilert.engines.tilert.weights import args_from_hf_config, checkpoint_keys, load_hf_config, load_model
from tilert.logs import configure
from tilert.netio import free_port
from tilert.settings import ConfigError

log = logging.getLogger(__name__)

INLINE = 64  # tokens / positions / sequences carried in the header itself (more: one more broadcast)
_FIELDS = 8  # op, seq, start_pos, n, num_draft, then unused
HEADER_LEN = _FIELDS + 3 * INLINE


class Op(enum.IntEnum):
    """The engine calls a leader announces (the header's first field)."""

    STOP = 0
    INJECT = 1
    FORWARD = 2
    DECODE = 3
    DECODE_GREEDY = 4
    SPEC = 5


class FollowerState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    STOPPED = "stopped"


class Channel:
    """The leader -> followers messages: headers on the control group, bulk tensors on the data group."""

    def __init__(self, group: Group, ctrl: Any, device: torch.device) -> None:
        self.group = group
        self.ctrl = ctrl
        self.device = device

    def send(
        self,
        op: Op,
        seq: int = 0,
        start_pos: int = 0,
        num_draft: int = 0,
        rows: list[list[int]] | None = None,
        n: int = 0,
    ) -> None:
        """(rank 0) Announce ``op``; ``rows``: up to three int lists of length ``n`` (tokens, positions, seqs)."""
        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        head[:5] = torch.tensor([int(op), seq, start_pos, n, num_draft])
        body = torch.tensor(rows or [[0] * n], dtype=torch.int64).reshape(-1, n) if n else None
        if body is not None and n <= INLINE:
            for i, row in enumerate(body):
                head[_FIELDS + i * INLINE : _FIELDS + i * INLINE + n] = row
        torch.distributed.broadcast(head, 0, group=self.ctrl)
        if body is not None and n > INLINE:
            torch.distributed.broadcast(body.contiguous(), 0, group=self.ctrl)

    def recv(self) -> tuple[Op, int, int, int, torch.Tensor]:
        """(followers) The next announcement: ``(op, seq, start_pos, num_draft, rows [3, n])``."""
        head = torch.zeros(HEADER_LEN, dtype=torch.int64)
        torch.distributed.broadcast(head, 0, group=self.ctrl)
        op, seq, start_pos, n, num_draft = head[:5].tolist()
        if n > INLINE:
            body = torch.zeros(3, n, dtype=torch.int64)
            torch.distributed.broadcast(body, 0, group=self.ctrl)
        else:
            body = head[_FIELDS:].view(3, INLINE)[:, :n].clone()
        return Op(op), seq, start_pos, num_draft, body

    def send_state(self, state: dict[str, torch.Tensor], layouts: dict[str, KVLayout], num_tokens: int) -> None:
        """(rank 0, after an INJECT header) The layouts and shapes, then every tensor over the data group."""
        meta: list[Any] = [layouts, {k: tuple(t.shape) for k, t in state.items()}, num_tokens]
        torch.distributed.broadcast_object_list(meta, 0, group=self.ctrl)
        for name in sorted(state):
            t = state[name].to(self.device).contiguous()
            torch.distributed.broadcast(t, 0, group=self.group.pg)

    def recv_state(self) -> tuple[dict[str, torch.Tensor], dict[str, KVLayout], int]:
        meta: list[Any] = [None, None, None]
        torch.distributed.broadcast_object_list(meta, 0, group=self.ctrl)
        layouts, shapes, num_tokens = meta
        state = {}
        for name in sorted(shapes):
            t = torch.empty(shapes[name], dtype=torch.uint8, device=self.device)
            torch.distributed.broadcast(t, 0, group=self.group.pg)
            state[name] = t
        return state, layouts, num_tokens


class LeaderEngine(DecodeEngine):
    """Rank 0's engine as the decode node sees it: each call that computes is announced, then made locally."""

    name = "tilert"

    def __init__(self, engine: TileRTEngine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.tp = channel.group.size
        self._lock = threading.Lock()  # one announcement + call at a time, whichever thread calls
        self._closed = False

    @classmethod
    def load(
        cls, model_dir: Path, *, device: str, dtype: torch.dtype, max_seq_len: int, max_sequences: int = 1
    ) -> DecodeEngine:
        raise NotImplementedError("a tensor-parallel engine is started by `tilert decode --tp N` (tilert.decode.tp)")

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def capabilities(self) -> Capabilities:
        caps = self.engine.capabilities()
        notes = (*caps.notes, f"tensor parallel over {self.tp} ranks; greedy steps announced one by one")
        return replace(caps, pipelined_greedy=False, notes=notes)

    def expected_layouts(self) -> dict[str, KVLayout]:
        return self.engine.expected_layouts()

    def check_layouts(self, layouts: Mapping[str, KVLayout]) -> None:
        self.engine.check_layouts(layouts)

    def inject(
        self,
        state: dict[str, torch.Tensor],
        layouts: dict[str, KVLayout],
        num_tokens: int,
        seq: int = 0,
        last_token_id: int | None = None,
    ) -> None:
        with self._lock:
            rows = None if last_token_id is None else [[last_token_id]]  # the prompt's last token, when known
            self.channel.send(Op.INJECT, seq, rows=rows, n=0 if rows is None else 1)
            self.channel.send_state(state, layouts, num_tokens)
            self.engine.inject(state, layouts, num_tokens, seq, last_token_id)

    def forward(self, token_ids: torch.Tensor, start_pos: int, seq: int = 0) -> torch.Tensor:
        tokens = token_ids.reshape(-1).tolist()
        with self._lock:
            self.channel.send(Op.FORWARD, seq, start_pos, rows=[tokens], n=len(tokens))
            return self.engine.forward(torch.tensor(tokens, dtype=torch.int64), start_pos, seq)

    def decode_step(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        with self._lock:
            self.channel.send(Op.DECODE, rows=[tokens, positions, seqs], n=_same_len(tokens, positions, seqs))
            return self.engine.decode_step(tokens, positions, seqs)

    def decode_step_greedy(self, tokens: list[int], positions: list[int], seqs: list[int]) -> list[int]:
        with self._lock:
            self.channel.send(Op.DECODE_GREEDY, rows=[tokens, positions, seqs], n=_same_len(tokens, positions, seqs))
            return self.engine.decode_step_greedy(tokens, positions, seqs)

    def speculative_greedy_step(
        self, next_token: int, start_pos: int, num_draft: int, seq: int = 0, accept_all: bool = False
    ) -> SpecStepResult:
        if accept_all:  # the followers' step would verify: refused at start-up (DecodeConfig.validate)
            raise ValueError("accept_all is not served tensor parallel")
        with self._lock:
            self.channel.send(Op.SPEC, seq, start_pos, num_draft, rows=[[next_token]], n=1)
            return self.engine.speculative_greedy_step(next_token, start_pos, num_draft, seq)

    def close(self) -> None:
        """Tell the followers to stop (idempotent; a follower already gone is only logged)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self.channel.send(Op.STOP)
                except RuntimeError as exc:
                    log.warning("tilert tp: could not tell the followers to stop: %s", exc)


def _same_len(*lists: list[int]) -> int:
    """The common length (the engine refuses ragged lists itself; a ragged announcement cannot be built)."""
    n = len(lists[0])
    if any(len(x) != n for x in lists):
        raise ValueError(f"decode_step needs one token, position and sequence per row (got {[len(x) for x in lists]})")
    return n


def follow(engine: TileRTEngine, channel: Channel) -> FollowerState:
    """A follower rank's loop: make every call rank 0 announces, until STOP (or rank 0 is gone)."""
    state = FollowerState.WAITING
    while state is not FollowerState.STOPPED:
        try:
            op, seq, start_pos, num_draft, rows = channel.recv()
        except RuntimeError as exc:  # the control group failed: rank 0 exited
            log.warning("tilert tp follower: rank 0 is gone (%s); stopping", exc)
            state = FollowerState.STOPPED
            break
        if op is Op.STOP:
            state = FollowerState.STOPPED
            break
        state = FollowerState.RUNNING
        try:
            if op is Op.INJECT:
                kv, layouts, num_tokens = channel.recv_state()
                engine.inject(kv, layouts, num_tokens, seq, int(rows[0, 0]) if rows.shape[1] else None)
            elif op is Op.FORWARD:
                engine.forward(rows[0], start_pos, seq)
            elif op is Op.DECODE:
                engine.decode_step(*(r.tolist() for r in rows))
            elif op is Op.DECODE_GREEDY:
                engine.decode_step_greedy(*(r.tolist() for r in rows))
            elif op is Op.SPEC:
                engine.speculative_greedy_step(int(rows[0, 0]), start_pos, num_draft, seq)
        except ValueError as exc:  # refused before any collective, on rank 0 as well
            log.info("tilert tp follower: %s refused: %s", op.name, exc)
        state = FollowerState.WAITING
    return state


# ------------------------------------------------------------------------------------------------ launch


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:rank`` for a CUDA node (``--device cuda``), else the CPU."""
    return torch.device("cuda", rank) if device.startswith("cuda") else torch.device("cpu")


def load_rank(
    model: Path,
    pg: Any,
    ctrl: Any,
    dev: torch.device,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int,
    allreduce: str = "nccl",
) -> tuple[TileRTEngine, Channel]:
    """This rank's share of the model in a ready engine, and its channel (the process group joined already)."""
    rank, size = torch.distributed.get_rank(pg), torch.distributed.get_world_size(pg)
    if dev.type == "cuda":
        register_device_kernels()
    m = load_model(
        model, device=dev, dtype=dtype, max_seq_len=max_seq_len, max_sequences=max_sequences, tp=(rank, size)
    )
    group = parallel.Group(
        pg, allreduce=allreduce, device=dev, dtype=dtype, max_numel=GRAPH_MAX_TOKENS * m.args.hidden_size
    )
    m.use_group(group)
    return TileRTEngine(m, dev, dtype, max_seq_len), Channel(group, ctrl, dev)


def start_rank(
    model: Path,
    rank: int,
    size: int,
    port: int,
    device: str,
    dtype: torch.dtype,
    max_seq_len: int,
    max_sequences: int,
    allreduce: str = "nccl",
) -> tuple[TileRTEngine, Channel]:
    """Join the group of ``size`` ranks at ``port``, then :func:`load_rank`."""
    dev = rank_device(device, rank)
    pg, ctrl = parallel.init_process_group(rank, size, port, dev)
    return load_rank(model, pg, ctrl, dev, dtype, max_seq_len, max_sequences, allreduce)


def _follower_main(
    model: str,
    rank: int,
    size: int,
    port: int,
    device: str,
    dtype: str,
    max_seq_len: int,
    max_sequences: int,
    allreduce: str,
    log_level: str,
    log_format: str,
) -> None:
    configure(log_level, log_format)
    engine, channel = start_rank(
        Path(model), rank, size, port, device, getattr(torch, dtype), max_seq_len, max_sequences, allreduce
    )
    follow(engine, channel)
    torch.distributed.destroy_process_group()


def check_tp(config: DecodeConfig, device: str) -> None:
    """``ConfigError`` when ``config.tp`` ranks cannot run this model on this machine (before any rank starts)."""
    if config.engine != "tilert":
        raise ConfigError(f"--tp {config.tp} needs the tilert engine (got {config.engine!r})")
    if config.tp_allreduce != "nccl" and not device.startswith("cuda"):
        raise ConfigError(f"--tp-allreduce {config.tp_allreduce} needs CUDA devices (the node runs on {device})")
    if device.startswith("cuda"):
        if device != "cuda":
            raise ConfigError(f"--tp {config.tp} uses cuda:0..{config.tp - 1}; pass --device cuda (got {device})")
        if torch.cuda.device_count() < config.tp:
            raise ConfigError(f"--tp {config.tp} needs {config.tp} GPUs; this machine has {torch.cuda.device_count()}")
    args = args_from_hf_config(load_hf_config(config.model), checkpoint_keys(config.model))
    try:
        sharding.check_degree(args, config.tp)
    except ValueError as exc:
        raise ConfigError(f"--tp {config.tp}: {exc}") from None


def serve_tp(config: DecodeConfig) -> None:
    """``tilert decode --tp N``: start ranks 1..N-1 (spawned processes), then serve as rank 0 until stopped."""
    device = resolve_device(config.device)
    check_tp(config, device)
    dtype = resolve_dtype(config.dtype, device)
    sockets = bind_sockets(config)  # the node's ports, before the ranks load
    port = free_port()
    ctx = torch.multiprocessing.get_context("spawn")
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    followers = [
        ctx.Process(
            target=_follower_main,
            name=f"tilert-tp-rank{r}",
            daemon=True,
            args=(
                str(config.model),
                r,
                config.tp,
                port,
                device,
                names[dtype],
                config.max_seq_len,
                config.sequences,
                config.tp_allreduce,
                config.log_level,
                config.log_format,
            ),
        )
        for r in range(1, config.tp)
    ]
    for p in followers:
        p.start()
    leader: LeaderEngine | None = None
    try:
        engine, channel = start_rank(
            config.model, 0, config.tp, port, device, dtype, config.max_seq_len, config.sequences, config.tp_allreduce
        )
        leader = LeaderEngine(engine, channel)
        node = DecodeNode(config, leader)
        log.info("tilert decode: rank 0 of %d serving (pid %d)", config.tp, os.getpid())
        run_node(node, sockets)
    finally:
        sockets.close()
        if leader is not None:
            leader.close()
        for p in followers:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
