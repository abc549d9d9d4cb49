"""The request schema without a server: OpenAI parameters this server does not implement are refused by name
unless neutral, fields the OpenAI API does not define are ignored and listed, and nested objects stay
strict."""

from __future__ import annotations

import json

import pytest

from peagle_jax.serve.protocol import (
    CHAT_NOT_IMPLEMENTED,
    MAX_STOP,
    APIError,
    ChatRequest,
    CompletionRequest,
    logprobs_wanted,
    parse,
    structured,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
COMPLETION = {"model": "m", "prompt": "x"}


def _parse(schema, body: dict):
    return parse(schema, json.dumps(body).encode())


def test_fields_the_api_does_not_define_are_ignored_and_listed():
    for schema, body in ((ChatRequest, CHAT), (CompletionRequest, COMPLETION)):
        req = _parse(schema, {**body, "zeta": 1, "alpha": {"nested": [1]}, "ignored": ["x"]})
        assert req.ignored == ["alpha", "ignored", "zeta"]
        assert _parse(schema, body).ignored == []
    # a chat-only parameter sent to completions is not an OpenAI completions parameter: ignored
    assert _parse(CompletionRequest, {**COMPLETION, "tools": [{"type": "function"}]}).ignored == ["tools"]


@pytest.mark.parametrize("name", sorted(CHAT_NOT_IMPLEMENTED))
def test_chat_parameters_not_implemented_are_refused_by_name_unless_neutral(name):
    for neutral in CHAT_NOT_IMPLEMENTED[name]:
        assert _parse(ChatRequest, {**CHAT, name: neutral}).ignored == []
    with pytest.raises(APIError) as err:
        _parse(ChatRequest, {**CHAT, name: "something-else"})
    assert (err.value.status, err.value.param, err.value.code) == (400, name, "unsupported_parameter")
    assert name in err.value.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({**CHAT, "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
        ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # no tool_call_id
        ({**CHAT, "messages": [{"role": "user", "content": None}]}, "messages.0"),
        ({**CHAT, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ({**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
        ({**CHAT, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        (
            {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({**CHAT, "response_format": {"type": "yaml"}}, "response_format"),
        ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format"),
        ({**COMPLETION, "structured_outputs": {"grammar": "start: x"}}, "structured_outputs"),
        ({**COMPLETION, "structured_outputs": {"choice": "abc"}}, "structured_outputs"),
        ({**COMPLETION, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({**CHAT, "logit_bias": {"five": 1.0}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"5": 100.5}}, "logit_bias"),
        ({**COMPLETION, "presence_penalty": 2.5}, "presence_penalty"),
        ({**CHAT, "frequency_penalty": -2.01}, "frequency_penalty"),
        ({**COMPLETION, "best_of": 2}, "best_of"),
        ({**COMPLETION, "logprobs": 21}, "logprobs"),
        ({**COMPLETION, "logprobs": -1}, "logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ],
)
def test_what_stays_refused(body, param):
    schema = ChatRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as err:
        _parse(schema, body)
    assert (err.value.status, err.value.param) == (400, param) and param in err.value.message


def test_logprobs_wanted():
    """How many alternatives per token a request asks for (None: no log-probabilities)."""
    cases = [
        (ChatRequest, {**CHAT, "logprobs": True, "top_logprobs": 20}, 20),
        (ChatRequest, {**CHAT, "logprobs": True}, 0),
        (ChatRequest, {**CHAT, "logprobs": False, "top_logprobs": 0}, None),
        (ChatRequest, CHAT, None),
        (CompletionRequest, {**COMPLETION, "logprobs": 0}, 0),
        (CompletionRequest, {**COMPLETION, "logprobs": 5, "echo": True}, 5),
        (CompletionRequest, COMPLETION, None),
    ]
    for schema, body, want in cases:
        assert logprobs_wanted(_parse(schema, body)) == want, body


def test_stop_strings_beyond_the_openai_four_are_accepted_up_to_max_stop():
    """lm-evaluation-harness sends a task's ``until`` strings and the EOS string as ``stop`` (humaneval: 6);
    vLLM takes any number, so this server takes up to MAX_STOP, and refuses more by name."""
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "<|im_end|>"]
    assert _parse(CompletionRequest, {**COMPLETION, "stop": stops}).stop == stops
    assert _parse(ChatRequest, {**CHAT, "stop": [str(i) for i in range(MAX_STOP)]}).stop[-1] == str(MAX_STOP - 1)
    with pytest.raises(APIError) as err:
        _parse(CompletionRequest, {**COMPLETION, "stop": [str(i) for i in range(MAX_STOP + 1)]})
    assert (err.value.status, err.value.param) == (400, "stop")


@pytest.mark.parametrize(
    "extra, want",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", None)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}},
            ("json_schema", {"type": "integer"}),
        ),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, ("json_schema", {"type": "string"})),
        ({"structured_outputs": {"regex": "a+"}}, ("regex", "a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"])),
        ({"structured_outputs": {"json_object": True}}, ("json_object", None)),
        ({"guided_json": {"type": "boolean"}}, ("json_schema", {"type": "boolean"})),
        ({"guided_regex": "[0-9]"}, ("regex", "[0-9]")),
        ({"guided_choice": ["x"]}, ("choice", ["x"])),
    ],
)
def test_structured_output_fields(extra, want):
    """response_format (both endpoints), vLLM's structured_outputs and guided_* give one grammar spec."""
    for schema, body in ((ChatRequest, CHAT), (CompletionRequest, COMPLETION)):
        assert structured(_parse(schema, {**body, **extra})) == want
