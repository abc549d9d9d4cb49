"""The fixed-shape verify graph: target forward over a static draft tree (:mod:`peagle_jax.spec.tree`),
acceptance, KV compaction.

Acceptance, one rule for greedy and sampling, chains and trees. At every node n (the root is the last
committed token) the target picks y(n): its argmax for a greedy row, or a Gumbel-max draw from the processed
distribution (temperature -> top-k -> top-p, :func:`peagle_jax.sampling.processed_logits`) with the uniforms
of the position being generated; presence/frequency penalties and a logit bias adjust the logits first, each
node's by the tokens of its own path (:func:`peagle_jax.logit_rules.tree_logits`). A child is accepted when its
token equals y(parent) and its parent was accepted; the deepest accepted node wins and y there is the bonus
token. Along the realised path each emitted token is y of its parent, drawn from the target's distribution at
that prefix with the same uniforms plain sampling would use, so the output equals plain decoding token for
token (greedy or seeded sampling), hence is lossless. For a chain with a greedy drafter this is the standard
rule: a draft token d is accepted with probability p(d), and on rejection the emitted token follows p without
d.

Compaction: the accepted path's keys and values are moved to the slots right after the root, so that the
cache again holds the committed sequence contiguously at its positions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax import executables
from peagle_jax.logit_rules import LogitRules, node_tokens, tree_logits
from peagle_jax.logprobs import TokenLogprobs, token_logprobs
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.ops import argmax_first
from peagle_jax.sampling import SamplingParams, greedy_or_sampled, processed_logits, uniforms
from peagle_jax.spec.tree import Tree, chain, parse_tree  # noqa: F401  (re-exported: the trees a verify takes)


class VerifyOut(NamedTuple):
    """For a tree of depth K, P = K + 1: ``tokens`` [B, P] the emitted tokens (the accepted drafts then the
    bonus token; 0 past ``count``), ``count`` [B] how many (1..P; the accepted drafts are ``count - 1``),
    ``aux`` [B, P, X] the target aux hidden states of the root and the accepted nodes (the next draft's
    context; past ``count``, the root's again); ``logprobs`` the raw log-probabilities of the emitted tokens
    and the top ones at each, from the logits at the path node before each (None unless asked for)."""

    tokens: jax.Array
    count: jax.Array
    aux: jax.Array
    logprobs: TokenLogprobs | None = None  # [B, P] of the emitted tokens, with ``logprobs`` on (0 past count)


def _node_choices(logits_BTV, sampling, seeds_B, positions_BT, greedy_only):
    """y(n) for every node: argmax for greedy rows, a seeded Gumbel-max draw for sampling rows."""
    greedy_BT = argmax_first(logits_BTV, axis=-1)
    if greedy_only:
        return greedy_BT
    B, T, V = logits_BTV.shape

    def sampled():
        flat = SamplingParams(*(jnp.repeat(x, T) for x in sampling))
        filtered = processed_logits(logits_BTV.reshape(B * T, V), flat)
        u = uniforms(jnp.repeat(seeds_B, T), positions_BT.reshape(-1), V)
        drawn_BT = argmax_first(filtered - jnp.log(-jnp.log(u)), axis=-1).reshape(B, T)
        return jnp.where((sampling.temperature > 0)[:, None], drawn_BT, greedy_BT)

    return greedy_or_sampled(greedy_BT, sampled, sampling.temperature)


def _compact(cache_BGSH, q_B, path_BK):
    """Move the accepted path's entries (tree node slots ``q + node``) to slots ``q + 1 .. q + K``.

    One gather and one scatter over the first B rows (the cache may hold more; those are left as they are),
    so XLA updates the donated cache in place. Per-row slices written back one by one, or stacked into a
    new cache, made it copy every layer's whole cache at each tree step (two copies per array; tested on
    the compiled graph)."""
    B, K = path_BK.shape
    b_BK = jnp.broadcast_to(jnp.arange(B)[:, None], (B, K))
    moved_BKGH = cache_BGSH[b_BK, :, q_B[:, None] + path_BK]
    return cache_BGSH.at[b_BK, :, q_B[:, None] + 1 + jnp.arange(K)[None, :]].set(moved_BKGH)


@functools.partial(
    executables.jit, static_argnames=("cfg", "tree", "window", "greedy_only", "logprobs"), donate_argnames=("cache",)
)
def verify(
    params,
    cache,
    root_B,
    draft_tokens,
    q_B,
    seeds_B,
    sampling: SamplingParams,
    *,
    cfg: ModelConfig,
    tree: Tree,
    window: int,
    greedy_only: bool,
    logprobs: bool = False,
    rules: LogitRules | None = None,
):
    """Verify one static tree of drafts per row against the target, in one forward pass.

    ``root_B`` is the last committed token, at position ``q_B`` (not yet in the target cache);
    ``draft_tokens`` [B, K, top_n] the draft's candidates per depth (target ids, :class:`Draft.tokens
    <peagle_jax.drafter.draft.Draft>`). Writes the root and the tree at
    slots ``q .. q + size`` (tree mask, RoPE positions ``q + depth``), accepts, and compacts the accepted
    path. Returns ``(VerifyOut, cache)``; the row's next root is ``tokens[count-1]`` at ``q + count``. With
    ``logprobs`` (static), ``VerifyOut.logprobs`` holds the emitted tokens' log-probabilities: emitted token k
    is drawn from the logits at the path's node of depth k, the same prefix plain decoding sees.
    ``rules`` (:mod:`peagle_jax.logit_rules`) adjust each node's logits by its own path: its counts and its
    grammar state.
    """
    K, T = tree.depth, tree.size + 1
    depths = jnp.asarray((0, *tree.depths), jnp.int32)
    if tree.size:  # the tree's nodes: [B, T - 1]
        nodes = draft_tokens[:, jnp.asarray(tree.depths) - 1, jnp.asarray(tree.ranks)]
    else:  # chain(0): the root alone, i.e. a plain decode step that also returns the root's aux state
        nodes = jnp.zeros((root_B.shape[0], 0), jnp.int32)
    nodes = node_tokens(nodes.astype(jnp.int32), rules)
    tokens_BT = jnp.concatenate([root_B[:, None], nodes], axis=1).astype(jnp.int32)
    positions_BT = q_B[:, None] + depths[None, :]
    mask_BTT = jnp.broadcast_to(jnp.asarray(tree.mask()), (q_B.shape[0], T, T))
    out, cache = model.forward(
        params, cache, tokens_BT, q_B, cfg=cfg, mask_BTT=mask_BTT, positions_BT=positions_BT, window=window
    )
    logits_BTV = tree_logits(out.logits, tokens_BT, tree, rules)
    y_BT = _node_choices(logits_BTV, sampling, seeds_B, positions_BT + 1, greedy_only)
    # Accepted: token equals y(parent) and the parent is accepted; parents precede children.
    parents = (0, *tree.parents)
    accepted = [jnp.ones_like(q_B, dtype=bool)]
    for i in range(1, T):
        accepted.append(accepted[parents[i]] & (tokens_BT[:, i] == y_BT[:, parents[i]]))
    accepted_BT = jnp.stack(accepted, axis=1)
    # The deepest accepted node (first in order among equals).
    score_BT = jnp.where(accepted_BT, depths[None, :] * T - jnp.arange(T)[None, :], -1)
    best_B = argmax_first(score_BT, axis=-1)
    count_B = jnp.take(depths, best_B) + 1
    path_BK = jnp.take(jnp.asarray(tree.ancestors()), best_B, axis=0)  # node at each depth 1..K (0 = beyond)
    path_nodes_BP = jnp.concatenate([jnp.zeros((q_B.shape[0], 1), path_BK.dtype), path_BK], axis=1)  # root first
    ks = jnp.arange(K + 1)[None, :]
    # Emitted token k (k = 0..K): y of the path node at depth k, valid while k < count.
    emitted_BP = jnp.take_along_axis(y_BT, path_nodes_BP, axis=1)
    emitted_BP = jnp.where(ks < count_B[:, None], emitted_BP, 0)
    aux_BPX = jnp.take_along_axis(out.aux, path_nodes_BP[:, :, None], axis=1)
    lp = None
    if logprobs:  # the log-softmax over the P path nodes only, not the whole tree
        lp = token_logprobs(jnp.take_along_axis(out.logits, path_nodes_BP[:, :, None], axis=1), emitted_BP)
        lp = lp._replace(logprob=jnp.where(ks < count_B[:, None], lp.logprob, 0.0))
    if not tree.is_chain:  # a chain's path already sits at slots q+1..q+K
        cache = model.KVCache(
            tuple(_compact(k, q_B, path_BK) for k in cache.k), tuple(_compact(v, q_B, path_BK) for v in cache.v)
        )
    return VerifyOut(emitted_BP.astype(jnp.int32), count_B.astype(jnp.int32), aux_BPX, lp), cache
