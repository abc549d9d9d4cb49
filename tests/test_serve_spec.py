"""The server with a drafter (speculative decoding through the slot engine), in SageMaker mode: concurrent
greedy and seeded requests equal plain decoding; /ping, /invocations and the acceptance metrics; the
SageMaker defaults and the flag errors of ``python -m peagle_jax.serve``."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from serve_fixtures import ServerProcess, check_logprobs, http, parse_metrics, write_tiny_drafter, write_tiny_model

from peagle_jax.drafter.shipped import shipped_drafter
from peagle_jax.errors import UserError

MAX_SEQ = 96
K = 3


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return write_tiny_model(root / "target"), write_tiny_drafter(root / "drafter", k=K)


@pytest.fixture(scope="module")
def server(dirs, tmp_path_factory):
    model, drafter = dirs
    args = ["--sagemaker", "--host", "127.0.0.1", "--model", str(model), "--drafter", str(drafter)]
    args += ["--max-batch", "3", "--max-seq-len", str(MAX_SEQ), "--served-model-name", "tiny-spec", "--load-k", "3:1"]
    args += ["--compile", "first"]  # every step length compiled: the metrics test counts the steps of each
    proc = ServerProcess(*args, log=tmp_path_factory.mktemp("log") / "server.log").wait()
    yield proc
    proc.stop()


def _plain_reference(model_dir, requests):
    """Plain (non-speculative) decoding of the same prompts in this process."""
    from transformers import AutoTokenizer

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cfg, params = load_target_any(model_dir)
    gen = Generator(cfg, params, max_seq_len=MAX_SEQ)
    stops = sorted(set(cfg.eos_token_ids) | {tok.eos_token_id})
    out = []
    for prompt, n, temperature, seed in requests:
        ids = gen.generate(
            [tok.encode(prompt)], max_new_tokens=n, temperature=temperature, seed=seed, stop_token_ids=stops
        )[0].token_ids
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def test_speculative_server_equals_plain_decoding(server, dirs):
    requests = [(f"prompt {i} " * (1 + i % 3), 5 + 4 * i, 0.0 if i % 2 else 0.9, 100 + i) for i in range(9)]

    def one(r):
        prompt, n, temperature, seed = r
        body = {"model": "tiny-spec", "prompt": prompt, "max_tokens": n, "temperature": temperature, "seed": seed}
        status, _, raw = http(server.base, "POST", "/invocations", json.dumps(body))
        assert status == 200, raw
        return json.loads(raw)["choices"][0]["text"]

    with ThreadPoolExecutor(9) as pool:
        texts = list(pool.map(one, requests))
    assert texts == _plain_reference(dirs[0], requests)


def test_penalties_and_logit_bias_under_speculation(server, dirs):
    """presence_penalty, frequency_penalty and logit_bias through the API, concurrent with free requests: the
    speculative server's tokens equal plain decoding with the same penalties (an in-process plain slot engine,
    which tests/test_penalties.py checks against a host reference); a banned token never appears."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator
    from peagle_jax.serve.slots import SlotEngine, SlotRequest

    e = 4 + ord("e") - 32  # the character tokenizer's id of "e" (serve_fixtures.VOCAB)
    requests = [
        ([10, 20, 30, 40], 24, 0.0, 1, dict(frequency_penalty=1.5, logit_bias={e: -100.0})),
        ([50, 51, 52], 20, 0.9, 2, dict(presence_penalty=1.0, logit_bias={e: 5.0, 60: -3.0})),
        ([70, 71], 18, 0.0, 3, {}),
        ([33, 34, 35, 36, 37], 22, 0.7, 4, dict(presence_penalty=-0.5, frequency_penalty=0.8)),
    ]

    def one(r):
        ids, n, temperature, seed, pen = r
        body = {"model": "tiny-spec", "prompt": ids, "max_tokens": n, "temperature": temperature, "seed": seed}
        body |= {k: {str(t): b for t, b in v.items()} if k == "logit_bias" else v for k, v in pen.items()}
        status, _, raw = http(server.base, "POST", "/v1/completions", json.dumps({**body, "return_token_ids": True}))
        assert status == 200, raw
        return json.loads(raw)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, requests))
    cfg, params = load_target_any(dirs[0])
    engine = SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 1, rules=True)
    for r, tokens in zip(requests, got, strict=True):
        ids, n, temperature, seed, pen = r
        events = [engine.admit(SlotRequest(ids, n, temperature, seed=seed, stop_token_ids=cfg.eos_token_ids, **pen))]
        while engine.active:
            events += engine.step()
        assert tokens == [t for ev in events for t in ev.tokens]
    assert e not in got[0] and got[1].count(e) > 2


def test_structured_outputs_under_speculation(server, dirs):
    """response_format (json_schema, json_object), structured_outputs (regex) and guided_choice through the
    speculative server, concurrent with a free request: the tokens equal constrained plain decoding (an
    in-process plain slot engine with the same grammars), finished answers match their grammars, /metrics
    counts the structured requests and their acceptance; bad grammars are a 400 naming the field."""
    import re

    from serve_fixtures import char_tokenizer

    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator
    from peagle_jax.grammar import Grammars
    from peagle_jax.serve.slots import SlotEngine, SlotRequest

    props = {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "s": {"type": "string", "maxLength": 3}}
    schema = {"type": "object", "properties": props, "required": ["n", "s"], "additionalProperties": False}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, 0.0,
         ("json_schema", schema)),
        ({"structured_outputs": {"regex": "[0-9]{2}-[a-c]+"}}, 0.8, ("regex", "[0-9]{2}-[a-c]+")),
        ({"guided_choice": ["red", "green"]}, 0.9, ("choice", ["red", "green"])),
        ({"response_format": {"type": "json_object"}}, 0.0, ("json_object", None)),
        ({}, 0.7, None),
    ]  # fmt: skip
    tok = char_tokenizer()
    before = parse_metrics(http(server.base, "GET", "/metrics")[2].decode())

    def one(i):
        extra, temperature, _ = cases[i]
        body = {"model": "tiny-spec", "prompt": tok.encode(f"ask {i}"), "max_tokens": 48, "temperature": temperature}
        status, _, raw = http(server.base, "POST", "/v1/completions", json.dumps({**body, "seed": i, **extra,
                                                                               "return_token_ids": True}))  # fmt: skip
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        return choice["token_ids"], choice["finish_reason"], choice["text"]

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(one, range(len(cases))))
    cfg, params = load_target_any(dirs[0])
    grammars = Grammars(tok, cfg.vocab_size, cfg.eos_token_ids)
    engine = SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 1, grammars=grammars)
    for i, ((_, temperature, spec), (tokens, finish, text)) in enumerate(zip(cases, got, strict=True)):
        grammar = None if spec is None else grammars.compile(*spec)
        req = SlotRequest(
            tok.encode(f"ask {i}"), 48, temperature, seed=i, stop_token_ids=cfg.eos_token_ids, grammar=grammar
        )
        events = [engine.admit(req)]
        while engine.active:
            events += engine.step()
        assert tokens == [t for ev in events for t in ev.tokens], i
        if spec is not None and finish == "stop":
            if spec[0] == "json_schema":
                value = json.loads(text)
                assert set(value) == {"n", "s"} and 0 <= value["n"] <= 99 and len(value["s"]) <= 3
            elif spec[0] == "regex":
                assert re.fullmatch(spec[1], text), text
            elif spec[0] == "choice":
                assert text in spec[1]
            else:
                assert isinstance(json.loads(text), dict)
    assert sum(finish == "stop" for _, finish, _ in got[:3]) >= 2
    m = parse_metrics(http(server.base, "GET", "/metrics")[2].decode())
    assert m["peagle_structured_requests_total"] == before["peagle_structured_requests_total"] + 4
    assert m["peagle_structured_target_forwards_total"] > before["peagle_structured_target_forwards_total"]
    assert 1.0 <= m["peagle_structured_acceptance_length"] <= K + 1
    for bad, param in [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ]:
        status, _, raw = http(
            server.base, "POST", "/v1/completions", json.dumps({"model": "tiny-spec", "prompt": "x", **bad})
        )
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and param in error["message"], raw
    assert one(4)[0] == got[4][0]  # still serving, the same answer


def test_logprobs_under_speculation(server, dirs):
    """The speculative server's log-probabilities are the plain target's (every emitted token)."""
    check_logprobs(server.base, "tiny-spec", dirs[0])


def test_ping_and_acceptance_metrics(server):
    status, _, raw = http(server.base, "GET", "/ping")
    assert status == 200 and json.loads(raw)["status"] == "ok"
    before = parse_metrics(http(server.base, "GET", "/metrics")[2].decode())["peagle_target_forwards_total"]
    body = {"model": "tiny-spec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:  # 3 at once: the slots fill up, so some steps run under --load-k
        answers = list(pool.map(lambda _: http(server.base, "POST", "/invocations", json.dumps(body)), range(3)))
    for status, _, raw in answers:
        assert status == 200 and json.loads(raw)["object"] == "chat.completion"
    _, _, raw = http(server.base, "GET", "/metrics")
    m = parse_metrics(raw.decode())
    forwards = m["peagle_target_forwards_total"]
    assert forwards > before and 1.0 <= m["peagle_acceptance_length"] <= K + 1  # counts requests, not warm-up
    per_position = [m[f'peagle_accepted_per_position_total{{position="{k}"}}'] for k in range(1, K + 1)]
    rates = [m[f'peagle_acceptance_rate{{position="{k}"}}'] for k in range(1, K + 1)]
    assert rates == pytest.approx([n / forwards for n in per_position], abs=1e-6)
    assert per_position == sorted(per_position, reverse=True)  # depth k accepted implies depth k-1 accepted
    assert m["peagle_acceptance_length"] == pytest.approx(1 + sum(per_position) / forwards, abs=1e-6)
    assert m['peagle_requests_total{endpoint="invocations",outcome="ok"}'] >= 1
    # --load-k 3:1: steps with all 3 slots busy drafted 1 token, the others K.
    assert m['peagle_speculative_steps_total{k="1"}'] > 0 and m[f'peagle_speculative_steps_total{{k="{K}"}}'] > 0
    # Fixed load thresholds keep every drafter current (only --load-k auto leaves it behind under load).
    assert m["peagle_unsynced_admissions_total"] == m["peagle_drafter_resyncs_total"] == 0
    assert not any(name.startswith("peagle_policy_step_seconds") for name in m)  # no --load-k auto policy


def test_answers_while_graphs_compile_in_the_background(dirs, tmp_path):
    """With an empty compilation cache the server is ready after the first graphs and answers a chat request
    while the others compile: with ``--load-k none`` plain steps are not a served step length, so the request
    waits for its drafting graphs, which the background compiler takes first (the engine thread compiles
    nothing itself). The answer equals plain ``generate --k 0``, and again once everything is compiled."""
    import subprocess
    import sys

    model, drafter = dirs
    args = ["--model", str(model), "--drafter", str(drafter), "--load-k", "none", "--compilation-cache", "none"]
    proc = ServerProcess(*args, "--max-batch", "4", "--max-seq-len", "1024", log=tmp_path / "server.log").wait()
    try:
        pending = proc.health()["graphs_pending"]
        body = {"model": "target", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 24}
        status, _, raw = http(proc.base, "POST", "/v1/chat/completions", json.dumps({**body, "temperature": 0}))
        assert status == 200, raw
        during = json.loads(raw)["choices"][0]["message"]["content"]
        m = parse_metrics(http(proc.base, "GET", "/metrics")[2].decode())
        assert 0 < m["peagle_graphs_pending"] <= pending and m["peagle_graphs_compiled"] > 0
        assert m.get('peagle_speculative_steps_total{k="0"}', 0) == 0  # no plain step (none compiled) ...
        assert m[f'peagle_speculative_steps_total{{k="{K}"}}'] > 0  # ... its drafting graphs came first
        while proc.health()["graphs_pending"]:
            assert proc.proc.poll() is None
            time.sleep(0.5)
        status, _, raw = http(proc.base, "POST", "/v1/chat/completions", json.dumps({**body, "temperature": 0}))
        after = json.loads(raw)["choices"][0]["message"]["content"]
        m = parse_metrics(http(proc.base, "GET", "/metrics")[2].decode())
        assert m[f'peagle_speculative_steps_total{{k="{K}"}}'] > 0 and m["peagle_graphs_pending"] == 0
        assert m["peagle_graphs_compiled"] > pending and m["peagle_compile_seconds"] > 0
    finally:
        assert proc.stop() == 0
    log = proc.log.read_text()
    assert "more compiling in the background" in log and "background compilation done" in log
    assert "Traceback" not in log
    cmd = [sys.executable, "-m", "peagle_jax.generate", "--model", str(model), "--chat", "--prompt", "Hi there"]
    cmd += ["--max-new-tokens", "24", "--max-seq-len", "1024", "--k", "0", "--json"]
    ref = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout)
    assert during == after == ref["text"]


@pytest.mark.parametrize("when", ["compiling before ready", "compiling in the background"])
def test_sigterm_while_compiling_stops_cleanly(dirs, tmp_path, when):
    """SIGTERM while graphs compile, before /health is ready or in the background: compilation stops after
    the graph it is on and the process exits 0 (XLA aborts a process that exits while it compiles on
    another thread)."""
    import urllib.error
    import urllib.request

    model, drafter = dirs
    args = ["--model", str(model), "--drafter", str(drafter), "--compilation-cache", "none"]
    proc = ServerProcess(*args, "--max-batch", "4", "--max-seq-len", "1024", log=tmp_path / "server.log")
    if when == "compiling before ready":
        t0 = time.time()
        while not proc.saw_503:  # the warm-up has begun and the port listens (refused until then)
            assert proc.proc.poll() is None and time.time() - t0 < 120, proc.log.read_text()
            try:
                urllib.request.urlopen(proc.base + "/health", timeout=5)
                pytest.fail("ready before a SIGTERM could be sent while compiling")
            except urllib.error.HTTPError as err:
                proc.saw_503 = err.code == 503
            except OSError:
                time.sleep(0.05)
    else:
        proc.wait()
        assert proc.health()["graphs_pending"] > 0
    t0 = time.time()
    assert proc.stop() == 0, proc.log.read_text()
    assert time.time() - t0 < 20
    log = proc.log.read_text()
    assert "Traceback" not in log and "terminate called" not in log
    if when == "compiling in the background":
        assert "background compilation stopped: the server is shutting down" in log


def test_sagemaker_defaults(tmp_path, monkeypatch):
    from peagle_jax.serve import __main__ as cli

    (tmp_path / "drafter").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "drafter" / "config.json").write_text("{}")
    monkeypatch.setattr(cli, "SAGEMAKER_MODEL_DIR", tmp_path)
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    args = cli.resolve(cli.build_parser().parse_args(["serve"]))
    assert (args.sagemaker, args.host, args.port) == (True, "0.0.0.0", 8080)
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "9090")  # set where SageMaker wants another port
    assert cli.resolve(cli.build_parser().parse_args(["serve"])).port == 9090
    assert cli.resolve(cli.build_parser().parse_args(["serve", "--port", "8081"])).port == 8081  # the flag wins
    assert cli.resolve(cli.build_parser().parse_args([])).port == 8000  # only the SageMaker mode reads it
    monkeypatch.setenv("SAGEMAKER_BIND_TO_PORT", "eighty")
    with pytest.raises(UserError, match="SAGEMAKER_BIND_TO_PORT='eighty'"):
        cli.resolve(cli.build_parser().parse_args(["serve"]))
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT")  # the rest expects the defaults
    assert (args.model, args.drafter) == (str(tmp_path), str(tmp_path / "drafter"))
    args = cli.resolve(cli.build_parser().parse_args([]))
    assert (args.sagemaker, args.host, args.port, args.model, args.drafter) == (
        False,
        "127.0.0.1",
        8000,
        "smollm2",
        str(shipped_drafter("smollm2-peagle")),  # the embedded target is speculated by default
    )
    assert args.adaptive_k and args.load_k == []  # the step length follows the measured throughput
    assert args.k is None and args.tree == "0,1,2,3,4,00,01"  # the shipped drafter's tree, as in generate
    chain = cli.resolve(cli.build_parser().parse_args(["--k", "3"]))
    assert chain.tree is None and chain.k == 3  # --k: a chain of K
    plain = cli.resolve(cli.build_parser().parse_args(["--k", "0"]))
    assert plain.drafter is None and not plain.adaptive_k
    fixed = cli.resolve(cli.build_parser().parse_args(["--load-k", "none"]))
    assert not fixed.adaptive_k and fixed.load_k == []
    pairs = cli.resolve(cli.build_parser().parse_args(["--load-k", "4:2,12:0"]))
    assert not pairs.adaptive_k and pairs.load_k == [(4, 2), (12, 0)]
    assert args.chains is None  # the default step lengths: a plain step or the draft
    chains = cli.resolve(cli.build_parser().parse_args(["--load-k", "auto:1,2"]))
    assert chains.adaptive_k and chains.load_k == [] and chains.chains == (1, 2)
    assert args.window_buckets is None  # the default windows
    windows = cli.resolve(cli.build_parser().parse_args(["--window-buckets", "1024,256"]))
    assert windows.window_buckets == (256, 1024)
    assert cli.resolve(cli.build_parser().parse_args(["--window-buckets", "none"])).window_buckets == ()
    other = cli.resolve(cli.build_parser().parse_args(["--model", str(tmp_path)]))
    assert other.drafter is None  # no shipped drafter for other targets


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--model", "/nonexistent", "--k", "3"], "need a drafter"),
        (["--k", "0", "--tree", "0,1"], "--k 0 turns speculative decoding off"),
        (["--k", "-1"], "--k must be >= 0"),
        (["--max-batch", "0"], "--max-batch"),
        (["--max-seq-len", "1"], "--max-seq-len"),
        (["--port", "70000"], "--port"),
        (["--model", "/nonexistent", "--load-k", "4:2"], "--drafter"),
        (["--drafter", "/nonexistent", "--load-k", "4"], "N:K pairs"),
        (["--drafter", "/nonexistent", "--load-k", "fast"], "'auto', 'auto:1', 'none'"),
        (["--drafter", "/nonexistent", "--load-k", "auto:0"], "chain lengths >= 1"),
        (["--drafter", "/nonexistent", "--load-k", "auto:one"], "chain lengths >= 1"),
        (["--window-buckets", "0"], "--window-buckets: expected 'none' or comma-separated positive sizes"),
        (["--window-buckets", "256,big"], "--window-buckets"),
        (["--model", "/nonexistent"], "/nonexistent"),
    ],
)
def test_flag_errors_are_one_line(argv, message, capsys):
    from peagle_jax.serve.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_platform_neuron_without_jax_neuronx(capsys):
    import importlib.util

    from peagle_jax.serve.__main__ import main

    if importlib.util.find_spec("jax_neuronx") is not None:
        pytest.skip("jax-neuronx is installed here")
    assert main(["--platform", "neuron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "jax-neuronx" in err[0] and "pip.repos.neuron.amazonaws.com" in err[0]


def test_unavailable_platform_is_one_line():
    """In a subprocess: selecting a backend changes JAX's global configuration."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [sys.executable, "-m", "peagle_jax.serve", "--platform", "tpu"], capture_output=True, text=True, env=env
    )
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith("error: --platform tpu"), proc.stderr
