"""Captured decode work: a function of static input buffers recorded once as a CUDA graph, then replayed.

``CapturedFn(fn)`` wraps ``fn(*inputs) -> outputs`` (a forward that only touches static memory: caches,
weights, engine buffers, its own intermediates) into a CUDA graph captured at the first inputs; each call
copies the new inputs into the static buffers and replays: one Python-side launch. Optionally
``torch.compile`` (mode ``"max-autotune-no-cudagraphs"``) the function first.

:class:`~tilert.engines.tilert.engine.TileRTEngine` uses them on CUDA for every main-model step of up to 16
tokens (decode, one graph per token count and attention regime) and for the MTP draft chain + verify step;
the benchmarks time the engine's graphs.

Capturing runs ``fn`` a few times (warm-up on a side stream, then the capture): those runs write cache rows
at the example positions, so capture at positions the real step writes anyway (the engine captures with
the step's own inputs), never inside a live prompt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CapturedFn:
    def __init__(self, fn: Callable[..., Any], device, *, compile: bool = False, warmup: int = 2) -> None:
        self.device = torch.device(device)
        self.fn = torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False) if compile else fn
        self.warmup = warmup
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Any = None

    @torch.no_grad()
    def capture(self, *inputs: torch.Tensor, pool=None) -> None:
        self.inputs = tuple(t.to(self.device).clone() for t in inputs)
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(self.warmup):
                self.fn(*self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.fn(*self.inputs)
        torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def __call__(self, *inputs: torch.Tensor) -> Any:
        assert self.graph is not None, "capture() first"
        for buf, t in zip(self.inputs, inputs, strict=True):
            buf.copy_(t, non_blocking=True)
        self.graph.replay()
        return self.out

    def replay(self) -> Any:
        """Replay with whatever is in the static buffers (benchmarks)."""
        assert self.graph is not None, "capture() first"
        self.graph.replay()
        return self.out
