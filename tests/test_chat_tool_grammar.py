"""Forced tool calls as grammars (peagle_jax.chat.tool_grammar), matched by llguidance over SmolLM2's real
tokenizer: every syntax takes its own well-formed calls and refuses a preamble, whitespace before the call, an
unknown name and arguments outside the schema; a named choice forces its whole markup up to the arguments."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from peagle_jax.chat.tool_grammar import forced_call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}
TOOLS = [WEATHER, NOARGS]


def _hermes(name, args):
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


def _llama(name, args):
    return '{"name": "' + name + '", "parameters": ' + json.dumps(args) + "}"


def _coder(name, args):
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


WRITE = {"hermes": _hermes, "llama3_json": _llama, "qwen3_coder": _coder}
JOIN = {"hermes": "\n", "llama3_json": "; ", "qwen3_coder": "\n"}
GOOD = {"city": "Paris <b>", "days": 3}


@functools.cache
def _setup():
    from peagle_jax.grammar import Grammars
    from peagle_jax.loading import load_tokenizer, resolve_model_dir

    tok = load_tokenizer(resolve_model_dir("smollm2"))
    return tok, Grammars(tok, 49152, [tok.eos_token_id])


def _matcher(grammar: str):
    import llguidance

    tok, grammars = _setup()
    assert llguidance.LLMatcher.validate_grammar(grammar, grammars.tokenizer) == ""
    return llguidance.LLMatcher(grammars.tokenizer, grammar)


def _takes(grammar: str, text: str) -> bool:
    """Whether the grammar takes all of ``text`` and may end there."""
    tok, _ = _setup()
    m = _matcher(grammar)
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()


@pytest.mark.parametrize("syntax", sorted(WRITE))
def test_each_syntax_takes_its_calls_and_nothing_else(syntax):
    write = WRITE[syntax]
    required = forced_call_grammar(syntax, TOOLS, None)
    named = forced_call_grammar(syntax, TOOLS, "get_weather")
    single = forced_call_grammar(syntax, TOOLS, None, parallel=False)
    call = write("get_weather", GOOD)
    assert _takes(required, call) and _takes(named, call) and _takes(single, call)
    assert _takes(required, write("get_weather", {**GOOD, "unit": "f"}))
    two = call + JOIN[syntax] + write("ping", {})
    assert _takes(required, two)
    assert not _takes(single, two)  # parallel_tool_calls: false
    assert not _takes(named, write("ping", {}))  # a named choice calls that tool only
    assert not _takes(required, "Sure! " + call)  # no preamble
    assert not _takes(required, " " + call) and not _takes(required, "\n" + call)  # no whitespace before
    assert not _takes(required, write("get_wether", GOOD))
    assert not _takes(required, write("get_weather", {"city": "Paris"}))  # a required parameter missing
    assert not _takes(required, write("get_weather", {**GOOD, "unit": "kelvin"}))  # outside the enum
    assert not _takes(required, write("get_weather", {**GOOD, "days": "three"}))
    assert not _takes(required, "")  # the call is not optional


@pytest.mark.parametrize("syntax", ["hermes", "llama3_json"])
def test_json_arguments_have_no_free_whitespace(syntax):
    grammar = forced_call_grammar(syntax, TOOLS, None)
    assert not _takes(grammar, WRITE[syntax]("get_weather", GOOD).replace('"city": ', '"city":  '))
    assert not _takes(grammar, WRITE[syntax]("get_weather", GOOD).replace("{", "{ ", 2))


@pytest.mark.parametrize(
    "syntax, prefix",
    [
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "'),
        ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n"),
    ],
)
def test_a_named_choice_forces_its_markup_up_to_the_first_free_value(syntax, prefix):
    """The tokens llguidance forces from the start (what grammar-aware drafting proposes for free) spell the
    whole markup: the model has no choice before the first value the schema leaves open."""
    tok, _ = _setup()
    m = _matcher(forced_call_grammar(syntax, TOOLS, "get_weather"))
    forced = tok.decode(m.compute_ff_tokens())
    assert prefix.startswith(forced) and len(forced) >= len(prefix) - 4, (forced, prefix)


BOUNDED = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "days": {"type": "integer", "minimum": 1, "maximum": 9},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    NOARGS,
]


@pytest.mark.parametrize("syntax", sorted(WRITE))
def test_a_random_walk_through_a_forced_call_always_parses(syntax):
    """Random tokens among those the grammar allows (a model that would ramble: its random choices): with
    bounded values the call ends within a bounded number of tokens, and what it wrote is a call of a given
    tool whose arguments validate against its schema."""
    import jsonschema

    from peagle_jax.chat.parsers import text_parser

    tok, grammars = _setup()
    rng = np.random.default_rng(0)
    import llguidance.numpy

    for _ in range(6):
        m = _matcher(forced_call_grammar(syntax, BOUNDED, None, parallel=False))
        ids = []
        while not m.is_stopped():
            mask = np.zeros((1, grammars.words), np.int32)
            llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: grammars.vocab])
            t = int(rng.choice(allowed))
            ids.append(t)
            assert m.consume_token(t)
            assert len(ids) <= 120, tok.decode(ids)  # the markup, 12 characters, one digit, an enum: bounded
        body = ids[:-1] if ids[-1] == tok.eos_token_id else ids  # the grammar may stop before its EOS
        parser = text_parser(None, syntax, BOUNDED)
        parser.feed(tok.decode(body), body, final=True)
        (call,) = parser.result().tool_calls
        tool = {t["function"]["name"]: t for t in BOUNDED}[call.name]
        jsonschema.validate(json.loads(call.arguments), tool["function"].get("parameters") or {"type": "object"})
