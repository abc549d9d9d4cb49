"""The speculative step library: prefill (target + drafter), one draft -> verify step, one plain step, and
the drafter-context flush, over a row state the caller holds (:class:`peagle_jax.spec.state.SpecState`).

Each draft -> verify step calls two fixed-shape graphs, the draft (:func:`peagle_jax.drafter.draft.parallel_draft`
or ``sequential_draft``, reading one :class:`~peagle_jax.drafter.draft.DraftContext`) and the verify
(:func:`peagle_jax.spec.verify.verify`), per (row bucket, tree, window bucket) (or one, :func:`fused_step`),
then :func:`write_context` puts the verified aux states in the next draft's context; the accepted count is
data, never a shape. A plain step (K' = 0) is one graph, :func:`plain_step`; the elements plain steps commit
queue up (up to :func:`queue_slots` of them) and one :func:`flush_context` writes them into the drafter cache.
Rows progress independently: each has its own committed length ``q`` (the position of its last committed
token, the next root), and a finished row idles in place (its q stops moving; its writes land at its own
uncommitted slots). Every step's outcome is one :class:`StepResult`.

Per step and row: the drafter's context is the elements committed by the previous step (the emitted tokens,
each paired with the target aux state of the position before it), ``count`` of them, starting at drafter
position ``q_prev``; the draft proposes K depths; the target verifies them with the root at q.

Two drivers use this library: the batch generator (:class:`peagle_jax.spec.generator.SpeculativeGenerator`)
and the serving engine (:class:`peagle_jax.serve.slots.SlotEngine`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import (
    DraftContext,
    drafter_prefill,
    fused_mask_hidden,
    parallel_draft,
    sequential_draft,
)
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine.generator import Generator, RequestError
from peagle_jax.engine.overlap import Launched
from peagle_jax.engine.state import host_copy
from peagle_jax.logprobs import TokenLogprobs, host_logprobs
from peagle_jax.models.cache import KVCache
from peagle_jax.models.config import ModelConfig
from peagle_jax.spec.graphs import flush_context, fused_step, plain_step, write_context
from peagle_jax.spec.plan import Windows
from peagle_jax.spec.state import SpecState, SpecStats, cache_slack, queue_slots
from peagle_jax.spec.tree import Tree, chain
from peagle_jax.spec.verify import verify


@dataclasses.dataclass
class StepResult:
    """What one step emitted, on the host: ``tokens`` [R, K + 1] (row b's first ``count[b]`` are its new
    tokens, 1 for a plain step), ``k`` the step's K' (0: plain), ``logprobs`` the tokens'
    :class:`~peagle_jax.logprobs.TokenLogprobs` [R, K + 1] (with the stepper's :attr:`logprobs`, else None)
    and ``seconds`` from its launch to its read."""

    tokens: np.ndarray
    count: np.ndarray
    k: int
    logprobs: TokenLogprobs | None = None
    seconds: float = 0.0


class DraftState(NamedTuple):
    """The drafter's device state, passed and returned as the target's cache is: its KV cache (None where the
    drafter did not run, an unsynced row's prefill) and the target aux states of the queued context elements
    ``aux`` [B, Q, X] (the host half of the queue is :class:`~peagle_jax.spec.state.SpecState`'s)."""

    cache: KVCache | None
    aux: jax.Array


def _on_device(ctx: DraftContext) -> DraftContext:
    """A draft context of host arrays (the aux states already on the device) as the graphs take it."""
    return DraftContext(jnp.asarray(ctx.tokens), ctx.aux, jnp.asarray(ctx.count), jnp.asarray(ctx.start))


class SpecStepper(Generator):
    """One target with one drafter (P-EAGLE parallel or EAGLE-3 sequential): the graphs of a speculative step
    and the host bookkeeping around them (see the module docstring)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        dcfg: DrafterConfig,
        dparams,
        *,
        k: int | None = None,
        tree: Tree | None = None,
        sequential: bool = False,
        fused: bool = False,
        max_seq_len: int = 2048,
        shard_drafter: bool = False,
        **kwargs,
    ):
        """``tree`` (default a chain of ``k``, default the drafter's ``speculative_tokens``): the largest step.
        With ``mesh`` (tensor parallelism) the drafter is replicated on it, or sharded by the target's rules
        when ``shard_drafter``. ``sequential``: EAGLE-3 drafting (K passes); ``fused``: draft and verify in
        one graph."""
        tree = tree or chain(k or dcfg.speculative_tokens)
        if k is not None and tree.depth != k:
            raise RequestError(f"--tree uses depth {tree.depth} but --k is {k}")
        if not sequential and not dcfg.parallel:
            raise RequestError("this drafter is EAGLE-3 (no mask token / mask_hidden): use sequential drafting")
        if dcfg.layer.vocab_size != cfg.vocab_size:
            raise RequestError(f"drafter vocabulary {dcfg.layer.vocab_size} != target vocabulary {cfg.vocab_size}")
        if dcfg.num_aux * dcfg.target_hidden_size != len(cfg.aux_layer_ids) * cfg.hidden_size:
            raise RequestError(
                f"the drafter reads {dcfg.num_aux} aux states of width {dcfg.target_hidden_size}; the target "
                f"taps {len(cfg.aux_layer_ids)} of width {cfg.hidden_size}"
            )
        if tree.width > dcfg.draft_vocab_size:
            raise RequestError(f"--tree needs {tree.width} candidates per depth; the draft vocab has fewer")
        # A step writes the root + tree nodes past the committed length; the draft window K - 1 mask slots.
        super().__init__(cfg, params, max_seq_len=max_seq_len, slack=cache_slack(tree), **kwargs)
        self.shard_drafter = shard_drafter
        if self.mesh is not None:
            from peagle_jax import sharding

            if shard_drafter:
                lc = dcfg.layer
                sharding.check_tp(
                    self.mesh.size,
                    num_kv_heads=lc.num_kv_heads,
                    intermediate_size=lc.intermediate_size,
                    what="the drafter",
                )
                dparams = sharding.shard_params(dparams, self.mesh)
            else:
                dparams = sharding.replicate(dparams, self.mesh)
        self.dcfg, self.dparams, self.tree, self.sequential, self.fused = dcfg, dparams, tree, sequential, fused
        self.K, self.Q = tree.depth, queue_slots(tree.depth)
        self.windows = Windows(self.window_buckets, self.K, self.Q)
        self.mask_g = None if sequential else fused_mask_hidden(dparams, cfg=dcfg)
        self.embed = None if dcfg.own_embedding else params["embed_tokens"]
        self.spec = SpecStats(accepted_per_position=[0] * self.K)
        # Whether a step waits for its draft before launching the verify, to time the two apart
        # (SpecStats.draft_s; python -m peagle_jax.bench.spec). Otherwise the verify is launched on the
        # draft's unread tokens, so that its launch (~1.6 ms of host time for SmolLM2's ~330 arrays) overlaps
        # the draft instead of following it, and the draft's time is counted as verify, as with ``fused``.
        self.time_draft = False

    def twin(self) -> SpecStepper:
        twin = super().twin()
        twin.spec = SpecStats(accepted_per_position=[0] * self.K)
        return twin

    def reset_statistics(self) -> None:
        """Zero :attr:`spec` in place (the server's /metrics reads this object)."""
        self.spec.reset()

    def context_aux(self, last_aux_BX) -> jax.Array:
        """The queued context's aux states [B, Q, X] after a prefill: the last prompt position's in slot 0."""
        B, X = last_aux_BX.shape
        return jnp.zeros((B, self.Q, X), last_aux_BX.dtype).at[:, 0].set(last_aux_BX)

    def _fused(
        self, cache, dcache, ctx, root, q, seeds, sampling, tree: Tree, window: int, greedy_only: bool, rules=None
    ):
        """:func:`fused_step` (draft and verify in one graph) with the queued draft context ``ctx`` (a
        :class:`DraftContext` of host arrays but its aux states). Returns (verify output, cache, dcache)."""
        return fused_step(
            self.params, cache, self.dparams, dcache, _on_device(ctx), self.mask_g, self.embed, jnp.asarray(root),
            jnp.asarray(q), seeds, sampling,
            cfg=self.cfg, dcfg=self.dcfg, tree=tree, sequential=self.sequential, draft_window=window, window=window,
            greedy_only=greedy_only, logprobs=self.logprobs, rules=rules,
        )  # fmt: skip

    def _draft(self, dcache, ctx: DraftContext, tree: Tree | None = None):
        """The draft of ``tree`` (default the generator's) from ``ctx`` (as :meth:`_fused`'s)."""
        tree = tree or self.tree
        kw = dict(cfg=self.dcfg, K=tree.depth, top_n=tree.width, window=self.windows.draft_window(ctx.start))
        if self.sequential:
            return sequential_draft(self.dparams, dcache, _on_device(ctx), self.embed, **kw)
        return parallel_draft(self.dparams, dcache, _on_device(ctx), self.mask_g, self.embed, **kw)

    def prefill_both(self, prompts: Sequence[Sequence[int]], batch: int, drafter: bool = True, on_logprobs=None):
        """Prefill the target and seed the drafter with the prompts (padded to ``batch`` rows). Returns
        (last-token logits [batch, V], target cache, drafter cache, aux [batch, X] of each last prompt
        position: the aux half of the first draft's context element). Without ``drafter`` the drafter is
        not run (its cache is None), for a row the slot engine leaves unsynced (:attr:`SpecState.synced`).
        ``on_logprobs``: the prompt's log-probabilities, as :meth:`Generator.prefill`'s."""
        lengths = np.array([len(p) for p in prompts] + [1] * (batch - len(prompts)), np.int32)
        dcache = new_drafter_cache(self.dcfg, batch, self.cache_slots(batch)) if drafter else None
        if drafter and self.mesh is not None:
            from peagle_jax import sharding

            dcache = (sharding.shard_cache if self.shard_drafter else sharding.replicate)(dcache, self.mesh)
        last_aux = [None]

        def seed_drafter(out, start, T):
            nonlocal dcache
            if drafter:
                # Element j pairs prompt token j+1 with the target aux of j; the last one (the first
                # generated token) is unknown yet and written by the first draft.
                toks = np.zeros((batch, T), np.int32)
                for b, p in enumerate(prompts):
                    piece = p[start + 1 : start + 1 + T]
                    toks[b, : len(piece)] = piece
                dcache = drafter_prefill(
                    self.dparams,
                    dcache,
                    jnp.asarray(toks),
                    out.aux,
                    jnp.full(batch, start, jnp.int32),
                    self.embed,
                    cfg=self.dcfg,
                    window=self.windows.prefill_window(start, T),
                )
            at = np.clip(lengths - 1 - start, 0, T - 1)
            here = jnp.asarray((lengths - 1 >= start) & (lengths - 1 < start + T))[:, None]
            aux_last = jnp.take_along_axis(out.aux, jnp.asarray(at)[:, None, None], axis=1)[:, 0]
            last_aux[0] = aux_last if last_aux[0] is None else jnp.where(here, aux_last, last_aux[0])

        logits, cache = self.prefill(prompts, batch, on_chunk=seed_drafter, on_logprobs=on_logprobs)
        return logits, cache, dcache, last_aux[0]

    def draft_verify(
        self, cache, drafter: DraftState, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None,
        rules=None,
    ):  # fmt: skip
        """One draft -> verify step over every row of ``state`` (``live`` [B] bool: rows whose results count;
        the others idle in place), not committed (:meth:`run_step` commits it). Returns (its
        :class:`StepResult`, the verified aux states [B, P, X] on the device, cache, drafter) and adds the
        live rows to :attr:`spec`.

        ``tree`` (default the generator's) may be a smaller tree of depth K' <= K and no more nodes, e.g. a
        shorter chain under load: it drafts K' tokens over the same K + 1 context slots and verifies them;
        its tokens are padded to K + 1 columns (a count never exceeds K' + 1, so the padding is never read),
        its aux states are K' + 1. ``rules``:
        :class:`peagle_jax.logit_rules.LogitRules` of the rows (None: none), or a function of the drafted
        candidates [B, K', N] (host) that returns them (a grammar's masks depend on the drafted paths): the
        step then reads the draft before it launches the verify, and is not fused.
        """
        tree = tree or self.tree
        if tree.depth > self.K or tree.size > self.tree.size or not tree.depth:
            raise ValueError(f"a step tree must fit the generator's (depth 1..{self.K}, <= {self.tree.size} nodes)")
        t0 = time.perf_counter()
        window = self.windows.verify_window(state.q[live], tree)
        C = self.K + 1  # the draft reads the first C of the Q queued slots (run_step flushed any beyond)
        # The graphs read the first C aux slots of the rows stepped.
        aux = drafter.aux if len(state.q) == len(drafter.aux) else drafter.aux[: len(state.q)]
        ctx = DraftContext(state.ctx_tokens[:, :C], aux, state.ctx_count, state.ctx_start)
        dcache = drafter.cache
        after_draft = rules if callable(rules) else None
        if self.fused and after_draft is None:
            # One window for both halves (the larger: a wider window is always safe), so the fused graphs
            # are one per window bucket, not one per (draft window, verify window) pair.
            window = max(window, self.windows.draft_window(state.ctx_start))
            out, cache, dcache = self._fused(
                cache, dcache, ctx, state.root, state.q, seeds, sampling, tree, window, greedy_only, rules
            )
            t1 = t0  # one launch: its whole time is counted as verify
        else:
            draft, dcache = self._draft(dcache, ctx, tree)
            if self.time_draft:
                jax.block_until_ready(draft.tokens)
            if after_draft is not None:
                rules = after_draft(np.asarray(draft.tokens))
            t1 = time.perf_counter() if self.time_draft else t0
            out, cache = verify(
                self.params,
                cache,
                jnp.asarray(state.root),
                draft.tokens,
                jnp.asarray(state.q),
                seeds,
                sampling,
                cfg=self.cfg,
                tree=tree,
                window=window,
                greedy_only=greedy_only,
                logprobs=self.logprobs,
                rules=rules,
            )
        tokens, count = np.asarray(out.tokens), np.asarray(out.count)
        if tree.depth < self.K:
            tokens = np.pad(tokens, ((0, 0), (0, self.K - tree.depth)))
        logprobs = None if out.logprobs is None else host_logprobs(out.logprobs, self.K + 1)
        t2 = time.perf_counter()
        self.stats.decode_steps += 1
        for c in count[live]:
            self.spec.target_forwards += 1
            self.spec.emitted += int(c)
            for depth in range(int(c) - 1):
                self.spec.accepted_per_position[depth] += 1
        self.spec.steps += 1
        self.spec.draft_s += t1 - t0
        self.spec.verify_s += t2 - t1
        result = StepResult(tokens, count, tree.depth, logprobs, t2 - t0)
        return result, out.aux, cache, DraftState(dcache, drafter.aux)

    def run_step(
        self, cache, drafter: DraftState, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None,
        rules=None,
    ):  # fmt: skip
        """One step of ``tree`` (default the stepper's) over the first R = ``len(live)`` rows of ``state``
        (which may hold more), read and committed into ``state`` for the live rows: a plain step for a tree
        of depth 0 (:func:`plain_step`), else draft -> verify (:meth:`draft_verify`), whose verified aux
        states join the next draft's context (:func:`write_context`). ``seeds`` and ``sampling`` are R rows.
        Returns (its :class:`StepResult`, cache, drafter)."""
        R, tree = len(live), tree or self.tree
        if not tree.depth:
            return self._plain(cache, drafter, state, seeds, sampling, greedy_only, live, rules)
        drafter = self.make_room(drafter, state, R, full=self.K + 2)  # a draft reads at most K + 1 queued
        result, aux, cache, drafter = self.draft_verify(
            cache, drafter, state.rows(R), seeds, sampling, greedy_only=greedy_only, live=live, tree=tree, rules=rules
        )
        # Host arguments: an eager jnp.zeros would be a device op of its own (~0.4 ms on the CPU, every step).
        drafter = DraftState(drafter.cache, write_context(drafter.aux, aux, np.zeros(R, np.int32), live))
        state.advance(result.tokens, result.count, live)
        return result, cache, drafter

    def _plain(
        self, cache, drafter: DraftState, state: SpecState, seeds, sampling, greedy_only: bool, live, rules=None
    ):
        """A plain step of :meth:`run_step`: one token per row, the drafter's context kept current."""
        launched, cache, drafter = self.launch_plain(
            cache, drafter, state, seeds, sampling, greedy_only, live, rules=rules
        )
        next_R = np.asarray(launched.tokens)
        state.commit_plain(next_R, launched.at, live)
        seconds = time.perf_counter() - launched.t_launch
        self.spec.verify_s += seconds
        logprobs = None if launched.logprobs is None else host_logprobs(launched.logprobs, self.K + 1)
        result = StepResult(self._plain_tokens(next_R), np.ones(len(live), np.int32), 0, logprobs, seconds)
        return result, cache, drafter

    def _plain_tokens(self, next_R: np.ndarray) -> np.ndarray:
        """A plain step's tokens [R] as a step's [R, K + 1] (the first column; its count is 1)."""
        tokens = np.zeros((len(next_R), self.K + 1), np.int32)
        tokens[:, 0] = next_R
        return tokens

    def launch_plain(
        self,
        cache,
        drafter: DraftState,
        state: SpecState,
        seeds,
        sampling,
        greedy_only: bool,
        live,
        root=None,
        lazy=False,
        rules=None,
    ) -> tuple[Launched, object, object]:
        """Launch a plain step over the first R = ``len(live)`` rows without waiting for it
        (:meth:`SpecState.advance_plain`). ``root`` [R] (on the device): the roots to decode, e.g. the unread
        output of the previous plain step; by default the host's. ``lazy``: see :meth:`make_room`. Returns
        (the launched step: next token [R] on the device and each row's context slot for it, cache, drafter)."""
        t0, R = time.perf_counter(), len(live)
        drafter = self.make_room(drafter, state, R, lazy=lazy)
        # Copies: the host state moves on at once, maybe while the step still reads it.
        next_R, cache, aux, *lp = plain_step(
            self.params,
            cache,
            drafter.aux,
            host_copy(state.root[:R]) if root is None else root,
            host_copy(state.q[:R]),
            host_copy(state.ctx_count[:R]),
            jnp.asarray(live),
            seeds,
            sampling,
            cfg=self.cfg,
            window=self.windows.plain_window(state.q[:R][live]),
            greedy_only=greedy_only,
            logprobs=self.logprobs,
            rules=rules,
        )
        at = state.advance_plain(live)
        self.stats.decode_steps += 1
        self.spec.plain_forwards += int(np.sum(live))
        launched = Launched(next_R, np.array(live, bool), t0, at=at, logprobs=lp[0] if lp else None)
        return launched, cache, DraftState(drafter.cache, aux)

    def _plain_seconds(self, seconds: float) -> None:
        self.spec.verify_s += seconds  # a plain step inside speculative decoding is a target forward

    def needs_flush(self, state: SpecState, rows: int, full: int | None = None, lazy: bool = False) -> bool:
        """Whether :meth:`make_room` would write the pending context (one of the first ``rows`` rows holds
        ``full``, by default Q, or more queued elements, and keeps its drafter current: never when ``lazy``)."""
        return not lazy and bool(((state.ctx_count[:rows] >= (full or self.Q)) & state.synced[:rows]).any())

    def make_room(self, drafter: DraftState, state: SpecState, rows: int, full: int | None = None, lazy: bool = False):
        """Where one of the first ``rows`` rows holds ``full`` (default Q: before a plain step, whose element
        would not fit) or more queued context elements, write the pending context of every row into the
        drafter cache (:func:`flush_context`) and keep only each row's last element pending; before a draft
        ``full`` is K + 2 (a draft reads at most K + 1). All rows start over together, so rows that fill at
        different steps (requests that came at different times) share one flush rather than one each. A
        row's pending elements are the same either way (written now or by its next draft; slots past them
        are written again before any query sees them), so this changes no output.

        A full row that is not synced (:attr:`SpecState.synced`), or any full row when ``lazy`` (the slot
        engine decodes plainly under load), is desynced instead (:meth:`SpecState.desync`, no drafter work).
        Returns the drafter's state; ``state`` is updated in place."""
        full = full or self.Q
        count = state.ctx_count[:rows]
        drop = (count >= full) & (~state.synced[:rows] | lazy)
        if drop.any():
            state.desync(np.flatnonzero(drop), keep=full - 1)
        if not self.needs_flush(state, rows, full):
            return drafter
        count, start = state.ctx_count[:rows], state.ctx_start[:rows]
        move = count >= 2
        drafter = DraftState(*flush_context(
            self.dparams,
            drafter.cache,
            host_copy(state.ctx_tokens[:rows]),  # the host state changes below, maybe while the graph runs
            drafter.aux,
            host_copy(start),
            jnp.asarray(count - 1),
            jnp.asarray(move),
            self.embed,
            cfg=self.dcfg,
            window=self.windows.flush_window(start),
        ))  # fmt: skip
        idx = np.flatnonzero(move)
        state.ctx_tokens[idx, 0] = state.ctx_tokens[idx, count[idx] - 1]
        state.ctx_start[idx] += count[idx] - 1
        state.ctx_count[idx] = 1
        return drafter
