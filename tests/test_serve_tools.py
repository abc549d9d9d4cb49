"""Tool calls and reasoning through the server, on tiny random models that carry the real tokenizers and chat
templates (tests/chat_models.py): Qwen3 (its template, ``<tool_call>`` JSON, ``<think>``) and GPT-OSS
(harmony), and for forced calls also Qwen3-Coder (XML calls) and Llama 3.1 (JSON calls). Random weights
ramble, so a forced ``tool_choice`` shows what the grammar guarantees: the call comes first, parses and
validates, within a bounded number of tokens; a plain and a speculative server (random drafter, every step
drafted) give the same tokens and calls; streaming sends the same call in pieces; the OpenAI SDK round trip
(call, tool result, answer) renders the result into the next prompt."""

from __future__ import annotations

import json

import jsonschema
import pytest
from chat_models import chat_model_dir, chat_tokenizer, write_chat_drafter
from serve_fixtures import ServerProcess, http, parse_metrics

MAX_SEQ = 1024
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping", "description": "Is the service up?"}}
TOOLS = [WEATHER, PING]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "ping": {"type": "object", "maxProperties": 0}}
ASK = [{"role": "user", "content": "What is the weather in Oslo for the next 3 days?"}]
CHOICES = ["required", *({"type": "function", "function": {"name": n}} for n in ("get_weather", "ping"))]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``servers(kind)``: (plain, speculative) servers of the tiny ``kind`` model, started on first use."""
    started: dict[str, tuple[ServerProcess, ServerProcess]] = {}

    def get(kind: str):
        if kind not in started:
            model = chat_model_dir(tmp_path_factory, kind)
            drafter = write_chat_drafter(tmp_path_factory.mktemp("drafter") / kind, kind)
            flags = ["--model", str(model), "--max-batch", "2", "--max-seq-len", str(MAX_SEQ)]
            flags += ["--served-model-name", kind]
            logs = tmp_path_factory.mktemp("logs")
            plain = ServerProcess(*flags, log=logs / "plain.log")
            spec = ServerProcess(*flags, "--drafter", str(drafter), "--load-k", "none", log=logs / "spec.log")
            started[kind] = (plain.wait(), spec.wait())
        return started[kind]

    yield get
    for pair in started.values():
        for proc in pair:
            assert proc.stop() == 0
            assert "Traceback" not in proc.log.read_text()


def _chat(server, **body) -> dict:
    status, _, raw = http(server.base, "POST", "/v1/chat/completions", json.dumps({"temperature": 0, **body}))
    assert status == 200, raw
    return json.loads(raw)


def _check_calls(message: dict, forced) -> None:
    calls = message["tool_calls"]
    assert calls, message
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    if isinstance(forced, dict):
        assert [c["function"]["name"] for c in calls] == [forced["function"]["name"]]


@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss", "qwen3-coder", "llama3.1"])
def test_forced_calls_parse_validate_and_equal_on_plain_and_speculative_servers(servers, kind):
    plain, spec = servers(kind)
    for choice in CHOICES:
        body = dict(model=kind, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=160, return_token_ids=True)
        body["parallel_tool_calls"] = False
        a, b = _chat(plain, **body), _chat(spec, **body)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"], choice
        for r in (a, b):
            (c,) = r["choices"]
            assert c["finish_reason"] == "tool_calls", c
            _check_calls(c["message"], choice)
            assert r["usage"]["completion_tokens"] <= 80  # markup and bounded values: no rambling inside
        strip = [{**c, "id": None} for c in a["choices"][0]["message"]["tool_calls"]]
        assert strip == [{**c, "id": None} for c in b["choices"][0]["message"]["tool_calls"]]
    # Grammar-aware drafting inside the markup: a random drafter's proposals are replaced by the tokens the
    # grammar forces, so the forced calls take fewer target forwards than tokens.
    metrics = parse_metrics(http(spec.base, "GET", "/metrics")[2].decode())
    (length,) = [v for k, v in metrics.items() if k.endswith("structured_acceptance_length")]
    print(f"{kind}: forced calls' acceptance length {length:.2f}")
    assert length > 1.5


@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss"])
def test_a_streamed_call_arrives_in_pieces_that_add_up_to_the_whole(servers, kind):
    from openai import OpenAI

    _, spec = servers(kind)
    client = OpenAI(base_url=spec.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    args = dict(model=kind, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=160)
    whole = client.chat.completions.create(**args).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**args, stream=True):
        (c,) = chunk.choices
        for piece in c.delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.function.name  # the first piece names the call
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls" == whole.finish_reason
    assert [calls[i] for i in sorted(calls)] == [
        {"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls
    ]


@pytest.mark.parametrize("kind", ["qwen3", "gpt-oss"])
def test_the_sdk_round_trip_renders_the_call_and_its_result(servers, kind):
    from openai import OpenAI

    _, spec = servers(kind)
    client = OpenAI(base_url=spec.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(model=kind, messages=ASK, tools=TOOLS, tool_choice=named, temperature=0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [*ASK, message]  # the SDK's message object, sent back as it came
    history.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"})
    args = dict(model=kind, messages=history, tools=TOOLS, temperature=0, max_tokens=12)
    answer = client.chat.completions.create(**args, extra_body={"return_token_ids": True})
    prompt = chat_tokenizer(kind).decode(answer.model_extra["prompt_token_ids"])
    assert "sunny, 21 degrees" in prompt and call.function.arguments in prompt
    streamed = client.chat.completions.create(**args, stream=True)
    pieces = [(c.choices[0].delta.content or "", c.choices[0].delta.tool_calls) for c in streamed if c.choices]
    whole = answer.choices[0].message
    assert "".join(p for p, _ in pieces) == (whole.content or "")
    assert bool(whole.tool_calls) == any(t for _, t in pieces)


def test_reasoning_is_split_from_the_content_streamed_or_not(servers):
    """A Qwen3 answer shaped by a grammar as ``<think>`` reasoning then content: ``reasoning`` (and
    ``reasoning_content``) apart from ``content``, the same in a stream; ``include_reasoning: false`` leaves
    it out."""
    plain, spec = servers("qwen3")
    shape = {"regex": "<think>\nhm[a-z]{3,12}\n</think>\n\nok[a-z]{3,12}"}
    body = dict(model="qwen3", messages=ASK, structured_outputs=shape, max_tokens=60, temperature=0)
    for server in (plain, spec):
        m = _chat(server, **body)["choices"][0]["message"]
        assert m["reasoning"] == m["reasoning_content"] and m["reasoning"].startswith("hm")
        assert m["content"].startswith("ok") and "<think>" not in m["content"]
        status, _, raw = http(server.base, "POST", "/v1/chat/completions", json.dumps({**body, "stream": True}))
        assert status == 200
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in raw.decode().splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert "".join(d.get("reasoning", "") for d in deltas) == m["reasoning"]
        assert "".join(d.get("content", "") for d in deltas) == m["content"]
        hidden = _chat(server, **body, include_reasoning=False)["choices"][0]["message"]
        assert "reasoning" not in hidden and hidden["content"] == m["content"]
