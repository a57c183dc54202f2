"""The parts of ``benchmarks/gpu_serving.py``, one concern each.

- :mod:`paged`: vLLM's paged KV caches for the device, and the engine's prompt rows written into them;
- :mod:`prefill_side`: the real connector's scheduler and worker halves, driven where vLLM drives them;
- :mod:`standin`: the prefill stand-in's server (vLLM's OpenAI answer to the router's prefill leg);
- :mod:`reference`: the engine's own tokens and speed on the same checkpoint and device;
- :mod:`parts`: the stand-in, the decode node and the router as supervised processes;
- :mod:`clients`: the streaming OpenAI clients; :mod:`report`: the rows and the table;
- :mod:`synthetic`: ``--synthetic NAME``'s checkpoint, written and converted before the run.
"""
