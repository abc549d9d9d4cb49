"""Speculative decoding host loop: prefill (target + drafter), then draft -> verify steps.

Each step calls two fixed-shape graphs, the draft (:func:`peagle_jax.drafter.draft.parallel_draft` or
``sequential_draft``) and the verify (:func:`peagle_jax.spec.verify.verify`), per (batch bucket, K, tree,
window bucket) (or one, :func:`fused_step`), then :func:`write_context` puts the verified aux states in
the next draft's context; the accepted count is data, never a shape. A plain step (K' = 0, chosen by the
adaptive step length) is one graph, :func:`plain_step`; the elements plain steps commit queue up (up to
:func:`queue_slots` of them) and one :func:`flush_context` writes them into the drafter cache.
Rows progress independently: each has its own committed length ``q`` (the position of its last committed
token, the next root), and a finished row idles in place (its q stops moving; its writes land at its own
uncommitted slots).

Per step and row: the drafter's context is the elements committed by the previous step (the emitted
tokens, each paired with the target aux state of the position before it), ``count`` of them, starting at
drafter position ``q_prev``; the draft proposes K depths; the target verifies them with the root at q.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import drafter_prefill, fused_mask_hidden, parallel_draft, sequential_draft
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine.generator import Generator, RequestError, sample_jit
from peagle_jax.engine.overlap import Launched, launch_then_read
from peagle_jax.engine.state import host_copy
from peagle_jax.logprobs import TokenLogprobs, host_logprobs
from peagle_jax.models.config import ModelConfig
from peagle_jax.sampling import SamplingParams, greedy_graph
from peagle_jax.spec.adaptive import AdaptiveK, adaptive_policy, step_trees
from peagle_jax.spec.graphs import flush_context, fused_step, plain_step
from peagle_jax.spec.plan import Windows, serving_trees, step_keys, windows_between
from peagle_jax.spec.state import SpecState, SpecStats, cache_slack, queue_slots
from peagle_jax.spec.tree import Tree, chain
from peagle_jax.spec.verify import verify


class SpeculativeGenerator(Generator):
    """Batched speculative decoding of one target with one drafter (P-EAGLE parallel or EAGLE-3 sequential)."""

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
        adaptive: bool = False,
        chains: Sequence[int] | None = None,
        **kwargs,
    ):
        """With ``mesh`` (tensor parallelism) the drafter is replicated on it, or sharded by the target's
        rules when ``shard_drafter``. ``adaptive``: each step of :meth:`stream` picks a plain step, ``tree``
        or a chain of each length in ``chains`` (default :data:`~peagle_jax.spec.adaptive.DEFAULT_CHAINS`) by
        measured throughput (:class:`peagle_jax.spec.adaptive.AdaptiveK`); outputs are the same."""
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
        # With :attr:`logprobs`: the last step's emitted tokens' log-probabilities on the host, [R, K + 1]
        # as its tokens (:func:`peagle_jax.logprobs.host_logprobs`).
        self.step_logprobs: TokenLogprobs | None = None
        self.chains = chains
        self.choices = step_trees(tree, chains)  # the step lengths an adaptive policy chooses from: K' -> tree
        # Whether a step waits for its draft before launching the verify, to time the two apart
        # (SpecStats.draft_s; python -m peagle_jax.bench.spec). Otherwise the verify is launched on the
        # draft's unread tokens, so that its launch (~1.6 ms of host time for SmolLM2's ~330 arrays) overlaps
        # the draft instead of following it, and the draft's time is counted as verify, as with ``fused``.
        self.time_draft = False
        self.policy = adaptive_policy(tree, chains) if adaptive else None

    def _fused(
        self, cache, dcache, ctx, root, q, seeds, sampling, tree: Tree, window: int, greedy_only: bool, rules=None
    ):
        """:func:`fused_step` (draft and verify in one graph) with ``ctx`` = (tokens, aux, count, start) of the
        queued draft context. Returns (verify output, cache, dcache)."""
        tokens, aux, count, start = ctx
        return fused_step(
            self.params, cache, self.dparams, dcache, jnp.asarray(tokens), aux, jnp.asarray(count),
            jnp.asarray(start), self.mask_g, self.embed, jnp.asarray(root), jnp.asarray(q), seeds, sampling,
            cfg=self.cfg, dcfg=self.dcfg, tree=tree, sequential=self.sequential, draft_window=window, window=window,
            greedy_only=greedy_only, logprobs=self.logprobs, rules=rules,
        )  # fmt: skip

    def _draft(self, dcache, tokens, aux, count, start, tree: Tree | None = None):
        tree = tree or self.tree
        window = self.windows.draft_window(start)
        args = (self.dparams, dcache, jnp.asarray(tokens), aux, jnp.asarray(count), jnp.asarray(start))
        kw = dict(cfg=self.dcfg, K=tree.depth, top_n=tree.width, window=window)
        if self.sequential:
            return sequential_draft(*args, self.embed, **kw)
        return parallel_draft(*args, self.mask_g, self.embed, **kw)

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

    def step(self, cache, dcache, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None, rules=None):
        """One draft -> verify step over every row (``live`` [B] bool: rows whose results count; the others
        idle in place). Returns (tokens [B, K+1] host, count [B] host, aux [B, P, X], cache, dcache) and
        adds the live rows to :attr:`spec`; :meth:`SpecState.advance` then moves the rows on.

        ``tree`` (default the generator's) may be a smaller tree of depth K' <= K and no more nodes, e.g. a
        shorter chain under load: it drafts K' tokens over the same K + 1 context slots and verifies them;
        its tokens are padded to K + 1 columns (a count never exceeds K' + 1, so the padding is never read),
        its aux states are K' + 1. A plain step (``chain(0)``) goes through :meth:`run_step`. ``rules``:
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
        ctx_tokens, ctx_aux = state.ctx_tokens[:, :C], state.ctx_aux  # the graphs read the first C aux slots
        after_draft = rules if callable(rules) else None
        if self.fused and after_draft is None:
            # One window for both halves (the larger: a wider window is always safe), so the fused graphs
            # are one per window bucket, not one per (draft window, verify window) pair.
            window = max(window, self.windows.draft_window(state.ctx_start))
            ctx = (ctx_tokens, ctx_aux, state.ctx_count, state.ctx_start)
            out, cache, dcache = self._fused(
                cache, dcache, ctx, state.root, state.q, seeds, sampling, tree, window, greedy_only, rules
            )
            t1 = t0  # one launch: its whole time is counted as verify
        else:
            draft, dcache = self._draft(dcache, ctx_tokens, ctx_aux, state.ctx_count, state.ctx_start, tree)
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
        tokens, count, aux = np.asarray(out.tokens), np.asarray(out.count), out.aux
        if tree.depth < self.K:
            tokens = np.pad(tokens, ((0, 0), (0, self.K - tree.depth)))
        self.step_logprobs = None if out.logprobs is None else host_logprobs(out.logprobs, self.K + 1)
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
        return tokens, count, aux, cache, dcache

    def run_step(
        self, cache, dcache, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None, rules=None
    ):
        """One step of ``tree`` (default the generator's) over the first R = ``len(live)`` rows of ``state``
        (which may hold more), committed into ``state`` for the live rows: a plain step for a tree of depth 0
        (:func:`plain_step`), else draft -> verify (:meth:`step`). ``seeds`` and ``sampling`` are R rows.
        Returns (tokens [R, K+1] host, count [R] host, the step's K', cache, dcache)."""
        R, tree = len(live), tree or self.tree
        if tree.depth:
            dcache = self.make_room(dcache, state, R, full=self.K + 2)  # a draft reads at most K + 1 queued
            tokens, count, aux, cache, dcache = self.step(
                cache, dcache, state.rows(R), seeds, sampling, greedy_only=greedy_only, live=live, tree=tree,
                rules=rules,
            )  # fmt: skip
            state.advance(tokens, count, aux, live)
        else:
            tokens, count, cache, dcache = self._plain(cache, dcache, state, seeds, sampling, greedy_only, live, rules)
        return tokens, count, tree.depth, cache, dcache

    def _plain(self, cache, dcache, state: SpecState, seeds, sampling, greedy_only: bool, live, rules=None):
        """A plain step of :meth:`run_step`: one token per row, the drafter's context kept current."""
        launched, cache, dcache = self.launch_plain(
            cache, dcache, state, seeds, sampling, greedy_only, live, rules=rules
        )
        next_R = np.asarray(launched.tokens)
        state.commit_plain(next_R, launched.at, live)
        self.spec.verify_s += time.perf_counter() - launched.t_launch
        self.step_logprobs = None if launched.logprobs is None else host_logprobs(launched.logprobs, self.K + 1)
        return self._plain_tokens(next_R), np.ones(len(live), np.int32), cache, dcache

    def _plain_tokens(self, next_R: np.ndarray) -> np.ndarray:
        """A plain step's tokens [R] as a step's [R, K + 1] (the first column; its count is 1)."""
        tokens = np.zeros((len(next_R), self.K + 1), np.int32)
        tokens[:, 0] = next_R
        return tokens

    def launch_plain(
        self,
        cache,
        dcache,
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
        (the launched step: next token [R] on the device and each row's context slot for it, cache, dcache)."""
        t0, R = time.perf_counter(), len(live)
        dcache = self.make_room(dcache, state, R, lazy=lazy)
        # Copies: the host state moves on at once, maybe while the step still reads it.
        next_R, cache, state.ctx_aux, *lp = plain_step(
            self.params,
            cache,
            state.ctx_aux,
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
        return Launched(next_R, np.array(live, bool), t0, at=at, logprobs=lp[0] if lp else None), cache, dcache

    def _plain_seconds(self, seconds: float) -> None:
        self.spec.verify_s += seconds  # a plain step inside speculative decoding is a target forward

    def needs_flush(self, state: SpecState, rows: int, full: int | None = None, lazy: bool = False) -> bool:
        """Whether :meth:`make_room` would write the pending context (one of the first ``rows`` rows holds
        ``full``, by default Q, or more queued elements, and keeps its drafter current: never when ``lazy``)."""
        return not lazy and bool(((state.ctx_count[:rows] >= (full or self.Q)) & state.synced[:rows]).any())

    def make_room(self, dcache, state: SpecState, rows: int, full: int | None = None, lazy: bool = False):
        """Where one of the first ``rows`` rows holds ``full`` (default Q: before a plain step, whose element
        would not fit) or more queued context elements, write the pending context of every row into the
        drafter cache (:func:`flush_context`) and keep only each row's last element pending; before a draft
        ``full`` is K + 2 (a draft reads at most K + 1). All rows start over together, so rows that fill at
        different steps (requests that came at different times) share one flush rather than one each. A
        row's pending elements are the same either way (written now or by its next draft; slots past them
        are written again before any query sees them), so this changes no output.

        A full row that is not synced (:attr:`SpecState.synced`), or any full row when ``lazy`` (the slot
        engine decodes plainly under load), is desynced instead (:meth:`SpecState.desync`, no drafter work).
        Returns the drafter cache; ``state`` is updated in place."""
        full = full or self.Q
        count = state.ctx_count[:rows]
        drop = (count >= full) & (~state.synced[:rows] | lazy)
        if drop.any():
            state.desync(np.flatnonzero(drop), keep=full - 1)
        if not self.needs_flush(state, rows, full):
            return dcache
        count, start = state.ctx_count[:rows], state.ctx_start[:rows]
        move = count >= 2
        dcache, state.ctx_aux = flush_context(
            self.dparams,
            dcache,
            host_copy(state.ctx_tokens[:rows]),  # the host state changes below, maybe while the graph runs
            state.ctx_aux,
            host_copy(start),
            jnp.asarray(count - 1),
            jnp.asarray(move),
            self.embed,
            cfg=self.dcfg,
            window=self.windows.flush_window(start),
        )
        idx = np.flatnonzero(move)
        state.ctx_tokens[idx, 0] = state.ctx_tokens[idx, count[idx] - 1]
        state.ctx_start[idx] += count[idx] - 1
        state.ctx_count[idx] = 1
        return dcache

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 128,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Iterator[list[list[int]]]:
        """As :meth:`Generator.stream`, but each step may yield up to K+1 tokens per row."""
        n, B, stops, sampling, greedy_only, seeds = self._request(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids
        )
        lengths = np.array([len(p) for p in prompts] + [1] * (B - n), np.int32)
        t0 = time.perf_counter()
        logits, cache, dcache, last_aux = self.prefill_both(prompts, B)
        first = np.asarray(sample_jit(logits, sampling, seeds, jnp.asarray(lengths), greedy_only=greedy_only))
        self.stats.prefill_s += time.perf_counter() - t0
        state = SpecState.start(first, last_aux, lengths, self.Q)
        done = np.zeros(B, bool)
        done[n:] = True
        produced = np.zeros(B, np.int32)
        gained = [[] for _ in range(n)]
        for b in range(n):  # the first token comes from the prefill
            self._emit(b, [int(first[b])], gained, produced, done, stops, max_new_tokens)
        yield gained
        # Plain steps (the adaptive policy's choice where drafting does not pay) run as the plain engine's
        # do (engine.overlap): the next one is launched, on the unread token of the last, before the host
        # reads that token. ``pending``: a launched plain step not read yet; ``chosen``: the step chosen while
        # it ran, when it could not be launched before the read.
        pending, chosen, t_read = None, None, time.perf_counter()
        while not done.all():
            live = ~done
            tree = chosen or (self.choices[self.policy.choose(B)] if self.policy is not None else self.tree)
            chosen = None
            if pending is None and tree.depth:
                tokens, count, _, cache, dcache = self.run_step(
                    cache, dcache, state, seeds, sampling, greedy_only=greedy_only, live=live, tree=tree
                )
                # Every step's time for the policy is the interval between two reads: the host's work between
                # steps (the caller's included) is part of each step length's period alike.
                now = time.perf_counter()
                if self.policy is not None:
                    self.policy.record(B, tree.depth, now - t_read, count[live])
                t_read = now
            elif pending is None:  # the first of a run of plain steps: launched, then the next one is chosen
                pending, cache, dcache = self.launch_plain(cache, dcache, state, seeds, sampling, greedy_only, live)
                continue
            else:
                live_next = live & (produced + 1 < max_new_tokens)  # rows that may want a token after pending's
                launch_next = None
                if not tree.depth and live_next.any() and not self.needs_flush(state, B):
                    # (a flush embeds the queued tokens: it waits until pending's are read). Every row live now
                    # was live in pending, whose output is its root; the finished rows idle on any token.
                    def launch_next(root, live_next=live_next):
                        nonlocal cache, dcache
                        launched, cache, dcache = self.launch_plain(
                            cache, dcache, state, seeds, sampling, greedy_only, live_next, root=root
                        )
                        return launched

                else:
                    chosen = tree
                next_B, following = launch_then_read(pending, launch_next)
                state.commit_plain(next_B, pending.at, pending.live)
                # The policy learns the interval between reads (as above).
                now = time.perf_counter()
                self.spec.verify_s += pending.device_seconds(t_read, now)
                if self.policy is not None:
                    self.policy.record(B, 0, now - t_read)
                t_read = now
                tokens, count = self._plain_tokens(next_B), np.ones(B, np.int32)
                live, pending = pending.live & live, following
            t2 = time.perf_counter()
            gained = [[] for _ in range(n)]
            for b in range(n):
                if live[b]:
                    self._emit(b, tokens[b, : int(count[b])].tolist(), gained, produced, done, stops, max_new_tokens)
            self.spec.host_s += time.perf_counter() - t2
            yield gained

    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int, *, greedy_only: bool = True) -> float:
        """Compile every graph a request of this size can call, before it arrives: a short run on a scratch
        prompt (prefills, first-token sampling, the first windows), then the draft and verify (or fused)
        graphs of each larger attention window the request can reach, on scratch caches."""
        t0 = time.perf_counter()
        self.generate(
            [[0] * prompt_len] * batch,
            max_new_tokens=min(max_new_tokens, self.K + 2),
            stop_token_ids=[],
            temperature=0.0 if greedy_only else 1.0,
        )
        self._warm_windows(batch, prompt_len, max_new_tokens, greedy_only)
        if self.policy is not None:  # the warm-up's steps compiled: their times are not measurements
            self.policy = self._calibrated(batch)
        self.spec.reset()
        return time.perf_counter() - t0

    def _calibrated(self, batch: int) -> AdaptiveK:
        """A fresh adaptive policy that knows what each step length costs at this batch: each is timed over
        a few compiled greedy steps on scratch caches (:meth:`AdaptiveK.calibrate`), so the first
        request does not pay for measuring the slower ones. Step times are refined by every step served; the
        acceptance is learnt from real text only."""
        from peagle_jax.engine.buckets import bucket

        policy = adaptive_policy(self.tree, self.chains)
        B = bucket(batch, self.batch_buckets)
        cache, dcache = self._scratch_caches(B)
        X = len(self.cfg.aux_layer_ids) * self.cfg.hidden_size
        q = np.full(B, max(self.windows.verify_q(self.window_buckets[0], self.tree), 1), np.int32)  # smallest
        sampling, seeds, live = SamplingParams.make(B, 0.0), jnp.zeros(B, jnp.uint32), np.ones(B, bool)

        def time_step(k: int) -> float:
            nonlocal cache, dcache
            state = SpecState.start(np.zeros(B, np.int32), jnp.zeros((B, X), self.cfg.jnp_dtype), q, self.Q)
            t0 = time.perf_counter()
            _, _, _, cache, dcache = self.run_step(
                cache, dcache, state, seeds, sampling, greedy_only=greedy_graph(0.0), live=live, tree=self.choices[k]
            )
            return time.perf_counter() - t0

        policy.calibrate_all(B, time_step)
        return policy

    def _scratch_caches(self, B: int):
        """Empty target and drafter caches of B rows, sharded as the generator's own."""
        from peagle_jax.models import model

        cache = model.new_cache(self.cfg, B, self.cache_slots(B))
        dcache = new_drafter_cache(self.dcfg, B, self.cache_slots(B))
        if self.mesh is not None:
            from peagle_jax import sharding

            cache = sharding.shard_cache(cache, self.mesh)
            dcache = (sharding.shard_cache if self.shard_drafter else sharding.replicate)(dcache, self.mesh)
        return cache, dcache

    def _warm_windows(self, batch: int, prompt_len: int, max_new_tokens: int, greedy_only: bool) -> None:
        """One call per window bucket, with the root (q) and the draft context start placed by the inverses of
        the window rule (:class:`peagle_jax.spec.plan.Windows`) so that a step lands in exactly that bucket;
        with the adaptive step length, for every step length (its draft and verify or fused graphs, the plain
        step and the context flush). Outputs are discarded."""
        from peagle_jax.engine.buckets import bucket

        B, K, Q = bucket(batch, self.batch_buckets), self.K, self.Q
        positions = range(prompt_len - 1, prompt_len + max_new_tokens + 1)
        draft_windows = sorted({self.windows.draft_window(s) for s in positions})
        cache, dcache = self._scratch_caches(B)
        X = len(self.cfg.aux_layer_ids) * self.cfg.hidden_size
        tokens, count = np.zeros((B, K + 1), np.int32), np.ones(B, np.int32)
        aux = jnp.zeros((B, Q, X), self.cfg.jnp_dtype)  # the whole queue, as step() passes it
        sampling = SamplingParams.make(B, 0.0 if greedy_only else 1.0)
        greedy_only = greedy_graph(sampling.temperature)  # the graphs such requests call
        seeds, root, live = jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32), jnp.ones(B, bool)
        out, first, last = None, prompt_len, prompt_len + max_new_tokens  # the roots q a request can reach
        for tree in serving_trees(self.tree, adaptive=self.policy is not None, chains=self.chains):
            windows = windows_between(self.window_buckets, first + tree.size + 1, last + tree.size + 1)
            if self.fused and tree.depth:
                windows = sorted(set(windows) | set(draft_windows))
            for key in step_keys([B], [tree], windows, [greedy_only]):
                w = key.window
                q = jnp.full(B, self.windows.verify_q(w, tree), jnp.int32)
                start = np.full(B, self.windows.draft_start(w), np.int32)
                if not tree.depth:  # a plain step (its context queue flushes below)
                    out, cache, aux, *_ = plain_step(
                        self.params, cache, aux, root, q, jnp.asarray(count), live, seeds, sampling, cfg=self.cfg,
                        window=w, greedy_only=greedy_only, logprobs=self.logprobs, rules=None,
                    )  # fmt: skip
                elif self.fused:
                    ctx = (tokens, aux, count, start)
                    out, cache, dcache = self._fused(cache, dcache, ctx, root, q, seeds, sampling, tree, w, greedy_only)
                else:
                    drafts = jnp.zeros((B, tree.depth, tree.width), jnp.int32)
                    out, cache = verify(
                        self.params, cache, root, drafts, q, seeds, sampling, cfg=self.cfg, tree=tree, window=w,
                        greedy_only=greedy_only, logprobs=self.logprobs, rules=None,
                    )  # fmt: skip
            for w in draft_windows if tree.depth and not self.fused else []:
                start = np.full(B, self.windows.draft_start(w), np.int32)
                out, dcache = self._draft(dcache, tokens, aux, count, start, tree)
        if self.policy is not None:  # the flushes of the context plain steps queue
            for w in sorted({self.windows.flush_window(s) for s in positions}):
                start = jnp.full(B, self.windows.flush_start(w), jnp.int32)
                dcache, aux = flush_context(
                    self.dparams, dcache, jnp.zeros((B, Q), jnp.int32), aux, start, jnp.asarray(count), live,
                    self.embed, cfg=self.dcfg, window=w,
                )  # fmt: skip
        jax.block_until_ready(out)
