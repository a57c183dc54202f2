"""TileRTConnector with both roles in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0), against stock vLLM.

The handed-off prompt KV, injected into our engine, must continue exactly as vLLM continues alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tilert.decode.control import ControlServer
from tilert.decode.slots import SlotTable
from tilert.engines.tilert.engine import TileRTEngine
from tilert.transports.tcp import TcpTransport

SECRET = "single-process-test-secret-0123456789"
PROMPT = "import os\nclass Alpha(object):\n    def run(self, value, other=None):\n        return sorted(value)"


@pytest.mark.timeout(600)
def test_single_process_vllm_handoff_continues_like_vllm(tiny_model: Path) -> None:
    engine = TileRTEngine.load(tiny_model, device="cpu", dtype=torch.float32, max_seq_len=512)
    receiver = TcpTransport.receiver(host="127.0.0.1", options={})
    table = SlotTable(1, engine.expected_layouts(), 512, receiver)
    control = ControlServer(table, "tcp", "test-node", SECRET.encode())
    result: dict[str, Any] = {}

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            port = await tg.start(control.serve, "127.0.0.1", 0)
            table.reserve("single-process")
            script = Path(__file__).parent / "support" / "offline_prefill.py"
            proc = await anyio.run_process(
                [sys.executable, str(script), str(tiny_model), str(port), "single-process", PROMPT],
                check=False,
                env={**os.environ, "TILERT_SECRET": SECRET, "TILERT_SECRET_FILE": ""},
            )
            out = proc.stdout.decode()
            line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
            assert proc.returncode == 0 and line, proc.stderr.decode()[-3000:]
            result.update(json.loads(line[len("RESULT ") :]))
            result["slot"] = await table.wait_ready("single-process", 10)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    finally:
        receiver.close()
    params = result["kv_transfer_params"]
    assert result["alone_kv_transfer_params"] is None
    n = len(result["prompt_token_ids"])
    assert params["tilert_prompt_tokens"] == n and params["tilert_transfer_id"] == "single-process"
    alone = result["alone_token_ids"]
    assert params["tilert_first_token_id"] == alone[0]
    state, layouts, num_tokens = result["slot"].tensors()
    assert num_tokens == n
    engine.inject(state, layouts, n)
    tokens, pos = [alone[0]], n
    for _ in range(len(alone) - 1):
        logits = engine.forward(torch.tensor([tokens[-1]]), pos)
        tokens.append(int(logits[-1].argmax()))
        pos += 1
    assert tokens == alone
