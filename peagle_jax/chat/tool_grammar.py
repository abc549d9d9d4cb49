"""Forced tool calls (``tool_choice`` ``required`` or a named function) as grammars in the model's own call
syntax, for llguidance (:mod:`peagle_jax.grammar`).

The grammar starts at the first generated token: no preamble, reasoning or whitespace is allowed before the
call, and the arguments are JSON laid out as ``json.dumps`` writes it (:data:`peagle_jax.grammar.JSON_LAYOUT`),
validated against the tool's parameters schema as they are generated. So a forced call always parses, its
arguments always validate, and its markup is fixed text that grammar-aware drafting proposes for free.
Only the values a schema leaves open (strings, numbers) are the model's choice.

The syntaxes, by tool parser name (:mod:`peagle_jax.chat.parsers`, :mod:`peagle_jax.chat.harmony`):

- ``hermes`` (Qwen3): ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``, calls joined by a
  newline;
- ``llama3_json`` (Llama 3.1): ``{"name": "NAME", "parameters": ARGS}``, calls joined by ``; ``;
- ``qwen3_coder``: ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n`` per parameter,
  then ``</function>\\n</tool_call>``; the parameters in the schema's order (required ones always, optional
  ones may be left out), strings raw (any text without ``</p``, up to a
  ``maxLength``; an enum's strings as given), other values as
  JSON;
- ``openai`` (GPT-OSS harmony): ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGS<|call|>``,
  one call (``<|call|>`` ends the turn).
"""

from __future__ import annotations

import json

from peagle_jax.grammar import JSON_LAYOUT

SYNTAXES = ("hermes", "llama3_json", "qwen3_coder", "openai")
# A Qwen3-Coder string value: any text without "</p" (so it cannot contain "</parameter>"), then the end of
# the parameter, in one lexeme (it cannot end early or late: its body never contains the end's "</p"). With a
# maxLength, at most that many pieces (a character, or "<" and one or two more).
_CODER_PIECE = r"(?s:[^<]|<[^\/]|<\/[^p])"


def _coder_string(max_length, rules: list[str]) -> str:
    """The terminal of a raw string value (added to ``rules`` once per bound)."""
    name = "CODER_STRING" if max_length is None else f"CODER_STRING_{int(max_length)}"
    count = "*" if max_length is None else f"{{0,{int(max_length)}}}"
    rule = f"{name}: /{_CODER_PIECE}{count}\\n<\\/parameter>\\n/"
    if rule not in rules:
        rules.append(rule)
    return name


def _schema(tool: dict) -> dict:
    params = tool["function"].get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {**params, "x-guidance": {**params.get("x-guidance", {}), **JSON_LAYOUT}}


def _lit(text: str) -> str:
    return json.dumps(text)


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps(schema)


def _coder_params(name: str, schema: dict, rules: list[str]) -> str:
    """The parameter lines of a Qwen3-Coder call, as a lark expression (rules added to ``rules``)."""
    props = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    parts = []
    for i, (param, sub) in enumerate(props.items()):
        open_ = _lit(f"<parameter={param}>\n")
        enum = sub.get("enum") if isinstance(sub, dict) else None
        if enum and all(isinstance(v, str) for v in enum):  # raw strings, one of the given ones
            rule = f'{open_} ({" | ".join(_lit(v) for v in enum)}) "\\n</parameter>\\n"'
        elif isinstance(sub, dict) and sub.get("type") == "string":
            rule = f"{open_} {_coder_string(sub.get('maxLength'), rules)}"
        else:
            value = f"v_{name}_{i}"
            typed = {**(sub if isinstance(sub, dict) else {}), "x-guidance": JSON_LAYOUT}
            rules.append(f"{value}: {_json_rule(typed)}")
            rule = f'{open_} {value} "\\n</parameter>\\n"'
        parts.append(f"({rule})" if param in required else f"({rule})?")
    return " ".join(parts) if parts else '""'


def _call(syntax: str, tool: dict, index: int, rules: list[str]) -> str:
    """One call of ``tool`` as a lark expression (the rules it needs added to ``rules``)."""
    name = tool["function"]["name"]
    schema = _schema(tool)
    if syntax == "qwen3_coder":
        body = _coder_params(f"t{index}", schema, rules)
        return " ".join([_lit(f"<tool_call>\n<function={name}>\n"), body, _lit("</function>\n</tool_call>")])
    args = f"args_{index}"
    rules.append(f"{args}: {_json_rule(schema)}")
    quoted = json.dumps(name)
    if syntax == "hermes":
        head, tail = '<tool_call>\n{"name": ' + quoted + ', "arguments": ', "}\n</tool_call>"
        return " ".join([_lit(head), args, _lit(tail)])
    if syntax == "llama3_json":
        return " ".join([_lit('{"name": ' + quoted + ', "parameters": '), args, _lit("}")])
    if syntax == "openai":
        head = _lit(f"commentary to=functions.{name} ")
        return f'<|channel|> {head} <|constrain|> "json" <|message|> {args} <|call|>'
    raise ValueError(f"no forced-call grammar for the tool syntax {syntax!r}; known: {', '.join(SYNTAXES)}")


# What joins several calls of one turn (a syntax missing here makes one call per turn).
JOINERS = {"hermes": "\n", "llama3_json": "; ", "qwen3_coder": "\n"}


def forced_call_grammar(syntax: str, tools: list[dict], name: str | None, *, parallel: bool = True) -> str:
    """The lark grammar (llguidance's dialect) of a forced answer: one call of the tool ``name`` (a named
    ``tool_choice``), or with ``name`` None (``required``) a call of any of ``tools``, then, with ``parallel``
    and a syntax that allows several calls per turn, optionally more. ``tools`` are OpenAI function tools."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    rules: list[str] = []
    calls = [_call(syntax, t, i, rules) for i, t in enumerate(chosen)]
    more = name is None and parallel and syntax in JOINERS
    start = "start: call" + (f" ({_lit(JOINERS[syntax])} call)*" if more else "")
    lines = [start, "call: " + " | ".join(f"({c})" for c in calls), *rules]
    return "\n".join(lines) + "\n"
