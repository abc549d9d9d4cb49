"""``python -m peagle_jax.bench`` (MT-Bench acceptance and speed) on a tiny random target and drafter: it
runs end to end, writes its table, JSON and plots, and fails on any output that differs from plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from peagle_jax.bench.mtbench import MismatchError, acceptance_run, load_questions
from peagle_jax.errors import UserError


class _FakeGen:
    K = 2

    def __init__(self, outputs):
        self.outputs = outputs
        self.spec = None

    def generate(self, rows, **kw):
        from peagle_jax.engine import GenerationResult

        self.spec.target_forwards += len(rows)
        self.spec.emitted += sum(len(o) for o in self.outputs[: len(rows)])
        return [GenerationResult(o, "length") for o in self.outputs[: len(rows)]]


def test_a_mismatch_fails_the_run():
    kw = dict(batch=8, max_new_tokens=3, temperature=0.0, stops=[0])
    same = acceptance_run(_FakeGen([[1, 2], [3]]), [[5], [6]], [[1, 2], [3]], name="x", **kw)
    assert same["acceptance_length"] == 1.5
    with pytest.raises(MismatchError, match="question 1 differs"):
        acceptance_run(_FakeGen([[1, 2], [4]]), [[5], [6]], [[1, 2], [3]], name="x", **kw)


def test_questions_file(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"turns": ["first?", "second?"]}) + "\n" + json.dumps({"turns": ["b"]}) + "\n")
    assert load_questions(str(f), None) == ["first?", "b"]
    assert load_questions(str(f), 1) == ["first?"]
    f.write_text('{"turns": []}\n')
    with pytest.raises(UserError, match="q.jsonl:1"):
        load_questions(str(f), None)


@pytest.mark.slow
def test_bench_end_to_end(tmp_path):
    import jax.numpy as jnp

    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.train.pipeline import load_target, save_random_target
    from peagle_jax.train.recipe import Recipe, TargetConfig

    recipe = Recipe(target=TargetConfig(model="random", tokenizer="smollm2", hidden_size=32, num_layers=3))
    cfg, params, tok, _ = load_target(recipe)
    save_random_target(cfg, params, tok, tmp_path / "target")
    dcfg = DrafterConfig(
        layer=cfg.replace(num_layers=1, aux_layer_ids=()),
        target_hidden_size=cfg.hidden_size,
        mask_token_id=cfg.vocab_size - 1,
        own_embedding=False,
        draft_vocab_size=1024,
    )
    dparams = init_drafter_params(dcfg, jax.random.key(0))
    dparams["d2t"] = jnp.zeros((1024,), jnp.int32)
    dparams["t2d"] = jnp.zeros((cfg.vocab_size,), bool).at[:1024].set(True)
    save_drafter(tmp_path / "drafter", dcfg, dparams)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"turns": [q]}) + "\n" for q in ("What is JAX?", "Write a poem.", "2+2?")))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "peagle_jax.bench",
            "--model",
            str(tmp_path / "target"),
            "--drafter",
            str(tmp_path / "drafter"),
            "--questions-file",
            str(questions),
            "--max-new-tokens",
            "8",
            "--max-seq-len",
            "128",
            "--ks",
            "1,2",
            "--trees",
            "0,1,00",
            "--sampled-ks",
            "2",
            "--speed-ks",
            "1,2",
            "--speed-questions",
            "2",
            "--rounds",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    shapes = {(r["method"], r["shape"], r["temperature"]) for r in res["acceptance"]}
    assert (
        ("P-EAGLE", "K=2", 0.7) in shapes
        and ("EAGLE-3", "K=1", 0.0) in shapes
        and ("P-EAGLE tree", "0,1,00", 0.0) in shapes
        and ("P-EAGLE tree", "0,1,00", 0.7) in shapes
    )
    assert ("P-EAGLE", "K=1", 0.7) not in shapes and ("EAGLE-3", "K=1", 0.7) not in shapes  # --sampled-ks 2
    assert all(r["acceptance_length"] >= 1.0 for r in res["acceptance"])
    assert {(r["batch"], r["method"].split()[0]) for r in res["speed"]} >= {
        (1, "plain"),
        (4, "P-EAGLE"),
        (4, "EAGLE-3"),
    }
    timed = {(r["batch"], r["method"]) for r in res["speed"]}
    assert {(b, f"{m} K={k}") for b in (1, 4) for m in ("P-EAGLE", "EAGLE-3") for k in (1, 2)} <= timed
    assert [r["batch"] for r in res["peagle_over_eagle3"]] == [1, 4]
    assert all(r["ratio"] > 0 and r["peagle"].startswith("P-EAGLE K=") for r in res["peagle_over_eagle3"])
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "speedup.png").stat().st_size > 0
    assert "| P-EAGLE | K=2 |" in (out / "results.md").read_text()
