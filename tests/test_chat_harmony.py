"""peagle_jax.chat.harmony against openai-harmony: the prompt rendered token for token as harmony renders the
same conversation, and the answer parsed as harmony's StreamableParser parses it, whatever the chunking."""

from __future__ import annotations

import copy
import datetime
import itertools
import os
import random
from pathlib import Path

import pytest

from peagle_jax.chat import harmony
from peagle_jax.chat.harmony import HarmonyParser, render_chat
from peagle_jax.chat.harmony_parse import MAX_HEADER_TOKENS
from peagle_jax.chat.output import Parsed, ToolCall
from peagle_jax.chat.vocab import tiktoken_dir
from peagle_jax.errors import UserError

DATE = "2025-06-28"


@pytest.fixture(scope="module")
def oh():
    """openai-harmony, its o200k vocabulary read offline."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(tiktoken_dir())
    import openai_harmony

    return openai_harmony


@pytest.fixture(scope="module")
def enc(oh):
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


# ---------------------------------------------------------------------------------------------------------------
# Rendering


def fn_tool(name, description="", parameters=None):
    out = {"type": "function", "function": {"name": name, "description": description}}
    if parameters is not None:
        out["function"]["parameters"] = parameters
    return out


WEATHER = fn_tool(
    "get_weather",
    "Get the current weather in a city.",
    {
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "The city, e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            "days": {"type": "integer", "description": "Forecast days", "default": 1},
        },
        "required": ["location"],
    },
)
SEARCH = fn_tool(
    "search_docs",
    "Search the documentation.\nReturns the best matches.",
    {
        "type": "object",
        "description": "The query",
        "properties": {
            "query": {"type": "string", "title": "Query", "examples": ["jax jit", "pytrees"]},
            "filters": {
                "type": "object",
                "properties": {
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["api", "guide"]}},
                    "since": {"type": ["string", "null"], "description": "A date"},
                    "deep": {"type": "object", "properties": {"level": {"type": "number"}}, "required": ["level"]},
                },
            },
            "limit": {"type": "integer", "nullable": True},
            "exact": {"type": "boolean", "default": False},
            "anything": {"description": "no type"},
            "list": {"type": "array"},
            "mode": {"type": "string", "enum": ["fast", "slow"], "default": "fast"},
            "target": {
                "description": "Where to look",
                "default": "all",
                "oneOf": [
                    {"type": "string", "description": "Where to look"},
                    {"type": "array", "items": {"type": "string"}, "description": "Several places"},
                    {"type": "integer", "nullable": True, "default": 3},
                ],
            },
            "shape": {
                "oneOf": [
                    {"type": "object", "properties": {"r": {"type": "number"}}, "description": "circle"},
                    {"type": "string", "enum": ["square"], "default": "square"},
                ]
            },
        },
        "required": ["query", "target"],
    },
)
NO_ARGS = fn_tool("get_time", "The time now.")
EMPTY_ARGS = fn_tool("ping", parameters={"type": "object", "properties": {}})
UNION_TOP = fn_tool(
    "pick", "Top-level union.", {"oneOf": [{"type": "string", "description": "a name"}, {"type": "integer"}]}
)


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL_TURN = [
    USER,
    {
        "role": "assistant",
        "content": None,
        "reasoning": "The user wants the weather. I'll call get_weather.",
        "tool_calls": [call("c1", "get_weather", '{"location": "Paris"}'), call("c2", "get_time", "{}")],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "c2", "content": "14:05"},
]
CONVERSATIONS = {
    "plain": ([USER], None),
    "system": ([{"role": "system", "content": "You are terse."}, USER], None),
    "system+developer": (
        [{"role": "system", "content": "You are terse."}, {"role": "developer", "content": "Answer in French."}, USER],
        None,
    ),
    "tools": ([USER], [WEATHER, NO_ARGS]),
    "tools+instructions": ([{"role": "developer", "content": "Use tools."}, USER], [WEATHER, SEARCH, NO_ARGS]),
    "schemas": ([USER], [SEARCH, EMPTY_ARGS, UNION_TOP, NO_ARGS]),
    "tool results": (CALL_TURN, [WEATHER, NO_ARGS]),
    "answer after tools": (
        [
            *CALL_TURN,
            {"role": "assistant", "reasoning": "It is clear.", "content": "It is 21 °C and clear at 14:05."},
            {"role": "user", "content": "Thanks! And tomorrow?"},
        ],
        [WEATHER, NO_ARGS],
    ),
    "reasoning before finals": (
        [
            USER,
            {"role": "assistant", "reasoning": "No tools; say so.", "content": "I cannot check."},
            {"role": "user", "content": "Guess then."},
            {"role": "assistant", "reasoning_content": "Paris in June: mild.", "content": "About 20 °C."},
            {"role": "user", "content": "Why?"},
        ],
        None,
    ),
    "reasoning before a call": (
        [
            USER,
            {"role": "assistant", "reasoning": "Ask for the city?", "content": "Which Paris?"},
            {"role": "user", "content": "France."},
            {
                "role": "assistant",
                "reasoning": "Now call the tool.",
                "content": "Let me check.",
                "tool_calls": [call("c9", "get_weather", '{"location": "Paris, FR"}')],
            },
            {"role": "tool", "tool_call_id": "c9", "content": "21"},
        ],
        [WEATHER],
    ),
    "parts and unicode": (
        [
            {"role": "user", "content": [{"type": "text", "text": "Bonjour 🌍, "}, {"type": "text", "text": "天气?"}]},
            {"role": "assistant", "content": "晴れ ☀️"},
            {"role": "user", "content": "ok"},
        ],
        None,
    ),
}


def reference(oh, messages, tools, effort, date):
    """The same conversation built with openai-harmony's own types (vLLM's mapping)."""
    system = oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort[effort.upper()])
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system.with_conversation_start_date(date))]
    texts = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    developer = oh.DeveloperContent.new()
    if texts:
        developer = developer.with_instructions("\n\n".join(texts))
    if tools:
        developer = developer.with_function_tools(
            [
                oh.ToolDescription.new(f["name"], f["description"], f.get("parameters"))
                for f in (t["function"] for t in tools)
            ]
        )
    if texts or tools:
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names = {}
    for m in messages:
        text = m.get("content") or ""
        text = text if isinstance(text, str) else "".join(p["text"] for p in text)
        if m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, text))
        elif m["role"] == "assistant":
            reasoning = m.get("reasoning") or m.get("reasoning_content")
            if reasoning:
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, reasoning).with_channel("analysis"))
            calls = m.get("tool_calls") or []
            if text:
                channel = "commentary" if calls else "final"
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel))
            for c in calls:
                names[c["id"]] = c["function"]["name"]
                msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, c["function"]["arguments"])
                msg = msg.with_channel("commentary").with_recipient("functions." + c["function"]["name"])
                out.append(msg.with_content_type("<|constrain|>json"))
        elif m["role"] == "tool":
            author = oh.Author.new(oh.Role.TOOL, "functions." + names[m["tool_call_id"]])
            msg = oh.Message.from_author_and_content(author, text).with_channel("commentary")
            out.append(msg.with_recipient("assistant"))
    return oh.Conversation.from_messages(out)


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_render_matches_harmony(oh, enc, name, effort):
    messages, tools = CONVERSATIONS[name]
    before = copy.deepcopy((messages, tools))
    text = render_chat(messages, tools, reasoning_effort=effort, conversation_start_date=DATE)
    want = enc.render_conversation_for_completion(reference(oh, messages, tools, effort, DATE), oh.Role.ASSISTANT)
    got = enc.encode(text, allowed_special="all")
    assert got == want, f"ours:\n{text}\n\nharmony's:\n{enc.decode(want)}"
    assert (messages, tools) == before  # the request is not changed


def test_render_mapping():
    """What the comparison with harmony cannot show, since the reference restates the mapping."""
    messages, tools = CONVERSATIONS["tool results"]
    text = render_chat(messages, tools, conversation_start_date=DATE)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT")
    assert "Reasoning: medium" in text and f"Current date: {DATE}" in text
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    call_ = (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>"
        '{"location": "Paris"}<|call|>'
    )
    assert call_ in text
    assert "<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>14:05<|end|>" in text
    assert text.endswith("<|end|><|start|>assistant")
    plain = render_chat([USER], conversation_start_date=DATE)
    assert "<|start|>developer" not in plain and "'functions'" not in plain
    assert f"Current date: {datetime.date.today().isoformat()}" in render_chat([USER])
    # analysis: dropped before the first final while the last assistant message is final, kept otherwise
    finals = render_chat(*CONVERSATIONS["reasoning before finals"])
    assert "No tools; say so." not in finals and "Paris in June: mild." in finals
    chain = render_chat(*CONVERSATIONS["reasoning before a call"])
    assert "Ask for the city?" in chain and "Now call the tool." in chain
    assert "<|channel|>commentary<|message|>Let me check.<|end|>" in chain


@pytest.mark.parametrize(
    "messages,tools,effort,match",
    [
        ([USER], None, "extreme", "reasoning_effort 'extreme'"),
        ([USER, {"role": "tool", "tool_call_id": "nope", "content": "1"}], None, None, "tool_call_id 'nope'"),
        ([{"role": "robot", "content": "hi"}], None, None, "unknown role 'robot'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], None, None, "only text parts"),
        ([{"role": "user", "content": 3}], None, None, r"messages\[0\].content"),
        ([USER], [{"type": "retrieval"}], None, r"tools\[0\]"),
        ([USER], [fn_tool("")], None, r"tools\[0\].function.name"),
        ([USER], [fn_tool("f", parameters="x")], None, "JSON schema"),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}], None, None, "function.name"),
        ([{"role": "assistant", "reasoning": 1}], None, None, "reasoning"),
    ],
)
def test_render_bad_input(messages, tools, effort, match):
    with pytest.raises(UserError, match=match):
        render_chat(messages, tools, reasoning_effort=effort, conversation_start_date=DATE)


def test_runtime_needs_no_openai_harmony():
    for module in ("harmony", "harmony_render", "harmony_parse"):
        source = (Path(harmony.__file__).parent / f"{module}.py").read_text()
        assert "openai_harmony" not in source
    assert (harmony.RETURN_ID, harmony.CALL_ID) == harmony.STOP_IDS == (200002, 200012)


def test_special_ids(enc):
    for name in ("START", "END", "MESSAGE", "CHANNEL", "CONSTRAIN", "RETURN", "CALL"):
        assert enc.encode(getattr(harmony, name), allowed_special="all") == [getattr(harmony, name + "_ID")]
    assert set(enc.stop_tokens_for_assistant_actions()) == set(harmony.STOP_IDS)


# ---------------------------------------------------------------------------------------------------------------
# Parsing


def answer(oh, *specs):
    """An answer's messages: (channel, text) or (channel, text, recipient, content type)."""
    out = []
    for channel, text, *rest in specs:
        msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
        if rest and rest[0]:
            msg = msg.with_recipient(rest[0])
        if len(rest) > 1:
            msg = msg.with_content_type(rest[1])
        out.append(msg)
    return out


def answer_ids(enc, messages):
    """The messages rendered as the model writes them after the prompt's ``<|start|>assistant``, the last one
    ending with its stop token (``<|return|>``, or ``<|call|>`` for a call)."""
    ids = [t for m in messages for t in enc.render(m)]
    prefix = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(prefix)] == prefix
    ids = ids[len(prefix) :]
    if ids[-1] == harmony.END_ID:
        ids[-1] = harmony.RETURN_ID
    return ids


def text_ids(enc, text):
    """An answer written as text (special tokens written out), as the model may order its header."""
    return enc.encode(text, allowed_special="all")


def ANSWERS(oh, enc):  # noqa: N802
    json_call = ("commentary", '{"location": "Paris", "unit": "celsius"}', "functions.get_weather", "<|constrain|>json")
    rendered = {
        "final only": [("final", "Hello there!")],
        "analysis+final": [("analysis", "Let me think. 2+2=4."), ("final", "It is **4**.")],
        "analysis+call": [("analysis", "Need the weather."), json_call],
        "preamble+call": [("analysis", "Plan."), ("commentary", "Checking the weather now."), json_call],
        "several analyses": [("analysis", "First, "), ("analysis", "second."), ("final", "Done")],
        "two calls": [json_call, ("commentary", "{}", "functions.get_time", "<|constrain|>json")],
        "builtin tools": [
            ("analysis", "Search it.", "browser.search", "<|constrain|>json"),
            ("analysis", "print(1 + 1)", "python", "code"),
        ],
        "plain json type": [("commentary", '{"a": [1, 2]}', "functions.f", "json")],
        "unicode": [("analysis", "思考中… 🤔🦜"), ("final", "答え: 🇫🇷 naïve café 👩‍👩‍👧")],
        "empty final": [("analysis", "Nothing to say."), ("final", "")],
    }
    out = {name: answer_ids(enc, answer(oh, *specs)) for name, specs in rendered.items()}
    out["recipient after channel"] = text_ids(
        enc,
        "<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"location": "Oslo"}<|call|>',
    )
    out["stop tokens stripped"] = answer_ids(enc, answer(oh, ("analysis", "Hm."), ("final", "Yes.")))[:-1]
    return out


@pytest.fixture(scope="module")
def answers(oh, enc):
    return ANSWERS(oh, enc)


def expected(oh, enc, ids):
    """What harmony's StreamableParser reads in ``ids``, mapped to reasoning, content and calls."""
    parser = oh.StreamableParser(enc, oh.Role.ASSISTANT)
    for t in ids:
        parser.process(t)
    parser.process_eos()
    content, reasoning, calls = "", "", []
    for m in parser.messages:
        text = "".join(c.text for c in m.content)
        if m.recipient:
            calls.append(ToolCall(f"id{len(calls)}", m.recipient.removeprefix("functions."), text))
        elif m.channel == "analysis":
            reasoning += text
        else:
            content += text
    return Parsed(content or None, reasoning or None, calls)


def counter():
    n = itertools.count()
    return lambda: f"id{next(n)}"


def run(enc, ids, chunks):
    """Feed ``ids`` in chunks of the given sizes (the rest in one last chunk, marked final); returns the result
    and the deltas joined up."""
    parser = HarmonyParser(enc.decode, new_call_id=counter())
    deltas, at = [], 0
    for size in chunks:
        deltas.append(parser.feed("", ids[at : at + size]))
        at += size
    deltas.append(parser.feed("", ids[at:], final=True))
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name is not None
                calls[c.index] = ToolCall(c.id, c.name, "")
            calls[c.index].arguments += c.arguments
    joined = Parsed(content or None, reasoning or None, [calls[i] for i in range(len(calls))])
    assert all("\ufffd" not in d.content + d.reasoning for d in deltas[:-1])
    return parser, parser.result(), joined


def chunkings(n):
    yield "one at a time", [1] * n
    for seed in range(4):
        rng, sizes = random.Random(seed), []
        while sum(sizes) < n:
            sizes.append(rng.randint(1, 7))
        yield f"random {seed}", sizes
    yield "all at once", []


CALLS_LAST = {
    "analysis+call",
    "preamble+call",
    "two calls",
    "builtin tools",
    "plain json type",
    "recipient after channel",
}


@pytest.mark.parametrize(
    "name",
    [
        "final only",
        "analysis+final",
        "analysis+call",
        "preamble+call",
        "several analyses",
        "two calls",
        "builtin tools",
        "plain json type",
        "unicode",
        "empty final",
        "recipient after channel",
        "stop tokens stripped",
    ],
)
def test_parse_matches_harmony(oh, enc, answers, name):
    ids = answers[name]
    want = expected(oh, enc, ids)
    for how, chunks in chunkings(len(ids)):
        parser, got, joined = run(enc, ids, chunks)
        assert got == want, how
        assert joined == want, how
    assert parser.ended_with_call == (name in CALLS_LAST)


def test_parse_mapping(answers, enc):
    _, got, _ = run(enc, answers["preamble+call"], [])
    args = '{"location": "Paris", "unit": "celsius"}'
    assert got == Parsed("Checking the weather now.", "Plan.", [ToolCall("id0", "get_weather", args)])
    _, got, _ = run(enc, answers["builtin tools"], [])
    assert [c.name for c in got.tool_calls] == ["browser.search", "python"] and got.reasoning is None


def test_call_name_streams_with_its_header(enc, answers):
    ids = answers["analysis+call"]
    at = ids.index(harmony.MESSAGE_ID, ids.index(harmony.START_ID))
    parser = HarmonyParser(enc.decode, new_call_id=counter())
    assert not parser.feed("", ids[:at]).tool_calls
    delta = parser.feed("", ids[at : at + 1])
    assert [(c.index, c.id, c.name, c.arguments) for c in delta.tool_calls] == [(0, "id0", "get_weather", "")]
    assert parser.feed("", ids[at + 1 : at + 3]).tool_calls[0].arguments == enc.decode(ids[at + 1 : at + 3])


@pytest.mark.parametrize("name", ["analysis+final", "preamble+call", "two calls", "unicode", "builtin tools"])
def test_parse_truncated(enc, answers, name):
    """Cut at every token: what came is kept, as a prefix of the whole answer's parts."""
    ids = answers[name]
    _, full, _ = run(enc, ids, [])
    for n in range(len(ids) + 1):
        for chunks in ([1] * n, []):
            _, got, joined = run(enc, ids[:n], chunks)
            assert got == joined
            assert (full.content or "").startswith((got.content or "").rstrip("\ufffd"))
            assert (full.reasoning or "").startswith((got.reasoning or "").rstrip("\ufffd"))
            assert len(got.tool_calls) <= len(full.tool_calls)
            for c, f in zip(got.tool_calls, full.tool_calls, strict=False):
                assert (c.id, c.name) == (f.id, f.name) and f.arguments.startswith(c.arguments.rstrip("\ufffd"))


def test_multibyte_split_across_tokens(enc, answers):
    ids = answers["unicode"]
    assert any(enc.decode([t]).endswith("\ufffd") for t in ids)  # the test splits characters
    parser = HarmonyParser(enc.decode)
    sent = [parser.feed("", [t]) for t in ids]
    assert all("\ufffd" not in d.content + d.reasoning for d in sent)
    assert "".join(d.content for d in sent) == "答え: 🇫🇷 naïve café 👩‍👩‍👧"
    assert "".join(d.reasoning for d in sent) == "思考中… 🤔🦜"


def test_garbage_is_content(enc):
    def parse(ids, chunks=()):
        return run(enc, ids, list(chunks))[1]

    plain = enc.encode("Just text, no format.")
    assert parse(plain) == parse(plain, [1] * len(plain)) == Parsed("Just text, no format.", None, [])
    after = text_ids(enc, "<|channel|>analysis<|message|>Hm.<|end|> stray words<|return|>")
    assert parse(after) == Parsed(" stray words", "Hm.", [])
    # a header cut off is dropped; a header too long to be one streams as content before the end
    assert parse(text_ids(enc, "<|channel|>final<|message|>Hi<|end|><|start|>assistant<|channel|>fin")) == Parsed(
        "Hi", None, []
    )
    long = enc.encode("word " * (MAX_HEADER_TOKENS + 10))
    parser = HarmonyParser(enc.decode)
    early = "".join(parser.feed("", [t]).content for t in long)
    assert early and parser.feed("", [], final=True).content + early == "word " * (MAX_HEADER_TOKENS + 10)


def test_round_trip(oh, enc, answers):
    """The answer parsed and sent back as the assistant's message renders as the model wrote it."""
    ids = answers["preamble+call"]
    _, got, _ = run(enc, ids, [])
    calls = [call(c.id, c.name, c.arguments) for c in got.tool_calls]
    assistant = {"role": "assistant", "content": got.content, "reasoning": got.reasoning, "tool_calls": calls}
    messages = [USER, assistant, {"role": "tool", "tool_call_id": "id0", "content": "21"}]
    prompt = enc.encode(render_chat(messages, [WEATHER], conversation_start_date=DATE), allowed_special="all")
    written = enc.encode("<|start|>assistant", allowed_special="all") + ids
    assert any(prompt[i : i + len(written)] == written for i in range(len(prompt)))
