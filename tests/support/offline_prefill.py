"""Stock vLLM, offline API, engine core and worker in ONE process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
with TileRTConnector: both connector roles then share a process. Run as a script by
``tests/test_connector_single_process.py``; prints one JSON line with what vLLM produced."""

from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    model, ctrl_port, transfer_id, prompt = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    from vllm import LLM, SamplingParams

    from tilert.stack import CPU_PREFILL_COMPILATION_CONFIG

    llm = LLM(
        model=model,
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        compilation_config=CPU_PREFILL_COMPILATION_CONFIG,
        kv_transfer_config={
            "kv_connector": "TileRTConnector",
            "kv_connector_module_path": "tilert.connector",
            "kv_role": "kv_producer",
        },
    )
    from tilert.auth import load_secret
    from tilert.contracts import Claim

    claim = Claim.signed(load_secret(), transfer_id, "127.0.0.1", ctrl_port)  # as the router signs it
    marked = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": claim.to_params()})
    first = llm.generate(prompt, marked)[0]
    alone = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    print(
        "RESULT "
        + json.dumps(
            {
                "prompt_token_ids": list(first.prompt_token_ids),
                "kv_transfer_params": first.kv_transfer_params,
                "alone_token_ids": list(alone.outputs[0].token_ids),
                "alone_kv_transfer_params": alone.kv_transfer_params,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
