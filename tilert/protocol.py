"""The prefill -> decode handoff protocol: one versioned, typed message set.

Control plane (this module): the connector's background sender opens a TCP connection to the decode
node's control port and speaks length-prefixed JSON frames (4-byte big-endian length, then an orjson
object with a ``"type"`` field):

    sender                               decode node
    Hello(version, transport)    ->
                                 <-      HelloAck(version, node_id, transports) | Reject
    Offer(transfer_id, layouts)  ->                 (checks reservation, layout, size)
                                 <-      Accept(transfer_id, target) | Reject(reason)
    ... transport writes the bytes into the decode node's registered buffer at ``target`` ...
    Done(transfer_id, nbytes)    ->      (or Abort(transfer_id, reason) on any sender-side fault)
                                 <-      Ack(transfer_id) | Reject(reason)

The data plane belongs to the transports (``tilert.transports``): they only move bytes into a region
the receiver registered up front. A version mismatch or an unknown layout is refused at Hello/Offer,
never guessed at. Every message carries the router-minted ``transfer_id`` where one applies.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import orjson

from tilert.netio import recv_exact

if TYPE_CHECKING:
    from anyio.streams.buffered import BufferedByteReceiveStream

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20
_LEN = struct.Struct(">I")


class ProtocolError(RuntimeError):
    """A peer sent something this side cannot accept (bad frame, wrong version, wrong state)."""


@dataclass(frozen=True)
class KVLayout:
    """How one handed-off KV tensor is laid out: ``num_layers x num_tokens`` rows of ``row_bytes``
    each, exactly as vLLM held it.

    ``kind`` names the vLLM layout: ``"mla_dense"`` (rows of ``[kv_lora | rope]`` in ``dtype``, rope
    pairs interleaved as vLLM keeps them), ``"fp8_ds_mla"`` (656-byte rows), ``"dsa_indexer"``
    (fp8 keys + fp32 scale per token).
    """

    kind: str
    dtype: str
    row_bytes: int
    num_layers: int
    rope_interleaved: bool = True

    def nbytes(self, num_tokens: int) -> int:
        return self.num_layers * num_tokens * self.row_bytes


@dataclass(frozen=True)
class Message:
    type: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **asdict(self)}


@dataclass(frozen=True)
class Hello(Message):
    type: ClassVar[str] = "hello"
    version: int
    transport: str
    sender_id: str = ""


@dataclass(frozen=True)
class HelloAck(Message):
    type: ClassVar[str] = "hello_ack"
    version: int
    node_id: str
    transports: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Offer(Message):
    """The sender has the request's KV staged and asks where to write it."""

    type: ClassVar[str] = "offer"
    transfer_id: str
    num_tokens: int
    layouts: dict[str, KVLayout]

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes(self.num_tokens) for layout in self.layouts.values())


@dataclass(frozen=True)
class Accept(Message):
    """Where to write: ``target`` is transport-specific (endpoint + registered region + offset)."""

    type: ClassVar[str] = "accept"
    transfer_id: str
    target: dict[str, Any]


@dataclass(frozen=True)
class Done(Message):
    type: ClassVar[str] = "done"
    transfer_id: str
    nbytes: int


@dataclass(frozen=True)
class Abort(Message):
    """The sender gives up on a transfer: the decode node fails the waiting request at once."""

    type: ClassVar[str] = "abort"
    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Ack(Message):
    type: ClassVar[str] = "ack"
    transfer_id: str


@dataclass(frozen=True)
class Reject(Message):
    type: ClassVar[str] = "reject"
    reason: str
    transfer_id: str = ""


_TYPES: dict[str, type[Message]] = {
    cls.type: cls for cls in (Hello, HelloAck, Offer, Accept, Done, Abort, Ack, Reject)
}


def encode(msg: Message) -> bytes:
    body = orjson.dumps(msg.to_dict())
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """Parse one frame body into its typed message; anything malformed is a ``ProtocolError``."""
    try:
        data = orjson.loads(body)
        cls = _TYPES[data.pop("type")]
        names = {f.name for f in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ProtocolError(f"{cls.type}: unknown fields {sorted(unknown)}")
        if cls is Offer:
            data["layouts"] = {name: KVLayout(**lay) for name, lay in data["layouts"].items()}
        return cls(**data)
    except ProtocolError:
        raise
    except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed control frame: {exc!r}") from exc


def send_msg(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))


def recv_msg(sock: socket.socket) -> Message:
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return decode(recv_exact(sock, length))


def expect(msg: Message, cls: type[Message]) -> Any:
    """Return ``msg`` if it is a ``cls``; a ``Reject`` or anything else becomes a ``ProtocolError``."""
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, Reject):
        raise ProtocolError(f"peer rejected: {msg.reason}")
    raise ProtocolError(f"expected {cls.type}, got {msg.type}")


async def arecv_msg(stream: "BufferedByteReceiveStream") -> Message:
    """Async twin of ``recv_msg`` for the decode node's control server (anyio streams)."""
    (length,) = _LEN.unpack(await stream.receive_exactly(_LEN.size))
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return decode(await stream.receive_exactly(length))
