"""Packed MXFP4 experts (``MoEConfig.experts == "packed"``): GPT-OSS's uint8 blocks and scales kept as the
parameters, unpacked inside each call (:mod:`peagle_jax.models.mxfp4_jax`). Against transformers' own
dequantization and forward, against the same model unpacked, through speculative decoding, loading,
conversion, tensor parallelism and the CLI's errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from test_moe_targets import WINDOW, YARN, _torch_forward, tiny_gpt_oss

from peagle_jax.errors import UserError
from peagle_jax.models import model as M
from peagle_jax.models import mxfp4, mxfp4_jax
from peagle_jax.models import weights as W
from peagle_jax.models.config import ConfigError, MoEConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.models.weights import load_target

ROOT = Path(__file__).resolve().parent.parent
BITS = {"float32": np.uint32, "bfloat16": np.uint16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def write_mxfp4_gpt_oss(save_hf, seed=0, name="model", dtype=torch.float32):
    """A tiny GPT-OSS (4 layers, sliding and full, YaRN, sinks, biases; width 32, experts 64 wide) saved as
    the hub ships it: experts quantized to MXFP4 pairs, ``quantization_config`` in config.json."""
    path = save_hf(tiny_gpt_oss(seed, intermediate=64).to(dtype), name)
    tensors = W.read_safetensors(path)
    for base in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[base + "_blocks"], tensors[base + "_scales"] = mxfp4.quantize(tensors.pop(base).astype(np.float32))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (path / "config.json").write_text(json.dumps(config))
    return path


def transformers_model(path, dtype_name):
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=TORCH_DTYPES[dtype_name]
    ).eval()


def with_dispatch(cfg, dispatch):
    return cfg.replace(moe=dataclasses.replace(cfg.moe, dispatch=dispatch))


def logits(params, cfg, ids, dispatch, prefill=12):
    """fp32 logits at every position of ``ids`` [B, T]: one forward with ``dispatch="dense"``; with
    ``"gather"``, a dense prefill of ``prefill`` tokens, then single-token gathered decode steps (each
    unrolls B * top-k expert pairs, where a gathered forward over every position would unroll B * T * k)."""
    B, T = ids.shape
    dense, cache = with_dispatch(cfg, "dense"), M.new_cache(cfg, B, T)
    if dispatch == "dense":
        prefill = T
    out, cache = M.forward_jit(params, cache, jnp.asarray(ids[:, :prefill]), jnp.zeros(B, jnp.int32), cfg=dense)
    steps = [out.logits]
    for t in range(prefill, T):
        start = jnp.full(B, t, jnp.int32)
        out, cache = M.forward_jit(
            params, cache, jnp.asarray(ids[:, t : t + 1]), start, cfg=with_dispatch(cfg, dispatch)
        )
        steps.append(out.logits)
    return np.asarray(jnp.concatenate(steps, axis=1).astype(jnp.float32))


# -- unpacking ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_unpack_equals_transformers_dequantization_at_every_scale(dtype_name):
    """All 256 scales (subnormals from 0 and 1, inf from 253 up) and every byte, bit for bit, through the
    jitted graph function and the host's dequantize_stored alike."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 128, 2, 16), dtype=np.uint8)
    blocks[0, :16, 0] = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scales = np.arange(512).astype(np.uint8).reshape(2, 128, 2)
    dtype = TORCH_DTYPES[dtype_name]
    theirs_ECR = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
    int_dtype = torch.int32 if dtype == torch.float32 else torch.int16
    theirs_ERC = theirs_ECR.view(int_dtype).numpy().view(BITS[dtype_name]).transpose(0, 2, 1)
    ours = jax.jit(mxfp4_jax.unpack, static_argnums=2)(blocks, scales, jnp.dtype(dtype_name))
    assert ours.shape == (2, 128, 64) and ours.dtype == jnp.dtype(dtype_name)
    np.testing.assert_array_equal(np.asarray(ours).view(BITS[dtype_name]), theirs_ERC)
    for chunk_bytes in (1, 4096, mxfp4.DEFAULT_CHUNK_BYTES):  # a row, 15 rows, everything at once
        host = mxfp4.dequantize_stored(
            blocks.reshape(2, 4, 32, 2, 16), scales.reshape(2, 4, 32, 2), dtype_name, chunk_bytes=chunk_bytes
        )
        np.testing.assert_array_equal(host.reshape(2, 128, 64).view(BITS[dtype_name]), theirs_ERC)


def test_the_gathered_dispatch_unpacks_only_the_experts_it_reads():
    """In a gathered decode step every unpacked matrix is one expert's ([2, F, D] or [D, F]); the dense
    dispatch unpacks all E at once."""
    cfg = packed_config()
    params = abstract_params(cfg)
    found = {}
    for dispatch in ("gather", "dense"):
        c = with_dispatch(cfg, dispatch)
        jaxpr = jax.make_jaxpr(lambda p, c=c: M.forward(p, M.new_cache(c, 1, 8), jnp.zeros((1, 1), jnp.int32),
                                                        jnp.zeros(1, jnp.int32), cfg=c))(params)  # fmt: skip
        found[dispatch] = {
            tuple(eqn.outvars[0].aval.shape)
            for eqn in _equations(jaxpr.jaxpr)
            if eqn.primitive.name == "bitcast_convert_type" and eqn.outvars[0].aval.dtype == jnp.float32
        }
    E, F, D = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
    # one bitcast per nibble: [..., C/32, 16] each, interleaved in the run dtype
    assert found["gather"] == {(2, F, D // 32, 16), (D, F // 32, 16)}
    assert found["dense"] == {(E, 2, F, D // 32, 16), (E, D, F // 32, 16)}


def test_a_dense_call_unpacks_one_layer_at_a_time():
    """The compiled temporaries of a dense forward (a prefill) do not grow with the layers: each layer's
    experts are unpacked when that layer runs, not all before the first (XLA hoists work that depends on
    the parameters alone; GPT-OSS-20B's prefill then asked for 87 GB)."""
    hf = dict(model_type="gpt_oss", vocab_size=64, hidden_size=256, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, num_experts_per_tok=2, num_local_experts=16,
              sliding_window=8)  # fmt: skip
    temps = {}
    for layers in (1, 4):
        cfg = W.with_experts(from_hf_config({**hf, "num_hidden_layers": layers}, dtype="bfloat16"), "packed")
        cfg = with_dispatch(cfg, "dense")
        forward = jax.jit(M.forward, static_argnames=("cfg",))
        args = (abstract_params(cfg), jax.eval_shape(lambda c=cfg: M.new_cache(c, 1, 64)))
        tokens, start = jax.ShapeDtypeStruct((1, 32), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)
        compiled = forward.lower(*args, tokens, start, cfg=cfg).compile()
        temps[layers] = compiled.memory_analysis().temp_size_in_bytes
    one_layer_unpacked = 16 * 3 * 256 * 256 * 2  # every expert of a layer in bfloat16
    assert temps[4] < temps[1] + one_layer_unpacked, temps


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs its equations hold (jit, custom_jvp, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for inner in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


# -- parity ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mxfp4")

    def save(model, name="model"):
        model.save_pretrained(directory / name)
        return directory / name

    return write_mxfp4_gpt_oss(save, seed=1)


@pytest.mark.parametrize("dispatch", ["dense", "gather"])
def test_packed_logits_equal_transformers_and_the_unpacked_model(mxfp4_dir, dispatch):
    """fp32, 16 positions past the window of 8 (``gather``: the last 4 as decode steps): transformers to 1e-4,
    the same model loaded unpacked exactly."""
    cfg, params = load_target(mxfp4_dir)
    assert cfg.moe.experts == "packed"
    experts = params["layers.0"]["mlp"]["experts"]
    assert experts["gate_up_proj_blocks"].dtype == jnp.uint8 and "gate_up_proj" not in experts
    ucfg, uparams = load_target(mxfp4_dir, experts="unpacked")
    assert ucfg.moe.experts == "unpacked" and ucfg == cfg.replace(moe=dataclasses.replace(cfg.moe, experts="unpacked"))
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 16))
    packed = logits(params, cfg, ids, dispatch)
    np.testing.assert_array_equal(packed, logits(uparams, ucfg, ids, dispatch))
    hf = transformers_model(mxfp4_dir, "float32")
    np.testing.assert_allclose(packed, _torch_forward(hf, ids)[0], atol=1e-4, rtol=0)


def test_bf16_packed_logits_equal_unpacked_and_track_transformers(mxfp4_dir):
    """bf16: packed equals unpacked bit for bit in both dispatches (the unpacked values are transformers'
    bf16 parameters, tests/test_mxfp4.py), and the logits stay as close to the fp32 reference as
    transformers' own bf16 logits: max error at most 1.25x theirs + 1e-3 (bf16 rounds each product, and the
    two implementations round at different places; measured: 0.0041 for ours, 0.0044 for theirs, logits up
    to 0.36)."""
    cfg, params = load_target(mxfp4_dir, dtype="bfloat16")
    ucfg, uparams = load_target(mxfp4_dir, dtype="bfloat16", experts="unpacked")
    ids = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 16))
    ours = {}
    for dispatch in ("dense", "gather"):
        ours[dispatch] = logits(params, cfg, ids, dispatch)
        np.testing.assert_array_equal(ours[dispatch], logits(uparams, ucfg, ids, dispatch))
    reference = _torch_forward(transformers_model(mxfp4_dir, "float32"), ids)[0]
    with torch.no_grad():
        theirs = transformers_model(mxfp4_dir, "bfloat16")(torch.tensor(ids)).logits.float().numpy()
    their_error = np.abs(theirs - reference).max()
    for dispatch, got in ours.items():
        assert np.abs(got - reference).max() <= 1.25 * their_error + 1e-3, (dispatch, their_error)


# -- speculative decoding -------------------------------------------------------------------------------------

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], [3, 4, 1], [0, 0, 1, 1, 2, 5, 4, 3, 2, 1]]


def packed_config():
    hf = dict(model_type="gpt_oss", vocab_size=6, hidden_size=32, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=2,
              num_local_experts=16, sliding_window=WINDOW, rope_parameters=YARN)  # fmt: skip
    return W.with_experts(from_hf_config(hf), "packed")


def abstract_params(cfg):
    return jax.eval_shape(lambda: M.init_params(cfg, jax.random.key(0)))


def packed_target():
    """A random packed GPT-OSS of 6 tokens with large weights (as tests/test_moe_targets.py's targets), drawn
    on the host (tests/moe_tp_check.py's ``random_params``), 16 experts: ``auto`` gathers in decode steps
    (3 rows, a batch bucket of 4, x top-2 < 16) and runs every expert in prefills and verifies."""
    from moe_tp_check import random_params

    cfg = packed_config()
    return cfg, random_params(abstract_params(cfg), seed=1)


@pytest.fixture(scope="module")
def spec_models():
    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.config import ModelConfig

    cfg, params = packed_target()
    layer = ModelConfig(family="llama", vocab_size=6, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=4, num_kv_heads=2, head_dim=8, aux_layer_ids=(0,))  # fmt: skip
    aux = cfg.aux_layer_ids
    dcfg = DrafterConfig(layer=layer, algorithm="peagle", mask_token_id=5, own_embedding=False,
                         target_hidden_size=32, num_aux=len(aux), aux_layer_ids=aux)  # fmt: skip
    dparams = jax.tree.map(lambda x: x * 30 if x.ndim > 1 else x, init_drafter_params(dcfg, jax.random.key(2)))
    return cfg, params, dcfg, dparams


@pytest.mark.parametrize("k,tree", [(3, None), (None, "0,1,00,10,000")])
def test_greedy_speculative_equals_plain_greedy_past_the_window(spec_models, k, tree):
    from peagle_jax.engine.generator import Generator
    from peagle_jax.models.moe import dispatch_for
    from peagle_jax.spec import verify as V
    from peagle_jax.spec.generator import SpeculativeGenerator

    cfg, params, dcfg, dparams = spec_models
    assert dispatch_for(4, cfg.moe) == "gather" and dispatch_for(4 * 4, cfg.moe) == "dense"  # decode, verify
    kw = dict(max_new_tokens=30, stop_token_ids=[])
    plain = Generator(cfg, params, max_seq_len=64).generate(PROMPTS, **kw)
    assert len({tuple(r.token_ids) for r in plain}) == 3
    gen = SpeculativeGenerator(
        cfg, params, dcfg, dparams, k=k, tree=V.parse_tree(tree) if tree else None, max_seq_len=64
    )
    assert [r.token_ids for r in gen.generate(PROMPTS, **kw)] == [r.token_ids for r in plain]
    assert gen.spec.accepted_per_position[0] > 0  # drafts were accepted: acceptance was exercised


# -- loading --------------------------------------------------------------------------------------------------

MEMORY_HF = dict(model_type="gpt_oss", vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=8,
                 num_experts_per_tok=2, sliding_window=8)  # fmt: skip


def test_loading_packed_experts_holds_one_tensor_at_a_time(tmp_path):
    """tracemalloc's peak while load_target reads a packed model (experts 8 x 512 x 256, 27 MB dequantized
    in fp32, 5 MB resident packed) stays below the packed resident size plus the largest tensor plus 1 MiB,
    and below a quarter of the dequantized size."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in W.hf_shapes(from_hf_config(MEMORY_HF)).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            E, C, R = shape
            tensors[name + "_blocks"] = rng.integers(0, 256, (E, R, C // 32, 16), dtype=np.uint8)
            tensors[name + "_scales"] = rng.integers(118, 125, (E, R, C // 32), dtype=np.uint8)
        else:
            tensors[name] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(MEMORY_HF))
    largest = max(t.nbytes for t in tensors.values())
    del tensors
    jax.device_put(np.zeros(8)).block_until_ready()
    tracemalloc.start()
    try:
        cfg, params = load_target(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert cfg.moe.experts == "packed"
    resident = sum(x.nbytes for x in jax.tree.leaves(params))
    dequantized = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_params(W.with_experts(cfg, "unpacked")))
    )
    assert resident < dequantized / 4
    assert peak < resident + largest + (1 << 20), (peak, resident, largest)
    assert peak < dequantized / 4, (peak, dequantized)


# -- conversion -----------------------------------------------------------------------------------------------


def test_convert_round_trip_keeps_the_mxfp4_pairs_bit_for_bit(save_hf, tmp_path):
    """Hub layout (bf16 tensors, MXFP4 experts) -> to-jax -> to-torch: the same tensors byte for byte and the
    same config.json; the JAX checkpoint loads as the hub directory does, packed and unpacked, and
    ``--experts unpacked`` writes what the hub directory unquantizes to."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.convert import main as convert

    hf_dir = write_mxfp4_gpt_oss(save_hf, seed=3, name="hf", dtype=torch.bfloat16)
    assert convert(["to-jax", str(hf_dir), str(tmp_path / "jax")]) == 0
    assert convert(["to-torch", str(tmp_path / "jax"), str(tmp_path / "back")]) == 0
    want, back = W.read_safetensors(hf_dir), W.read_safetensors(tmp_path / "back")
    assert sorted(back) == sorted(want) and any(n.endswith("_blocks") for n in want)
    for name, value in want.items():
        assert (back[name].dtype, back[name].shape) == (value.dtype, value.shape), name
        assert back[name].tobytes() == value.tobytes(), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    for experts in ("auto", "unpacked"):
        cfg, params = load_target(hf_dir, experts=experts)
        cfg_jax, params_jax = load_target_any(tmp_path / "jax", experts=experts)
        assert cfg_jax == cfg and cfg.moe.experts == ("packed" if experts == "auto" else "unpacked")
        flat, flat_jax = W.flatten(params), W.flatten(params_jax)
        assert sorted(flat) == sorted(flat_jax)
        for name, value in flat.items():
            np.testing.assert_array_equal(np.asarray(flat_jax[name]), np.asarray(value), err_msg=name)
    for src, dst in ((hf_dir, "hf-unquantized"), (tmp_path / "jax", "jax-unquantized")):
        assert convert(["to-torch", str(src), str(tmp_path / dst), "--experts", "unpacked"]) == 0
    from_hf, from_jax = (
        W.read_safetensors(tmp_path / "hf-unquantized"),
        W.read_safetensors(tmp_path / "jax-unquantized"),
    )
    assert sorted(from_hf) == sorted(from_jax) and not any(mxfp4.is_mxfp4_name(n) for n in from_jax)
    for name, value in from_hf.items():
        assert from_jax[name].dtype == value.dtype and from_jax[name].tobytes() == value.tobytes(), name


# -- tensor parallelism ---------------------------------------------------------------------------------------


def test_tp_and_the_expert_split_give_the_one_device_tokens():
    """tests/moe_tp_check.py gpt_oss_packed on 8 simulated devices: TP 2 (experts, width), 4 and 8 (experts)
    emit the tokens of one device plainly and speculatively, equal to the unpacked model's; each device
    holds its share of the uint8 pairs (the width split on F, whose F/32 block axis down_proj splits); a
    width split that TP does not divide in blocks is refused by name."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "moe_tp_check.py"), "gpt_oss_packed"],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    reference = r["runs"]["none"]["plain"]
    assert r["devices"] == 8 and len({tuple(t) for t in reference}) == 2 and r["unpacked"] == reference
    assert set(r["runs"]) == {"none", "2-experts", "2-width", "4-experts", "8-experts"}
    E, F, D = 8, 64, 32
    for name, run in r["runs"].items():
        assert run["plain"] == reference, name
        for spec in ("parallel", "fused"):
            if spec in run:
                assert run[spec] == reference and run["accepted"][0] > 0, (name, spec)
        if name == "none":
            continue
        tp, split = int(name.split("-")[0]), name.split("-")[1]
        e, f = (E // tp, F) if split == "experts" else (E, F // tp)
        assert run["shards"] == {
            "gate_up_proj_blocks": [e, 2, f, D // 32, 16],
            "gate_up_proj_scales": [e, 2, f, D // 32],
            "down_proj_blocks": [e, D, f // 32, 16],
            "down_proj_scales": [e, D, f // 32],
            "gate_up_proj_bias": [e, 2, f],
            "down_proj_bias": [e if split == "experts" else E, D],
        }, name
        assert run.get("spec_shards_same", True), name
    assert r["refused"].startswith("--tp 4 must divide the target's packed expert width of 2 MXFP4 blocks")


def test_packed_partition_specs_and_refusals():
    from jax.sharding import PartitionSpec as P

    from peagle_jax.sharding import check_tp, param_spec

    params = abstract_params(packed_config())
    experts = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(params) if "['layers.0']['mlp']['experts']" in
               jax.tree_util.keystr(p)]  # fmt: skip
    specs = {
        split: {jax.tree_util.keystr(p).split("'")[-2]: param_spec(p, x, split) for p, x in experts}
        for split in ("experts", "width")
    }
    assert specs["experts"]["gate_up_proj_blocks"] == P("tp", None, None, None, None)
    assert specs["experts"]["down_proj_scales"] == P("tp", None, None)
    assert specs["width"]["gate_up_proj_blocks"] == P(None, None, "tp", None, None)  # F
    assert specs["width"]["gate_up_proj_scales"] == P(None, None, "tp", None)
    assert specs["width"]["down_proj_blocks"] == P(None, None, "tp", None)  # F/32
    assert specs["width"]["down_proj_scales"] == P(None, None, "tp")
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=64, sparse_layers=(0,), experts="packed")
    check_tp(2, num_kv_heads=2, intermediate_size=None, moe=moe, experts="width")
    with pytest.raises(UserError, match=r"--tp 4 must divide the target's packed expert width of 2 MXFP4 blocks"):
        check_tp(4, num_kv_heads=4, intermediate_size=None, moe=moe, experts="width")
    check_tp(4, num_kv_heads=4, intermediate_size=None, moe=moe)  # auto: whole experts
    unpacked = dataclasses.replace(moe, experts="unpacked")
    check_tp(4, num_kv_heads=4, intermediate_size=None, moe=unpacked, experts="width")


# -- configs and errors ---------------------------------------------------------------------------------------


def test_packed_is_a_gpt_oss_choice_of_the_checkpoint(save_hf):
    cfg = packed_config()
    unpacked = W.with_experts(cfg, "unpacked")
    assert W.resolve_experts(unpacked, "auto", mxfp4_stored=True) == cfg
    assert W.resolve_experts(cfg, "auto", mxfp4_stored=False) == unpacked
    assert W.resolve_experts(cfg, "unpacked", mxfp4_stored=True) == unpacked
    with pytest.raises(UserError, match="--experts packed: DIR has no MXFP4 experts"):
        W.resolve_experts(unpacked, "packed", mxfp4_stored=False, where="DIR")
    with pytest.raises(UserError, match="--experts 'fp4': choose auto, packed, unpacked"):
        W.resolve_experts(unpacked, "fp4", mxfp4_stored=True)
    qwen = from_hf_config(dict(model_type="qwen3_moe", vocab_size=8, hidden_size=32, intermediate_size=32,
                               num_hidden_layers=1, num_attention_heads=2, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=32))  # fmt: skip
    assert W.resolve_experts(qwen, "auto", mxfp4_stored=True) == qwen
    with pytest.raises(UserError, match="qwen3_moe model; packed .* are GPT-OSS's"):
        W.resolve_experts(qwen, "packed", mxfp4_stored=True, where="DIR")
    with pytest.raises(ConfigError, match="GPT-OSS's"):
        W.with_experts(qwen, "packed")
    with pytest.raises(ConfigError, match="intermediate_size a multiple of 32, got 24"):
        cfg.replace(moe=dataclasses.replace(cfg.moe, intermediate_size=24))
    with pytest.raises(ConfigError, match="'fp4'"):
        dataclasses.replace(cfg.moe, experts="fp4")
    bf16_dir = save_hf(tiny_gpt_oss(0, intermediate=32))  # experts in the run dtype: unpacked, always
    assert load_target(bf16_dir)[0].moe.experts == "unpacked"


def test_gpt_oss_20b_packed_at_zero_memory():
    """The real model's packed parameters and the hub's MXFP4 tensors they come from (names, shapes)."""
    from test_moe_targets import GPT_OSS_20B

    cfg = W.with_experts(from_hf_config(GPT_OSS_20B), "packed")
    expected = W.expected_shapes(cfg)
    experts = "layers.0/mlp/experts/"
    assert expected[experts + "gate_up_proj_blocks"] == ((32, 2, 2880, 90, 16), np.dtype(np.uint8))
    assert expected[experts + "gate_up_proj_scales"] == ((32, 2, 2880, 90), np.dtype(np.uint8))
    assert expected[experts + "down_proj_blocks"] == ((32, 2880, 90, 16), np.dtype(np.uint8))
    assert expected[experts + "down_proj_scales"] == ((32, 2880, 90), np.dtype(np.uint8))
    assert experts + "gate_up_proj" not in expected
    hub = W.hf_shapes(cfg)
    prefix = "model.layers.0.mlp.experts."
    assert hub[prefix + "gate_up_proj_blocks"] == (32, 5760, 90, 16) and hub[prefix + "gate_up_proj_scales"] == (
        32,
        5760,
        90,
    )
    assert hub[prefix + "down_proj_blocks"] == (32, 2880, 90, 16) and hub[prefix + "down_proj_scales"] == (32, 2880, 90)
    packed = sum(int(np.prod(s)) for p, (s, d) in expected.items() if d == np.uint8)
    assert packed == 24 * 32 * 3 * 2880 * 2880 * 17 // 32  # 4.25 bits per expert weight


def _generate_error(path, *flags):
    from peagle_jax.generate import main as generate

    return generate(["--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "1", *flags])


def test_wrong_pairs_are_one_error_line(save_hf, capsys):
    """``python -m peagle_jax.generate``: a blocks/scales pair whose shapes disagree (in a subprocess: exit
    2, one line, no traceback), a pair that does not fit the config, and --experts packed on experts that
    are not MXFP4."""
    path = write_mxfp4_gpt_oss(save_hf, seed=4)
    tensors = load_file(path / "model.safetensors")
    good = dict(tensors)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :-1]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "peagle_jax.generate", "--model", str(path), "--prompt-ids", "1,2",
         "--max-new-tokens", "1", "--compilation-cache", "none"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.startswith("error:") and "\n" not in err, proc.stderr
    assert "model.layers.1.mlp.experts.down_proj" in err and "disagree" in err
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    tensors = {**good, blocks: good[blocks][:, :-2], blocks[: -len("blocks")] + "scales": good[blocks][:, :-2, :, 0]}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    bf16_dir = save_hf(tiny_gpt_oss(0, intermediate=32), "bf16")
    capsys.readouterr()  # what saving printed
    assert _generate_error(path) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and blocks in err and "does not fit the config" in err
    assert _generate_error(bf16_dir, "--experts", "packed") == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --experts packed:") and "\n" not in err and "no MXFP4 experts" in err
