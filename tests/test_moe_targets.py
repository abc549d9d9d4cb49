"""GPT-OSS and Qwen3-MoE targets: parity with transformers (sinks, sliding windows past the window, YaRN,
top-k routing, dense and sparse layers), prefill + decode, config round trip, weights both ways."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from peagle_jax.errors import UserError
from peagle_jax.models import model as M
from peagle_jax.models import weights as W
from peagle_jax.models.hf_config import from_hf_config, to_hf_config
from peagle_jax.models.tensors import fused_experts
from peagle_jax.models.weights import load_target

WINDOW, SEQ = 8, 40
TINY = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
}


def tiny_gpt_oss(seed=0, *, kv_heads=2, experts=4, top_k=2, rope=None, intermediate=24, **extra):
    import transformers

    cfg = transformers.GptOssConfig(
        **TINY,
        intermediate_size=intermediate,
        num_key_value_heads=kv_heads,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=WINDOW,
        rope_parameters=rope or YARN,
        max_position_embeddings=512,
        **extra,
    )
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial sinks, norms and biases so that their mapping is tested too
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "norm.weight", "bias")):
                p.add_(0.5 * torch.randn_like(p))
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.mul_(10.0)  # experts that matter next to the residual stream
    return model


def tiny_qwen3_moe(seed=0, *, norm_topk_prob=True, experts=4, top_k=2, **extra):
    import transformers

    kwargs = dict(
        TINY,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
    )
    cfg = transformers.Qwen3MoeConfig(**{**kwargs, **extra})
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif "experts" in name:
                p.mul_(10.0)
    return model


def _torch_forward(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


CASES = [
    ("gpt_oss", 0, dict(kv_heads=2, experts=4, top_k=2)),
    ("gpt_oss", 1, dict(kv_heads=1, experts=5, top_k=3, layer_types=["full_attention", "sliding_attention"] * 2)),
    ("gpt_oss", 2, dict(kv_heads=4, experts=4, top_k=1, rope={"rope_type": "default", "rope_theta": 10000.0})),
    ("qwen3_moe", 3, dict(norm_topk_prob=True)),
    ("qwen3_moe", 4, dict(norm_topk_prob=False, experts=6, top_k=3, decoder_sparse_step=2, mlp_only_layers=[])),
]


def _tiny(family, seed, extra):
    return (tiny_gpt_oss if family == "gpt_oss" else tiny_qwen3_moe)(seed, **extra)


@pytest.mark.parametrize("family,seed,extra", CASES)
def test_logits_and_aux_match_transformers_past_the_window(save_hf, family, seed, extra):
    hf = _tiny(family, seed, extra)
    cfg, params = load_target(save_hf(hf), aux_layer_ids=(0, 1, 3))
    assert cfg.family == family
    ids = np.random.RandomState(seed).randint(0, cfg.vocab_size, (2, SEQ))
    ref_logits, ref_hidden = _torch_forward(hf, ids)
    out, _ = M.forward_jit(params, M.new_cache(cfg, 2, 48), jnp.asarray(ids), jnp.zeros(2, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    aux = np.asarray(out.aux).reshape(2, SEQ, 3, cfg.hidden_size)
    for i, j in enumerate(cfg.aux_layer_ids):  # vLLM convention: residual entering layer j
        np.testing.assert_allclose(aux[:, :, i], ref_hidden[j], atol=1e-4, rtol=0)


def test_long_context_gpt_oss(save_hf):
    """520 positions: many windows, YaRN far past its original context (16), against transformers."""
    hf = tiny_gpt_oss(8, kv_heads=2, experts=4, top_k=2)
    cfg, params = load_target(save_hf(hf))
    ids = np.random.RandomState(8).randint(0, cfg.vocab_size, (1, 520))
    ref_logits, _ = _torch_forward(hf, ids)
    out, _ = M.forward_jit(params, M.new_cache(cfg, 1, 528), jnp.asarray(ids), jnp.zeros(1, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)


def test_yarn_on_a_dense_llama_matches_transformers(save_hf):
    from conftest import tiny_hf_model

    rope = {**YARN, "truncate": True, "factor": 4.0, "beta_fast": 16.0, "attention_factor": 1.2}
    hf = tiny_hf_model("llama", seed=9, rope_parameters=rope, max_position_embeddings=512)
    cfg, params = load_target(save_hf(hf))
    assert (cfg.rope.type, cfg.rope.truncate, cfg.rope.attention_factor) == ("yarn", True, 1.2)
    ids = np.random.RandomState(9).randint(0, cfg.vocab_size, (1, 64))
    out, _ = M.forward_jit(params, M.new_cache(cfg, 1, 64), jnp.asarray(ids), jnp.zeros(1, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), _torch_forward(hf, ids)[0], atol=1e-4, rtol=0)
    assert from_hf_config(to_hf_config(cfg)) == cfg


@pytest.mark.parametrize("family,seed,extra", [CASES[0], CASES[3]])
def test_prefill_then_decode_equals_the_full_forward(save_hf, family, seed, extra):
    """A 12-token prefill, then single-token steps past the window, against one forward over everything."""
    hf = _tiny(family, seed, extra)
    cfg, params = load_target(save_hf(hf))
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, (2, 24)))
    full, _ = M.forward_jit(params, M.new_cache(cfg, 2, 32), ids, jnp.zeros(2, jnp.int32), cfg=cfg)
    cache = M.new_cache(cfg, 2, 32)
    out, cache = M.forward_jit(params, cache, ids[:, :12], jnp.zeros(2, jnp.int32), cfg=cfg)
    steps = [out.logits]
    for t in range(12, 24):
        out, cache = M.forward_jit(params, cache, ids[:, t : t + 1], jnp.full(2, t, jnp.int32), cfg=cfg)
        steps.append(out.logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), np.asarray(full.logits), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,seed,extra", [CASES[1], CASES[4]])
def test_config_and_weights_round_trip(save_hf, tmp_path, family, seed, extra):
    """config.json -> ModelConfig -> config.json -> the same ModelConfig; params -> HF tensors -> a directory
    that transformers loads and runs to the same logits."""
    import transformers

    hf = _tiny(family, seed, extra)
    path = save_hf(hf)
    cfg, params = load_target(path)
    hf_json = json.loads((path / "config.json").read_text())
    assert from_hf_config(to_hf_config(cfg)) == cfg
    tensors = W.params_to_hf(params, cfg)
    saved = W.read_safetensors(path)
    assert sorted(tensors) == sorted(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    out = tmp_path / "back"
    out.mkdir()
    W.write_safetensors(out, tensors)
    (out / "config.json").write_text(json.dumps({**hf_json, **to_hf_config(cfg)}))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 20))
    np.testing.assert_allclose(_torch_forward(back, ids)[0], _torch_forward(hf, ids)[0], atol=1e-5, rtol=0)


def test_fused_qwen3_moe_experts_load_like_per_expert_ones(save_hf):
    hf = tiny_qwen3_moe(5)
    path = save_hf(hf)
    cfg, params = load_target(path)
    tensors = W.read_safetensors(path)
    fused = fused_experts(tensors, cfg.moe.num_experts)
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    assert not any(".experts.0." in name for name in fused)
    flat, again = W.flatten(params), W.flatten(W.params_from_hf(fused, cfg))
    assert sorted(flat) == sorted(again)
    for name, value in flat.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(again[name]), err_msg=name)
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(W.WeightsError, match=r"experts\.3\.up_proj"):
        W.params_from_hf(tensors, cfg)


def test_unsupported_rope_type_is_refused_by_name(save_hf):
    hf_json = to_hf_config(from_hf_config(json.loads(json.dumps(tiny_gpt_oss(0).config.to_dict()))))
    hf_json["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(UserError, match="rope_type 'longrope' is not implemented"):
        from_hf_config(hf_json)
    hf_json["rope_parameters"] = {**YARN, "mscale": 0.7}
    with pytest.raises(UserError, match=r"\['mscale'\]"):
        from_hf_config(hf_json)


def test_moe_outside_the_moe_families_is_refused():
    hf = {"model_type": "llama", **dict(vocab_size=8, hidden_size=8, intermediate_size=8)}
    hf.update(num_hidden_layers=1, num_attention_heads=1, num_local_experts=4)
    with pytest.raises(UserError, match="num_local_experts"):
        from_hf_config(hf)


def test_sliding_window_follows_positions_not_slots():
    """A tree node at slot start+node with RoPE position start+depth: the window is judged by positions."""
    from peagle_jax import ops

    start = jnp.asarray([10], jnp.int32)
    positions = jnp.asarray([[10, 11, 11, 12]], jnp.int32)  # root, two children, a grandchild of node 1
    mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool)
    _, _, visible = ops.new_token_layout(start, 4, 16, None, mask, positions)
    sliding = np.asarray(ops.sliding_visible(visible, start, positions, 4))[0]
    # The grandchild (slot 13, position 12) sees positions 9..12: slot 9, the root (slot 10), its parent
    # (slot 11) and itself. Judged by slots, slot 9 (13 - 9 = 4) would be out of the window.
    assert np.flatnonzero(sliding[3]).tolist() == [9, 10, 11, 13]
    assert np.flatnonzero(sliding[2]).tolist() == [8, 9, 10, 12]
    # A grandchild of node 2 (slot 12, position 11) with a window of 1: only itself. Judged by its slot,
    # node 2 would look as recent as the grandchild's own position.
    mask = jnp.asarray([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]], bool)
    _, _, visible = ops.new_token_layout(start, 4, 16, None, mask, positions)
    assert np.flatnonzero(np.asarray(ops.sliding_visible(visible, start, positions, 1))[0, 3]).tolist() == [13]
    jax.clear_caches()


# Speculative decoding on MoE targets: random tiny models with a 6-token vocabulary and large weights, so
# that a random drafter agrees often enough for drafts to be accepted at every depth (tests/test_speculative).
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], [3, 4, 1], [0, 0, 1, 1, 2, 5, 4, 3, 2, 1]]


def _moe_target(family):
    hf = dict(
        model_type=family,
        vocab_size=6,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
    )
    if family == "gpt_oss":
        hf.update(num_local_experts=4, sliding_window=WINDOW, rope_parameters=YARN)
    else:
        hf.update(num_experts=4, moe_intermediate_size=16, mlp_only_layers=[2], norm_topk_prob=True)
    cfg = from_hf_config(hf)
    params = M.init_params(cfg, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(7), 64))

    def scale(path, x):
        name = jax.tree_util.keystr(path)
        if "sinks" in name or "bias" in name:
            return jax.random.normal(next(keys), x.shape, x.dtype)
        return x * 30 if x.ndim > 1 else x

    return cfg, jax.tree_util.tree_map_with_path(scale, params)


@pytest.fixture(
    scope="module",
    params=[("gpt_oss", "auto"), ("qwen3_moe", "auto"), ("gpt_oss", "dense")],
    ids=lambda p: "-".join(p),
)
def spec_models(request):
    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.models.config import ModelConfig

    family, dispatch = request.param
    cfg, params = _moe_target(family)
    cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, dispatch=dispatch))
    layer = ModelConfig(
        family="llama",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        aux_layer_ids=(0,),
    )
    dcfg = DrafterConfig(
        layer=layer,
        algorithm="peagle",
        mask_token_id=5,
        own_embedding=False,
        target_hidden_size=cfg.hidden_size,
        num_aux=len(cfg.aux_layer_ids),
        aux_layer_ids=cfg.aux_layer_ids,
    )
    dparams = jax.tree.map(lambda x: x * 30 if x.ndim > 1 else x, init_drafter_params(dcfg, jax.random.key(2)))
    return cfg, params, dcfg, dparams


@pytest.mark.parametrize("k,tree", [(3, None), (None, "0,1,00,10,000")])
def test_greedy_speculative_equals_plain_greedy_past_the_window(spec_models, k, tree):
    from peagle_jax.engine.generator import Generator
    from peagle_jax.spec import verify as V
    from peagle_jax.spec.generator import SpeculativeGenerator

    cfg, params, dcfg, dparams = spec_models
    kw = dict(max_new_tokens=30, stop_token_ids=[])
    plain = Generator(cfg, params, max_seq_len=64).generate(PROMPTS, **kw)
    gen = SpeculativeGenerator(
        cfg, params, dcfg, dparams, k=k, tree=V.parse_tree(tree) if tree else None, max_seq_len=64
    )
    assert [r.token_ids for r in gen.generate(PROMPTS, **kw)] == [r.token_ids for r in plain]
    assert gen.spec.accepted_per_position[0] > 0  # drafts were accepted: acceptance was exercised


def test_seeded_sampling_speculative_equals_plain_sampling(spec_models):
    from peagle_jax.engine.generator import Generator
    from peagle_jax.spec import verify as V
    from peagle_jax.spec.generator import SpeculativeGenerator

    cfg, params, dcfg, dparams = spec_models
    kw = dict(
        max_new_tokens=30,
        stop_token_ids=[],
        temperature=[0.9, 1.2, 0.0],
        top_k=[0, 4, 0],
        top_p=[0.9, 1.0, 1.0],
        seed=[3, 4, 5],
    )
    plain = Generator(cfg, params, max_seq_len=64).generate(PROMPTS, **kw)
    for tree in (None, V.parse_tree("0,1,00,10")):
        gen = SpeculativeGenerator(cfg, params, dcfg, dparams, k=3 if tree is None else None, tree=tree, max_seq_len=64)
        assert [r.token_ids for r in gen.generate(PROMPTS, **kw)] == [r.token_ids for r in plain]
        assert gen.spec.accepted_per_position[0] > 0


@pytest.mark.parametrize("family,dtype", [("gpt_oss", torch.bfloat16), ("qwen3_moe", torch.float32)])
def test_convert_round_trip_is_bit_for_bit(tmp_path, save_hf, family, dtype):
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.convert import to_jax, to_torch

    hf_dir = save_hf(_tiny(family, 6, {}).to(dtype), "hf")
    to_jax(hf_dir, tmp_path / "jax")
    to_torch(tmp_path / "jax", tmp_path / "back")
    back, want = W.read_safetensors(tmp_path / "back"), W.read_safetensors(hf_dir)
    assert sorted(back) == sorted(want)
    for name, value in want.items():
        assert back[name].dtype == value.dtype, name
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    cfg, params = load_target(hf_dir)
    cfg_jax, params_jax = load_target_any(tmp_path / "jax")
    assert cfg_jax == cfg
    flat, flat_jax = W.flatten(params), W.flatten(params_jax)
    assert sorted(flat) == sorted(flat_jax)
    for name, value in flat.items():
        np.testing.assert_array_equal(np.asarray(flat_jax[name]), np.asarray(value), err_msg=name)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_moe_graphs_are_lint_clean_for_neuron(family):
    """The target forward and a tree verify, exported for Neuron: fixed shapes, no sort over the vocabulary,
    no data-dependent loops (the dense dispatch selects outputs with a fixed-shape take_along_axis).
    The verify is the greedy graph:
    the sampling one branches on CPU (peagle_jax.platform.branching_allowed), not on Neuron."""
    from jax import export

    from peagle_jax.neuron.lint import lint_stablehlo
    from peagle_jax.sampling import SamplingParams
    from peagle_jax.spec import verify as V

    cfg, params = _moe_target(family)
    cache = M.new_cache(cfg, 2, 32)
    tokens, start = jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)
    text = export.export(M.forward_jit, platforms=["neuron"])(params, cache, tokens, start, cfg=cfg).mlir_module()
    assert lint_stablehlo(text) == []
    sampling = SamplingParams(jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.ones(2))
    args = (params, cache, start, jnp.zeros((2, 3, 2), jnp.int32), start + 5, start, sampling)
    tree = V.parse_tree("0,1,00,10,000")
    text = export.export(V.verify, platforms=["neuron"])(
        *args, cfg=cfg, tree=tree, window=32, greedy_only=True
    ).mlir_module()
    assert lint_stablehlo(text) == []


@pytest.mark.parametrize("family,seed,extra", [CASES[0], CASES[4]])
def test_gather_dispatch_equals_dense_dispatch(save_hf, family, seed, extra):
    """The two dispatches agree, and ``auto`` gathers only where the tokens' top-k are fewer than E."""
    from peagle_jax.models.moe import dispatch_for

    hf = _tiny(family, seed, extra)
    cfg, params = load_target(save_hf(hf))
    ids = jnp.asarray(np.random.RandomState(seed).randint(0, cfg.vocab_size, (2, 12)))
    logits = {}
    for dispatch in ("dense", "gather"):
        c = cfg.replace(moe=dataclasses.replace(cfg.moe, dispatch=dispatch))
        out, _ = M.forward_jit(params, M.new_cache(c, 2, 16), ids, jnp.zeros(2, jnp.int32), cfg=c)
        logits[dispatch] = np.asarray(out.logits)
    np.testing.assert_allclose(logits["gather"], logits["dense"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits["dense"], _torch_forward(hf, np.asarray(ids))[0], atol=1e-4, rtol=0)
    auto = dataclasses.replace(cfg.moe, dispatch="auto")
    E, k = auto.num_experts, auto.top_k
    assert dispatch_for(1, auto) == "gather" and dispatch_for(E // k, auto) == "dense"


GPT_OSS_20B = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=32,
    num_experts_per_tok=4,
    sliding_window=128,
    rms_norm_eps=1e-5,
    rope_parameters={**YARN, "original_max_position_embeddings": 4096},
    eagle_aux_hidden_state_layer_ids=[2, 12, 21],
)
QWEN3_CODER_30B = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7},
)


@pytest.mark.parametrize("hf", [GPT_OSS_20B, QWEN3_CODER_30B], ids=["gpt-oss-20b", "qwen3-coder-30b-a3b"])
def test_full_size_configs_map_onto_the_hub_shapes(hf):
    """The real models' configs, at zero memory (``jax.eval_shape``): each HF tensor a rule writes has the
    hub's (dequantized) shape, and each parameter is filled exactly once."""
    cfg = from_hf_config(hf)
    assert from_hf_config(to_hf_config(cfg)) == cfg
    expected = W.expected_shapes(cfg)
    rules = W._rules(cfg)
    names = {}
    for path, (shape, _) in expected.items():
        for rule, name in W._parts(rules, path):
            part = jax.ShapeDtypeStruct(shape, jnp.int8)
            if rule.index is not None:
                part = jax.eval_shape(lambda p, idx=rule.index: p[idx], part)
            names[name] = jax.eval_shape(rule.to_hf, part).shape
    prefix = "model.layers.0."
    if cfg.family == "gpt_oss":
        E, D, F, N = 32, 2880, 2880, 64
        assert cfg.layer_types[:2] == ("sliding_attention", "full_attention") and cfg.aux_layer_ids == (2, 12, 21)
        assert names[prefix + "self_attn.sinks"] == (N,)
        assert names[prefix + "self_attn.q_proj.weight"] == (N * 64, D)
        assert names[prefix + "mlp.router.weight"] == (E, D)
        assert names[prefix + "mlp.experts.gate_up_proj"] == (E, D, 2 * F)
        assert names[prefix + "mlp.experts.gate_up_proj_bias"] == (E, 2 * F)
        assert names[prefix + "mlp.experts.down_proj"] == (E, F, D)
        assert names[prefix + "mlp.experts.down_proj_bias"] == (E, D)
    else:
        E, D, F = 128, 2048, 768
        assert cfg.moe.sparse_layers == tuple(range(48))
        assert names[prefix + "mlp.gate.weight"] == (E, D)
        assert names[prefix + "mlp.experts.gate_up_proj"] == (E, 2 * F, D)
        assert names[prefix + "mlp.experts.down_proj"] == (E, D, F)
    layer0 = sorted(n for n in names if n.startswith(prefix))
    assert len(layer0) == (17 if cfg.family == "gpt_oss" else 11), layer0  # the hub's tensors of one layer


@pytest.mark.parametrize("form", ["K @ q^T", "q @ K^T", "bf16 K @ q^T", "bf16 q @ K^T"])
def test_attention_sinks_join_the_softmax_denominator(form):
    """p_j = exp(s_j - m) / (sum_k exp(s_k - m) + exp(sink - m)) with m over scores and sink, in every form."""
    from peagle_jax import ops

    rng = np.random.RandomState(0)
    B, T, N, G, H, S = 2, 3, 4, 2, 8, 6
    q, k, v = rng.randn(B, T, N, H), rng.randn(B, G, S, H), rng.randn(B, G, S, H)
    sinks = 3 * rng.randn(N)
    visible = rng.rand(B, T, S) < 0.7
    visible[..., 0] = True
    s = np.einsum("BTNH,BNSH->BNTS", q, np.repeat(k, N // G, axis=1)) / np.sqrt(H)
    s = np.where(visible[:, None], s, -np.inf)
    m = np.maximum(s.max(-1, keepdims=True), sinks[None, :, None, None])
    e = np.exp(s - m)
    p = e / (e.sum(-1, keepdims=True) + np.exp(sinks[None, :, None, None] - m))
    want = np.einsum("BNTS,BNSH->BTNH", p, np.repeat(v, N // G, axis=1))
    dt = jnp.bfloat16 if form in ops.BF16_FORMS else jnp.float32
    got = ops.attention(
        jnp.asarray(q, dt),
        jnp.asarray(k, dt),
        jnp.asarray(v, dt),
        jnp.asarray(visible),
        form=form,
        sinks_N=jnp.asarray(sinks, dt),
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=5e-2 if dt == jnp.bfloat16 else 1e-5, rtol=0)


def _quantize_experts(path):
    """Rewrite a saved GPT-OSS directory as the hub ships it: the experts as MXFP4 ``_blocks``/``_scales``.
    Returns the dequantized expert tensors the file now stands for."""
    from safetensors.numpy import load_file, save_file

    from peagle_jax.models import mxfp4

    tensors = load_file(path / "model.safetensors")
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).astype(np.float32))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = mxfp4.dequantize(blocks, scales, np.float32)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return expected


def test_an_mxfp4_checkpoint_loads_and_converts_unquantized(save_hf, tmp_path):
    """With ``experts="unpacked"`` the experts of an MXFP4 directory load dequantized (the values the blocks
    and scales encode) and the rest as saved; ``convert --experts unpacked`` writes them back unquantized in
    bfloat16, and the model runs on them. (By default they stay packed: tests/test_mxfp4_packed.py.)"""
    from peagle_jax.convert import main as convert
    from peagle_jax.models.weights import read_safetensors

    hf = tiny_gpt_oss(0, intermediate=32)  # MXFP4 packs 32 values along each contraction
    path = save_hf(hf)
    plain_cfg, plain = load_target(path)
    expected = _quantize_experts(path)
    cfg, params = load_target(path, experts="unpacked")
    assert cfg == plain_cfg
    flat, plain_flat = dict(W.flatten(params)), dict(W.flatten(plain))
    assert flat.keys() == plain_flat.keys()
    moved = [k for k in flat if not np.array_equal(flat[k], plain_flat[k])]
    assert moved and all("experts" in k for k in moved)  # only the quantized experts differ
    by_hf = W.params_to_hf(params, cfg)
    for name, want in expected.items():
        np.testing.assert_array_equal(by_hf[name], want)
    out = tmp_path / "unquantized"
    assert convert(["to-torch", str(path), str(out), "--experts", "unpacked"]) == 0
    written = read_safetensors(out)
    assert not any(n.endswith(("_blocks", "_scales")) for n in written)
    for name, want in expected.items():
        assert written[name].dtype == jnp.bfloat16
        np.testing.assert_array_equal(written[name].astype(np.float32), want.astype(jnp.bfloat16).astype(np.float32))
    logits, _ = M.forward_jit(
        params, M.new_cache(cfg, 1, 16), jnp.asarray([[1, 2, 3]]), jnp.zeros(1, jnp.int32), cfg=cfg
    )
    assert np.isfinite(np.asarray(logits.logits)).all()


def test_an_mxfp4_pair_missing_its_scales_is_one_error_line(save_hf, capsys):
    from safetensors.numpy import load_file, save_file

    from peagle_jax.generate import main as generate

    path = save_hf(tiny_gpt_oss(0, intermediate=32))
    _quantize_experts(path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # what saving the model printed
    assert generate(["--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "model.layers.1.mlp.experts.down_proj" in err


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_every_serving_graph_exports_lint_clean_with_a_random_drafter(family):
    """``python -m peagle_jax.neuron export`` on an MoE target: its random stand-in drafter is a plain Llama
    drafter (as the released ones are), and every graph of a small bucket set, sampling and the adaptive step
    length included, exports for Neuron and TPU without a lint finding."""
    from peagle_jax.drafter.config import random_drafter_config
    from peagle_jax.neuron.buckets import ServingBuckets
    from peagle_jax.neuron.export import export_all
    from peagle_jax.neuron.graphs import all_graphs

    cfg, _ = _moe_target(family)
    dcfg = random_drafter_config(cfg)
    assert dcfg.layer.family == "llama" and dcfg.layer.moe is None and not dcfg.layer.sliding_window
    buckets = ServingBuckets(batch_buckets=(2,), prefill_buckets=(16,), max_seq_len=24, k_values=(2,), dtype="float32")
    graphs = all_graphs(cfg, dcfg, buckets)
    findings = export_all(graphs, None, write=False)
    assert len(findings) == len(graphs)
    assert all(not found for per_platform in findings.values() for found in per_platform.values())


def test_a_released_style_drafter_for_gpt_oss_loads_round_trips_and_decodes_losslessly(tmp_path):
    """The layout of the released GPT-OSS P-EAGLE drafters (EAGLE/AWS: flat Llama config, ``midlayer.*``,
    ``ptd_token_id``, ``mask_hidden``, llama3 RoPE in the drafter, 4 layers, a draft vocabulary equal to the
    target's with identity ``d2t``): it loads, converts to JAX and back bit for bit, and speculative decoding
    of a GPT-OSS target with it emits plain decoding's tokens past the sliding window."""
    from peagle_jax.convert import main as convert
    from peagle_jax.drafter.config import DrafterConfig
    from peagle_jax.drafter.load import load_drafter, save_drafter
    from peagle_jax.drafter.model import init_drafter_params
    from peagle_jax.engine.generator import Generator
    from peagle_jax.models.config import ModelConfig, RopeConfig
    from peagle_jax.models.weights import read_safetensors
    from peagle_jax.spec.generator import SpeculativeGenerator

    cfg, params = _moe_target("gpt_oss")
    llama3 = RopeConfig(theta=500000.0, type="llama3", factor=32.0, original_max_position_embeddings=8192)
    layer = ModelConfig(
        family="llama", vocab_size=cfg.vocab_size, hidden_size=32, intermediate_size=64, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=8, rope=llama3, aux_layer_ids=(0,),
    )  # fmt: skip
    dcfg = DrafterConfig(
        layer=layer, algorithm="peagle", draft_vocab_size=cfg.vocab_size, mask_token_id=5,
        target_hidden_size=cfg.hidden_size, num_aux=len(cfg.aux_layer_ids), aux_layer_ids=cfg.aux_layer_ids,
    )  # fmt: skip
    dparams = jax.tree.map(lambda x: x * 30 if x.ndim > 1 else x, init_drafter_params(dcfg, jax.random.key(2)))
    src = tmp_path / "aws"
    save_drafter(src, dcfg, dparams, layout="eagle")
    config = json.loads((src / "config.json").read_text())
    assert config["ptd_token_id"] == 5 and config["draft_vocab_size"] == cfg.vocab_size
    rope = config.get("rope_parameters") or config["rope_scaling"]  # either spelling of the RoPE settings
    assert rope["rope_type"] == "llama3" and config["num_hidden_layers"] == 4
    from safetensors.numpy import save_file

    tensors = read_safetensors(src)
    assert "midlayer.self_attn.q_proj.weight" in tensors and "mask_hidden" in tensors
    # The released checkpoints carry the identity mapping explicitly: d2t all zero offsets, t2d all true.
    tensors["d2t"] = np.zeros(cfg.vocab_size, np.int64)
    tensors["t2d"] = np.ones(cfg.vocab_size, bool)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    assert convert(["to-jax", str(src), str(tmp_path / "jax")]) == 0
    assert convert(["to-torch", str(tmp_path / "jax"), str(tmp_path / "back")]) == 0
    back = read_safetensors(tmp_path / "back")
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and np.array_equal(back[name], t), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == config
    loaded_cfg, loaded = load_drafter(src)
    kw = dict(max_new_tokens=30, stop_token_ids=[])
    plain = Generator(cfg, params, max_seq_len=64).generate(PROMPTS, **kw)
    gen = SpeculativeGenerator(cfg, params, loaded_cfg, loaded, k=3, max_seq_len=64)
    assert [r.token_ids for r in gen.generate(PROMPTS, **kw)] == [r.token_ids for r in plain]
