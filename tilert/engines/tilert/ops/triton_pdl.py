"""Programmatic dependent launch (PDL, Hopper) for the decode kernels.

With PDL each kernel is launched with ``launch_pdl=True`` and starts while its predecessor drains: it may
read *static* data (weights) at once, then ``gdc_wait()`` blocks until the predecessor grid has completed and
its writes are visible, before any activation is read or anything is written; ``gdc_launch_dependents()`` lets
the next kernel start (both: :func:`pdl_begin`). Every kernel of the chain waits before its first dependent
access, so the completions stay in chain order whatever the order of the two. ``TILERT_PDL=0`` turns it off
(kernels then run with plain stream order).

Where a kernel lets the next one start is a choice (the ``PDL`` constexpr of :func:`kw`):

- ``1``, after its own wait (the default): the next kernel starts once this kernel's predecessor has completed,
  so what it reads before its own wait may come from the kernel two back (``moe_up``'s shared-expert programs
  read the residual stream that way, ``moe_down`` the router's expert ids).
- ``2``, before its wait (:data:`EARLY_TRIGGER`): the next kernel starts as soon as all of this kernel's programs
  have, several kernels of the chain may then be waiting at once, each with its first weights requested. What a
  kernel reads before its wait must then be static or written before the step. A kernel whose successor reads
  the kernel two back's output (``kw(ordered=True)``) keeps ``1``.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = os.environ.get("TILERT_PDL", "1") == "1"
# Kernels let the next one start before their own wait (mode 2 above), except those launched ``ordered``.
EARLY_TRIGGER = False


def set_enabled(flag: bool) -> None:
    global ENABLED
    ENABLED = bool(flag)


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A kernel's PDL prologue: wait for the predecessor grid and let the next kernel launch (``PDL`` 2: in the
    other order). Call it before the first read of anything the predecessor writes (static weights may be loaded
    before)."""
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


def kw(ordered: bool = False) -> dict:
    """Launch kwargs: the PDL constexpr (0 off, 1 or 2: see the module docstring) and Triton's launch option.
    ``ordered``: the next kernel reads, before its own wait, what this kernel's predecessor wrote."""
    mode = 0 if not ENABLED else 2 if EARLY_TRIGGER and not ordered else 1
    return {"PDL": mode, "launch_pdl": ENABLED}
