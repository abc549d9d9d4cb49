"""Mixture-of-experts MLPs (GPT-OSS, Qwen3-MoE) in one fixed-shape graph.

Shape letters: docs/glossary.md (E = experts). Parameters mirror the Hugging Face names, in the layout the
einsums want (transposed once, at conversion, by :mod:`peagle_jax.models.weights`):

- router: ``router.weight`` [E, D] and ``router.bias`` [E] (GPT-OSS), ``gate.weight`` [E, D] (Qwen3-MoE);
- experts: ``experts.gate_up_proj`` [E, 2, F, D] (gate then up, ``[out, in]`` per expert, as the dense
  ``mlp.gate_up_proj``), ``experts.down_proj`` [E, D, F]; GPT-OSS adds ``gate_up_proj_bias`` [E, 2, F]
  and ``down_proj_bias`` [E, D];
- packed experts (``MoEConfig.experts == "packed"``, GPT-OSS's MXFP4 checkpoints) hold the two matrices as
  uint8 pairs in the same layout, blocks running along the contracted axis: ``gate_up_proj_blocks``
  [E, 2, F, D/32, 16] and ``gate_up_proj_scales`` [E, 2, F, D/32], ``down_proj_blocks`` [E, D, F/32, 16]
  and ``down_proj_scales`` [E, D, F/32]; biases stay in the run dtype. A call unpacks the experts it reads
  (:func:`peagle_jax.models.mxfp4_jax.unpack`, the values transformers dequantizes to, bit for bit): the
  gathered dispatch slices a pair's uint8 blocks and scales and unpacks that expert, the dense one unpacks
  every expert. Both then run the unpacked dispatch's products, so packed and unpacked experts give the
  same logits.

Two dispatches, both fixed-shape (no shape depends on the routing, nothing is sorted over the vocabulary, no
token is dropped: a capacity limit would break lossless verification), both the exact weighted sum over each
token's top-k experts:

- ``dense``: every expert runs on every token (``out_BTED``, E / top-k times the expert FLOPs), then each
  token takes its k experts' outputs (``take_along_axis``, no scatter);
- ``gather``: each (token, expert) pair on its own, unrolled: the pair slices its expert's weights out of
  the stacked ones (``dynamic_index_in_dim``) and runs the products on one row, so a call reads only the
  selected experts' weights: the decode step of a large MoE.

Both end in :func:`combine` (each expert's output, bias included, times its routing weight, summed over k in
top-k order). ``MoEConfig.dispatch`` picks one, or ``"auto"`` (the default) by shape (:func:`dispatch_for`):
``gather`` where the call's tokens select fewer than E experts' worth of pairs (a decode step, a small
verify), ``dense`` otherwise (prefill, large verifies and batches), so the pairs a graph unrolls stay below
E. The expert products run in different XLA kernels in the two dispatches, and at real widths XLA's CPU
fusions round a token's output differently with the call's shape in either dispatch, so decode and verify
agree to rounding, not bit for bit (``docs/bench/moe/README.md``); at the tiny widths of the tests they agree
bit for bit and speculative decoding is tested token for token against plain decoding with ``auto``.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.models import mxfp4_jax
from peagle_jax.models.config import MoEConfig

_init = nn.initializers.normal(stddev=0.02)


def _random_blocks(key, shape, dtype=jnp.uint8):
    """Uniform random bytes: two uniform FP4 codes each (random tiny models)."""
    return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(dtype)


def _random_scales(key, shape, dtype=jnp.uint8):
    """Scales 2**-8 and 2**-7: unpacked values of about the unpacked experts' 0.02 standard deviation."""
    return jax.random.randint(key, shape, 119, 121, jnp.int32).astype(dtype)


def combine(out, top_w):
    """``out_BTD``: each token's k expert outputs ``out`` [B, T, k, D] weighted by ``top_w`` [B, T, k] and
    summed over k in top-k order (as transformers: expert output, bias included, times its weight). Both
    dispatches end here, so they round alike once their expert outputs agree."""
    return jnp.sum(out * top_w.astype(out.dtype)[..., None], axis=2)


def route_gpt_oss(logits_BTE, top_k: int):
    """GPT-OSS: the top-k logits, softmax over those k. Returns (indices, weights), each [B, T, k]."""
    top_logits, top_idx = jax.lax.top_k(logits_BTE, top_k)
    return top_idx, jax.nn.softmax(top_logits, axis=-1)


def route_qwen3_moe(logits_BTE, top_k: int, norm_topk_prob: bool):
    """Qwen3-MoE: softmax over all experts in fp32, the top-k, renormalised when ``norm_topk_prob``."""
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    top_w, top_idx = jax.lax.top_k(probs_BTE, top_k)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return top_idx, top_w.astype(logits_BTE.dtype)


def dispatch_for(tokens: int, cfg: MoEConfig) -> str:
    """The dispatch a call over ``tokens`` (B * T, static) uses: ``cfg.dispatch``, where ``"auto"`` gathers
    when the tokens' (token, expert) pairs are fewer than E (a decode step of a large MoE reads k of E
    experts' weights), and runs every expert densely otherwise."""
    if cfg.dispatch != "auto":
        return cfg.dispatch
    return "gather" if tokens * cfg.top_k < cfg.num_experts else "dense"


class Router(nn.Module):
    """``logits_BTE = x . W^T (+ b)``, through :func:`peagle_jax.ops.linear` as every other product (in bf16
    it computes a row's product independently of the other rows of the call)."""

    num_experts: int
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        weight_ED = self.param("weight", _init, (self.num_experts, x_BTD.shape[-1]), self.dtype)
        logits_BTE = ops.linear(weight_ED, x_BTD)
        if self.use_bias:
            logits_BTE = logits_BTE + self.param("bias", _init, (self.num_experts,), self.dtype)[None, None, :]
        return logits_BTE


class Experts(nn.Module):
    """The top-k experts of every token, summed with their routing weights.

    ``clamped``: GPT-OSS experts (biases; ``(clip(up, ±limit) + 1) * g * sigmoid(alpha g)``, g = min(gate,
    limit)); otherwise SiLU-gated without bias (Qwen3-MoE). ``dispatch`` ``"dense"`` runs all E experts on
    every token (``out_BTED``, each a contraction over F as in the gathered path) and then takes the k
    selected ones' outputs; ``"gather"`` slices each token's k experts' weights and runs only those. Both
    then weight and sum the k outputs by the same arithmetic (:func:`combine`), in top-k order, so they
    agree bit for bit wherever XLA computes the expert products alike (``tests/test_moe_dispatch.py``)."""

    cfg: MoEConfig
    clamped: bool
    dtype: jnp.dtype = jnp.float32
    dispatch: str = "dense"

    @nn.compact
    def __call__(self, x_BTD, top_idx, top_w):
        m, dt = self.cfg, self.dtype
        E, F, D = m.num_experts, m.intermediate_size, x_BTD.shape[-1]
        weights = self._packed(E, F, D) if m.experts == "packed" else self._unpacked(E, F, D)
        gate_up_bias = self.param("gate_up_proj_bias", nn.initializers.zeros, (E, 2, F), dt) if self.clamped else None
        down_bias_ED = self.param("down_proj_bias", nn.initializers.zeros, (E, D), dt) if self.clamped else None
        if self.dispatch == "dense":
            gate_up, down_EDF = weights(None, after=top_idx)
            # ops.linear (W @ x^T) for all experts at once: written as x @ W^T, XLA's CPU dot repacks all E
            # experts' weights on every call (python -m peagle_jax.bench.linear measures the two forms).
            gate_up_BTE2F = ops.linear(gate_up, x_BTD)
            gate_BTEF, up_BTEF = gate_up_BTE2F[..., 0, :], gate_up_BTE2F[..., 1, :]
            if self.clamped:
                gate_BTEF = gate_BTEF + gate_up_bias[None, None, :, 0]
                up_BTEF = up_BTEF + gate_up_bias[None, None, :, 1]
            precision = ops.EXACT if math.prod(x_BTD.shape[:2]) <= ops.SMALL_ROWS else None
            out_BTED = jnp.einsum("BTEF,EDF->BTED", self._activation(gate_BTEF, up_BTEF), down_EDF, precision=precision)
            if self.clamped:
                out_BTED = out_BTED + down_bias_ED[None, None]
            out = jnp.take_along_axis(out_BTED, top_idx[..., None], axis=2)  # [B, T, k, D]
        elif self.dispatch == "gather":
            out = self._gathered(x_BTD, top_idx, weights, gate_up_bias, down_bias_ED)
        else:
            raise ValueError(f"unknown MoE dispatch {self.dispatch!r}")
        return combine(out, top_w).astype(x_BTD.dtype)

    def _unpacked(self, E, F, D):
        """The weights in the run dtype, and ``weights(e)``: (gate_up [2, F, D], down [D, F]) of expert ``e``
        (an int32 scalar), or of every expert ([E, 2, F, D], [E, D, F]) for ``e=None`` (``after``: the layer's
        expert indices, which the packed weights' unpacking waits for; unpacked weights need no wait)."""
        gate_up = self.param("gate_up_proj", _init, (E, 2, F, D), self.dtype)
        down_EDF = self.param("down_proj", _init, (E, D, F), self.dtype)

        def weights(e, after=None):
            if e is None:
                return gate_up, down_EDF
            return tuple(jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in (gate_up, down_EDF))

        return weights

    def _packed(self, E, F, D):
        """As :meth:`_unpacked` from the uint8 blocks and scales: ``weights(e)`` slices expert ``e``'s bytes
        and unpacks only those; ``weights(None)`` unpacks every expert."""
        gate_up_shapes, down_shapes = mxfp4_jax.packed_shapes((E, 2, F), D), mxfp4_jax.packed_shapes((E, D), F)
        gate_up = [
            self.param("gate_up_proj_blocks", _random_blocks, gate_up_shapes[0], jnp.uint8),
            self.param("gate_up_proj_scales", _random_scales, gate_up_shapes[1], jnp.uint8),
        ]
        down = [
            self.param("down_proj_blocks", _random_blocks, down_shapes[0], jnp.uint8),
            self.param("down_proj_scales", _random_scales, down_shapes[1], jnp.uint8),
        ]

        def weights(e, after=None):
            pairs = (gate_up, down)
            if e is not None:
                # The expert's bytes copied out first (a barrier keeps the slice out of the unpacking's fusion):
                # unpacking a contiguous array runs several times faster than through a fused dynamic slice.
                pairs = jax.lax.optimization_barrier(
                    [[jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False) for a in pair] for pair in pairs]
                )
            elif after is not None:
                # Unpacking depends on the parameters alone, so XLA's CPU backend unpacks every layer's experts
                # before the first layer runs and holds them all (GPT-OSS-20B's prefill asked for 87 GB; an
                # optimization barrier does not stop it). A data dependence on the layer's routing does: the
                # blocks and scales plus min(indices, 0), which is 0 (expert indices are >= 0).
                zero = jnp.minimum(jnp.min(after), 0).astype(jnp.uint8)
                pairs = [(blocks + zero, scales + zero) for blocks, scales in pairs]
            return tuple(mxfp4_jax.unpack(blocks, scales, self.dtype) for blocks, scales in pairs)

        return weights

    def _gathered(self, x_BTD, top_idx, weights, gate_up_bias, down_bias_ED):
        """``out`` [B, T, k, D]: each (token, expert) pair on its own, unrolled over the B * T * k pairs, so the
        graph grows with the call's tokens: ``auto`` gathers only below E pairs, and an explicit ``gather``
        is meant for decode-sized calls, not prefill. A pair slices its expert's weights out of the stacked
        ones (``weights(e)``, ``dynamic_index_in_dim``: that expert's bytes, not all E experts'; packed, its
        uint8 blocks and scales, unpacked after the slice) and runs the dense dispatch's products on one
        row."""
        B, T, k = top_idx.shape
        x_ND, idx_Nk = x_BTD.reshape(B * T, -1), top_idx.reshape(B * T, k)
        outs = []
        for n in range(B * T):
            for j in range(k):
                e = idx_Nk[n, j]
                gate_up_2FD, down_DF = weights(e)
                # Gate and up apart: one product over [2 * F, D] would merge F with the 2, which a width split
                # over F cannot follow (XLA all-gathers the expert's weights first).
                gate_1F, up_1F = (ops.linear(gate_up_2FD[i], x_ND[n : n + 1]) for i in (0, 1))
                if self.clamped:
                    bias_2F = jax.lax.dynamic_index_in_dim(gate_up_bias, e, 0, keepdims=False)
                    gate_1F, up_1F = gate_1F + bias_2F[None, 0], up_1F + bias_2F[None, 1]
                out_1D = ops.linear(down_DF, self._activation(gate_1F, up_1F))
                if self.clamped:
                    out_1D = out_1D + jax.lax.dynamic_index_in_dim(down_bias_ED, e, 0)
                outs.append(out_1D)
        return jnp.concatenate(outs).reshape(B, T, k, -1)

    def _activation(self, gate, up):
        m = self.cfg
        if not self.clamped:
            return jax.nn.silu(gate) * up
        gate = jnp.minimum(gate, m.swiglu_limit)
        up = jnp.clip(up, -m.swiglu_limit, m.swiglu_limit)
        return (up + 1) * gate * jax.nn.sigmoid(m.swiglu_alpha * gate)


class MoE(nn.Module):
    """The sparse MLP of a GPT-OSS (``family='gpt_oss'``) or Qwen3-MoE layer; the dispatch is chosen
    statically from the number of tokens (:func:`dispatch_for`)."""

    cfg: MoEConfig
    family: str
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        m, dt = self.cfg, self.dtype
        if self.family == "gpt_oss":
            top_idx, top_w = route_gpt_oss(Router(m.num_experts, True, dt, name="router")(x_BTD), m.top_k)
        else:
            logits_BTE = Router(m.num_experts, False, dt, name="gate")(x_BTD)
            top_idx, top_w = route_qwen3_moe(logits_BTE, m.top_k, m.norm_topk_prob)
        dispatch = dispatch_for(x_BTD.shape[0] * x_BTD.shape[1], m)
        return Experts(m, self.family == "gpt_oss", dt, dispatch, name="experts")(x_BTD, top_idx, top_w)
