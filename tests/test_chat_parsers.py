"""The text-level output parsers (:mod:`peagle_jax.chat.parsers`): scripted answers for each syntax, each fed
whole, one character at a time and at random split points, with one invariant checked on every run: the
deltas add up to the result, and the result does not depend on the chunking."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from peagle_jax.chat.output import Parsed, ToolCall
from peagle_jax.chat.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    Qwen3CoderToolParser,
    partial_suffix,
    text_parser,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "scale": {"type": "number"},
                    "alerts": {"type": "boolean"},
                    "units": {"type": ["string", "null"]},
                    "limit": {"type": ["integer", "null"]},
                    "where": {"type": "object"},
                    "tags": {"type": "array"},
                    "code": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def counter():
    """Deterministic call ids, fresh per parser, so that every chunking gives the same ids."""
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def make(reasoning, tool, *, in_reasoning=False):
    return lambda: text_parser(reasoning, tool, TOOLS, in_reasoning=in_reasoning, new_id=counter())


def chunkings(text: str, seeds: int = 5):
    """Whole, one character at a time, and random split points (empty chunks included)."""
    yield [text]
    yield list(text)
    for seed in range(seeds):
        rng = random.Random(seed)
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def run(factory, chunks: list[str], final_alone: bool) -> Parsed:
    """Feed ``chunks`` (the last one final, or an empty final chunk after them) and check that the deltas add
    up to the result: content to content, reasoning to reasoning, and per call index, a first piece with id
    and name (and later ones without) whose arguments pieces concatenate to the call's arguments."""
    parser = factory()
    deltas = [parser.feed(c, [], final=not final_alone and i == len(chunks) - 1) for i, c in enumerate(chunks)]
    if final_alone:
        deltas.append(parser.feed("", [], final=True))
    result = parser.result()
    assert "".join(d.content for d in deltas) == (result.content or "")
    assert "".join(d.reasoning for d in deltas) == (result.reasoning or "")
    assert result.content is None or result.content.strip() == result.content != ""
    assert result.reasoning is None or result.reasoning.strip() == result.reasoning != ""
    calls: list[ToolCall] = []
    for delta in deltas:
        indices = [piece.index for piece in delta.tool_calls]
        assert len(set(indices)) == len(indices)
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                assert piece.id is not None and piece.name is not None
                calls.append(ToolCall(piece.id, piece.name, ""))
            else:
                assert piece.index == len(calls) - 1 and piece.id is None and piece.name is None
            calls[piece.index].arguments += piece.arguments
    assert calls == result.tool_calls
    return result


def check(factory, text: str, seeds: int = 5) -> Parsed:
    """The result of ``text`` under every chunking, checked to be the same for all."""
    results = [run(factory, chunks, k % 2 == 1) for k, chunks in enumerate(chunkings(text, seeds))]
    for result in results[1:]:
        assert result == results[0]
    return results[0]


def calls(*pairs) -> list[ToolCall]:
    return [ToolCall(f"call_{i}", name, arguments) for i, (name, arguments) in enumerate(pairs)]


# A JSON object with nested objects and arrays, unicode, strings holding braces, quotes and escaped quotes.
HARD_ARGS = (
    '{"city": "Zürich \\"Altstadt\\" 東京", "query": "a {b} [c] } ] \\\\", '
    '"nested": {"deep": [1, {"x": "}"}, null, true], "empty": {}}, "n": -1.5e3}'
)


def test_hard_args_are_json():
    assert json.loads(HARD_ARGS)["nested"]["deep"][1] == {"x": "}"}


# ---------------------------------------------------------------------------------------------- hermes


HERMES = [
    (
        "Hello! 2 < 3, 5 > 4, <b>bold</b>, a <tool or <tool_call",
        Parsed("Hello! 2 < 3, 5 > 4, <b>bold</b>, a <tool or <tool_call", None, []),
    ),  # fmt: skip
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        Parsed(None, None, calls(("get_weather", '{"city": "Paris"}'))),
    ),
    (
        'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + HARD_ARGS + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        Parsed("Let me check both.", None, calls(("get_weather", HARD_ARGS), ("get_time", "{}"))),
    ),
    (  # arguments before the name, spelled "parameters"; a call without arguments
        '<tool_call>{"parameters": {"city": "Nice", "days": 2}, "name": "get_weather"}</tool_call>\n\n'
        '<tool_call>{"name": "get_time"}</tool_call>',
        Parsed(None, None, calls(("get_weather", '{"city": "Nice", "days": 2}'), ("get_time", "{}"))),
    ),
    (  # content after a call; arguments given as a JSON string
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>\n\nDone.',
        Parsed("Done.", None, calls(("get_time", '{"tz": "UTC"}'))),
    ),
    (  # not a call: released verbatim, and the real call after it is read
        'See <tool_call>not json</tool_call> and <tool_call>{"foo": 1}</tool_call>!\n'
        '<tool_call>{"name": "get_time", "arguments": {"a": "<tool_call>"}}</tool_call>',
        Parsed(
            'See <tool_call>not json</tool_call> and <tool_call>{"foo": 1}</tool_call>!',
            None,
            calls(("get_time", '{"a": "<tool_call>"}')),
        ),
    ),
    (  # a name that never completes
        '<tool_call>\n{"name": "get_wea',
        Parsed('<tool_call>\n{"name": "get_wea', None, []),
    ),
    (  # arguments cut off by the end: as far as they went
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\',
        Parsed(None, None, calls(("get_weather", '{"city": "Par\\'))),
    ),
    (  # unexpected text after the object ends the call; the text is content
        '<tool_call>{"name": "get_time", "arguments": {"a": 1}} oops</tool_call>',
        Parsed("oops</tool_call>", None, calls(("get_time", '{"a": 1}'))),
    ),
]


@pytest.mark.parametrize("text, expected", HERMES)
def test_hermes(text, expected):
    assert check(make(None, "hermes"), text) == expected


# ---------------------------------------------------------------------------------------------- qwen3


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QWEN3 = [
    (
        {},
        "<think>\nThe user wants 2+2 <= 4 </thinking>.\n\nSo: 4.\n</think>\n\nThe answer is **4**.",
        Parsed("The answer is **4**.", "The user wants 2+2 <= 4 </thinking>.\n\nSo: 4.", []),
    ),
    ({}, "<think>\n\n</think>\n\nHi", Parsed("Hi", None, [])),
    ({}, "Just an answer, no <think> here.", Parsed("Just an answer, no <think> here.", None, [])),
    ({}, "  <thi", Parsed("<thi", None, [])),
    ({}, "<think>\nCut off mid-thought\n\n", Parsed(None, "Cut off mid-thought", [])),
    ({"in_reasoning": True}, "The user greets me.\n</think>\n\nHello!", Parsed("Hello!", "The user greets me.", [])),
    ({"in_reasoning": True}, "Still thinking </thin", Parsed(None, "Still thinking </thin", [])),
    (
        {"tool": "hermes"},
        "<think>\nI should check the weather.\n</think>\n\n" + CALL,
        Parsed(None, "I should check the weather.", calls(("get_weather", '{"city": "Paris"}'))),
    ),
    (  # the call closes the thinking implicitly
        {"tool": "hermes"},
        "<think>\nLet me call the tool.\n\n" + CALL,
        Parsed(None, "Let me call the tool.", calls(("get_weather", '{"city": "Paris"}'))),
    ),
    (
        {"tool": "hermes", "in_reasoning": True},
        "Weather, then.\n" + CALL + "\n" + CALL,
        Parsed(
            None, "Weather, then.", calls(("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}'))
        ),
    ),
    (  # no tool parser: markup is content
        {},
        "<think>x</think>" + CALL,
        Parsed(CALL, "x", []),
    ),
]


@pytest.mark.parametrize("options, text, expected", QWEN3)
def test_qwen3(options, text, expected):
    factory = make("qwen3", options.get("tool"), in_reasoning=options.get("in_reasoning", False))
    assert check(factory, text) == expected


def test_no_parsers_is_trimmed_content():
    assert check(make(None, None), "\n  a <tool_call> b \n") == Parsed("a <tool_call> b", None, [])
    assert check(make(None, None), " \n ") == Parsed(None, None, [])


# ---------------------------------------------------------------------------------------------- qwen3_coder


def coder_call(name: str, *params: tuple[str, str], end: str = "</parameter>\n") -> str:
    body = "".join(f"<parameter={key}>\n{value}\n{end}" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


CODE = "\ndef f(x):\n    return x < 2 and '</param' != \"{\"\n"  # starts and ends with a newline of its own
TYPED = {
    "city": "Zürich",
    "days": 3,
    "scale": 2.5,
    "alerts": True,
    "units": None,
    "limit": None,
    "where": {"lat": 1, "tags": ["a", "}"]},
    "tags": [1, "x"],
    "code": CODE,
    "extra": 42,
    "note": "hello <b>",
}
QWEN3_CODER = [
    (
        coder_call("get_weather", ("city", "Paris"), ("days", "3")),
        Parsed(None, None, calls(("get_weather", '{"city": "Paris", "days": 3}'))),
    ),
    (
        coder_call(
            "get_weather",
            ("city", "Zürich"),
            ("days", " 3 "),
            ("scale", "2.5"),
            ("alerts", "True"),
            ("units", "null"),
            ("limit", "null"),
            ("where", '{"lat": 1, "tags": ["a", "}"]}'),
            ("tags", '[1, "x"]'),
            ("code", CODE),
            ("extra", "42"),
            ("note", "hello <b>"),
        ),
        Parsed(None, None, calls(("get_weather", json.dumps(TYPED, ensure_ascii=False)))),
    ),
    (  # values that do not parse as their type stay strings; a tool the request does not have
        coder_call("get_weather", ("days", "three"), ("scale", "nan"), ("where", "[1]"), ("alerts", "yes"))
        + coder_call("lookup", ("q", "Paris"), ("n", "[1, 2]")),
        Parsed(
            None,
            None,
            calls(
                ("get_weather", '{"days": "three", "scale": "nan", "where": "[1]", "alerts": "yes"}'),
                ("lookup", '{"q": "Paris", "n": [1, 2]}'),
            ),
        ),
    ),
    (
        "I'll check the time, then the weather.\n\n"
        + coder_call("get_time")
        + "\n"
        + coder_call("get_weather", ("city", "Paris"), end="")  # no </parameter> before </function>
        + "\nAll done.",
        Parsed(
            "I'll check the time, then the weather.\nAll done.",  # the whitespace before a call is dropped
            None,
            calls(("get_time", "{}"), ("get_weather", '{"city": "Paris"}')),
        ),
    ),
    (
        "<tool_call>\nhello</tool_call> <tool_call>\n<function=bad name\n>",
        Parsed("<tool_call>\nhello</tool_call> <tool_call>\n<function=bad name\n>", None, []),
    ),
    ("<tool_call>\n<function=get_wea", Parsed("<tool_call>\n<function=get_wea", None, [])),
    (  # cut off: the parameters completed so far, no closing brace
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
        Parsed(None, None, calls(("get_weather", '{"city": "Paris"'))),
    ),
    (  # unexpected text between parameters ends the call
        "<tool_call>\n<function=get_time>\noops\n</function>\n</tool_call>",
        Parsed("oops\n</function>\n</tool_call>", None, calls(("get_time", "{}"))),
    ),
]


@pytest.mark.parametrize("text, expected", QWEN3_CODER)
def test_qwen3_coder(text, expected):
    assert check(make(None, "qwen3_coder"), text) == expected


def test_qwen3_coder_after_reasoning():
    text = "<think>\nThe time first.\n" + coder_call("get_time") + coder_call("get_weather", ("days", "2"))
    expected = Parsed(None, "The time first.", calls(("get_time", "{}"), ("get_weather", '{"days": 2}')))
    assert check(make("qwen3", "qwen3_coder"), text) == expected


# ---------------------------------------------------------------------------------------------- llama3_json


LLAMA3_JSON = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        Parsed(None, None, calls(("get_weather", '{"city": "Paris"}'))),
    ),
    (
        ' \n{"name": "get_weather", "parameters": ' + HARD_ARGS + '} ;\n{"arguments": {}, "name": "get_time"}',
        Parsed(None, None, calls(("get_weather", HARD_ARGS), ("get_time", "{}"))),
    ),
    ("The weather is {nice}; <tool_call>", Parsed("The weather is {nice}; <tool_call>", None, [])),
    ('{"result": 42, "name": "x"}', Parsed('{"result": 42, "name": "x"}', None, [])),
    (
        '{"name": "get_time", "parameters": {}}; {"name": 3}',
        Parsed('; {"name": 3}', None, calls(("get_time", "{}"))),
    ),
    (
        '{"name": "get_time", "parameters": {}}\nThat is all.',
        Parsed("That is all.", None, calls(("get_time", "{}"))),
    ),
]


@pytest.mark.parametrize("text, expected", LLAMA3_JSON)
def test_llama3_json(text, expected):
    assert check(make(None, "llama3_json"), text) == expected


# ---------------------------------------------------------------------------------------------- truncation


SINGLE_CALLS = [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + HARD_ARGS + "}\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Nice"}, "name": "get_weather"}\n</tool_call>'),
    ("qwen3_coder", "Sure.\n" + coder_call("get_weather", ("city", "Zürich"), ("days", "3"), ("code", CODE))),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + HARD_ARGS + "}"),
]


@pytest.mark.parametrize("tool, text", SINGLE_CALLS)
def test_truncated_call(tool, text):
    """Cut at every character: before the name is complete the text is content; after, it is the call with a
    prefix of its arguments."""
    full = check(make(None, tool), text)
    assert len(full.tool_calls) == 1
    for end in range(len(text)):
        prefix = text[:end]
        result = check(make(None, tool), prefix, seeds=1)
        if result.tool_calls:
            [call] = result.tool_calls
            assert call.name == "get_weather" and full.tool_calls[0].arguments.startswith(call.arguments)
            assert full.content is None or result.content == full.content
        else:
            assert result.content == (prefix.strip() or None)


def test_truncated_reasoning_and_calls():
    """Several calls after reasoning, cut at every character: nothing raises, the invariant holds."""
    text = "<think>\nTwo calls.\n</think>\n\nOK.\n" + CALL + "\n" + CALL
    for end in range(len(text)):
        check(make("qwen3", "hermes"), text[:end], seeds=1)


# ---------------------------------------------------------------------------------------------- fuzz


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<function=f>", "<parameter=a>", "</parameter>",
    "</function>", '{"name": "f"', '"arguments"', ": ", "{", "}", "[", '"', "\\", ",", ";", "\n", " ", "x", "é",
    "<", "</", "1",
]  # fmt: skip


CONFIGS = [(None, "hermes"), ("qwen3", "hermes"), ("qwen3", "qwen3_coder"), (None, "llama3_json")]


@pytest.mark.parametrize("reasoning, tool", CONFIGS)
def test_fuzz(reasoning, tool):
    """Random markup soup: no exception, and the invariant holds for every chunking."""
    rng = random.Random(f"{reasoning}{tool}")
    for _ in range(60):
        text = "".join(rng.choices(FRAGMENTS, k=rng.randint(1, 30)))
        check(make(reasoning, tool), text, seeds=2)


# ---------------------------------------------------------------------------------------------- API


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "llama3_json"}
    assert set(REASONING_PARSERS) == {"qwen3"}
    assert HermesToolParser.start == Qwen3CoderToolParser.start == "<tool_call>"
    assert Llama3JsonToolParser.start == "{" and not Llama3JsonToolParser.start_anywhere
    with pytest.raises(ValueError, match="unknown parser"):
        text_parser(None, "mistral", None)
    with pytest.raises(ValueError, match="unknown parser"):
        text_parser("deepseek_r1", None, None)


def test_default_ids_and_end():
    parser = text_parser(None, "hermes", TOOLS)
    parser.feed('<tool_call>{"name": "get_time"}</tool_call>', [], final=True)
    [call] = parser.result().tool_calls
    assert call.id.startswith("call_") and len(call.id) == 29
    assert not parser.feed("", [], final=True)
    with pytest.raises(ValueError):
        parser.feed("more", [])


def test_partial_suffix():
    assert partial_suffix("abc <tool", "<tool_call>") == 5
    assert partial_suffix("abc <tool_call>", "<tool_call>") == 0
    assert partial_suffix("a </th", "</think>", "<tool_call>") == 4
    assert partial_suffix("a <", "</think>", "<tool_call>") == 1
    assert partial_suffix("", "<x>") == 0
