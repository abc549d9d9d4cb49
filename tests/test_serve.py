"""``python -m peagle_jax.serve`` as a client sees it: one real server process on loopback (a tiny random
Llama with a character tokenizer), driven with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_fixtures import ServerProcess, check_logprobs, http, parse_metrics, write_tiny_model

from peagle_jax.serve.protocol import MAX_STOP

# Long enough that a request of MAX_SEQ - 2 tokens holds its slot for seconds (the queue and cancel tests).
MAX_SEQ = 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--max-batch", "4", "--max-seq-len", str(MAX_SEQ), "--max-queue", "24"]
    proc = ServerProcess(*args, log=tmp_path_factory.mktemp("log") / "server.log").wait()
    yield proc
    assert proc.stop() == 0  # SIGTERM drains and exits 0
    assert "Traceback" not in proc.log.read_text()  # no request, however bad, crashed a handler


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _generate_cli(model_dir, prompt: str, n: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "peagle_jax.generate", "--model", str(model_dir), "--prompt", prompt]
    cmd += ["--max-new-tokens", str(n), "--max-seq-len", str(MAX_SEQ), "--json", *extra]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)


def test_health_models_and_warmup(server, client):
    assert server.saw_503  # /health answered 503 while the graphs compiled, 200 after
    for path in ("/health", "/ping"):
        status, _, body = http(server.base, "GET", path)
        assert status == 200 and json.loads(body)["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_greedy_equals_generate_cli(model_dir, client):
    ref = _generate_cli(model_dir, "Hello, world", 24)
    out = client.completions.create(model="tiny", prompt="Hello, world", max_tokens=24, temperature=0)
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["finish_reason"]
    assert out.usage.prompt_tokens == ref["prompt_tokens"] and out.usage.completion_tokens == ref["completion_tokens"]
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    ref = _generate_cli(model_dir, "Tell me a story.", 30, "--chat")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=30, temperature=0
    )
    assert chat.choices[0].message.content == ref["text"] and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == ref["prompt_tokens"] and chat.usage.completion_tokens == ref["completion_tokens"]


def test_streaming_equals_plain_responses(server, client):
    kw = dict(model="tiny", prompt="abc def", max_tokens=20, temperature=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=25, temperature=0)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=25, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    # The wire format: `data: {...}` events, then `data: [DONE]`.
    status, headers, body = http(server.base, "POST", "/v1/completions", json.dumps({**kw, "stream": True}))
    events = [e for e in body.decode().split("\n\n") if e]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == full_text(client, kw)


def test_n_choices_and_prompt_lists_equal_their_single_requests(client):
    """Choice j of a prompt is the single request with seed + j; prompt i's choices are i*n .. i*n+n-1;
    usage counts each prompt once; streamed choices carry their index and join to the same texts."""
    kw = dict(model="tiny", max_tokens=10, temperature=0.9, seed=40)
    prompts = ["ab", "cd e"]
    for listed in (prompts, [[5, 6, 7], [8, 9]]):  # strings, or token-id lists as lm-evaluation-harness sends
        many = client.completions.create(prompt=listed, n=2, **kw)
        assert [c.index for c in many.choices] == list(range(4))
        singles = []
        for p in listed:
            for j in range(2):
                singles.append(client.completions.create(prompt=p, **{**kw, "seed": 40 + j}))
        assert [c.text for c in many.choices] == [s.choices[0].text for s in singles]
        assert many.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles[::2])
        assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    many = client.completions.create(prompt=prompts, n=2, **kw)
    assert len({c.text for c in many.choices[:2]}) == 2  # other seeds, other samples
    chunks = list(client.completions.create(prompt=prompts[:2], n=2, stream=True, **kw))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in many.choices[:4]]
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 4 and chunks[-1].usage is not None
    msgs = [{"role": "user", "content": "Why?"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, n=3, max_tokens=8, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1, 2] and len({c.message.content for c in chat.choices}) == 1
    one = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == one.choices[0].message.content
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens


def full_text(client, kw):
    return client.completions.create(**kw).choices[0].text


def test_stop_strings(client):
    kw = dict(model="tiny", prompt="xyz", max_tokens=40, temperature=0)
    text = full_text(client, kw)
    assert len(text) >= 6
    stop = text[3:5]
    cut = text[: text.find(stop)]
    out = client.completions.create(stop=[stop, "\u00ff never"], **kw)
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


def _one(client, spec):
    kind, prompt, n, temperature, seed, top_p, top_k = spec
    kw = dict(model="tiny", max_tokens=n, temperature=temperature, seed=seed, top_p=top_p)
    extra = {"top_k": top_k} if top_k else None
    if kind == "chat":
        r = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], extra_body=extra, **kw)
        return r.choices[0].message.content, r.usage.completion_tokens
    r = client.completions.create(prompt=prompt, extra_body=extra, **kw)
    return r.choices[0].text, r.usage.completion_tokens


def test_16_concurrent_clients_equal_their_single_requests(client):
    specs = []
    for i in range(16):
        temperature = 0.0 if i % 3 else 0.8
        specs.append(
            ("chat" if i % 2 else "text", "prompt " * (1 + i % 5) + str(i), 4 + 5 * (i % 7), temperature, i, 0.9, i % 4)
        )
    single = [_one(client, s) for s in specs]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda s: _one(client, s), specs))
    assert together == single
    assert any(t[1] > 10 for t in single)


BAD = {
    "malformed_json": ("/v1/completions", '{"model": "tiny", "prompt": "x"'),
    "not_an_object": ("/v1/completions", "[1, 2]"),
    "wrong_type_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": "5"}),
    "wrong_type_temperature": ("/v1/completions", {"prompt": "x", "temperature": "hot"}),
    "wrong_type_prompt": ("/v1/completions", {"prompt": 7}),
    "bad_token_id": ("/v1/completions", {"prompt": [1, 500]}),
    "negative_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": -3}),
    "zero_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    "huge_max_tokens": ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}),
    "prompt_longer_than_context": ("/v1/completions", {"prompt": "y" * (MAX_SEQ + 5)}),
    "unknown_model": ("/v1/completions", {"model": "gpt-4", "prompt": "x"}),
    "missing_model": ("/v1/completions", {"model": None, "prompt": "x"}),
    "n_0": ("/v1/completions", {"prompt": "x", "n": 0}),
    "n_too_large": ("/v1/completions", {"prompt": ["a", "b"], "n": 100}),
    "n_beyond_slots_and_queue": ("/v1/completions", {"prompt": "x", "n": 50}),
    "logprobs_21": ("/v1/completions", {"prompt": "x", "logprobs": 21}),
    "empty_token_prompt_in_list": ("/v1/completions", {"prompt": [[1, 2], []]}),
    "empty_prompt_list": ("/v1/completions", {"prompt": []}),
    "top_p_zero": ("/v1/completions", {"prompt": "x", "top_p": 0}),
    "negative_temperature": ("/v1/completions", {"prompt": "x", "temperature": -1}),
    "too_many_stops": ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(MAX_STOP + 1)]}),
    "empty_messages": ("/v1/chat/completions", {"messages": []}),
    "bad_role": ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    "message_without_content": ("/v1/chat/completions", {"messages": [{"role": "user"}]}),
    "chat_top_logprobs_21": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
    ),
    "chat_top_logprobs_without_logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ),
    "tools": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
    ),
    "unknown_field_in_a_message": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "y": 1}]}),
    "chat_too_long": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * MAX_SEQ}]}),
    "invocations_garbage": ("/invocations", "garbage"),
    "invocations_deeply_nested": ("/invocations", '{"messages":' + "[" * 100000 + "]" * 100000 + "}"),
    "chat_deeply_nested": ("/v1/chat/completions", '{"messages":' + "[" * 100000 + "]" * 100000 + "}"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_a_4xx_openai_error(server, case):
    path, body = BAD[case]
    if isinstance(body, dict):
        body = json.dumps({"model": "tiny", **body} if "model" not in body else {k: v for k, v in body.items() if v})
    status, _, raw = http(server.base, "POST", path, body)
    assert 400 <= status < 500, (status, raw)
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"]
    if case == "unknown_model":
        assert status == 404 and err["code"] == "model_not_found"
    if case == "prompt_longer_than_context":
        assert err["code"] == "context_length_exceeded"
    ok, _, _ = http(
        server.base, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})
    )
    assert ok == 200


def test_fields_the_openai_api_does_not_define_are_ignored_with_one_warning_line(server):
    """An SDK's field that the OpenAI API does not define changes nothing (the same greedy answer) and is
    named in one warning line of the log; an OpenAI parameter at its neutral value is accepted."""
    plain = {"model": "tiny", "messages": [{"role": "user", "content": "ign"}], "max_tokens": 4, "temperature": 0}
    extra = {**plain, "x_sdk_trace": {"id": 7}, "frobnicate": True, "tools": [], "store": False}
    answers = []
    for body in (plain, extra):
        status, _, raw = http(server.base, "POST", "/v1/chat/completions", json.dumps(body))
        assert status == 200, raw
        answers.append(json.loads(raw)["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]
    want = "chat: ignoring fields the OpenAI API does not define: frobnicate, x_sdk_trace"
    lines = [line for line in server.log.read_text().splitlines() if "does not define" in line]
    assert len(lines) == 1 and lines[0].endswith(want), lines


def test_a_port_in_use_is_one_error_line_before_anything_loads(server, model_dir):
    cmd = [sys.executable, "-m", "peagle_jax.serve", "--model", str(model_dir), "--port", str(server.port)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)  # bound before the model loads
    assert proc.returncode == 2
    want = f"error: cannot listen on 127.0.0.1:{server.port}: Address already in use"
    assert proc.stderr.strip().splitlines() == [want]


def test_an_api_key_guards_the_v1_routes(model_dir, tmp_path):
    import os

    key = "sk-test-" + "k" * 24
    os.environ["PEAGLE_API_KEY"] = key  # read as the default of --api-key
    try:
        proc = ServerProcess(
            "--model", str(model_dir), "--max-batch", "1", "--max-seq-len", "64", log=tmp_path / "server.log"
        ).wait()
    finally:
        del os.environ["PEAGLE_API_KEY"]
    try:
        body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            status, _, raw = http(proc.base, "POST", "/v1/completions", body, headers=headers)
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key", headers
        assert http(proc.base, "GET", "/v1/models")[0] == 401
        auth = {"Authorization": f"Bearer {key}"}
        assert http(proc.base, "POST", "/v1/completions", body, headers=auth)[0] == 200
        assert http(proc.base, "GET", "/v1/models", headers=auth)[0] == 200
        for path in ("/health", "/ping", "/metrics"):
            assert http(proc.base, "GET", path)[0] == 200, path
    finally:
        assert proc.stop() == 0
    assert key not in proc.log.read_text()


def test_wrong_method_and_path(server):
    for method, path, code in (("GET", "/v1/completions", 405), ("POST", "/v1/nothing", 404)):
        status, _, raw = http(server.base, method, path)
        assert status == code and json.loads(raw)["error"]["message"]


def _open_stream(server, max_tokens: int, stream: bool = True) -> socket.socket:
    """A raw (streaming) request whose client then vanishes (the socket is closed without reading)."""
    body = json.dumps({"model": "tiny", "prompt": "q", "max_tokens": max_tokens, "temperature": 0, "stream": stream})
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
    )
    return s


def _metrics(server) -> dict[str, float]:
    status, headers, raw = http(server.base, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return parse_metrics(raw.decode())


def _wait_idle(server, timeout=30):
    t0 = time.time()
    while time.time() - t0 < timeout:
        m = _metrics(server)
        if m["peagle_active_slots"] == 0 and m["peagle_queue_depth"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"slots still busy: {m}")


def _wait_for(server, name, value, timeout=10):
    t0 = time.time()
    while _metrics(server)[name] != value:
        assert time.time() - t0 < timeout, (name, _metrics(server))
        time.sleep(0.05)


def test_queue_bound_429_and_disconnect_cancels(server):
    # Saturate 4 slots + 24 queue places with requests whose clients then disconnect.
    before = _wait_idle(server)
    socks = [_open_stream(server, MAX_SEQ - 2) for _ in range(4)]
    _wait_for(server, "peagle_active_slots", 4)
    socks += [_open_stream(server, MAX_SEQ - 2) for _ in range(24)]
    _wait_for(server, "peagle_queue_depth", 24)
    status, headers, raw = http(server.base, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x"}))
    assert status == 429 and int(headers["retry-after"]) >= 1 and json.loads(raw)["error"]["type"] == "rate_limit_error"
    for s in socks:
        s.close()
    m = _wait_idle(server, timeout=8)  # run out, the 28 requests would take several times longer
    assert m["peagle_completion_tokens_total"] - before["peagle_completion_tokens_total"] < 8 * (MAX_SEQ - 2)
    assert m['peagle_requests_total{endpoint="completions",outcome="rejected"}'] >= 1
    assert m['peagle_requests_total{endpoint="completions",outcome="client_gone"}'] >= 1
    ok, _, _ = http(
        server.base, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 3})
    )
    assert ok == 200


def _status(sock: socket.socket) -> int:
    sock.settimeout(60)
    return int(sock.recv(64).split(b" ", 2)[1])


def test_a_burst_of_slots_plus_queue_is_accepted_whole(server):
    """4 slots + 24 queue places sent at once on an idle server: all 28 accepted (the engine thread admits
    them one prefill at a time, which must not count them as waiting), the 29th refused."""
    _wait_idle(server)
    socks = [_open_stream(server, MAX_SEQ - 2) for _ in range(28)]
    try:
        assert [_status(s) for s in socks] == [200] * 28
        extra = _open_stream(server, MAX_SEQ - 2)
        socks.append(extra)
        assert _status(extra) == 429
    finally:
        for s in socks:
            s.close()
    _wait_idle(server, timeout=8)


def test_a_non_streaming_client_that_disconnects_frees_its_slot(server):
    before = _wait_idle(server)
    socks = [_open_stream(server, MAX_SEQ - 2, stream=False) for _ in range(2)]
    _wait_for(server, "peagle_active_slots", 2)
    for s in socks:
        s.close()
    m = _wait_idle(server, timeout=3)  # the disconnect is seen at once, not when the answer is done
    assert m["peagle_completion_tokens_total"] - before["peagle_completion_tokens_total"] < MAX_SEQ - 2
    key = 'peagle_requests_total{endpoint="completions",outcome="client_gone"}'
    assert m[key] - before.get(key, 0) == 2


def _content_length(response: bytes) -> int:
    head = response.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    return next((int(line.split(":")[1]) for line in head.splitlines() if line.startswith("content-length:")), 0)


def test_an_oversized_body_is_413_while_health_answers(server):
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:  # declares 9 MiB, sends 1 KiB
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (9 << 20) + b" " * 1024
        )
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            chunk = s.recv(65536)
            assert chunk, data  # the server answered in full before closing
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head  # the limit is 8 MiB: refused without reading the rest
    assert "exceeds the limit" in json.loads(body)["error"]["message"]
    assert time.time() - t0 < 10
    assert http(server.base, "GET", "/health")[0] == 200


def test_metrics_count_requests_and_tokens(server, client):
    before = _wait_idle(server)
    out = client.completions.create(model="tiny", prompt="count me", max_tokens=7, temperature=0)
    after = _metrics(server)
    key = 'peagle_requests_total{endpoint="completions",outcome="ok"}'
    assert after[key] == before.get(key, 0) + 1
    assert (
        after["peagle_completion_tokens_total"] - before["peagle_completion_tokens_total"]
        == out.usage.completion_tokens
    )
    assert after["peagle_prompt_tokens_total"] - before["peagle_prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["peagle_step_seconds_count"] > before["peagle_step_seconds_count"]
    assert after['peagle_step_seconds_bucket{le="+Inf"}'] == after["peagle_step_seconds_count"]
    assert after["peagle_max_slots"] == 4 and "peagle_acceptance_length" not in after  # no drafter here


def test_sagemaker_invocations(server, client):
    kw = dict(prompt="inv", max_tokens=9, temperature=0)
    ref = client.completions.create(model="tiny", **kw)
    status, _, raw = http(server.base, "POST", "/invocations", json.dumps({"model": "tiny", **kw}))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == ref.choices[0].text
    msgs = [{"role": "user", "content": "inv"}]
    ref = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9, temperature=0)
    body = json.dumps({"model": "tiny", "messages": msgs, "max_tokens": 9, "temperature": 0})
    status, _, raw = http(server.base, "POST", "/invocations", body)
    out = json.loads(raw)
    assert status == 200 and out["choices"][0]["message"]["content"] == ref.choices[0].message.content
    assert out["usage"] == ref.usage.model_dump(exclude_none=True)


def _request_bodies():
    """JSON bodies over the request schema: a valid body (completion or chat, optional fields present or not),
    or one with a field out of range, of the wrong type, or unknown."""
    from hypothesis import strategies as st

    text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
    valid = {
        "model": st.just("tiny"),
        "max_tokens": st.integers(1, 12),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 200),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.one_of(text.filter(bool), st.lists(text.filter(bool), max_size=6)),
        "stream": st.booleans(),
        "n": st.integers(1, 2),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
        "logit_bias": st.dictionaries(st.integers(0, 127).map(str), st.floats(-100, 100), max_size=3),
        "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    }
    invalid = {
        "model": st.one_of(st.just("other"), st.integers()),
        "max_tokens": st.one_of(st.integers(max_value=0), st.integers(min_value=2000), st.floats(), st.text()),
        "temperature": st.one_of(st.floats(max_value=-0.01), st.floats(min_value=2.01), st.text()),
        "top_p": st.one_of(st.floats(max_value=0), st.floats(min_value=1.01), st.just([1])),
        "top_k": st.one_of(st.integers(max_value=-1), st.just("1")),
        "seed": st.one_of(st.integers(min_value=2**64), st.floats(0.5, 1.5)),
        "stop": st.one_of(st.just(""), st.lists(text, min_size=MAX_STOP + 1, max_size=MAX_STOP + 2), st.integers()),
        "stream": st.one_of(st.just("yes"), st.integers(2, 3)),
        "n": st.one_of(st.integers(max_value=0), st.integers(min_value=129), st.just("2")),
        "prompt": st.one_of(st.just([]), st.lists(st.integers(128, 10**6), min_size=1, max_size=3), st.just({})),
        "messages": st.one_of(st.just([]), st.just([{"role": "robot", "content": "x"}]), st.just([{"role": "user"}])),
        "logit_bias": st.one_of(st.just({"5": 101.0}), st.just({"x": 1.0}), st.just({"128": 1.0})),
        "presence_penalty": st.one_of(st.floats(min_value=2.01), st.floats(max_value=-2.01)),
        "response_format": st.one_of(st.just({"type": "json"}), st.just({"type": "json_schema", "json_schema": 1})),
    }
    prompt = st.one_of(text.filter(bool), st.lists(st.integers(0, 127), min_size=1, max_size=8))
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": text})
    optional = {k: v for k, v in valid.items() if k not in ("model", "max_tokens")}
    required = {"model": valid["model"], "max_tokens": valid["max_tokens"]}
    completion = st.fixed_dictionaries({**required, "prompt": prompt}, optional=optional)
    chat = st.fixed_dictionaries({**required, "messages": st.lists(message, min_size=1, max_size=3)}, optional=optional)

    @st.composite
    def body(draw):
        is_chat = draw(st.booleans())
        out = draw(chat if is_chat else completion)
        if draw(st.booleans()):  # break one field
            key = draw(st.sampled_from([k for k in invalid if k != ("prompt" if is_chat else "messages")]))
            out[key] = draw(invalid[key])
        path = draw(st.sampled_from(["/invocations", "/v1/chat/completions" if is_chat else "/v1/completions"]))
        return path, out

    return body()


def test_fuzz_request_schema(server):
    """Whatever the body, the answer is a 200 with a well-formed response or a 4xx with an OpenAI error."""
    from hypothesis import HealthCheck, given, settings

    seen = set()

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_request_bodies())
    def check(case):
        path, body = case
        status, _, raw = http(server.base, "POST", path, json.dumps(body))
        assert status < 500, (body, raw)
        seen.add(status)
        if status == 200 and body.get("stream") is True:
            events = [e for e in raw.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and "usage" in json.loads(events[-2][6:])
        elif status == 200:
            out = json.loads(raw)
            assert [c["index"] for c in out["choices"]] == list(range(body.get("n", 1)))
            assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
            assert out["usage"]["total_tokens"] >= 1
        else:
            assert 400 <= status < 500 and json.loads(raw)["error"]["message"], (body, raw)

    check()
    assert {200, 400} <= seen  # both outcomes were exercised
    ok, _, _ = http(
        server.base, "POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2})
    )
    assert ok == 200


def test_logprobs(server, model_dir):
    check_logprobs(server.base, "tiny", model_dir)


def test_a_disconnect_frees_its_slot_within_a_second_on_a_cold_start(model_dir, tmp_path):
    """An empty compilation cache: the server serves once the first graphs compiled and compiles the rest in
    the background. Requests whose context grows into windows (and row buckets) not compiled yet wait for
    those graphs, which the compiler takes next; the engine thread compiles nothing itself, so it goes on
    taking cancellations: a non-streaming client that disconnects frees its slot within a second."""
    args = ["--model", str(model_dir), "--max-batch", "4", "--max-seq-len", str(MAX_SEQ)]
    server = ServerProcess(*args, "--compilation-cache", str(tmp_path / "jax-cache"), log=tmp_path / "server.log")
    server.wait()
    try:
        seen_pending, freed_in = 0, []
        for _ in range(3):
            socks = [_open_stream(server, MAX_SEQ - 2, stream=False) for _ in range(2)]
            _wait_for(server, "peagle_active_slots", 2, timeout=30)
            time.sleep(0.5)  # into the answers: their windows grow
            seen_pending = max(seen_pending, _metrics(server)["peagle_graphs_pending"])
            t0 = time.time()
            for s in socks:
                s.close()
            _wait_idle(server, timeout=10)
            freed_in.append(time.time() - t0)
        assert seen_pending > 0  # the disconnects came while graphs were still compiling
        assert max(freed_in) < 1.0, freed_in
        # what comes after is decoded as before (its graphs compile on demand, first)
        ref = _generate_cli(model_dir, "x", 300)
        out = json.loads(
            http(
                server.base,
                "POST",
                "/v1/completions",
                json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 300, "temperature": 0}),
            )[2]
        )
        assert (
            out["choices"][0]["text"] == ref["text"] and out["usage"]["completion_tokens"] == ref["completion_tokens"]
        )
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log.read_text()
