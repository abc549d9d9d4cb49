"""Flax modules for a pre-norm Llama-style decoder layer, shared by the target and the drafter.

Parameter names mirror the Hugging Face checkpoint keys (``self_attn.o_proj``, ``mlp.down_proj``,
``input_layernorm``...), and matrices keep Hugging Face's ``[out, in]`` layout (``weight``), only reshaped
to expose heads, so conversion is a rename plus a reshape. ``[out, in]`` is also what a CPU matrix-vector
product reads fastest in a decode step (measured: about 15% faster than ``[in, out]`` over SmolLM2's layers).
Two pairs are stacked, as vLLM stacks them, because one larger matmul beats several small ones:

- ``self_attn.qkv_proj.weight`` ``[G, J+2, H, D]``: for each kv head g, its J query heads (the HF query
  heads ``g*J .. g*J+J-1``, which share kv head g), then its key head, then its value head. Grouping by kv
  head keeps each group whole when the G axis is sharded for tensor parallelism.
- ``mlp.gate_up_proj.weight`` ``[2, F, D]``: gate then up.

Others: ``o_proj.weight`` ``[D, N, H]``, ``down_proj.weight`` ``[D, F]``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.models.cache import read, write_rows
from peagle_jax.models.config import MoEConfig
from peagle_jax.models.moe import MoE

_init = nn.initializers.normal(stddev=0.02)


class Linear(nn.Module):
    """``y = x . W^T (+ b)`` with ``W`` of shape ``features + in_shape`` (Hugging Face ``[out, in]``, heads
    exposed): contracts the last ``in_axes`` axes of ``x`` with the trailing axes of ``W``."""

    features: tuple[int, ...]
    in_axes: int = 1
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        in_shape = x.shape[x.ndim - self.in_axes :]
        weight = self.param("weight", _init, (*self.features, *in_shape), self.dtype)
        y = ops.linear(weight, x, self.in_axes)
        lead = x.shape[: x.ndim - self.in_axes]
        if self.use_bias:
            bias = self.param("bias", nn.initializers.zeros, self.features, self.dtype)
            y = y + bias.reshape((1,) * len(lead) + bias.shape)
        return y


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32
    scale_in_fp32: bool = False  # GPT-OSS: ``(weight * normed).to(dtype)`` rather than Llama's order

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return ops.rms_norm(x, weight, self.eps, self.scale_in_fp32)


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
    sinks: bool = False  # GPT-OSS: a learned softmax sink logit per query head (``self_attn.sinks`` [N])


class Attention(nn.Module):
    """Self-attention over the KV cache. Writes the new keys/values, then attends with ``visible_BTW``."""

    spec: AttentionSpec
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTW):
        s, dt = self.spec, self.dtype

        G, J, H = s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim
        qkv = Linear((G, J + 2, H), use_bias=s.qkv_bias, dtype=dt, name="qkv_proj")(x_BTD)  # [B, T, G, J+2, H]
        B, T = x_BTD.shape[:2]
        q_BTNH = qkv[:, :, :, :J].reshape(B, T, G * J, H)
        k_BTGH = qkv[:, :, :, J]
        v_BTGH = qkv[:, :, :, J + 1]
        if s.qk_norm:
            q_BTNH = RMSNorm(s.eps, dt, name="q_norm")(q_BTNH)
            k_BTGH = RMSNorm(s.eps, dt, name="k_norm")(k_BTGH)
        q_BTNH = ops.apply_rope(q_BTNH, cos_BTH, sin_BTH)
        k_BTGH = ops.apply_rope(k_BTGH, cos_BTH, sin_BTH)
        k_BGSH = write_rows(k_BGSH, k_BTGH, start_B)
        v_BGSH = write_rows(v_BGSH, v_BTGH, start_B)
        # Attend over the first W slots only (W = the visibility mask's width, a static window bucket that
        # covers every row's context): the cost follows the context, not the cache size.
        # The cache may hold more rows than this call has (a slot engine stepping only its first B rows):
        # the new entries went to rows 0..B-1, and only those rows are read.
        W = visible_BTW.shape[-1]
        sinks_N = self.param("sinks", nn.initializers.zeros, (G * J,), dt) if s.sinks else None
        out_BTNH = ops.attention(q_BTNH, read(k_BGSH[:B, :, :W]), read(v_BGSH[:B, :, :W]), visible_BTW, sinks_N=sinks_N)
        y_BTD = Linear((s.out_dim,), in_axes=2, use_bias=s.o_bias, dtype=dt, name="o_proj")(out_BTNH)
        return y_BTD, k_BGSH, v_BGSH


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up stacked in ``gate_up_proj``."""

    hidden: int
    bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        D, dt = x_BTD.shape[-1], self.dtype
        gate_up_BT2F = Linear((2, self.hidden), use_bias=self.bias, dtype=dt, name="gate_up_proj")(x_BTD)
        h_BTF = ops.swiglu(gate_up_BT2F)
        return Linear((D,), use_bias=self.bias, dtype=dt, name="down_proj")(h_BTF)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: ``h = x + attn(norm(x)); h + mlp(norm(h))``. With ``moe`` the MLP is the
    mixture of experts of ``family`` (:mod:`peagle_jax.models.moe`); ``family='gpt_oss'`` also scales its
    norms in fp32."""

    attn: AttentionSpec
    mlp_hidden: int
    mlp_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    moe: MoEConfig | None = None
    family: str = ""

    @nn.compact
    def __call__(self, x_BTD, cos_BTH, sin_BTH, k_BGSH, v_BGSH, start_B, visible_BTW):
        eps, dt, fp32 = self.attn.eps, self.dtype, self.family == "gpt_oss"
        y_BTD, k_BGSH, v_BGSH = Attention(self.attn, dt, name="self_attn")(
            RMSNorm(eps, dt, fp32, name="input_layernorm")(x_BTD),
            cos_BTH,
            sin_BTH,
            k_BGSH,
            v_BGSH,
            start_B,
            visible_BTW,
        )
        h_BTD = x_BTD + y_BTD
        if self.moe is None:
            mlp = MLP(self.mlp_hidden, self.mlp_bias, dt, name="mlp")
        else:
            mlp = MoE(self.moe, self.family, dt, name="mlp")
        h_BTD = h_BTD + mlp(RMSNorm(eps, dt, fp32, name="post_attention_layernorm")(h_BTD))
        return h_BTD, k_BGSH, v_BGSH
