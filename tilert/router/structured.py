"""A request's structured-output constraint (``response_format``, ``structured_outputs``) as the grammar the decode
node compiles, following vLLM: ``response_format`` overrides ``structured_outputs``; ``json_object`` is any JSON
object, ``json_schema`` its ``schema``; exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
``json_object`` in ``structured_outputs``; a ``choice`` becomes vLLM's EBNF grammar of the alternatives. The JSON
schema travels as Python's ``json.dumps`` of it, the text vLLM compiles. What the node does not compile
(structural tags, per-request whitespace options) is refused with the field named.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from tilert import contracts as c
from tilert.router.errors import RouterError, bad_request, unsupported

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# structured_outputs options with the value the node's compiler assumes (vLLM's defaults).
_FIXED = {"disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None}
_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def grammar_of(
    response_format: dict[str, msgspec.Raw] | None, outputs: dict[str, msgspec.Raw] | None
) -> c.Grammar | None:
    """The request's grammar (None: unconstrained); :class:`RouterError` 400 naming the field otherwise."""
    fmt = _loads(response_format, "response_format")
    if fmt is not None and fmt.get("type") != "text":
        return _from_response_format(fmt)
    so = _loads(outputs, "structured_outputs")
    if not so:
        return None
    for key, value in so.items():
        if key in _FIXED and value != _FIXED[key]:
            raise unsupported(f"structured_outputs.{key}", "the decode path compiles with vLLM's defaults")
        if key not in _FIXED and key not in _KINDS:
            raise unsupported(f"structured_outputs.{key}", "not served on the decode path")
    given = [k for k in _KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad_request(
            f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got {given}", "structured_outputs"
        )
    kind, value = given[0], so[given[0]]
    if kind == "json":
        return _json(value, "structured_outputs")
    if kind == "json_object":
        return c.Grammar("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise bad_request("structured_outputs.choice must be a non-empty list of strings", "structured_outputs")
        return capped(c.Grammar("grammar", choice_as_grammar(value)))
    if not isinstance(value, str) or not value or (kind == "regex" and "\x00" in value):
        raise bad_request(f"structured_outputs.{kind} must be a non-empty string without NUL", "structured_outputs")
    return capped(c.Grammar("regex" if kind == "regex" else "grammar", value))


def _from_response_format(fmt: dict[str, Any]) -> c.Grammar:
    kind = fmt.get("type")
    if kind == "json_object":
        return c.Grammar("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                "response_format",
            )
        return _json(spec.get("schema", {}), "response_format")
    if kind == "structural_tag":
        raise unsupported("response_format", "structural tags are not served on the decode path")
    raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}", "response_format")


def choice_as_grammar(choice: list[str]) -> str:
    """vLLM's EBNF grammar of a ``choice`` list: its alternatives as escaped literals."""

    def escape(ch: str) -> str:
        if ch in _ESCAPES:
            return _ESCAPES[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(escape(ch) for ch in option) + '"' for option in choice)


def _loads(obj: dict[str, msgspec.Raw] | None, field: str) -> dict[str, Any] | None:
    if obj is None:
        return None
    try:
        return {key: json.loads(bytes(raw)) for key, raw in obj.items()}
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field) from None


def _json(schema: Any, field: str) -> c.Grammar:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request("Invalid JSON grammar specification.", field) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request("a JSON schema must be an object", field)
    return capped(c.Grammar("json", json.dumps(schema)))


def capped(grammar: c.Grammar) -> c.Grammar:
    """``grammar``, or a 413 when it is longer than a grammar may be."""
    if len(grammar.spec) > c.MAX_GRAMMAR_CHARS:
        raise RouterError(
            413, f"the grammar is {len(grammar.spec)} characters, over {c.MAX_GRAMMAR_CHARS}", outcome="too_large"
        )
    return grammar
