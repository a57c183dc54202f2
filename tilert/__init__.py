"""tilert: stock vLLM prefill + a low-latency decode engine, joined through vLLM's KV connector API."""

__version__ = "0.1.0"
