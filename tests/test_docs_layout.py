"""The layout table of docs/architecture.md names every module of the package, so a newcomer can find each file's
job there."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_names() -> set[str]:
    """The backquoted names in the "Layout" section of docs/architecture.md (file names, paths, globs such as
    ``triton_*.py``)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = re.search(r"^## Layout\n(.*?)(?=^#)", text, re.S | re.M)
    assert section is not None, "docs/architecture.md has no '## Layout' section"
    return set(re.findall(r"`([^`\s]+)`", section.group(1)))


def test_every_module_is_in_the_layout_table() -> None:
    names = layout_names()
    missing = []
    for path in sorted((ROOT / "tilert").rglob("*")):
        if path.suffix not in (".py", ".c") or path.name == "__init__.py":
            continue
        rel = path.relative_to(ROOT).as_posix()
        named = any(fnmatch.fnmatch(path.name, n) or rel.endswith("/" + n) or fnmatch.fnmatch(rel, n) for n in names)
        if not named:
            missing.append(rel)
    assert not missing, f"modules the layout table of docs/architecture.md does not name: {missing}"


def test_every_link_and_results_path_of_the_docs_exists() -> None:
    """The README's and docs/'s relative links, and every ``benchmarks/results/...`` path they cite, exist."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)\)", text):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}: link {target}")
        for path in re.findall(r"benchmarks/results/[\w./-]*\w", text):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
