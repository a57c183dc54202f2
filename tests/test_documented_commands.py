"""Every command the README and docs/deployment.md tell a user to run, run as written.

- The README's tour: ``make demo`` is started as a user starts it (its own process group, the repository as the
  working directory); once it serves, every other shell block and the Python example of the README run against
  it, each checked for what the README says it shows; then Ctrl-C (SIGINT to the group) must stop every process.
- docs/deployment.md's stand-alone parts: its shell block runs as written (vLLM prefill, decode node, the router
  under uvicorn with ``config/router.example.toml``); every part must listen on loopback only, and greedy answers
  through the router must equal vLLM alone's.

Only ``make test`` is not run (it is the suite this test belongs to; ``.ci/run`` runs it). Other pages hold no shell
block: commands that need a GPU or name placeholders (``DIR``) are ``text`` blocks, and say so.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import psutil
import pytest
from support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = {"make test": "the suite itself: .ci/run runs it"}
DEMO_PORTS = (8000, 8100, 5556, 5557)  # what `make demo` and docs/deployment.md use

pytestmark = pytest.mark.timeout(900)


def blocks(page: str, lang: str) -> list[str]:
    """The fenced ``lang`` blocks of ``page`` (a path under the repository), in order."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def commands(block: str) -> list[str]:
    """A shell block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _env(tmp: Path) -> dict[str, str]:
    """The user's environment without the suite's TILERT_* settings; temporary files under ``tmp``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TILERT_")} | {"TMPDIR": str(tmp)}


def _ports_free() -> None:
    def busy() -> list[int]:
        taken = {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"}
        return [p for p in DEMO_PORTS if p in taken]

    try:
        wait_until(lambda: not busy(), 30, "the documented ports free", interval_s=0.5)
    except AssertionError:
        pytest.fail(f"ports {busy()} are taken: the documented commands use {DEMO_PORTS}")


@contextlib.contextmanager
def _group(cmd: str, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``cmd`` through bash in a process group of its own (as a terminal runs it), its output to ``log``; at the end
    every process of the group and every process they started is stopped."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", cmd], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    seen: dict[int, psutil.Process] = {}
    try:
        yield proc
    finally:
        family = _family(proc.pid, seen)
        for p in family:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(family, timeout=30)  # gone, and their ports with them, before the next test
        assert not alive, [p.pid for p in alive]


def _family(pgid: int, seen: dict[int, psutil.Process]) -> list[psutil.Process]:
    """The living processes of group ``pgid`` and all they started (in groups of their own too), remembered in
    ``seen``, so processes that outlive their parent, or a shell that left them in the background, are found."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(p.pid) == pgid:
                seen.setdefault(p.pid, p)
    for p in list(seen.values()):
        with contextlib.suppress(psutil.Error):
            for child in p.children(recursive=True):
                seen.setdefault(child.pid, child)
    alive = []
    for p in seen.values():
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def _listening(family: list[psutil.Process]) -> list[tuple[str, int]]:
    out = []
    for p in family:
        with contextlib.suppress(psutil.Error):
            out += [(c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == "LISTEN"]
    return out


def _run(cmd: str, env: dict[str, str], timeout_s: float = 300) -> str:
    done = subprocess.run(["bash", "-c", cmd], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{cmd}\nexited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_no_other_page_holds_a_shell_block() -> None:
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    holding = [page for page in pages if page != "docs/deployment.md" and blocks(page, "bash")]
    assert not holding, f"shell blocks no test runs: {holding} (a template or a GPU command is a text block)"
    assert blocks("README.md", "bash") and blocks("docs/deployment.md", "bash")


def test_readme_tour(tmp_path: Path) -> None:
    _ports_free()
    first, *tour = blocks("README.md", "bash")
    start = [c for c in commands(first) if c not in NOT_RUN]
    assert start == ["make demo"], f"the README's first block, other than {list(NOT_RUN)}: {start}"
    env, out = _env(tmp_path), tmp_path / "demo.out"
    with _group("make demo", env, out) as demo:
        seen: dict[int, psutil.Process] = {}
        serving = lambda: "\nServing." in out.read_text(errors="replace")  # noqa: E731
        try:
            wait_until(lambda: demo.poll() is None and serving(), 600, "make demo serving", interval_s=0.5)
        except AssertionError:
            pytest.fail(f"make demo did not serve:\n{out.read_text(errors='replace')[-4000:]}")
        shown = out.read_text(errors="replace")
        before = shown[: shown.index("\nServing.")].splitlines()
        assert len(before) <= 40, f"{len(before)} lines before 'Serving':\n{shown}"
        assert "The same tokens from every path." in shown, shown
        assert re.search(r"^TileRT pool .* ms .* tok/s +\d+\.\d\dx$", shown, re.M), shown
        assert re.search(r"^vLLM alone .* ms .* tok/s", shown, re.M), shown
        log_dir = Path(re.search(r"logs in (\S+)/", shown).group(1))  # type: ignore[union-attr]
        assert {p.name for p in log_dir.glob("*.log")} >= {"prefill.log", "decode.log", "router.log", "up.log"}

        examples = [line.strip() for line in shown[shown.index("\nServing.") :].splitlines() if line.startswith("  ")]
        assert [e.split()[0] for e in examples] == ["curl", ".venv/bin/python"], examples
        assert orjson.loads(_run(examples[0], env))["choices"][0]["message"]["content"]
        assert _run(examples[1], env).strip()
        for block in tour:
            said = _run(block, env)
            if "chat/completions -H" in block:
                assert orjson.loads(said)["choices"][0]["message"]["content"]
            if "vllm bench serve" in block:
                assert re.search(r"Successful requests:\s+16\b", said) and re.search(r"Failed requests:\s+0\b", said)
            if "/metrics" in block:
                assert re.match(r"tilert:time_to_first_token_seconds_count\{.*\} \d+", said), said
        for example in blocks("README.md", "python"):
            done = subprocess.run(
                [sys.executable, "-c", example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]

        family = _family(demo.pid, seen)
        assert len(family) >= 4, [p.cmdline() for p in family]  # make, the demo, tilert up and its processes
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C
        demo.wait(timeout=60)
        wait_until(lambda: not _family(demo.pid, seen), 30, "no process of make demo left")
    assert "Traceback" not in out.read_text(errors="replace")


def test_deployment_parts_on_one_host(tmp_path: Path) -> None:
    _ports_free()
    (block,) = blocks("docs/deployment.md", "bash")
    env = _env(tmp_path)
    logs = [ROOT / name for name in ("prefill.log", "decode.log", "router.log")]
    try:
        with _group(block, env, tmp_path / "parts.out") as shell:
            seen: dict[int, psutil.Process] = {}
            for port in (8100, 5557, 8000):
                url = f"http://127.0.0.1:{port}/health"
                try:
                    wait_until(lambda u=url: _healthy(u), 600, url, interval_s=0.5)  # type: ignore[misc]
                except AssertionError:
                    tails = [f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs if p.exists()]
                    pytest.fail(f"{url} did not answer:\n" + "\n".join(tails))
            listening = _listening(_family(shell.pid, seen))
            assert {port for _, port in listening} >= {8100, 5556, 5557, 8000}, listening
            assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
            for prompt in ("def add(a, b):", "import os", "The quick brown fox", "class Stack:", "# TODO"):
                body = {"model": "models/tiny-deepseek-v3", "prompt": prompt, "max_tokens": 16, "temperature": 0}
                alone = httpx.post("http://127.0.0.1:8100/v1/completions", json=body, timeout=120)
                routed = httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=120)
                assert routed.status_code == 200, routed.text
                assert routed.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"], prompt
    finally:
        for log in logs:
            log.unlink(missing_ok=True)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
