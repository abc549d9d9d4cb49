"""The server under hostile and slow clients: the soak (``python -m peagle_jax.bench.soak``) at CI size,
bodies sent a byte at a time, stalled clients, garbage on the socket, a client gone mid-body, and SIGTERM
with streams in flight; plus the soak's pure parts (its traffic mix, answer parsing, checks, summary)."""

from __future__ import annotations

import json
import random
import signal
import socket
import threading
import time
from http.client import HTTPResponse

import pytest
from serve_fixtures import ServerProcess, http, parse_metrics, write_tiny_model

from peagle_jax.bench import soak
from peagle_jax.serve import protocol

MAX_SEQ = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("reliability") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--model", str(model_dir), "--max-batch", "2", "--max-seq-len", str(MAX_SEQ), "--compile", "first"]
    proc = ServerProcess(*args, log=tmp_path_factory.mktemp("log") / "server.log").wait()
    yield proc
    proc.stop()  # the SIGTERM test stops it first
    assert "Traceback" not in proc.log.read_text()


# -- the soak's pure parts ---------------------------------------------------------------------------


def test_the_traffic_mix_has_every_kind_and_valid_bodies_are_valid():
    pool = soak.greedy_pool(0, "tiny", MAX_SEQ)
    assert len({json.dumps(b) for _, b in pool}) == soak.GREEDY_POOL and all(b["temperature"] == 0 for _, b in pool)
    rng = random.Random(1)
    actions = [soak.plan(rng, pool, "tiny", MAX_SEQ) for _ in range(3000)]
    kinds = {k: sum(a.kind == k for a in actions) / len(actions) for k in ("request", "disconnect", "bad")}
    assert 0.07 < kinds["disconnect"] < 0.13 and 0.07 < kinds["bad"] < 0.13, kinds
    variants = {(a.kind, a.variant) for a in actions}
    assert {("bad", v) for v in soak.BAD_VARIANTS} <= variants
    assert {("disconnect", v) for v in soak.DISCONNECT_VARIANTS} <= variants
    assert {("request", "greedy"), ("request", "sampled")} <= variants
    for a in actions:
        if a.kind in ("request", "disconnect") or a.variant == "slow_body":
            schema = protocol.ChatRequest if a.path.endswith("chat/completions") else protocol.CompletionRequest
            req = protocol.parse(schema, a.body)
            prompt = req.messages[0].content if schema is protocol.ChatRequest else req.prompt
            assert len(prompt) + 40 + req.max_tokens < MAX_SEQ  # the prompt (chars, template) and answer fit
            assert (a.greedy is not None) == (req.temperature == 0) and req.stream == a.stream
        elif a.kind == "bad" and a.variant != "garbage_http":
            schema = protocol.ChatRequest if a.path.endswith("chat/completions") else protocol.CompletionRequest
            with pytest.raises(protocol.APIError):  # each is refused by the schema or later by the server
                req = protocol.parse(schema, a.body)
                if req.model != "tiny" or (req.max_tokens or 0) > MAX_SEQ:
                    raise protocol.APIError(400, "refused by the server")


def test_answers_are_parsed_and_checked():
    plain = json.dumps({"choices": [{"text": "ab", "finish_reason": "length"}]}).encode()
    assert soak.parse_answer(plain, False) == ("ab", "length", False)
    chat = json.dumps({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}).encode()
    assert soak.parse_answer(chat, False) == ("hi", "stop", False)
    events = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    events += [{"choices": [{"delta": {"content": "h"}, "finish_reason": None}]}]
    events += [{"choices": [{"delta": {"content": "i"}, "finish_reason": "length"}], "usage": {}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
    assert soak.parse_answer((sse + "data: [DONE]\n\n").encode(), True) == ("hi", "length", False)
    assert soak.parse_answer(sse.encode(), True)[1] is None  # cut short: no [DONE]
    err = 'data: {"error": {"message": "x"}}\n\n'
    assert soak.parse_answer(err.encode(), True)[2]

    def rec(kind, variant, status, **kw):
        return {"kind": kind, "variant": variant, "status": status, "greedy": None, **kw}

    assert soak.check_record(rec("request", "sampled", 200, finish="stop")) is None
    assert soak.check_record(rec("request", "sampled", 429)) is None
    assert "status 500" in soak.check_record(rec("bad", "garbage_http", 500))
    assert soak.check_record(rec("bad", "garbage_http", 200)) is None
    assert soak.check_record(rec("bad", "garbage_http", None)) is None
    assert "expected a 4xx" in soak.check_record(rec("bad", "malformed_json", 200))
    assert "status 400" in soak.check_record(rec("request", "greedy", 400))
    assert "no finish_reason" in soak.check_record(rec("request", "greedy", 200, finish=None))
    assert "client error" in soak.check_record(rec("request", "greedy", None, client_error="TimeoutError"))
    assert "error event" in soak.check_record(rec("request", "greedy", 200, finish=None, error_event=True))
    assert soak.check_record(rec("disconnect", "mid_stream", None)) is None
    assert soak.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and soak.percentile([3.0, 1.0, 2.0, 4.0], 99) == 4.0
    counts = soak.summarize([rec("request", "greedy", 200), rec("disconnect", "mid_body", None), rec("bad", "x", 400)])
    assert counts["by_status"] == {"200": 1, "400": 1, "disconnected": 1}
    assert (counts["disconnects"], counts["bad_requests"], counts["completed_requests"]) == (1, 1, 1)


def test_bad_flags_are_one_line_errors(capsys):
    for argv, want in (
        (["--seconds", "0"], "error: --seconds must be >= 1"),
        (["--max-seq-len", "64"], "error: --max-seq-len must be >= 128"),
        (["--serve-args", "--port 9"], "error: --serve-args: --port is set by the soak itself"),
        (["--serve-args", "'unclosed"], "error: --serve-args"),
    ):
        assert soak.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(want) and len(err.strip().splitlines()) == 1, err


# -- a real server -----------------------------------------------------------------------------------


def test_the_soak_at_ci_size(model_dir, tmp_path, capsys):
    out = tmp_path / "soak.json"
    argv = ["--model", str(model_dir), "--seconds", "40", "--max-batch", "2", "--max-seq-len", str(MAX_SEQ)]
    assert soak.main([*argv, "--seed", "3", "--json", str(out)]) == 0, capsys.readouterr()
    result = json.loads(out.read_text())
    counts = result["counts"]
    assert counts["disconnects"] > 0 and counts["bad_requests"] > 0 and counts["completed_requests"] > 0
    assert result["greedy"]["checked"] > 0 and not result["greedy"]["mismatches"]
    assert not [s for s in counts["by_status"] if s.startswith("5")]
    assert all(problem is None for problem in result["invariants"].values())
    assert result["health"]["polls"] > 40 and result["health"]["max_ms"] < 1000
    assert result["rss_mib"]["peak"] > 0 and result["idle_after_s"] is not None
    assert "| invariant | result |" in capsys.readouterr().out


class HealthPoller(threading.Thread):
    """Polls /health every 0.1 s until stopped; ``worst`` is the slowest answer (inf for a failed one)."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.worst, self.polls = server, 0.0, 0
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(0.1):
            t = time.perf_counter()
            try:
                ok = http(self.server.base, "GET", "/health", timeout=10)[0] == 200
            except OSError:
                ok = False
            self.worst = max(self.worst, time.perf_counter() - t if ok else float("inf"))
            self.polls += 1

    def stop(self):
        self.done.set()
        self.join()


def _request(path: str, body: dict) -> tuple[bytes, bytes]:
    return soak.request_bytes(path, json.dumps(body).encode())


def test_a_body_sent_a_byte_at_a_time_is_served_while_health_answers(server):
    body = {"model": "tiny", "prompt": "slowly, one byte at a time", "max_tokens": 12, "temperature": 0}
    _, _, raw = http(server.base, "POST", "/v1/completions", json.dumps(body))
    want = json.loads(raw)["choices"][0]["text"]
    head, payload = _request("/v1/completions", body)
    poller = HealthPoller(server)
    poller.start()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        for i in range(len(head + payload)):
            s.sendall((head + payload)[i : i + 1])
            time.sleep(0.01)
        status, raw = soak.read_response(s)
    poller.stop()
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == want
    assert poller.polls >= 10 and poller.worst < 1.0, poller.worst


def test_stalled_clients_do_not_block_others(server):
    body = {"model": "tiny", "prompt": "stalled", "max_tokens": 6, "temperature": 0}
    head, payload = _request("/v1/completions", body)
    stalled_body = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    stalled_body.sendall(head + payload[:5])  # headers, then 5 bytes of the body, then nothing
    stalled_head = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    stalled_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # half a header
    try:
        t0 = time.perf_counter()
        for _ in range(3):
            status, _, raw = http(server.base, "POST", "/v1/completions", json.dumps(body), timeout=30)
            assert status == 200, raw
            want = json.loads(raw)["choices"][0]["text"]
        assert time.perf_counter() - t0 < 30
        t0 = time.perf_counter()
        assert http(server.base, "GET", "/health")[0] == 200 and time.perf_counter() - t0 < 1.0
        stalled_body.sendall(payload[5:])  # the stalled client resumes and is answered normally
        status, raw = soak.read_response(stalled_body)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == want
    finally:
        stalled_body.close()
        stalled_head.close()


def _raw(server, data: bytes) -> int | None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before reading everything
            pass
        return soak.read_response(s)[0]


def test_garbage_and_bad_bodies_never_5xx_nor_a_traceback(server):
    rng = random.Random(7)
    statuses = []
    for make in soak.GARBAGE_HTTP:
        statuses.append(_raw(server, make(rng)))
    for _ in range(20):
        statuses.append(_raw(server, rng.randbytes(rng.randint(1, 4096))))
    assert all(s is None or s < 500 for s in statuses), statuses
    assert 400 in statuses  # most garbage is answered 400
    pool = soak.greedy_pool(0, "tiny", MAX_SEQ)
    for variant in soak.BAD_VARIANTS:
        if variant in ("garbage_http", "slow_body"):
            continue
        for _ in range(3):
            action = soak.bad_action(rng, variant, pool, "tiny")
            rec = soak.execute(action, server.port, rng)
            assert rec["status"] is not None and 400 <= rec["status"] < 500, (variant, rec)
            if variant == "unknown_model":
                assert rec["status"] == 404, (action, rec)
    assert http(server.base, "GET", "/health")[0] == 200
    assert "Traceback" not in server.log.read_text()


def _metrics(server) -> dict[str, float]:
    return parse_metrics(http(server.base, "GET", "/metrics")[2].decode())


def test_a_client_gone_mid_body_is_counted_not_an_error(server):
    key = 'peagle_requests_total{endpoint="completions",outcome="%s"}'
    before = _metrics(server)
    head, payload = _request("/v1/completions", {"model": "tiny", "prompt": "gone", "max_tokens": 4})
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
            s.sendall(head + payload[: len(payload) // 2])
            time.sleep(0.2)  # the handler is reading the body when the client goes
    t0 = time.time()
    while _metrics(server).get(key % "client_gone", 0) - before.get(key % "client_gone", 0) < 2:
        assert time.time() - t0 < 10, _metrics(server)
        time.sleep(0.1)
    assert _metrics(server).get(key % "error", 0) == before.get(key % "error", 0)
    assert "Traceback" not in server.log.read_text()


def test_sigterm_drains_the_streams_in_flight_and_exits_0(server):
    """Last: it stops the module's server."""
    n = MAX_SEQ - 16
    results: dict[int, tuple[float, bytes]] = {}
    started = threading.Barrier(4)

    def stream(i: int):
        body = {"model": "tiny", "prompt": f"drain {i}", "max_tokens": n, "temperature": 0, "stream": True}
        head, payload = _request("/v1/completions", body)
        with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
            s.sendall(head + payload)
            r = HTTPResponse(s)
            r.begin()  # the head of the answer: the request was accepted (in a slot or queued)
            started.wait()
            raw = r.read()
            results[i] = (time.perf_counter(), r.status, raw)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    server.proc.send_signal(signal.SIGTERM)
    t0 = time.perf_counter()
    while True:  # the listening socket closes at once
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
        except ConnectionRefusedError:
            refused = time.perf_counter()
            break
        assert time.perf_counter() - t0 < 5, "new connections still accepted 5 s after SIGTERM"
        time.sleep(0.05)
    assert server.proc.wait(120) == 0
    for t in threads:
        t.join(10)
    assert sorted(results) == [0, 1, 2]
    for done, status, raw in results.values():
        assert done > refused  # still streaming when the listener closed
        assert status == 200
        text, finish, error = soak.parse_answer(raw, True)
        last = json.loads(raw.decode().split("\n\n")[-3][6:])
        assert finish == "length" and not error and last["usage"]["completion_tokens"] == n
