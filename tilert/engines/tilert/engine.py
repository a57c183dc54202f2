"""``TileRTEngine``: the TileRT decode engine (thin wrapper; the math lives in ``model.py``).

Sequences: the engine holds ``max_sequences`` independent sequences (slots ``0..max_sequences-1``), each with
``max_seq_len`` positions. Every method takes ``seq`` (default 0) and :meth:`TileRTEngine.decode_step` advances
several sequences by one token each in one step.

State per sequence slot (static, allocated at load): the latent cache rows ``[layers, S, L+R]``, the DSA
indexer key rows ``[index layers, S, Di]``, and, when the checkpoint has an MTP module, its own latent (and
indexer) rows plus per-position buffers of main-model hidden states and tokens that the MTP module needs to
(re)compute its rows, and the bookkeeping below (:class:`_Seq`). The caches hold the slots one after the other
(slot ``b`` in rows ``b*S..b*S+S-1``; see ``model.py``).

MTP row bookkeeping (per sequence): MTP row ``r`` holds the module's KV for input ``(h_r, t_{r+1})``. Rows are
only valid once computed from the main model's real hidden ``h_r``; the valid rows are kept as one range
``[mtp_lo, mtp_upto)`` (rows of an injected prompt without MTP KV lie below it) and the MTP attention
runs dense over ``mtp_lo..row``. ``speculative_greedy_step`` first catches up the MTP rows whose inputs
became known (``[mtp_upto, L-1]``), which also yields the first draft; when those rows do not continue
the range (a gap after a rewind), the range restarts at them.

On CUDA the main-model step of 1..16 tokens runs as one CUDA graph per ``(n, dense/DSA)``
(``fast.CapturedFn``, captured at first use); its inputs are the tokens, their cache rows and (several
sequences) each token's first row, all device tensors, so the same graph serves a verify batch of one sequence
and a :meth:`~TileRTEngine.decode_step` over ``n`` sequences. A speculative step (MTP catch-up + draft chain +
verify + the verify's argmax) is one graph per ``(drafts, catch-up rows, dense/DSA)``: one launch and one host
read per step; :meth:`~TileRTEngine.speculative_stream` runs its steps from state on the device (one graph per
``(drafts, dense/DSA, accept_all)``), each launched before the host reads the one before. Prefill runs eagerly
(the same functions).

On CPU the model computes with :mod:`.ops.cpu` (the native row-invariant kernels of :mod:`.ops.native` where a C
compiler is present, else ATen; over only the cache rows a step reads; ``TILERT_CPU_FAST=0`` or
``cpu_kernels=False`` keeps the dispatched reference ops) and reads one sequence through a view of its own rows;
``decode_step`` runs the rows of several sequences as one model call over flat cache rows (the kernels give each
row the bits it gets alone). With the reference ops the sequences run one after the other (they round a row
differently in batches of different sizes).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tilert.engines.base import Capabilities, DecodeEngine, KVLayout, SpecStepResult, check_decode_batch
from tilert.engines.plugin import DRAFT_HEADS, draft_vocab_problem
from tilert.engines.shaping import NextMask, Shaping

from . import layouts
from .fast import CapturedFn
from .model import Transformer
from .ops import cpu as cpu_ops
from .ops import native, register_device_kernels
from .weights import load_model

GRAPH_MAX_TOKENS = 16  # main-model steps of up to this many tokens are replayed as CUDA graphs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_OP_NAMES = (
    "rms_norm",
    "gemv",
    "gemv_residual",
    "mla_prep",
    "mla_attention",
    "mla_sparse_attention",
    "indexer_topk",
    "mla_uv",
    "mla_attention_uv",
    "moe_experts",
    "moe_residual",
    "moe_block",
    "router",
    "moe_partial",
)

log = logging.getLogger(__name__)


def cpu_kernels_wanted(flag: bool | None = None) -> bool:
    """Whether a CPU engine computes with :mod:`.ops.cpu`: ``flag`` when given, else ``$TILERT_CPU_FAST``
    (default on; ``0``/``false``/``off`` turn it off). Off as well when some ``tilert::*`` op has a CPU kernel
    registered through ``torch.library`` (the direct calls would bypass it)."""
    if flag is None:
        flag = os.environ.get("TILERT_CPU_FAST", "1").strip().lower() not in ("0", "false", "no", "off")
    if flag:
        overridden = [n for n in _OP_NAMES if torch._C._dispatch_has_kernel_for_dispatch_key(f"tilert::{n}", "CPU")]
        if overridden:
            log.warning("tilert: CPU kernels registered for %s; the CPU fast path is off", overridden)
            return False
    return flag


@dataclass
class _Seq:
    """Bookkeeping of one sequence slot (positions are the sequence's own, ``0..max_seq_len-1``)."""

    len: int = 0  # positions [0, len) hold the sequence in the main cache
    hid_lo: int = 0  # positions [hid_lo, len) of the hidden-state buffer are valid
    mtp_upto: int = 0  # MTP rows < mtp_upto are computed (or permanently invalid)
    mtp_lo: int = 0  # MTP rows >= mtp_lo (and < mtp_upto) are valid
    recompute_last: int | None = None  # injected prompt's last token: its position is recomputed to draft


class TileRTEngine(DecodeEngine):
    """Plain-PyTorch MLA/DSA/MoE decoder for ``deepseek_v3``, ``deepseek_v32`` and ``glm_moe_dsa``."""

    name = "tilert"
    kind = "node-engine"

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        dtype: torch.dtype,
        max_seq_len: int,
        *,
        cpu_kernels: bool | None = None,
    ) -> None:
        if model.max_seq_len != max_seq_len:
            raise ValueError(f"the model's caches hold {model.max_seq_len} positions, not {max_seq_len}")
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.max_sequences = model.max_sequences
        a = model.args
        # Per-position buffers for the MTP module (flat rows, as the caches): main final-norm hidden h_r, token t_r.
        n_buf = self.max_sequences * max_seq_len if a.num_mtp_layers else 0
        self._hidden = torch.zeros(n_buf, a.hidden_size, dtype=dtype, device=device)
        self._tokens = torch.zeros(n_buf + 1, dtype=torch.int64, device=device)
        self._seqs = [_Seq() for _ in range(self.max_sequences)]
        self._mtp_from = torch.zeros(1, dtype=torch.int64, device=device)  # the MTP attention's first row (graphs)
        # CUDA: flat cache rows, graphs. Elsewhere: each sequence through a view of its own rows.
        self.flat = device.type == "cuda"
        self.use_graphs = device.type == "cuda"
        self.cpu_kernels = device.type == "cpu" and cpu_kernels_wanted(cpu_kernels)
        self.cpu_native = False
        if self.cpu_kernels:
            model.use_kernels(cpu_ops)
            self.cpu_native = native.kernels() is not None  # built now (about a second), not in a request's step
        self._graphs: dict[tuple[int, bool], CapturedFn | None] = {}
        self._spec_graphs: dict[tuple[int, int, bool], CapturedFn | None] = {}
        self._draft_choice: tuple[str, tuple[int, ...] | None] = ("model", None)  # use_draft_head's
        # greedy_stream's step: reads and advances these on the device (token, its cache row, its first row; the
        # first row is speculative_stream's too)
        self._stream_tok = torch.zeros(1, dtype=torch.int64, device=device)
        self._stream_pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._stream_base = torch.zeros(1, dtype=torch.int64, device=device)
        self._stream_graphs: dict[bool, CapturedFn | None] = {}
        # speculative_stream's step: its first token's model row, which it advances by what it accepts (the
        # sequence's first row: _stream_base); its drafts, verify tokens and accepted count
        self._spec_row = torch.zeros(1, dtype=torch.int64, device=device)
        self._spec_out = torch.zeros(2 * GRAPH_MAX_TOKENS + 1, dtype=torch.int64, device=device)
        self._spec_run_graphs: dict[tuple[int, bool, bool], CapturedFn] = {}
        # greedy_batch_stream's graphs by (rows, regime) and their static tokens / cache rows / first rows by rows
        self._batch_graphs: dict[tuple[int, bool], CapturedFn] = {}
        self._batch_bufs: dict[int, tuple[torch.Tensor, ...]] = {}
        # shaped_greedy_stream's graphs and their static rules, logits row and grammar bitmask (made at first use)
        self._shaped_graphs: dict[bool, CapturedFn] = {}
        self._shape_pick: CapturedFn | None = None
        self._shape_static: Shaping | None = None
        self._shape_bits: torch.Tensor | None = None
        self._shape_bits_host = torch.empty(0, dtype=torch.int32)
        self._shape_logits = torch.empty(0, dtype=torch.float32)
        if self.use_graphs:  # where the host reads the streamed tokens (pinned: asynchronous copies)
            self._stream_host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            self._stream_done = (torch.cuda.Event(), torch.cuda.Event())
            self._batch_host = torch.empty(2, GRAPH_MAX_TOKENS, dtype=torch.int64, pin_memory=True)
            self._spec_host = torch.empty(2, 2 * GRAPH_MAX_TOKENS + 1, dtype=torch.int64, pin_memory=True)
            self._spec_done = (torch.cuda.Event(), torch.cuda.Event())
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None  # shared by the graphs

    # ----------------------------------------------------------------------------- contract

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_seq_len: int = 4096,
        max_sequences: int = 1,
    ) -> TileRTEngine:
        """Read the HF checkpoint in ``model_dir`` (bf16/fp16/fp32 safetensors) and allocate the caches of
        ``max_sequences`` sequences of ``max_seq_len`` positions."""
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1 ({max_sequences})")
        dev = torch.device(device)
        if dev.type == "cuda":
            register_device_kernels()  # Triton kernels over the reference ops (a no-op without Triton)
        model = load_model(
            Path(model_dir), device=dev, dtype=dtype, max_seq_len=max_seq_len, max_sequences=max_sequences
        )
        return cls(model, dev, dtype, max_seq_len)

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    @property
    def supports_mtp(self) -> bool:
        """True when the checkpoint carries an MTP module (``speculative_greedy_step`` can draft)."""
        return self.model.args.num_mtp_layers > 0

    def capabilities(self) -> Capabilities:
        a = self.model.args
        if self.use_graphs:
            notes = [f"arch={a.arch}", f"CUDA-graph decode steps (1..{GRAPH_MAX_TOKENS} tokens)"]
        elif self.cpu_kernels:
            how = "native row-invariant kernels" if self.cpu_native else "ATen only (no native kernels)"
            notes = [f"arch={a.arch}", f"CPU kernels (ops.cpu: {how}), a decode_step's sequences in one model call"]
        else:
            notes = [f"arch={a.arch}", "reference PyTorch kernels"]
        if a.dsa:
            notes.append(f"DSA sparse attention, index_topk={a.index_topk}")
        if self.supports_mtp:
            notes.append(
                "MTP speculative decoding: greedy requests only (temperature > 0 decodes without MTP); after an "
                "injection that names the prompt's last token, drafts from the first step (that position is "
                "recomputed once for its hidden state, which the KV does not carry), else from the second"
            )
        return Capabilities(
            mtp=self.supports_mtp,
            pipelined_greedy=True,
            max_seq_len=self.max_seq_len,
            max_sequences=self.max_sequences,
            notes=tuple(notes),
        )

    def expected_layouts(self) -> dict[str, KVLayout]:
        """``"mla"``: vLLM's dense latent rows in the model dtype (rope interleaved) for every main layer;
        ``"indexer"`` (DSA): per-token fp8 key rows + fp32 scale for every layer with its own indexer."""
        a = self.model.args
        dt = _DTYPE_NAMES[self.dtype]
        item = torch.empty((), dtype=self.dtype).element_size()
        out = {"mla": KVLayout("mla_dense", dt, a.latent_dim * item, a.num_layers, rope_interleaved=True)}
        if a.dsa:
            out["indexer"] = KVLayout(
                "dsa_indexer",
                "float8_e4m3fn",
                layouts.dsa_indexer_row_bytes(a.index_head_dim),
                len(a.index_layers),
                rope_interleaved=a.indexer_rope_interleave,
            )
        return out

    def check_layouts(self, layouts_: Mapping[str, KVLayout]) -> None:
        """Every layout ``inject`` can convert: ``"mla"`` as ``mla_dense`` (float32 / bfloat16 / float16)
        or ``fp8_ds_mla`` for the main layers (plus one MTP layer when the model has one), and for DSA
        models ``"indexer"`` as ``dsa_indexer`` rows with the model's indexer RoPE convention (plus the MTP
        layer's own indexer exactly when the MTP layer's KV is given and the MTP layer has an indexer)."""
        a = self.model.args
        unknown = set(layouts_) - {"mla", "indexer"}
        if unknown or "mla" not in layouts_:
            raise ValueError(f"expected KV tensors 'mla' (+ 'indexer' for DSA), got {sorted(layouts_)}")
        if a.dsa and "indexer" not in layouts_:
            raise ValueError("DSA model: the 'indexer' KV is required")
        if not a.dsa and "indexer" in layouts_:
            raise ValueError("this model has no DSA indexer; unexpected 'indexer' KV")
        lay = layouts_["mla"]
        layer_counts = {a.num_layers, a.num_layers + 1} if a.num_mtp_layers else {a.num_layers}
        if lay.num_layers not in layer_counts:
            raise ValueError(f"mla layout has {lay.num_layers} layers, model has {a.num_layers}")
        row = layouts.mla_row_bytes(lay.kind, lay.dtype, a.kv_lora_rank, a.qk_rope_head_dim)
        if lay.row_bytes != row:
            raise ValueError(f"mla rows of {lay.row_bytes} bytes, {lay.kind}/{lay.dtype} has {row}")
        if a.dsa:
            ilay = layouts_["indexer"]
            if ilay.kind != "dsa_indexer":
                raise ValueError(f"unknown indexer KV layout kind {ilay.kind!r} (supported: 'dsa_indexer')")
            if ilay.rope_interleaved != a.indexer_rope_interleave:
                raise ValueError(
                    f"indexer rope_interleaved={ilay.rope_interleaved}, but {a.arch}'s indexer RoPE is "
                    f"{'interleaved' if a.indexer_rope_interleave else 'half-split'}"
                )
            want = len(a.index_layers) + int(lay.num_layers == a.num_layers + 1 and a.mtp_indexer)
            if ilay.num_layers != want:
                raise ValueError(
                    f"indexer layout has {ilay.num_layers} layers, expected {want} "
                    f"({len(a.index_layers)} main{' + the MTP layer' if want > len(a.index_layers) else ''})"
                )
            want_row = layouts.dsa_indexer_row_bytes(a.index_head_dim)
            if ilay.row_bytes != want_row:
                raise ValueError(f"indexer rows of {ilay.row_bytes} bytes, expected {want_row}")

    @torch.no_grad()
    def inject(
        self,
        state: dict[str, torch.Tensor],
        layouts_: dict[str, KVLayout],
        num_tokens: int,
        seq: int = 0,
        last_token_id: int | None = None,
    ) -> None:
        """Replace sequence ``seq`` with a prompt of ``num_tokens`` tokens whose KV is ``state`` (the other
        sequences are untouched).

        ``state["mla"]``: ``uint8 [N or N+1, num_tokens, row_bytes]`` of kind ``mla_dense`` (float32 /
        bfloat16 / float16) or ``fp8_ds_mla``; an extra last layer is taken as the MTP layer's KV (rows
        then valid). ``state["indexer"]`` (DSA only): kind ``dsa_indexer`` per-token rows, the MTP layer's
        last when it has its own indexer. ``last_token_id`` (the prompt's last token): the first speculative
        step recomputes that position for its hidden state and drafts at once. Raises ``ValueError`` on
        unknown names, kinds, shapes or rope conventions, and on a ``seq`` out of range.
        """
        a = self.model.args
        self._check_seq(seq)
        if not 0 < num_tokens <= self.max_seq_len:
            raise ValueError(f"num_tokens={num_tokens} outside 1..{self.max_seq_len}")
        self.check_layouts(layouts_)
        if set(state) != set(layouts_):
            raise ValueError(f"state tensors {sorted(state)} do not match their layouts {sorted(layouts_)}")
        lay = layouts_["mla"]
        rows = state["mla"]
        mtp_given = lay.num_layers == a.num_layers + 1
        if tuple(rows.shape) != (lay.num_layers, num_tokens, lay.row_bytes):
            raise ValueError(
                f"mla state shape {tuple(rows.shape)} != [layers, tokens, row bytes] "
                f"{(lay.num_layers, num_tokens, lay.row_bytes)}"
            )
        ikeys = None
        if a.dsa:
            ilay = layouts_["indexer"]
            irows = state["indexer"]
            if tuple(irows.shape) != (ilay.num_layers, num_tokens, ilay.row_bytes):
                raise ValueError(
                    f"indexer state shape {tuple(irows.shape)} != [layers, tokens, row bytes] "
                    f"{(ilay.num_layers, num_tokens, ilay.row_bytes)}"
                )
            ikeys = layouts.decode_dsa_indexer(
                irows.to(self.device), a.index_head_dim, a.qk_rope_head_dim, ilay.rope_interleaved
            )
        latent = layouts.decode_mla_rows(
            rows.to(self.device), lay.kind, lay.dtype, a.kv_lora_rank, a.qk_rope_head_dim, lay.rope_interleaved
        )
        m = self.model
        lo = seq * self.max_seq_len
        m.kv_cache[:, lo : lo + num_tokens] = latent[: a.num_layers].to(self.dtype)
        if mtp_given:
            m.mtp_kv_cache[0, lo : lo + num_tokens] = latent[a.num_layers].to(self.dtype)
        if ikeys is not None:
            n_main = len(a.index_layers)
            m.index_cache[:, lo : lo + num_tokens] = ikeys[:n_main].to(self.dtype)
            if ikeys.shape[0] > n_main:  # the MTP layer's own indexer keys
                m.mtp_index_cache[0, lo : lo + num_tokens] = ikeys[n_main].to(self.dtype)
        recompute = last_token_id is not None and self.supports_mtp
        self._seqs[seq] = _Seq(
            len=num_tokens,
            hid_lo=num_tokens,  # no hidden states for the prompt
            # MTP row P-1 takes (h_{P-1}, first token): recomputed at the first step when the last token is known
            mtp_upto=(num_tokens - int(recompute)) if mtp_given else 0,
            mtp_lo=0 if mtp_given else num_tokens,
            recompute_last=last_token_id if recompute else None,
        )

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start_pos: int, seq: int = 0) -> torch.Tensor:
        """Run ``token_ids`` (int64 ``[n]``) at positions ``start_pos..start_pos+n-1`` of sequence ``seq``;
        float32 logits ``[n, V]``.

        Positions ``>= start_pos`` of earlier calls are overwritten (a rewind is just a smaller start_pos).
        """
        self._check_seq(seq)
        _, logits = self._forward_main(token_ids, start_pos, seq, invalidate_mtp=True)
        return logits

    def decode_step(self, tokens: list[int], positions: list[int], seqs: list[int]) -> torch.Tensor:
        """One new token for each of ``n`` distinct sequences: ``tokens[i]`` at ``positions[i]`` of sequence
        ``seqs[i]``; float32 logits ``[n, V]``, row ``i`` bit for bit what :meth:`forward` of that token alone
        gives (batch-invariant).

        The rows run as one model call (CUDA: one graph replay) per attention regime (dense / DSA) and up to
        ``GRAPH_MAX_TOKENS`` rows, addressed as flat cache rows. On the CPU the kernels are row-invariant
        (:mod:`.ops.cpu`); with the reference kernels (``cpu_kernels=False``) the rows run one after the other.
        """
        out = self._decode(tokens, positions, seqs, greedy=False)
        assert isinstance(out, torch.Tensor)
        return out

    def decode_step_greedy(self, tokens: list[int], positions: list[int], seqs: list[int]) -> list[int]:
        """:meth:`decode_step`, then the argmax of each row, on the device with one host read."""
        out = self._decode(tokens, positions, seqs, greedy=True)
        assert isinstance(out, list)
        return out

    @torch.no_grad()
    def greedy_stream(self, first_token: int, start_pos: int, max_new: int, seq: int = 0) -> Iterator[int]:
        """Plain greedy decoding of sequence ``seq``, pipelined: feed ``first_token`` at ``start_pos`` and yield
        up to ``max_new`` next tokens one by one (the same tokens as :func:`greedy_generate`).

        On CUDA each step is one graph replay that also takes the argmax and advances its own token and
        position on the device, so step ``t+1`` is launched before token ``t`` is read: the GPU never
        waits for Python. On CPU each step is the CPU fast step (:mod:`.ops.cpu`). Stop iterating at any
        time; at most one step beyond the last token read has run (its cache row lies beyond the sequence and
        is overwritten later).
        """
        self._check_seq(seq)
        if not 0 <= start_pos <= self.max_seq_len:
            raise ValueError(f"start_pos={start_pos} outside the cache (max {self.max_seq_len})")
        max_new = min(max_new, self.max_seq_len - start_pos)  # ends early when the cache is full
        if max_new <= 0:
            return
        if not self.use_graphs:
            tok = first_token
            for pos in range(start_pos, start_pos + max_new):
                _, logits = self._forward_main(torch.tensor([tok]), pos, seq, invalidate_mtp=True)
                tok = int(logits[-1].argmax())
                yield tok
            return
        st = self._seqs[seq]
        st.mtp_upto = min(st.mtp_upto, max(start_pos - 1, 0))  # as forward(): t_start may be new
        base = seq * self.max_seq_len
        self._stream_tok.fill_(first_token)
        self._stream_pos.fill_(base + start_pos)
        self._stream_base.fill_(base)
        host, done = self._stream_host, self._stream_done

        def launch(pos: int, slot: int) -> None:
            self._stream_step(self.model.args.dsa and pos + 1 > self.model.args.index_topk).replay()
            host[slot : slot + 1].copy_(self._stream_tok, non_blocking=True)
            done[slot].record()

        launch(start_pos, 0)
        for i in range(max_new):
            pos = start_pos + i
            if i + 1 < max_new:
                launch(pos + 1, (i + 1) % 2)  # runs while token i is read
            done[i % 2].synchronize()
            self._note_written(st, pos, 1)
            yield int(host[i % 2])

    def _stream_step(self, use_indexer: bool) -> CapturedFn:
        """greedy_stream's graph for the dense / DSA regime: one step at row ``_stream_pos`` from ``_stream_tok``,
        which it then replaces by the argmax, and the row by the next one."""
        if use_indexer not in self._stream_graphs:
            m = self.model
            row_start = self._stream_base if self.max_sequences > 1 else None

            def fn() -> None:
                hidden = m(self._stream_tok, self._stream_pos, use_indexer, row_start)
                nxt = m.logits(hidden).argmax(-1)
                if self.supports_mtp:
                    self._hidden.index_copy_(0, self._stream_pos, hidden)
                    self._tokens.index_copy_(0, self._stream_pos, self._stream_tok)
                self._stream_tok.copy_(nxt)
                self._stream_pos.add_(1)

            torch.cuda.synchronize(self.device)  # the step in flight has advanced the buffers
            saved = self._stream_tok.clone(), self._stream_pos.clone()
            captured = CapturedFn(fn, self.device)
            captured.capture(pool=self._pool)  # warm-up and capture advance the buffers: put them back
            self._stream_tok.copy_(saved[0])
            self._stream_pos.copy_(saved[1])
            self._stream_graphs[use_indexer] = captured
        step = self._stream_graphs[use_indexer]
        assert step is not None
        return step

    @torch.no_grad()
    def warm_up(
        self,
        num_draft: int = 0,
        accept_all: bool = False,
        draft_head: str = "model",
        draft_vocab: Sequence[int] | None = None,
    ) -> None:
        """On CUDA, capture the graphs of the node's plain greedy paths now, in each attention regime: the
        ``greedy_stream`` step and the ``greedy_batch_stream`` step of every row count up to ``max_sequences``
        (a request would otherwise wait for a capture when that many sequences first decode together); with
        ``num_draft`` and an MTP module, the speculative steps' too (:meth:`_warm_speculative`). The steps
        write cache rows of every sequence: nothing is injected yet, and the sequences' bookkeeping is reset.
        ``draft_head`` / ``draft_vocab``: what the drafts' head reads from now on (:meth:`use_draft_head`)."""
        self.use_draft_head(draft_head, draft_vocab)
        if self.use_graphs:
            self._warm_steps(num_draft, accept_all)

    def use_draft_head(self, draft_head: str = "model", draft_vocab: Sequence[int] | None = None) -> None:
        """What the MTP drafts' head reads from now on (:meth:`Transformer.set_draft_head`): ``draft_head`` (one
        of ``DRAFT_HEADS``) ``"model"``, the model's head, or ``"fp8"``, a block-FP8 copy; ``draft_vocab`` the only
        token ids drafts may propose (distinct, in the vocabulary), or ``None``, all. Anything but the model's
        whole head needs an MTP module. The speculative steps' graphs captured with another head are dropped."""
        if draft_head not in DRAFT_HEADS:
            raise ValueError(f"draft_head must be one of {', '.join(DRAFT_HEADS)} (got {draft_head!r})")
        vocab = None if draft_vocab is None else tuple(int(t) for t in draft_vocab)
        problem = None if vocab is None else draft_vocab_problem(vocab, self.vocab_size)
        if problem:
            raise ValueError(
                f"draft_vocab must be distinct token ids in 0..{self.vocab_size - 1}, at least one ({problem})"
            )
        choice = (draft_head, vocab)
        if choice != ("model", None) and not self.supports_mtp:
            raise ValueError("a draft head other than the model's needs a checkpoint with an MTP layer")
        if choice == self._draft_choice:
            return
        ids = None if vocab is None else torch.tensor(vocab, dtype=torch.int64, device=self.device)
        self.model.set_draft_head(draft_head == "fp8", ids)
        self._draft_choice = choice
        self._spec_graphs.clear()
        self._spec_run_graphs.clear()

    def _warm_steps(self, num_draft: int, accept_all: bool) -> None:
        """:meth:`warm_up`'s steps, on any device (on the CPU they capture nothing)."""
        a = self.model.args
        starts = [0] + ([a.index_topk] if a.dsa and a.index_topk + 2 < self.max_seq_len else [])
        for start in starts:
            list(self.greedy_stream(0, start, 2))
            for n in range(2, min(self.max_sequences, GRAPH_MAX_TOKENS) + 1):
                list(self.greedy_batch_stream([0] * n, [start] * n, list(range(n)), 2))
            self._warm_speculative(start, num_draft, accept_all)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)
        self._seqs = [_Seq() for _ in range(self.max_sequences)]

    def _warm_speculative(self, start: int, num_draft: int, accept_all: bool) -> None:
        """Speculative steps of sequence 0 from ``start`` as a request takes them (nothing when the engine cannot
        draft, or when they would not fit in the cache): a step that catches up one MTP row (the first ones after
        an injection), then :meth:`speculative_stream` until its steps run from the device's state, the next
        launched ahead. On CUDA their graphs are then captured; the sequence's rows and bookkeeping are left as
        they end (the caller resets them)."""
        K = num_draft
        rows = (K + 2) + (K + 4) * (K + 1) + K + 2  # the prompt, the steps below, and one step run ahead
        if not (self.supports_mtp and K > 0 and start + rows < self.max_seq_len):
            return
        st, pos = self._seqs[0], start + K + 2
        for p in range(start, pos):  # hidden rows to draft from, one token a step (the step a recomputed row takes)
            self.forward(torch.zeros(1, dtype=torch.int64, device=self.device), p)
        st.mtp_upto = pos - 1  # the MTP rows below the last position are done, as after a request's first step
        step = self.speculative_greedy_step(0, pos, K, accept_all=accept_all)
        stream = self.speculative_stream(step.tokens[-1], pos + len(step.tokens), K, accept_all=accept_all)
        for _ in range(K + 3):  # drafts rejected: K steps of one row, then from the device's state
            next(stream)
        stream.close()

    @torch.no_grad()
    def greedy_batch_stream(
        self, tokens: list[int], positions: list[int], seqs: list[int], max_new: int
    ) -> Generator[list[int], None, None]:
        """:meth:`DecodeEngine.greedy_batch_stream`. On CUDA, while every row is in one attention regime (dense /
        DSA) and there are at most ``GRAPH_MAX_TOKENS`` of them, each step is one graph replay over the rows that
        also takes each row's argmax and advances its token and cache row on the device, so step ``t+1`` is
        launched before step ``t``'s tokens are read, as in :meth:`greedy_stream`. Rows that would cross from the
        dense regime into the DSA one go on step by step through :meth:`decode_step_greedy` until they all run in
        one regime."""
        self._check_batch(tokens, positions, seqs)
        n = len(seqs)
        max_new = min(max_new, self.max_seq_len - max(positions))  # ends early when a cache is full
        toks, pos = list(tokens), list(positions)
        while max_new > 0:
            run = self._one_regime_steps(pos, max_new) if self._batch_graph_ready(n, pos) else 0
            steps: Iterator[list[int]]
            if run == 0:  # mixed regimes (or no graph to use): one step at a time
                steps = iter([self.decode_step_greedy(toks, pos, seqs)])
            else:
                steps = self._batch_stream_run(toks, pos, seqs, run)
            for toks in steps:
                pos = [p + 1 for p in pos]
                max_new -= 1
                yield toks

    def _batch_graph_ready(self, n: int, positions: Sequence[int]) -> bool:
        """Whether ``n`` rows at ``positions`` can run on a batch-stream graph: CUDA, at most ``GRAPH_MAX_TOKENS``
        rows, and the graph captured already or capturable here (its warm-up runs write each row's next position
        too, which must lie inside its sequence's cache)."""
        if not self.use_graphs or n > GRAPH_MAX_TOKENS:
            return False
        a = self.model.args
        captured = (n, a.dsa and positions[0] + 1 > a.index_topk) in self._batch_graphs
        return captured or max(positions) + 1 < self.max_seq_len

    def _one_regime_steps(self, positions: Sequence[int], max_new: int) -> int:
        """How many of the next ``max_new`` steps of rows at ``positions`` keep every row in one attention regime
        (0: the rows are in different regimes now)."""
        a = self.model.args
        if not a.dsa:
            return max_new
        sparse = [p + 1 > a.index_topk for p in positions]
        if all(sparse):
            return max_new
        if any(sparse):
            return 0
        return min(max_new, a.index_topk - max(positions))  # the first row to reach the DSA regime ends the run

    def _batch_stream_run(
        self, tokens: list[int], positions: list[int], seqs: list[int], steps: int
    ) -> Iterator[list[int]]:
        """``steps`` pipelined graph steps over rows that stay in one regime (:meth:`greedy_batch_stream`)."""
        n, a = len(seqs), self.model.args
        use_indexer = a.dsa and positions[0] + 1 > a.index_topk
        tok_b, rows_b, start_b = self._batch_stream_buffers(n)
        S = self.max_seq_len
        cols = torch.tensor([tokens, [s * S + p for s, p in zip(seqs, positions, strict=True)], [s * S for s in seqs]])
        tok_b.copy_(cols[0])
        rows_b.copy_(cols[1])
        start_b.copy_(cols[2])
        step = self._batch_stream_step(n, use_indexer)
        states = [self._seqs[s] for s in seqs]
        for st, p in zip(states, positions, strict=True):
            st.mtp_upto = min(st.mtp_upto, max(p - 1, 0))
        host, done = self._batch_host, self._stream_done

        def launch(slot: int) -> None:
            step.replay()
            host[slot, :n].copy_(tok_b, non_blocking=True)
            done[slot].record()

        launch(0)
        for i in range(steps):
            if i + 1 < steps:
                launch((i + 1) % 2)  # runs while step i's tokens are read
            done[i % 2].synchronize()
            for st, p in zip(states, positions, strict=True):
                self._note_written(st, p + i, 1)
            yield host[i % 2, :n].tolist()

    def _batch_stream_buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static tokens, cache rows and first rows of :meth:`_batch_stream_step`'s graphs for ``n`` rows."""
        if n not in self._batch_bufs:
            self._batch_bufs[n] = tuple(torch.zeros(n, dtype=torch.int64, device=self.device) for _ in range(3))
        tok_b, rows_b, start_b = self._batch_bufs[n]
        return tok_b, rows_b, start_b

    def _batch_stream_step(self, n: int, use_indexer: bool) -> CapturedFn:
        """greedy_batch_stream's graph for ``n`` rows in the dense / DSA regime: one step over the rows, each of
        whose tokens it then replaces by its argmax, and each row by the next one."""
        key = (n, use_indexer)
        if key not in self._batch_graphs:
            m = self.model
            tok_b, rows_b, start_b = self._batch_stream_buffers(n)
            row_start = start_b if self.max_sequences > 1 else None

            def fn() -> None:
                hidden = m(tok_b, rows_b, use_indexer, row_start)
                nxt = m.logits(hidden).argmax(-1)
                if self.supports_mtp:
                    self._hidden.index_copy_(0, rows_b, hidden)
                    self._tokens.index_copy_(0, rows_b, tok_b)
                tok_b.copy_(nxt)
                rows_b.add_(1)

            # captured on the rows the caller loaded: its runs write their next rows as the stream will, then move
            # them on; put them back
            torch.cuda.synchronize(self.device)
            saved = tok_b.clone(), rows_b.clone()
            captured = CapturedFn(fn, self.device)
            captured.capture(pool=self._pool)
            tok_b.copy_(saved[0])
            rows_b.copy_(saved[1])
            self._batch_graphs[key] = captured
        return self._batch_graphs[key]

    @torch.no_grad()
    def shaped_greedy_stream(
        self,
        first_token: int,
        start_pos: int,
        max_new: int,
        shaping: Shaping,
        next_mask: NextMask | None = None,
        seq: int = 0,
    ) -> Iterator[int]:
        """:meth:`DecodeEngine.shaped_greedy_stream`. On CUDA each step is two graph replays: the model's step into
        a static logits row, then the rules (on the engine's static copy of ``shaping``), the grammar's bitmask,
        the argmax and the advance of token, row and counts. Without a grammar the next step is launched before
        token ``t`` is read, as in :meth:`greedy_stream`; with one, the model's step ``t+1`` runs while the caller
        takes token ``t`` and the grammar fills the mask for ``t+1``."""
        if not self.use_graphs:
            yield from super().shaped_greedy_stream(first_token, start_pos, max_new, shaping, next_mask, seq)
            return
        self._check_seq(seq)
        if not 0 <= start_pos <= self.max_seq_len:
            raise ValueError(f"start_pos={start_pos} outside the cache (max {self.max_seq_len})")
        max_new = min(max_new, self.max_seq_len - start_pos)
        if max_new <= 0:
            return
        pick = self._shaped_pick()  # captured before the request's state is loaded (its warm-up runs advance it)
        static, bits = self._shape_static, self._shape_bits
        assert static is not None and bits is not None
        static.copy_from(shaping)
        bits.fill_(-1)  # every token, until a grammar says otherwise
        st = self._seqs[seq]
        st.mtp_upto = min(st.mtp_upto, max(start_pos - 1, 0))
        base = seq * self.max_seq_len
        self._stream_tok.fill_(first_token)
        self._stream_pos.fill_(base + start_pos)
        self._stream_base.fill_(base)
        host, done = self._stream_host, self._stream_done

        def model_step(pos: int) -> None:
            self._shaped_model(self.model.args.dsa and pos + 1 > self.model.args.index_topk).replay()

        def decide(slot: int) -> None:
            if next_mask is not None:
                mask = next_mask()
                if mask is None:
                    bits.fill_(-1)
                else:
                    self._shape_bits_host.copy_(mask.view(-1))
                    bits.copy_(self._shape_bits_host, non_blocking=True)
            pick.replay()
            host[slot : slot + 1].copy_(self._stream_tok, non_blocking=True)
            done[slot].record()

        model_step(start_pos)
        if next_mask is None:
            decide(0)
        for i in range(max_new):
            pos = start_pos + i
            if next_mask is not None:
                decide(i % 2)
            elif i + 1 < max_new:  # no grammar: the next step runs while token i is read
                model_step(pos + 1)
                decide((i + 1) % 2)
            done[i % 2].synchronize()
            self._note_written(st, pos, 1)
            if next_mask is not None and i + 1 < max_new:
                model_step(pos + 1)  # runs while the caller takes token i and the grammar moves on
            yield int(host[i % 2])

    def _shaped_model(self, use_indexer: bool) -> CapturedFn:
        """shaped_greedy_stream's model step for the dense / DSA regime: the row ``_stream_pos`` from
        ``_stream_tok``, its logits into ``_shape_logits`` (it leaves token and row as they are)."""
        if use_indexer not in self._shaped_graphs:
            m = self.model
            row_start = self._stream_base if self.max_sequences > 1 else None

            def fn() -> None:
                hidden = m(self._stream_tok, self._stream_pos, use_indexer, row_start)
                self._shape_logits.copy_(m.logits(hidden)[-1])
                if self.supports_mtp:
                    self._hidden.index_copy_(0, self._stream_pos, hidden)
                    self._tokens.index_copy_(0, self._stream_pos, self._stream_tok)

            captured = CapturedFn(fn, self.device)
            captured.capture(pool=self._pool)  # its runs rewrite the row the next replay writes: nothing moves
            self._shaped_graphs[use_indexer] = captured
        return self._shaped_graphs[use_indexer]

    def _shaped_pick(self) -> CapturedFn:
        """shaped_greedy_stream's decision (:mod:`.ops.triton_shaping`): the rules and the bitmask on
        ``_shape_logits``, the argmax into ``_stream_tok``, counted, and the next row."""
        if self._shape_pick is None:
            from .ops import triton_shaping  # lazy: Triton, CUDA only

            self._shape_static = Shaping(self.vocab_size, self.device)
            self._shape_bits = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32, device=self.device)
            self._shape_bits_host = torch.empty_like(self._shape_bits, device="cpu").pin_memory()
            self._shape_logits = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            static, bits, logits = self._shape_static, self._shape_bits, self._shape_logits

            def fn() -> None:
                triton_shaping.shape_logits_(logits, static, bits)
                triton_shaping.advance_(logits.argmax(-1, keepdim=True), static, self._stream_tok, self._stream_pos)

            torch.cuda.synchronize(self.device)
            captured = CapturedFn(fn, self.device)
            captured.capture(pool=self._pool)  # the caller loads the request's state and rows afterwards
            self._shape_pick = captured
        return self._shape_pick

    # ---------------------------------------------------------------------------------- MTP

    @torch.no_grad()
    def speculative_greedy_step(
        self, next_token: int, start_pos: int, num_draft: int, seq: int = 0, accept_all: bool = False
    ) -> SpecStepResult:
        """One greedy speculative step of sequence ``seq`` with the MTP module.

        Precondition: positions ``0..start_pos-1`` are in the cache and ``next_token`` is the (greedy)
        token at ``start_pos``, not yet run. The MTP module drafts ``d_1..d_K`` (``K = num_draft``,
        chaining its own output hidden), the main model verifies ``[next_token, d_1..d_K]`` at
        ``start_pos..start_pos+K`` in one forward, and the longest prefix with ``d_j == argmax_{j-1}`` is
        accepted plus one bonus token. Rejected positions are simply rewound (later writes overwrite
        them). The emitted tokens equal plain greedy decoding token for token.

        Without an MTP module, or without the main hidden state for ``start_pos-1`` (right after an
        injection), no drafts are made and this is one plain greedy step.
        """
        self._check_seq(seq)
        if num_draft < 0:
            raise ValueError("num_draft must be >= 0")
        L = start_pos
        if L >= self.max_seq_len:
            raise ValueError(f"start_pos={L} is at capacity {self.max_seq_len}")
        k_max = min(num_draft, self.max_seq_len - 1 - L)
        a = self.model.args
        if a.dsa and L < a.index_topk <= L + k_max:
            # Keep the verify batch in one attention regime, the one plain steps use at these positions
            # (dense below index_topk, DSA from it): then it computes them bit for bit as plain decoding.
            k_max = a.index_topk - 1 - L
        st = self._seqs[seq]
        self._recompute_last(st, L, seq, k_max)
        if not (self.supports_mtp and k_max > 0 and L > 0 and st.hid_lo <= L - 1 < st.len and st.mtp_upto < L):
            _, logits = self._forward_main(torch.tensor([next_token]), L, seq, invalidate_mtp=False)
            st.mtp_upto = min(st.mtp_upto, L)
            return SpecStepResult(tokens=[int(logits[-1].argmax())], num_drafted=0, num_accepted=0)

        # Catch up MTP rows [lo, L-1] from real hidden states (row r <- (h_r, t_{r+1})), then draft.
        lo = max(st.mtp_upto, st.hid_lo)
        if lo > st.mtp_upto or st.mtp_upto <= st.mtp_lo:  # gap or empty: restart the range
            st.mtp_lo = lo
        base = seq * self.max_seq_len
        off = base if self.flat else 0  # model rows = positions + off; buffer rows = model rows + buf_off
        buf_off = base - off
        self._tokens[base + L] = next_token
        self._mtp_from.fill_(st.mtp_lo + off)
        rows = torch.arange(off + lo, off + L, device=self.device)
        verify_pos = torch.arange(off + L, off + L + k_max + 1, device=self.device)
        use_indexer = a.dsa and L + k_max + 1 > a.index_topk
        inputs: tuple[torch.Tensor, ...] = (self._tokens[rows + buf_off + 1], rows, verify_pos)
        if self.flat and self.max_sequences > 1:
            inputs += (torch.full((k_max + 1,), base, dtype=torch.int64, device=self.device),)
        step = self._spec_step(k_max, L - lo, use_indexer, inputs)
        if step is not None:
            drafts_t, greedy_t = step(*inputs)
        else:
            with torch.inference_mode(not self.flat):  # as _forward_main
                drafts_t, greedy_t = self._draft_verify(
                    *inputs, num_draft=k_max, use_indexer=use_indexer, buf_off=buf_off, seq=self._view(seq)
                )
        out = torch.cat([drafts_t, greedy_t]).tolist()  # the step's one host sync
        drafts, greedy = out[:k_max], out[k_max:]
        n_acc = k_max  # accept_all: every draft, then the main model's token after the last
        if not accept_all:
            n_acc = 0
            while n_acc < k_max and drafts[n_acc] == greedy[n_acc]:
                n_acc += 1
        return self._spec_outcome(st, L, drafts, greedy, n_acc)

    def _spec_outcome(self, st: _Seq, L: int, drafts: list[int], greedy: list[int], n_acc: int) -> SpecStepResult:
        """The bookkeeping after a speculative step at ``L`` that verified ``drafts`` (the verify's tokens
        ``greedy``) and accepted ``n_acc`` of them, and its tokens: the accepted drafts, then the verify's next."""
        st.mtp_upto = L  # rows >= L hold draft data only
        self._note_written(st, L, len(drafts) + 1)
        st.len = L + n_acc + 1  # rejected positions are rewound
        return SpecStepResult(tokens=[*drafts[:n_acc], greedy[n_acc]], num_drafted=len(drafts), num_accepted=n_acc)

    def speculative_stream(
        self, first_token: int, start_pos: int, num_draft: int, seq: int = 0, accept_all: bool = False
    ) -> Generator[SpecStepResult, None, None]:
        """:meth:`DecodeEngine.speculative_stream`, pipelined on CUDA as :meth:`greedy_stream` is.

        Where a step's shape does not depend on where it starts, the step runs from state kept on the device
        (:meth:`_spec_run`: its first token's row, advanced by the step itself by what it accepts; one CUDA
        graph per ``(drafts, dense/DSA, accept_all)``), so step ``t+1`` is launched before step ``t``'s tokens
        are read. Such a step always catches up the ``num_draft + 1`` MTP rows below its first position (rows that
        an earlier step caught up are computed again, to the same values), drafts, verifies and accepts. Where
        its shape could change (the first steps after an injection, a verify that could cross into the DSA
        regime, the end of the cache), a step is one :meth:`speculative_greedy_step`, read before the next.
        The tokens are those of :meth:`speculative_greedy_step` called step by step; when the caller stops, at
        most one step beyond the last one read has run (its rows lie beyond the sequence, rewritten later).
        """
        self._check_seq(seq)
        if num_draft < 0:
            raise ValueError("num_draft must be >= 0")
        st = self._seqs[seq]
        base = seq * self.max_seq_len
        off = base if self.flat else 0  # as speculative_greedy_step
        buf_off, view = base - off, self._view(seq)  # the step's buffers' offset and model rows (CPU view path)
        token, pos = first_token, start_pos
        slot, running = 0, False  # running: a step from the device's state, launched at ``pos``, not read yet
        while True:
            if not running:
                regime = self._spec_regime(st, pos, pos, num_draft)
                if regime is None:
                    step = self.speculative_greedy_step(token, pos, num_draft, seq, accept_all)
                    yield step
                    token, pos = step.tokens[-1], pos + len(step.tokens)
                    continue
                self._tokens[base + pos] = token
                self._spec_row.fill_(off + pos)
                self._stream_base.fill_(base)
                self._mtp_from.fill_(st.mtp_lo + off)
                self._spec_launch(num_draft, regime, accept_all, buf_off, view, slot)
            st.mtp_upto = pos  # as speculative_greedy_step: this step catches up the MTP rows below pos
            # the next step, from wherever this one ends (1 to num_draft + 1 positions on), before this one is read
            ahead = self._spec_regime(st, pos + 1, pos + num_draft + 1, num_draft) if self.use_graphs else None
            if ahead is not None:
                self._spec_launch(num_draft, ahead, accept_all, buf_off, view, 1 - slot)
            step = self._spec_read(st, pos, num_draft, slot)
            yield step
            token, pos = step.tokens[-1], pos + len(step.tokens)
            slot, running = 1 - slot, ahead is not None

    def _spec_regime(self, st: _Seq, lo: int, hi: int, num_draft: int) -> bool | None:
        """Whether a step from the device's state (:meth:`_spec_run`) may start anywhere in positions ``lo..hi``
        of sequence ``st``, and in which regime (``True``: DSA); ``None``: a step must be called from the host.
        Its catch-up rows ``p-K-1..p-1`` must hold real hidden states inside the MTP rows' range, its verify rows
        ``p..p+K`` and the row of its last token ``p+K+1`` must lie in the cache and in one attention regime."""
        a = self.model.args
        K = num_draft
        if not (self.supports_mtp and 1 <= K < GRAPH_MAX_TOKENS and st.recompute_last is None):
            return None
        if lo - K - 1 < max(st.hid_lo, st.mtp_lo) or st.mtp_upto < lo - K - 1 or hi + K + 1 >= self.max_seq_len:
            return None
        if not a.dsa or hi + K < a.index_topk:
            return False
        return True if lo >= a.index_topk else None

    def _spec_launch(
        self, num_draft: int, use_indexer: bool, accept_all: bool, buf_off: int, seq: int | None, slot: int
    ) -> None:
        """Run :meth:`_spec_run` (its graph on CUDA, then the copy of its outcome to the host's ``slot``)."""
        if not self.use_graphs:
            with torch.inference_mode():  # as _forward_main
                self._spec_run(num_draft, use_indexer, accept_all, buf_off, seq)
            return
        key = (num_draft, use_indexer, accept_all)
        if key not in self._spec_run_graphs:
            torch.cuda.synchronize(self.device)  # the step in flight has advanced the row
            saved = self._spec_row.clone()
            captured = CapturedFn(lambda: self._spec_run(num_draft, use_indexer, accept_all), self.device, warmup=1)
            captured.capture(pool=self._pool)  # its warm-up advanced the row: put it back
            self._spec_row.copy_(saved)
            self._spec_run_graphs[key] = captured
        self._spec_run_graphs[key].replay()
        n = 2 * num_draft + 2
        self._spec_host[slot, :n].copy_(self._spec_out[:n], non_blocking=True)
        self._spec_done[slot].record()

    def _spec_read(self, st: _Seq, pos: int, num_draft: int, slot: int) -> SpecStepResult:
        """The outcome of the step at ``pos`` launched into ``slot`` (waits for it on CUDA)."""
        n = 2 * num_draft + 2
        if self.use_graphs:
            self._spec_done[slot].synchronize()
            out = self._spec_host[slot, :n].tolist()
        else:
            out = self._spec_out[:n].tolist()
        return self._spec_outcome(st, pos, out[:num_draft], out[num_draft:-1], out[-1])

    def _spec_run(
        self, num_draft: int, use_indexer: bool, accept_all: bool, buf_off: int = 0, seq: int | None = None
    ) -> None:
        """One speculative step from the device's state, no host sync (graph-capturable): its first token is
        ``_tokens`` at model row ``_spec_row`` (+ ``buf_off``), the MTP rows caught up are the ``K + 1`` below it,
        then :meth:`_draft_verify`; the accepted drafts (all with ``accept_all``) and the verify's next token
        decide the next step's row, whose token it writes. ``_spec_out``: drafts ``[K]``, the verify's tokens
        ``[K+1]``, the accepted count."""
        K = num_draft
        row = self._spec_row
        offs = torch.arange(K + 1, device=self.device)
        catch = row - (K + 1) + offs
        verify = row + offs
        start = self._stream_base.expand(K + 1).contiguous() if self.flat and self.max_sequences > 1 else None
        drafts, greedy = self._draft_verify(
            self._tokens[catch + buf_off + 1],
            catch,
            verify,
            start,
            num_draft=K,
            use_indexer=use_indexer,
            buf_off=buf_off,
            seq=seq,
        )
        if accept_all:
            n_acc = torch.full((1,), K, dtype=torch.int64, device=self.device)
        else:  # the longest prefix of drafts equal to the verify's tokens
            n_acc = (drafts == greedy[:K]).long().cumprod(0).sum().view(1)
        nxt = row + n_acc + 1
        self._tokens.index_copy_(0, nxt + buf_off, greedy.gather(0, n_acc))
        row.copy_(nxt)
        self._spec_out[: 2 * K + 2].copy_(torch.cat([drafts, greedy, n_acc]))

    # ----------------------------------------------------------------------------- internals

    def _recompute_last(self, st: _Seq, L: int, seq: int, k_max: int) -> None:
        """Right after an injection that named the prompt's last token: run the main model once more at
        position ``L-1`` (its KV row is rewritten with the same values) for the hidden state ``h_{L-1}`` that
        the first draft needs (vLLM's decode side recomputes the last prompt token the same way)."""
        last, st.recompute_last = st.recompute_last, None
        if last is not None and k_max > 0 and L == st.len == st.hid_lo and L > 0:
            self._forward_main(torch.tensor([last]), L - 1, seq, invalidate_mtp=False)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.max_sequences:
            raise ValueError(f"seq={seq} outside 0..{self.max_sequences - 1}")

    def _view(self, seq: int) -> int | None:
        """The model's ``seq`` argument: sequence ``seq``'s own rows on the view path (CPU), ``None`` for flat
        rows (CUDA) or when the engine holds one sequence (the whole cache is its own)."""
        return seq if self.max_sequences > 1 and not self.flat else None

    def _draft_verify(
        self,
        catch_tokens: torch.Tensor,
        catch_rows: torch.Tensor,
        verify_pos: torch.Tensor,
        verify_start: torch.Tensor | None = None,
        *,
        num_draft: int,
        use_indexer: bool,
        buf_off: int = 0,
        seq: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step on the device, no host sync (graph-capturable): MTP rows ``catch_rows`` from
        the recorded hidden states (tokens ``catch_tokens``), ``num_draft`` chained drafts, then the main
        model over ``[t_L, drafts]`` at ``verify_pos`` (hidden states and tokens recorded for the MTP).
        Rows are the model's (flat; or sequence ``seq``'s own, the buffers then at ``+ buf_off``);
        ``verify_start``: the verify tokens' first row (flat rows of several sequences).
        Returns the drafts ``[K]`` and the verify's greedy tokens ``[K+1]`` (int64)."""
        m = self.model
        g, logits = m.mtp_forward(catch_tokens, self._hidden[catch_rows + buf_off], catch_rows, self._mtp_from, seq)
        drafts = [m.draft_tokens(logits)]
        h_prev = g[-1:]
        for j in range(1, num_draft):  # chained drafts at rows L, L+1, ...
            h_prev, logits = m.mtp_forward(drafts[-1], h_prev, verify_pos[j - 1 : j], self._mtp_from, seq)
            drafts.append(m.draft_tokens(logits))
        buf_rows = verify_pos + buf_off
        tokens = torch.cat([self._tokens[buf_rows[:1]], *drafts])
        hidden = m(tokens, verify_pos, use_indexer, verify_start, seq)
        greedy = m.logits(hidden).argmax(-1)
        self._hidden.index_copy_(0, buf_rows, hidden)
        self._tokens.index_copy_(0, buf_rows, tokens)
        return tokens[1:], greedy

    def _spec_step(
        self, num_draft: int, n_catch: int, use_indexer: bool, inputs: tuple[torch.Tensor, ...]
    ) -> CapturedFn | None:
        """The CUDA graph of :meth:`_draft_verify` for this shape, captured with ``inputs`` (``None``: eager)."""
        if not self.use_graphs or num_draft + 1 > GRAPH_MAX_TOKENS or n_catch > num_draft + 1:
            return None
        key = (num_draft, n_catch, use_indexer)
        if key not in self._spec_graphs:

            def fn(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self._draft_verify(*args, num_draft=num_draft, use_indexer=use_indexer)

            step = CapturedFn(fn, self.device)
            try:  # its warm-up runs write the rows the replay below rewrites
                step.capture(*inputs, pool=self._pool)
                self._spec_graphs[key] = step
            except RuntimeError:  # an op fell back to a non-capturable kernel: stay eager for this shape
                self._spec_graphs[key] = None
        return self._spec_graphs[key]

    def _note_written(self, st: _Seq, start_pos: int, n: int) -> None:
        """Bookkeeping after the main model wrote positions ``start_pos..start_pos+n-1`` (hidden recorded)."""
        if self.supports_mtp and (start_pos < st.hid_lo or start_pos > st.len):
            st.hid_lo = start_pos
        st.len = start_pos + n

    def _step(self, n: int, use_indexer: bool) -> CapturedFn | None:
        """The CUDA graph for ``n`` tokens in the dense / DSA regime (``None``: run eagerly). Inputs: tokens,
        their cache rows and (several sequences) each token's first row."""
        if not self.use_graphs or n > GRAPH_MAX_TOKENS:
            return None
        key = (n, use_indexer)
        if key not in self._graphs:  # a size that failed to capture stays None (eager)
            model = self.model

            def step(
                tokens: torch.Tensor, rows: torch.Tensor, row_start: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
                hidden = model(tokens, rows, use_indexer, row_start)
                return hidden, model.logits(hidden)

            self._graphs[key] = CapturedFn(step, self.device)
        return self._graphs[key]

    def _run_flat(
        self, tokens: torch.Tensor, rows: torch.Tensor, row_start: torch.Tensor | None, use_indexer: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model over flat cache ``rows`` (graph when there is one): hidden ``[n, D]``, logits ``[n, V]``
        (the logits are the caller's; the hidden is valid until the next step)."""
        n = tokens.shape[0]
        inputs = (tokens, rows) if row_start is None else (tokens, rows, row_start)
        step = self._step(n, use_indexer)
        if step is not None and step.graph is None:
            try:  # its warm-up runs write rows that the replay below rewrites
                step.capture(*inputs, pool=self._pool)
            except RuntimeError:  # an op fell back to a non-capturable kernel: stay eager for this size
                self._graphs[(n, use_indexer)] = step = None
        if step is not None:
            hidden, logits = step(*inputs)
            return hidden, logits.clone()  # the graph's static buffer is rewritten by the next step
        with torch.inference_mode():  # eager (CPU): autograd's bookkeeping is a large part of a small step otherwise
            hidden = self.model(tokens, rows, use_indexer, row_start)
            logits = self.model.logits(hidden)
        return hidden, logits.clone()  # a normal tensor: the caller may modify it in place

    def _forward_main(
        self, token_ids: torch.Tensor, start_pos: int, seq: int, invalidate_mtp: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model over ``token_ids`` at ``start_pos..`` of sequence ``seq``; returns final-norm hidden
        ``[n, D]`` and float32 logits ``[n, V]``, and records hidden states / tokens for the MTP module."""
        token_ids = token_ids.to(device=self.device, dtype=torch.int64).reshape(-1)
        n = token_ids.shape[0]
        if start_pos < 0 or n == 0 or start_pos + n > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + n - 1} outside the cache (max {self.max_seq_len})")
        # Every query position < index_topk: the DSA top-k is every row, so dense MLA gives the same result.
        use_indexer = self.model.args.dsa and start_pos + n > self.model.args.index_topk
        base = seq * self.max_seq_len
        if self.flat:
            rows = torch.arange(base + start_pos, base + start_pos + n, device=self.device)
            starts = None
            if self.max_sequences > 1:
                starts = torch.full((n,), base, dtype=torch.int64, device=self.device)
            hidden, logits = self._run_flat(token_ids, rows, starts, use_indexer)
        else:
            positions = torch.arange(start_pos, start_pos + n, device=self.device)
            # autograd's bookkeeping, even under no_grad, is a large part of a small CPU step
            with torch.inference_mode():
                hidden = self.model(token_ids, positions, use_indexer, None, self._view(seq))
                logits = self.model.logits(hidden)
            logits = logits.clone()  # a normal tensor: the caller may modify it in place
        st = self._seqs[seq]
        if self.supports_mtp:
            self._hidden[base + start_pos : base + start_pos + n] = hidden
            self._tokens[base + start_pos : base + start_pos + n] = token_ids
            if invalidate_mtp:
                # t_{start_pos} may differ from what MTP row start_pos-1 used.
                st.mtp_upto = min(st.mtp_upto, max(start_pos - 1, 0))
        self._note_written(st, start_pos, n)
        return hidden, logits

    def _check_batch(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int]) -> None:
        check_decode_batch(tokens, positions, seqs)
        for s, p in zip(seqs, positions, strict=True):
            self._check_seq(s)
            if not 0 <= p < self.max_seq_len:
                raise ValueError(f"position {p} of sequence {s} outside the cache (max {self.max_seq_len})")

    @torch.no_grad()
    def _decode(
        self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int], greedy: bool
    ) -> torch.Tensor | list[int]:
        """:meth:`decode_step` (logits) or :meth:`decode_step_greedy` (argmax tokens)."""
        self._check_batch(tokens, positions, seqs)
        if not (self.flat or self.cpu_kernels):  # reference kernels round by row count: one sequence at a time
            rows = [
                self._forward_main(torch.tensor([t]), p, s, invalidate_mtp=True)[1]
                for t, p, s in zip(tokens, positions, seqs, strict=True)
            ]
            logits = torch.cat(rows)
            return logits.argmax(-1).tolist() if greedy else logits
        a = self.model.args
        S = self.max_seq_len
        groups: dict[bool, list[int]] = {}  # rows by attention regime: each row runs in the one it runs alone
        for i, p in enumerate(positions):
            groups.setdefault(a.dsa and p + 1 > a.index_topk, []).append(i)
        parts: list[tuple[list[int], torch.Tensor]] = []
        for use_indexer, idx in groups.items():
            for c in range(0, len(idx), GRAPH_MAX_TOKENS):
                part = idx[c : c + GRAPH_MAX_TOKENS]
                cols = [(tokens[i], seqs[i] * S + positions[i], seqs[i] * S) for i in part]
                host = torch.tensor(cols, dtype=torch.int64).t()
                tok_t, rows_t, start_t = host.to(self.device)
                hidden, logits = self._run_flat(tok_t, rows_t, start_t if self.max_sequences > 1 else None, use_indexer)
                if self.supports_mtp:
                    self._hidden.index_copy_(0, rows_t, hidden)
                    self._tokens.index_copy_(0, rows_t, tok_t)
                parts.append((part, logits.argmax(-1) if greedy else logits))
        if len(parts) == 1:
            out = parts[0][1]
        else:
            order = torch.tensor([i for part, _ in parts for i in part], device=self.device)
            joined = torch.cat([t for _, t in parts])
            out = torch.empty_like(joined)
            out[order] = joined
        for p, s in zip(positions, seqs, strict=True):
            st = self._seqs[s]
            if self.supports_mtp:
                st.mtp_upto = min(st.mtp_upto, max(p - 1, 0))
            self._note_written(st, p, 1)
        return out.tolist() if greedy else out


def greedy_generate(engine: DecodeEngine, first_token: int, start_pos: int, n: int) -> list[int]:
    """Plain greedy decoding: feed ``first_token`` at ``start_pos`` and return the next ``n`` tokens."""
    out: list[int] = []
    tok, pos = first_token, start_pos
    for _ in range(n):
        logits = engine.forward(torch.tensor([tok], dtype=torch.int64), pos)
        tok = int(logits[-1].argmax())
        out.append(tok)
        pos += 1
    return out


def speculative_generate(
    engine: TileRTEngine, first_token: int, start_pos: int, n: int, num_draft: int, seq: int = 0
) -> tuple[list[int], int, int]:
    """Greedy decoding of sequence ``seq`` through :meth:`TileRTEngine.speculative_stream`: the next ``n`` tokens
    after ``first_token`` (at ``start_pos``), plus ``(drafted, accepted)`` totals."""
    out: list[int] = []
    drafted = accepted = 0
    for res in engine.speculative_stream(first_token, start_pos, num_draft, seq):
        out.extend(res.tokens)
        drafted += res.num_drafted
        accepted += res.num_accepted
        if len(out) >= n:
            break
    return out[:n], drafted, accepted
