"""``TileRTEngine``: the TileRT decode engine (thin wrapper; the math lives in ``model.py``).

State per sequence (static, allocated at load): the latent cache ``[layers, S, L+R]``, the DSA indexer
key cache ``[index layers, S, Di]``, and, when the checkpoint has an MTP module, its own latent (and
indexer) cache plus per-position buffers of main-model hidden states and tokens that the MTP module
needs to (re)compute its rows.

MTP row bookkeeping: MTP row ``r`` holds the module's KV for input ``(h_r, t_{r+1})``. Rows are only
valid once computed from the main model's real hidden ``h_r``; the valid rows are kept as one range
``[_mtp_lo, _mtp_upto)`` (rows of an injected prompt without MTP KV lie below it) and the MTP attention
runs dense over ``_mtp_lo..row``. ``speculative_greedy_step`` first catches up the MTP rows whose inputs
became known (``[_mtp_upto, L-1]``), which also yields the first draft; when those rows do not continue
the range (a gap after a rewind), the range restarts at them.

On CUDA the main-model step of 1..16 tokens runs as one CUDA graph per ``(n, dense/DSA)``
(``fast.CapturedFn``, captured at first use), and a speculative step (MTP catch-up + draft chain + verify +
the verify's argmax) as one graph per ``(drafts, catch-up rows, dense/DSA)``: one launch and one host read
per step. Prefill and CPU run eagerly (the same functions).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from tilert.engines.base import Capabilities, DecodeEngine, KVLayout, SpecStepResult

from . import layouts
from .fast import CapturedFn
from .model import Transformer
from .ops import register_device_kernels
from .weights import load_model

GRAPH_MAX_TOKENS = 16  # main-model steps of up to this many tokens are replayed as CUDA graphs

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class TileRTEngine(DecodeEngine):
    """Plain-PyTorch MLA/DSA/MoE decoder for ``deepseek_v3``, ``deepseek_v32`` and ``glm_moe_dsa``."""

    name = "tilert"

    def __init__(self, model: Transformer, device: torch.device, dtype: torch.dtype, max_seq_len: int) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        a = model.args
        # Per-position buffers for the MTP module: main final-norm hidden h_r and token t_r.
        n_buf = max_seq_len if a.num_mtp_layers else 0
        self._hidden = torch.zeros(n_buf, a.hidden_size, dtype=dtype, device=device)
        self._tokens = torch.zeros(n_buf + 1, dtype=torch.int64, device=device)
        self._len = 0  # positions [0, _len) hold the current sequence in the main cache
        self._hid_lo = 0  # rows [_hid_lo, _len) of _hidden are valid
        self._mtp_upto = 0  # MTP rows < _mtp_upto are computed (or permanently invalid)
        self._mtp_lo_t = torch.zeros(1, dtype=torch.int64, device=device)  # _mtp_lo on the device (graphs)
        self._mtp_lo = 0  # MTP rows >= _mtp_lo (and < _mtp_upto) are valid
        self.use_graphs = device.type == "cuda"
        self._graphs: dict[tuple[int, bool], CapturedFn | None] = {}
        self._spec_graphs: dict[tuple[int, int, bool], CapturedFn | None] = {}
        # greedy_stream's step: reads and advances these on the device (token at position, position)
        self._stream_tok = torch.zeros(1, dtype=torch.int64, device=device)
        self._stream_pos = torch.zeros(1, dtype=torch.int64, device=device)
        self._stream_graphs: dict[bool, CapturedFn | None] = {}
        if self.use_graphs:  # where the host reads the streamed tokens (pinned: asynchronous copies)
            self._stream_host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            self._stream_done = (torch.cuda.Event(), torch.cuda.Event())
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None  # shared by the graphs

    # ----------------------------------------------------------------------------- contract

    @classmethod
    def load(
        cls, model_dir: Path, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16, max_seq_len: int = 4096
    ) -> TileRTEngine:
        """Read the HF checkpoint in ``model_dir`` (bf16/fp16/fp32 safetensors) and allocate the caches."""
        dev = torch.device(device)
        if dev.type == "cuda":
            register_device_kernels()  # Triton kernels over the reference ops (a no-op without Triton)
        model = load_model(Path(model_dir), device=dev, dtype=dtype, max_seq_len=max_seq_len)
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
        notes = [f"arch={a.arch}", "reference PyTorch kernels unless device kernels are registered"]
        if self.use_graphs:
            notes.append(f"CUDA-graph decode steps (1..{GRAPH_MAX_TOKENS} tokens)")
        if a.dsa:
            notes.append(f"DSA sparse attention, index_topk={a.index_topk}")
        if self.supports_mtp:
            notes.append(
                "MTP speculative decoding: greedy requests only (temperature > 0 decodes without MTP); drafts "
                "from the second step after an injection (the handoff carries KV, not the prompt's last hidden "
                "state)"
            )
        return Capabilities(
            mtp=self.supports_mtp, pipelined_greedy=True, max_seq_len=self.max_seq_len, notes=tuple(notes)
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
        models ``"indexer"`` as ``dsa_indexer`` rows with the model's indexer RoPE convention."""
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
            if ilay.num_layers != len(a.index_layers):
                raise ValueError(f"indexer layout has {ilay.num_layers} layers, model has {len(a.index_layers)}")
            want_row = layouts.dsa_indexer_row_bytes(a.index_head_dim)
            if ilay.row_bytes != want_row:
                raise ValueError(f"indexer rows of {ilay.row_bytes} bytes, expected {want_row}")

    @torch.no_grad()
    def inject(self, state: dict[str, torch.Tensor], layouts_: dict[str, KVLayout], num_tokens: int) -> None:
        """Replace the sequence with a prompt of ``num_tokens`` tokens whose KV is ``state``.

        ``state["mla"]``: ``uint8 [N or N+1, num_tokens, row_bytes]`` of kind ``mla_dense`` (float32 /
        bfloat16 / float16) or ``fp8_ds_mla``; an extra last layer is taken as the MTP layer's KV (rows
        then valid). ``state["indexer"]`` (DSA only): kind ``dsa_indexer`` per-token rows. Raises
        ``ValueError`` on unknown names, kinds, shapes or rope conventions.
        """
        a = self.model.args
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
        latent = layouts.decode_mla_rows(
            rows.to(self.device), lay.kind, lay.dtype, a.kv_lora_rank, a.qk_rope_head_dim, lay.rope_interleaved
        )
        m = self.model
        m.kv_cache[:, :num_tokens] = latent[: a.num_layers].to(self.dtype)
        if mtp_given:
            m.mtp_kv_cache[0, :num_tokens] = latent[a.num_layers].to(self.dtype)

        if a.dsa:
            ilay = layouts_["indexer"]
            irows = state["indexer"]
            if tuple(irows.shape) != (ilay.num_layers, num_tokens, ilay.row_bytes):
                raise ValueError(
                    f"indexer state shape {tuple(irows.shape)} != [layers, tokens, row bytes] "
                    f"{(ilay.num_layers, num_tokens, ilay.row_bytes)}"
                )
            keys = layouts.decode_dsa_indexer(
                irows.to(self.device), a.index_head_dim, a.qk_rope_head_dim, ilay.rope_interleaved
            )
            m.index_cache[:, :num_tokens] = keys.to(self.dtype)

        self._len = num_tokens
        self._hid_lo = num_tokens  # no hidden states for the prompt
        self._mtp_upto = num_tokens if mtp_given else 0
        self._mtp_lo = 0 if mtp_given else num_tokens

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run ``token_ids`` (int64 ``[n]``) at positions ``start_pos..start_pos+n-1``; float32 logits ``[n, V]``.

        Positions ``>= start_pos`` of earlier calls are overwritten (a rewind is just a smaller start_pos).
        """
        _, logits = self._forward_main(token_ids, start_pos, invalidate_mtp=True)
        return logits

    @torch.no_grad()
    def greedy_stream(self, first_token: int, start_pos: int, max_new: int) -> Iterator[int]:
        """Plain greedy decoding, pipelined: feed ``first_token`` at ``start_pos`` and yield up to ``max_new``
        next tokens one by one (the same tokens as :func:`greedy_generate`).

        On CUDA each step is one graph replay that also takes the argmax and advances its own token and
        position on the device, so step ``t+1`` is launched before token ``t`` is read: the GPU never
        waits for Python. Stop iterating at any time; at most one step beyond the last token read has run
        (its cache row lies beyond the sequence and is overwritten later).
        """
        if not 0 <= start_pos <= self.max_seq_len:
            raise ValueError(f"start_pos={start_pos} outside the cache (max {self.max_seq_len})")
        max_new = min(max_new, self.max_seq_len - start_pos)  # ends early when the cache is full
        if max_new <= 0:
            return
        if not self.use_graphs:
            tok = first_token
            for pos in range(start_pos, start_pos + max_new):
                tok = int(self.forward(torch.tensor([tok]), pos)[-1].argmax())
                yield tok
            return
        self._mtp_upto = min(self._mtp_upto, max(start_pos - 1, 0))  # as forward(): t_start may be new
        self._stream_tok.fill_(first_token)
        self._stream_pos.fill_(start_pos)
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
            self._note_written(pos, 1)
            yield int(host[i % 2])

    def _stream_step(self, use_indexer: bool) -> CapturedFn:
        """greedy_stream's graph for the dense / DSA regime: one step at ``_stream_pos`` from ``_stream_tok``,
        which it then replaces by the argmax, and the position by the next one."""
        if use_indexer not in self._stream_graphs:
            m = self.model

            def fn() -> None:
                hidden = m(self._stream_tok, self._stream_pos, use_indexer)
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

    # ---------------------------------------------------------------------------------- MTP

    @torch.no_grad()
    def speculative_greedy_step(self, next_token: int, start_pos: int, num_draft: int) -> SpecStepResult:
        """One greedy speculative step with the MTP module.

        Precondition: positions ``0..start_pos-1`` are in the cache and ``next_token`` is the (greedy)
        token at ``start_pos``, not yet run. The MTP module drafts ``d_1..d_K`` (``K = num_draft``,
        chaining its own output hidden), the main model verifies ``[next_token, d_1..d_K]`` at
        ``start_pos..start_pos+K`` in one forward, and the longest prefix with ``d_j == argmax_{j-1}`` is
        accepted plus one bonus token. Rejected positions are simply rewound (later writes overwrite
        them). The emitted tokens equal plain greedy decoding token for token.

        Without an MTP module, or without the main hidden state for ``start_pos-1`` (right after an
        injection), no drafts are made and this is one plain greedy step.
        """
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
        if not (self.supports_mtp and k_max > 0 and L > 0 and self._hid_lo <= L - 1 < self._len and self._mtp_upto < L):
            _, logits = self._forward_main(torch.tensor([next_token]), L, invalidate_mtp=False)
            self._mtp_upto = min(self._mtp_upto, L)
            return SpecStepResult(tokens=[int(logits[-1].argmax())], num_drafted=0, num_accepted=0)

        # Catch up MTP rows [lo, L-1] from real hidden states (row r <- (h_r, t_{r+1})), then draft.
        lo = max(self._mtp_upto, self._hid_lo)
        if lo > self._mtp_upto or self._mtp_upto <= self._mtp_lo:  # gap or empty: restart the range
            self._mtp_lo = lo
        self._tokens[L] = next_token
        rows = torch.arange(lo, L, device=self.device)
        verify_pos = torch.arange(L, L + k_max + 1, device=self.device)
        use_indexer = a.dsa and L + k_max + 1 > a.index_topk
        inputs = (self._tokens[rows + 1], rows, verify_pos)
        step = self._spec_step(k_max, L - lo, use_indexer, inputs)
        if step is not None:
            drafts_t, greedy_t = step(*inputs)
        else:
            drafts_t, greedy_t = self._draft_verify(*inputs, num_draft=k_max, use_indexer=use_indexer)
        out = torch.cat([drafts_t, greedy_t]).tolist()  # the step's one host sync
        drafts, greedy = out[:k_max], out[k_max:]
        self._mtp_upto = L  # rows >= L hold draft data only
        self._note_written(L, k_max + 1)
        n_acc = 0
        while n_acc < k_max and drafts[n_acc] == greedy[n_acc]:
            n_acc += 1
        self._len = L + n_acc + 1  # rejected positions are rewound
        return SpecStepResult(tokens=greedy[: n_acc + 1], num_drafted=len(drafts), num_accepted=n_acc)

    # ----------------------------------------------------------------------------- internals

    @property
    def _mtp_lo(self) -> int:
        return self._mtp_lo_host

    @_mtp_lo.setter
    def _mtp_lo(self, row: int) -> None:
        """One source for the host value and the device copy the MTP graphs read."""
        self._mtp_lo_host = row
        self._mtp_lo_t.fill_(row)

    def _draft_verify(
        self, catch_tokens: torch.Tensor, catch_rows: torch.Tensor, verify_pos: torch.Tensor, *, num_draft: int,
        use_indexer: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One speculative step on the device, no host sync (graph-capturable): MTP rows ``catch_rows`` from
        the recorded hidden states (tokens ``catch_tokens``), ``num_draft`` chained drafts, then the main
        model over ``[t_L, drafts]`` at ``verify_pos`` (hidden states and tokens recorded for the MTP).
        Returns the drafts ``[K]`` and the verify's greedy tokens ``[K+1]`` (int64)."""
        m = self.model
        g, logits = m.mtp_forward(catch_tokens, self._hidden[catch_rows], catch_rows, self._mtp_lo_t)
        drafts = [logits[-1:].argmax(-1)]
        h_prev = g[-1:]
        for j in range(1, num_draft):  # chained drafts at rows L, L+1, ...
            h_prev, logits = m.mtp_forward(drafts[-1], h_prev, verify_pos[j - 1 : j], self._mtp_lo_t)
            drafts.append(logits[-1:].argmax(-1))
        tokens = torch.cat([self._tokens[verify_pos[:1]], *drafts])
        hidden = m(tokens, verify_pos, use_indexer)
        greedy = m.logits(hidden).argmax(-1)
        self._hidden.index_copy_(0, verify_pos, hidden)
        self._tokens.index_copy_(0, verify_pos, tokens)
        return tokens[1:], greedy

    def _spec_step(
        self, num_draft: int, n_catch: int, use_indexer: bool, inputs: tuple[torch.Tensor, ...]
    ) -> CapturedFn | None:
        """The CUDA graph of :meth:`_draft_verify` for this shape, captured with ``inputs`` (``None``: eager)."""
        if not self.use_graphs or num_draft + 1 > GRAPH_MAX_TOKENS or n_catch > num_draft + 1:
            return None
        key = (num_draft, n_catch, use_indexer)
        if key not in self._spec_graphs:

            def fn(catch_tokens: torch.Tensor, catch_rows: torch.Tensor, verify_pos: torch.Tensor):
                return self._draft_verify(catch_tokens, catch_rows, verify_pos, num_draft=num_draft,
                                          use_indexer=use_indexer)

            step = CapturedFn(fn, self.device)
            try:  # its warm-up runs write the rows the replay below rewrites
                step.capture(*inputs, pool=self._pool)
                self._spec_graphs[key] = step
            except RuntimeError:  # an op fell back to a non-capturable kernel: stay eager for this shape
                self._spec_graphs[key] = None
        return self._spec_graphs[key]

    def _note_written(self, start_pos: int, n: int) -> None:
        """Bookkeeping after the main model wrote positions ``start_pos..start_pos+n-1`` (hidden recorded)."""
        if self.supports_mtp and (start_pos < self._hid_lo or start_pos > self._len):
            self._hid_lo = start_pos
        self._len = start_pos + n

    def _step(self, n: int, use_indexer: bool) -> CapturedFn | None:
        """The CUDA graph for ``n`` tokens in the dense / DSA regime (``None``: run eagerly)."""
        if not self.use_graphs or n > GRAPH_MAX_TOKENS:
            return None
        key = (n, use_indexer)
        if key not in self._graphs:  # a size that failed to capture stays None (eager)
            model = self.model

            def step(tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                hidden = model(tokens, positions, use_indexer)
                return hidden, model.logits(hidden)

            self._graphs[key] = CapturedFn(step, self.device)
        return self._graphs[key]

    def _forward_main(
        self, token_ids: torch.Tensor, start_pos: int, invalidate_mtp: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model over ``token_ids`` at ``start_pos..``; returns final-norm hidden ``[n, D]`` and float32
        logits ``[n, V]``, and records hidden states / tokens for the MTP module."""
        token_ids = token_ids.to(device=self.device, dtype=torch.int64).reshape(-1)
        n = token_ids.shape[0]
        if start_pos < 0 or n == 0 or start_pos + n > self.max_seq_len:
            raise ValueError(f"positions {start_pos}..{start_pos + n - 1} outside the cache (max {self.max_seq_len})")
        positions = torch.arange(start_pos, start_pos + n, device=self.device)
        # Every query position < index_topk: the DSA top-k is every row, so dense MLA gives the same result.
        use_indexer = self.model.args.dsa and start_pos + n > self.model.args.index_topk
        step = self._step(n, use_indexer)
        if step is not None and step.graph is None:
            try:  # its warm-up runs write rows that the replay below rewrites
                step.capture(token_ids, positions, pool=self._pool)
            except RuntimeError:  # an op fell back to a non-capturable kernel: stay eager for this size
                self._graphs[(n, use_indexer)] = step = None
        if step is not None:
            hidden, logits = step(token_ids, positions)
            logits = logits.clone()  # the graph's static buffer is rewritten by the next step
        else:
            hidden = self.model(token_ids, positions, use_indexer)
            logits = self.model.logits(hidden)
        if self.supports_mtp:
            self._hidden[start_pos : start_pos + n] = hidden
            self._tokens[start_pos : start_pos + n] = token_ids
            if invalidate_mtp:
                # t_{start_pos} may differ from what MTP row start_pos-1 used.
                self._mtp_upto = min(self._mtp_upto, max(start_pos - 1, 0))
        self._note_written(start_pos, n)
        return hidden, logits


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
    engine: TileRTEngine, first_token: int, start_pos: int, n: int, num_draft: int
) -> tuple[list[int], int, int]:
    """Greedy decoding through :meth:`TileRTEngine.speculative_greedy_step`: the next ``n`` tokens after
    ``first_token`` (at ``start_pos``), plus ``(drafted, accepted)`` totals."""
    out: list[int] = []
    drafted = accepted = 0
    tok, pos = first_token, start_pos
    while len(out) < n:
        res = engine.speculative_greedy_step(tok, pos, num_draft)
        out.extend(res.tokens)
        drafted += res.num_drafted
        accepted += res.num_accepted
        pos += len(res.tokens)
        tok = res.tokens[-1]
    return out[:n], drafted, accepted
