"""Bad arguments to ``python -m peagle_jax.convert``, ``train/train.py`` (``python -m peagle_jax.train``) and
``python -m peagle_jax.neuron`` (``export``, ``plan``): each ends with exit status 2 and one line ``error: ...``
on stderr naming the bad flag or value, prints no result, and leaves nothing half-written: the output
directory does not exist afterwards, or is unchanged when it existed. (``generate`` has its own table in
test_cli.py.)

The entry points' ``main(argv)`` run in this process (a subprocess per case would cost a second of imports
each); an uncaught exception, a traceback's in-process equivalent, fails the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import tiny_hf_model

from peagle_jax.convert import main as convert_main
from peagle_jax.neuron.__main__ import main as neuron_main
from peagle_jax.train.cli import main as train_main

ROOT = Path(__file__).resolve().parent.parent
TINY_RECIPE = str(ROOT / "train" / "configs" / "tiny.yaml")
BUCKETS = "batch_buckets: [1]\nprefill_buckets: [8]\nmax_seq_len: 16\nk_values: [2]\nsampling: false\nadaptive: false\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Inputs good and broken, built once: a tiny Llama (HF and converted), a drafter, files of the wrong kind."""
    import jax

    from peagle_jax.convert import to_jax
    from peagle_jax.drafter.config import random_drafter_config
    from peagle_jax.drafter.load import save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.hf_config import load_hf_config

    root = tmp_path_factory.mktemp("inputs")
    good = root / "good"
    tiny_hf_model("llama").save_pretrained(good)
    to_jax(good, root / "jax")
    dcfg = random_drafter_config(load_hf_config(good))
    save_drafter(root / "drafter", dcfg, init_drafter_params(dcfg, jax.random.key(0)))
    (root / "afile").write_text("a file, not a directory\n")
    (root / "empty").mkdir()
    for name in ("corrupt", "badjson"):
        (root / name).mkdir()
    shutil.copy(good / "config.json", root / "corrupt")
    (root / "corrupt" / "model.safetensors").write_bytes(b"not safetensors" * 8)
    shutil.copy(good / "model.safetensors", root / "badjson")
    (root / "badjson" / "config.json").write_text("{not json")
    (root / "full").mkdir()  # an earlier run's output: a failed command must leave it as it is
    (root / "full" / "keep.txt").write_text("kept\n")
    shutil.copy(good / "config.json", root / "tiny.json")
    (root / "junk.json").write_text("{nope")
    (root / "buckets.yaml").write_text(BUCKETS)
    (root / "bad.yaml").write_text("batch:\n  seq_len: [1\n")
    (root / "list.yaml").write_text("- a\n- b\n")
    return {p.name: p for p in root.iterdir()}


def _state(path: Path):
    """What is at ``path``: None, a file's bytes, or a directory's {relative path: bytes} (dirs: None)."""
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() if p.is_file() else None for p in sorted(path.rglob("*"))}


def _call(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of an entry point's ``main(argv)`` (a return value or SystemExit)."""
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _check_refused(main, case, inputs, tmp_path, capsys) -> None:
    argv, message, output = case
    out = tmp_path / "out"
    paths = {**{f"@{k}": str(v) for k, v in inputs.items()}, "@out": str(out)}

    def expand(arg: str) -> str:
        for key in sorted(paths, key=len, reverse=True):  # @full before @f...
            arg = arg.replace(key, paths[key])
        return arg

    argv = [expand(a) for a in argv]
    written = Path(expand(output)) if output else None
    before = _state(written) if written else None
    status, stdout, stderr = _call(main, argv, capsys)
    lines = stderr.strip().splitlines()
    assert status == 2, (status, stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert message in lines[0], lines[0]
    assert stdout == ""
    if written is not None:
        assert _state(written) == before, f"{written} changed"
    assert list(tmp_path.iterdir()) == []  # nothing else either: no staging or partial directory


CONVERT = {
    "no_such_src": (["to-jax", "@empty/missing", "@out"], "missing: no such directory", "@out"),
    "src_is_a_file": (["to-jax", "@afile", "@out"], "afile: no such directory", "@out"),
    "src_without_config": (["to-jax", "@empty", "@out"], "no config.json", "@out"),
    "corrupt_config": (["to-jax", "@badjson", "@out"], "config.json: not valid JSON", "@out"),
    "corrupt_weights": (["to-jax", "@corrupt", "@out"], "not a readable safetensors file", "@out"),
    "dst_is_a_file": (["to-jax", "@good", "@afile"], "afile exists and is not a directory", "@afile"),
    "dst_under_a_file": (["to-jax", "@good", "@afile/sub"], "afile is a file, not a directory", "@afile"),
    "dst_not_empty": (["to-jax", "@good", "@full"], "pass --force", "@full"),
    "dst_is_src": (["to-jax", "@good", "@good"], "SRC and DST are the same directory", "@good"),
    "already_jax": (["to-jax", "@jax", "@out"], "already a JAX checkpoint", "@out"),
    "forced_over_bad_src": (["to-jax", "@corrupt", "@full", "--force"], "not a readable safetensors", "@full"),
    "zero_shard_size": (["to-torch", "@jax", "@out", "--max-shard-size", "0"], "--max-shard-size", "@out"),
    "bad_shard_size": (["to-torch", "@jax", "@out", "--max-shard-size", "2XB"], "--max-shard-size", "@out"),
    "unknown_dtype": (["to-torch", "@jax", "@out", "--dtype", "int8"], "argument --dtype", "@out"),
    "unknown_layout": (["to-torch", "@jax", "@out", "--layout", "gguf"], "argument --layout", "@out"),
    # Refused from the config, before the weights are read, and before --force clears anything.
    "layout_of_a_target": (["to-torch", "@jax", "@full", "--force", "--layout", "eagle"], "--layout eagle", "@full"),
    "layout_before_weights": (["to-torch", "@corrupt", "@out", "--layout", "eagle"], "--layout eagle", "@out"),
    "verifier_before_weights": (["to-torch", "@corrupt", "@out", "--verifier", "x"], "--verifier", "@out"),
    "verifier_in_eagle_layout": (
        ["to-torch", "@drafter", "@out", "--layout", "eagle", "--verifier", "x"],
        "--verifier applies to drafters written in the speculators layout",
        "@out",
    ),
    "missing_dst": (["to-jax", "@good"], "required: dst", None),
    "unknown_command": (["to-safetensors", "@good", "@out"], "invalid choice: 'to-safetensors'", "@out"),
}


@pytest.mark.parametrize("case", CONVERT)
def test_convert_refuses(inputs, tmp_path, capsys, case):
    _check_refused(convert_main, CONVERT[case], inputs, tmp_path, capsys)


def _train(*overrides: str, config: str = TINY_RECIPE, output: str = "@out") -> list[str]:
    return ["--config", config, "--output", output, *overrides]


TRAIN = {
    "no_such_config": (_train(config="@empty/missing.yaml"), "cannot read config", "@out"),
    "config_is_a_directory": (_train(config="@empty"), "Is a directory", "@out"),
    "corrupt_yaml": (_train(config="@bad.yaml"), "not valid YAML (expected ',' or ']'", "@out"),
    "yaml_not_a_mapping": (_train(config="@list.yaml"), "expected a mapping of key: value, got list", "@out"),
    "non_numeric": (_train("optim.lr=fast"), "lr expects a float, got 'fast'", "@out"),
    "zero": (_train("optim.lr=0"), "lr=0.0 must be > 0", "@out"),
    "negative": (_train("batch.batch_size=-1"), "batch.batch_size must be >= 1", "@out"),
    "unknown_choice": (_train("batch.features=disk"), "batch.features must be online or cached", "@out"),
    "unknown_key": (_train("batch.rows=3"), "unknown key(s) rows", "@out"),
    "override_without_value": (_train("optim.lr"), "override 'optim.lr' is not of the form key=value", "@out"),
    "unparsable_override": (_train("optim.lr=[1"), "override 'optim.lr=[1': cannot parse", "@out"),
    "conflicting_keys": (
        _train("optim.objective=eagle3", "optim.segments=2"),
        "partitioning is for the peagle objective",
        "@out",
    ),
    "empty_layer_type": (
        _train(
            "target.family=gpt_oss", "target.sliding_window=8", "target.max_seq_len=64", "target.layer_types=full,,full"
        ),
        "target.layer_types 'full,,full'",
        "@out",
    ),
    "output_is_a_file": (_train(output="@afile"), "--output", "@afile"),
    "output_under_a_file": (_train(output="@afile/run"), "afile is a file, not a directory", "@afile"),
    "missing_output": (["--config", TINY_RECIPE], "required: --output", None),
    # Checked before the run directory is created or any model, data or device work starts.
    "no_such_target": (_train("target.model=@empty/missing"), "target.model", "@out"),
    "target_without_weights": (_train("target.model=@empty"), "no config.json", "@out"),
    "corrupt_target": (_train("target.model=@corrupt", "target.tokenizer=smollm2"), "not a readable", "@out"),
    "target_without_tokenizer": (_train("target.model=@good", "target.tokenizer="), "no tokenizer there", "@out"),
    "no_such_prompts": (_train("data.prompts=@empty/p.jsonl"), "data.prompts", "@out"),
    "prompts_of_unknown_kind": (_train("data.prompts=@afile"), "expected 'sharegpt', a .jsonl or a .json", "@out"),
    "no_such_init": (_train("drafter.init=@empty/missing"), "drafter.init", "@out"),
    "zero_fsdp": (_train("mesh.fsdp=0"), "mesh: data=-1 fsdp=0 must be >= 1", "@out"),
    "too_many_devices": (_train("mesh.data=4096"), "mesh: data=4096", "@out"),
    "existing_run_kept": (_train("mesh.data=4096", output="@full"), "mesh: data=4096", "@full"),
}


@pytest.mark.parametrize("case", TRAIN)
def test_train_refuses(inputs, tmp_path, capsys, case):
    _check_refused(train_main, TRAIN[case], inputs, tmp_path, capsys)


def _export(*args: str, out: str = "@out") -> list[str]:
    return ["export", "--model", "@tiny.json", "--buckets", "@buckets.yaml", "--out", out, *args]


def _plan(*args: str) -> list[str]:
    return ["plan", "--model", "@tiny.json", *args]


NEURON = {
    "no_such_model": (["export", "--model", "@empty/missing", "--out", "@out"], "--model", "@out"),
    "no_such_config_file": (["export", "--model", "@empty/x.json", "--out", "@out"], "no such file", "@out"),
    "model_is_a_file": (["export", "--model", "@afile", "--out", "@out"], "no such directory", "@out"),
    "corrupt_config_file": (["export", "--model", "@junk.json", "--out", "@out"], "not valid JSON", "@out"),
    "corrupt_config_in_dir": (["export", "--model", "@badjson", "--out", "@out"], "not valid JSON", "@out"),
    "zero_k": (_export("--k", "0"), "--k '0': every value must be >= 1", "@out"),
    "negative_k": (_export("--k", "-1"), "--k '-1'", "@out"),
    "non_numeric_k": (_export("--k", "two"), "--k 'two': expected comma-separated integers", "@out"),
    "empty_k_item": (_export("--k", "2,,3"), "without empty ones", "@out"),
    "empty_platform_item": (_export("--platforms", "neuron,"), "--platforms 'neuron,'", "@out"),
    "unknown_platform": (_export("--platforms", "cuda"), "unknown platform 'cuda'", "@out"),
    "zero_tp": (_export("--tp", "0"), "--tp must be >= 1", "@out"),
    "non_numeric_tp": (_export("--tp", "x"), "argument --tp: invalid int value", "@out"),
    "indivisible_tp": (_export("--tp", "3"), "--tp 3 must divide", "@out"),
    "unknown_split": (_export("--expert-split", "rows"), "argument --expert-split", "@out"),
    "out_is_a_file": (_export(out="@afile"), "--out", "@afile"),
    "out_under_a_file": (_export(out="@afile/x"), "afile is a file, not a directory", "@afile"),
    "lint_only_out_is_a_file": (_export("--no-write", out="@afile"), "--out", "@afile"),
    "no_such_buckets": (
        ["export", "--model", "@tiny.json", "--buckets", "@empty/b.yaml", "--out", "@out"],
        "--buckets",
        "@out",
    ),
    "buckets_is_a_directory": (
        ["export", "--model", "@tiny.json", "--buckets", "@empty", "--out", "@out"],
        "--buckets",
        "@out",
    ),
    "corrupt_buckets": (
        ["export", "--model", "@tiny.json", "--buckets", "@bad.yaml", "--out", "@out"],
        "not valid YAML",
        "@out",
    ),
    "no_such_drafter": (_export("--drafter", "@empty/missing"), "--drafter", "@out"),
    "target_as_drafter": (_export("--drafter", "@good"), "not a drafter config", "@out"),
    "existing_out_kept": (_export("--k", "0", out="@full"), "--k", "@full"),
    "missing_out": (["export", "--model", "@tiny.json"], "required: --out", None),
    "unknown_command": (["compile"], "invalid choice: 'compile'", None),
    "plan_missing_acceptance": (_plan(), "required: --acceptance-length", None),
    "plan_zero_acceptance": (_plan("--acceptance-length", "0"), "--acceptance-length must be in 1..K+1", None),
    "plan_nan_acceptance": (_plan("--acceptance-length", "nan"), "--acceptance-length", None),
    "plan_acceptance_over_k": (_plan("--acceptance-length", "5", "--k", "3"), "1..4, got 5.0", None),
    "plan_non_numeric": (_plan("--acceptance-length", "high"), "argument --acceptance-length", None),
    "plan_zero_k": (_plan("--acceptance-length", "2", "--k", "0"), "--k must be >= 1", None),
    "plan_zero_batch": (_plan("--acceptance-length", "2", "--batch", "0"), "--batch must be >= 1", None),
    "plan_negative_context": (_plan("--acceptance-length", "2", "--context", "-1"), "--context must be >= 0", None),
    "plan_unknown_instance": (_plan("--acceptance-length", "2", "--instance", "trn9"), "argument --instance", None),
    "plan_zero_tp": (_plan("--acceptance-length", "2", "--tp", "0"), "--tp must be >= 1", None),
    "plan_no_such_model": (["plan", "--model", "@empty/missing", "--acceptance-length", "2"], "--model", None),
    "plan_drafter_is_a_file": (_plan("--acceptance-length", "2", "--drafter", "@afile"), "--drafter", None),
}


@pytest.mark.parametrize("case", NEURON)
def test_neuron_refuses(inputs, tmp_path, capsys, case):
    _check_refused(neuron_main, NEURON[case], inputs, tmp_path, capsys)


def test_a_failed_export_writes_nothing(inputs, tmp_path, capsys, monkeypatch):
    """An export that fails after some graphs are written leaves no part of them: ``--out`` is as it was
    (absent, or an earlier export's files untouched), and no staging directory remains."""
    from peagle_jax.neuron import export as export_mod

    real = export_mod.export_graph
    calls = []

    def fail_on_the_third(graph, platform):
        calls.append(graph.name)
        if len(calls) == 3:
            raise ValueError("unsupported op")
        return real(graph, platform)

    monkeypatch.setattr(export_mod, "export_graph", fail_on_the_third)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "manifest.json").write_text(json.dumps({"graphs": []}))
    for out in (tmp_path / "out", earlier):
        calls.clear()
        before = _state(out)
        argv = ["export", "--model", str(inputs["tiny.json"]), "--buckets", str(inputs["buckets.yaml"])]
        status, _, stderr = _call(neuron_main, [*argv, "--out", str(out)], capsys)
        assert status == 2 and len(calls) == 3
        assert stderr.strip().splitlines()[-1] == "error: export failed: unsupported op"
        assert _state(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]

    # A finished export moves its files into the existing directory, replacing the older ones.
    monkeypatch.undo()
    status, _, _ = _call(neuron_main, [*argv, "--platforms", "neuron", "--out", str(earlier)], capsys)
    assert status == 0
    names = {p.name for p in earlier.iterdir()}
    assert names == {"manifest.json", "neuron"}  # no staging directory left inside
    graphs = json.loads((earlier / "manifest.json").read_text())["graphs"]
    assert len(graphs) > 3 and all((earlier / "neuron" / f"{g['name']}.hlo.pb").is_file() for g in graphs)
    assert (earlier / "neuron" / "compile.sh").stat().st_mode & 0o111
