"""Session-wide fixtures: one tiny checkpoint, one real stack (stock vLLM + decode node + router).

The stack is started once per session through ``tilert up`` itself, exactly as a user starts it, and stopped at
the end of the session the way a user stops it (SIGINT); that stop is checked (:func:`support.stack.
stop_stack_checked`): a ``tilert up`` that does not exit cleanly, or leaves a process behind, errors the run.
No test stops it, so the suite runs in any order (pytest-randomly shuffles it: ``-p no:randomly`` runs it in
file order, ``--randomly-seed=N`` repeats a shuffled run).
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.stack import TOOL_FLAGS, Launch, Stack, launch_stack, stop_launch, stop_stack_checked


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls: one intra-op thread is several times faster than two on a busy 2-core machine. A module
    asks for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch  # lazy: only the modules that ask for this fixture need torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tilert.models.tiny import build_tiny_model  # lazy: imports torch

    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("models") / "tiny-deepseek-v3", seed=0)


def _launch_session_stack(request: pytest.FixtureRequest) -> Launch:
    tiny_model = request.getfixturevalue("tiny_model")
    logs = request.getfixturevalue("tmp_path_factory").mktemp("logs")
    # vLLM's tool flags, on every process of the session stack (its vLLM alone answers with them too): requests
    # without tools are answered as without them (tests/test_tool_calls.py serves tools through them).
    return launch_stack(tiny_model, logs / "stack.log", *TOOL_FLAGS)


@pytest.fixture(scope="session", autouse=True)
def _stack_launched(request: pytest.FixtureRequest, _offline_env: None) -> Iterator[Launch | None]:
    """The session stack's ``tilert up`` started before the first test when a selected test uses the stack, so
    that its start-up (mostly one process importing) overlaps the tests that run before the first that uses it;
    stopped here if no test waited for it."""
    if not any("stack" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    launch = _launch_session_stack(request)
    yield launch
    stop_launch(launch)  # nothing left to do once the stack fixture stopped it


@pytest.fixture(scope="session")
def stack(request: pytest.FixtureRequest, _stack_launched: Launch | None) -> Iterator[Stack]:
    """The session's ``tilert up`` stack. Its teardown is a check: SIGINT stops ``tilert up`` (status 0) and every
    process it started, vLLM's engine core included; a failure there errors the run."""
    launch = _stack_launched or _launch_session_stack(request)  # only asked for by name (getfixturevalue): now
    handle = launch.wait()
    yield handle
    stop_stack_checked(handle)


@pytest.fixture(autouse=True)
def _torch_seeded(request: pytest.FixtureRequest) -> None:
    """Torch's global generator seeded from the test's id: a test draws the same values whichever tests ran before
    it (pytest-randomly does the same for ``random`` and numpy, from its run's seed)."""
    torch = sys.modules.get("torch")  # only where torch is imported already: importing it here costs seconds
    if torch is not None:
        torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session", autouse=True)
def _offline_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The shuffle's seed at the end of every run (``-q`` hides the header that names it), to repeat the order."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.hasplugin("randomly") and config.option.randomly_reorganize:
        terminalreporter.write_line(f"test order shuffled by pytest-randomly; repeat it with --randomly-seed={seed}")
