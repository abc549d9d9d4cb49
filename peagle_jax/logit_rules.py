"""Per-row rules on the target's logits before temperature, top-k and top-p, in every graph that picks a
token, as arrays (changing them never recompiles): presence_penalty, frequency_penalty, logit_bias and a
grammar's allowed tokens (structured outputs, :mod:`peagle_jax.grammar`).

A row's adjusted logit of token t is ``(logit + bias[t]) - (presence * (c[t] > 0) + frequency * c[t])``,
``c[t]`` the times the row generated t so far (the prompt does not count: vLLM's and the OpenAI API's
reading), and -inf where the row's grammar forbids t. Greedy rows take the argmax of the adjusted logits;
sampling rows draw from them. The raw log-probabilities (:mod:`peagle_jax.logprobs`) stay those of the
unadjusted logits. A row without penalties, bias or grammar keeps its logits bit for bit.

Under speculation every node of a drafted tree is judged by its own path: the committed counts plus the
drafted tokens from depth 1 down to the node (:func:`tree_logits`), and the grammar's mask after that path
(computed on the host per node, :mod:`peagle_jax.grammar`). The adjusted logit of every token a plain step
would see after that prefix is the same expression on the same values, so speculative output equals plain
output token for token. A constrained row's drafted tokens may come from the host too
(:attr:`LogitRules.drafted`: grammar-aware drafting replaces the candidates its grammar forbids); which
tokens are drafted never changes the output.

``counts`` and ``bias`` are ``[B, V]`` arrays of the serving engine's every slot, of which a step over its
first R rows reads R (:class:`peagle_jax.serve.slots.SlotEngine` keeps them on the device and adds each
step's tokens with :func:`count_tokens`); the masks are bitmasks, 32 tokens per int32 word (llguidance's
layout: token t is bit ``t % 32`` of word ``t // 32``), one per row and tree node.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables
from peagle_jax.errors import UserError
from peagle_jax.platform import branching_allowed

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as the OpenAI API
MAX_BIAS = 100.0  # |logit_bias| values, as the OpenAI API


def mask_words(vocab: int) -> int:
    """int32 words of a token bitmask over ``vocab`` tokens."""
    return -(-vocab // 32)


class LogitRules(NamedTuple):
    """The rules of a step over R rows and T tree nodes (T = 1 for a plain step). ``presence``, ``frequency``
    [R] float32, ``active`` [R] bool (the row has penalties or a bias), ``bias`` [B, V] float32 and ``counts``
    [B, V] int32 (B >= R: the first R rows are read), ``allowed`` [R, T, W] int32 bitmasks of the tokens each
    node may pick (all ones where free), ``constrained`` [R] bool (the row has a grammar: its masks and its
    ``drafted`` tokens [R, T - 1], the tree nodes' own, are used). Where a graph may branch
    (:func:`peagle_jax.platform.branching_allowed`), a step in which no row is active or constrained skips
    the rules (the same logits)."""

    presence: jax.Array
    frequency: jax.Array
    active: jax.Array
    bias: jax.Array
    counts: jax.Array
    allowed: jax.Array
    constrained: jax.Array
    drafted: jax.Array


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


def _allowed(words, vocab: int):
    """Bitmask words [..., W] as booleans [..., vocab]."""
    bits = jnp.repeat(words, 32, axis=-1)[..., :vocab]
    shift = (jnp.arange(vocab, dtype=jnp.int32) % 32).reshape((1,) * (bits.ndim - 1) + (vocab,))
    return ((bits >> shift) & 1) == 1


def _when_used(rules: LogitRules, apply, logits):
    """``apply()``, or the float32 ``logits`` where no row is active or constrained and the graph may branch."""
    if not branching_allowed():
        return apply()
    used = jnp.any(rules.active) | jnp.any(rules.constrained)
    return jax.lax.cond(used, apply, lambda: logits.astype(jnp.float32))


def step_logits(logits_RV, rules: LogitRules | None):
    """A plain step's logits [R, V] under ``rules`` (T = 1; unchanged when None)."""
    if rules is None:
        return logits_RV
    R, V = logits_RV.shape
    r = rules

    def apply():
        out = _adjust(logits_RV, r.bias[:R], r.counts[:R], r.presence[:, None], r.frequency[:, None])
        return jnp.where(_allowed(r.allowed[:, 0], V), out, -jnp.inf)

    return _when_used(rules, apply, logits_RV)


def _path_pairs(tree) -> tuple[np.ndarray, np.ndarray]:
    """(node, ancestor) index pairs, static: for every drafted node, each node on its path from depth 1 down
    to itself (the drafted tokens its prefix holds beyond the committed ones)."""
    anc, depths = tree.ancestors(), (0, *tree.depths)
    pairs = [(i, int(anc[i, d])) for i in range(1, tree.size + 1) for d in range(depths[i])]
    return np.array([p[0] for p in pairs], np.int32), np.array([p[1] for p in pairs], np.int32)


def node_tokens(nodes_BN, rules: LogitRules | None):
    """A tree's drafted node tokens [B, N]: the constrained rows' from ``rules.drafted`` (the host's
    grammar-aware draft), the others' as drafted on the device."""
    if rules is None or not nodes_BN.shape[1]:
        return nodes_BN
    return jnp.where(rules.constrained[:, None], rules.drafted, nodes_BN)


def tree_logits(logits_BTV, tokens_BT, tree, rules: LogitRules | None):
    """The logits [B, T, V] of every node of ``tree`` (node 0 the root; ``tokens_BT`` the nodes' tokens)
    under ``rules`` by each node's own path: penalties with the committed counts for every token and, at each
    token drafted on the path, the count plus its times on the path; the node's grammar mask
    (``rules.allowed[:, node]``). Unchanged when None."""
    if rules is None:
        return logits_BTV
    B, T, V = logits_BTV.shape
    r = rules
    bias, counts = r.bias[:B], r.counts[:B]
    presence, frequency = r.presence[:, None], r.frequency[:, None]
    node, anc = _path_pairs(tree)

    def apply():
        out = _adjust(logits_BTV, bias[:, None], counts[:, None], presence[:, :, None], frequency[:, :, None])
        if len(node):
            b = jnp.arange(B)[:, None]
            tok_BP = tokens_BT[:, anc]
            same_node = jnp.asarray(node[:, None] == node[None, :])  # [P, P]: pairs on the same node's path
            times_BP = jnp.sum(same_node[None] & (tok_BP[:, :, None] == tok_BP[:, None, :]), axis=-1)
            vals_BP = _adjust(
                logits_BTV[b, node[None], tok_BP], bias[b, tok_BP], counts[b, tok_BP] + times_BP, presence, frequency
            )
            out = out.at[b, node[None], tok_BP].set(vals_BP)
        return jnp.where(_allowed(r.allowed, V), out, -jnp.inf)

    return _when_used(rules, apply, logits_BTV)


@functools.partial(executables.jit, donate_argnames=("counts",))
def count_tokens(counts, tokens_RP, n_R):
    """``counts`` [B, V] with each of the first R rows' first ``n`` tokens of ``tokens_RP`` added."""
    R, P = tokens_RP.shape
    add = (jnp.arange(P)[None, :] < n_R[:, None]).astype(counts.dtype)
    return counts.at[jnp.arange(R)[:, None], tokens_RP].add(add)


@functools.partial(executables.jit, donate_argnames=("counts", "bias"))
def start_row(counts, bias, b, first, bias_V):
    """Row ``b`` (an int32 scalar) starts a request: its counts hold only its first token, its bias is
    ``bias_V``."""
    row = jnp.zeros(counts.shape[1], counts.dtype).at[first].set(1)
    return counts.at[b].set(row), bias.at[b].set(bias_V)
