"""lm-evaluation-harness (``lm-eval``) against the server: its ``local-completions`` model scores a small local
multiple-choice task (log-likelihoods: completions with ``echo``, ``logprobs: 1`` and ``max_tokens: 1``, four
prompts per request) and a small local generate-until task (greedy completions with five ``stop`` strings)
through ``python -m peagle_jax.serve``, plain and speculative, and every per-sample result and aggregate score
equals the same harness's with the same model in this process (:class:`InProcessLM`: a log-softmax of the
target's logits, the plain greedy :class:`~peagle_jax.engine.generator.Generator`). Hermetic: the tasks are YAML
files over JSON-lines data written here, the tokenizer is the model directory's."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from serve_fixtures import ServerProcess, http, parse_metrics, write_tiny_drafter, write_tiny_model

lm_eval = pytest.importorskip("lm_eval", reason='the test extra brings it: pip install -e ".[test]"')
from lm_eval.api.model import TemplateLM  # noqa: E402

MAX_SEQ = 128  # the longest prompt plus MAX_GEN fits, and so does one whole padded log-likelihood row (PAD)
MAX_GEN = 12
PAD = 64  # the in-process log-likelihood forward's one shape: every context + continuation fits

MC_DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Water freezes at", "choices": ["100 degrees", "0 degrees", "-40 degrees"], "answer": 1},
    {"question": "Cats say", "choices": ["woof", "moo", "meow", "quack"], "answer": 2},
    {"question": "Q: capital of France?\nA:", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
    {"question": "The longest is", "choices": ["x", "yy", "zzz"], "answer": 2},
    {"question": "", "choices": ["A", "Z"], "answer": 0},  # no context: the harness puts the EOS token first
]
GEN_PROMPTS = ["Once upon a time", "The answer is", "Hello, world", "def f(x):", "1, 2, 3,"]
UNTIL = ["\n", ".", "!", "?"]  # with the EOS string the harness adds, five stop strings (as humaneval)
TASKS = ["peagle_mc", "peagle_gen"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("lm_eval") / "tiny")


class InProcessLM(TemplateLM):
    """The served model in this process, as a harness model: a continuation's log-likelihood is the sum of a
    float64 log-softmax of the target's logits (one forward of context + continuation), greedy when every
    continuation token is the argmax; generation is plain greedy decoding to an EOS token or ``max_gen_toks``,
    cut at the first ``until`` string. It tokenizes as ``local-completions`` with a Hugging Face tokenizer
    does (no special tokens added)."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        from peagle_jax.checkpoint import load_target_any
        from peagle_jax.engine.generator import Generator

        super().__init__()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.cfg, self.params = load_target_any(model_dir)
        self.gen = Generator(self.cfg, self.params, max_seq_len=MAX_SEQ)
        self.stops = sorted(set(self.cfg.eos_token_ids) | {self.tokenizer.eos_token_id})

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=False).input_ids

    def _logprobs(self, ids: list[int]) -> np.ndarray:
        """Row i: the log-probabilities of the token after ``ids[: i + 1]``."""
        from peagle_jax.models import model as M

        assert len(ids) <= PAD
        tokens = jnp.asarray([ids + [0] * (PAD - len(ids))])  # right padding: causal, changes no row before it
        out, _ = M.forward_jit(
            self.params, M.new_cache(self.cfg, 1, PAD), tokens, jnp.zeros(1, jnp.int32), cfg=self.cfg
        )
        x = np.asarray(out.logits[0, : len(ids)], np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        out = []
        for _, context, continuation in requests:
            ids = context + continuation
            rows = self._logprobs(ids)[len(context) - 1 : -1]
            out.append(
                (
                    float(sum(row[t] for row, t in zip(rows, continuation, strict=True))),
                    all(int(row.argmax()) == t for row, t in zip(rows, continuation, strict=True)),
                )
            )
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else until
            ids = self.gen.generate(
                [self.tok_encode(context)],
                max_new_tokens=kwargs.get("max_gen_toks", MAX_GEN),
                temperature=0.0,
                stop_token_ids=self.stops,
            )[0].token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = [i for i in (text.find(s) for s in until) if i >= 0]
            out.append(text[: min(cut)] if cut else text)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the tasks here score continuations only")


@pytest.fixture(scope="module")
def reference(model_dir):
    return InProcessLM(model_dir)


def _metric(name: str) -> dict:
    return {"metric": name, "aggregation": "mean", "higher_is_better": True}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, reference):
    """The two tasks: YAML files and their JSON-lines data in one directory, and the generate-until task's
    exact-match score by construction. Its targets are the in-process greedy answers for every other prompt
    and a wrong one for the rest, and one multiple-choice document offers the greedy continuation, so that
    neither the scores nor the ``is_greedy`` flags are all the same."""
    from lm_eval.api.instance import Instance

    root = tmp_path_factory.mktemp("tasks")
    requests = [Instance("generate_until", {}, (p, {"until": UNTIL, "max_gen_toks": MAX_GEN}), 0) for p in GEN_PROMPTS]
    answers = reference.generate_until(requests)
    gen_docs = [
        {"prompt": p, "target": a + ("?" if i % 2 else "")}
        for i, (p, a) in enumerate(zip(GEN_PROMPTS, answers, strict=True))
    ]
    greedy = max(answers, key=len)
    mc_docs = [*MC_DOCS, {"question": GEN_PROMPTS[answers.index(greedy)], "choices": ["~~~", greedy[:3]], "answer": 1}]
    for name, docs, fields in (
        (
            "peagle_mc",
            mc_docs,
            dict(
                output_type="multiple_choice",
                doc_to_text="{{question}}",
                doc_to_choice="{{choices}}",
                doc_to_target="{{answer}}",
                target_delimiter="",  # the greedy choice continues its prompt directly
                metric_list=[_metric("acc"), _metric("acc_norm")],
            ),
        ),
        (
            "peagle_gen",
            gen_docs,
            dict(
                output_type="generate_until",
                doc_to_text="{{prompt}}",
                doc_to_target="{{target}}",
                generation_kwargs={"until": UNTIL, "max_gen_toks": MAX_GEN, "do_sample": False, "temperature": 0.0},
                metric_list=[_metric("exact_match")],
            ),
        ),
    ):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(root / "hf-cache")},
            "test_split": "test",
            **fields,
        }
        (root / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return root, len(mc_docs), len(gen_docs[::2]) / len(gen_docs)


def _evaluate(model, tasks_dir, **kwargs) -> dict:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(
        model=model, tasks=TASKS, task_manager=manager, log_samples=True, bootstrap_iters=0, **kwargs
    )


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _scores(sample: dict) -> tuple[list[float], list[bool]]:
    """A multiple-choice sample's log-likelihood and is-greedy flag per choice."""
    return [r[0][0] for r in sample["resps"]], [r[0][1] for r in sample["resps"]]


@pytest.fixture(scope="module")
def in_process(reference, tasks):
    return _evaluate(reference, tasks[0])


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_local_completions_scores_equal_in_process(speculative, model_dir, tasks, in_process, tmp_path):
    """The plain server gets token-id prompts (the harness's default) one request at a time, the speculative
    one strings (``tokenized_requests=False``) two requests at a time; both get four prompts per request."""
    tasks_dir, mc_docs, exact_match = tasks
    args = ["--model", str(model_dir), "--max-batch", "4", "--max-seq-len", str(MAX_SEQ)]
    if speculative:
        # Every step drafts (K = 3), its graphs compiled before the server answers.
        args += ["--drafter", str(write_tiny_drafter(tmp_path / "drafter")), "--load-k", "none", "--compile", "first"]
    server = ServerProcess(*args, log=tmp_path / "server.log").wait()
    try:
        model_args = {
            "model": "tiny",
            "base_url": server.base + "/v1/completions",
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": not speculative,
            "batch_size": 4,
            "num_concurrent": 2 if speculative else 1,
            "max_gen_toks": MAX_GEN,
            "max_retries": 1,
        }
        served = _evaluate("local-completions", tasks_dir, model_args=model_args)
        metrics = parse_metrics(http(server.base, "GET", "/metrics")[2].decode())
    finally:
        exit_code = server.stop()
    assert exit_code == 0 and "Traceback" not in server.log.read_text()
    if speculative:  # the generations' steps drafted and verified three tokens each
        assert metrics['peagle_speculative_steps_total{k="3"}'] > 0
        assert 'peagle_speculative_steps_total{k="0"}' not in metrics

    # Batched: one request per four log-likelihoods (one per choice), and per four generations.
    loglikelihoods = sum(len(s["arguments"]) for s in _samples(in_process, "peagle_mc"))
    batches = -(-loglikelihoods // 4) + -(-len(GEN_PROMPTS) // 4)
    assert metrics['peagle_requests_total{endpoint="completions",outcome="ok"}'] == batches
    greedy = []
    for got, want in zip(_samples(served, "peagle_mc"), _samples(in_process, "peagle_mc"), strict=True):
        assert got["doc_id"] == want["doc_id"] and got["arguments"] == want["arguments"]
        got_ll, got_greedy = _scores(got)
        want_ll, want_greedy = _scores(want)
        np.testing.assert_allclose(got_ll, want_ll, atol=1e-4, rtol=0)
        assert got_greedy == want_greedy
        greedy += want_greedy
        assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"])
    assert any(greedy) and not all(greedy)
    for got, want in zip(_samples(served, "peagle_gen"), _samples(in_process, "peagle_gen"), strict=True):
        assert (got["doc_id"], got["resps"], got["exact_match"]) == (want["doc_id"], want["resps"], want["exact_match"])
    assert served["results"] == in_process["results"]
    assert served["results"]["peagle_mc"]["sample_len"] == mc_docs
    assert served["results"]["peagle_gen"]["exact_match,none"] == exact_match
