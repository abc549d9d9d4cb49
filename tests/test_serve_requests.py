"""Request translation without a server: validated chat and completions requests become the slot requests the
engine gets (sampling parameters, n choices in groups with consecutive seeds, stop ids, max_tokens defaults,
logit_bias, grammars, echo), or the APIError the client gets."""

from __future__ import annotations

import json

import pytest
from serve_fixtures import ByteTokenizer

from peagle_jax.engine.generator import RequestError
from peagle_jax.errors import UserError
from peagle_jax.serve import protocol
from peagle_jax.serve.protocol import APIError, ChatRequest, CompletionRequest
from peagle_jax.serve.requests import DEFAULT_COMPLETION_TOKENS, Translator, echo_of
from peagle_jax.serve.slots import SlotRequest

HI = "user: hi\nassistant: "  # the ByteTokenizer chat template's text of one user message "hi"


def completion(**body) -> CompletionRequest:
    return protocol.parse(CompletionRequest, json.dumps({"model": "tiny", **body}).encode())


def chat(**body) -> ChatRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}
    return protocol.parse(ChatRequest, json.dumps(body).encode())


def translator(**kw) -> Translator:
    args = dict(tokenizer=ByteTokenizer(), model_name="tiny", max_seq_len=64, stop_token_ids=(2,), capacity=8)
    return Translator(**{**args, **kw})


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as err:
        fn(*args)
    return err.value


def test_completion_becomes_one_slot_request():
    req = completion(prompt="abc", max_tokens=4, temperature=0.5, top_k=3, top_p=0.9, seed=7, stop_token_ids=[9, 2, 5])
    [sreq] = translator().slot_requests(req)
    expected = SlotRequest([97, 98, 99], 4, 0.5, 3, 0.9, 7, (2, 5, 9), id=sreq.id)
    assert sreq == expected  # group None, group_size 1, no echo, penalties, bias or grammar


def test_unset_sampling_parameters_take_the_openai_defaults():
    [sreq] = translator().slot_requests(completion(prompt=[5, 6], seed=1))
    assert (sreq.prompt, sreq.temperature, sreq.top_k, sreq.top_p) == ([5, 6], 1.0, 0, 1.0)
    assert sreq.stop_token_ids == (2,)  # the server's own stop ids


def test_chat_messages_go_through_the_chat_template():
    [sreq] = translator().slot_requests(chat(max_completion_tokens=5))
    assert sreq.prompt == list(HI.encode())
    assert sreq.max_new_tokens == 5


def test_a_chat_template_returning_an_encoding_is_unwrapped():
    class Encoding(ByteTokenizer):
        def apply_chat_template(self, messages, **kw):
            return {"input_ids": super().apply_chat_template(messages, **kw)}

    assert translator(tokenizer=Encoding()).prompt_ids(chat()) == [list(HI.encode())]


def test_max_tokens_defaults():
    """Completions default to 16 tokens (fewer when the context has less room), chat to the rest of the
    context."""
    assert DEFAULT_COMPLETION_TOKENS == 16
    [sreq] = translator(max_seq_len=64).slot_requests(completion(prompt="abc"))
    assert sreq.max_new_tokens == 16
    [sreq] = translator(max_seq_len=10).slot_requests(completion(prompt="abc"))
    assert sreq.max_new_tokens == 7
    [sreq] = translator(max_seq_len=64).slot_requests(chat())
    assert sreq.max_new_tokens == 64 - len(HI)
    [sreq] = translator(max_seq_len=64).slot_requests(chat(max_tokens=3))
    assert sreq.max_new_tokens == 3


def test_n_choices_share_a_group_per_prompt_with_consecutive_seeds():
    """Prompt i's choice j is choice i * n + j, seed (seed + j) mod 2**32; each prompt's n choices are one
    group (one prefill)."""
    sreqs = translator().slot_requests(completion(prompt=["ab", "c"], n=3, seed=2**32 - 2))
    assert [s.prompt for s in sreqs] == [[97, 98]] * 3 + [[99]] * 3
    assert [s.seed for s in sreqs] == [2**32 - 2, 2**32 - 1, 0] * 2
    assert [s.group_size for s in sreqs] == [3] * 6
    groups = [s.group for s in sreqs]
    assert None not in groups and groups[0] == groups[1] == groups[2] != groups[3] == groups[4] == groups[5]
    assert len({s.id for s in sreqs}) == 6
    assert [s.seed for s in translator().slot_requests(chat(n=2, seed=-1))] == [2**32 - 1, 0]


def test_without_a_seed_the_choices_still_get_consecutive_seeds():
    sreqs = translator().slot_requests(chat(n=2))
    assert sreqs[1].seed == (sreqs[0].seed + 1) & 0xFFFFFFFF


def test_more_choices_than_the_server_holds_are_refused():
    err = refused(translator(capacity=5).slot_requests, completion(prompt=["a", "b", "c"], n=2))
    assert (err.status, err.param) == (400, "n")
    held = "6 choices (n times the prompts) is more than this server holds at once (5: its slots and its queue)"
    assert err.message == held


def test_another_model_is_not_found():
    err = refused(translator().slot_requests, completion(model="gpt-4", prompt="a"))
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert err.message == "model 'gpt-4' does not exist; this server serves 'tiny'"


def test_a_prompt_that_fills_the_context_is_refused():
    err = refused(translator(max_seq_len=3).slot_requests, completion(prompt="abc"))
    assert err.body() == {
        "error": {
            "message": "the prompt has 3 tokens; the context holds 3",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": "context_length_exceeded",
        }
    }
    err = refused(translator(max_seq_len=len(HI)).slot_requests, chat())
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")


def test_max_tokens_beyond_the_context_is_refused():
    ok = translator(max_seq_len=8).slot_requests(completion(prompt="abc", max_tokens=5))
    assert ok[0].max_new_tokens == 5
    err = refused(translator(max_seq_len=8).slot_requests, completion(prompt="abc", max_tokens=6))
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert err.message == "the prompt (3 tokens) plus max_tokens (6) exceeds the context of 8 tokens"


def test_an_empty_prompt_is_refused():
    err = refused(translator().slot_requests, completion(prompt=""))
    assert (err.status, err.message, err.param) == (400, "the prompt is empty", "prompt")


def test_without_a_tokenizer_only_token_ids_are_served():
    t = translator(tokenizer=None)
    assert t.slot_requests(completion(prompt=[[1, 2], [3]]))[1].prompt == [3]
    err = refused(t.slot_requests, completion(prompt="abc"))
    assert (err.status, err.message, err.param) == (400, "this model has no tokenizer: send token ids", "prompt")
    err = refused(t.slot_requests, chat())
    assert (err.message, err.param) == ("this model has no chat template; use /v1/completions", "messages")


def test_a_chat_template_that_refuses_the_messages_is_a_400():
    class Strict(ByteTokenizer):
        def apply_chat_template(self, messages, **kw):
            raise ValueError("roles must alternate")

    err = refused(translator(tokenizer=Strict()).slot_requests, chat())
    assert (err.status, err.param) == (400, "messages")
    assert err.message == "the chat template refused these messages: roles must alternate"


def test_penalties_and_logit_bias():
    req = chat(presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"5": 2.5, "7": -100})
    [sreq] = translator().slot_requests(req)
    assert (sreq.presence_penalty, sreq.frequency_penalty) == (0.5, -0.25)
    assert sreq.logit_bias == {5: 2.5, 7: -100.0}
    assert sreq.penalized
    [plain] = translator().slot_requests(chat(logit_bias={}))
    assert plain.logit_bias is None and not plain.penalized


class FakeGrammars:
    """Compiles a grammar to its name; counts the compilations; refuses the regex ``(``."""

    def __init__(self):
        self.compiled = []

    def compile(self, kind, value):
        if kind == "regex" and value == "(":
            raise UserError("unbalanced parenthesis")
        self.compiled.append((kind, value))
        return f"{kind}:{json.dumps(value)}"


def test_grammars_from_response_format_compiled_once():
    grammars = FakeGrammars()
    t = translator(grammars=grammars)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    [first] = t.slot_requests(chat(response_format=fmt))
    [again] = t.slot_requests(completion(prompt="a", response_format=fmt))
    assert first.grammar == again.grammar == f"json_schema:{json.dumps(schema)}"
    assert grammars.compiled == [("json_schema", schema)]
    assert t.slot_requests(chat(response_format={"type": "json_object"}))[0].grammar == "json_object:null"
    assert t.slot_requests(chat(response_format={"type": "text"}))[0].grammar is None


def test_grammars_refused():
    err = refused(translator().slot_requests, chat(response_format={"type": "json_object"}))
    assert (err.status, err.param) == (400, "response_format")
    assert err.message == "response_format: this server has no tokenizer for structured outputs"
    err = refused(translator(grammars=FakeGrammars()).slot_requests, chat(guided_regex="("))
    assert (err.status, err.message, err.param) == (400, "guided_regex: unbalanced parenthesis", "guided_regex")


def test_echo_asks_the_engine_for_prompt_logprobs_only_with_logprobs():
    t = translator()
    assert echo_of(completion(prompt="a", echo=True)) and not echo_of(chat())
    assert t.slot_requests(completion(prompt="a", echo=True, logprobs=0))[0].echo
    assert not t.slot_requests(completion(prompt="a", echo=True))[0].echo
    assert not t.slot_requests(completion(prompt="a", logprobs=2))[0].echo


def test_the_engine_check_refusal_is_a_400():
    seen = []

    def check(sreq):
        seen.append(sreq)
        if sreq.top_k > 100:
            raise RequestError(f"top_k {sreq.top_k} exceeds the vocabulary")

    t = translator(check=check)
    [ok] = t.slot_requests(completion(prompt="a", top_k=5))
    assert seen == [ok]
    err = refused(t.slot_requests, completion(prompt="a", top_k=500))
    assert err.body()["error"] == {
        "message": "top_k 500 exceeds the vocabulary",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
