"""Flax modules for a pre-norm Llama-style decoder layer, shared by the target and the drafter.

Parameter names mirror the Hugging Face checkpoint keys (``self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``...), so conversion is a rename plus one transpose per matrix. Matrices are stored in
the layout the einsums want: ``q_proj.kernel`` is ``[D, N, H]``, ``o_proj.kernel`` is ``[N, H, D]``,
``mlp.*_proj.kernel`` is ``[in, out]``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.cache import write_rows

_init = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return ops.rms_norm(x, weight, self.eps)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """Static attention shape and options (hashable, so it can live inside a static config)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    out_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    eps: float = 1e-6


class Attention(nn.Module):
    """Self-attention over the KV cache. Writes the new keys/values, then attends with ``visible_BTS``."""

    spec: AttentionSpec
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTS):
        s, dt = self.spec, self.dtype

        def proj(name, heads):
            return nn.DenseGeneral(
                (heads, s.head_dim),
                use_bias=s.qkv_bias,
                dtype=dt,
                param_dtype=dt,
                kernel_init=_init,
                name=name,
            )(x_BTD)

        q_BTNH = proj("q_proj", s.num_heads)
        k_BTGH = proj("k_proj", s.num_kv_heads)
        v_BTGH = proj("v_proj", s.num_kv_heads)
        if s.qk_norm:
            q_BTNH = RMSNorm(s.eps, dt, name="q_norm")(q_BTNH)
            k_BTGH = RMSNorm(s.eps, dt, name="k_norm")(k_BTGH)
        q_BTNH = ops.apply_rope(q_BTNH, cos_BTH, sin_BTH)
        k_BTGH = ops.apply_rope(k_BTGH, cos_BTH, sin_BTH)
        k_BGSH = write_rows(k_BGSH, k_BTGH, start_B)
        v_BGSH = write_rows(v_BGSH, v_BTGH, start_B)
        # Attend over the first W slots only (W = the visibility mask's width, a static window bucket that
        # covers every row's context): the cost follows the context, not the cache size.
        W = visible_BTS.shape[-1]
        out_BTNH = ops.attention(q_BTNH, k_BGSH[:, :, :W], v_BGSH[:, :, :W], visible_BTS)
        y_BTD = nn.DenseGeneral(
            s.out_dim,
            axis=(-2, -1),
            use_bias=s.o_bias,
            dtype=dt,
            param_dtype=dt,
            kernel_init=_init,
            name="o_proj",
        )(out_BTNH)
        return y_BTD, k_BGSH, v_BGSH


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    hidden: int
    bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        D, dt = x_BTD.shape[-1], self.dtype

        def linear(name, n_out):
            return nn.Dense(n_out, use_bias=self.bias, dtype=dt, param_dtype=dt, kernel_init=_init, name=name)

        h_BTF = jax.nn.silu(linear("gate_proj", self.hidden)(x_BTD)) * linear("up_proj", self.hidden)(x_BTD)
        return linear("down_proj", D)(h_BTF)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h = x + attn(norm(x)); h + mlp(norm(h))``."""

    attn: AttentionSpec
    mlp_hidden: int
    mlp_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTS):
        eps, dt = self.attn.eps, self.dtype
        y_BTD, k_BGSH, v_BGSH = Attention(self.attn, dt, name="self_attn")(
            RMSNorm(eps, dt, name="input_layernorm")(x_BTD),
            cos_BTH,
            sin_BTH,
            k_BGSH,
            v_BGSH,
            start_B,
            visible_BTS,
        )
        h_BTD = x_BTD + y_BTD
        mlp = MLP(self.mlp_hidden, self.mlp_bias, dt, name="mlp")
        h_BTD = h_BTD + mlp(RMSNorm(eps, dt, name="post_attention_layernorm")(h_BTD))
        return h_BTD, k_BGSH, v_BGSH
