"""The published TileRT x vLLM command lines (``decode_server``, ``weight_converter``, ``pd_router`` and vLLM's
``--kv-transfer-config`` for ``tilert.pd_vllm.prefill_connector``) work here verbatim.

End to end: ``weight_converter`` converts the tiny checkpoint, ``decode_server`` serves the converted weights,
stock vLLM prefills with ``kv_connector_module_path: tilert.pd_vllm.prefill_connector`` and the published
``kv_connector_extra_config`` keys, ``pd_router`` fronts them; tokens through the router equal vLLM's own greedy
tokens. Only paths, ports and the sequence length differ from the published lines (tiny model, loopback, CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.oracle import prompts, router_call, vllm_alone
from support.stack import free_port, wait_healthy

from tilert.auth import SECRET_FILE_ENV, generate_secret
from tilert.contracts import ContractError
from tilert.pd_vllm import aliases
from tilert.pd_vllm.prefill_connector import TileRTConnector as PublishedConnector
from tilert.stack import CPU_PREFILL_COMPILATION_CONFIG

PY = sys.executable


def test_decode_server_flags_translate(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = (
        "--engine tilert --model glm5 --model-weights-dir W --with-mtp --max-seq-len 202752 --kv-cache-dtype fp8 "
        "--ctrl-port 5556 --http-port 5557 --host 0.0.0.0"
    ).split()
    monkeypatch.setattr(aliases, "check_family", lambda *a: None)  # no checkpoint at "W" here
    out = aliases.decode_server_args(argv)
    want = "decode --engine tilert --model W --ctrl-port 5556 --http-port 5557 --max-seq-len 202752 "
    want += "--num-speculative-tokens 1 --host 0.0.0.0"
    assert out == want.split()
    router = "--vllm-url http://p:8000/v1 --decode d:5556:5557 --model-path M --port 23333".split()
    assert aliases.pd_router_args(router)[:3] == ["router", "--prefill-url", "http://p:8000"]


def test_inapplicable_or_wrong_values_are_refused_with_a_reason(tiny_model: Path, tmp_path: Path) -> None:
    convert = [PY, "-m", "tilert.models.preprocess.weight_converter", "--model_type", "glm-5"]
    convert += ["--model_dir", str(tiny_model), "--save_dir", str(tmp_path / "x")]
    res = subprocess.run(convert, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "means model_type 'glm_moe_dsa', but" in res.stderr and "deepseek_v3" in res.stderr
    serve = [PY, "-m", "tilert.pd_vllm.decode_server", "--model", "deepseek-v3", "--model-weights-dir", str(tiny_model)]
    res = subprocess.run([*serve, "--kv-cache-dtype", "int4"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--kv-cache-dtype 'int4' is not supported" in res.stderr
    with pytest.raises(aliases.AliasError, match="tilert_model 'glm5' means model_type 'glm_moe_dsa', but vLLM"):
        aliases.check_connector_extra({"tilert_model": "glm5"}, "deepseek_v3", 2048)
    extra = {"tilert_host": "h", "tilert_ctrl_port": 5556, "tilert_model": "glm5", "tilert_max_seq_len": 1024}
    warnings = aliases.check_connector_extra(extra, "glm_moe_dsa", 2048)
    assert any("refuses longer ones" in w for w in warnings)
    # the published keys set none of the connector's own settings; any other unknown key stops vLLM's start-up
    assert PublishedConnector.settings(extra | {"tilert_transport": "nixl"}).transport == "nixl"
    with pytest.raises(ContractError, match="tilert_nonsense"):
        PublishedConnector.settings(extra | {"tilert_nonsense": 1})


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.fixture(scope="module")
def published(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    root = tmp_path_factory.mktemp("published")
    secret = root / "secret"
    secret.write_text(generate_secret() + "\n")
    secret.chmod(0o600)
    env = {**os.environ, SECRET_FILE_ENV: str(secret), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    weights = root / "tilert-weights"
    convert = [PY, "-m", "tilert.models.preprocess.weight_converter", "--model_type", "deepseek-v3"]
    convert += ["--model_dir", str(tiny_model), "--save_dir", str(weights)]
    ctrl, http, prefill, router = (free_port() for _ in range(4))
    extra = {"tilert_host": "127.0.0.1", "tilert_ctrl_port": ctrl, "tilert_model": "deepseek-v3"}
    kv = {
        "kv_connector": "TileRTConnector",
        "kv_connector_module_path": "tilert.pd_vllm.prefill_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra | {"tilert_max_seq_len": 2048},
    }
    decode = f"--engine tilert --model deepseek-v3 --max-seq-len 2048 --kv-cache-dtype fp8 --ctrl-port {ctrl}"
    vllm = f"--port {prefill} --enforce-eager --dtype float32 --max-model-len 2048 --kv-cache-memory-bytes 134217728"
    pd_router = f"--vllm-url http://127.0.0.1:{prefill} --decode 127.0.0.1:{ctrl}:{http} --port {router}"
    cmds = {
        "decode": [
            PY,
            "-m",
            "tilert.pd_vllm.decode_server",
            *decode.split(),
            "--http-port",
            str(http),
            "--model-weights-dir",
            str(weights),
        ],
        "prefill": [
            PY,
            "-m",
            "vllm.entrypoints.openai.api_server",
            *vllm.split(),
            "--model",
            str(tiny_model),
            "--compilation-config",
            json.dumps(CPU_PREFILL_COMPILATION_CONFIG),
            "--kv-transfer-config",
            json.dumps(kv),
        ],
        "router": [PY, "-m", "tilert.pd_vllm.pd_router", *pd_router.split(), "--model-path", str(tiny_model)],
    }
    procs = {name: _spawn(cmd, root / f"{name}.log", env) for name, cmd in cmds.items() if name != "decode"}
    try:  # the prefill and the router start while the weights convert (the decode node needs them)
        subprocess.run(convert, check=True, env=env, timeout=300)
        procs["decode"] = _spawn(cmds["decode"], root / "decode.log", env)
        for name, port in (("decode", http), ("prefill", prefill), ("router", router)):
            wait_healthy(f"http://127.0.0.1:{port}", procs[name], 600, root / f"{name}.log")
        base = "http://127.0.0.1"
        yield SimpleNamespace(model=tiny_model, prefill=f"{base}:{prefill}", router=f"{base}:{router}", logs=root)
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_published_command_lines_end_to_end(published: Any) -> None:
    kind, prompt = prompts(published.model)[0]
    want, text, _ = vllm_alone(published, kind, prompt)
    got, got_text, _ = router_call(published.router, published.model, kind, prompt, stream=True)
    assert got == want and got_text == text
    decode_log = (published.logs / "decode.log").read_text()
    assert "--kv-cache-dtype fp8: the decode engine keeps its latent cache" in decode_log
    assert "published_extra_config" in (published.logs / "prefill.log").read_text()
