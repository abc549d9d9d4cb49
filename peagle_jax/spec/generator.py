"""Batched speculative generation: prefill (target + drafter), then a loop of draft -> verify steps (or plain
steps, with the adaptive step length) over the step library (:class:`peagle_jax.spec.stepper.SpecStepper`),
and its warm-up, which compiles every graph a request of a given size can call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import DraftContext
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine.generator import sample_jit
from peagle_jax.engine.overlap import StepLoop
from peagle_jax.models.config import ModelConfig
from peagle_jax.sampling import SamplingParams, greedy_graph
from peagle_jax.spec.adaptive import AdaptiveK, adaptive_policy, step_trees
from peagle_jax.spec.graphs import flush_context, plain_step
from peagle_jax.spec.plan import serving_trees, step_keys, windows_between
from peagle_jax.spec.state import SpecState
from peagle_jax.spec.stepper import DraftState, SpecStepper
from peagle_jax.spec.tree import Tree
from peagle_jax.spec.verify import verify


class SpeculativeGenerator(SpecStepper):
    """Batched speculative decoding of one target with one drafter (P-EAGLE parallel or EAGLE-3 sequential):
    :meth:`stream` drives the step library it inherits (:class:`~peagle_jax.spec.stepper.SpecStepper`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        dcfg: DrafterConfig,
        dparams,
        *,
        adaptive: bool = False,
        chains: Sequence[int] | None = None,
        **kwargs,
    ):
        """``kwargs``: the stepper's (``k``, ``tree``, ``sequential``, ``fused``, ``max_seq_len``,
        ``shard_drafter``, ``mesh``, ...). ``adaptive``: each step of :meth:`stream` picks a plain step, the
        tree or a chain of each length in ``chains`` (default :data:`~peagle_jax.spec.adaptive.DEFAULT_CHAINS`)
        by measured throughput (:class:`peagle_jax.spec.adaptive.AdaptiveK`); outputs are the same."""
        super().__init__(cfg, params, dcfg, dparams, **kwargs)
        self.chains = chains
        self.choices = step_trees(self.tree, chains)  # the step lengths an adaptive policy picks from: K' -> tree
        self.policy = adaptive_policy(self.tree, chains) if adaptive else None

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
        first, cache, state, drafter = self._prefill_rows(prompts, B, sampling, seeds, greedy_only)
        done = np.arange(B) >= n  # the padding rows never run
        produced = np.zeros(B, np.int32)
        gained = [[] for _ in range(n)]
        for b in range(n):  # the first token comes from the prefill
            self._emit(b, [int(first[b])], gained, produced, done, stops, max_new_tokens)
        yield gained
        # Plain steps (the adaptive policy's choice where drafting does not pay) run as the plain engine's
        # do (engine.overlap.StepLoop): the next one is launched, on the unread token of the last, before the
        # host reads that token; ``chosen``: the step chosen while one ran, when it could not be launched then.
        loop, chosen, t_read = StepLoop(), None, time.perf_counter()

        def choose() -> Tree:
            nonlocal chosen
            tree, chosen = chosen or (self.choices[self.policy.choose(B)] if self.policy else self.tree), None
            return tree

        def run(tree: Tree):
            nonlocal cache, drafter
            result, cache, drafter = self.run_step(
                cache, drafter, state, seeds, sampling, greedy_only=greedy_only, live=~done, tree=tree
            )
            return result

        def launch(live_R=None, root=None):
            nonlocal cache, drafter
            live_R = ~done if live_R is None else live_R
            launched, cache, drafter = self.launch_plain(
                cache, drafter, state, seeds, sampling, greedy_only, live_R, root=root
            )
            return launched

        def following(pending):
            # The rows that may want a token after pending's; a flush embeds the queued tokens: it waits until
            # pending's are read. Every row live now was live in pending, whose output is its root; the
            # finished rows idle on any token.
            nonlocal chosen
            tree, live_next = choose(), ~done & (produced + 1 < max_new_tokens)
            if not tree.depth and live_next.any() and not self.needs_flush(state, B):
                return lambda root: launch(live_next, root)
            chosen = tree
            return None

        while not done.all():
            live = ~done
            turn = loop.turn(choose, run, launch, following)
            # Every step's time for the policy is the interval between two reads: the host's work between
            # steps (the caller's included) is part of each step length's period alike.
            now = time.perf_counter()
            if turn.launched is None:
                tokens, count, k = turn.result.tokens, turn.result.count, turn.result.k
            else:
                self.read_plain(turn.launched, state, turn.launched.live, t_read, turn.tokens)
                tokens, count, k = self._plain_tokens(turn.tokens), np.ones(B, np.int32), 0
                live = turn.launched.live & live
            if self.policy is not None:
                self.policy.record(B, k, now - t_read, count[live])
            t_read = now
            t2 = time.perf_counter()
            gained = [[] for _ in range(n)]
            for b in range(n):
                if live[b]:
                    self._emit(b, tokens[b, : int(count[b])].tolist(), gained, produced, done, stops, max_new_tokens)
            self.spec.host_s += time.perf_counter() - t2
            yield gained

    def _prefill_rows(self, prompts, B: int, sampling, seeds, greedy_only: bool):
        """Prefill the prompts (padded to B rows) and sample each row's first token: (first tokens [B] on the
        host, target cache, row state, drafter state)."""
        lengths = np.array([len(p) for p in prompts] + [1] * (B - len(prompts)), np.int32)
        t0 = time.perf_counter()
        logits, cache, dcache, last_aux = self.prefill_both(prompts, B)
        first = np.asarray(sample_jit(logits, sampling, seeds, jnp.asarray(lengths), greedy_only=greedy_only))
        self.stats.prefill_s += time.perf_counter() - t0
        return first, cache, SpecState.start(first, lengths, self.Q), DraftState(dcache, self.context_aux(last_aux))

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
            state = SpecState.start(np.zeros(B, np.int32), q, self.Q)
            drafter = DraftState(dcache, self.context_aux(jnp.zeros((B, X), self.cfg.jnp_dtype)))
            t0 = time.perf_counter()
            _, cache, (dcache, _) = self.run_step(
                cache, drafter, state, seeds, sampling, greedy_only=greedy_graph(0.0), live=live, tree=self.choices[k]
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
                    ctx = DraftContext(tokens, aux, count, start)
                    out, cache, dcache = self._fused(cache, dcache, ctx, root, q, seeds, sampling, tree, w, greedy_only)
                else:
                    drafts = jnp.zeros((B, tree.depth, tree.width), jnp.int32)
                    out, cache = verify(
                        self.params, cache, root, drafts, q, seeds, sampling, cfg=self.cfg, tree=tree, window=w,
                        greedy_only=greedy_only, logprobs=self.logprobs, rules=None,
                    )  # fmt: skip
            for w in draft_windows if tree.depth and not self.fused else []:
                start = np.full(B, self.windows.draft_start(w), np.int32)
                out, dcache = self._draft(dcache, DraftContext(tokens, aux, count, start), tree)
        if self.policy is not None:  # the flushes of the context plain steps queue
            for w in sorted({self.windows.flush_window(s) for s in positions}):
                start = jnp.full(B, self.windows.flush_start(w), jnp.int32)
                dcache, aux = flush_context(
                    self.dparams, dcache, jnp.zeros((B, Q), jnp.int32), aux, start, jnp.asarray(count), live,
                    self.embed, cfg=self.dcfg, window=w,
                )  # fmt: skip
        jax.block_until_ready(out)
