"""The target LLM (Llama / Qwen2 / Qwen3 / GPT-OSS / Qwen3-MoE) as a Flax module, and its pure device entry points.

Entry points are pure functions of ``(params, cache, inputs)`` with the :class:`ModelConfig` static and the
cache donated. Each compiles once per input shape: callers pad to fixed buckets (see
:mod:`peagle_jax.engine.buckets`), so prompt lengths, positions and accepted counts never trigger a compile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from peagle_jax import executables, ops
from peagle_jax.models.cache import KVCache
from peagle_jax.models.config import ModelConfig
from peagle_jax.models.layers import AttentionSpec, DecoderLayer, Linear, RMSNorm


class ForwardOut(NamedTuple):
    """``logits`` [B, M, V] (M = T, or the gathered positions), ``aux`` [B, T, X] (the residual stream
    entering each of the A aux layers, concatenated in increasing layer id), ``hidden`` [B, T, D] (final
    normed)."""

    logits: jax.Array
    aux: jax.Array
    hidden: jax.Array


def attention_spec(cfg: ModelConfig) -> AttentionSpec:
    return AttentionSpec(
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        out_dim=cfg.hidden_size,
        qkv_bias=cfg.qkv_bias,
        o_bias=cfg.o_bias,
        qk_norm=cfg.qk_norm,
        eps=cfg.rms_norm_eps,
        sinks=cfg.attn_sinks,
    )


class Transformer(nn.Module):
    """Decoder-only target model. Parameter tree mirrors Hugging Face: ``embed_tokens``, ``layers.{i}``,
    ``norm``, ``lm_head`` (absent when embeddings are tied)."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens_BT, positions_BT, start_B, visible_BTW, cache: KVCache, logits_at_BM=None):
        cfg, dt = self.cfg, self.cfg.jnp_dtype
        embed_VD = self.param("embed_tokens", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size), dt)
        x_BTD = jnp.take(embed_VD, tokens_BT, axis=0).astype(dt)
        inv_freq = ops.rope_inv_freq(cfg.rope, cfg.head_dim)
        cos_BTH, sin_BTH = ops.rope_cos_sin(positions_BT, inv_freq, ops.rope_scale(cfg.rope))
        spec = attention_spec(cfg)
        sliding_BTW = None
        if any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
            sliding_BTW = ops.sliding_visible(visible_BTW, start_B, positions_BT, cfg.sliding_window)
        taps, new_k, new_v = {}, [], []
        for i in range(cfg.num_layers):
            taps[i] = x_BTD
            moe = cfg.moe if cfg.is_sparse(i) else None
            layer = DecoderLayer(spec, cfg.intermediate_size, cfg.mlp_bias, dt, moe, cfg.family, name=f"layers.{i}")
            vis_BTW = sliding_BTW if cfg.is_sliding(i) else visible_BTW
            x_BTD, k, v = layer(x_BTD, cos_BTH, sin_BTH, cache.k[i], cache.v[i], start_B, vis_BTW)
            new_k.append(k)
            new_v.append(v)
        hidden_BTD = RMSNorm(cfg.rms_norm_eps, dt, cfg.family == "gpt_oss", name="norm")(x_BTD)
        h_BMD = hidden_BTD
        if logits_at_BM is not None:
            h_BMD = jnp.take_along_axis(hidden_BTD, logits_at_BM[:, :, None], axis=1)
        if cfg.tie_word_embeddings:
            logits_BMV = ops.linear(embed_VD, h_BMD, preferred_element_type=jnp.float32)
        else:
            logits_BMV = Linear((cfg.vocab_size,), dtype=dt, name="lm_head")(h_BMD).astype(jnp.float32)
        aux_BTX = jnp.concatenate([taps[j] for j in cfg.aux_layer_ids], axis=-1)
        return ForwardOut(logits_BMV, aux_BTX, hidden_BTD), KVCache(tuple(new_k), tuple(new_v))


def init_params(cfg: ModelConfig, key: jax.Array):
    """Random parameters (for tiny test models); real weights come from :mod:`peagle_jax.models.weights`."""
    cache = KVCache.zeros(cfg.num_layers, 1, 4, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    start = jnp.zeros((1,), jnp.int32)
    variables = Transformer(cfg).init(key, tokens, tokens, start, ops.visible_mask(start, 1, 4), cache)
    return variables["params"]


def new_cache(cfg: ModelConfig, batch: int, slots: int) -> KVCache:
    return KVCache.zeros(cfg.num_layers, batch, slots, cfg.num_kv_heads, cfg.head_dim, cfg.jnp_dtype)


def forward(
    params,
    cache: KVCache,
    tokens_BT,
    start_B,
    *,
    cfg: ModelConfig,
    mask_BTT=None,
    positions_BT=None,
    logits_at_BM=None,
    window: int | None = None,
):
    """T new tokens per row, written to cache slots ``start[b] .. start[b]+T-1``.

    ``window`` (static) limits attention to the first W cache slots; the caller picks a bucket with
    ``start[b] + T <= W`` for every live row, so the attention cost follows the context length.

    ``positions_BT`` are the RoPE positions (default: the write slots; a tree passes its depths instead).
    ``mask_BTT`` says which new tokens each new token sees (default causal); committed slots below
    ``start[b]`` are always visible. ``logits_at_BM`` gathers M positions before the LM head (prefill only
    needs the last one). Returns ``(ForwardOut, cache)``.
    """
    start_B, positions_BT, visible_BTW = ops.new_token_layout(
        start_B, tokens_BT.shape[1], cache.num_slots, window, mask_BTT, positions_BT
    )
    return Transformer(cfg).apply(
        {"params": params},
        tokens_BT.astype(jnp.int32),
        positions_BT,
        start_B,
        visible_BTW,
        cache,
        logits_at_BM,
    )


@functools.partial(executables.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def forward_jit(params, cache, tokens_BT, start_B, mask_BTT=None, positions_BT=None, *, cfg, window=None):
    """Jitted :func:`forward` returning logits at every new position (verification, tests)."""
    return forward(
        params, cache, tokens_BT, start_B, cfg=cfg, mask_BTT=mask_BTT, positions_BT=positions_BT, window=window
    )


@functools.partial(executables.jit, static_argnames=("cfg", "window"), donate_argnames=("cache",))
def prefill(params, cache, tokens_BT, lengths_B, start_B, *, cfg, window=None):
    """Prefill a batch of prompts padded to one length bucket T (right padding).

    Row b's prompt is ``tokens[b, :lengths[b]]``, written at slots ``start[b]..`` (``start`` is 0 for a fresh
    prompt, or the previous chunk's end when a long prompt is prefilled in chunks). Padding positions write
    cache slots beyond the prompt; those are invisible to later queries and overwritten by decoding.
    Returns logits [B, V] at each row's last prompt token, aux [B, T, X], hidden [B, T, D], and the cache.
    """
    last_B1 = jnp.maximum(lengths_B - 1, 0).astype(jnp.int32)[:, None]
    out, cache = forward(params, cache, tokens_BT, start_B, cfg=cfg, logits_at_BM=last_B1, window=window)
    return ForwardOut(out.logits[:, 0], out.aux, out.hidden), cache
