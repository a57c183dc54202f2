"""The captured decode step: one CUDA graph per token count, replayed with static input buffers.

``GraphStep(fn, n)`` wraps ``fn(tokens int64 [n], positions int64 [n]) -> Tensor`` (a model forward that
only touches static memory: caches, weights, its own buffers) into a CUDA graph captured once; each call
copies the new token ids and positions into the static buffers and replays: one Python-side launch per
step. Optionally ``torch.compile`` (mode ``"max-autotune-no-cudagraphs"``) the function first.

:class:`~tilert.engines.tilert.engine.TileRTEngine` uses it on CUDA for every main-model step of up to 16
tokens (decode, and K+1 for MTP verify), one graph per token count and attention regime; the benchmarks
capture the engine's model the same way.

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
