"""The speculative step's device graphs besides the draft and the verify themselves.

- :func:`fused_step`: draft (:func:`peagle_jax.drafter.draft.parallel_draft` or ``sequential_draft``) and
  verify (:func:`peagle_jax.spec.verify.verify`) in one graph;
- :func:`write_context`: the verified aux states into the next draft's context;
- :func:`plain_step`: a plain step (K' = 0) inside speculative decoding: the target decodes each row's root
  and its aux state joins the queued draft context;
- :func:`flush_context`: the queued context elements into the drafter cache.

Each is jitted once per shape bucket; counts are data, never shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from peagle_jax import executables
from peagle_jax.drafter.draft import drafter_prefill, parallel_draft, sequential_draft
from peagle_jax.spec.tree import chain
from peagle_jax.spec.verify import verify


@functools.partial(
    executables.jit,
    static_argnames=("cfg", "dcfg", "tree", "sequential", "draft_window", "window", "greedy_only", "logprobs"),
    donate_argnames=("cache", "dcache"),
)
def fused_step(
    params,
    cache,
    dparams,
    dcache,
    ctx,
    mask_g,
    embed,
    root,
    q,
    seeds,
    sampling,
    *,
    cfg,
    dcfg,
    tree,
    sequential,
    draft_window,
    window,
    greedy_only,
    logprobs=False,
    rules=None,
):
    """Draft and verify in one graph (one device launch per step): the two jitted functions inline.
    ``logprobs`` (static): the verify's output carries the emitted tokens' log-probabilities; ``rules``:
    the verify's."""
    kw = dict(cfg=dcfg, K=tree.depth, top_n=tree.width, window=draft_window)
    if sequential:
        draft, dcache = sequential_draft(dparams, dcache, ctx, embed, **kw)
    else:
        draft, dcache = parallel_draft(dparams, dcache, ctx, mask_g, embed, **kw)
    out, cache = verify(
        params,
        cache,
        root,
        draft.tokens,
        q,
        seeds,
        sampling,
        cfg=cfg,
        tree=tree,
        window=window,
        greedy_only=greedy_only,
        logprobs=logprobs,
        rules=rules,
    )
    return out, cache, dcache


def _write_context(ctx_aux_BQX, aux_RPX, at_R, live_R):
    """Write each live row r's P aux states (the first R rows) at its queued draft-context slots
    ``at[r] ..``; slots outside them, and the rows that are not live, keep theirs. Selects, no scatter."""
    R, P = aux_RPX.shape[:2]
    rel_RQ = jnp.arange(ctx_aux_BQX.shape[1])[None, :] - at_R[:, None]  # aux index of each context slot
    take_RQ1 = (live_R[:, None] & (rel_RQ >= 0) & (rel_RQ < P))[:, :, None]
    src_RQX = jnp.take_along_axis(aux_RPX, jnp.clip(rel_RQ, 0, P - 1)[:, :, None], axis=1)
    new_RQX = jnp.where(take_RQ1, src_RQX.astype(ctx_aux_BQX.dtype), ctx_aux_BQX[:R])
    return jax.lax.dynamic_update_slice_in_dim(ctx_aux_BQX, new_RQX, 0, axis=0)


write_context = executables.jit(_write_context, donate_argnums=0)


@functools.partial(
    executables.jit, static_argnames=("cfg", "window", "greedy_only", "logprobs"), donate_argnames=("cache", "ctx_aux")
)
def plain_step(
    params,
    cache,
    ctx_aux,
    root_R,
    q_R,
    at_R,
    live_R,
    seeds_R,
    sampling,
    *,
    cfg,
    window,
    greedy_only,
    logprobs=False,
    rules=None,
):
    """A plain step inside speculative decoding, in one graph: the target decodes each row's root (the verify
    of ``chain(0)``) and the root's aux state joins the row's pending draft context at slot ``at`` (live rows
    of the first R; ``ctx_aux`` holds B >= R rows). Returns (next token [R], cache, ctx_aux), and with
    ``logprobs`` (static) the next tokens' :class:`~peagle_jax.logprobs.TokenLogprobs` [R, 1] last.
    ``rules``: :class:`peagle_jax.logit_rules.LogitRules` of the rows (None: none)."""
    none_R01 = jnp.zeros((root_R.shape[0], 0, 1), jnp.int32)
    out, cache = verify(
        params, cache, root_R, none_R01, q_R, seeds_R, sampling, cfg=cfg, tree=chain(0), window=window,
        greedy_only=greedy_only, logprobs=logprobs, rules=rules,
    )  # fmt: skip
    ctx_aux = _write_context(ctx_aux, out.aux, at_R, live_R)
    if not logprobs:
        return out.tokens[:, 0], cache, ctx_aux
    return out.tokens[:, 0], cache, ctx_aux, out.logprobs


@functools.partial(executables.jit, static_argnames=("cfg", "window"), donate_argnames=("dcache", "ctx_aux"))
def flush_context(dparams, dcache, ctx_tokens_RQ, ctx_aux, start_R, last_R, move_R, embed, *, cfg, window):
    """:meth:`peagle_jax.spec.stepper.SpecStepper.make_room` in one graph: the first R rows' Q queued context
    slots go into the drafter cache at slots ``start ..``, and in each ``move`` row the last pending element
    (slot ``last``) moves to slot 0."""
    R = ctx_tokens_RQ.shape[0]
    dcache = drafter_prefill(dparams, dcache, ctx_tokens_RQ, ctx_aux[:R], start_R, embed, cfg=cfg, window=window)
    keep_R1X = jnp.take_along_axis(ctx_aux[:R], last_R[:, None, None], axis=1)
    return dcache, _write_context(ctx_aux, keep_R1X, jnp.zeros(R, jnp.int32), move_R)
