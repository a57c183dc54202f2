"""The TileRT decode engine: a plain-PyTorch MLA / DSA / MoE / MTP decoder behind ``tilert::*`` ops.

- ``model.py``: the decoder (one file, gpt-fast style).
- ``weights.py``: HF checkpoint -> model.
- ``layouts.py``: vLLM KV layouts -> engine cache layout.
- ``ops/``: the custom ops (reference kernels; device kernels register over them).
- ``engine.py``: ``TileRTEngine`` (the ``DecodeEngine`` plugin).
"""

from __future__ import annotations

__all__ = ["TileRTEngine", "SpecStepResult", "greedy_generate", "speculative_generate"]


def __getattr__(name: str):  # lazy: importing the package must not pull in transformers
    if name in __all__:
        from . import engine  # lazy: importing the package must not pull in transformers

        return getattr(engine, name)
    raise AttributeError(name)
