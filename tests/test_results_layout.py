"""``benchmarks/results/``: one current result per benchmark and machine kind, each with its header, all of them
listed by ``benchmarks/README.md``; every results path the code and tests cite exists.

Current files are ``<machine>-<benchmark>.md`` / ``.json`` at the top level (an ``.md`` and a ``.json`` of one stem are
one result); older runs live under ``archive/`` and are not checked here.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import results_header as rh  # noqa: E402

RESULTS = rh.RESULTS_DIR
README = BENCH / "README.md"
# a run's date or a letter / ordinal suffix in the name: what the naming scheme leaves to the header
DATED = re.compile(r"\d{4}-\d{2}-\d{2}|\d{8}|-(?:[b-z]|final|run\d+|v\d+|old|new|\d+)$")
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_./-]*[A-Za-z0-9_]")


def current_files() -> list[Path]:
    return sorted(p for p in RESULTS.iterdir() if p.is_file())


def split_stem(stem: str) -> tuple[str, str]:
    """``(machine, benchmark)`` of a current file's stem."""
    machine, _, benchmark = stem.partition("-")
    return machine, benchmark


def test_only_current_results_at_the_top_level() -> None:
    files = current_files()
    assert files, "no current result in benchmarks/results/"
    bad_suffix = [p.name for p in files if p.suffix not in rh.SUFFIXES]
    assert not bad_suffix, f"only .md / .json results at the top level (the rest under archive/): {bad_suffix}"
    for p in files:
        machine, benchmark = split_stem(p.stem)
        assert machine in rh.MACHINES, f"{p.name}: machine kind {machine!r} not one of {rh.MACHINES}"
        assert re.fullmatch(r"[a-z0-9]+(?:-[a-z0-9]+)*", benchmark), f"{p.name}: benchmark name {benchmark!r}"
        assert not DATED.search(benchmark), f"{p.name}: a date or run suffix in the name (move it to archive/)"


def test_one_result_per_benchmark_and_machine() -> None:
    by_key: dict[tuple[str, str], set[str]] = defaultdict(set)
    for p in current_files():
        machine, benchmark = split_stem(p.stem)
        by_key[(machine, benchmark.lower().replace("_", "-"))].add(p.stem)
    dup = {k: sorted(v) for k, v in by_key.items() if len(v) > 1}
    assert not dup, f"several current results of one benchmark and machine: {dup}"


@pytest.mark.parametrize("path", current_files(), ids=lambda p: p.name)
def test_current_result_has_its_header(path: Path) -> None:
    head = rh.read_header(path)
    assert head is not None, f"{path.name}: no header (markdown: a 'Recorded: ...' line; JSON: \"recorded\")"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2}(:\d{2})?)?", head["date"]), head
    assert re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?|unknown", head["commit"]), head
    assert head["machine"] == split_stem(path.stem)[0], f"{path.name}: header says machine {head['machine']}"


def test_readme_links_every_current_result_and_nothing_missing() -> None:
    text = README.read_text()
    links = set(re.findall(r"\]\((results/[^)#\s]+)\)", text))
    missing = sorted(link for link in links if not (BENCH / link).exists())
    assert not missing, f"benchmarks/README.md links files that do not exist: {missing}"
    linked = {(BENCH / link).resolve() for link in links}
    omitted = sorted(p.name for p in current_files() if p.resolve() not in linked)
    assert not omitted, f"benchmarks/README.md does not link these current results: {omitted}"


def cited_paths() -> list[tuple[str, str]]:
    """``(citing file, cited path)`` for every ``benchmarks/results/...`` in the code, the tests and the
    benchmark scripts (the READMEs and docs/ are checked elsewhere)."""
    sources = [
        *sorted((REPO / "tilert").rglob("*.py")),
        *sorted((REPO / "tests").rglob("*.py")),
        *sorted(BENCH.glob("*.py")),
        *sorted((BENCH / "e2elib").glob("*.py")),
    ]
    out = []
    for src in sources:
        for m in CITED.finditer(src.read_text(errors="replace")):
            out.append((str(src.relative_to(REPO)), m.group(0)))
    return out


def _exists(path: str) -> bool:
    """A cited file, or a cited stem (``results/cpu-e2e`` for its ``.md`` / ``.json``)."""
    return any((REPO / (path + suffix)).exists() for suffix in ("", *rh.SUFFIXES))


def test_cited_results_exist() -> None:
    missing = [(src, path) for src, path in cited_paths() if not _exists(path)]
    assert not missing, f"cited results that do not exist: {missing}"


def test_result_path_names_the_current_file(tmp_path: Path) -> None:
    assert rh.result_path("h200", "decode-bf16", ".json") == RESULTS / "h200-decode-bf16.json"
    assert rh.result_path("cpu", "e2e", ".md", tmp_path) == tmp_path / "cpu-e2e.md"
    assert rh.result_path("cpu", "e2e", ".md", tmp_path / "x.md") == tmp_path / "x.md"
    assert rh.machine_of_gpu("NVIDIA H200", 2) == "h200x2" and rh.machine_of_gpu(None) == "cpu"


def test_written_files_carry_their_header(tmp_path: Path) -> None:
    rec = rh.recorded("cpu", argv=["x.py", "--flag", "a b"], config="tiny")
    md = rh.write_md(tmp_path / "cpu-x.md", "# Title\n\nbody\n", rec)
    js = rh.write_json(tmp_path / "cpu-x.json", [1, 2], rec)
    for path in (md, js):
        head = rh.read_header(path)
        assert head is not None and head["machine"] == "cpu" and head["commit"] == rec["commit"]
    assert md.read_text().startswith("# Title\n\nRecorded: ")
    assert "`python benchmarks/x.py --flag 'a b'`" in md.read_text()
