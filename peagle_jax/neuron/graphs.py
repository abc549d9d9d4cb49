"""Every device graph the generators call, for a set of serving buckets, with abstract inputs.

A graph is one jitted entry point with its static arguments bound and its inputs given as
``jax.ShapeDtypeStruct``: exporting needs shapes only, so a full-size model is exported without its
weights in memory (parameters come from ``jax.eval_shape`` of the initialiser).

The set is what :class:`peagle_jax.engine.generator.Generator` and
:class:`peagle_jax.spec.generator.SpeculativeGenerator` can call with these buckets: the step keys and
prefill chunks come from :mod:`peagle_jax.spec.plan`, which their warm-ups enumerate too, and the cache
slots and window buckets from a generator built with these buckets. For each batch bucket B,

- plain decoding: ``prefill`` per (prompt bucket, attention window) a chunked prompt can reach, the
  first-token ``sample``, ``decode_step`` per window (greedy and, with ``sampling``, sampling);
- per draft shape (each K as a chain, each tree): the target ``prefill`` and the ``drafter_prefill`` over
  the speculative cache (it has more slots), ``parallel_draft`` and (with ``sequential``)
  ``sequential_draft`` per draft window, ``verify`` per window, and (with ``fused``) ``fused_step`` per
  window (it runs draft and verify at one window), and ``write_context`` (the verified aux states into the
  next draft's context); with ``adaptive`` (the server's default step-length policy) the same for the
  shorter chains it picks from (``adaptive_chains``, over the same K + 1 context slots), the plain step
  (``plain_step`` per window) and ``flush_context`` per window (the Q queued context elements, see
  :func:`peagle_jax.spec.state.queue_slots`, into the drafter cache);
- once: ``fused_mask_hidden`` (run at load).

Every graph that picks a token is the server's variant (:class:`peagle_jax.serve.slots.SlotEngine` built by
``python -m peagle_jax.serve``): it returns the emitted tokens' log-probabilities and takes the slots'
penalties, logit biases and grammar masks (:mod:`peagle_jax.logit_rules`); ``start_row`` and
``count_tokens`` keep the slots' generated-token counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import DraftContext, drafter_prefill, fused_mask_hidden, parallel_draft, sequential_draft
from peagle_jax.drafter.model import init_drafter_params, new_drafter_cache
from peagle_jax.engine.generator import Generator, decode_step, sample_jit
from peagle_jax.logit_rules import LogitRules, count_tokens, mask_words, start_row
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.neuron.buckets import ServingBuckets
from peagle_jax.sampling import SamplingParams
from peagle_jax.sharding import AXIS, CACHE_SPEC, check_target_tp, param_shardings, target_dispatch
from peagle_jax.spec.graphs import flush_context, fused_step, plain_step, write_context
from peagle_jax.spec.plan import prefill_keys, serving_trees, step_keys, windows_up_to
from peagle_jax.spec.state import cache_slack, queue_slots
from peagle_jax.spec.tree import Tree, chain, parse_tree
from peagle_jax.spec.verify import verify


@dataclasses.dataclass(frozen=True)
class Graph:
    """One entry point with its static arguments: ``fn(*args, **static)`` (args abstract)."""

    name: str
    fn: Callable
    args: tuple
    static: dict[str, Any]


def sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def abstract_params(cfg: ModelConfig):
    return jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))


def abstract_drafter_params(dcfg: DrafterConfig):
    return jax.eval_shape(lambda: init_drafter_params(dcfg, jax.random.key(0)))


def _sampling(B):
    return SamplingParams(sds((B,), jnp.float32), sds((B,), jnp.int32), sds((B,), jnp.float32))


def _rules(B, V, T=1):
    """The server's per-row penalties, logit bias and grammar masks of T nodes (its engine passes them to every
    graph that samples)."""
    f32, flags = sds((B,), jnp.float32), sds((B,), jnp.bool_)
    words, drafted = sds((B, T, mask_words(V)), jnp.int32), sds((B, T - 1), jnp.int32)
    return LogitRules(f32, f32, flags, sds((B, V), jnp.float32), sds((B, V), jnp.int32), words, flags, drafted)


def _served(B, V, T=1) -> dict:
    """The keywords the server's engine passes every graph that samples: log-probabilities on
    (:mod:`peagle_jax.logprobs`) and the slots' logit rules (:mod:`peagle_jax.logit_rules`) for T nodes."""
    return dict(logprobs=True, rules=_rules(B, V, T))


def _counting_graphs(B: int, V: int, widths) -> list[Graph]:
    """The server's per-slot token counts: a request's start (one row) and each step's tokens (``widths``:
    the tokens per row a step emits, 1 for a plain step, K + 1 for a draft of depth K)."""
    counts, bias = sds((B, V), jnp.int32), sds((B, V), jnp.float32)
    i32 = sds((), jnp.int32)
    out = [Graph(f"start_row_b{B}", start_row, (counts, bias, i32, i32, sds((V,), jnp.float32)), {})]
    for P in sorted(set(widths)):
        args = (counts, sds((B, P), jnp.int32), sds((B,), jnp.int32))
        out.append(Graph(f"count_tokens_b{B}_p{P}", count_tokens, args, {}))
    return out


def _placed(tree, shardings):
    """Abstract arrays carrying shardings (a tree of them, or one for every leaf)."""
    if isinstance(shardings, NamedSharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _cache(cfg: ModelConfig, B: int, S: int, mesh=None):
    cache = jax.eval_shape(lambda: model.new_cache(cfg, B, S))
    return cache if mesh is None else _placed(cache, NamedSharding(mesh, CACHE_SPEC))


def _dcache(dcfg: DrafterConfig, B: int, S: int, mesh=None):
    cache = jax.eval_shape(lambda: new_drafter_cache(dcfg, B, S))
    return cache if mesh is None else _placed(cache, NamedSharding(mesh, PartitionSpec()))


def abstract_mesh(tp: int):
    """A ``tp``-device mesh of no particular devices: enough to export partitioned graphs on one CPU."""
    return AbstractMesh((tp,), (AXIS,), axis_types=(AxisType.Auto,))


def tree_name(tree: Tree) -> str:
    return f"chain{tree.depth}" if tree.is_chain else f"tree{tree.size}d{tree.depth}w{tree.width}"


def _prefill_graph(cfg, params, cache, B: int, S: int, T: int, W: int) -> Graph:
    """The target's prefill of one (batch, slots, chunk, window) bucket; plain and speculative lists share it."""
    ints = sds((B,), jnp.int32)
    return Graph(
        f"prefill_b{B}_s{S}_t{T}_w{W}",
        model.prefill,
        (params, cache, sds((B, T), jnp.int32), ints, ints),
        dict(cfg=cfg, window=W),
    )


def plain_graphs(cfg, params, buckets: ServingBuckets, mesh=None) -> list[Graph]:
    gen = Generator(
        cfg,
        None,
        max_seq_len=buckets.max_seq_len,
        prefill_buckets=buckets.prefill_buckets,
        batch_buckets=buckets.batch_buckets,
        window_buckets=buckets.window_buckets,
    )
    S, V = gen.num_slots, cfg.vocab_size
    modes = (True, False) if buckets.sampling else (True,)
    out = []
    for B in gen.batch_buckets:
        cache = _cache(cfg, B, S, mesh)
        ints = sds((B,), jnp.int32)
        for T, W in prefill_keys(gen.prefill_buckets, gen.window_buckets, buckets.max_seq_len):
            out.append(_prefill_graph(cfg, params, cache, B, S, T, W))
        for g in modes:
            mode = "greedy" if g else "sampling"
            args = (sds((B, V), jnp.float32), _sampling(B), sds((B,), jnp.uint32), ints)
            static = dict(greedy_only=g, rules=_rules(B, V))
            out.append(Graph(f"sample_b{B}_{mode}", sample_jit, args, static))
        for key in step_keys([B], [chain(0)], windows_up_to(gen.window_buckets, buckets.max_seq_len), modes):
            mode, W = "greedy" if key.greedy_only else "sampling", key.window
            args = (params, cache, ints, ints, sds((B,), jnp.uint32), _sampling(B))
            static = dict(cfg=cfg, greedy_only=key.greedy_only, window=W, **_served(B, V))
            out.append(Graph(f"decode_b{B}_s{S}_w{W}_{mode}", decode_step, args, static))
        out += _counting_graphs(B, V, [1])
    return out


def speculative_graphs(cfg, params, dcfg, dparams, buckets: ServingBuckets, tree: Tree, mesh=None) -> list[Graph]:
    """The graphs of a generator drafting ``tree`` (K = its depth, C = K + 1 context slots); with
    ``buckets.adaptive`` also those of its shorter step lengths (:func:`peagle_jax.spec.adaptive.step_trees`: a
    plain step and a chain of each ``buckets.adaptive_chains``, drafted over the same C slots and cache) and
    ``flush_context``, which keeps the drafter current during plain steps (``make_room``)."""
    gen = Generator(
        cfg,
        None,
        max_seq_len=buckets.max_seq_len,
        prefill_buckets=buckets.prefill_buckets,
        batch_buckets=buckets.batch_buckets,
        slack=cache_slack(tree),
        window_buckets=buckets.window_buckets,
    )
    S, K = gen.num_slots, tree.depth
    C, Q, X = K + 1, queue_slots(K), len(cfg.aux_layer_ids) * cfg.hidden_size
    dt = cfg.jnp_dtype
    embed = None if dcfg.own_embedding else params["embed_tokens"]
    mask_g = sds((dcfg.hidden_size,), dcfg.layer.jnp_dtype) if dcfg.parallel else None
    draft_windows = windows_up_to(gen.window_buckets, buckets.max_seq_len + 2 * K + 1)
    steps = serving_trees(tree, adaptive=buckets.adaptive, chains=buckets.adaptive_chains)
    kinds = (["parallel"] if dcfg.parallel else []) + (["sequential"] if buckets.sequential else [])
    out = []
    for B in gen.batch_buckets:
        cache, dcache = _cache(cfg, B, S, mesh), _dcache(dcfg, B, S, mesh)
        ints = sds((B,), jnp.int32)
        ctx = DraftContext(sds((B, C), jnp.int32), sds((B, Q, X), dt), ints, ints)  # a draft reads C of Q aux slots
        prefills = prefill_keys(gen.prefill_buckets, gen.window_buckets, buckets.max_seq_len)
        out += [_prefill_graph(cfg, params, cache, B, S, T, W) for T, W in prefills]
        for T, W in prefills:
            args = (dparams, dcache, sds((B, T), jnp.int32), sds((B, T, X), dt), ints, embed)
            out.append(Graph(f"drafter_prefill_b{B}_s{S}_t{T}_w{W}", drafter_prefill, args, dict(cfg=dcfg, window=W)))
        if buckets.adaptive:  # make_room: the Q queued context elements, at any window they can reach
            for W in windows_up_to(gen.window_buckets, buckets.max_seq_len + Q):
                args = (dparams, dcache, sds((B, Q), jnp.int32), ctx.aux, ints, ints, sds((B,), jnp.bool_), embed)
                name = f"flush_context_b{B}_s{S}_c{Q}_w{W}"
                out.append(Graph(name, flush_context, args, dict(cfg=dcfg, window=W)))
        for step in steps:
            caches = (cache, dcache, ctx)
            out += _step_graphs(cfg, params, dcfg, dparams, buckets, gen, step, B, caches, kinds, draft_windows)
            if not step.depth:
                continue
            tn = f"c{C}_{tree_name(step)}"
            args = (ctx.aux, sds((B, step.depth + 1, X), dt), ints, sds((B,), jnp.bool_))
            out.append(Graph(f"write_context_b{B}_c{Q}_n{step.depth + 1}", write_context, args, {}))
            for Wd in draft_windows:
                static = dict(cfg=dcfg, K=step.depth, top_n=step.width, window=Wd)  # drafts sample nothing
                if "parallel" in kinds:
                    args = (dparams, dcache, ctx, mask_g, embed)
                    name = f"parallel_draft_b{B}_s{S}_{tn}_n{step.width}_w{Wd}"
                    out.append(Graph(name, parallel_draft, args, static))
                if "sequential" in kinds:
                    args = (dparams, dcache, ctx, embed)
                    name = f"sequential_draft_b{B}_s{S}_{tn}_n{step.width}_w{Wd}"
                    out.append(Graph(name, sequential_draft, args, static))
        out += _counting_graphs(B, cfg.vocab_size, [1, K + 1])
    return out


def _step_graphs(cfg, params, dcfg, dparams, buckets, gen, step: Tree, B, caches, kinds, draft_windows) -> list[Graph]:
    """The verify graphs of one step tree per window and sampling mode (for ``chain(0)`` the plain step's),
    and with ``buckets.fused`` the fused draft + verify graphs (a plain step is never fused). ``caches``: the
    abstract target cache, drafter cache and draft context of batch bucket B."""
    cache, dcache, ctx = caches
    S, tn, ints = gen.num_slots, tree_name(step), sds((B,), jnp.int32)
    served = _served(B, cfg.vocab_size, step.size + 1)  # a mask per tree node
    C, Q = ctx.tokens.shape[1], ctx.aux.shape[1]  # the draft's context slots, the queue's
    embed = None if dcfg.own_embedding else params["embed_tokens"]
    mask_g = sds((dcfg.hidden_size,), dcfg.layer.jnp_dtype) if dcfg.parallel else None
    verify_windows = windows_up_to(gen.window_buckets, buckets.max_seq_len + step.size + 1)
    out = []
    modes = (True, False) if buckets.sampling else (True,)
    drafts = sds((B, step.depth, step.width), jnp.int32)
    verify_args = (params, cache, ints, drafts, ints, sds((B,), jnp.uint32), _sampling(B))
    for key in step_keys([B], [step], verify_windows, modes):
        g, W = key.greedy_only, key.window
        mode = "greedy" if g else "sampling"
        if not step.depth:  # the target decodes the root; its aux state joins the draft context
            args = (params, cache, ctx.aux, ints, ints, ints, sds((B,), jnp.bool_), *verify_args[-2:])
            static = dict(cfg=cfg, window=W, greedy_only=g, **served)
            out.append(Graph(f"plain_b{B}_s{S}_c{Q}_w{W}_{mode}", plain_step, args, static))
            continue
        static = dict(cfg=cfg, tree=step, window=W, greedy_only=g, **served)
        out.append(Graph(f"verify_b{B}_s{S}_{tn}_w{W}_{mode}", verify, verify_args, static))
    if not buckets.fused or not step.depth:  # a plain step is never fused
        return out
    # The fused step runs both halves at one window, the larger of the two (SpecStepper.draft_verify).
    for key in step_keys([B], [step], sorted(set(draft_windows) | set(verify_windows)), modes):
        g, W = key.greedy_only, key.window
        mode = "greedy" if g else "sampling"
        for kind in kinds:
            seq = kind == "sequential"
            args = (params, cache, dparams, dcache, ctx, None if seq else mask_g, embed, ints, ints)
            args += (sds((B,), jnp.uint32), _sampling(B))
            static = dict(cfg=cfg, dcfg=dcfg, tree=step, sequential=seq, draft_window=W, window=W, greedy_only=g)
            static |= served
            out.append(Graph(f"fused_{kind}_b{B}_s{S}_c{C}_{tn}_w{W}_{mode}", fused_step, args, static))
    return out


def all_graphs(
    cfg: ModelConfig, dcfg: DrafterConfig, buckets: ServingBuckets, tp: int = 1, expert_split: str = "auto"
) -> list[Graph]:
    """Every graph for these buckets, deduplicated by name (a graph shared by two draft shapes once).

    With ``tp > 1`` the graphs are the tensor-parallel ones (:mod:`peagle_jax.sharding`): parameters and KV
    cache carry their ``tp`` shardings over an abstract mesh (a mixture of experts split as ``expert_split``
    says), the drafter is replicated, and each exported module is a ``tp``-device program for the compiler's
    partitioner."""
    params, dparams = abstract_params(cfg), abstract_drafter_params(dcfg)
    mesh = None
    if tp > 1:
        check_target_tp(tp, cfg, expert_split)
        mesh = abstract_mesh(tp)
        params = _placed(params, param_shardings(params, mesh, expert_split, target_dispatch(cfg)))
        dparams = _placed(dparams, NamedSharding(mesh, PartitionSpec()))
    graphs = plain_graphs(cfg, params, buckets, mesh)
    trees = [chain(k) for k in buckets.k_values] + [parse_tree(t) for t in buckets.trees]
    for tree in trees:
        graphs += speculative_graphs(cfg, params, dcfg, dparams, buckets, tree, mesh)
    if dcfg.parallel:
        graphs.append(Graph("fused_mask_hidden", fused_mask_hidden, (dparams,), dict(cfg=dcfg)))
    seen, unique = set(), []
    for g in graphs:
        if g.name not in seen:
            seen.add(g.name)
            unique.append(g)
    return unique
