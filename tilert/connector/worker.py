"""Worker half of the connector (lives in vLLM's worker process, one per TP rank).

At start-up (``register``) it detects the cache layouts (anything unknown is refused there, never guessed
at), allocates the bounded staging pool once and registers it with the transport's sender: a pool that
cannot be allocated or registered stops vLLM from starting, with the reason.

Inside the forward window, as each attention layer finishes, the rows of every claimed request whose
prompt completes in this step are copied out of the paged cache (the layer's DSA indexer cache with it: vLLM
calls ``save_kv_layer`` for attention layers only) into that request's extent of the pool
(placed by the scheduler half; two requests never share one), and the layers' chunks are marked staged
(on GPU by a CUDA event recorded after the copy). The copies go in batches (``tilert_stage_batch_bytes``): a
request's layers are copied together, in one launch on a GPU (:mod:`tilert.connector.gather`), once they hold
that many bytes, and whatever is left at ``wait_for_save``. A short prompt is then copied in one go
at the end of the forward, for one launch of host time, and a long one a layer or two at a time, its writes
overlapping the rest of the forward. The request goes to the background sender before its first layer is
copied, so the handshake overlaps the forward; the paged blocks can be recycled as soon as the forward ends (the
copies are queued on the forward's stream before it ends). An extraction error never escapes into vLLM's
forward: the transfer is aborted instead. Extents the sender is done with are reported to the scheduler
(``take_report``, through vLLM's ``build_connector_worker_meta``).
"""

from __future__ import annotations

import collections
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import torch

from tilert.connector.claims import SaveRequest, TileRTConnectorMetadata, TileRTWorkerMeta
from tilert.connector.faults import Fault, FaultHook
from tilert.connector.gather import INDEXER_SCALE_BYTES, Group, KVCopier, RequestRows
from tilert.connector.sender import BackgroundSender, Staged
from tilert.connector.staging import ExtentAllocator, pool_bytes
from tilert.contracts import DEFAULT_POLL_WAIT_S, DEFAULT_STAGE_BATCH_BYTES, KVLayout
from tilert.transports.base import TransferError

log = structlog.get_logger("tilert.connector.worker")

FP8_DS_MLA_ROW = 656
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
_DENSE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _layer_index(name: str, default: int) -> int:
    """The decoder layer a cache belongs to, from vLLM's layer name (``model.layers.{i}....``)."""
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else default


@dataclass(frozen=True)
class _Layer:
    group: str  # "mla" or "indexer"
    position: int  # index within its group (an MTP draft layer's cache comes after the main layers')
    cache: torch.Tensor


def classify(
    name: str, cache: torch.Tensor, mla_width: int, index_head_dim: int, indexer_rope_interleaved: bool
) -> tuple[str, KVLayout]:
    """Name the vLLM layout of one layer's cache, or raise ``ValueError`` for one we do not know.

    vLLM always keeps MLA's rope pairs interleaved; the indexer's keys follow the model's
    ``indexer_rope_interleave`` (GLM-5: interleaved, DeepSeek-V3.2: half-split)."""
    if "indexer" in name:
        if cache.dtype != torch.uint8:
            raise ValueError(f"{name}: indexer cache of dtype {cache.dtype}, expected uint8")
        if not index_head_dim:
            raise ValueError(f"{name}: an indexer cache, but the model config has no index_head_dim")
        row = index_head_dim + INDEXER_SCALE_BYTES
        return "indexer", KVLayout("dsa_indexer", "float8_e4m3fn", row, 0, indexer_rope_interleaved)
    last = cache.shape[-1]
    if cache.dtype == torch.uint8 and last == FP8_DS_MLA_ROW:
        return "mla", KVLayout("fp8_ds_mla", "fp8_ds_mla", FP8_DS_MLA_ROW, 0)
    if cache.dtype in _DENSE_DTYPES and last == mla_width:
        return "mla", KVLayout("mla_dense", _DENSE_DTYPES[cache.dtype], mla_width * cache.element_size(), 0)
    raise ValueError(
        f"{name}: unsupported KV cache layout shape={tuple(cache.shape)} dtype={cache.dtype}; "
        f"TileRTConnector handles MLA caches of width {mla_width} (dense), fp8_ds_mla and DSA indexer caches"
    )


@dataclass
class _Open:
    """A request being staged in this step."""

    save: SaveRequest
    staged: Staged
    rows: RequestRows
    stream: torch.cuda.Stream | None = None  # the forward's stream (the copies' events are recorded on it); None on CPU
    pending: set[int] = field(default_factory=set)  # the copier's items the forward has written, not copied yet
    pending_bytes: int = 0
    done: set[int] = field(default_factory=set)  # items copied (queued, on a GPU)
    fault: Fault | None = None  # armed through the test-only hook (tilert.connector.faults)
    first_layer: int = 0  # the step's layers from this one on are its own (opened at the step's first, normally)


def layouts_bytes_per_token(layouts: dict[str, KVLayout]) -> int:
    """What the detected layouts stage per token: must equal the scheduler's ``staging.bytes_per_token``."""
    return sum(lay.num_layers * lay.row_bytes for lay in layouts.values())


class WorkerSide:
    def __init__(
        self,
        hf_config: Any,
        sender: BackgroundSender,
        *,
        staging_bytes: int | None = None,
        max_model_len: int = 0,
        expected_bytes_per_token: int | None = None,
        staging_device: str = "cpu",
        poll_wait_s: float = DEFAULT_POLL_WAIT_S,
        stage_batch_bytes: int | None = None,
    ) -> None:
        """``staging_bytes`` (``tilert_staging_bytes``) / ``max_model_len`` size the pool (see
        ``staging.pool_bytes``); ``expected_bytes_per_token`` is the scheduler's figure (from vLLM's KV cache
        config), checked against the cache tensors at registration; ``staging_device``: ``"cpu"`` (host
        memory, pinned when the caches are on a GPU) or ``"cache"`` (the caches' own device, for a transport
        that reads device memory); ``poll_wait_s``: the longest a step that only polls for the end of
        transfers (``TileRTConnectorMetadata.poll``) waits for one (see :meth:`flush`); ``stage_batch_bytes``: a
        request's layers reached by the forward are copied once they hold this many bytes (0: each layer as it
        completes; unset: ``DEFAULT_STAGE_BATCH_BYTES`` when the caches are on a GPU, 0 otherwise)."""
        lora, rope = getattr(hf_config, "kv_lora_rank", None), getattr(hf_config, "qk_rope_head_dim", None)
        if not lora or not rope:
            raise ValueError("TileRTConnector needs an MLA model (config without kv_lora_rank/qk_rope_head_dim)")
        if staging_device not in ("cpu", "cache"):
            raise ValueError(f'tilert_staging_device must be "cpu" or "cache", not {staging_device!r}')
        self._mla_width = int(lora) + int(rope)
        self._num_main_layers = int(hf_config.num_hidden_layers)
        self._index_head_dim = int(getattr(hf_config, "index_head_dim", 0) or 0)
        self._indexer_rope_interleaved = bool(getattr(hf_config, "indexer_rope_interleave", False))
        self._sender = sender
        self._staging_bytes = staging_bytes
        self._max_model_len = max_model_len
        self._expected_bpt = expected_bytes_per_token
        self._staging_device = staging_device
        self._layers: dict[str, _Layer] = {}
        self._companions: dict[str, list[str]] = {}  # attention layer -> the indexer caches of its decoder layer
        self._layouts: dict[str, KVLayout] = {}
        self._open: dict[str, _Open] = {}  # this step's requests, by req_id
        self._seen: set[str] = set()  # this step's saves acted on (staged, or refused and reported)
        # this step: its metadata, the layers its forward reached (in order: each one's place), its requests copied
        # a batch at a time during the forward
        self._step_meta: TileRTConnectorMetadata | None = None
        self._layer_at: dict[str, int] = {}
        self._batched: list[_Open] = []
        self.pool: torch.Tensor | None = None
        self._extents: ExtentAllocator | None = None
        self._lock = threading.Lock()  # extents + freed list: the sender's threads release into them
        self._released = threading.Condition(self._lock)  # notified whenever the sender frees an extent
        self._freed: list[tuple[str, int]] = []
        self._poll_wait_s = poll_wait_s
        self._batch_setting = stage_batch_bytes
        self._stage_batch_bytes = 0  # fixed by register, once the caches' device is known
        self._copier: KVCopier | None = None
        # what save_kv_layer(name) stages: the copier's items (an attention layer's DSA indexer with it), their bytes
        # a token
        self._save_plans: dict[str, tuple[tuple[int, ...], int]] = {}
        self._device = torch.device("cpu")  # the caches'
        # host memory that queued copies read (their block tables), with the event after them: kept until it completes
        self._in_flight: collections.deque[tuple[Any, Any]] = collections.deque()
        self.transfers: list[Staged] = []  # the most recent ones (tests, benchmarks)
        self._faults = FaultHook.from_env()  # None unless TILERT_TEST_FAULTS is set (tests only)

    @property
    def layouts(self) -> dict[str, KVLayout]:
        return dict(self._layouts)

    @property
    def bytes_per_token(self) -> int:
        return layouts_bytes_per_token(self._layouts)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        groups: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
        kinds: dict[str, KVLayout] = {}
        for order, (name, cache) in enumerate(kv_caches.items()):
            group, layout = classify(name, cache, self._mla_width, self._index_head_dim, self._indexer_rope_interleaved)
            index = _layer_index(name, order)
            # vLLM names an MTP draft layer's caches layers.{N}.* (N = num_hidden_layers): sorted by index,
            # they become the group's last layers, as the engine takes them (see TileRTEngine.inject).
            if kinds.setdefault(group, layout) != layout:
                raise ValueError(f"{name}: layout {layout} differs from the rest of group {group}: {kinds[group]}")
            groups.setdefault(group, []).append((index, name, cache))
        for group, members in groups.items():
            members.sort()
            for position, (_, name, cache) in enumerate(members):
                self._layers[name] = _Layer(group, position, cache)
            base = kinds[group]
            self._layouts[group] = KVLayout(base.kind, base.dtype, base.row_bytes, len(members), base.rope_interleaved)
        indexers: dict[int, list[str]] = {}
        for name, layer in self._layers.items():
            if layer.group == "indexer" and _LAYER_INDEX.search(name):
                indexers.setdefault(_layer_index(name, -1), []).append(name)
        for name, layer in self._layers.items():
            if layer.group == "mla" and _LAYER_INDEX.search(name):
                self._companions[name] = indexers.get(_layer_index(name, -1), [])
        mtp = {i for i in (_layer_index(name, 0) for name in self._layers) if i >= self._num_main_layers}
        log.info(
            "kv_caches_registered",
            mtp_layers=len(mtp),
            layouts={g: msgspec.to_builtins(lay) for g, lay in self._layouts.items()},
        )
        device = self._device = next(iter(kv_caches.values())).device if kv_caches else torch.device("cpu")
        gpu_default = DEFAULT_STAGE_BATCH_BYTES if device.type == "cuda" else 0
        self._stage_batch_bytes = gpu_default if self._batch_setting is None else self._batch_setting
        # vLLM calls save_kv_layer for attention layers only: a DSA indexer's cache, which the indexer writes before
        # its layer's attention runs, is staged with the attention layer of the same decoder layer.
        by_group: dict[str, list[torch.Tensor]] = {group: [] for group in self._layouts}
        for layer in sorted(self._layers.values(), key=lambda lay: lay.position):
            by_group[layer.group].append(layer.cache)
        copier = KVCopier([Group(g, lay.kind, lay.row_bytes, by_group[g]) for g, lay in self._layouts.items()])
        for name in self._layers:
            names = (name, *self._companions.get(name, ()))
            items = tuple(copier.item_of[self._layers[n].group, self._layers[n].position] for n in names)
            row_bytes = sum(self._layouts[self._layers[n].group].row_bytes for n in names)
            self._save_plans[name] = (items, row_bytes)
        self._copier = copier
        log.info("kv_copy_plan", stage_batch_bytes=self._stage_batch_bytes, kernel=copier.on_gpu_kernel)
        self._allocate_pool(device)

    def _allocate_pool(self, cache_device: torch.device) -> None:
        """The staging pool, once: allocated, registered with the sender, or a start-up error saying why."""
        bpt = self.bytes_per_token
        if self._expected_bpt is not None and self._expected_bpt != bpt:
            raise ValueError(
                f"TileRTConnector: the KV cache tensors stage {bpt} bytes per token but vLLM's KV cache config "
                f"says {self._expected_bpt}: refusing to account the staging pool on a wrong figure"
            )
        size = pool_bytes(self._staging_bytes, bpt, self._max_model_len)
        device = cache_device if self._staging_device == "cache" else torch.device("cpu")
        pin = device.type == "cpu" and cache_device.type == "cuda"
        try:
            pool = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
        except (RuntimeError, MemoryError) as exc:
            raise RuntimeError(
                f"TileRTConnector: cannot allocate the {size}-byte KV staging pool on {device}"
                f"{' (pinned)' if pin else ''}: {exc}; lower tilert_staging_bytes"
            ) from exc
        try:
            self._sender.register_source(pool)
        except (TransferError, RuntimeError, ValueError) as exc:
            raise RuntimeError(
                f"TileRTConnector: the {self._sender.transport_name} transport cannot register the {size}-byte "
                f"KV staging pool on {device}: {exc}"
            ) from exc
        self.pool, self._extents = pool, ExtentAllocator(size)
        log.info(
            "staging_pool_ready",
            nbytes=size,
            device=str(device),
            pinned=pin,
            bytes_per_token=bpt,
            transport=self._sender.transport_name,
            sender_cpus=sorted(self._sender.cpus),
        )

    # ---- inside the forward -------------------------------------------------------------------

    def save_layer(self, meta: TileRTConnectorMetadata, layer_name: str) -> None:
        """The forward wrote ``layer_name``'s pages. The step's first layer opens its requests (each goes to the
        sender); a request of fewer bytes than one batch is copied whole at :meth:`flush`, so for it a layer is
        only noted here; the others take the layer into their next batch now."""
        plan = self._save_plans.get(layer_name)
        if plan is None or not meta.saves:
            return
        if meta is not self._step_meta:  # the step's first layer (vLLM binds one metadata a step)
            self._step_meta = meta
            self._open_step(meta, self._layer_at.get(layer_name, len(self._layer_at)))
        if layer_name in self._layer_at:
            return
        self._layer_at[layer_name] = len(self._layer_at)
        if not self._batched:
            return
        items, row_bytes = plan
        for req in self._batched:
            if req.staged.closed:  # the transfer already ended (refused, aborted)
                continue
            req.pending.update(items)
            req.pending_bytes += req.save.num_tokens * row_bytes
            if req.pending_bytes >= self._stage_batch_bytes:
                self._stage(req)

    def _open_step(self, meta: TileRTConnectorMetadata, first_layer: int) -> None:
        """``meta``'s requests not yet seen this step opened (or refused), from the step's ``first_layer``-th
        layer on; those copied a batch at a time during the forward noted."""
        for save in meta.saves:
            if save.req_id in self._seen:
                continue
            self._seen.add(save.req_id)
            req = self._start(save, self._device)
            if req is None:
                continue
            req.first_layer = first_layer
            if save.num_tokens * self.bytes_per_token >= self._stage_batch_bytes:
                self._batched.append(req)

    def _stage(self, req: _Open) -> None:
        """Copy the request's pending items into its extent (one copy a run of consecutive items), then mark their
        chunks staged (on the GPU: once one event recorded after the copies completes)."""
        assert self._copier is not None
        items, req.pending, req.pending_bytes = sorted(req.pending), set(), 0
        where = f"item {items[0]}" if items else ""
        keep: list[Any] = []  # host memory the queued copies read
        event = None
        try:
            for first, count in _runs_of(items):
                where = f"items {first}..{first + count - 1}"
                if req.fault is not None:
                    for k in range(count):
                        req.fault.before_layer(len(req.done) + k)
                keep.append(self._copier.copy(req.rows, req.staged.buffer, first, count))
                req.done.update(range(first, first + count))
            if items and req.stream is not None:
                event = torch.cuda.Event()
                event.record(req.stream)  # after these copies
            if items:
                req.staged.ready([self._copier.chunk_of[i] for i in items], event)
        except Exception as exc:  # noqa: BLE001 - never break vLLM's forward: abort this transfer instead
            # The transfer ends first; rendering the traceback after it can take a while.
            req.staged.fail(f"KV extraction failed at {where}: {type(exc).__name__}: {exc}")
            log.exception("staging_failed", transfer_id=req.save.claim.transfer_id, at=where)
        finally:
            if req.stream is not None and any(k is not None for k in keep):
                if event is None:  # failed after a copy was queued: it still reads that memory
                    event = torch.cuda.Event()
                    event.record(req.stream)
                self._keep_until(event, keep)

    def _keep_until(self, event: Any, host_memory: list[Any]) -> None:
        """Hold ``host_memory`` (what the queued copies read) until ``event`` completes; let go of earlier ones."""
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()
        self._in_flight.append((event, host_memory))

    def _start(self, save: SaveRequest, device: torch.device) -> _Open | None:
        """Take the request's extent (as the scheduler placed it) and hand the transfer to the sender now."""
        tid = save.claim.transfer_id
        total = save.num_tokens * self.bytes_per_token
        assert self.pool is not None and self._extents is not None, "register_kv_caches was not called"
        try:
            with self._lock:
                self._extents.take(save.offset, total)
        except ValueError as exc:  # the scheduler's view disagrees with this pool: never stage over another
            log.error("staging_extent_refused", transfer_id=tid, offset=save.offset, nbytes=total, error=str(exc))
            self._sender.abort(save.claim, f"prefill side: {exc}")
            with self._lock:
                self._freed.append((save.req_id, save.offset))  # the scheduler's record of it must go
            return None
        assert self._copier is not None
        buffer = self.pool[save.offset : save.offset + total]
        chunks = self._copier.extent_chunks(save.num_tokens)
        staged = Staged(
            save.claim,
            save.num_tokens,
            dict(self._layouts),
            buffer,
            chunks,
            lambda: self._release(save.req_id, save.offset),
            save.last_token_id,
        )
        rows = RequestRows(save.block_ids, save.num_tokens, save.block_size, device)
        staged.fault = self._faults.take(tid) if self._faults is not None else None
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        req = _Open(save, staged, rows, stream, fault=staged.fault)
        self._open[save.req_id] = req
        self.transfers = [*self.transfers[-15:], staged]
        try:
            self._sender.submit(staged)
        except RuntimeError as exc:  # the sender is shut down (vLLM stopping): nothing will ship it
            log.error("transfer_not_submitted", transfer_id=tid, error=str(exc))
            staged.release()
        return req

    def _release(self, req_id: str, offset: int) -> None:
        """The sender is done with an extent (any outcome): free it here, report it to the scheduler."""
        with self._lock:
            assert self._extents is not None
            self._extents.free(offset)
            self._freed.append((req_id, offset))
            self._released.notify_all()

    def flush(self, meta: TileRTConnectorMetadata | None = None) -> None:
        """After the forward: a request missing layers is aborted (the rest were fully staged); a save of
        ``meta`` that no layer ever reached is aborted too, and its extent reported back.

        A step that schedules no token (``meta.poll``) runs only because some connector has work pending: our
        transfers in flight (``has_pending_push_work``), or NixlConnector's blocks held until a remote decode
        reads them. vLLM runs such empty steps back to back, as fast as it can: its EngineCore and this worker
        process then take a whole core each, for as long as the pending work lasts. On a small machine that
        starved exactly what the pending work waited for (the sender, the decode node, the router; the native
        decode instance's NIXL read), so a transfer stalled until a timeout ended it, which ended the spin.
        Such a step therefore waits here: until the sender frees one of our extents (the step then
        reports it at once), at most ``poll_wait_s``; so vLLM runs at most ``1 / poll_wait_s`` empty steps a
        second, and new requests wait at most ``poll_wait_s`` longer to be scheduled. Which steps are ``poll``
        (not the one after a request finished): ``SchedulerSide.build_meta``."""
        for save in meta.saves if meta is not None else ():
            if save.req_id not in self._seen:
                log.error("staging_never_started", transfer_id=save.claim.transfer_id)
                self._sender.abort(save.claim, "prefill side: no KV cache layer of this step was staged")
                with self._lock:
                    self._freed.append((save.req_id, save.offset))
        self._seen.clear()
        layers, self._layer_at = list(self._layer_at), {}
        self._batched, self._step_meta = [], None
        for req_id, req in list(self._open.items()):
            del self._open[req_id]
            if req.staged.closed:
                continue  # the transfer already ended (and said why)
            for name in layers[req.first_layer :]:  # every layer the forward reached since it opened, not copied yet
                items = self._save_plans[name][0]
                if items[0] not in req.done:
                    req.pending.update(items)
            if req.pending:
                self._stage(req)
            if len(req.done) != len(self._layers):
                missing = len(self._layers) - len(req.done)
                log.error("staging_incomplete", transfer_id=req.save.claim.transfer_id, missing_layers=missing)
                req.staged.fail(f"prefill staged {len(req.done)}/{len(self._layers)} layers")
        if meta is not None and meta.poll and self._poll_wait_s > 0:
            self.wait_for_release(self._poll_wait_s)

    def wait_for_release(self, timeout_s: float) -> bool:
        """Until an extent freed since the last report is waiting to be reported, at most ``timeout_s``;
        whether one is."""
        with self._released:
            self._released.wait_for(lambda: bool(self._freed), timeout_s)
            return bool(self._freed)

    def take_report(self) -> TileRTWorkerMeta | None:
        """Extents freed since the last report, for the scheduler (``None`` when there is no news)."""
        with self._lock:
            freed, self._freed = self._freed, []
        return TileRTWorkerMeta(freed) if freed else None

    @property
    def extents_in_use(self) -> int:
        with self._lock:
            return self._extents.live if self._extents is not None else 0

    def close(self) -> None:
        self._sender.close()


def _runs_of(items: list[int]) -> list[tuple[int, int]]:
    """Sorted item numbers as runs ``(first, count)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for item in items:
        if runs and runs[-1][0] + runs[-1][1] == item:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((item, 1))
    return runs
