"""The native decode pool (engine plugin ``vllm``): a stock vLLM decode instance, fed by vLLM's own P/D.

A plugin of kind ``native-pool`` (:class:`~tilert.engines.plugin.NativePool`). Where the ``tilert`` engine is
loaded by our decode node, this plugin describes a pool that needs no code of ours at all: stock vLLM on both
sides, joined by vLLM's built-in ``NixlConnector``. The prefill instance runs it as a child of
``MultiConnector`` beside ``TileRTConnector``; the decode instance runs it as a consumer.
The router's native leg (:mod:`tilert.router.native`) then follows vLLM's standard request flow: prefill with
:class:`~tilert.contracts.NativePrefillParams` and ``max_tokens=1``, then the original request, carrying the
prefill's :class:`~tilert.contracts.NativeHandoff`, to the decode instance, which pulls the KV and decodes.

Why NixlConnector: it is the one P/D connector of vLLM 0.32 that moves KV between two vLLM CPU instances
here (NIXL's UCX backend over loopback, DRAM memory); docs/architecture.md ("Which vLLM P/D connector") records why
the others (Mooncake, LMCache, the example/shared-storage connector, ...) do not.

The NIXL side channel (a ZMQ handshake port, ``VLLM_NIXL_SIDE_CHANNEL_PORT``) is per instance: two
instances on one host need two ports, given by :meth:`VllmNativePool.env`.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tilert.contracts import NativeHandoff, NativePrefillParams
from tilert.engines.plugin import NativeInstance, NativePool
from tilert.logs import vllm_access_log_args

__all__ = ["VllmNativePool"]

CPU_COMPILATION_CONFIG = {"custom_ops": ["-rotary_embedding"]}  # vLLM 0.32's CPU rotary kernel and MLA


class VllmNativePool(NativePool):
    """Plugin ``vllm`` of the ``tilert.engines`` group: a pool of stock vLLM decode instances."""

    name = "vllm"
    kind = "native-pool"  # nothing of ours runs on its decode side
    connector = "NixlConnector"

    @classmethod
    def prefill_connector(cls) -> dict[str, Any]:
        """The child of the prefill's ``MultiConnector`` that serves this pool."""
        return {"kv_connector": cls.connector, "kv_role": "kv_producer"}

    @classmethod
    def decode_connector(cls) -> dict[str, Any]:
        """The decode instance's: a consumer of the same connector."""
        return {"kv_connector": cls.connector, "kv_role": "kv_consumer"}

    # -- the request flow (the router's native leg) ---------------------------------------------------
    @classmethod
    def prefill_params(cls) -> dict[str, Any]:
        """``kv_transfer_params`` of the prefill request: keep the KV for a remote decode."""
        return NativePrefillParams().to_params()

    @classmethod
    def handoff(cls, params: dict[str, Any] | None) -> NativeHandoff | None:
        """The prefill's answer checked (``ContractError`` if malformed); None: nothing to decode remotely."""
        return NativeHandoff.from_params(params)

    @classmethod
    def decode_params(cls, handoff: NativeHandoff) -> dict[str, Any]:
        """``kv_transfer_params`` of the decode request: the prefill's answer, verbatim."""
        return dict(handoff.raw)

    # -- processes (``tilert up --native``) ------------------------------------------------------------
    @classmethod
    def env(cls, inst: NativeInstance) -> dict[str, str]:
        """Environment of a vLLM instance taking part (prefill or decode): its own side channel, loopback UCX."""
        env = {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": inst.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(inst.side_channel_port),
            "UCX_NET_DEVICES": "lo" if inst.host in ("127.0.0.1", "localhost", "::1") else "all",
            "UCX_MODULES": "^efa",  # UCX's efa module crashes at exit where ibverbs-providers is installed
        }
        if inst.cpu_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = inst.cpu_bind
        return env

    @classmethod
    def decode_command(cls, inst: NativeInstance, *, cpu: bool) -> list[str]:
        """Stock vLLM's OpenAI server as a native decode instance (no patch, no wrapper)."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(inst.model),
            "--host",
            inst.host,
            "--port",
            str(inst.port),
            "--dtype",
            inst.dtype,
            "--max-model-len",
            str(inst.max_model_len),
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(inst.kv_cache_bytes),
            "--kv-transfer-config",
            json.dumps(cls.decode_connector()),
            # NIXL's handshake hashes whether the hybrid KV cache manager is on; the prefill runs without it
            # (TileRTConnector is not SupportsHMA, and MultiConnector enables it only if every child is), so the
            # decode side must match, or every transfer fails with "NIXL compatibility hash mismatch".
            "--disable-hybrid-kv-cache-manager",
            *vllm_access_log_args(),
        ]
        if cpu:
            cmd += ["--compilation-config", json.dumps(CPU_COMPILATION_CONFIG)]
        return cmd
