"""OpenAI (and vLLM-extension) response shapes: SSE chunks, final JSON bodies, usage, errors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from tilert.router.logprobs import ChoiceExtras
from tilert.router.validation import Route

if TYPE_CHECKING:
    from tilert.router.tools import AnswerParser

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any] | None) -> bytes:
    """One server-sent event (none for None: a chunk with nothing to send)."""
    return b"" if obj is None else b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the client-facing objects of one request (id, created, model fixed once)."""

    def __init__(
        self,
        route: Route,
        response_id: str,
        created: int,
        model: str,
        return_token_ids: bool,
        extras: ChoiceExtras | None = None,
    ) -> None:
        self.route = route
        self.id = response_id
        self.created = created
        self.model = model
        self.return_token_ids = return_token_ids
        self.extras = extras  # the echoed prompt and the logprobs of a one-choice request (each chunk: its tokens')
        self._role_sent: set[int] = set()  # the choices whose first chunk went out (it carries the role)
        self.parsing: AnswerParser | None = None  # vLLM's tool / reasoning parser over a chat answer, if it has one

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        usage_now: dict[str, int] | None = None,
        index: int = 0,
    ) -> dict[str, Any] | None:
        """The chunk of one delta of choice ``index``; None: nothing to send now (vLLM's parser holds the text
        back)."""
        if self.route == "chat":
            delta = self._chat_delta(text, token_ids, finish_reason, index)
            if delta is None:
                return None
            if finish_reason is not None and self.parsing is not None:
                finish_reason = self.parsing.finish_reason(finish_reason)
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("chat.completion.chunk")
        else:
            echo = self.extras.take_echo() if self.extras is not None else ""
            choice = {"index": index, "text": echo + text, "logprobs": None, "finish_reason": finish_reason}
            out = self._head("text_completion")
        if self.extras is not None:
            choice["logprobs"] = self.extras.chunk_logprobs()
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        out["choices"] = [choice]
        if usage_now is not None:
            out["usage"] = usage_now
        return out

    def _chat_delta(
        self, text: str, token_ids: list[int], finish_reason: str | None, index: int
    ) -> dict[str, Any] | None:
        sent = index in self._role_sent  # the choice's first chunk carries the role
        if self.parsing is None:
            delta: dict[str, Any] | None = {"content": text} if text or finish_reason is None else {}
        else:
            delta = self.parsing.delta(text, token_ids, finish_reason)
            if delta is None and sent and finish_reason is None and not self.return_token_ids:
                return None
            delta = (delta or {}) if sent else (delta or {"content": ""})
        if not sent:
            self._role_sent.add(index)
            return {"role": "assistant", **(delta or {})}
        return delta

    def usage_chunk(self, usage_all: dict[str, Any]) -> dict[str, Any]:
        out = self._head("chat.completion.chunk" if self.route == "chat" else "text_completion")
        out["choices"] = []
        out["usage"] = usage_all if self.parsing is None else self.parsing.usage(usage_all)
        return out

    def final(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        stop_reason: str | int | None,
        usage_all: dict[str, Any],
        prompt_token_ids: list[int] | None,
        index: int = 0,
    ) -> dict[str, Any]:
        """The whole answer of one choice (``index``); :func:`with_choices` joins several."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        if self.parsing is not None:
            message, finish_reason = self.parsing.message(text, token_ids, finish_reason)
            usage_all = self.parsing.usage(usage_all)
        if self.route == "chat":
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            out = self._head("chat.completion")
        else:
            choice = {
                "index": index,
                "text": (self.extras.echo if self.extras is not None else "") + text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
            out = self._head("text_completion")
        if self.extras is not None:
            self.extras.complete(out, choice)
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            if self.route == "completions":
                choice["prompt_token_ids"] = prompt_token_ids
        out["choices"] = [choice]
        out["usage"] = usage_all
        if self.return_token_ids and self.route == "chat":
            out["prompt_token_ids"] = prompt_token_ids
        return out


def with_choices(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer of several choices, from each choice's own (:meth:`ResponseShape.final`, in index order): the
    first's, holding every choice (their usage is the first's, which counts them all)."""
    out = answers[0]
    out["choices"] = [answer["choices"][0] for answer in answers]
    return out


def models_list(model: str, created: int, root: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "tilert",
                "root": root,
                "parent": None,
            }
        ],
    }
