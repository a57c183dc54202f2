"""The shared secret that binds router, connector and decode node together.

One secret is configured once per deployment (``tilert up`` generates one) and read from a file or an
environment variable, never from a command line (``ps`` shows command lines to every user):

- ``$TILERT_SECRET_FILE``: path of a file holding the secret (first line, surrounding blanks ignored);
- ``$TILERT_SECRET``: the secret itself.

The secret itself never travels. Each use signs what it authorises with HMAC-SHA256:

- the decode node's HTTP API takes ``Authorization: Bearer <node_api_token(secret)>``;
- a claim in ``kv_transfer_params`` carries ``tilert_auth = claim_token(secret, transfer_id, host, port)``,
  so a client that sends ``tilert_*`` keys straight to vLLM cannot make the prefill node connect anywhere;
- the connector's ``Hello`` on the control port carries ``hello_token(secret, sender_id)``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

SECRET_ENV = "TILERT_SECRET"
SECRET_FILE_ENV = "TILERT_SECRET_FILE"
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """No usable secret is configured; the message says how to configure one."""


def generate_secret() -> str:
    return secrets.token_hex(32)


def load_secret(path: str | os.PathLike[str] | None = None) -> bytes:
    """The deployment's secret from ``path``, else ``$TILERT_SECRET_FILE``, else ``$TILERT_SECRET``."""
    path = path or os.environ.get(SECRET_FILE_ENV) or None
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8").strip().splitlines()
        except OSError as exc:
            raise SecretError(f"cannot read the secret file {str(path)!r}: {exc.strerror or exc}") from None
        value = text[0].strip() if text else ""
        where = f"secret file {str(path)!r}"
    else:
        value = os.environ.get(SECRET_ENV, "").strip()
        where = f"${SECRET_ENV}"
    if not value:
        raise SecretError(
            f"no shared secret: set {SECRET_FILE_ENV} to a file holding one, or {SECRET_ENV} "
            "(the same secret for router, prefill connector and decode nodes; `tilert up` makes one itself)"
        )
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise SecretError(f"the {where} is shorter than {MIN_SECRET_BYTES} bytes")
    return value.encode()


def sign(secret: bytes, *parts: str | int) -> str:
    """Hex HMAC-SHA256 of ``parts`` (unit-separated, so ``("a", "bc")`` and ``("ab", "c")`` differ)."""
    msg = "\x1f".join(str(p) for p in parts).encode()
    return hmac.digest(secret, msg, "sha256").hex()  # OpenSSL's one-shot: no HMAC object on the request path


def verify(token: object, expected: str) -> bool:
    """True when ``token`` equals the ``expected`` token; constant-time, any non-string is False."""
    return isinstance(token, str) and hmac.compare_digest(token.encode(), expected.encode())


def node_api_token(secret: bytes) -> str:
    """The bearer token of the decode node's HTTP API (reserve, decode, release)."""
    return sign(secret, "tilert-node-api")


def claim_token(secret: bytes, transfer_id: str, host: str, ctrl_port: int) -> str:
    """Authorises the connector to ship ``transfer_id`` to ``host:ctrl_port``."""
    return sign(secret, "tilert-claim", transfer_id, host, ctrl_port)


def hello_token(secret: bytes, sender_id: str) -> str:
    """Authorises a prefill-side sender on a decode node's control port."""
    return sign(secret, "tilert-hello", sender_id)
