"""An OpenAI chat conversation rendered as GPT-OSS's harmony prompt (text with the special tokens written out).

Harmony messages read ``<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ <|constrain|>TYPE]<|message|>TEXT<|end|>``
(an assistant's message to a tool ends ``<|call|>``). The mapping from the OpenAI messages is vLLM's for GPT-OSS:

- one system message from harmony's defaults (model identity, knowledge cutoff, date, ``Reasoning: EFFORT``, the
  valid channels, and the line routing calls to ``functions`` when there are function tools);
- one developer message holding the OpenAI system and developer texts (``# Instructions``) and the function
  tools (``# Tools``, TypeScript-like), left out when there are neither;
- an assistant turn as ``analysis`` (its reasoning), then ``commentary`` (its content when it also calls tools:
  the preamble the model wrote before the calls), the calls (``commentary`` to ``functions.NAME``, JSON), or
  ``final`` (its content when it calls nothing); a tool result as a ``commentary`` message from
  ``functions.NAME`` to ``assistant``.

Analysis is dropped as openai-harmony's ``render_conversation_for_completion`` drops it by default: only when the
last assistant message is a ``final`` one, and then only the analysis before the *first* ``final`` message (the
analysis of later turns stays, and so does all of it while the model is in the middle of a tool-call chain).
The rendered text equals harmony's rendering token for token when encoded with the special tokens allowed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from peagle_jax.errors import UserError

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
START_ID, END_ID, MESSAGE_ID, CHANNEL_ID, CONSTRAIN_ID = 200006, 200007, 200008, 200005, 200003
RETURN_ID, CALL_ID = 200002, 200012
# <|return|> ends the answer, <|call|> ends it with a tool call: the generation's stop tokens
STOP_IDS = (RETURN_ID, CALL_ID)
# o200k's special tokens (harmony's, <|endoftext|>, the reserved ones) are the ids from here up
FIRST_SPECIAL_ID = 199998
SPECIAL_TEXT = {
    START_ID: START,
    END_ID: END,
    MESSAGE_ID: MESSAGE,
    CHANNEL_ID: CHANNEL,
    CONSTRAIN_ID: CONSTRAIN,
    RETURN_ID: RETURN,
    CALL_ID: CALL,
}

MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
CHANNELS = ("analysis", "commentary", "final")


@dataclasses.dataclass
class HarmonyMessage:
    """One harmony message: ``author`` is the role, or a tool's name for a tool's message."""

    author: str
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    def render(self) -> str:
        head = self.author + (f" to={self.recipient}" if self.recipient else "")
        head += f"{CHANNEL}{self.channel}" if self.channel else ""
        if self.content_type is not None:
            head += " " + self.content_type
        end = CALL if self.author == "assistant" and self.recipient else END
        return f"{START}{head}{MESSAGE}{self.text}{end}"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    conversation_start_date: str | None = None,
) -> str:
    """The harmony prompt of an OpenAI chat (``messages``, function ``tools``), ending with ``<|start|>assistant``
    for the answer. ``reasoning_effort``: low, medium (the default) or high; ``conversation_start_date``:
    YYYY-MM-DD, today by default. Bad input raises :class:`UserError`."""
    msgs = harmony_messages(messages, tools, reasoning_effort, conversation_start_date)
    return "".join(m.render() for m in drop_analysis(msgs)) + START + "assistant"


def harmony_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    reasoning_effort: str | None = None,
    conversation_start_date: str | None = None,
) -> list[HarmonyMessage]:
    """The harmony messages of an OpenAI chat, before analysis is dropped (see :func:`render_chat`)."""
    effort = "medium" if reasoning_effort is None else reasoning_effort
    if effort not in EFFORTS:
        raise UserError(f"reasoning_effort {reasoning_effort!r}: expected one of {', '.join(EFFORTS)}")
    date = conversation_start_date or datetime.date.today().isoformat()
    functions = [_function(t, i) for i, t in enumerate(tools or ())]
    instructions, turns, call_names = [], [], {}
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise UserError(f"messages[{i}]: expected an object, got {type(m).__name__}")
        role = m.get("role")
        if role in ("system", "developer"):
            if text := _text(m, i):
                instructions.append(text)
        elif role == "user":
            turns.append(HarmonyMessage("user", _text(m, i)))
        elif role == "assistant":
            turns += _assistant(m, i, call_names)
        elif role == "tool":
            cid = m.get("tool_call_id")
            if cid not in call_names:
                raise UserError(f"messages[{i}]: tool_call_id {cid!r} answers no earlier assistant tool call")
            turns.append(HarmonyMessage(f"functions.{call_names[cid]}", _text(m, i), "commentary", "assistant"))
        else:
            raise UserError(f"messages[{i}]: unknown role {role!r} (system, developer, user, assistant or tool)")
    out = [HarmonyMessage("system", _system_text(effort, date, bool(functions)))]
    sections = (["# Instructions", "\n\n".join(instructions)] if instructions else []) + (
        [tools_section("functions", functions)] if functions else []
    )
    if sections:
        out.append(HarmonyMessage("developer", "\n\n".join(sections)))
    return out + turns


def drop_analysis(msgs: Sequence[HarmonyMessage]) -> list[HarmonyMessage]:
    """openai-harmony's default (``auto_drop_analysis``): when the last assistant message is on the ``final``
    channel, the analysis messages before the first ``final`` message are left out."""
    last = next((m for m in reversed(msgs) if m.author == "assistant"), None)
    if last is None or last.channel != "final":
        return list(msgs)
    first = next(i for i, m in enumerate(msgs) if m.channel == "final")
    return [m for i, m in enumerate(msgs) if i >= first or m.channel != "analysis"]


def _system_text(effort: str, date: str, has_functions: bool) -> str:
    channels = f"# Valid channels: {', '.join(CHANNELS)}. Channel must be included for every message."
    if has_functions:
        channels += "\nCalls to these tools must go to the commentary channel: 'functions'."
    top = f"{MODEL_IDENTITY}\nKnowledge cutoff: {KNOWLEDGE_CUTOFF}\nCurrent date: {date}"
    return f"{top}\n\nReasoning: {effort}\n\n{channels}"


def _text(m: Mapping[str, Any], i: int) -> str:
    """A message's content as text: a string, a list of text parts (joined), or nothing (empty)."""
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise UserError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are read")
            parts.append(part["text"])
        return "".join(parts)
    raise UserError(f"messages[{i}].content: expected text or a list of text parts, got {type(content).__name__}")


def _assistant(m: Mapping[str, Any], i: int, call_names: dict[str, str]) -> list[HarmonyMessage]:
    """An assistant turn's messages; records its calls' names by id in ``call_names``."""
    out = []
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise UserError(f"messages[{i}].reasoning: expected text, got {type(reasoning).__name__}")
    if reasoning:
        out.append(HarmonyMessage("assistant", reasoning, "analysis"))
    content, calls = _text(m, i), m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise UserError(f"messages[{i}].tool_calls: expected a list, got {type(calls).__name__}")
    if content:
        out.append(HarmonyMessage("assistant", content, "commentary" if calls else "final"))
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or call.get("type", "function") != "function":
            raise UserError(f"{where}: expected {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
        name, args = fn.get("name"), fn.get("arguments")
        if not isinstance(name, str) or not name:
            raise UserError(f"{where}.function.name: expected a function name, got {name!r}")
        if args is None:
            args = ""
        elif not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        if isinstance(call.get("id"), str):
            call_names[call["id"]] = name
        out.append(HarmonyMessage("assistant", args, "commentary", f"functions.{name}", f"{CONSTRAIN}json"))
    return out


def _function(tool: Any, i: int) -> tuple[str, str, Any]:
    """A function tool's (name, description, parameters schema or None)."""
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or tool.get("type") != "function":
        raise UserError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', ...}}}}")
    name, description = fn.get("name"), fn.get("description") or ""
    if not isinstance(name, str) or not name:
        raise UserError(f"tools[{i}].function.name: expected a function name, got {name!r}")
    if not isinstance(description, str):
        raise UserError(f"tools[{i}].function.description: expected text, got {type(description).__name__}")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise UserError(f"tools[{i}].function.parameters: expected a JSON schema object")
    return name, description, params


def tools_section(namespace: str, functions: Sequence[tuple[str, str, Any]]) -> str:
    """The ``# Tools`` section declaring ``functions`` ((name, description, parameters) triples) in a
    TypeScript-like ``namespace``, as harmony writes it."""
    parts = [f"## {namespace}\n", f"namespace {namespace} {{\n"]
    for name, description, params in functions:
        parts += [f"// {line}" for line in _lines(description)]
        args = "" if params is None else f"_: {schema_type(params, '')}"
        parts.append(f"type {name} = ({args}) => any;\n")
    parts.append(f"}} // namespace {namespace}")
    return "# Tools\n\n" + "\n".join(parts)


def _lines(text: str) -> list[str]:
    """Rust's ``str::lines``: split at newlines, no empty last line, a ``\\r`` before a newline dropped."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _get(schema: Any, key: str) -> Any:
    return schema.get(key) if isinstance(schema, Mapping) else None


def _has(schema: Any, key: str) -> bool:
    return isinstance(schema, Mapping) and key in schema


def _json(value: Any) -> str:
    """JSON as serde_json writes it (compact, non-ASCII as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _is_enum(schema: Any) -> bool:
    return isinstance(_get(schema, "enum"), list) and bool(schema["enum"])


def _default(schema: Any, quote_enum: bool) -> str:
    """``default: VALUE``: a string default is quoted as is, or (an enum's) bare or as JSON (``quote_enum``)."""
    value = schema["default"]
    if isinstance(value, str) and not _is_enum(schema):
        return f'default: "{value}"'
    if isinstance(value, str) and not quote_enum:
        return f"default: {value}"
    return f"default: {_json(value)}"


def _nullable(schema: Any, text: str) -> str:
    return text + " | null" if _get(schema, "nullable") is True and "null" not in text else text


def schema_type(schema: Any, indent: str) -> str:
    """A JSON schema as harmony's TypeScript-like type (objects with a comment per property, ``?`` for the
    optional ones, enums as unions of string literals, ``oneOf`` as a union of variants)."""
    one_of = _get(schema, "oneOf")
    if isinstance(one_of, list):
        out = ""
        for variant in one_of:
            out += f"\n{indent} | " + _nullable(variant, schema_type(variant, indent + "   "))
            notes = [d] if isinstance(d := _get(variant, "description"), str) else []
            if _has(variant, "default"):
                notes.append(_default(variant, quote_enum=True))
            out += f" // {' '.join(notes)}" if notes else ""
        return out
    kind = _get(schema, "type")
    if isinstance(kind, list):
        names = ["number" if k == "integer" else k for k in kind if isinstance(k, str)]
        return " | ".join(names) if names else "any"
    if kind == "object":
        return _object_type(schema, indent)
    if kind == "string":
        enum = _get(schema, "enum")
        values = [f'"{v}"' for v in enum if isinstance(v, str)] if isinstance(enum, list) else []
        return " | ".join(values) if values else "string"
    if kind == "array":
        return schema_type(schema["items"], indent) + "[]" if _has(schema, "items") else "Array<any>"
    return {"number": "number", "integer": "number", "boolean": "boolean"}.get(kind, "any")


def _object_type(schema: Mapping[str, Any], indent: str) -> str:
    out = f"{indent}// {d}\n" if isinstance(d := schema.get("description"), str) else ""
    out += "{\n"
    props = schema.get("properties")
    required = schema.get("required")
    required = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    for key, val in props.items() if isinstance(props, Mapping) else ():
        mark = "" if key in required else "?"
        if isinstance(title := _get(val, "title"), str):
            out += f"{indent}// {title}\n{indent}//\n"
        if not _has(val, "oneOf") and isinstance(d := _get(val, "description"), str):
            out += f"{indent}// {d}\n"
        if isinstance(examples := _get(val, "examples"), list) and examples:
            out += f"{indent}// Examples:\n" + "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
        if isinstance(one_of := _get(val, "oneOf"), list):
            out += _property_union(key + mark, val, one_of, indent)
            continue
        out += f"{indent}{key}{mark}: " + _nullable(val, schema_type(val, indent + "    ")) + ","
        if _has(val, "default"):
            out += " // " + _default(val, quote_enum=False)
        out += "\n"
    return out + f"{indent}}}"


def _property_union(name: str, val: Mapping[str, Any], one_of: list, indent: str) -> str:
    """A property whose schema is a ``oneOf``: its comments above it, then one ``| VARIANT`` line per variant."""
    desc = val.get("description") if isinstance(val.get("description"), str) else None
    first_desc = _get(one_of[0], "description") if one_of else None
    desc_above = desc is not None and first_desc != desc
    out = f"{indent}// {desc}\n" if desc_above else ""
    if "default" in val:
        out += f"{indent}// {_default(val, quote_enum=False)}\n"
    out += f"{indent}{name}:\n"
    for i, variant in enumerate(one_of):
        out += f"{indent} | " + _nullable(variant, schema_type(variant, indent + "   "))
        vdesc = _get(variant, "description")
        notes = [vdesc] if isinstance(vdesc, str) and vdesc != desc and not (i == 0 and desc_above) else []
        if _has(variant, "default"):
            notes.append(_default(variant, quote_enum=False))
        out += (f" // {' '.join(notes)}" if notes else "") + "\n"
    return out + f"{indent},\n"
