"""Parity with transformers' PyTorch models on random tiny Llama / Qwen2 / Qwen3 checkpoints."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import tiny_hf_model

from peagle_jax.models import model as M
from peagle_jax.models.weights import load_target

CASES = [
    # family, seed, heads, kv_heads, tied, extra config
    ("llama", 0, 4, 4, False, {}),  # MHA, untied
    ("llama", 1, 4, 2, True, {}),  # GQA, tied
    ("llama", 2, 4, 1, False, {"attention_bias": True, "mlp_bias": True}),
    (
        "llama",
        3,
        4,
        2,
        True,
        {
            "rope_theta": 500000.0,
            "max_position_embeddings": 1024,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    ("qwen2", 4, 4, 2, False, {}),
    ("qwen2", 5, 4, 4, True, {}),
    ("qwen3", 6, 4, 2, False, {}),
    ("qwen3", 7, 4, 1, True, {"head_dim": 32}),
]


def _torch_forward(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor(ids), output_hidden_states=True)
    return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.mark.parametrize("family,seed,heads,kv_heads,tied,extra", CASES)
def test_logits_and_aux_match_transformers(save_hf, family, seed, heads, kv_heads, tied, extra):
    hf = tiny_hf_model(family, seed=seed, heads=heads, kv_heads=kv_heads, tied=tied, **extra)
    cfg, params = load_target(save_hf(hf), aux_layer_ids=(0, 1, 3))
    ids = np.random.RandomState(seed).randint(0, cfg.vocab_size, (2, 24))
    ref_logits, ref_hidden = _torch_forward(hf, ids)
    out, _ = M.forward_jit(params, M.new_cache(cfg, 2, 32), jnp.asarray(ids), jnp.zeros(2, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    aux = np.asarray(out.aux).reshape(2, 24, 3, cfg.hidden_size)
    for i, j in enumerate(cfg.aux_layer_ids):  # vLLM convention: residual entering layer j
        np.testing.assert_allclose(aux[:, :, i], ref_hidden[j], atol=1e-5, rtol=0)


def test_long_context_llama3_rope(save_hf):
    """600 positions, past the llama3 rope's original context, against transformers."""
    hf = tiny_hf_model(
        "llama",
        seed=11,
        kv_heads=2,
        rope_theta=500000.0,
        max_position_embeddings=2048,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    )
    cfg, params = load_target(save_hf(hf))
    assert cfg.rope.type == "llama3"
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 600))
    ref_logits, _ = _torch_forward(hf, ids)
    out, _ = M.forward_jit(params, M.new_cache(cfg, 1, 640), jnp.asarray(ids), jnp.zeros(1, jnp.int32), cfg=cfg)
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)


def test_default_aux_layers_are_vllm_defaults(save_hf):
    hf = tiny_hf_model("llama", num_hidden_layers=8)
    cfg, _ = load_target(save_hf(hf))
    assert cfg.aux_layer_ids == (2, 4, 5)  # [2, L//2, L-3]
