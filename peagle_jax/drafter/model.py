"""The drafter as a Flax module: EAGLE-3 layout plus P-EAGLE's ``mask_hidden``.

Parameter tree (names mirror the speculators checkpoint keys; matrices in ``[out, in]`` layout, q/k/v and
gate/up stacked as in :mod:`peagle_jax.models.layers`):

    embed_tokens [V, D]          only when the checkpoint carries its own (else the target's is passed in)
    input_norm.weight [X]        norm_before_fc      fc_norm.{i}.weight [X/A]  fc_norm
    fc.weight [D, X]             fuses the concatenated aux hidden states (X = A * the target's width)
    layers.0                     input_layernorm, hidden_norm, self_attn (over 2D inputs), mlp, ...
    layers.{1..L-1}              plain pre-norm decoder layers
    norm.weight [D]   lm_head.weight [U, D]
    mask_hidden [1, 1, X]        P-EAGLE's hidden placeholder, at the width before fc
    d2t [U] int32, t2d [V] bool  only when U < V; target id = draft id + d2t[draft id]

Layer 0 (per element, with ``e = embed(token)`` and ``g`` the fused hidden): ``residual = g`` (or
``hidden_norm(g)`` with norm_before_residual); ``h = residual + attn(cat[input_layernorm(e), hidden_norm(g)])``;
``h = h + mlp(post_attention_layernorm(h))``.
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.models.cache import KVCache
from peagle_jax.models.layers import MLP, Attention, DecoderLayer, Linear, RMSNorm
from peagle_jax.models.model import attention_spec

_init = nn.initializers.normal(stddev=0.02)


class DraftForwardOut(NamedTuple):
    """``logits`` [B, M, U] over the draft vocab (M = T, or the gathered rows); ``hidden`` [B, T, D]: the
    last layer's output (post-norm when ``norm_output``), which sequential drafting feeds back as ``g``."""

    logits: jax.Array
    hidden: jax.Array


class FirstLayer(nn.Module):
    """Drafter layer 0: attention over ``cat[input_layernorm(embed), hidden_norm(g)]`` (2D wide)."""

    cfg: DrafterConfig

    @nn.compact
    def __call__(self, e_BTD, g_BTD, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTW):
        lc, dt = self.cfg.layer, self.cfg.layer.jnp_dtype
        eps = lc.rms_norm_eps
        h_BTD = RMSNorm(eps, dt, name="hidden_norm")(g_BTD)
        residual_BTD = h_BTD if self.cfg.norm_before_residual else g_BTD
        x = jnp.concatenate([RMSNorm(eps, dt, name="input_layernorm")(e_BTD), h_BTD], axis=-1)  # [B, T, 2D]
        y_BTD, k_BGSH, v_BGSH = Attention(attention_spec(lc), dt, name="self_attn")(
            x, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTW
        )
        h_BTD = residual_BTD + y_BTD
        mlp = MLP(lc.intermediate_size, lc.mlp_bias, dt, name="mlp")
        return h_BTD + mlp(RMSNorm(eps, dt, name="post_attention_layernorm")(h_BTD)), k_BGSH, v_BGSH


class Drafter(nn.Module):
    cfg: DrafterConfig

    def setup(self):
        c, lc = self.cfg, self.cfg.layer
        dt, eps = lc.jnp_dtype, lc.rms_norm_eps
        A, D, V, U = c.num_aux, lc.hidden_size, lc.vocab_size, c.draft_vocab_size
        X = A * c.target_hidden_size
        if c.own_embedding:
            self.embed_tokens = self.param("embed_tokens", _init, (V, D), dt)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(eps, dt)
        if c.fc_norm:
            self.fc_norms = [RMSNorm(eps, dt, name=f"fc_norm.{i}") for i in range(A)]
        self.fc = Linear((D,), dtype=dt)
        self.first = FirstLayer(c, name="layers.0")
        spec = attention_spec(lc)
        self.rest = [
            DecoderLayer(spec, lc.intermediate_size, lc.mlp_bias, dt, name=f"layers.{i}")
            for i in range(1, lc.num_layers)
        ]
        self.norm = RMSNorm(eps, dt)
        self.lm_head = Linear((U,), dtype=dt)
        if c.parallel:
            self.mask_hidden = self.param("mask_hidden", _init, (1, 1, X), dt)
        if c.has_vocab_map:
            self.d2t = self.param("d2t", nn.initializers.zeros, (U,), jnp.int32)
            self.t2d = self.param("t2d", nn.initializers.zeros, (V,), jnp.bool_)

    def fuse(self, aux_BTX):
        """``fc`` over the concatenated aux hidden states (after the optional input norms): g [B, T, D]."""
        c = self.cfg
        x = aux_BTX.astype(c.layer.jnp_dtype)
        if c.norm_before_fc:
            x = self.input_norm(x)
        if c.fc_norm:
            chunks = jnp.split(x, c.num_aux, axis=-1)
            x = jnp.concatenate([norm(chunk) for norm, chunk in zip(self.fc_norms, chunks, strict=True)], axis=-1)
        return self.fc(x)

    def fused_mask_hidden(self):
        """``fc(mask_hidden)`` through the same norms as a real aux vector: [D]. Computed once at load."""
        return self.fuse(self.mask_hidden)[0, 0]

    def __call__(
        self, tokens_BT, g_BTD, positions_BT, start_B, visible_BTW, cache: KVCache, embed_VD=None, logits_at_BM=None
    ):
        c, lc = self.cfg, self.cfg.layer
        table_VD = self.embed_tokens if c.own_embedding else embed_VD
        e_BTD = jnp.take(table_VD, tokens_BT, axis=0).astype(lc.jnp_dtype)
        cos_BTH, sin_BTH = ops.rope_cos_sin(positions_BT, ops.rope_inv_freq(lc.rope, lc.head_dim))
        h_BTD, k, v = self.first(e_BTD, g_BTD, cos_BTH, sin_BTH, cache.k[0], cache.v[0], start_B, visible_BTW)
        new_k, new_v = [k], [v]
        for i, layer in enumerate(self.rest, start=1):
            h_BTD, k, v = layer(h_BTD, cos_BTH, sin_BTH, cache.k[i], cache.v[i], start_B, visible_BTW)
            new_k.append(k)
            new_v.append(v)
        normed_BTD = self.norm(h_BTD)
        hidden_BTD = normed_BTD if c.norm_output else h_BTD
        if logits_at_BM is not None:  # only the rows that are drafted from: the LM head is the costly part
            normed_BTD = jnp.take_along_axis(normed_BTD, logits_at_BM[:, :, None], axis=1)
        logits_BMU = self.lm_head(normed_BTD).astype(jnp.float32)
        return DraftForwardOut(logits_BMU, hidden_BTD), KVCache(tuple(new_k), tuple(new_v))

    def init_all(self, aux_BTX, tokens_BT, positions_BT, start_B, visible_BTW, cache, embed_VD=None):
        """Touches every submodule once, so that ``init`` creates the whole parameter tree."""
        return self(tokens_BT, self.fuse(aux_BTX), positions_BT, start_B, visible_BTW, cache, embed_VD)


def init_drafter_params(cfg: DrafterConfig, key: jax.Array):
    """Random drafter parameters (tiny test models); real ones come from a checkpoint."""
    lc = cfg.layer
    cache = KVCache.zeros(lc.num_layers, 1, 4, lc.num_kv_heads, lc.head_dim, lc.jnp_dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    start = jnp.zeros((1,), jnp.int32)
    aux = jnp.zeros((1, 1, cfg.num_aux * cfg.target_hidden_size), lc.jnp_dtype)
    embed = None if cfg.own_embedding else jnp.zeros((lc.vocab_size, lc.hidden_size), lc.jnp_dtype)
    visible = ops.visible_mask(start, 1, 4)
    return Drafter(cfg).init(key, aux, tokens, tokens, start, visible, cache, embed, method=Drafter.init_all)["params"]


def new_drafter_cache(cfg: DrafterConfig, batch: int, slots: int, *, bits: bool = True) -> KVCache:
    """``bits=False`` for training (see :meth:`KVCache.zeros`)."""
    lc = cfg.layer
    return KVCache.zeros(lc.num_layers, batch, slots, lc.num_kv_heads, lc.head_dim, lc.jnp_dtype, bits=bits)
