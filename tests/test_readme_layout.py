"""The README's layout table names every module of the package, so a newcomer can find each file's job there."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_names() -> set[str]:
    """The backquoted names in the README's "Layout" section (file names, paths, globs such as
    ``triton_*.py``)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^### Layout\n(.*?)(?=^#)", text, re.S | re.M)
    assert section is not None, "README.md has no '### Layout' section"
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
    assert not missing, f"modules the README's layout table does not name: {missing}"
