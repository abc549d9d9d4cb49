"""presence_penalty, frequency_penalty and logit_bias: per-row arrays that change the target's logits before
temperature, top-k and top-p, in every graph that picks a token, so that changing them never recompiles.

A row's adjusted logit of token t is ``(logit + bias[t]) - (presence * (c[t] > 0) + frequency * c[t])``,
``c[t]`` the times the row generated t so far (the prompt does not count: vLLM's and the OpenAI API's
reading). Greedy rows take the argmax of the adjusted logits; sampling rows draw from them. The raw
log-probabilities (:mod:`peagle_jax.logprobs`) stay those of the unadjusted logits. A row without
penalties or bias (zeros) keeps its logits bit for bit.

Under speculation every node of a drafted tree is judged with the counts of its own path: the committed
counts plus the drafted tokens from depth 1 down to the node (:func:`tree_logits`). The adjusted logit of
every token a plain step would see after that prefix is the same expression on the same values, so
speculative output equals plain output token for token.

``counts`` and ``bias`` are ``[B, V]`` arrays of the serving engine's every slot, of which a step over its
first R rows reads R (:class:`peagle_jax.serve.slots.SlotEngine` keeps them on the device and adds each
step's tokens with :func:`count_tokens`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.errors import UserError
from peagle_jax.platform import branching_allowed

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as the OpenAI API
MAX_BIAS = 100.0  # |logit_bias| values, as the OpenAI API


class Penalties(NamedTuple):
    """``presence`` and ``frequency`` [R] float32 and ``active`` [R] bool (whether the row has penalties or a
    bias at all; R: the rows of the step), ``bias`` [B, V] float32 and ``counts`` [B, V] int32 (B >= R: the
    first R rows are read). Where a graph may branch (:func:`peagle_jax.platform.branching_allowed`), a
    step in which no row is ``active`` skips the adjustment (the same logits: an inactive row's are unchanged)."""

    presence: jax.Array
    frequency: jax.Array
    active: jax.Array
    bias: jax.Array
    counts: jax.Array


def check_penalties(presence: float, frequency: float, logit_bias: dict[int, float] | None, vocab: int) -> None:
    """Validate a request's penalties and bias; raise UserError naming the first bad value."""
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise UserError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    for tok, value in (logit_bias or {}).items():
        if not 0 <= tok < vocab:
            raise UserError(f"logit_bias: token id {tok} is outside the vocabulary 0..{vocab - 1}")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise UserError(f"logit_bias: token {tok}'s bias must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value}")


def _adjust(logits, bias, counts, presence, frequency):
    """The adjusted logits, elementwise with broadcasting; one expression for every caller, so that a tree
    node and a plain step round alike."""
    c = counts.astype(jnp.float32)
    return (logits.astype(jnp.float32) + bias) - (presence * (c > 0).astype(jnp.float32) + frequency * c)


def _when_active(pen: Penalties, adjust, logits):
    """``adjust()``, or the float32 ``logits`` where no row is active and the graph may branch."""
    if not branching_allowed():
        return adjust()
    return jax.lax.cond(jnp.any(pen.active), adjust, lambda: logits.astype(jnp.float32))


def step_logits(logits_RV, pen: Penalties | None):
    """A plain step's logits [R, V] adjusted by ``pen`` (unchanged when None)."""
    if pen is None:
        return logits_RV
    R = logits_RV.shape[0]

    def adjust():
        return _adjust(logits_RV, pen.bias[:R], pen.counts[:R], pen.presence[:, None], pen.frequency[:, None])

    return _when_active(pen, adjust, logits_RV)


def _path_pairs(tree) -> tuple[np.ndarray, np.ndarray]:
    """(node, ancestor) index pairs, static: for every drafted node, each node on its path from depth 1 down
    to itself (the drafted tokens its prefix holds beyond the committed ones)."""
    anc, depths = tree.ancestors(), (0, *tree.depths)
    pairs = [(i, int(anc[i, d])) for i in range(1, tree.size + 1) for d in range(depths[i])]
    return np.array([p[0] for p in pairs], np.int32), np.array([p[1] for p in pairs], np.int32)


def tree_logits(logits_BTV, tokens_BT, tree, pen: Penalties | None):
    """The logits [B, T, V] of every node of ``tree`` (node 0 the root; ``tokens_BT`` the nodes' tokens)
    adjusted by ``pen`` with the counts of each node's own path: the committed counts for every token, then,
    at each token drafted on the path, the count plus its times on the path. Unchanged when None."""
    if pen is None:
        return logits_BTV
    B = logits_BTV.shape[0]
    bias, counts = pen.bias[:B], pen.counts[:B]
    presence, frequency = pen.presence[:, None], pen.frequency[:, None]
    node, anc = _path_pairs(tree)

    def adjust():
        out = _adjust(logits_BTV, bias[:, None], counts[:, None], presence[:, :, None], frequency[:, :, None])
        if not len(node):
            return out
        b = jnp.arange(B)[:, None]
        tok_BP = tokens_BT[:, anc]
        same_node = jnp.asarray(node[:, None] == node[None, :])  # [P, P]: pairs on the same node's path
        times_BP = jnp.sum(same_node[None] & (tok_BP[:, :, None] == tok_BP[:, None, :]), axis=-1)
        vals_BP = _adjust(
            logits_BTV[b, node[None], tok_BP], bias[b, tok_BP], counts[b, tok_BP] + times_BP, presence, frequency
        )
        return out.at[b, node[None], tok_BP].set(vals_BP)

    return _when_active(pen, adjust, logits_BTV)


@functools.partial(jax.jit, donate_argnames=("counts",))
def count_tokens(counts, tokens_RP, n_R):
    """``counts`` [B, V] with each of the first R rows' first ``n`` tokens of ``tokens_RP`` added."""
    R, P = tokens_RP.shape
    add = (jnp.arange(P)[None, :] < n_R[:, None]).astype(counts.dtype)
    return counts.at[jnp.arange(R)[:, None], tokens_RP].add(add)


@functools.partial(jax.jit, donate_argnames=("counts", "bias"))
def start_row(counts, bias, b, first, bias_V):
    """Row ``b`` (an int32 scalar) starts a request: its counts hold only its first token, its bias is
    ``bias_V``."""
    row = jnp.zeros(counts.shape[1], counts.dtype).at[first].set(1)
    return counts.at[b].set(row), bias.at[b].set(bias_V)
