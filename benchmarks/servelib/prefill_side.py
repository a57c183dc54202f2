"""The real connector's two halves, driven exactly where vLLM drives them, around the engine's own prefill.

What ``TileRTConnector`` does inside vLLM, without vLLM's engine (``TileRTConnector.__init__`` builds the halves the
same way, from the same :class:`~tilert.contracts.ConnectorSettings`):

- at start-up, the worker half registers the paged caches (``register_kv_caches``: layouts detected from the
  tensors, the staging pool allocated and registered with the transport);
- per prefill step: the scheduler half reads the step's scheduler output (``build_connector_meta``: the claim in the
  request's ``kv_transfer_params``, checked against the deployment's secret, the prompt's block table, its extent of
  the staging pool); the forward calls the worker's ``save_kv_layer`` after each attention layer wrote its pages (an
  engine forward hook on each attention module), then ``wait_for_save``; the worker's report of extents it is done
  with goes back to the scheduler (``build_connector_worker_meta`` -> ``update_connector_output``);
- the request finishes after its one token: ``request_finished`` returns the :class:`~tilert.contracts.ClaimResult`
  that vLLM's reply carries in ``kv_transfer_params``;
- while extents are out (``has_pending_push_work``), vLLM keeps running empty steps (``poll`` metadata, paced by
  ``wait_for_save``): :meth:`ConnectorDriver.poll_forever` does the same in a thread of its own.

vLLM's scheduler output and request objects are stood in for by the few attributes the connector reads (as
``benchmarks/handoff.py`` does). Without a speculative config vLLM's prefill has no MTP layer, so the main layers'
KV travels, as from the stack's prefill; the decode node recomputes the prompt's last position to draft with MTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

from servelib.paged import PagedCaches, attention_name
from tilert.connector.claims import TileRTConnectorMetadata
from tilert.connector.scheduler import SchedulerSide
from tilert.connector.sender import BackgroundSender
from tilert.connector.staging import pool_bytes
from tilert.connector.worker import WorkerSide
from tilert.contracts import ConnectorSettings
from tilert.engines.tilert.engine import GRAPH_MAX_TOKENS

T = TypeVar("T")


def _scheduler_output(req_id: str, params: dict[str, Any] | None, prompt: list[int], blocks: list[int]) -> Any:
    """vLLM's ``SchedulerOutput`` of a step that schedules one new request's whole prompt."""
    new = SimpleNamespace(
        req_id=req_id,
        sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params} if params is not None else {}),
        prompt_token_ids=prompt,
        block_ids=(blocks,),
        num_computed_tokens=0,
    )
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={req_id: len(prompt)},
        finished_req_ids=set(),
    )


def _empty_output() -> Any:
    """An empty step's ``SchedulerOutput`` (vLLM runs them while a connector has work pending)."""
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[])
    return SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={}, finished_req_ids=set()
    )


class ConnectorDriver:
    """The connector's scheduler and worker halves over ``caches``; every call under :attr:`lock` (vLLM's engine
    core runs one step at a time)."""

    def __init__(
        self, caches: PagedCaches, hf_config: Any, secret: bytes, settings: ConnectorSettings, max_model_len: int
    ) -> None:
        self.caches = caches
        self.lock = threading.Lock()
        sender = BackgroundSender(
            settings.transport,
            dict(settings.transport_options),
            secret,
            timeout_s=settings.timeout_s,
            workers=settings.sender_threads,
        )
        self.worker = WorkerSide(
            hf_config,
            sender,
            staging_bytes=settings.staging_bytes,
            max_model_len=max_model_len,
            staging_device=settings.staging_device,
            poll_wait_s=settings.poll_wait_s,
            stage_batch_bytes=settings.stage_batch_bytes,
        )
        self.worker.register(caches.caches)
        # vLLM's figure comes from its KV cache config; here from the same pages (the worker's own count of them)
        bpt = self.worker.bytes_per_token
        self.scheduler = SchedulerSide(
            caches.block_size,
            secret,
            bytes_per_token=bpt,
            pool_bytes=pool_bytes(settings.staging_bytes, bpt, max_model_len),
            retry_after_s=settings.busy_retry_after_s,
        )
        self._pending = threading.Event()  # set while extents may be out
        self._stop = threading.Event()
        self._hooks = [
            layer.attn.register_forward_hook(self._after_attention(i))
            for i, layer in enumerate(caches.engine.model.layers)
        ]
        self._step: tuple[TileRTConnectorMetadata, torch.Tensor, int] | None = None  # the forward being saved
        # seconds spent in the connector's own calls (the host's side of them), per hook, since the caller cleared it
        self.connector_s: dict[str, float] = {}

    def _connector(self, hook: str, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, a connector hook, timed: wall seconds under ``hook``, this thread's CPU seconds under
        ``hook + "_cpu"`` (the difference is waiting: for the GIL, for the device). Plain calls, no context
        manager: what is timed is the hook, as near as two clock reads allow."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return call(*args)
        finally:
            t1, c1 = time.perf_counter(), time.thread_time()
            spent = self.connector_s
            spent[hook] = spent.get(hook, 0.0) + (t1 - t0)
            spent[hook + "_cpu"] = spent.get(hook + "_cpu", 0.0) + (c1 - c0)

    def close(self) -> None:
        self._stop.set()
        self._pending.set()
        for hook in self._hooks:
            hook.remove()
        self.worker.close()

    def _after_attention(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._step is not None:
                self._save(layer)

        return hook

    def _save(self, layer: int) -> None:
        """vLLM's attention wrote layer ``layer``'s pages (its indexer before it): ``save_kv_layer``."""
        assert self._step is not None
        meta, slots, n = self._step
        self.caches.write_layer(layer, slots, n)
        # the first layer's call opens the request and hands it to the sender: timed apart from the others
        hook = "save_kv_layer_open" if layer == 0 else "save_kv_layer"
        self._connector(hook, self.worker.save_layer, meta, attention_name(layer))

    @contextmanager
    def step(
        self, req_id: str, params: dict[str, Any] | None, prompt: list[int], computed: bool = True
    ) -> Iterator[None]:
        """One prefill step of ``prompt`` (under :attr:`lock`): the scheduler's metadata, then the engine's forward
        (run by the caller inside this block) saving each layer as it completes, then ``wait_for_save`` and the
        worker's report. ``computed=False``: the caller restores the prompt's cache rows instead of running the
        forward (a prefix-cache hit); every layer is saved after the block."""
        n = len(prompt)
        blocks = self.caches.block_table(n)
        meta = self._connector(
            "build_connector_meta", self.scheduler.build_meta, _scheduler_output(req_id, params, prompt, blocks)
        )
        slots = self.caches.slots(blocks, n)
        engine = self.caches.engine
        # A prompt the engine runs as a CUDA graph (its forward hooks fire only while capturing) is saved after it.
        layer_by_layer = computed and (not engine.use_graphs or n > GRAPH_MAX_TOKENS)
        self._step = (meta, slots, n) if layer_by_layer and meta.saves else None
        try:
            yield
        finally:
            self._step = None
        if meta.saves and not layer_by_layer:
            self._step = (meta, slots, n)
            try:
                for layer in range(len(engine.model.layers)):
                    self._save(layer)
            finally:
                self._step = None
        self._connector("wait_for_save", self._wait_for_save, meta)
        if meta.saves:
            self._pending.set()

    def finished(self, req_id: str, params: dict[str, Any] | None, first: int, prompt_tokens: int) -> dict | None:
        """``request_finished``: the connector's ``kv_transfer_params`` for vLLM's reply (None: not claimed)."""
        request = SimpleNamespace(
            request_id=req_id, kv_transfer_params=params, output_token_ids=[first], num_prompt_tokens=prompt_tokens
        )
        return self._connector("request_finished", self.scheduler.request_finished, request)

    def _wait_for_save(self, meta: TileRTConnectorMetadata) -> None:
        """vLLM's ``wait_for_save`` after the forward, then the worker's report to the scheduler."""
        self.worker.flush(meta)
        self._report()

    def _report(self) -> None:
        self.scheduler.update(SimpleNamespace(kv_connector_worker_meta=self.worker.take_report()))  # type: ignore[arg-type]

    def poll_forever(self) -> None:
        """vLLM's empty steps while extents are out: ``poll`` metadata, ``wait_for_save`` (waits for the sender to
        free an extent, at most ``poll_wait_s``), the report."""
        while not self._stop.is_set():
            self._pending.wait()
            if self._stop.is_set():
                return
            with self.lock:
                if not self.scheduler.has_pending_work():
                    self._pending.clear()
                    continue
                meta = self.scheduler.build_meta(_empty_output())
                self.worker.flush(meta)
                self._report()
