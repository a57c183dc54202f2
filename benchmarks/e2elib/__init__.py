"""The parts of ``benchmarks/e2e.py``, one concern each.

- :mod:`procs`: the servers as supervised child processes (each in its own process group, all stopped on leaving);
- :mod:`probes`: what a server did during one run, from its ``/metrics`` and its CPU time;
- :mod:`conditions`: the checkpoint and the conditions a run is recorded with;
- :mod:`targets`: the end-to-end targets (the stack, vLLM alone, the stack's prefill) and their commands;
- :mod:`e2e_runs`: end to end, ``vllm bench serve`` against each target in interleaved rounds;
- :mod:`load`: the router-overhead load client (the router's path and the direct one, timed from the client);
- :mod:`overhead`: the router between the stand-ins of :mod:`tilert.testing.standins`, driven by :mod:`load`;
- :mod:`tables`: the result tables; :mod:`report`: the markdown and JSON a run writes.
"""
