"""The collectives of tensor parallelism over the ranks of one host (``Transformer.use_group``); what each rank
holds and how the weights are split is ``sharding.py``'s, how the model computes with its share ``model.py``'s.

Collectives (:class:`Group`): a sum all-reduce of the residual-stream partials (two per layer; each rank's share
is written by the kernel that computes it, :meth:`Group.partial`) and the
all-gather of the logits, through ``torch.distributed`` (NCCL on CUDA, gloo on CPU) or, on CUDA, PyTorch's
symmetric-memory one-shot / two-shot all-reduce (``allreduce="symm_one_shot"`` / ``"symm_two_shot"``). All of
them are captured inside the engine's CUDA graphs. NVLink multicast is whatever the machine says (this module
never sets ``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` or ``NVSHMEM_DISABLE_NVLS``).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

ALLREDUCE_KINDS = ("nccl", "symm_one_shot", "symm_two_shot")  # "nccl" means the process group's own (gloo on CPU)


class OneRank:
    """The collectives of a lone rank: nothing to communicate (the model's default)."""

    rank = 0
    size = 1

    def partial(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        """Where this rank writes its share of ``h += f(x)``, as ``(out, base)``: the kernel computing ``f`` writes
        ``out = base + f(x)`` (``base`` ``None``: ``f(x)`` alone), then :meth:`reduce_into` sums ``out`` over the
        ranks into ``h``. Rank 0 adds ``h``, the others only their share; ``out`` is ``h`` itself (NCCL / gloo
        reduce in place: call this after the last read of ``h`` but the kernel's own) or a symmetric-memory
        buffer. Nothing is copied or zeroed here: the kernel reads ``base`` and writes ``out`` in one pass. A lone
        rank: ``(h, h)``, the in-place residual add."""
        return h, h

    def reduce_into(self, h: Tensor, out: Tensor) -> None:
        """``h = sum over ranks of out`` (``out`` from :meth:`partial`)."""

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        """``[n, W]`` per rank -> ``[n, N W]`` (rank ``r``'s columns at ``r W``)."""
        return t


ONE_RANK = OneRank()


class Group(OneRank):
    """This rank's view of a ``torch.distributed`` process group (already initialised) and its collectives."""

    def __init__(
        self,
        pg: torch.distributed.ProcessGroup | None = None,
        *,
        allreduce: str = "nccl",
        device: torch.device | str = "cpu",
        max_numel: int = 0,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if allreduce not in ALLREDUCE_KINDS:
            raise ValueError(f"all-reduce {allreduce!r} unknown; choose one of {', '.join(ALLREDUCE_KINDS)}")
        group = pg if pg is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("torch.distributed is not initialised (parallel.init_process_group first)")
        self.pg: dist.ProcessGroup = group
        self.rank = dist.get_rank(self.pg)
        self.size = dist.get_world_size(self.pg)
        self.kind = allreduce
        self.device = torch.device(device)
        self._symm: Tensor | None = None
        if allreduce != "nccl":
            if self.device.type != "cuda":
                raise ValueError(f"all-reduce {allreduce!r} needs CUDA devices (got {self.device})")
            if max_numel <= 0:
                raise ValueError("the symmetric-memory all-reduce needs max_numel (its buffer size)")
            import torch.distributed._symmetric_memory as symm_mem  # lazy: CUDA symmetric memory only

            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before rendezvous by older torch
                symm_mem.enable_symm_mem_for_group(self.pg.group_name)
            # Two halves used in turn: a rank never rewrites the input a slower peer may still be reading.
            self._symm = symm_mem.empty(2 * max_numel, dtype=dtype, device=self.device)
            symm_mem.rendezvous(self._symm, self.pg.group_name)
            self._turn = 0

    def _symm_buf(self, t: Tensor) -> Tensor | None:
        """The next half of the symmetric-memory buffer, shaped as ``t`` (``None``: NCCL takes ``t``)."""
        if self._symm is None or t.dtype != self._symm.dtype or t.numel() > self._symm.numel() // 2:
            return None
        half = self._symm.numel() // 2
        self._turn ^= 1
        return self._symm[self._turn * half : self._turn * half + t.numel()].view(t.shape)

    def _reduce_symm(self, buf: Tensor, out: Tensor) -> None:
        """``out = sum over ranks of buf`` (``buf`` in symmetric memory)."""
        if self.kind == "symm_one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_out(buf.view(-1), "sum", self.pg.group_name, out=out.view(-1))
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(buf.view(-1), "sum", self.pg.group_name)
            out.copy_(buf)

    def partial(self, h: Tensor) -> tuple[Tensor, Tensor | None]:
        base = h if self.rank == 0 else None
        buf = self._symm_buf(h) if self.size > 1 else None
        return (h if buf is None else buf), base

    def reduce_into(self, h: Tensor, out: Tensor) -> None:
        if self.size == 1:
            return
        if out is h:
            torch.distributed.all_reduce(h, group=self.pg)
        else:
            self._reduce_symm(out, h)

    def all_reduce(self, t: Tensor) -> Tensor:
        if self.size == 1:
            return t
        buf = self._symm_buf(t)
        if buf is None:
            torch.distributed.all_reduce(t, group=self.pg)
        else:
            self._reduce_symm(buf.copy_(t), t)
        return t

    def all_gather(self, t: Tensor) -> Tensor:
        if self.size == 1:
            return t
        n, w = t.shape
        out = t.new_empty(self.size * n, w)
        _gather(out, t.contiguous(), group=self.pg)
        return out.view(self.size, n, w).transpose(0, 1).reshape(n, self.size * w)


# torch >= 2.13 names it all_gather_single (and deprecates the old name); 2.11 has only all_gather_into_tensor.
_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor


def init_process_group(
    rank: int, size: int, port: int, device: torch.device | str, *, host: str = "127.0.0.1"
) -> tuple[torch.distributed.ProcessGroup, torch.distributed.ProcessGroup]:
    """Join the ``size`` ranks of this host at ``host:port`` (rank 0 hosts the store). Returns the data group
    (NCCL on CUDA, gloo on CPU; the model's collectives and the prompt-state broadcast) and a gloo control
    group with no practical timeout (a follower waits there, on the CPU, for as long as the node is idle)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(minutes=10),
        device_id=dev if dev.type == "cuda" else None,
    )
    assert dist.group.WORLD is not None
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    # One eager collective, so that the NCCL communicator exists before any CUDA graph captures one.
    x = torch.ones(1, device=dev)
    dist.all_reduce(x)
    if int(x.item()) != size:
        raise RuntimeError(f"rank {rank}: the all-reduce of {size} ones gave {x.item()}")
    return dist.group.WORLD, ctrl
