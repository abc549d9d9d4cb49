"""The recipe's ``random`` target (``target.model: random``) and the drafter layer a target gets.

A random target is a Llama, a GPT-OSS or a Qwen3-MoE of the recipe's shape (``target.family``) with the
tokenizer's vocabulary. The mixture-of-experts families are described as a Hugging Face ``config.json``
first and read back through :func:`peagle_jax.models.hf_config.from_hf_config`, so the random model is
exactly what the loader makes of the directory :func:`save_random_target` writes (which transformers
loads as well). GPT-OSS takes the YaRN RoPE of the real model (theta 150000, factor 32, beta 32 / 1, not
truncated) over the recipe's context: ``max_position_embeddings`` is ``target.max_seq_len`` and the original
context 1/32 of it (as gpt-oss's 131072 and 4096), so that positions past it are YaRN-interpolated as in
the real model's long contexts; its layers slide and attend fully in turn; its attention sinks and biases
are drawn at random (flax initialises them to zero, which would leave the sinks untested).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax

from peagle_jax.models.config import ModelConfig, RopeConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.train.recipe import parse_layer_types

# GPT-OSS's own RoPE (gpt-oss-20b and gpt-oss-120b config.json: original context 4096 of 131072).
GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}


def random_target_hf_config(t, vocab_size: int, eos_token_ids: tuple[int, ...]) -> dict:
    """The Hugging Face config dict of the recipe's random mixture-of-experts target ``t`` (a
    :class:`peagle_jax.train.recipe.TargetConfig` with ``family`` gpt_oss or qwen3_moe)."""
    hf = {
        "model_type": t.family,
        "vocab_size": vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.hidden_size // t.num_heads,
        "max_position_embeddings": t.max_seq_len,
        "eos_token_id": list(eos_token_ids),
        "tie_word_embeddings": False,
        "num_experts_per_tok": t.experts_per_token,
    }
    if t.family == "gpt_oss":
        types = parse_layer_types(t.layer_types, t.num_layers)
        hf.update(
            num_local_experts=t.num_experts,
            sliding_window=t.sliding_window,
            rope_parameters={
                **GPT_OSS_ROPE,
                "truncate": False,
                "original_max_position_embeddings": t.max_seq_len // int(GPT_OSS_ROPE["factor"]),
            },
            **({"layer_types": types} if types else {}),
        )
    else:
        hf.update(
            num_experts=t.num_experts,
            moe_intermediate_size=t.moe_intermediate_size or t.intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return hf


def random_target(t, tokenizer) -> tuple[ModelConfig, dict]:
    """``(cfg, params)`` of the recipe's random target ``t`` with ``tokenizer``'s vocabulary."""
    from peagle_jax.models.model import init_params

    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    if t.family == "llama":
        cfg = ModelConfig(
            family="llama",
            vocab_size=len(tokenizer),
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_layers=t.num_layers,
            num_heads=t.num_heads,
            num_kv_heads=t.num_kv_heads,
            head_dim=t.hidden_size // t.num_heads,
            tie_word_embeddings=True,
            eos_token_ids=eos,
            max_position_embeddings=t.max_seq_len,
        )
        return cfg, init_params(cfg, jax.random.key(t.seed))
    cfg = from_hf_config(random_target_hf_config(t, len(tokenizer), eos))
    init_key, extra_key = jax.random.split(jax.random.key(t.seed))
    params = init_params(cfg, init_key)
    keys = iter(jax.random.split(extra_key, len(jax.tree.leaves(params))))

    def draw(path, x):  # sinks ~ N(0, 1) (the size of an attention logit), biases ~ N(0, 0.02) like the weights
        name = jax.tree_util.keystr(path)
        if "sinks" in name:
            return jax.random.normal(next(keys), x.shape, x.dtype)
        if "bias" in name:
            return 0.02 * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return cfg, jax.tree_util.tree_map_with_path(draw, params)


def save_random_target(cfg: ModelConfig, params, tokenizer, path: Path) -> None:
    """Write the random target as a Hugging Face directory (config.json, safetensors, the tokenizer), which
    peagle_jax and transformers both load, so that the exported drafter runs against it:
    ``generate --model DIR/target --drafter DIR/drafter``."""
    from peagle_jax.models.hf_config import to_hf_config
    from peagle_jax.models.weights import params_to_hf, write_safetensors

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(to_hf_config(cfg), indent=1))
    write_safetensors(path, params_to_hf(params, cfg))
    tokenizer.save_pretrained(str(path))


def drafter_layer(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The drafter's decoder layers for target ``cfg``: the target's width, heads and vocabulary. For a
    dense target they are its own kind of layer; for GPT-OSS and Qwen3-MoE they are plain Llama layers
    (dense MLP of the target's ``intermediate_size``, no biases, sinks or sliding window, default RoPE at
    the target's theta), as in the released P-EAGLE drafters of those models."""
    plain = {}
    if cfg.moe is not None or cfg.attn_sinks or cfg.sliding_window:
        plain = dict(
            family="llama", moe=None, attn_sinks=False, sliding_window=None, layer_types=(), qkv_bias=False,
            o_bias=False, mlp_bias=False, qk_norm=False, rope=RopeConfig(theta=cfg.rope.theta),
            tie_word_embeddings=True,
        )  # fmt: skip
    return cfg.replace(num_layers=num_layers, aux_layer_ids=(), **plain)
