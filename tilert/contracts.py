"""Every message that crosses a process boundary in tilert: one module, one version, strict types.

The conversations, all covered by :data:`PROTOCOL_VERSION`:

0. **Connector settings** (whoever starts vLLM -> the connector inside it): :class:`ConnectorSettings`, the
   ``tilert_*`` keys of ``kv_connector_extra_config`` in vLLM's ``--kv-transfer-config``.
1. **Claim** (router -> vLLM -> connector, and back): the ``tilert_*`` keys of vLLM's pass-through
   ``kv_transfer_params``. :class:`Claim` goes in with the request (signed with the shared secret, see
   :mod:`tilert.auth`); :class:`ClaimResult` comes back in vLLM's non-streaming response.
2. **Control port** (connector's sender <-> decode node), length-prefixed JSON frames, a tagged union::

       sender                               decode node
       Hello(version, transport, auth) ->
                                        <-  HelloAck(version, node_id, transports) | Reject
       Offer(transfer_id, layouts)     ->             (checks reservation, layout, size)
                                        <-  Accept(transfer_id, target) | Reject(reason)
       ... the transport writes the bytes into the decode node's registered buffer at ``target`` ...
       Done(transfer_id, nbytes)       ->   (or Abort(transfer_id, reason) on any sender-side fault)
                                        <-  Ack(transfer_id) | Reject(reason)

4. **Native handoff** (router -> vLLM prefill -> router -> native vLLM decode), vLLM's own P/D protocol:
   :class:`NativePrefillParams` asks the prefill's built-in P/D connector (under ``MultiConnector``, beside
   the TileRT connector) to keep the prompt's KV for a remote decode; :class:`NativeHandoff` is what that
   connector answers, passed on verbatim to the native decode instance (vLLM owns its fields; the router
   checks the ones it relies on and passes the rest through).

3. **Decode node HTTP API** (router -> decode node): :class:`ReserveRequest` (idempotent per transfer id,
   carrying the request's :class:`Sampling` to be checked up front), :class:`ReleaseRequest`
   (one idempotent release that also cancels a running decode), :class:`DecodeRequest` answered by an
   NDJSON stream of :data:`DecodeLine` (token lines (:class:`TokenLine`), the last one with its
   ``finish_reason``, or an :class:`ErrorLine`), the watch stream's :data:`WatchLine` (:class:`NodeBeat`,
   :class:`TransferFailed`), :class:`NodeHealth`, and :class:`ErrorBody` for every 4xx/5xx.

5. **Engine process** (decode node <-> its engine process, ``tilert decode --engine-process``): msgpack
   messages over a local pipe, :data:`EngineCommand` from the node (:class:`EngineSubmit`,
   :class:`EngineCancel`, :class:`EngineCheck`, :class:`EngineStop`) and :data:`EngineEvent` back
   (:class:`EngineReady`, :class:`EngineTokens`, :class:`EngineJobDone`, :class:`EngineCheckResult`);
   see :mod:`tilert.decode.engine_process`.

Each type has one parse (``parse_*`` / ``msgspec`` decoders below, raising :class:`ContractError`) and
one dump (:func:`dump`). Unknown fields, wrong types (``true`` for an int, ``"1"`` for a number), values
out of range and oversized inputs are refused, never coerced. No field is ``Any``, so nothing a peer
sends can nest deeper than the schema.
"""

from __future__ import annotations

import socket
import struct
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec

from tilert import auth
from tilert.netio import recv_exact

if TYPE_CHECKING:
    from collections.abc import Sequence

    from anyio.streams.buffered import BufferedByteReceiveStream

PROTOCOL_VERSION = 4  # 4: the choices of a decode (Sampling.n, TokenLine.index, NodeHealth.max_choices); logprobs
MAX_FRAME_BYTES = 64 << 10  # a control frame; offers are a few hundred bytes
MAX_API_BODY_BYTES = 64 << 10  # a decode-node HTTP request body
MAX_DECODE_BODY_BYTES = 32 << 20  # a reserve or decode request: its grammar, its prompt's token ids
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1 << 18  # entries of logit_bias / allowed_token_ids: a whole vocabulary
MAX_BAD_WORDS = 256  # token sequences of bad_words (each word tokenized with and without a leading space)
MAX_BAD_WORD_TOKENS = 128
MAX_GRAMMAR_CHARS = 1 << 20  # a structured-output grammar or JSON schema, as text
MAX_PROMPT_TOKEN_IDS = 1 << 21  # the prompt's ids a decode request carries for the repetition penalty
MAX_REASON_CHARS = 2000
MAX_CHOICES = 1 << 10  # n of a decode: the choices (engine sequences) one request decodes from its prompt
MAX_LOGPROBS = 20  # top log-probabilities a token carries: vLLM's default max_logprobs
MAX_DRAFTS = 16  # draft positions a speculative step counts (the node's num_speculative_tokens is at most 8)
# vLLM's OpenAI layer shows a log-probability below this (-inf: a token the grammar masks) as this value; the
# node sends it so (JSON has no -inf), which changes nothing a client sees
LOGPROB_FLOOR = -9999.0

TransferId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Token = Annotated[str, msgspec.Meta(max_length=256)]


class ContractError(ValueError):
    """A peer sent something that is not a valid message of this contract; the text says what."""


class _Strict(msgspec.Struct, forbid_unknown_fields=True):
    pass


# ---- 0. the connector's settings (the prefill's --kv-transfer-config) ------------------------------

CLAIM_PREFIX = "tilert_"  # every key of ours in vLLM's kv_connector_extra_config and kv_transfer_params

TransportOption = str | int | float | bool | list[str] | None
# The longest a vLLM step that schedules no token waits for one of the connector's transfers to end (vLLM runs
# such steps back to back while a connector has work pending): a request arriving meanwhile waits as long to be
# scheduled, and it keeps vLLM to at most 1 / wait such steps a second.
DEFAULT_POLL_WAIT_S = 0.01
# On a GPU, a request's layers are copied out of vLLM's cache once they hold this many bytes (and the rest at the end
# of the forward): a prompt of a few thousand tokens is copied in one go, for one launch of host time, and a long
# one a layer or two at a time, its transfer overlapping the rest of the forward.
DEFAULT_STAGE_BATCH_BYTES = 32 << 20


class ConnectorSettings(_Strict, kw_only=True, omit_defaults=True, rename=lambda name: CLAIM_PREFIX + name):
    """``TileRTConnector``'s ``kv_connector_extra_config``, every key ``tilert_``-prefixed; a key it does not
    know, or a value of the wrong type or range, stops vLLM's start-up with the reason.

    ``transport`` and ``transport_options``: the transport plugin the sender uses and what it is given;
    ``timeout_s``: the control channel's timeout and the longest wait for the next staged layer;
    ``staging_bytes``: the bounded staging pool (unset: room for a few prompts of ``max_model_len``, capped,
    never below one); ``staging_device``: ``cpu`` (host memory, pinned on GPU machines) or ``cache`` (the
    caches' device, for a transport that reads device memory); ``sender_threads``: transfers shipped at once;
    ``busy_retry_after_s``: the ``Retry-After`` a client gets when its claim found the pool full;
    ``poll_wait_s``: see :data:`DEFAULT_POLL_WAIT_S`; ``stage_batch_bytes``: a request's layers are copied out of the
    cache once they hold this many bytes (0: each layer as it completes; unset: :data:`DEFAULT_STAGE_BATCH_BYTES` on
    a GPU, 0 on CPU, where a copy costs no launch); ``secret_file``: the deployment's shared secret
    (unset: ``$TILERT_SECRET_FILE`` / ``$TILERT_SECRET``)."""

    transport: Name = "tcp"
    transport_options: dict[Annotated[str, msgspec.Meta(max_length=128)], TransportOption] = {}
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 10.0
    staging_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)] | None = None
    staging_device: Literal["cpu", "cache"] = "cpu"
    sender_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    busy_retry_after_s: Annotated[int, msgspec.Meta(ge=0, le=3600)] = 1
    poll_wait_s: Annotated[float, msgspec.Meta(ge=0, le=10)] = DEFAULT_POLL_WAIT_S
    stage_batch_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] | None = None
    secret_file: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """The settings in ``kv_connector_extra_config``; ``ContractError`` naming the key that is wrong."""
        return _convert(dict(extra or {}), cls, "TileRTConnector's kv_connector_extra_config")

    def to_extra(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` that sets these, defaults left out."""
        return msgspec.to_builtins(self)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(CLAIM_PREFIX + name for name in cls.__struct_fields__)


# ---- 1. the claim in kv_transfer_params ------------------------------------------------------


class Claim(
    _Strict,
    rename={
        "transfer_id": "tilert_transfer_id",
        "host": "tilert_host",
        "ctrl_port": "tilert_ctrl_port",
        "auth": "tilert_auth",
    },
):
    """What the router asks of the connector: ship ``transfer_id``'s KV to ``host:ctrl_port``."""

    transfer_id: TransferId
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    ctrl_port: Port
    auth: Token

    @classmethod
    def signed(cls, secret: bytes, transfer_id: str, host: str, ctrl_port: int) -> Claim:
        return cls(transfer_id, host, ctrl_port, auth.claim_token(secret, transfer_id, host, ctrl_port))

    def verified(self, secret: bytes) -> bool:
        return auth.verify(self.auth, auth.claim_token(secret, self.transfer_id, self.host, self.ctrl_port))

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> Claim | None:
        """``None`` for a request with no ``tilert_*`` key (not ours); ``ContractError`` for a bad claim.

        Other keys (another connector's, under vLLM's ``MultiConnector``) are left alone."""
        ours = {k: v for k, v in (params or {}).items() if k.startswith(CLAIM_PREFIX)}
        if not ours:
            return None
        return _convert(ours, cls, "claim")


class ClaimResult(_Strict, rename=lambda name: CLAIM_PREFIX + name):
    """What the connector's ``request_finished`` hands back through vLLM's response.

    ``error`` says why the claim was not acted on (no KV will be shipped). ``busy`` marks a transient
    refusal: the connector had no staging room for the prompt at that moment, a later retry may succeed (the
    router answers 503 with ``Retry-After: retry_after_s``); any other ``error`` is not worth retrying."""

    transfer_id: TransferId | None = None
    first_token_id: TokenId | None = None
    prompt_tokens: Count | None = None
    error: Reason | None = None
    busy: bool | None = None
    retry_after_s: Annotated[int, msgspec.Meta(ge=0, le=3600)] | None = None

    def to_params(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.to_builtins(self).items() if v is not None}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> ClaimResult | None:
        ours = {k: v for k, v in (params or {}).items() if k.startswith(CLAIM_PREFIX)}
        return _convert(ours, cls, "kv_transfer_params") if ours else None


# ---- 4. the native handoff (vLLM's own P/D connector) --------------------------------------------


class NativePrefillParams(_Strict):
    """``kv_transfer_params`` of a prefill whose decode runs on a native vLLM instance (vLLM's documented
    request for NixlConnector: keep the blocks for a remote decode, which pulls them)."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None

    def to_params(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class NativeHandoff(msgspec.Struct):
    """The prefill's answer for a native decode (only when it finished by length): the fields the router
    relies on, checked; vLLM's other fields (``tp_size``, ``remote_request_id``, ...) ride along in ``raw``."""

    do_remote_prefill: Literal[True]
    remote_engine_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    remote_port: Port
    remote_block_ids: list[list[Annotated[int, msgspec.Meta(ge=0)]]]  # per KV-cache group
    raw: dict[str, Any] = {}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> NativeHandoff | None:
        """``None`` when the prefill returned no handoff (it ended before its one token was due: EOS, stop)."""
        if not params or "remote_engine_id" not in params:
            return None
        fields = {
            k: params.get(k)
            for k in ("do_remote_prefill", "remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
        }
        handoff = _convert(fields, cls, "native kv_transfer_params")
        handoff.raw = {k: v for k, v in params.items() if not k.startswith(CLAIM_PREFIX)}
        return handoff


# ---- 2. the control port -------------------------------------------------------------------------


class KVLayout(_Strict):
    """How one handed-off KV tensor is laid out: ``num_layers x num_tokens`` rows of ``row_bytes``
    each, exactly as vLLM held it.

    ``kind`` names the vLLM layout: ``"mla_dense"`` (rows of ``[kv_lora | rope]`` in ``dtype``, rope
    pairs interleaved as vLLM keeps them), ``"fp8_ds_mla"`` (656-byte rows), ``"dsa_indexer"``
    (fp8 keys + fp32 scale per token).
    """

    kind: Name
    dtype: Name
    row_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    rope_interleaved: bool = True

    def nbytes(self, num_tokens: int) -> int:
        return self.num_layers * num_tokens * self.row_bytes


class _Frame(_Strict, tag_field="type"):
    pass


class Hello(_Frame, tag="hello"):
    version: int
    transport: Name
    sender_id: Name
    auth: Token  # auth.hello_token(secret, sender_id)

    @classmethod
    def signed(cls, secret: bytes, transport: str, sender_id: str) -> Hello:
        return cls(PROTOCOL_VERSION, transport, sender_id, auth.hello_token(secret, sender_id))

    def verified(self, secret: bytes) -> bool:
        return auth.verify(self.auth, auth.hello_token(secret, self.sender_id))


class HelloAck(_Frame, tag="hello_ack"):
    version: int
    node_id: Name
    transports: Annotated[list[Name], msgspec.Meta(max_length=16)] = []


class Offer(_Frame, tag="offer"):
    """The sender has the request's KV staged and asks where to write it. ``last_token_id``: the prompt's
    last token, so an engine can recompute that position (its hidden state, which KV does not carry) and
    draft with MTP from the first decode step, as vLLM's own decode side does."""

    transfer_id: TransferId
    num_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    layouts: Annotated[dict[Name, KVLayout], msgspec.Meta(min_length=1, max_length=8)]
    last_token_id: TokenId | None = None

    @property
    def nbytes(self) -> int:
        return sum(layout.nbytes(self.num_tokens) for layout in self.layouts.values())


class Accept(_Frame, tag="accept"):
    """Where to write: ``target`` is transport-specific (endpoint + registered region + offset)."""

    transfer_id: TransferId
    target: Annotated[dict[Name, str | int], msgspec.Meta(max_length=32)]


class Done(_Frame, tag="done"):
    transfer_id: TransferId
    nbytes: Count


class Abort(_Frame, tag="abort"):
    """The sender gives up on a transfer: the decode node fails the waiting request at once."""

    transfer_id: TransferId
    reason: Reason


class Ack(_Frame, tag="ack"):
    transfer_id: TransferId


class Reject(_Frame, tag="reject"):
    reason: Reason
    transfer_id: Annotated[str, msgspec.Meta(max_length=128)] = ""


Message = Hello | HelloAck | Offer | Accept | Done | Abort | Ack | Reject
_LEN = struct.Struct(">I")
_frame_decoder = msgspec.json.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One control frame: 4-byte big-endian length, then the JSON message."""
    body = msgspec.json.encode(msg)
    return _LEN.pack(len(body)) + body


def decode(body: bytes) -> Message:
    """Parse one frame body into its typed message; anything malformed is a ``ContractError``."""
    try:
        return _frame_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ContractError(f"invalid control frame: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ContractError(f"malformed control frame: {exc}") from None


def frame_length(header: bytes) -> int:
    (length,) = _LEN.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ContractError(f"control frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return int(length)


def send_msg(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode(msg))


def recv_msg(sock: socket.socket) -> Message:
    return decode(recv_exact(sock, frame_length(recv_exact(sock, _LEN.size))))


async def arecv_msg(stream: BufferedByteReceiveStream) -> Message:
    """Async twin of ``recv_msg`` for the decode node's control server (anyio streams)."""
    length = frame_length(await stream.receive_exactly(_LEN.size))
    return decode(await stream.receive_exactly(length))


M = TypeVar("M")
T = TypeVar("T")


def expect(msg: Message, cls: type[M]) -> M:
    """Return ``msg`` if it is a ``cls``; a ``Reject`` or anything else becomes a ``ContractError``."""
    if isinstance(msg, cls):
        return msg
    if isinstance(msg, Reject):
        raise ContractError(f"peer rejected: {msg.reason}")
    raise ContractError(f"expected {cls.__name__}, got {type(msg).__name__}")


# ---- 3. the decode node's HTTP API ---------------------------------------------------------------

NODE_AUTH_HEADER = "authorization"  # "Bearer " + auth.node_api_token(secret)
NODE_KEEPALIVE_S = 30.0  # how long the node keeps an idle connection open (its clients drop theirs sooner)
NODE_BEAT_S = 1.0  # a node's watch stream (``GET /v1/watch``) is never silent longer than this while it runs


class _WatchLine(_Strict, tag_field="type"):
    pass


class NodeBeat(_WatchLine, tag="beat"):
    """The node is alive: the watch stream's first line, then one whenever ``NODE_BEAT_S`` passed without a line.
    The stream ends only when the node stops (or dies: its router sees the connection close)."""

    node_id: Name


class TransferFailed(_WatchLine, tag="transfer_failed"):
    """A transfer to this node failed (the sender's ``Abort``, a refused offer, a transport error), told at once to
    every router watching: the one holding its reservation fails the request then, not when the prefill returns."""

    transfer_id: TransferId
    reason: Reason


WatchLine = NodeBeat | TransferFailed


class Grammar(_Strict):
    """A structured-output constraint as vLLM's xgrammar backend compiles it: ``json`` (a JSON schema, as text),
    ``json_object`` (any JSON object; no spec), ``regex``, ``grammar`` (EBNF, or Lark when no line holds an EBNF
    ``::=`` rule), ``structural_tag`` (xgrammar's structural tag as JSON: what vLLM's tool parsers constrain tool
    calls with). vLLM's ``choice`` arrives as the EBNF grammar vLLM makes of it."""

    kind: Literal["json", "json_object", "regex", "grammar", "structural_tag"]
    spec: Annotated[str, msgspec.Meta(max_length=MAX_GRAMMAR_CHARS)] = ""


Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
Bias = Annotated[float, msgspec.Meta(ge=-100, le=100)]
BadWord = Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]


class Sampling(_Strict):
    """How a request decodes. Sampling fields left null take the checkpoint's ``generation_config.json``
    defaults (as vLLM does); ``max_tokens`` null runs to the end of the context.

    ``max_tokens`` and ``min_tokens`` count the tokens of the whole completion as the client asked (the first
    came from prefill); ``max_tokens`` counts the tokens the node generates. The logits rules are vLLM's:
    ``allowed_token_ids``, ``bad_words_token_ids`` (vLLM's tokenization of ``bad_words``), ``min_tokens`` (stop
    ids and EOS masked until the completion has that many tokens), ``logit_bias`` (clamped to +-100 as vLLM
    does), then the repetition (prompt and completion tokens), frequency and presence (completion tokens)
    penalties; ``min_p`` after the temperature. ``n``: the choices decoded from the one handed-off prompt, each an
    engine sequence of its own with its own sampler (a reservation takes ``n`` of the node's slots); choice 0
    continues from prefill's first token, every other samples its own from the prompt's last position."""

    max_tokens: Count | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1e6)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=1 << 31)] | None = None
    seed: Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None
    stop_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0, le=1e6)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    min_tokens: Count = 0
    logit_bias: Annotated[dict[TokenId, Bias], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    allowed_token_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1, max_length=MAX_LOGIT_BIAS)] | None = None
    bad_words_token_ids: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORDS)] = []
    grammar: Grammar | None = None  # structured output: the tokens each step may take (before every rule above)
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)] = 1
    # Each emitted token's log-probability and this many top ones (vLLM's raw logprobs; None: none)
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class ReserveRequest(_Strict):
    """``sampling``: the request's decode parameters, checked now: a node refuses the reserve when they are
    wrong for its model (422) or more than its engine can honour (501), before prefill has answered, so that
    the decode request cannot be refused for them once the router has started streaming."""

    transfer_id: TransferId
    lease_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None
    sampling: Sampling | None = None


class ReserveResponse(_Strict):
    """``max_seq_len``: the context this node decodes to (:func:`decode_room`)."""

    transfer_id: TransferId
    slot: Count
    max_seq_len: Count


def decode_room(max_seq_len: int, prompt_tokens: int) -> int:
    """The most tokens a node with context ``max_seq_len`` generates after a prompt of ``prompt_tokens``
    (prefill's first token takes a position too). The one statement of the context limit: the node refuses a
    ``max_tokens`` above it; the router uses it to foresee that refusal."""
    return max_seq_len - prompt_tokens - 1


class ReleaseRequest(_Strict):
    """Frees the slot of ``transfer_id`` whatever its state, cancelling a running decode. Idempotent."""

    transfer_id: TransferId


class ReleaseResponse(_Strict):
    released: bool


class DecodeRequest(_Strict):
    """Decode after prefill's first token, as ``sampling`` says."""

    transfer_id: TransferId
    first_token_id: TokenId
    prompt_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    # The prompt's token ids: sent only when the repetition penalty needs them.
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKEN_IDS)] | None = None


class _Line(_Strict, tag_field="type"):
    pass


FinishReason = Literal["stop", "length"]


MAX_LINE_TOKENS = 1024  # tokens in one NDJSON line of the decode stream
MAX_LINE_LOGPROB_TOKENS = 32  # tokens with their log-probabilities in one line (each up to ~1 KB of JSON)
MAX_LINE_BYTES = 64 << 10  # one such line, encoded


class TokenLogprobs(_Strict, array_like=True):
    """One emitted token's log-probabilities as vLLM's sampler computes them (``logprobs_mode`` ``raw_logprobs``):
    the log-softmax of the step's logits before any logits rule, penalty or temperature (a grammar's mask
    applied). ``logprob``: the token's; ``rank``: 1 + how many tokens are more likely (vLLM counts those at
    least as likely, itself included); ``top_ids`` / ``top_logprobs``: the ``Sampling.logprobs`` most likely,
    in descending order (``torch.topk``). Values below :data:`LOGPROB_FLOOR` are sent as it."""

    logprob: float
    rank: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
    top_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LOGPROBS)] = []
    top_logprobs: Annotated[list[float], msgspec.Meta(max_length=MAX_LOGPROBS)] = []

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs):
            raise ValueError("top_ids and top_logprobs differ in length")


class TokenLine(_Line, tag="tokens"):
    """Tokens of one decode step, sent as soon as they exist. The last line of a decode carries
    ``finish_reason``: this node alone decides when decoding is over. ``stop``: the line's last token is
    EOS or one of the request's stop ids (``stop_token_id`` names a stop id; null for EOS); ``length``:
    ``max_tokens`` or the end of the context was reached. ``index``: the choice the line belongs to (of a decode
    with ``n`` > 1, whose choices interleave on the stream and finish each on its own line). ``logprobs``: one entry
    per token, for a request whose ``Sampling.logprobs`` is set (at most :data:`MAX_LINE_LOGPROB_TOKENS` tokens a
    line then)."""

    token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_LINE_TOKENS)]
    finish_reason: FinishReason | None = None
    stop_token_id: TokenId | None = None
    index: Annotated[int, msgspec.Meta(ge=0, lt=MAX_CHOICES)] = 0
    logprobs: Annotated[list[TokenLogprobs], msgspec.Meta(max_length=MAX_LINE_LOGPROB_TOKENS)] | None = None

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")


class ErrorLine(_Line, tag="error"):
    """The decode failed after the stream began; ``status`` is the HTTP status it stands for."""

    status: Annotated[int, msgspec.Meta(ge=400, le=599)]
    message: Reason


DecodeLine = TokenLine | ErrorLine


def join_lines(lines: Sequence[TokenLine]) -> TokenLine:
    """Consecutive token lines of one stream (one choice) as one line: their tokens in order, the last line's
    finish (only the last line of a choice has one). A side that fell behind sends or relays what queued up at once;
    at most :data:`MAX_LINE_TOKENS` tokens in all (:data:`MAX_LINE_LOGPROB_TOKENS` with their logprobs)."""
    if len(lines) == 1:
        return lines[0]
    if any(line.finish_reason is not None for line in lines[:-1]):
        raise ValueError("only the last of the joined lines may carry the finish")
    if any(line.index != lines[0].index for line in lines):
        raise ValueError("only lines of one choice may be joined")
    ids = [t for line in lines for t in line.token_ids]
    logprobs = None
    if any(line.logprobs is not None for line in lines):
        logprobs = [lp for line in lines for lp in line.logprobs or ()]
    room = line_room(logprobs is not None)
    if len(ids) > room:
        raise ValueError(f"{len(ids)} tokens is more than one line holds ({room})")
    last = lines[-1]
    return TokenLine(ids, last.finish_reason, last.stop_token_id, last.index, logprobs)


def line_room(with_logprobs: bool) -> int:
    """The most tokens one line holds."""
    return MAX_LINE_LOGPROB_TOKENS if with_logprobs else MAX_LINE_TOKENS


def join_runs(items: Sequence[T]) -> list[T | TokenLine]:
    """``items`` in order with each run of token lines joined (:func:`join_lines`, up to :data:`MAX_LINE_TOKENS`
    tokens a line, never past a finish: what follows a last line stays separate, for the reader to refuse);
    anything else (an error line, the decode node's own end-of-stream markers) is passed as it is. The lines of
    several choices (``n`` > 1) between two such items are joined choice by choice, each choice's in order."""
    if len(items) == 1:
        return list(items)
    one = _one_run(items)
    if one is not None:
        return [one]
    out: list[T | TokenLine] = []
    run: list[TokenLine] = []
    count, with_logprobs = 0, False  # tokens in run; whether a line of run carries logprobs
    for item in _by_choice(items):
        if isinstance(item, TokenLine):
            logprobs = with_logprobs or item.logprobs is not None
            if (
                run
                and run[-1].index == item.index
                and run[-1].finish_reason is None
                and count + len(item.token_ids) <= line_room(logprobs)
            ):
                run.append(item)
                count, with_logprobs = count + len(item.token_ids), logprobs
                continue
        if run:
            out.append(join_lines(run))
        if isinstance(item, TokenLine):
            run, count, with_logprobs = [item], len(item.token_ids), item.logprobs is not None
        else:
            run, count, with_logprobs = [], 0, False
            out.append(item)
    if run:
        out.append(join_lines(run))
    return out


def _one_run(items: Sequence[object]) -> TokenLine | None:
    """The common case of :func:`join_runs` in one pass: token lines of one choice without logprobs, only the last
    one finished, that fit one line, joined; None when ``items`` are anything else."""
    ids: list[int] = []
    first = items[0]
    if not isinstance(first, TokenLine):
        return None
    for line in items:
        if type(line) is not TokenLine or line.index != first.index or line.logprobs is not None:
            return None
        if line.finish_reason is not None and line is not items[-1]:
            return None
        ids += line.token_ids
    if len(ids) > MAX_LINE_TOKENS:
        return None
    last = items[-1]
    assert isinstance(last, TokenLine)
    return TokenLine(ids, last.finish_reason, last.stop_token_id, last.index)


def _by_choice(items: Sequence[T]) -> list[T | TokenLine]:
    """``items`` with each stretch of consecutive token lines grouped by choice (stably: a choice's lines keep their
    order, the choices the order of their first line); anything else stays where it is."""
    out: list[T | TokenLine] = []
    stretch: dict[int, list[TokenLine]] = {}
    for item in items:
        if isinstance(item, TokenLine):
            stretch.setdefault(item.index, []).append(item)
            continue
        out += [line for lines in stretch.values() for line in lines]
        stretch = {}
        out.append(item)
    out += [line for lines in stretch.values() for line in lines]
    return out


class EngineInfo(_Strict):
    temperature: bool
    top_p: bool
    top_k: bool
    mtp: bool
    pipelined_greedy: bool = False


class NodeHealth(_Strict):
    status: Literal["ok"]
    node_id: Name
    engine: Name
    protocol_version: int
    transport: Name
    ctrl_port: Port
    max_seq_len: Count
    slots_total: Count
    slots_free: Count
    decodes_running: Count
    decodes_waiting: Count
    transfers_received: Count
    decodes_completed: Count
    capabilities: EngineInfo
    max_lease_s: Annotated[float, msgspec.Meta(gt=0)] | None = None  # the longest reservation lease it grants
    max_choices: Count | None = None  # the largest ``n`` a reserve gets here (the sequences its engine decodes at once)


class ErrorDetail(_Strict):
    message: Reason
    code: int


class ErrorBody(_Strict):
    error: ErrorDetail


# ---- 5. the decode node's engine process --------------------------------------------------------------


class _EngineMsg(_Strict, tag_field="type", array_like=True):
    pass


class EngineCaps(_Strict):
    """:class:`tilert.engines.base.Capabilities`, field for field."""

    temperature: bool
    top_p: bool
    top_k: bool
    mtp: bool
    pipelined_greedy: bool
    max_seq_len: Count
    max_sequences: Count
    notes: list[Reason]


class EngineParams(_Strict):
    """:class:`tilert.decode.sampling.DecodeParams`, field for field (checked and completed by the node)."""

    transfer_id: TransferId
    first_token_id: TokenId
    prompt_tokens: Count
    max_tokens: Count | None
    temperature: float
    top_p: float
    top_k: Count
    seed: int | None
    stop_token_ids: list[TokenId]
    ignore_eos: bool
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_tokens: Count
    logit_bias: dict[TokenId, float]
    allowed_token_ids: list[TokenId] | None
    bad_words_token_ids: list[list[TokenId]]
    prompt_token_ids: list[TokenId]
    grammar: Grammar | None
    n: Count
    logprobs: Count | None = None


class EngineReady(_EngineMsg, tag="ready"):
    """The engine is loaded: what the node asks of an engine without computing."""

    name: Name
    vocab_size: Count
    capabilities: EngineCaps
    layouts: dict[Name, KVLayout]


class EngineSubmit(_EngineMsg, tag="submit"):
    """Decode job ``job`` from the prompt state in receive slot ``slot`` (its first bytes, laid out as ``layouts``)."""

    job: Count
    slot: Count
    num_tokens: Count
    layouts: dict[Name, KVLayout]
    params: EngineParams
    last_token_id: TokenId | None = None


class EngineCancel(_EngineMsg, tag="cancel"):
    job: Count


class EngineCheck(_EngineMsg, tag="check"):
    """Could the engine take a prompt state laid out as ``layouts`` (``DecodeEngine.check_layouts``)?"""

    call: Count
    layouts: dict[Name, KVLayout]


class EngineStop(_EngineMsg, tag="stop"):
    pass


class EngineTokens(_EngineMsg, tag="tokens"):
    """A step's new tokens of ``job``'s choice ``index``; ``finish`` set on its last, ``logprobs`` when asked (as
    :class:`TokenLine`)."""

    job: Count
    token_ids: list[TokenId]
    finish: Literal["stop", "length"] | None = None
    stop_token_id: TokenId | None = None
    index: Count = 0
    logprobs: list[TokenLogprobs] | None = None


class EngineStep(_EngineMsg, tag="step"):
    """The new tokens of the jobs one engine step advanced together, in one message (one pipe write a step, not
    one a job: the engine's thread makes them)."""

    tokens: list[EngineTokens]


class SpecTally(_Strict, array_like=True):
    """A job's speculative steps (:class:`tilert.decode.generate.SpecCounts`, field for field)."""

    drafts: Count
    draft_tokens: Count
    accepted_per_pos: Annotated[list[Count], msgspec.Meta(max_length=MAX_DRAFTS)]


class EngineJobDone(_EngineMsg, tag="done"):
    """``job`` left the engine: finished (``finish``, with its speculative steps when it took any) or failed
    (``error``, the engine's exception)."""

    job: Count
    finish: Literal["stop", "length", "cancelled"] | None = None
    stop_token_id: TokenId | None = None
    error: Reason | None = None
    spec: SpecTally | None = None


class EngineCheckResult(_EngineMsg, tag="check_result"):
    call: Count
    error: Reason | None = None


EngineCommand = EngineSubmit | EngineCancel | EngineCheck | EngineStop
EngineEvent = EngineReady | EngineTokens | EngineStep | EngineJobDone | EngineCheckResult
_engine_commands = msgspec.msgpack.Decoder(EngineCommand)
_engine_events = msgspec.msgpack.Decoder(EngineEvent)
_engine_encoder = msgspec.msgpack.Encoder()


def dump_engine(msg: EngineCommand | EngineEvent) -> bytes:
    return _engine_encoder.encode(msg)


def parse_engine_command(raw: bytes) -> EngineCommand:
    try:
        return _engine_commands.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ContractError(f"invalid engine command: {exc}") from None


def parse_engine_event(raw: bytes) -> EngineEvent:
    try:
        return _engine_events.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ContractError(f"invalid engine event: {exc}") from None


# ---- one parse, one dump ------------------------------------------------------------------------

_json_decoders: dict[object, msgspec.json.Decoder[Any]] = {}


def _decoder(cls: Any) -> msgspec.json.Decoder[Any]:
    dec = _json_decoders.get(cls)
    if dec is None:
        dec = _json_decoders[cls] = msgspec.json.Decoder(cls)
    return dec


def _convert(data: object, cls: type[T], what: str) -> T:
    try:
        return msgspec.convert(data, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise ContractError(f"invalid {what}: {exc}") from None


def parse(cls: type[T], raw: bytes | str, *, limit: int = MAX_API_BODY_BYTES) -> T:
    """Decode JSON ``raw`` as ``cls`` (a struct, or a union such as :data:`DecodeLine`)."""
    if len(raw) > limit:
        raise ContractError(f"body of {len(raw)} bytes exceeds {limit}")
    try:
        return _decoder(cls).decode(raw)
    except msgspec.ValidationError as exc:
        raise ContractError(f"invalid {getattr(cls, '__name__', 'message')}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ContractError(f"malformed JSON: {exc}") from None


def parse_line(raw: bytes | str) -> TokenLine | ErrorLine:
    return parse(DecodeLine, raw)  # type: ignore[arg-type]


def parse_lines(raw: bytes) -> list[TokenLine | ErrorLine]:
    """The decode stream's complete lines in ``raw`` (newline-delimited; blank lines skipped), decoded in one call."""
    try:
        return _decoder(DecodeLine).decode_lines(raw)
    except msgspec.ValidationError as exc:
        raise ContractError(f"invalid line: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ContractError(f"malformed JSON: {exc}") from None


def parse_watch_line(raw: bytes | str) -> NodeBeat | TransferFailed:
    return parse(WatchLine, raw)  # type: ignore[arg-type]


def dump(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def dump_line(msg: TokenLine | ErrorLine) -> bytes:
    return msgspec.json.encode(msg) + b"\n"


def dump_lines(lines: Sequence[TokenLine | ErrorLine]) -> bytes:
    """Several lines of the decode stream in one call (each as :func:`dump_line` writes it)."""
    return _line_encoder.encode_lines(lines)


_line_encoder = msgspec.json.Encoder()


def error_body(message: str, code: int) -> bytes:
    return dump(ErrorBody(ErrorDetail(message[:MAX_REASON_CHARS], code)))
