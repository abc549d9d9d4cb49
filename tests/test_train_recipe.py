"""The smoke recipe end to end (``train/train.py --config train/configs/tiny.yaml``), its resume, its exported
drafter in ``generate --drafter``, and the recipe's YAML sections and errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_jax.models.config import ConfigError
from peagle_jax.models.weights import read_safetensors
from peagle_jax.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "train" / "configs" / "tiny.yaml"


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _generate(*args):
    proc = _run("-m", "peagle_jax.generate", *args, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_tiny_recipe_end_to_end_and_resume(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "jax-cache"
    proc = _run(
        "train/train.py",
        "--config",
        str(TINY),
        "--output",
        str(out),
        "optim.total_steps=30",
        "run.progress=false",
        f"run.compilation_cache={cache}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"compilation cache {re.escape(str(cache))}: \d+ graphs loaded, [1-9]\d* compiled", proc.stderr)
    assert "regenerated:" in proc.stderr and "draft vocab:" in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(30))
    assert records[-1]["loss"] < records[0]["loss"]
    assert (out / "eval.jsonl").exists() and list((out / "tb").iterdir())
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["draft_vocab_size"] == 2048

    # A run stopped after 12 steps and started again continues from its checkpoint to the same state as
    # the uninterrupted run: the same loss at every step.
    part = tmp_path / "part"
    args = (
        "train/train.py",
        "--config",
        str(TINY),
        "--output",
        str(part),
        "optim.total_steps=30",
        "run.progress=false",
        f"run.compilation_cache={cache}",
    )
    proc = _run(*args, "run.stop_after=12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same recipe's graphs come from the first run's compilation cache, not compiled again.
    assert int(re.search(r"compilation cache .*: (\d+) graphs loaded", proc.stderr)[1]) > 0
    # As a run killed after step 14 leaves them: rows past its last checkpoint, redone on resume, not repeated.
    with open(part / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps({"step": s, "loss": 999.0}) + "\n" for s in (12, 13, 14))
    with open(part / "eval.jsonl", "a") as f:
        f.write(json.dumps({"step": 14, "loss": 999.0}) + "\n")
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from step 12" in proc.stderr
    resumed = [json.loads(line) for line in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(30))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records]
    last_eval = [json.loads((d / "eval.jsonl").read_text().splitlines()[-1]) for d in (part, out)]
    assert last_eval[0]["loss"] == pytest.approx(last_eval[1]["loss"], rel=1e-6)
    # A finished run run again trains nothing and keeps the summary of the invocation that trained.
    trained = (part / "summary.json").read_text()
    assert json.loads(trained)["trained_steps_this_run"] == 18
    proc = _run(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (part / "summary.json").read_text() == trained
    assert "per-depth top-1 accuracy: 0." in proc.stderr + proc.stdout

    # The exported drafter runs in generate against the saved target, losslessly.
    common = ["--model", str(out / "target"), "--chat", "--prompt", "Tell me about JAX.", "--max-new-tokens", "24"]
    plain = _generate(*common)
    # --k-policy fixed: draft at every step (the default may decode plainly where it measured that faster)
    spec = _generate(*common, "--drafter", str(out / "drafter"), "--k", "3", "--k-policy", "fixed")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["acceptance_length"] >= 1.0

    # Shipping, as the SmolLM2 drafters are shipped: bf16 speculators directory + training card; still lossless.
    shipped = tmp_path / "shipped"
    proc = _run("-m", "peagle_jax.convert", "to-torch", str(out / "drafter"), str(shipped), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((shipped / "config.json").read_text())["dtype"] == "bfloat16"
    proc = _run(
        "-m",
        "peagle_jax.train.card",
        str(out),
        "--drafter",
        str(shipped),
        "--command",
        "python train/train.py ...",
        "--note",
        "trained in a test",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (shipped / "README.md").read_text()
    assert "30 steps of" in text and "| accuracy |" in text and "python train/train.py ..." in text
    assert "## Notes\n\n- trained in a test" in text
    assert f"{summary['last_eval']['acc_K'][0] * 100:.1f}%" in text
    bf16 = _generate(*common, "--drafter", str(shipped), "--k", "3")
    assert bf16["token_ids"] == plain["token_ids"]
    proc = _run("-m", "peagle_jax.train.card", str(tmp_path), "--drafter", str(shipped), "--command", "x")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "not a finished training run" in proc.stderr


@pytest.mark.slow
def test_a_run_dying_in_an_evaluation_redoes_it_on_resume(tmp_path, monkeypatch):
    """A run that dies evaluating step 6 (as the survivor of a killed process does) has no checkpoint at 6, so
    its resume redoes step 6's evaluation instead of continuing past it with the step missing from eval.jsonl."""
    from peagle_jax.train import pipeline

    small = ["optim.total_steps=9", "optim.save_every=3", "run.eval_every=3", "run.eval_batches=1"]
    small += ["data.max_prompts=16", "run.tensorboard=false", "run.progress=false"]
    recipe = load_recipe(TINY, small)
    evaluate = pipeline.evaluate

    def dies_at_6(state, *args, **kw):
        if int(state.step) == 6:
            raise RuntimeError("another task died")
        return evaluate(state, *args, **kw)

    out = tmp_path / "run"
    monkeypatch.setattr(pipeline, "evaluate", dies_at_6)
    with pytest.raises(RuntimeError, match="another task died"):
        pipeline.run(recipe, out, log=lambda *a: None)
    monkeypatch.setattr(pipeline, "evaluate", evaluate)
    logs = []
    pipeline.run(recipe, out, log=logs.append)
    assert "resumed from step 3" in logs
    assert [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()] == [3, 6, 9]


def test_bad_recipe_is_one_error_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch:\n  seq_len: 2\n")
    proc = _run("train/train.py", "--config", str(bad), "--output", str(tmp_path / "out"), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: batch.seq_len must be >= 4"


def test_recipe_sections_and_overrides(tmp_path):
    r = load_recipe(TINY, ["optim.lr=1e-4", "batch.features=online", "drafter.num_layers=2"])
    assert r.optim.lr == 1e-4 and r.batch.features == "online" and r.drafter.num_layers == 2
    assert r.batch.seq_len == 128  # from the file
    with pytest.raises(ConfigError, match="unknown key"):
        load_recipe(TINY, ["batch.sequence_length=3"])
    with pytest.raises(ConfigError, match="expects a mapping"):
        load_recipe(TINY, ["batch=3"])
    with pytest.raises(ConfigError, match="partitioning is for the peagle objective"):
        load_recipe(TINY, ["optim.objective=eagle3", "optim.segments=2"])
    with pytest.raises(ConfigError, match="data.regen_workers > 1 needs regen_slots > 0"):
        load_recipe(TINY, ["data.regen_workers=2"])
    assert load_recipe(TINY, ["data.regen_workers=2", "data.regen_slots=4"]).data.regen_workers == 2


def test_overrides_are_taken_anywhere_on_the_command_line():
    """``--config X key=value --output DIR key2=value``: overrides on both sides of an option."""
    from peagle_jax.train.cli import parse_args

    args = parse_args(
        ["--config", str(TINY), "optim.lr=1e-4", "--output", "out", "batch.features=online", "--until", "data"]
    )
    assert args.overrides == ["optim.lr=1e-4", "batch.features=online"] and args.output == "out"
    r = load_recipe(args.config, args.overrides)
    assert r.optim.lr == 1e-4 and r.batch.features == "online"


@pytest.mark.parametrize("recipe", sorted((ROOT / "train" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load(recipe):
    load_recipe(recipe)


@pytest.mark.slow
def test_dataset_answers_and_warm_start(tmp_path):
    """``data.responses=dataset`` trains on ShareGPT's own answers (no regeneration), and ``drafter.init``
    continues from an exported drafter: the continued run starts where the first ended, with its vocabulary."""
    common = ("--config", str(TINY), "data.responses=dataset", "optim.total_steps=12", "run.progress=false")
    first = tmp_path / "first"
    proc = _run("train/train.py", "--output", str(first), *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dataset answers:" in proc.stderr and "regenerated:" not in proc.stderr
    assert not (first / "regen").exists()
    losses = [json.loads(line)["loss"] for line in (first / "metrics.jsonl").read_text().splitlines()]

    more = tmp_path / "more"
    proc = _run("train/train.py", "--output", str(more), *common, f"drafter.init={first / 'drafter'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warm start from" in proc.stderr
    continued = [json.loads(line)["loss"] for line in (more / "metrics.jsonl").read_text().splitlines()]
    # The same batches in the same order: the warm start's first loss is near where the first run ended
    # and far below the first run's start from random weights.
    assert continued[0] < losses[0] - 0.5 * (losses[0] - losses[-1])
    assert continued[0] < 1.1 * max(losses[-3:])
    a, b = (json.loads((d / "drafter" / "config.json").read_text()) for d in (first, more))
    for config in (a, b):  # each run saves its random target in its own directory
        config["speculators_config"].pop("verifier")
    assert a == b  # architecture, draft vocabulary size and mask token carried over
    maps = [read_safetensors(d / "drafter") for d in (first, more)]
    assert all((maps[0][k] == maps[1][k]).all() for k in ("d2t", "t2d"))

    proc = _run("-m", "peagle_jax.train.card", str(more), "--drafter", str(more / "drafter"), "--command", "x")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (more / "drafter" / "README.md").read_text()
    vocab = json.loads((more / "vocab.json").read_text())
    assert f"own first answers (at most 32 tokens), no regeneration: {vocab['responses']} responses" in text
    assert f"- warm start from `{first / 'drafter'}`" in text and "1 decoder layers" in text

    proc = _run(
        "train/train.py",
        "--output",
        str(tmp_path / "bad"),
        *common,
        "optim.objective=eagle3",
        f"drafter.init={first / 'drafter'}",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: drafter.init ")
    assert "is a peagle drafter but optim.objective is eagle3" in proc.stderr
    proc = _run("train/train.py", "--output", str(tmp_path / "bad"), *common, f"drafter.init={tmp_path / 'nothing'}")
    assert proc.returncode == 2 and proc.stderr.strip().endswith("nothing: no such directory")


def test_card_names_the_prompts_used():
    from peagle_jax.train.card import _data_lines

    info = {
        "recipe": {
            "data": {"prompts": "sharegpt", "max_prompts": 0, "max_prompt_tokens": 384, "max_new_tokens": 384,
                     "responses": "dataset"},
            "batch": {"features": "online", "feature_dtype": "float32", "seq_len": 512},
            "drafter": {"init": "some/drafter"},
            "run": {"eval_fraction": 0.01},
        },
        "vocab": {"draft_vocab_size": 8192, "rows": 10, "fill": 0.9, "loss_tokens": 4000, "coverage": 0.87,
                  "mask_token_id": 5},
        "responses": 7,
        "response_tokens": 4100,
    }  # fmt: skip
    assert _data_lines(info)[0] == "- prompts: sharegpt (all salvaged prompts; longer than 384 tokens skipped)"
    info["recipe"]["data"]["max_prompts"] = 6000
    assert _data_lines(info)[0] == "- prompts: sharegpt (first 6000 salvaged prompts; longer than 384 tokens skipped)"


def test_a_second_run_trains_on_the_first_run_s_data(tmp_path):
    """``data.from_run``: an EAGLE-3 run reads a P-EAGLE run's regenerated answers and feature cache (the
    baseline on the same data), writing nothing into either; a directory that is not a run is one error."""
    common = ["--config", str(TINY), "data.max_prompts=16", "optim.total_steps=6", "optim.save_every=6"]
    common += ["run.eval_every=6", "run.progress=false", "run.tensorboard=false"]
    first = tmp_path / "peagle"
    proc = _run("train/train.py", "--output", str(first), *common, "--until", "features")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = [p for p in first.rglob("*") if p.is_file() and p.relative_to(first).parts[0] in ("regen", "features")]
    stamps = {p: p.stat().st_mtime_ns for p in data}
    assert any("shard-" in p.name for p in data) and any("hidden-" in p.name for p in data)

    second = tmp_path / "eagle3"
    proc = _run("train/train.py", "--output", str(second), *common, "optim.objective=eagle3", f"data.from_run={first}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"data: the answers and features of {first}" in proc.stderr
    assert not (second / "regen").exists() and not (second / "features").exists()
    assert {p: p.stat().st_mtime_ns for p in data} == stamps
    assert (second / "drafter" / "config.json").exists()
    keys = ("responses", "response_tokens", "rows")
    a, b = ([json.loads((d / "vocab.json").read_text())[k] for k in keys] for d in (first, second))
    assert a == b  # the same answers, packed into the same rows
    proc = _run("-m", "peagle_jax.train.card", str(second), "--drafter", str(second / "drafter"), "--command", "x")
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (second / "drafter" / "README.md").read_text()
    assert f"(greedy, at most 32 tokens): {a[0]} responses" in text
    assert f"the answers and features of the run `{first}`" in text

    proc = _run("train/train.py", "--output", str(tmp_path / "bad"), *common, f"data.from_run={tmp_path / 'nothing'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.from_run ")
