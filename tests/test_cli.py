"""``python -m peagle_jax.generate`` as a user runs it: bad input ends with exit code 2 and one line
``error: ...`` on stderr, never a traceback; a good tiny model generates."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_hf_model
from safetensors.torch import save_file

# The CPU backend keeps the subprocesses hermetic and free of accelerator start-up messages on stderr.
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def generate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "peagle_jax.generate", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny model directories, good and broken, built once for the module."""
    root = tmp_path_factory.mktemp("cli")
    hf = tiny_hf_model("llama", seed=0, eos_token_id=None)  # no EOS: generation always runs to the limit
    good = root / "good"
    hf.save_pretrained(good)

    def with_config(name: str) -> Path:
        path = root / name
        path.mkdir()
        shutil.copy(good / "config.json", path)
        return path

    with_config("config_only")
    torch.save(hf.state_dict(), with_config("bin_only") / "pytorch_model.bin")
    state = {**hf.state_dict(), "model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}
    save_file(state, str(with_config("wrong_shape") / "model.safetensors"), {"format": "pt"})
    gelu = root / "gelu"
    gelu.mkdir()
    shutil.copy(good / "model.safetensors", gelu)
    config = json.loads((good / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    no_heads = root / "no_heads"
    no_heads.mkdir()
    shutil.copy(good / "model.safetensors", no_heads)
    del config["num_attention_heads"]
    (no_heads / "config.json").write_text(json.dumps(config))
    (with_config("corrupt") / "model.safetensors").write_bytes(b"not safetensors" * 8)
    return {p.name: p for p in root.iterdir()}


def _model(models, name):
    return str(models[name]) if name in models else name


BAD = {
    "config_only": (["--model", "config_only", "--prompt-ids", "1,2"], "no *.safetensors weights"),
    "bin_only": (["--model", "bin_only", "--prompt-ids", "1,2"], "pickled"),
    "wrong_shape": (["--model", "wrong_shape", "--prompt-ids", "1,2"], "model.layers.1.self_attn.k_proj.weight"),
    "gelu": (["--model", "gelu", "--prompt-ids", "1,2"], "hidden_act='gelu'"),
    "missing_attribute": (["--model", "no_heads", "--prompt-ids", "1,2"], "num_attention_heads"),
    "corrupt_weights": (["--model", "corrupt", "--prompt-ids", "1,2"], "not a readable safetensors file"),
    "no_such_dir": (["--model", "/nonexistent", "--prompt-ids", "1,2"], "/nonexistent"),
    "bad_prompt_ids": (["--model", "good", "--prompt-ids", "1,x"], "--prompt-ids"),
    "empty_prompt_id": (["--model", "good", "--prompt-ids", "1,,2"], "without empty ones"),
    "negative_temperature": (["--model", "good", "--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
    "token_outside_vocab": (["--model", "good", "--prompt-ids", "1,128"], "token id 128"),
    "text_without_tokenizer": (["--model", "good", "--prompt", "hi"], "no tokenizer"),
    "tiny_max_seq_len": (["--model", "good", "--prompt-ids", "1,2", "--max-seq-len", "1"], "--max-seq-len"),
    "too_long": (["--model", "good", "--prompt-ids", "1,2", "--max-seq-len", "4"], "--max-seq-len 4"),
    # Checked from config.json before the weights are read: this directory has none.
    "bad_token_before_weights": (["--model", "config_only", "--prompt-ids", "1,500"], "token id 500"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_error_line(models, case):
    args, message = BAD[case]
    args = [_model(models, a) for a in args]
    proc = generate(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert message in lines[0]
    assert proc.stdout == ""


def test_generates_json(models):
    proc = generate("--model", str(models["good"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["token_ids"]) == 5
    assert all(0 <= t < 128 for t in result["token_ids"])
    assert result["text"] is None  # the tiny model has no tokenizer
    assert result["prompt_tokens"] == 3 and result["finish_reason"] == "length"
    assert isinstance(result["tokens_per_s"], float) and result["tokens_per_s"] > 0
