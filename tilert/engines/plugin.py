"""The ``tilert.engines`` plugin group: its two kinds of plugin and how each is loaded.

Every plugin class of the group declares the kind it offers as its class attribute ``kind``:

- ``"node-engine"``: a :class:`~tilert.engines.base.DecodeEngine` that our decode node loads and runs in its
  own process (``tilert decode --engine NAME``; plugin ``tilert``).
- ``"native-pool"``: a :class:`NativePool`, a pool of stock decode instances that needs no code of ours on
  its decode side; ``tilert up --native`` starts it and the router's native leg (:mod:`tilert.router.native`)
  speaks to it (``--native-engine NAME``; plugin ``vllm``).

:func:`load_engine` and :func:`load_native_pool` read the declared kind (:func:`tilert.plugins.load`) and
refuse a plugin of the other kind, of none or of an unknown one, with a :class:`~tilert.plugins.PluginError`
naming what is there. This module imports no torch: the router loads native pools through it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

from tilert.contracts import NativeHandoff
from tilert.plugins import ENGINES_GROUP, PluginError, load

if TYPE_CHECKING:
    from tilert.engines.base import DecodeEngine

__all__ = [
    "DRAFT_HEADS",
    "draft_vocab_problem",
    "KINDS",
    "NATIVE_POOL",
    "NODE_ENGINE",
    "EngineKind",
    "NativeInstance",
    "NativePool",
    "load_engine",
    "load_native_pool",
]

# What an engine's MTP drafts read as their vocabulary head (DecodeEngine.warm_up's draft_head): the checkpoint's own
# head, or a block-FP8 copy of it.
DRAFT_HEADS: Final = ("model", "fp8")


def draft_vocab_problem(ids: Sequence[int], vocab_size: int | None) -> str | None:
    """What keeps the token ids ``ids`` from being a draft vocabulary (DecodeEngine.warm_up's ``draft_vocab``: at least
    one id, each inside ``0..vocab_size - 1``, none twice; the range unchecked when ``vocab_size`` is None), or None."""
    if not ids:
        return "no token id given"
    outside = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if outside:
        return f"token id {outside[0]} is outside the checkpoint's vocabulary (0..{(vocab_size or 1) - 1})"
    if len(set(ids)) != len(ids):
        return "token ids must be distinct"
    return None


EngineKind = Literal["node-engine", "native-pool"]
NODE_ENGINE: Final = "node-engine"
NATIVE_POOL: Final = "native-pool"

KINDS: Final[dict[str, str]] = {
    NODE_ENGINE: "an engine the decode node runs in-process (`tilert decode --engine`)",
    NATIVE_POOL: "a native decode pool of stock vLLM decode instances (`tilert up --native --native-engine`)",
}


@dataclass(frozen=True)
class NativeInstance:
    """One stock vLLM instance taking part in a native pool (the prefill or a decode): its HTTP and KV
    side-channel ports."""

    model: Path
    host: str
    port: int
    side_channel_port: int
    dtype: str = "float32"
    max_model_len: int = 2048
    kv_cache_bytes: int = 134_217_728
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (two vLLM CPU instances: pin them apart)


class NativePool(ABC):
    """A native decode pool: what ``tilert up --native`` starts and the router's native leg speaks.

    The pool is used as a class (never instantiated). Its request flow is vLLM's own P/D: the shared prefill
    runs :meth:`prefill_connector` beside ``TileRTConnector``; the router prefills with :meth:`prefill_params`
    and ``max_tokens=1``, checks the answer with :meth:`handoff`, and sends the client's request with
    :meth:`decode_params` to a decode instance, which pulls the KV and decodes.
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["native-pool"]]
    connector: ClassVar[str]  # the vLLM KV connector carrying the pool's KV (named in the router's errors)

    @classmethod
    @abstractmethod
    def prefill_connector(cls) -> dict[str, Any]:
        """The prefill's ``MultiConnector`` child that serves this pool (a ``--kv-transfer-config`` entry)."""

    @classmethod
    @abstractmethod
    def decode_connector(cls) -> dict[str, Any]:
        """The decode instance's ``--kv-transfer-config``."""

    @classmethod
    @abstractmethod
    def prefill_params(cls) -> dict[str, Any]:
        """``kv_transfer_params`` of the prefill request: keep the KV for a remote decode."""

    @classmethod
    @abstractmethod
    def handoff(cls, params: dict[str, Any] | None) -> NativeHandoff | None:
        """The prefill's answer checked (``ContractError`` if malformed); None: nothing to decode remotely."""

    @classmethod
    @abstractmethod
    def decode_params(cls, handoff: NativeHandoff) -> dict[str, Any]:
        """``kv_transfer_params`` of the decode request."""

    @classmethod
    @abstractmethod
    def env(cls, inst: NativeInstance) -> dict[str, str]:
        """Environment of a vLLM instance taking part (prefill or decode)."""

    @classmethod
    @abstractmethod
    def decode_command(cls, inst: NativeInstance, *, cpu: bool) -> list[str]:
        """The command line of a decode instance of the pool (``cpu``: no CUDA device)."""


def load_engine(name: str) -> type[DecodeEngine]:
    """The ``node-engine`` plugin ``name``: an engine the decode node runs (a native pool is refused)."""
    from tilert.engines.base import DecodeEngine  # lazy: torch

    cls = load(ENGINES_GROUP, name, NODE_ENGINE, KINDS)
    if not issubclass(cls, DecodeEngine):
        raise PluginError(f"plugin {name!r} of {ENGINES_GROUP} declares kind {NODE_ENGINE!r} but is no DecodeEngine")
    return cls


def load_native_pool(name: str) -> type[NativePool]:
    """The ``native-pool`` plugin ``name`` (an engine the decode node runs is refused)."""
    cls = load(ENGINES_GROUP, name, NATIVE_POOL, KINDS)
    if not issubclass(cls, NativePool):
        raise PluginError(f"plugin {name!r} of {ENGINES_GROUP} declares kind {NATIVE_POOL!r} but is no NativePool")
    return cls
