"""The two MoE dispatches (dense, gather) compute each token's output by the same arithmetic after the expert
products: each selected expert's output (bias included) weighted and summed over k in top-k order."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_targets import tiny_gpt_oss, tiny_qwen3_moe

from peagle_jax.models.moe import MoE
from peagle_jax.models.weights import load_target

TOKENS = (1, 2, 4, 8, 16)


def _layer(save_hf, family):
    """A tiny random GPT-OSS (5 experts, top-3, biases, clamp) or Qwen3-MoE (6 experts, top-3) built by
    transformers, and its first MoE layer's parameters."""
    if family == "gpt_oss":
        hf = tiny_gpt_oss(11, experts=5, top_k=3)
    else:
        hf = tiny_qwen3_moe(12, experts=6, top_k=3, norm_topk_prob=False)
    cfg, params = load_target(save_hf(hf))
    return cfg, params[f"layers.{cfg.moe.sparse_layers[0]}"]["mlp"]


def _exact_products(mlp, seed):
    """Expert weights whose products are exact in any summation order: integer gate/up weights (with integer
    inputs every partial sum is a small integer), and a down projection with one power-of-two entry per
    output row. The router and the biases keep their random values."""
    rng = np.random.default_rng(seed)
    ex = dict(mlp["experts"])
    E, D, F = ex["down_proj"].shape
    ex["gate_up_proj"] = jnp.asarray(rng.integers(-2, 3, ex["gate_up_proj"].shape), jnp.float32)
    down = np.zeros((E, D, F), np.float32)
    e, d = np.meshgrid(np.arange(E), np.arange(D), indexing="ij")
    down[e, d, (7 * e + d) % F] = rng.choice([-2.0, -0.5, 0.5, 1.0, 2.0], (E, D))
    ex["down_proj"] = jnp.asarray(down)
    return {**mlp, "experts": ex}


def _outputs(cfg, mlp, x_BTD, dtype):
    out = {}
    for dispatch in ("dense", "gather"):
        module = MoE(dataclasses.replace(cfg.moe, dispatch=dispatch), cfg.family, dtype)
        params = jax.tree.map(lambda p: p.astype(dtype), {"params": mlp})
        out[dispatch] = np.asarray(jax.jit(module.apply)(params, x_BTD.astype(dtype)).astype(jnp.float32))
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dispatches_combine_expert_outputs_bit_for_bit(save_hf, family, dtype):
    """With expert products that are exact however XLA orders their sums, dense and gather agree bit for bit
    at every token count: what remains (biases, activation, weighting, the sum over k) is shared."""
    cfg, mlp = _layer(save_hf, family)
    mlp = _exact_products(mlp, 0)
    rng = np.random.default_rng(1)
    for tokens in TOKENS:
        x_BTD = jnp.asarray(rng.integers(-2, 3, (2, tokens, cfg.hidden_size)), jnp.float32)
        out = _outputs(cfg, mlp, x_BTD, dtype)
        assert np.abs(out["dense"]).max() > 1  # the experts contribute
        np.testing.assert_array_equal(out["gather"], out["dense"], err_msg=f"{tokens} tokens")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_random_tiny_layers_agree_bit_for_bit_in_bf16(save_hf, family):
    """Random weights in bf16 at these tiny widths: XLA's CPU products of the two dispatches round alike, so
    the outputs agree bit for bit up to 16 tokens. (In float32, and in bf16 at real widths from 4 tokens, the
    dense and gathered products are computed by different XLA kernels and differ by rounding:
    docs/bench/moe/README.md.)"""
    cfg, mlp = _layer(save_hf, family)
    rng = np.random.default_rng(2)
    for tokens in TOKENS:
        x_BTD = jnp.asarray(rng.standard_normal((1, tokens, cfg.hidden_size)), jnp.float32)
        out = _outputs(cfg, mlp, x_BTD, jnp.bfloat16)
        np.testing.assert_array_equal(out["gather"], out["dense"], err_msg=f"{tokens} tokens")
