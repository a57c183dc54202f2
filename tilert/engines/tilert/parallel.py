"""Tensor parallelism of the decoder over the ranks of one host: rank-local :class:`ModelArgs`, the
sharding of the fused state dict, and the collectives the model calls (``Transformer.use_group``).

What each rank holds (``N`` ranks, rank ``r``; the model docstring says how it computes with it):

- attention: heads ``r H/N .. (r+1) H/N - 1``: those heads' rows of ``q_b`` (of ``q_proj`` without q_lora) and
  of ``kv_b``, their columns of ``o_proj`` (``o_proj``'s bias on rank 0, zeros elsewhere). ``W_a`` (``q_a``,
  ``kv_a``), the norms, the latent cache and the whole DSA indexer (its weights, its key cache) are replicated:
  MLA has a single latent KV head that every query head reads (so every rank writes and reads the same latent
  rows; the cache is not split), and the indexer's top-k needs the sum over all indexer heads.
- MoE: the router (gate, bias) replicated; every expert (routed, shared, a dense MLP alike) split along its
  intermediate width: rank ``r`` holds gate / up rows and down columns ``r I/N .. (r+1) I/N - 1`` of each, in the
  one-GPU layout (shared experts stacked after the routed ones), so each rank runs the one-GPU MoE kernels on
  half-width experts. Not expert parallel: at decode batch sizes a rank would read the experts the router sends
  it, ``top_k / N`` only on average (``max(X, top_k - X)`` of ``top_k`` for two ranks, 5.1 of 8 expected for
  V3.2), and the step waits for the busiest rank; split along the width every rank reads the same bytes.
- ``lm_head`` and the MTP module's own head: vocabulary rows ``r V/N .. (r+1) V/N - 1``. Embeddings, the final
  norm and the rest of the MTP module (its norms, ``eh_proj``) replicated.

Collectives (:class:`Group`): a sum all-reduce of the residual-stream partials (two per layer; each rank's share
is written by the kernel that computes it, :meth:`Group.partial`) and the
all-gather of the logits, through ``torch.distributed`` (NCCL on CUDA, gloo on CPU) or, on CUDA, PyTorch's
symmetric-memory one-shot / two-shot all-reduce (``allreduce="symm_one_shot"`` / ``"symm_two_shot"``). All of
them are captured inside the engine's CUDA graphs. NVLink multicast is whatever the machine says (this module
never sets ``NCCL_NVLS_ENABLE``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST`` or ``NVSHMEM_DISABLE_NVLS``).
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .model import ModelArgs, Transformer

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
        import torch.distributed as dist

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
            import torch.distributed._symmetric_memory as symm_mem

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
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size, timeout=timedelta(minutes=10),
        device_id=dev if dev.type == "cuda" else None,
    )  # fmt: skip
    assert dist.group.WORLD is not None
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    # One eager collective, so that the NCCL communicator exists before any CUDA graph captures one.
    x = torch.ones(1, device=dev)
    dist.all_reduce(x)
    if int(x.item()) != size:
        raise RuntimeError(f"rank {rank}: the all-reduce of {size} ones gave {x.item()}")
    return dist.group.WORLD, ctrl


# ------------------------------------------------------------------------------------------------ sharding


def check_degree(args: ModelArgs, size: int) -> None:
    """``ValueError`` naming every dimension that ``size`` ranks cannot split evenly."""
    if size < 1:
        raise ValueError(f"tensor-parallel degree must be >= 1 (got {size})")
    if size == 1:
        return
    if args.fp8:
        raise ValueError("tensor parallelism over block-FP8 weights is not supported yet (the shards would cut "
                         "the 128-wide scale blocks): serve a bf16 checkpoint with --tp, or FP8 on one GPU")
    problems = []
    if args.num_heads % size:
        problems.append(f"{args.num_heads} attention heads")
    routed = "sparse" in args.mlp_layer_types or (args.num_mtp_layers and args.mtp_moe)
    if routed and args.moe_intermediate_size % size:
        problems.append(f"the experts' width {args.moe_intermediate_size}")
    dense = "dense" in args.mlp_layer_types or (args.num_mtp_layers and not args.mtp_moe)
    if dense and args.intermediate_size % size:
        problems.append(f"the dense MLP width {args.intermediate_size}")
    if args.vocab_size % size:
        problems.append(f"the vocabulary of {args.vocab_size}")
    if problems:
        raise ValueError(f"tensor-parallel degree {size} does not divide {', '.join(problems)}")


def local_args(args: ModelArgs, rank: int, size: int) -> ModelArgs:
    """Rank ``rank``'s :class:`ModelArgs`: its heads, dense-MLP and expert widths; ``tp_rank``/``tp_size`` set."""
    check_degree(args, size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    if args.tp_size != 1:
        raise ValueError("the args are already rank-local")
    return dataclasses.replace(
        args, num_heads=args.num_heads // size, intermediate_size=args.intermediate_size // size,
        moe_intermediate_size=args.moe_intermediate_size // size, tp_rank=rank, tp_size=size,
    )  # fmt: skip


def _part(t: Tensor, rank: int, size: int, dim: int = 0) -> Tensor:
    """Rank ``rank``'s ``1/size`` of ``t`` along ``dim``."""
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n)


def shard_expert(leaf: str, t: Tensor, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s share of an expert weight (a dense MLP is one expert), split along its intermediate width:
    ``w13 [..., 2I, D]``'s gate and up rows, ``w2 [..., D, I]``'s columns. ``t`` is one expert or a stack of them
    (the leading dims are kept): the engine shards stacks, ``tilert convert`` one expert at a time."""
    if leaf == "w13":
        inter = t.shape[-2] // 2
        g, u = t[..., :inter, :], t[..., inter:, :]
        return torch.cat([_part(g, rank, size, -2), _part(u, rank, size, -2)], -2).contiguous()
    if leaf == "w2":
        return _part(t, rank, size, -1).contiguous()
    raise ValueError(f"{leaf!r} is not an expert weight")


def shard_tensor(key: str, t: Tensor, args: ModelArgs, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s share of fused tensor ``key`` (``args`` global), the rule of the module docstring for
    everything but the experts (:func:`shard_expert`): a replicated tensor comes back as it is."""
    pre, _, leaf = key.rpartition(".")
    h, p, r, v = args.num_heads, args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    q_in = "wb" if args.q_lora_rank is not None else "wa"  # the block whose first H(P+R) rows are the query
    if pre.endswith("attn") and leaf in (q_in, q_in + "_bias"):
        q = t[: h * (p + r)].unflatten(0, (h, p + r))
        return torch.cat([_part(q, rank, size).flatten(0, 1), t[h * (p + r) :]])
    if pre.endswith("attn") and leaf == "wkv_b":
        return _part(t.unflatten(0, (h, p + v)), rank, size).flatten(0, 1).contiguous()
    if pre.endswith("attn") and leaf == "wo":
        return _part(t, rank, size, dim=1).contiguous()
    if pre.endswith("attn") and leaf == "wo_bias":  # added once, by rank 0
        return t if rank == 0 else torch.zeros_like(t)
    if key in ("lm_head", "mtp.0.head"):
        return _part(t, rank, size).contiguous()
    return t


def shard_state_dict(sd: dict[str, Tensor], args: ModelArgs, rank: int, size: int) -> dict[str, Tensor]:
    """The fused state dict of the whole model (``weights.fuse_state_dict``; ``args`` global) -> rank ``rank``'s
    (for ``Transformer(local_args(args, rank, size))``). Replicated tensors are shared, not copied."""
    check_degree(args, size)
    if size == 1:
        return dict(sd)
    return {key: shard(key, t, args, rank, size) for key, t in sd.items()}


def shard(key: str, t: Tensor, args: ModelArgs, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s share of fused tensor ``key``: an expert weight (``w13`` / ``w2``, one expert or a stack) by
    :func:`shard_expert`, anything else by :func:`shard_tensor`."""
    leaf = key.rpartition(".")[2]
    return shard_expert(leaf, t, rank, size) if leaf in ("w13", "w2") else shard_tensor(key, t, args, rank, size)


def shard_model(model: Transformer, rank: int, size: int) -> Transformer:
    """Rank ``rank``'s share of a whole ``model`` (weights on the model's device and dtype; caches allocated as the
    model's). Used with ``weights.random_model`` (benchmarks, tests); checkpoints shard as they load."""
    from .model import Transformer
    from .weights import finish_model

    sd = {k: t.detach() for k, t in model.state_dict().items()}
    args = local_args(model.args, rank, size)
    with torch.device("meta"):
        local = Transformer(args)
    device, dtype = model.embed.device, model.embed.dtype
    return finish_model(local, shard_state_dict(sd, model.args, rank, size), device, dtype, model.max_seq_len,
                        model.max_sequences)
