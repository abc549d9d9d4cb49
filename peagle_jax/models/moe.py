"""Mixture-of-experts MLPs (GPT-OSS, Qwen3-MoE) in one fixed-shape graph.

Shape letters: docs/glossary.md (E = experts). Parameters mirror the Hugging Face names, in the layout the
einsums want (transposed once, at conversion, by :mod:`peagle_jax.models.weights`):

- router: ``router.weight`` [E, D] and ``router.bias`` [E] (GPT-OSS), ``gate.weight`` [E, D] (Qwen3-MoE);
- experts: ``experts.gate_up_proj`` [E, 2, F, D] (gate then up, ``[out, in]`` per expert, as the dense
  ``mlp.gate_up_proj``), ``experts.down_proj`` [E, D, F]; GPT-OSS adds ``gate_up_proj_bias`` [E, 2, F]
  and ``down_proj_bias`` [E, D].

Two dispatches, both fixed-shape (no shape depends on the routing, nothing is sorted over the vocabulary, no
token is dropped: a capacity limit would break lossless verification), both the exact weighted sum over each
token's top-k experts:

- ``dense``: every expert runs on every token (``out_BTED``, E / top-k times the expert FLOPs), then each
  token takes its k experts' outputs (``take_along_axis``, no scatter);
- ``gather``: each token gathers its k experts' weights (``jnp.take`` over E) and runs only those, which
  reads k of E experts per token: the decode step of a large MoE.

Both end in :func:`combine` (each expert's output, bias included, times its routing weight, summed over k in
top-k order), so they differ only where XLA computes the expert products themselves differently: on the CPU
the dense products (``W @ x^T`` over all experts) and the gathered ones (a matrix-vector product per token
and expert) are different kernels, which round differently in float32 and, at real widths, in bf16
(``tests/test_moe_dispatch.py``; ``docs/bench/moe/README.md``). ``MoEConfig.dispatch`` picks one, or
``"auto"`` by shape (:func:`dispatch_for`). The default is ``dense`` everywhere, so that a decode step and a
verify of the same rows run the same dispatch (speculative decoding is tested token for token against plain
decoding).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from peagle_jax import ops
from peagle_jax.models.config import MoEConfig

_init = nn.initializers.normal(stddev=0.02)


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
    when the tokens' top-k experts are fewer than all E (a decode step of a large MoE reads k of E experts'
    weights), and runs every expert densely otherwise."""
    if cfg.dispatch != "auto":
        return cfg.dispatch
    return "gather" if tokens * cfg.top_k < cfg.num_experts else "dense"


class Router(nn.Module):
    """``logits_BTE = x . W^T (+ b)``."""

    num_experts: int
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BTD):
        weight_ED = self.param("weight", _init, (self.num_experts, x_BTD.shape[-1]), self.dtype)
        logits_BTE = jnp.einsum("BTD,ED->BTE", x_BTD, weight_ED)
        if self.use_bias:
            logits_BTE = logits_BTE + self.param("bias", _init, (self.num_experts,), self.dtype)[None, None, :]
        return logits_BTE


class Experts(nn.Module):
    """The top-k experts of every token, summed with their routing weights.

    ``clamped``: GPT-OSS experts (biases; ``(clip(up, ±limit) + 1) * g * sigmoid(alpha g)``, g = min(gate,
    limit)); otherwise SiLU-gated without bias (Qwen3-MoE). ``dispatch`` ``"dense"`` runs all E experts on
    every token (``out_BTED``, each a contraction over F as in the gathered path) and then takes the k
    selected ones' outputs; ``"gather"`` gathers each token's k experts' weights and runs only those. Both
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
        gate_up = self.param("gate_up_proj", _init, (E, 2, F, D), dt)
        down_EDF = self.param("down_proj", _init, (E, D, F), dt)
        gate_up_bias = self.param("gate_up_proj_bias", nn.initializers.zeros, (E, 2, F), dt) if self.clamped else None
        down_bias_ED = self.param("down_proj_bias", nn.initializers.zeros, (E, D), dt) if self.clamped else None
        if self.dispatch == "dense":
            # ops.linear (W @ x^T) for all experts at once: written as x @ W^T, XLA's CPU dot repacks all E
            # experts' weights on every call (python -m peagle_jax.bench.linear measures the two forms).
            gate_up_BTE2F = ops.linear(gate_up, x_BTD)
            gate_BTEF, up_BTEF = gate_up_BTE2F[..., 0, :], gate_up_BTE2F[..., 1, :]
            if self.clamped:
                gate_BTEF = gate_BTEF + gate_up_bias[None, None, :, 0]
                up_BTEF = up_BTEF + gate_up_bias[None, None, :, 1]
            out_BTED = jnp.einsum("BTEF,EDF->BTED", self._activation(gate_BTEF, up_BTEF), down_EDF)
            if self.clamped:
                out_BTED = out_BTED + down_bias_ED[None, None]
            out = jnp.take_along_axis(out_BTED, top_idx[..., None], axis=2)  # [B, T, k, D]
        elif self.dispatch == "gather":  # [B, T, k, ...]: each token's k experts
            gate_up_sel = jnp.take(gate_up, top_idx, axis=0)  # [B, T, k, 2, F, D]
            gate = jnp.einsum("BTD,BTkFD->BTkF", x_BTD, gate_up_sel[:, :, :, 0])
            up = jnp.einsum("BTD,BTkFD->BTkF", x_BTD, gate_up_sel[:, :, :, 1])
            if self.clamped:
                bias_sel = jnp.take(gate_up_bias, top_idx, axis=0)  # [B, T, k, 2, F]
                gate, up = gate + bias_sel[:, :, :, 0], up + bias_sel[:, :, :, 1]
            out = jnp.einsum("BTkF,BTkDF->BTkD", self._activation(gate, up), jnp.take(down_EDF, top_idx, axis=0))
            if self.clamped:
                out = out + jnp.take(down_bias_ED, top_idx, axis=0)
        else:
            raise ValueError(f"unknown MoE dispatch {self.dispatch!r}")
        return combine(out, top_w).astype(x_BTD.dtype)

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
