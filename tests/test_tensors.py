"""Tensor sources: safetensors read on demand equal safetensors' own reader; bad files are named; a target
loads one parameter at a time, so host memory stays near one parameter above what is already placed."""

from __future__ import annotations

import json
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from peagle_jax.models import mxfp4
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.models.tensors import TensorSource, WeightsError, _Entry, open_safetensors, write_safetensors
from peagle_jax.models.weights import hf_shapes, params_from_hf

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int32, np.uint8, np.bool_]


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        f"t{i}.{np.dtype(dt).name}": rng.standard_normal((3, 5 + i)).astype(dt)
        if dt != np.bool_
        else rng.random((4,)) > 0.5
        for i, dt in enumerate(DTYPES)
    }


@pytest.mark.parametrize("shard", [None, 200])
def test_open_safetensors_reads_what_safetensors_reads(tmp_path, shard):
    tensors = _tensors()
    files = write_safetensors(tmp_path, tensors, max_shard_size=shard)
    assert (len(files) > 1) == (shard is not None)
    source = open_safetensors(tmp_path)
    want = {k: v for f in files for k, v in load_file(str(f)).items()}
    assert sorted(source) == sorted(want)
    for name, value in want.items():
        assert source.shape(name) == value.shape and source.dtype(name) == value.dtype, name
        got = source[name]
        assert got.dtype == value.dtype and got.shape == value.shape
        np.testing.assert_array_equal(got.view(np.uint8), value.view(np.uint8), err_msg=name)


def test_a_truncated_or_inconsistent_file_is_named(tmp_path):
    save_file({"a": np.arange(1000, dtype=np.float32)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    source = open_safetensors(tmp_path)  # the header is whole: the loss shows when the tensor is read
    with pytest.raises(WeightsError, match="model.safetensors.*truncated"):
        source["a"]
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["a"]["shape"] = [999]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(size)
    (tmp_path / "model.safetensors").write_bytes(data[:8] + text + data[8 + size :])
    with pytest.raises(WeightsError, match="tensor 'a' spans 4000 bytes"):
        open_safetensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        open_safetensors(tmp_path)


GPT_OSS = {
    "model_type": "gpt_oss",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 3,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _mxfp4_checkpoint(path):
    """A random GPT-OSS checkpoint whose experts are MXFP4 pairs; returns (cfg, the largest parameter's bytes
    in float32, all parameters' bytes in float32)."""
    cfg = from_hf_config(GPT_OSS)
    rng = np.random.default_rng(0)
    tensors, sizes = {}, []
    for name, shape in hf_shapes(cfg).items():
        sizes.append(4 * int(np.prod(shape)))
        value = (0.02 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(value)
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = value
    write_safetensors(path, tensors)
    (path / "config.json").write_text(json.dumps(GPT_OSS))
    return cfg, max(sizes), sum(sizes)


def test_a_target_loads_one_parameter_at_a_time(tmp_path):
    import jax

    cfg, largest, total = _mxfp4_checkpoint(tmp_path)
    assert total > 8 * largest  # the bound below would be met by reading everything at once otherwise
    source = open_safetensors(tmp_path)
    events = []

    def logged(name, entry):
        def read():
            events.append(("read", name))
            return entry.read()

        return _Entry(entry.shape, entry.dtype, read)

    logged = TensorSource({name: logged(name, entry) for name, entry in source._entries.items()})

    def place(path, value):
        events.append(("place", path))
        return jax.device_put(value)

    tracemalloc.start()
    try:
        params = params_from_hf(logged, cfg, place=place)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Every parameter is placed before the next is read: reads come in runs, each ended by its place.
    placed = [e for e in events if e[0] == "place"]
    assert len(placed) == len(jax.tree.leaves(params))
    runs, current = [], []
    for kind, name in events:
        if kind == "read":
            current.append(name)
        else:
            runs.append((name, current))
            current = []
    assert not current
    assert all(1 <= len(reads) <= 3 for _, reads in runs)  # q, k and v (or a blocks/scales pair) fill one
    # Host memory (numpy's, traced) stays within a few of the largest parameter, far below all of them.
    assert peak < 3 * largest + (2 << 20), (peak, largest, total)
    assert peak < total / 2


def test_dequantized_and_fused_views_check_before_reading(tmp_path):
    from peagle_jax.models.tensors import dequantized, fused_experts

    blocks = np.zeros((2, 4, 1, 16), np.uint8)
    with pytest.raises(mxfp4.MXFP4Error, match="w: blocks .* and scales .* disagree"):
        dequantized({"w_blocks": blocks, "w_scales": np.zeros((2, 3, 1), np.uint8)}, "float32")
    experts = {
        f"m.mlp.experts.{e}.{k}_proj.weight": np.zeros((4, 8), np.float32)
        for e in range(2)
        for k in ("gate", "up", "down")
    }
    experts["m.mlp.experts.1.up_proj.weight"] = np.zeros((5, 8), np.float32)
    with pytest.raises(WeightsError, match="mismatched shapes"):
        fused_experts(experts, 2)
