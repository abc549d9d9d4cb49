"""Qwen3-Coder's parameter values: raw text between tags, typed by the tool's JSON schema."""

from __future__ import annotations

import json
import math
import re

_INTEGER = re.compile(r"[-+]?\d+")


def parameter_schemas(tools: list[dict], name: str) -> dict[str, dict] | None:
    """The schemas of tool ``name``'s parameters, by parameter name (None: the request has no such tool)."""
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return None


def typed_value(raw: str, schema: dict | None):
    """The value of a parameter written as ``raw`` (the text between ``<parameter=...>`` and its end tag).

    The one newline the model writes after the opening tag and the one before the closing tag are not part of
    the value. A string is the text as is; an integer, a number, a boolean, an object or an array is parsed
    (a value that does not parse as the type stays the string); ``null`` is None where the schema allows it
    (before any other type: ``["string", "null"]`` reads ``null`` as None). Several types (``anyOf`` too) are
    tried in order. A parameter the schema does not
    type (or does not know) is JSON if it parses as JSON, else the string.
    """
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    types = _types(schema) if isinstance(schema, dict) else []
    if not types:
        return _json(text.strip(), default=text)
    if "null" in types and text.strip() == "null":
        return None
    for kind in types:
        value = _as(kind, text)
        if value is not _NO:
            return value
    return text


_NO = object()  # a text that does not parse as a type


def _as(kind: str, text: str):
    stripped = text.strip()
    if kind == "string":
        return text
    if kind == "boolean":
        return {"true": True, "false": False}.get(stripped.lower(), _NO)
    if kind == "integer":
        return int(stripped) if _INTEGER.fullmatch(stripped) else _NO
    if kind == "number":
        if _INTEGER.fullmatch(stripped):
            return int(stripped)
        try:
            number = float(stripped)
        except ValueError:
            return _NO
        return number if math.isfinite(number) else _NO
    if kind in ("object", "array"):
        value = _json(stripped, default=_NO)
        return value if isinstance(value, dict if kind == "object" else list) else _NO
    return _NO


def _types(schema: dict) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [k for option in schema[key] if isinstance(option, dict) for k in _types(option)]
    return []


def _reject(constant: str):
    raise ValueError(constant)  # NaN and Infinity are not JSON


def _json(text: str, default):
    try:
        return json.loads(text, parse_constant=_reject)
    except ValueError:
        return default
