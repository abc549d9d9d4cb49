"""Training for a mixture-of-experts target: the recipe's random GPT-OSS (and Qwen3-MoE) target is what
transformers and peagle_jax's loader make of the directory it is saved to, and the tiny GPT-OSS recipe
(``train/configs/tiny-gpt-oss.yaml``) runs end to end into a drafter that decodes its target losslessly,
past the sliding window."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.models.config import ConfigError, default_aux_layer_ids
from peagle_jax.train.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "train" / "configs" / "tiny-gpt-oss.yaml"
QWEN3_MOE = ("target.family=qwen3_moe", "target.sliding_window=0", "target.moe_intermediate_size=32")


@pytest.mark.parametrize("family,overrides", [("gpt_oss", ()), ("qwen3_moe", QWEN3_MOE)], ids=["gpt_oss", "qwen3_moe"])
def test_random_moe_target_saves_a_directory_that_transformers_and_the_loader_run_alike(tmp_path, family, overrides):
    """The saved random target loads back bit for bit, and transformers' eager fp32 forward over 60
    positions (past the 16-position window and YaRN's original 32) gives its logits within 1e-4 and
    ``output_hidden_states`` at the aux taps (vLLM's convention: the residual entering each tapped layer)."""
    import torch
    import transformers

    from peagle_jax.models import model as M
    from peagle_jax.models.weights import flatten, load_target
    from peagle_jax.train.pipeline import load_target as recipe_target
    from peagle_jax.train.target import save_random_target

    cfg, params, tokenizer, source = recipe_target(load_recipe(RECIPE, overrides))
    assert source == "random" and cfg.family == family and cfg.moe.num_experts == 4 and cfg.moe.top_k == 2
    assert cfg.aux_layer_ids == default_aux_layer_ids(4) and default_aux_layer_ids(24) == (2, 12, 21)
    if family == "gpt_oss":
        assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 and cfg.sliding_window == 16
        assert cfg.rope.type == "yarn" and cfg.rope.original_max_position_embeddings == 32
        drawn = {k: np.asarray(v) for k, v in flatten(params).items() if k.endswith(("sinks", "bias"))}
        assert "layers.0/self_attn/sinks" in drawn and "layers.3/mlp/router/bias" in drawn
        assert all(np.abs(v).min() > 0 for v in drawn.values())  # random, not flax's zeros
    else:
        assert cfg.moe.intermediate_size == 32 and cfg.moe.sparse_layers == (0, 1, 2, 3) and cfg.moe.norm_topk_prob
    path = tmp_path / "target"
    save_random_target(cfg, params, tokenizer, path)

    loaded_cfg, loaded = load_target(path)
    assert loaded_cfg == cfg
    flat, again = flatten(params), flatten(loaded)
    assert sorted(flat) == sorted(again)
    for name, value in flat.items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(again[name]), err_msg=name)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = {"gpt_oss": transformers.GptOssForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}[family]
    assert type(hf) is expected
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 60))
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True)
    out, _ = M.forward_jit(loaded, M.new_cache(cfg, 2, 64), jnp.asarray(ids), jnp.zeros(2, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    aux = np.asarray(out.aux).reshape(2, 60, len(cfg.aux_layer_ids), cfg.hidden_size)
    for i, j in enumerate(cfg.aux_layer_ids):
        np.testing.assert_allclose(aux[:, :, i], ref.hidden_states[j].numpy(), atol=1e-4, rtol=0)
    jax.clear_caches()


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["target.family=mamba"], "target.family must be llama, gpt_oss or qwen3_moe"),
        (["target.experts_per_token=5"], "target.experts_per_token must be within 1..num_experts"),
        (["target.sliding_window=0"], "target.sliding_window must be >= 1 for gpt_oss"),
        (["target.layer_types=sliding,full"], "target.layer_types 'sliding,full' must give sliding or full for each"),
        (["target.layer_types=sliding,full,full,slide"], "must give sliding or full for each of the 4 layers"),
        ([*QWEN3_MOE, "target.layer_types=full,full,full,full"], "target.layer_types is for family gpt_oss"),
    ],
)
def test_bad_moe_target_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(RECIPE, overrides)


@pytest.mark.slow
def test_tiny_gpt_oss_recipe_trains_a_drafter_that_decodes_losslessly(tmp_path):
    """``train/train.py --config train/configs/tiny-gpt-oss.yaml`` as shipped (40 steps): the GPT-OSS target
    regenerates the answers, its features are cached, the drafter trains and is exported in the speculators
    format; speculative decoding with it against the saved target emits plain decoding's tokens, greedy
    (chain and tree) and with seeded sampling, for 48 tokens after prompts already longer than the
    16-position window, with drafts accepted."""
    from transformers import AutoTokenizer

    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.engine.generator import Generator
    from peagle_jax.models.weights import load_target
    from peagle_jax.spec import verify as V
    from peagle_jax.spec.generator import SpeculativeGenerator
    from peagle_jax.train.regen import chat_prompt_ids

    out = tmp_path / "run"
    args = [
        "train/train.py",
        "--config",
        str(RECIPE),
        "--output",
        str(out),
        "run.progress=false",
    ]
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "regenerated:" in proc.stderr and "draft vocab:" in proc.stderr
    assert json.loads((out / "summary.json").read_text())["steps"] == 40
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(40)) and records[-1]["loss"] < records[0]["loss"]
    target_json = json.loads((out / "target" / "config.json").read_text())
    drafter_json = json.loads((out / "drafter" / "config.json").read_text())
    assert target_json["architectures"] == ["GptOssForCausalLM"] and target_json["sliding_window"] == 16
    assert drafter_json["speculators_model_type"] == "peagle" and drafter_json["draft_vocab_size"] == 2048
    assert drafter_json["transformer_layer_config"]["model_type"] == "llama"  # plain layers, as released
    assert drafter_json["eagle_aux_hidden_state_layer_ids"] == target_json["eagle_aux_hidden_state_layer_ids"]

    cfg, params = load_target(out / "target")
    dcfg, dparams = load_drafter(out / "drafter")
    assert cfg.moe is not None and cfg.attn_sinks and dcfg.layer.moe is None and not dcfg.layer.attn_sinks
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    questions = ["Tell me about JAX.", "Hi", "Write a poem about the sea and the wind."]
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    assert min(len(p) for p in prompts) > cfg.sliding_window
    greedy = dict(max_new_tokens=48, stop_token_ids=[])
    sampled = dict(greedy, temperature=[0.9, 1.2, 0.0], top_k=[0, 50, 0], top_p=[0.9, 1.0, 1.0], seed=[3, 4, 5])
    for kw, trees in ((greedy, (None, "0,1,00,10,000")), (sampled, (None,))):
        plain = [r.token_ids for r in Generator(cfg, params, max_seq_len=128).generate(prompts, **kw)]
        for tree in trees:
            gen = SpeculativeGenerator(
                cfg, params, dcfg, dparams, k=None if tree else 3, tree=tree and V.parse_tree(tree), max_seq_len=128
            )
            assert [r.token_ids for r in gen.generate(prompts, **kw)] == plain, (kw, tree)
            assert gen.spec.accepted_per_position[0] > 0  # the trained drafter's drafts were accepted
    jax.clear_caches()
