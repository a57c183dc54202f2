"""Programmatic dependent launch (PDL, Hopper) for the decode kernels.

With PDL each kernel is launched with ``launch_pdl=True`` and starts while its predecessor drains: it may
read *static* data (weights) at once, then ``gdc_wait()`` blocks until the predecessor grid has completed and
its writes are visible, before any activation is read or anything is written; ``gdc_launch_dependents()`` then
lets the next kernel start. Every kernel of the chain waits before its first dependent access, so the
ordering stays transitive. ``TILERT_PDL=0`` turns it off (kernels then run with plain stream order).
"""

from __future__ import annotations

import os

ENABLED = os.environ.get("TILERT_PDL", "1") == "1"


def set_enabled(flag: bool) -> None:
    global ENABLED
    ENABLED = bool(flag)


def kw() -> dict:
    """Launch kwargs: the PDL constexpr and Triton's launch option."""
    return {"PDL": ENABLED, "launch_pdl": ENABLED}
