"""Response formatting without a server: engine events fed to the choices of a request become the exact
OpenAI bodies and server-sent events (chat and completions, usage in the last chunk, log-probabilities,
echo), and incremental text never sends half a character or the start of a stop string."""

from __future__ import annotations

import json

from serve_fixtures import ByteTokenizer

from peagle_jax.serve import protocol, responses
from peagle_jax.serve.protocol import ChatRequest, CompletionRequest
from peagle_jax.serve.responses import Formatter, TextStream, choices_of, prompt_text
from peagle_jax.serve.slots import SlotEvent, SlotRequest

TOK = ByteTokenizer()


def ids(text: str) -> list[int]:
    return list(text.encode())


def completion(**body) -> CompletionRequest:
    return protocol.parse(CompletionRequest, json.dumps({"model": "tiny", **body}).encode())


def chat(**body) -> ChatRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return protocol.parse(ChatRequest, json.dumps(body).encode())


def setup(req, prompts: list[list[int]]):
    """The choices (one per prompt and n) and a formatter with a fixed id and time."""
    n = req.n or 1
    sreqs = [SlotRequest(p, 8) for p in prompts for _ in range(n)]
    choices = choices_of(req, sreqs, TOK)
    chat_ = isinstance(req, ChatRequest)
    fmt = Formatter("chatcmpl-1" if chat_ else "cmpl-1", "tiny", chat_, sum(map(len, prompts)), created=100)
    return choices, fmt


def event(choice, text: str = "", finish=None, **kw) -> SlotEvent:
    return SlotEvent(choice.sreq, ids(text), finish, **kw)


def data(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    return json.loads(chunk[len("data: ") : -2])


# TextStream


def test_without_a_tokenizer_the_text_is_the_ids():
    s = TextStream(None, [])
    assert s.feed([1, 22]) == "1,22,"
    assert s.feed([3], final=True) == "3,"
    assert s.text == "1,22,3,"


def test_multi_byte_characters_are_never_split():
    s = TextStream(TOK, [])
    assert s.feed([0x61, 0xC3]) == "a"  # the first byte of "é" alone
    assert s.feed([0xA9]) == "é"
    assert s.feed(ids("€")[:2]) == ""
    assert s.feed(ids("€")[2:] + ids("!"), final=True) == "€!"
    assert s.text == "aé€!"
    cut = TextStream(TOK, [])
    assert cut.feed(ids("€")[:2]) == ""
    assert cut.feed([], final=True) == "\ufffd"  # a stream that ends inside a character sends what it has


def test_a_stop_string_ends_the_text_before_it():
    s = TextStream(TOK, ["world"])
    assert s.feed(ids("hello wo")) == "hello "  # "wo" may start "world": held back
    assert not s.stopped
    assert s.feed(ids("rld and more")) == ""
    assert s.stopped and s.text == "hello "


def test_a_held_back_tail_is_sent_once_it_cannot_be_a_stop_string():
    s = TextStream(TOK, ["world"])
    assert s.feed(ids("hello wo")) == "hello "
    assert s.feed(ids("ok")) == "wook"
    assert s.feed(ids(" wor")) == " "
    assert s.feed([], final=True) == "wor"
    assert not s.stopped and s.text == "hello wook wor"


def test_the_earliest_stop_string_wins_even_across_one_feed():
    s = TextStream(TOK, ["b", "xa"])
    assert s.feed(ids("zxab")) == "z"
    assert s.stopped and s.text == "z"


def test_prompt_text_of_an_echo():
    assert prompt_text(TOK, "as sent", ids("ignored")) == "as sent"
    assert prompt_text(TOK, [104, 105], [104, 105]) == "hi"
    assert prompt_text(None, [1, 2], [1, 2]) == "1,2,"


# Whole bodies


def test_chat_body():
    choices, fmt = setup(chat(), [ids("hi")])
    [c] = choices
    assert c.feed(event(c, "Hel")).content == "Hel"
    assert c.feed(event(c, "lo", "length")).content == "lo"
    assert fmt.full(choices, 5) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 100,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello"},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7},
    }


def test_chat_body_with_token_ids_has_the_prompt_once():
    choices, fmt = setup(chat(n=2, return_token_ids=True), [ids("hi")])
    choices[0].feed(event(choices[0], "a", "stop"))
    choices[1].feed(event(choices[1], "bc", "length"))
    body = fmt.full(choices, 3, token_ids=True)
    assert body["prompt_token_ids"] == [104, 105]
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": None, "finish_reason": "stop",
         "token_ids": [97]},
        {"index": 1, "message": {"role": "assistant", "content": "bc"}, "logprobs": None,
         "finish_reason": "length", "token_ids": [98, 99]},
    ]  # fmt: skip


def test_completions_body_with_a_stop_string_echo_and_token_ids():
    choices, fmt = setup(completion(prompt=["ab", "c"], stop=["!"], echo=True), [ids("ab"), ids("c")])
    first, second = choices
    assert (first.echo, second.echo) == ("ab", "c")
    first.feed(event(first, "x!y"))
    second.feed(event(second, "z", "length"))
    assert (first.finish, second.finish) == ("stop", "length")  # a stop string is "stop" with tokens left
    assert fmt.full(choices, 4, token_ids=True) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "tiny",
        "choices": [
            {"index": 0, "text": "abx", "logprobs": None, "finish_reason": "stop", "token_ids": [120, 33, 121],
             "prompt_token_ids": [97, 98]},
            {"index": 1, "text": "cz", "logprobs": None, "finish_reason": "length", "token_ids": [122],
             "prompt_token_ids": [99]},
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
    }  # fmt: skip


def test_formatter_for_counts_each_prompt_once():
    req = completion(prompt=["ab", "cde"], n=2)
    choices = choices_of(req, [SlotRequest(ids(p), 4) for p in ("ab", "ab", "cde", "cde")], TOK)
    fmt = responses.formatter_for(req, choices, "tiny")
    assert (fmt.prompt_tokens, fmt.model, fmt.chat) == (5, "tiny", False)
    assert fmt.rid.startswith("cmpl-") and len(fmt.rid) == len("cmpl-") + 24
    assert responses.formatter_for(chat(), choices[:1], "tiny").rid.startswith("chatcmpl-")


# Streams


def test_chat_stream_chunks_and_the_final_usage():
    choices, fmt = setup(chat(n=2), [ids("hi")])
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 100, "model": "tiny"}

    def chunk(index, delta, finish=None, **extra):
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
                **extra}  # fmt: skip

    opening = [data(c) for c in fmt.opening(choices)]
    assert opening == [chunk(0, {"role": "assistant", "content": ""}), chunk(1, {"role": "assistant", "content": ""})]
    a, b = choices
    assert data(fmt.step(a, a.feed(event(a, "Hi")), choices)) == chunk(0, {"content": "Hi"})
    assert fmt.step(b, b.feed(SlotEvent(b.sreq, [0xC3])), choices) is None  # half a character: nothing yet
    b_last = fmt.step(b, b.feed(SlotEvent(b.sreq, [0xA9], "length")), choices)
    assert data(b_last) == chunk(1, {"content": "é"}, "length")  # not the last choice to finish: no usage
    usage = {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert data(fmt.step(a, a.feed(event(a, "", "stop")), choices)) == chunk(0, {}, "stop", usage=usage)
    assert responses.DONE == "data: [DONE]\n\n"


def test_completions_stream_with_echo_and_logprobs():
    req = completion(prompt="ab", echo=True, logprobs=1, stream=True)
    choices, fmt = setup(req, [ids("ab")])
    [c] = choices
    assert fmt.opening(choices) == []
    first = event(c, "c", logprobs=[(-0.1, [(99, -0.1), (100, -2.0)])], prompt_logprobs=[(-1.0, [(97, -0.5)])])
    expected = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 100,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "abc",
                "logprobs": {
                    "tokens": ["a", "b", "c"],
                    "token_logprobs": [None, -1.0, -0.1],
                    "top_logprobs": [None, {"a": -0.5, "b": -1.0}, {"c": -0.1}],
                    "text_offset": [0, 1, 2],
                },
                "finish_reason": None,
            }
        ],
    }
    assert data(fmt.step(c, c.feed(first), choices)) == expected
    last = data(fmt.step(c, c.feed(event(c, "d", "length", logprobs=[(-0.7, [(101, -0.2)])])), choices))
    assert last["choices"] == [
        {"index": 0, "text": "d", "finish_reason": "length", "logprobs": {
            "tokens": ["d"], "token_logprobs": [-0.7], "top_logprobs": [{"e": -0.2, "d": -0.7}], "text_offset": [3]}},
    ]  # fmt: skip
    assert last["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


def test_chat_logprobs_in_the_body():
    choices, fmt = setup(chat(logprobs=True, top_logprobs=1), [ids("hi")])
    [c] = choices
    c.feed(event(c, "é", "stop", logprobs=[(-0.5, [(0xC3, -0.5), (0x61, -1.5)]), (-0.25, [(0xA9, -0.25)])]))
    half = {"token": "\ufffd", "bytes": [0xEF, 0xBF, 0xBD]}  # half a character decodes alone to U+FFFD
    assert fmt.full(choices, 2)["choices"][0]["logprobs"] == {
        "content": [
            {**half, "logprob": -0.5, "top_logprobs": [{**half, "logprob": -0.5}]},
            {**half, "logprob": -0.25, "top_logprobs": [{**half, "logprob": -0.25}]},
        ],
        "refusal": None,
    }
    assert c.take_logprobs() == {"content": [], "refusal": None}  # sent once


def test_a_failure_mid_stream_is_an_error_event():
    assert responses.error_event(500, "the engine stopped") == (
        'data: {"error": {"message": "the engine stopped", "type": "server_error", "param": null, "code": null}}\n\n'
    )
