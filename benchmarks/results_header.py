"""Where a benchmark's current result lives, and the header every result file carries.

``benchmarks/results/`` holds one current result per benchmark and machine kind, named
``<machine>-<benchmark>.md`` / ``.json`` (no date in the name); older runs are under ``results/archive/``.
Every file a benchmark writes starts with its conditions: the date (UTC), the git commit (short hash, ``-dirty``
when the working tree has changes, ``unknown`` without git), the machine kind and the command with its arguments.
In markdown that is the ``Recorded:`` line under the title; in JSON the top-level ``"recorded"`` object.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
ARCHIVE_DIR = RESULTS_DIR / "archive"
MACHINES = ("cpu", "h100", "h200", "h200x2")
HEADER_KEY = "recorded"
MD_HEADER = re.compile(
    r"^Recorded: (?P<date>\d{4}-\d{2}-\d{2}(?: \d{2}:\d{2}(?::\d{2})?)?) UTC, "
    r"commit (?P<commit>[0-9a-f]{7,40}(?:-dirty)?|unknown), machine (?P<machine>[a-z0-9]+)\b"
)
SUFFIXES = (".md", ".json")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit() -> str:
    """``git rev-parse --short HEAD`` plus ``-dirty`` when tracked files changed; ``unknown`` without git."""
    head = _git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return f"{head}-dirty" if dirty else head


def machine_of_gpu(name: str | None, gpus: int = 1) -> str:
    """The machine kind of ``gpus`` GPUs named ``name`` (``NVIDIA H200`` -> ``h200``, two -> ``h200x2``);
    ``cpu`` when there is no GPU name."""
    if not name:
        return "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    base = words[0] if words else "gpu"
    return base if gpus <= 1 else f"{base}x{gpus}"


def machine_kind(gpus: int = 1, device: str = "cuda") -> str:
    """The machine kind a measurement on ``gpus`` GPUs of this host (``device`` ``cpu``: none) ran on."""
    if device == "cpu":
        return "cpu"
    try:
        import torch
    except ImportError:
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    return machine_of_gpu(torch.cuda.get_device_name(0), gpus)


def result_path(machine: str, benchmark: str, suffix: str, out: str | os.PathLike[str] | None = None) -> Path:
    """The file a run writes: ``results/<machine>-<benchmark><suffix>`` by default; under ``out`` when that is a
    directory (or names no file of this suffix); ``out`` itself when it ends in ``suffix``."""
    name = f"{machine}-{benchmark}{suffix}"
    if out is None or str(out) == "":
        return RESULTS_DIR / name
    path = Path(out)
    if path.suffix == suffix and not path.is_dir():
        return path
    return path / name


def recorded(machine: str, argv: list[str] | None = None, script: str | None = None, **conditions: Any) -> dict:
    """The header of one result: date (UTC), commit, machine, the command line, host, Python, and ``conditions``
    (configuration and arguments the run wants on record)."""
    argv = sys.argv if argv is None else argv
    script = script or (Path(argv[0]).name if argv else "")
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "commit": git_commit(),
        "machine": machine,
        "command": shlex.join(["python", f"benchmarks/{script}", *argv[1:]]),
        "host": platform.node(),
        "python": platform.python_version(),
        **conditions,
    }


def md_header(rec: dict) -> str:
    """The ``Recorded:`` line of a markdown result."""
    line = f"Recorded: {rec['date_utc']} UTC, commit {rec['commit']}, machine {rec['machine']}"
    if rec.get("command"):
        line += f"; command `{rec['command']}`"
    extra = {k: v for k, v in rec.items() if k not in ("date_utc", "commit", "machine", "command", "host", "python")}
    if extra:
        line += "".join(f"; {k.replace('_', ' ')}: {v}" for k, v in extra.items())
    return line + "."


def with_md_header(text: str, rec: dict) -> str:
    """``text`` with the ``Recorded:`` line under its ``#`` title (at the top when it has none)."""
    lines = text.splitlines(keepends=True)
    if lines and lines[0].startswith("# "):
        rest = lines[1:]
        while rest and not rest[0].strip():
            rest = rest[1:]
        return lines[0] + "\n" + md_header(rec) + "\n\n" + "".join(rest)
    return md_header(rec) + "\n\n" + text


def with_json_header(doc: Any, rec: dict) -> dict:
    """``doc`` with ``"recorded"`` first (a list becomes ``{"recorded": ..., "results": [...]}``)."""
    if isinstance(doc, dict):
        return {HEADER_KEY: rec, **{k: v for k, v in doc.items() if k != HEADER_KEY}}
    return {HEADER_KEY: rec, "results": doc}


def write_json(path: str | os.PathLike[str], doc: Any, rec: dict) -> Path:
    """Write ``doc`` with its header as JSON at ``path`` (directories made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(with_json_header(doc, rec), indent=1, default=str) + "\n")
    return path


def write_md(path: str | os.PathLike[str], text: str, rec: dict) -> Path:
    """Write the markdown ``text`` with its ``Recorded:`` line at ``path`` (directories made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(with_md_header(text, rec))
    return path


def read_header(path: str | os.PathLike[str]) -> dict | None:
    """The header of a result file (``date``, ``commit``, ``machine``), or None when it has none."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return None
        rec = doc.get(HEADER_KEY) if isinstance(doc, dict) else None
        if not isinstance(rec, dict) or not all(rec.get(k) for k in ("date_utc", "commit", "machine")):
            return None
        return {"date": rec["date_utc"], "commit": rec["commit"], "machine": rec["machine"]}
    for line in text.splitlines()[:10]:
        m = MD_HEADER.match(line)
        if m:
            return m.groupdict()
    return None
