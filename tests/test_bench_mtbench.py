"""``python -m peagle_jax.bench`` (MT-Bench acceptance and speed) on a tiny random target and drafter: it
runs end to end, writes its table, JSON and plots, and fails on any output that differs from plain decoding."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import pytest

from peagle_jax.bench.mtbench import MismatchError, acceptance_run, fixed_k_speedups, load_questions
from peagle_jax.bench.progress import digest
from peagle_jax.errors import UserError


class _FakeGen:
    K = 2

    def __init__(self, outputs):
        self.outputs = outputs
        self.spec = None

    def generate(self, rows, **kw):
        from peagle_jax.engine.generator import GenerationResult

        self.spec.target_forwards += len(rows)
        self.spec.emitted += sum(len(o) for o in self.outputs[: len(rows)])
        return [GenerationResult(o, "length") for o in self.outputs[: len(rows)]]


def test_a_mismatch_fails_the_run():
    kw = dict(batch=8, max_new_tokens=3, temperature=0.0, stops=[0])
    same = acceptance_run(_FakeGen([[1, 2], [3]]), [[5], [6]], [[1, 2], [3]], name="x", **kw)
    assert same["acceptance_length"] == 1.5
    with pytest.raises(MismatchError, match="question 1 differs"):
        acceptance_run(_FakeGen([[1, 2], [4]]), [[5], [6]], [[1, 2], [3]], name="x", **kw)


def test_speedup_plot_reads_fixed_k_rows_only():
    speed = [
        {"batch": 1, "method": "plain", "vs_plain": 1.0},
        {"batch": 1, "method": "P-EAGLE K=7", "vs_plain": 0.5},
        {"batch": 1, "method": "P-EAGLE K=3", "vs_plain": 0.6},
        {"batch": 4, "method": "P-EAGLE K=3", "vs_plain": 0.8},
        {"batch": 1, "method": "P-EAGLE adaptive K'<=7", "vs_plain": 0.9},
        {"batch": 1, "method": "EAGLE-3 K=3", "vs_plain": 0.7},
    ]
    assert fixed_k_speedups(speed, "P-EAGLE", 1) == {3: 0.6, 7: 0.5}
    assert fixed_k_speedups(speed, "P-EAGLE", 4) == {3: 0.8}
    assert fixed_k_speedups(speed, "EAGLE-3", 1) == {3: 0.7}


def test_questions_file(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"turns": ["first?", "second?"]}) + "\n" + json.dumps({"turns": ["b"]}) + "\n")
    assert load_questions(str(f), None) == ["first?", "b"]
    assert load_questions(str(f), 1) == ["first?"]
    f.write_text('{"turns": []}\n')
    with pytest.raises(UserError, match="q.jsonl:1"):
        load_questions(str(f), None)


def test_progress_file_resumes_only_the_same_settings(tmp_path):
    from peagle_jax.bench.progress import Progress

    sig = {"model": "m", "prompts": digest([[1, 2], [3]]), "max_new_tokens": 8}
    p = Progress(tmp_path / "progress.json", sig, resume=False)
    p.set_reference(0.0, [[5], [6]])
    p.add({"method": "P-EAGLE", "shape": "K=1", "temperature": 0.0, "acceptance_length": 1.5})
    again = Progress(tmp_path / "progress.json", sig, resume=True)
    assert again.finished == 2 and again.reference(0) == [[5], [6]] and again.reference(0.7) is None
    assert again.row("P-EAGLE", "K=1", 0.0)["acceptance_length"] == 1.5 and again.row("P-EAGLE", "K=2", 0.0) is None
    assert Progress(tmp_path / "progress.json", sig, resume=False).finished == 0  # a fresh run starts over
    with pytest.raises(UserError, match=r"other settings \(max_new_tokens\)"):
        Progress(tmp_path / "progress.json", {**sig, "max_new_tokens": 16}, resume=True)
    (tmp_path / "progress.json").write_text("{not json")
    with pytest.raises(UserError, match="not a progress file"):
        Progress(tmp_path / "progress.json", sig, resume=True)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny random target, a drafter for it and three questions."""
    import jax.numpy as jnp

    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.train.pipeline import load_target, save_random_target
    from peagle_jax.train.recipe import Recipe, TargetConfig

    tmp_path = tmp_path_factory.mktemp("bench")
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
    return tmp_path


def _bench(setup, out, *args):
    common = ["--model", str(setup / "target"), "--drafter", str(setup / "drafter")]
    common += ["--questions-file", str(setup / "q.jsonl"), "--max-new-tokens", "8", "--max-seq-len", "128"]
    cmd = [sys.executable, "-m", "peagle_jax.bench", *common, "--out", str(out), "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_bench_end_to_end(tiny_setup, tmp_path):
    out = tmp_path / "out"
    proc = _bench(
        tiny_setup,
        out,
        *[
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
        ],
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
    assert {(1, "P-EAGLE adaptive K'<=2"), (4, "P-EAGLE adaptive K'<=2")} <= timed
    assert [r["batch"] for r in res["peagle_over_eagle3"]] == [1, 4]
    assert all(r["ratio"] > 0 and r["peagle"].startswith("P-EAGLE K=") for r in res["peagle_over_eagle3"])
    assert (out / "acceptance.png").stat().st_size > 0 and (out / "speedup.png").stat().st_size > 0
    assert "| P-EAGLE | K=2 |" in (out / "results.md").read_text()


@pytest.mark.slow
def test_a_stopped_bench_resumes(tiny_setup, tmp_path):
    """Finished acceptance runs survive a failed run and are not run again with --resume."""
    out = tmp_path / "out"
    small = ["--ks", "1", "--trees", "", "--temperatures", "0", "--speed-questions", "1", "--rounds", "1"]
    proc = _bench(tiny_setup, out, *small, "--speed-ks", "2")  # fails after the acceptance part
    assert proc.returncode == 2 and "--speed-ks" in proc.stderr, proc.stderr[-2000:]
    saved = json.loads((out / "progress.json").read_text())
    assert [(r["method"], r["shape"]) for r in saved["acceptance"]] == [("P-EAGLE", "K=1"), ("EAGLE-3", "K=1")]
    saved["acceptance"][0]["acceptance_length"] = 42.0  # a marker: only a resumed run reports it
    (out / "progress.json").write_text(json.dumps(saved))
    proc = _bench(tiny_setup, out, *small, "--speed-ks", "1", "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert [r["acceptance_length"] for r in res["acceptance"]][0] == 42.0
    assert res["acceptance"][1] == saved["acceptance"][1]
    assert not (out / "progress.json").exists()
    # --speed-only: the speed part again, the acceptance rows read back (the marker stays), none rerun.
    (out / "results.json").write_text(json.dumps(res | {"speed": []}))
    proc = _bench(tiny_setup, out, *small, "--speed-ks", "1", "--speed-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = json.loads((out / "results.json").read_text())
    assert again["acceptance"] == res["acceptance"]
    assert {r["method"] for r in again["speed"]} >= {"plain", "P-EAGLE K=1", "EAGLE-3 K=1"}


def test_speed_only_refuses_other_settings(tmp_path):
    from peagle_jax.bench.mtbench import earlier_acceptance

    this = {"questions": 3, "max_new_tokens": 8}
    with pytest.raises(UserError, match="results.json of an earlier run"):
        earlier_acceptance(tmp_path / "results.json", this, [0.0])
    rows = [{"method": "P-EAGLE", "shape": "K=1", "temperature": 0.0}, {"temperature": 0.7}]
    (tmp_path / "results.json").write_text(json.dumps(this | {"acceptance": rows}))
    assert earlier_acceptance(tmp_path / "results.json", this, [0.0]) == rows[:1]
    with pytest.raises(UserError, match="max_new_tokens=8, this run 16"):
        earlier_acceptance(tmp_path / "results.json", this | {"max_new_tokens": 16}, [0.0])
    with pytest.raises(UserError, match="no acceptance rows at T=0.5"):
        earlier_acceptance(tmp_path / "results.json", this, [0.5])
