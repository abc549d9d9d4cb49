"""MXFP4 expert weights (peagle_jax.models.mxfp4) against transformers' own dequantization and loader."""

from __future__ import annotations

import json
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from peagle_jax.errors import UserError
from peagle_jax.models import mxfp4
from peagle_jax.models.mxfp4 import MXFP4Error

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
BITS = {"float32": np.uint32, "bfloat16": np.uint16}


def random_pair(rng, E=3, R=8, C=64, low=110, high=136):
    """Random blocks (E, R, C/32, 16) and scales (E, R, C/32) with scales in [low, high)."""
    blocks = rng.integers(0, 256, (E, R, C // 32, 16), dtype=np.uint8)
    scales = rng.integers(low, high, (E, R, C // 32), dtype=np.uint8)
    return blocks, scales


def canonical_pair(rng, E=3, R=8, C=64):
    """A pair as the quantizer writes it: each block's largest magnitude is 4 or 6 (codes 6, 7, 14, 15) and
    its scale is at least 1, except all-zero blocks (codes 0 and 8), whose scale is 0."""
    codes = rng.integers(0, 16, (E, R, C // 32, 32), dtype=np.uint8)
    where = rng.integers(0, 32, (E, R, C // 32))
    np.put_along_axis(codes, where[..., None], rng.choice([6, 7, 14, 15], (E, R, C // 32, 1)), axis=-1)
    scales = rng.integers(1, 255, (E, R, C // 32), dtype=np.uint8)
    zero = rng.random((E, R, C // 32)) < 0.1
    codes[zero] = rng.choice([0, 8], (int(zero.sum()), 32))
    scales[zero] = 0
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales


def bits(array):
    return array.view(np.uint32 if array.dtype == np.float32 else np.uint16)


def transformers_dequantize(blocks, scales, dtype_name):
    """transformers' routine (convert_moe_packed_tensors, which its Mxfp4Dequantize loading op calls)."""
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    return out.view(torch.int32 if dtype == torch.float32 else torch.int16).numpy().view(BITS[dtype_name])


def assert_one_line(err: pytest.ExceptionInfo, *words: str):
    message = str(err.value)
    assert "\n" not in message and message
    assert isinstance(err.value, UserError)
    for word in words:
        assert word in message, message


# -- dequantize ----------------------------------------------------------------------------------------------


def test_fp4_table_is_transformers_table():
    pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import FP4_VALUES

    np.testing.assert_array_equal(bits(mxfp4.FP4_VALUES), bits(np.array(FP4_VALUES, np.float32)))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_dequantize_matches_transformers_bit_for_bit(dtype_name):
    blocks, scales = random_pair(np.random.default_rng(0))
    ours = mxfp4.dequantize(blocks, scales, DTYPES[dtype_name])
    assert ours.shape == (3, 64, 8) and ours.dtype == DTYPES[dtype_name]  # (E, C, R): stored (E, R, C) transposed
    np.testing.assert_array_equal(bits(ours), transformers_dequantize(blocks, scales, dtype_name))


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_dequantize_matches_transformers_at_every_scale(dtype_name):
    """All 256 scales, subnormal 2**-127 and scale 255 (2**128: inf, or finite for magnitudes below 1)."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 128, 2, 16), dtype=np.uint8)
    scales = np.arange(2 * 128 * 2).astype(np.uint8).reshape(2, 128, 2)
    ours = mxfp4.dequantize(blocks, scales, dtype_name)
    np.testing.assert_array_equal(bits(ours), transformers_dequantize(blocks, scales, dtype_name))


def test_dequantize_values_by_hand():
    blocks = np.zeros((1, 1, 1, 16), np.uint8)
    blocks[0, 0, 0, :3] = [0x71, 0xF8, 0x2A]  # elements 0..5: codes 1, 7, 8, 15, 10, 2
    scales = np.full((1, 1, 1), 128, np.uint8)  # 2 ** 1
    w = mxfp4.dequantize(blocks, scales)
    np.testing.assert_array_equal(w[0, :6, 0], [1.0, 12.0, -0.0, -12.0, -2.0, 2.0])
    assert np.signbit(w[0, 2, 0])


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 64 * 4, 20 * 64 * 4, 1 << 30])
def test_chunking_matches_one_chunk(chunk_bytes):
    """One row, three rows (experts split), several experts per chunk, everything at once."""
    blocks, scales = random_pair(np.random.default_rng(2), E=5, R=8, C=64)
    whole = mxfp4.dequantize(blocks, scales, "bfloat16", chunk_bytes=1 << 30)
    chunked = mxfp4.dequantize(blocks, scales, "bfloat16", chunk_bytes=chunk_bytes)
    np.testing.assert_array_equal(bits(chunked), bits(whole))


def test_chunks_cover_every_row_once():
    for E, R, rows in [(5, 8, 1), (5, 8, 3), (5, 8, 8), (5, 8, 17), (5, 8, 100), (1, 1, 1)]:
        seen = np.zeros((E, R), int)
        for e0, e1, r0, r1 in mxfp4._chunks(E, R, rows):
            assert (e1 - e0) * (r1 - r0) <= max(rows, 1)
            seen[e0:e1, r0:r1] += 1
        assert (seen == 1).all(), (E, R, rows)


def test_dequantize_into_out():
    blocks, scales = random_pair(np.random.default_rng(3))
    out = np.empty((3, 64, 8), ml_dtypes.bfloat16)
    assert mxfp4.dequantize(blocks, scales, ml_dtypes.bfloat16, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(mxfp4.dequantize(blocks, scales, "bfloat16")))
    with pytest.raises(MXFP4Error) as err:
        mxfp4.dequantize(blocks, scales, np.float32, out=out, name="w")
    assert_one_line(err, "w", "out")


def test_parameter_shape_of_gpt_oss_20b():
    assert mxfp4.parameter_shape((32, 5760, 90, 16)) == (32, 2880, 5760)  # gate_up_proj (E, hidden, 2I)
    assert mxfp4.parameter_shape((32, 2880, 90, 16)) == (32, 2880, 2880)  # down_proj (E, I, hidden)


def test_dequantize_memory_stays_within_output_plus_one_chunk():
    blocks, scales = random_pair(np.random.default_rng(4), E=8, R=256, C=1024)
    chunk_bytes = 1 << 20
    for dtype in (np.float32, ml_dtypes.bfloat16):
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            out = mxfp4.dequantize(blocks, scales, dtype, chunk_bytes=chunk_bytes)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        float32_copy = blocks.size * 2 * 4
        assert out.nbytes <= peak <= out.nbytes + 1.25 * chunk_bytes + (64 << 10), (dtype, peak, out.nbytes)
        assert peak < out.nbytes + float32_copy / 4


# -- quantize -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_round_trip_with_given_scales_is_exact(dtype_name):
    blocks, scales = random_pair(np.random.default_rng(5), low=0, high=253)  # 253 up: 6 * 2**126 is inf
    weight = mxfp4.dequantize(blocks, scales, dtype_name)
    got_blocks, got_scales = mxfp4.quantize(weight, scales, chunk_bytes=1)
    np.testing.assert_array_equal(got_blocks, blocks)
    np.testing.assert_array_equal(got_scales, scales)


@pytest.mark.parametrize("chunk_bytes", [1, mxfp4.DEFAULT_CHUNK_BYTES])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_round_trip_of_quantizer_output_is_exact(dtype_name, chunk_bytes):
    blocks, scales = canonical_pair(np.random.default_rng(6), E=4, R=16, C=96)
    weight = mxfp4.dequantize(blocks, scales, dtype_name)
    got_blocks, got_scales = mxfp4.quantize(weight, chunk_bytes=chunk_bytes)
    assert got_blocks.dtype == got_scales.dtype == np.uint8
    np.testing.assert_array_equal(got_scales, scales)
    np.testing.assert_array_equal(got_blocks, blocks)


def reference_quantize_block(x: np.ndarray) -> tuple[np.ndarray, int]:
    """Brute force for one block of 32 float32 values: the ROUND_UP scale, then the nearest FP4 value with
    ties to the larger magnitude, saturating at 6."""
    ds = np.float32(np.abs(x).max()) / np.float32(6)
    if ds == 0:
        scale = 0
    else:
        mantissa, exponent = np.frexp(ds)
        scale = max(1, int(exponent if mantissa > 0.5 else exponent - 1) + 127)
    q = x.astype(np.float64) * 2.0 ** (127 - scale)
    magnitudes = mxfp4.FP4_VALUES[:8].astype(np.float64)
    codes = []
    for v in q:
        distance = np.abs(magnitudes - abs(v))
        best = np.flatnonzero(distance == distance.min()).max()
        codes.append(best | (8 if np.signbit(v) else 0))
    return np.array(codes, np.uint8), scale


def test_quantize_matches_brute_force_rounding():
    rng = np.random.default_rng(7)
    spread = np.exp2(rng.integers(-20, 20, (2, 1, 6)))
    weight = (rng.standard_normal((2, 64, 6)) * spread).astype(np.float32)
    midpoints = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    weight[0, :32, 0] = np.tile(midpoints, 4) * np.repeat([1, -1, 1, -1], 8)  # every tie, both signs; scale 2**0
    weight[0, :32, 1] = np.float32([-0.0, 0.0, -0.1, 0.1] * 7 + [-0.0, 0.0, -0.1, 6.0])  # signed zeros, tiny
    weight[0, :32, 2] = 0.0  # an all-zero block
    weight[0, :32, 3] = np.float32(3.0) * (np.arange(32) == 5)  # max 3: scale 2**-1, 3 -> 6
    weight[1, 32:, 0] = np.float32(1e-40)  # subnormal: the scale clamps at 2**-126 (code 1)
    blocks, scales = mxfp4.quantize(weight)
    codes = np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(2, 6, 2, 32)
    for e in range(2):
        for r in range(6):
            for g in range(2):
                want_codes, want_scale = reference_quantize_block(weight[e, 32 * g : 32 * g + 32, r])
                assert scales[e, r, g] == want_scale, (e, r, g)
                np.testing.assert_array_equal(codes[e, r, g], want_codes, err_msg=str((e, r, g)))
    assert scales[0, 0, 0] == 127 and scales[0, 2, 0] == 0 and scales[0, 3, 0] == 126 and scales[1, 0, 1] == 1
    np.testing.assert_array_equal(codes[0, 0, 0, :8], [1, 2, 3, 4, 5, 6, 7, 7])  # ties away from zero
    np.testing.assert_array_equal(codes[0, 1, 0, :4], [8, 0, 8, 0])


def test_quantize_saturates_with_given_scales():
    weight = np.zeros((1, 32, 1), np.float32)
    weight[0, :3, 0] = [7.0, -100.0, 5.5]
    blocks, _ = mxfp4.quantize(weight, np.full((1, 1, 1), 127, np.uint8))
    np.testing.assert_array_equal(blocks[0, 0, 0, :2], [0x7 | (0xF << 4), 0x7])


# -- names and errors -----------------------------------------------------------------------------------------

GPT_OSS_NAMES = [
    "model.layers.0.mlp.experts.gate_up_proj_blocks",
    "model.layers.0.mlp.experts.gate_up_proj_scales",
    "model.layers.0.mlp.experts.gate_up_proj_bias",
    "model.layers.0.mlp.experts.down_proj_blocks",
    "model.layers.0.mlp.experts.down_proj_scales",
    "model.layers.0.mlp.experts.down_proj_bias",
    "model.layers.0.mlp.router.weight",
    "model.embed_tokens.weight",
]


def test_mxfp4_pairs_of_gpt_oss_names():
    base = "model.layers.0.mlp.experts."
    assert mxfp4.mxfp4_pairs(GPT_OSS_NAMES) == {
        base + p: (base + p + "_blocks", base + p + "_scales") for p in ("down_proj", "gate_up_proj")
    }
    assert mxfp4.mxfp4_pairs(["lm_head.weight"]) == {}
    assert [n for n in GPT_OSS_NAMES if mxfp4.is_mxfp4_name(n)] == GPT_OSS_NAMES[:2] + GPT_OSS_NAMES[3:5]


@pytest.mark.parametrize("missing", ["_scales", "_blocks"])
def test_half_a_pair_is_an_error(missing):
    names = [n for n in GPT_OSS_NAMES if n != "model.layers.0.mlp.experts.down_proj" + missing]
    with pytest.raises(MXFP4Error) as err:
        mxfp4.mxfp4_pairs(names)
    assert_one_line(err, "model.layers.0.mlp.experts.down_proj" + missing)


def test_pair_beside_plain_tensor_is_an_error():
    with pytest.raises(MXFP4Error) as err:
        mxfp4.mxfp4_pairs([*GPT_OSS_NAMES, "model.layers.0.mlp.experts.down_proj"])
    assert_one_line(err, "model.layers.0.mlp.experts.down_proj")


@pytest.mark.parametrize(
    "blocks_shape, scales_shape, words",
    [
        ((3, 8, 2, 16), (3, 8, 3), ["disagree", "(3, 8, 2)"]),
        ((3, 8, 2, 16), (3, 8), ["disagree"]),
        ((3, 8, 2, 8), (3, 8, 2), ["blocks have shape"]),
        ((8, 2, 16), (8, 2), ["blocks have shape"]),
    ],
)
def test_shape_mismatch_is_an_error(blocks_shape, scales_shape, words):
    with pytest.raises(MXFP4Error) as err:
        mxfp4.dequantize(np.zeros(blocks_shape, np.uint8), np.zeros(scales_shape, np.uint8), name="experts.w")
    assert_one_line(err, "experts.w", *words)


@pytest.mark.parametrize("which", ["blocks", "scales"])
def test_wrong_dtype_is_an_error(which):
    blocks, scales = random_pair(np.random.default_rng(8))
    if which == "blocks":
        blocks = blocks.astype(np.int8)
    else:
        scales = scales.astype(np.float32)
    with pytest.raises(MXFP4Error) as err:
        mxfp4.dequantize(blocks, scales, name="experts.w")
    assert_one_line(err, "experts.w", which, "uint8")


def test_other_errors_are_one_line():
    blocks, scales = random_pair(np.random.default_rng(9))
    with pytest.raises(MXFP4Error) as err:
        mxfp4.dequantize(blocks, scales, np.int32)
    assert_one_line(err, "int32")
    weight = np.ones((1, 32, 2), np.float32)
    weight[0, 3, 1] = np.nan
    with pytest.raises(MXFP4Error) as err:
        mxfp4.quantize(weight, name="experts.w")
    assert_one_line(err, "experts.w", "non-finite")
    with pytest.raises(MXFP4Error) as err:
        mxfp4.quantize(np.ones((1, 33, 2), np.float32), name="experts.w")
    assert_one_line(err, "experts.w", "multiple of 32")
    with pytest.raises(MXFP4Error) as err:
        mxfp4.quantize(np.ones((1, 32, 2), np.float32), np.full((1, 2, 1), 255, np.uint8), name="experts.w")
    assert_one_line(err, "experts.w", "255")
    with pytest.raises(MXFP4Error) as err:
        mxfp4.quantize(np.ones((1, 32, 2), np.float32), np.full((1, 1, 2), 127, np.uint8), name="experts.w")
    assert_one_line(err, "experts.w", "(1, 2, 1)")


# -- safetensors ----------------------------------------------------------------------------------------------


def write_pairs(path, rng, names=("a.gate_up_proj", "a.down_proj"), extra=None):
    tensors = dict(extra or {})
    for name in names:
        tensors[name + "_blocks"], tensors[name + "_scales"] = random_pair(rng)
    save_file(tensors, str(path))
    return tensors


def test_load_dequantized_from_path_and_handle(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = write_pairs(path, np.random.default_rng(10), extra={"a.router": np.ones((3, 4), np.float32)})
    want = mxfp4.dequantize(tensors["a.down_proj_blocks"], tensors["a.down_proj_scales"], "bfloat16")
    got = mxfp4.load_dequantized(path, "a.down_proj", "bfloat16", chunk_bytes=1)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(bits(got), bits(want))
    with safe_open(path, framework="numpy") as handle:
        got = mxfp4.load_dequantized(handle, "a.gate_up_proj")
    want = mxfp4.dequantize(tensors["a.gate_up_proj_blocks"], tensors["a.gate_up_proj_scales"])
    np.testing.assert_array_equal(bits(got), bits(want))


def test_load_dequantized_errors(tmp_path):
    path = tmp_path / "model.safetensors"
    rng = np.random.default_rng(11)
    blocks, scales = random_pair(rng)
    save_file({"x_blocks": blocks, "x_scales": scales.astype(np.int8), "y_blocks": blocks}, str(path))
    with pytest.raises(MXFP4Error) as err:
        mxfp4.load_dequantized(path, "y")
    assert_one_line(err, "y_scales")
    with pytest.raises(MXFP4Error) as err:
        mxfp4.load_dequantized(path, "x")
    assert_one_line(err, "x", "scales", "uint8")


def test_the_dequantized_view_replaces_pairs():
    from peagle_jax.models.tensors import dequantized

    rng = np.random.default_rng(12)
    tensors = {"router": np.ones(3, np.float32)}
    for name in ("gate_up_proj", "down_proj"):
        tensors[name + "_blocks"], tensors[name + "_scales"] = random_pair(rng)
    want = mxfp4.dequantize(tensors["down_proj_blocks"], tensors["down_proj_scales"], "bfloat16")
    view = dequantized(tensors, "bfloat16")
    assert sorted(view) == ["down_proj", "gate_up_proj", "router"]
    assert view.shape("down_proj") == want.shape and view.dtype("down_proj") == want.dtype
    np.testing.assert_array_equal(bits(view["down_proj"]), bits(want))


# -- transformers' loader -------------------------------------------------------------------------------------


def write_tiny_gpt_oss(directory, rng, *, hidden=64, intermediate=96, experts=4, layers=2):
    """A random tiny GPT-OSS checkpoint with MXFP4 experts, laid out like the hub's (config + safetensors);
    returns the blocks and scales written, by base name."""
    torch = pytest.importorskip("torch")
    import transformers
    from safetensors.torch import save_file as save_torch

    config = transformers.GptOssConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=experts,
        num_experts_per_tok=2,
        vocab_size=128,
        layer_types=["sliding_attention", "full_attention"][:layers],
    )
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous() for k, v in transformers.GptOssForCausalLM(config).state_dict().items()}
    pairs = {}
    for i in range(layers):
        for proj, rows, cols in (("gate_up_proj", 2 * intermediate, hidden), ("down_proj", hidden, intermediate)):
            base = f"model.layers.{i}.mlp.experts.{proj}"
            assert tuple(state.pop(base).shape) == (experts, cols, rows)
            pairs[base] = random_pair(rng, E=experts, R=rows, C=cols)
            state[base + "_blocks"], state[base + "_scales"] = (torch.from_numpy(a) for a in pairs[base])
    directory.mkdir()
    save_torch(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config_dict = config.to_dict()
    config_dict["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
    }
    (directory / "config.json").write_text(json.dumps(config_dict))
    return pairs


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_transformers_loader_gives_the_same_parameters(tmp_path, dtype_name):
    """from_pretrained with Mxfp4Config(dequantize=True) - transformers' full loading path, transpose and all -
    yields exactly load_dequantized's arrays for every expert tensor."""
    torch = pytest.importorskip("torch")
    import transformers

    directory = tmp_path / "gpt-oss-tiny"
    pairs = write_tiny_gpt_oss(directory, np.random.default_rng(13))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = transformers.GptOssForCausalLM.from_pretrained(
        directory, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=dtype
    )
    params = dict(model.named_parameters())
    assert tuple(params["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 192)  # (E, hidden, 2I)
    assert tuple(params["model.layers.0.mlp.experts.down_proj"].shape) == (4, 96, 64)  # (E, I, hidden)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    for base in pairs:
        theirs = params[base].detach().view(int_dtype).numpy().view(BITS[dtype_name])
        ours = mxfp4.load_dequantized(directory / "model.safetensors", base, dtype_name)
        np.testing.assert_array_equal(bits(ours), theirs, err_msg=base)
