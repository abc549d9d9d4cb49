"""Reading Hugging Face safetensors checkpoints: shards, half-precision files, the exact inverse
``params_to_hf``, and one-line :class:`WeightsError` messages that name the offending tensor or file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_hf_model
from safetensors.torch import save_file

from peagle_jax.models import model as M
from peagle_jax.models.config import ConfigError
from peagle_jax.models.weights import WeightsError, load_target, params_from_hf, params_to_hf, read_safetensors

IDS = np.random.RandomState(0).randint(0, 128, (2, 16))


def _logits(cfg, params) -> np.ndarray:
    cache = M.new_cache(cfg, 2, 16)
    out, _ = M.forward_jit(params, cache, jnp.asarray(IDS), jnp.zeros(2, jnp.int32), cfg=cfg)
    return np.asarray(out.logits)


def _torch_logits(hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits.float().numpy()


def _write_checkpoint(path: Path, hf, state_dict: dict[str, torch.Tensor]) -> Path:
    """A model directory holding ``hf``'s config.json and ``state_dict`` as one safetensors file."""
    hf.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path / "model.safetensors"), {"format": "pt"})
    return path


def test_sharded_checkpoint_loads_like_unsharded(save_hf):
    hf = tiny_hf_model("llama", seed=1)
    sharded = save_hf(hf, "sharded", max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 1
    assert {p.name for p in shards} == set(index["weight_map"].values())

    cfg, params = load_target(save_hf(hf, "single"))
    cfg_sharded, params_sharded = load_target(sharded)
    assert cfg_sharded == cfg
    assert read_safetensors(sharded).keys() == read_safetensors(save_hf(hf, "single2")).keys()
    np.testing.assert_array_equal(_logits(cfg_sharded, params_sharded), _logits(cfg, params))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint_loads_as_exact_float32(save_hf, dtype):
    """fp16/bf16 tensors are cast to fp32 exactly (every half value is an fp32 value), so the logits equal
    those of the same half weights run in fp32 by transformers, to fp32 precision. Against the original
    fp32 model they differ only by the rounding of the weights to the half type: measured at 1.3-1.4 half
    eps times the logit scale (fp16 3.8e-4, bf16 3.2e-3 at max |logit| 0.61), bounded here by 2 eps."""
    reference = tiny_hf_model("llama", seed=2)
    half = tiny_hf_model("llama", seed=2).to(dtype)
    checkpoint = {k: v.float().numpy() for k, v in half.state_dict().items()}
    cfg, params = load_target(save_hf(half))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))

    loaded = params_to_hf(params, cfg)
    assert loaded.keys() == checkpoint.keys()
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, checkpoint[name], err_msg=name)

    logits = _logits(cfg, params)
    np.testing.assert_allclose(logits, _torch_logits(half.float()), atol=1e-5, rtol=0)
    ref_logits = _torch_logits(reference)
    scale = np.abs(ref_logits).max()
    np.testing.assert_allclose(logits, ref_logits, atol=2 * torch.finfo(dtype).eps * scale, rtol=0)


@pytest.mark.parametrize(
    "family,tied,extra",
    [
        ("llama", False, {}),
        ("llama", False, {"attention_bias": True, "mlp_bias": True}),
        ("qwen2", False, {}),
        ("qwen3", False, {}),
        ("llama", True, {}),
    ],
)
def test_params_to_hf_inverts_params_from_hf_bit_for_bit(save_hf, family, tied, extra):
    hf = tiny_hf_model(family, seed=3, tied=tied, **extra)
    model_dir = save_hf(hf)
    cfg, _ = load_target(model_dir)
    tensors = read_safetensors(model_dir)
    assert ("lm_head.weight" in tensors) == (not tied)
    if family == "qwen2" or extra.get("attention_bias"):
        assert "model.layers.0.self_attn.q_proj.bias" in tensors
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in tensors

    back = params_to_hf(params_from_hf(tensors, cfg), cfg)
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype, name
        assert back[name].shape == value.shape, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.fixture
def llama():
    return tiny_hf_model("llama", seed=4)


def test_missing_tensor_is_named(tmp_path, llama):
    name = "model.layers.2.mlp.down_proj.weight"
    state = {k: v for k, v in llama.state_dict().items() if k != name}
    with pytest.raises(WeightsError, match=re.escape(name)):
        load_target(_write_checkpoint(tmp_path, llama, state))


def test_unexpected_tensor_is_named(tmp_path, llama):
    name = "model.layers.0.self_attn.foo.weight"
    state = {**llama.state_dict(), name: torch.zeros(4, 4)}
    with pytest.raises(WeightsError, match=re.escape(name)):
        load_target(_write_checkpoint(tmp_path, llama, state))


def test_tensor_for_an_absent_parameter_is_named(tmp_path, llama):
    """A well-formed name the config does not have (a bias on a bias-free model, a layer too many)."""
    for name, shape in [("model.layers.0.self_attn.q_proj.bias", (64,)), ("model.layers.9.mlp.up_proj.weight", (1,))]:
        state = {**llama.state_dict(), name: torch.zeros(shape)}
        with pytest.raises(WeightsError, match=re.escape(name)):
            load_target(_write_checkpoint(tmp_path / name, llama, state))


def test_wrong_shape_is_named(tmp_path, llama):
    name = "model.layers.1.self_attn.k_proj.weight"
    state = {**llama.state_dict(), name: torch.zeros(16, 64)}  # one kv head where the config has two
    with pytest.raises(WeightsError, match=re.escape(f"{name!r} has shape (16, 64)") + r".*\(32, 64\)"):
        load_target(_write_checkpoint(tmp_path, llama, state))


def test_pickled_bin_only_is_refused(tmp_path, llama):
    llama.config.save_pretrained(tmp_path)
    torch.save(llama.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(WeightsError, match="pickled.*safetensors"):
        load_target(tmp_path)


def test_empty_directory(tmp_path):
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        read_safetensors(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):  # load_target reads the config first
        load_target(tmp_path)


def test_config_without_weights(tmp_path, llama):
    llama.config.save_pretrained(tmp_path)
    with pytest.raises(WeightsError, match=re.escape(str(tmp_path)) + ".*no \\*.safetensors"):
        load_target(tmp_path)


def test_index_naming_a_missing_shard(save_hf, llama):
    model_dir = save_hf(llama, max_shard_size="20KB")
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(WeightsError, match=re.escape(shard.name) + ".*missing"):
        load_target(model_dir)


def test_malformed_index_is_named(save_hf, llama):
    model_dir = save_hf(llama, max_shard_size="20KB")
    index = model_dir / "model.safetensors.index.json"
    for text in ("{not json", '{"metadata": {}}', "[1, 2]"):
        index.write_text(text)
        with pytest.raises(WeightsError, match=re.escape(index.name)):
            read_safetensors(model_dir)


def test_corrupt_safetensors_file_is_named(save_hf, llama):
    model_dir = save_hf(llama)
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file" * 4)
    with pytest.raises(WeightsError, match="model.safetensors.*not a readable safetensors file"):
        load_target(model_dir)
