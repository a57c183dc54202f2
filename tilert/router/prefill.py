"""The prefill leg: one non-streaming ``max_tokens=1`` request to stock vLLM, carrying the TileRT claim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tilert.router.errors import RouterError, upstream_message
from tilert.router.validation import RequestPlan


@dataclass
class PrefillResult:
    """What the router needs from vLLM's answer."""

    raw: dict[str, Any]
    response_id: str
    created: int
    model: str
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    first_token_id: int
    prompt_tokens: int
    prompt_token_ids: list[int] | None


def _fail(message: str) -> RouterError:
    return RouterError(502, message, outcome="prefill_error")


async def run_prefill(
    client: httpx.AsyncClient,
    plan: RequestPlan,
    *,
    transfer_id: str,
    node_host: str,
    node_ctrl_port: int,
    request_id: str,
    api_key: str | None,
) -> PrefillResult:
    """POST the prefill; map vLLM 4xx to the same 4xx, 5xx and transport errors to 502."""
    kv = {"tilert_host": node_host, "tilert_ctrl_port": node_ctrl_port, "tilert_transfer_id": transfer_id}
    headers = {"content-type": "application/json", "x-request-id": request_id}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    try:
        resp = await client.post(plan.path, content=orjson.dumps(plan.prefill_body(kv)), headers=headers)
    except httpx.TimeoutException as exc:
        raise RouterError(504, f"prefill timed out: {type(exc).__name__}", outcome="prefill_timeout") from None
    except httpx.HTTPError as exc:
        raise _fail(f"prefill server unreachable: {type(exc).__name__}: {exc}") from None
    body = resp.content
    if 400 <= resp.status_code < 500:
        message = upstream_message(body, f"prefill rejected the request with HTTP {resp.status_code}")
        raise RouterError(
            resp.status_code,
            message,
            outcome="prefill_rejected",
            body=body if _is_json_object(body) else None,
        )
    if resp.status_code != 200:
        message = upstream_message(body, "")
        raise _fail(f"prefill failed with HTTP {resp.status_code}" + (f": {message}" if message else ""))
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise _fail("prefill returned a body that is not JSON") from None
    return parse_prefill_response(data, plan, transfer_id)


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(orjson.loads(body), dict)
    except orjson.JSONDecodeError:
        return False


def parse_prefill_response(data: Any, plan: RequestPlan, transfer_id: str) -> PrefillResult:
    if not isinstance(data, dict):
        raise _fail("prefill returned a JSON value that is not an object")
    kv = data.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("tilert_error"):
        raise _fail(f"the TileRT connector refused the claim: {kv['tilert_error']}")
    if not isinstance(kv, dict) or "tilert_first_token_id" not in kv:
        raise _fail(
            "prefill response has no TileRT kv_transfer_params: the TileRT connector is not loaded in vLLM "
            "or did not claim the request (check --kv-transfer-config)"
        )
    if kv.get("tilert_transfer_id") not in (None, transfer_id):
        raise _fail(f"prefill answered for transfer {kv.get('tilert_transfer_id')!r}, expected {transfer_id!r}")
    first = kv.get("tilert_first_token_id")
    if isinstance(first, bool) or not isinstance(first, int):
        raise _fail(f"prefill kv_transfer_params.tilert_first_token_id is not an int: {first!r}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise _fail("prefill response has no choices")
    choice = choices[0]
    if plan.route == "chat":
        message = choice.get("message") or {}
        text = message.get("content") if isinstance(message, dict) else None
    else:
        text = choice.get("text")
    usage_raw = data.get("usage")
    usage: dict[str, Any] = usage_raw if isinstance(usage_raw, dict) else {}
    prompt_tokens = kv.get("tilert_prompt_tokens")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        prompt_tokens = usage.get("prompt_tokens")
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
        raise _fail("prefill response carries no prompt token count")
    token_ids = choice.get("token_ids")
    if isinstance(token_ids, list) and token_ids and token_ids[0] != first:
        raise _fail(f"prefill token_ids[0]={token_ids[0]} disagrees with tilert_first_token_id={first}")
    prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length", None):
        raise _fail(f"prefill ended with finish_reason={finish!r}")
    return PrefillResult(
        raw=data,
        response_id=str(data.get("id") or ""),
        created=int(data.get("created") or 0),
        model=str(data.get("model") or ""),
        text=text if isinstance(text, str) else "",
        finish_reason=finish,
        stop_reason=choice.get("stop_reason"),
        first_token_id=first,
        prompt_tokens=prompt_tokens,
        prompt_token_ids=prompt_ids if isinstance(prompt_ids, list) else None,
    )
