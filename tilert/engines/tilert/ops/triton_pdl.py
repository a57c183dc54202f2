"""Programmatic dependent launch (PDL, Hopper) for the decode kernels.

With PDL each kernel is launched with ``launch_pdl=True`` and starts while its predecessor drains: it may
read *static* data (weights) at once, then ``gdc_wait()`` blocks until the predecessor grid has completed and
its writes are visible, before any activation is read or anything is written; ``gdc_launch_dependents()`` then
lets the next kernel start (both: :func:`pdl_begin`). Every kernel of the chain waits before its first
dependent access, so the ordering stays transitive. ``TILERT_PDL=0`` turns it off (kernels then run with plain
stream order).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("TILERT_PDL", "1") == "1"


def set_enabled(flag: bool) -> None:
    global ENABLED
    ENABLED = bool(flag)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A kernel's PDL prologue: wait for the predecessor grid, then let the next kernel launch. Call it before
    the first read of anything the predecessor writes (static weights may be loaded before)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def kw() -> dict:
    """Launch kwargs: the PDL constexpr and Triton's launch option."""
    return {"PDL": ENABLED, "launch_pdl": ENABLED}
