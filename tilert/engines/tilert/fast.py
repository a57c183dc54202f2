"""The captured decode step: one CUDA graph per token count, replayed with static input buffers.

``GraphStep(fn, n)`` wraps ``fn(tokens int64 [n], positions int64 [n]) -> Tensor`` (a model forward that
only touches static memory: caches, weights, its own buffers) into a CUDA graph captured once; each call
copies the new token ids and positions into the static buffers and replays: one Python-side launch per
step. Optionally ``torch.compile`` (mode ``"max-autotune-no-cudagraphs"``) the function first.

``FastEngine`` applies it to :class:`~tilert.engines.tilert.engine.TileRTEngine`'s model for the token counts
it is asked to serve (1, and K+1 for MTP verify); other counts run eagerly.

Capturing runs ``fn`` a few times (warm-up on a side stream, then the capture): those runs write cache rows
at the example positions, so capture at a position the next real step overwrites anyway (the default:
the engine's current length), never inside a live prompt.
"""

from __future__ import annotations

from typing import Callable

import torch


class GraphStep:
    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n: int, device,
                 *, compile: bool = False, warmup: int = 2) -> None:
        self.n = n
        self.device = torch.device(device)
        self.fn = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False) if compile else fn
        self.tokens = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    @torch.no_grad()
    def capture(self, tokens: torch.Tensor, positions: torch.Tensor, pool=None) -> None:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                self.fn(self.tokens, self.positions)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.fn(self.tokens, self.positions)
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        assert self.graph is not None, "capture() first"
        self.tokens.copy_(tokens, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.graph.replay()
        return self.out

    def replay(self) -> torch.Tensor:
        """Replay with whatever is in the static buffers (benchmarks)."""
        self.graph.replay()
        return self.out


class FastEngine:
    """CUDA-graph decode for a ``TileRTEngine`` (its ``model``: ``Transformer`` with ``forward``/``logits``).

    ``forward(token_ids, start_pos)`` has the engine's contract (writes KV, returns fp32 logits ``[n, V]``);
    graphs for ``n in sizes`` are captured lazily at the first call of that size. The returned logits are
    the graph's static output: copy them if they must outlive the next step.
    """

    def __init__(self, engine, sizes=(1,), compile: bool = False) -> None:
        self.engine = engine
        self.model = engine.model
        self.device = next(self.model.parameters()).device
        self.sizes = tuple(sizes)
        self.compile = compile
        self.steps: dict[int, GraphStep] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _fn(self, tokens, positions):
        hidden = self.model(tokens, positions)
        return hidden, self.model.logits(hidden)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        n = int(token_ids.shape[0])
        positions = torch.arange(start_pos, start_pos + n, device=self.device, dtype=torch.int64)
        tokens = token_ids.to(self.device, torch.int64)
        if n not in self.sizes:
            return self.engine.forward(token_ids, start_pos)
        step = self.steps.get(n)
        if step is None:
            step = GraphStep(self._fn, n, self.device, compile=self.compile)
            step.capture(tokens, positions, pool=self.pool)
            self.steps[n] = step
        hidden, logits = step(tokens, positions)
        self._bookkeep(tokens, hidden, start_pos, n)
        return logits

    def _bookkeep(self, tokens, hidden, start_pos, n):
        """What ``TileRTEngine._forward_main`` records after a main forward (MTP inputs, length)."""
        e = self.engine
        if getattr(e, "supports_mtp", False):
            if start_pos < e._hid_lo or start_pos > e._len:
                e._hid_lo = start_pos
            e._hidden[start_pos : start_pos + n] = hidden
            e._tokens[start_pos : start_pos + n] = tokens
            e._mtp_upto = min(e._mtp_upto, max(start_pos - 1, 0))
        e._len = start_pos + n
