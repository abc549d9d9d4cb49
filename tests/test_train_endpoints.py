"""Regeneration through OpenAI-compatible servers (``data.regen_endpoints``, peagle_jax.train.endpoints):
two local servers of the tiny target give the shards that in-process regeneration gives (greedy token ids),
also when one server is killed mid-run and when the run is resumed; bad endpoints are one clear error."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from serve_fixtures import ServerProcess, http, write_tiny_model

from peagle_jax.checkpoint import load_target_any
from peagle_jax.engine.generator import Generator
from peagle_jax.train.endpoints import EndpointGenerator, parse_endpoints
from peagle_jax.train.prompts import DataError
from peagle_jax.train.regen import regenerate

NEW = 12
KW = dict(max_prompt_tokens=40, max_new_tokens=NEW, batch=4, shard_size=4, temperature=0.0, progress=False)


def _shards(directory) -> list[str]:
    return [p.read_text() for p in sorted(directory.glob("shard-*.jsonl"))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("endpoints") / "model", seed=3)


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("endpoint-logs")
    flags = ["--model", str(model_dir), "--max-seq-len", "64", "--max-batch", "2"]
    procs = [ServerProcess(*flags, log=logs / f"server{i}.log") for i in range(2)]
    try:
        yield [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.stop()


def test_two_servers_one_killed_mid_run_equal_in_process_regeneration(model_dir, servers, tmp_path):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 128, int(n)).tolist() for n in rng.integers(2, 30, 14)]
    prompts[5] = list(range(3, 50))  # longer than max_prompt_tokens: skipped by both
    cfg, params = load_target_any(model_dir)
    stops = sorted(cfg.eos_token_ids)
    regenerate(Generator(cfg, params, max_seq_len=64), prompts, tmp_path / "ref", stop_token_ids=stops, **KW)

    gen = EndpointGenerator([s.base for s in servers], concurrency=2, retry_wait_s=0.05)
    calls = []

    class KillAfterFirstBatch:
        """The endpoint generator; the second server is killed after the first batch."""

        def generate(self, batch, **kw):
            out = gen.generate(batch, **kw)
            calls.append(len(batch))
            if len(calls) == 1:
                servers[1].proc.kill()
                servers[1].proc.wait()
            return out

    regenerate(KillAfterFirstBatch(), prompts, tmp_path / "remote", stop_token_ids=stops, **KW)
    assert len(calls) > 1 and servers[1].proc.poll() is not None
    assert _shards(tmp_path / "remote") == _shards(tmp_path / "ref")
    records = [json.loads(line) for text in _shards(tmp_path / "ref") for line in text.splitlines()[1:]]
    assert sum("response_ids" in r for r in records) == 13 and any(r.get("finish_reason") == "length" for r in records)

    # A run that stopped after its first shard resumes through the surviving server: nothing lost or doubled.
    for path in sorted((tmp_path / "remote").glob("shard-*.jsonl"))[1:]:
        path.unlink()
    regenerate(gen, prompts, tmp_path / "remote", stop_token_ids=stops, **KW)
    assert _shards(tmp_path / "remote") == _shards(tmp_path / "ref")


def test_the_server_returns_token_ids_and_stops_at_extra_stop_ids(model_dir, servers):
    alive = next(s for s in servers if s.proc.poll() is None)
    model = json.loads(http(alive.base, "GET", "/v1/models")[2])["data"][0]["id"]
    body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    status, _, raw = http(alive.base, "POST", "/v1/completions", json.dumps(body))
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    cfg, params = load_target_any(model_dir)
    (ref,) = Generator(cfg, params, max_seq_len=64).generate([[5, 6, 7]], max_new_tokens=6, temperature=0.0)
    assert choice["prompt_token_ids"] == [5, 6, 7] and choice["token_ids"] == ref.token_ids[:6]
    # Several prompts: each choice carries its own prompt's ids.
    status, _, raw = http(alive.base, "POST", "/v1/completions", json.dumps({**body, "prompt": [[5, 6, 7], [9, 8]]}))
    choices = json.loads(raw)["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [[5, 6, 7], [9, 8]] and choices[0] == choice
    # Chat (vLLM's shape): the prompt's ids once in the response, the answer's in each choice; the ids are
    # those a completions request with that prompt answers.
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    status, _, raw = http(alive.base, "POST", "/v1/chat/completions", json.dumps({**chat, "return_token_ids": True}))
    assert status == 200, raw
    reply = json.loads(raw)
    again = {**body, "prompt": reply["prompt_token_ids"]}
    plain = json.loads(http(alive.base, "POST", "/v1/completions", json.dumps(again))[2])["choices"][0]
    assert reply["choices"][0]["token_ids"] == plain["token_ids"] and "prompt_token_ids" not in reply["choices"][0]
    first = choice["token_ids"][0]
    status, _, raw = http(alive.base, "POST", "/v1/completions", json.dumps({**body, "stop_token_ids": [first]}))
    choice = json.loads(raw)["choices"][0]
    assert choice["token_ids"] == [first] and choice["finish_reason"] == "stop"
    status, _, raw = http(alive.base, "POST", "/v1/completions", json.dumps({**body, "stream": True}))
    assert status == 400 and "return_token_ids" in raw.decode()


def test_bad_endpoints_are_one_clear_error():
    with pytest.raises(DataError, match="not an http:// or https:// URL"):
        parse_endpoints("localhost:8000")
    assert parse_endpoints("http://a:1/v1/, https://b:2") == ["http://a:1", "https://b:2"]
    with pytest.raises(DataError, match="no server answered GET /v1/models"):
        EndpointGenerator(["http://127.0.0.1:9"], timeout_s=5)
    gen = EndpointGenerator(["http://127.0.0.1:9"], model="m", timeout_s=5, retry_wait_s=0)
    with pytest.raises(DataError, match="a prompt failed 3 times"):
        gen.generate([[1, 2]], max_new_tokens=2)


def test_recipe_keys_are_checked(tmp_path):
    from peagle_jax.models.config import ConfigError
    from peagle_jax.train.recipe import DataConfig, load_recipe

    assert DataConfig(regen_endpoints="http://a:1, https://b:2").regen_concurrency == 8
    (tmp_path / "r.yaml").write_text("data:\n  regen_endpoints: [http://a:1, http://b:2/v1]\n")
    assert load_recipe(tmp_path / "r.yaml").data.regen_endpoints == "http://a:1,http://b:2/v1"
    assert load_recipe(None, ["data.regen_endpoints=[http://c:3]"]).data.regen_endpoints == "http://c:3"
    with pytest.raises(ConfigError, match="data.regen_endpoints must be comma-separated http:// or https:// URLs"):
        load_recipe(None, ["data.regen_endpoints=[1, 2]"])
    with pytest.raises(ConfigError, match="regen_endpoints expects a str"):
        load_recipe(None, ["data.regen_endpoints={a: 1}"])
    with pytest.raises(ConfigError, match="data.regen_endpoints must be comma-separated http:// or https:// URLs"):
        DataConfig(regen_endpoints="a:1")
    with pytest.raises(ConfigError, match="data.regen_concurrency must be >= 1"):
        DataConfig(regen_concurrency=0)


class _Fake(BaseHTTPRequestHandler):
    """A stand-in completions server: ``ok`` answers the prompt reversed as token ids; ``cut`` drops the
    connection mid-answer (a server killed mid-request); ``500`` fails; ``no_ids`` ignores return_token_ids;
    ``bos`` reports a prompt with a BOS added."""

    def do_GET(self):  # /v1/models: the mode names the model
        raw = json.dumps({"object": "list", "data": [{"id": self.server.mode, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode = self.server.mode
        self.server.calls += 1
        choice = {"text": "x", "finish_reason": "length", "prompt_token_ids": body["prompt"]}
        if mode == "ok":
            choice["token_ids"] = body["prompt"][::-1]
        elif mode == "bos":
            choice.update(token_ids=[1], prompt_token_ids=[0, *body["prompt"]])
        raw = json.dumps({"choices": [choice]}).encode()
        self.send_response(500 if mode == "500" else 200)
        self.send_header("Content-Length", str(len(raw) + (100 if mode == "cut" else 0)))
        self.end_headers()
        self.wfile.write(raw[: len(raw) // 2] if mode == "cut" else raw)
        if mode == "cut":
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    """fake(mode) -> (base URL, server): a stand-in server in a thread, stopped after the test."""
    started = []

    def start(mode):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
        srv.mode, srv.calls = mode, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_port}", srv

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def test_failing_servers_hand_their_prompts_to_the_others(fake):
    (cut, cut_srv), (err, err_srv), (ok, ok_srv) = fake("cut"), fake("500"), fake("ok")
    prompts = [[i, i + 1, i + 2] for i in range(10)]
    gen = EndpointGenerator([cut, err, ok], model="m", concurrency=2, retry_wait_s=0)
    out = gen.generate(prompts, max_new_tokens=3)
    assert [r.token_ids for r in out] == [p[::-1] for p in prompts]
    assert ok_srv.calls == 10 and cut_srv.calls > 0 and err_srv.calls > 0


def test_servers_of_different_models_are_refused(fake):
    (a, _), (b, _), (down, _) = fake("ok"), fake("no_ids"), ("http://127.0.0.1:9", None)
    assert EndpointGenerator([down, a], timeout_s=5).model == "ok"
    with pytest.raises(DataError, match="serve different models"):
        EndpointGenerator([a, b, down], timeout_s=5)


@pytest.mark.parametrize(("mode", "match"), [("no_ids", "return_token_ids"), ("bos", "other prompt token ids")])
def test_a_server_that_cannot_answer_exactly_stops_at_once(fake, mode, match):
    url, srv = fake(mode)
    with pytest.raises(DataError, match=match):
        EndpointGenerator([url, url], model="m", retry_wait_s=0).generate([[1, 2]], max_new_tokens=2)
    assert srv.calls == 1  # not retried
