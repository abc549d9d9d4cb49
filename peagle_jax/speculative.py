"""Speculative decoding host loop: prefill (target + drafter), then draft -> verify steps.

Each step calls two fixed-shape graphs, the draft (:func:`peagle_jax.drafter.draft.parallel_draft` or
``sequential_draft``) and the verify (:func:`peagle_jax.verify.verify`), per (batch bucket, K, tree,
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

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.adaptive import AdaptiveK, adaptive_policy, step_trees
from peagle_jax.config import ModelConfig
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.draft import drafter_prefill, fused_mask_hidden, parallel_draft, sequential_draft
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine import Generator, RequestError, sample_jit
from peagle_jax.sampling import SamplingParams, greedy_graph
from peagle_jax.verify import Tree, chain, verify


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "dcfg", "tree", "sequential", "draft_window", "window", "greedy_only"),
    donate_argnames=("cache", "dcache"),
)
def fused_step(
    params,
    cache,
    dparams,
    dcache,
    ctx_tokens,
    ctx_aux,
    ctx_count,
    ctx_start,
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
):
    """Draft and verify in one graph (one device launch per step): the two jitted functions inline."""
    kw = dict(cfg=dcfg, K=tree.depth, top_n=tree.width, window=draft_window)
    if sequential:
        draft, dcache = sequential_draft(dparams, dcache, ctx_tokens, ctx_aux, ctx_count, ctx_start, embed, **kw)
    else:
        draft, dcache = parallel_draft(dparams, dcache, ctx_tokens, ctx_aux, ctx_count, ctx_start, mask_g, embed, **kw)
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
    )
    return out, cache, dcache


def _write_context(ctx_aux_BCX, aux_RWX, at_R, live_R):
    """Write each live row r's W aux states (the first R rows) at its draft-context slots ``at[r] ..``; slots
    outside them, and the rows that are not live, keep theirs. Selects, no scatter."""
    R, W = aux_RWX.shape[:2]
    rel_RC = jnp.arange(ctx_aux_BCX.shape[1])[None, :] - at_R[:, None]  # aux index of each context slot
    take_RC1 = (live_R[:, None] & (rel_RC >= 0) & (rel_RC < W))[:, :, None]
    src_RCX = jnp.take_along_axis(aux_RWX, jnp.clip(rel_RC, 0, W - 1)[:, :, None], axis=1)
    new_RCX = jnp.where(take_RC1, src_RCX.astype(ctx_aux_BCX.dtype), ctx_aux_BCX[:R])
    return jax.lax.dynamic_update_slice_in_dim(ctx_aux_BCX, new_RCX, 0, axis=0)


write_context = jax.jit(_write_context, donate_argnums=0)


@functools.partial(jax.jit, static_argnames=("cfg", "window", "greedy_only"), donate_argnames=("cache", "ctx_aux"))
def plain_step(params, cache, ctx_aux, root_R, q_R, at_R, live_R, seeds_R, sampling, *, cfg, window, greedy_only):
    """A plain step inside speculative decoding, in one graph: the target decodes each row's root (the verify
    of ``chain(0)``) and the root's aux state joins the row's pending draft context at slot ``at`` (live rows
    of the first R; ``ctx_aux`` holds B >= R rows). Returns (next token [R], cache, ctx_aux)."""
    none_R01 = jnp.zeros((root_R.shape[0], 0, 1), jnp.int32)
    out, cache = verify(
        params, cache, root_R, none_R01, q_R, seeds_R, sampling, cfg=cfg, tree=chain(0), window=window,
        greedy_only=greedy_only,
    )  # fmt: skip
    return out.tokens[:, 0], cache, _write_context(ctx_aux, out.aux, at_R, live_R)


@functools.partial(jax.jit, static_argnames=("cfg", "window"), donate_argnames=("dcache", "ctx_aux"))
def flush_context(dparams, dcache, ctx_tokens_RC, ctx_aux, start_R, last_R, move_R, embed, *, cfg, window):
    """:meth:`SpeculativeGenerator.make_room` in one graph: the first R rows' C context slots go into the
    drafter cache at slots ``start ..``, and in each ``move`` row the last pending element (slot ``last``)
    moves to slot 0."""
    R = ctx_tokens_RC.shape[0]
    dcache = drafter_prefill(dparams, dcache, ctx_tokens_RC, ctx_aux[:R], start_R, embed, cfg=cfg, window=window)
    keep_R1X = jnp.take_along_axis(ctx_aux[:R], last_R[:, None, None], axis=1)
    return dcache, _write_context(ctx_aux, keep_R1X, jnp.zeros(R, jnp.int32), move_R)


def host_copy(x: np.ndarray) -> jax.Array:
    """A device array of a host array that will change while a graph launched on it may still run: on the
    CPU, ``jnp.asarray`` (and ``jnp.array``'s copy, itself launched asynchronously) may read the host buffer
    in place, so it is copied on the host first."""
    return jnp.asarray(np.array(x, copy=True))


QUEUE = 16  # context elements plain steps may queue before one flush_context writes them (at least K + 1)


def queue_slots(K: int) -> int:
    """Context slots of a generator drafting K deep: the K + 1 a draft reads, or more, so that runs of plain
    steps write the drafter cache once per ``QUEUE`` steps (a drafter forward over 16 elements costs about
    what one over 4 costs on a CPU) rather than once per K + 1."""
    return max(K + 1, QUEUE)


def cache_slack(tree: Tree) -> int:
    """Cache slots a step may write past the committed length: the root + tree nodes (verify), the K - 1
    mask slots past the context (draft) with room to spare, and a flush of the queued context."""
    return max(tree.size + 2 * tree.depth + 2, queue_slots(tree.depth))


@dataclasses.dataclass
class SpecStats:
    """Counters over everything generated so far (all rows)."""

    target_forwards: int = 0  # verify calls x live rows (prefill excluded)
    plain_forwards: int = 0  # plain steps (no draft, see SlotEngine's adaptive K) x live rows: not in the above
    emitted: int = 0  # tokens emitted by those verify calls
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)  # drafts accepted at depth k
    draft_s: float = 0.0  # only with time_draft; otherwise (and with --fused) counted as verify
    verify_s: float = 0.0
    host_s: float = 0.0
    steps: int = 0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (1 + accepted drafts)."""
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    def reset(self) -> None:
        """Zero every counter in place (others, e.g. the server's /metrics, hold this object)."""
        self.__dict__.update(type(self)(accepted_per_position=[0] * len(self.accepted_per_position)).__dict__)


@dataclasses.dataclass
class SpecState:
    """Per-row host state between speculative steps (B rows, Q >= K + 1 context slots, see :func:`queue_slots`).

    ``q`` is the position of each row's root (its last committed token, not yet in the target cache) and
    ``root`` that token; the drafter's next context is the ``ctx_count`` elements committed since the last
    draft or flush (``ctx_tokens`` [B, Q] with their target aux states ``ctx_aux`` [B, Q, X]), the first at
    drafter position ``ctx_start`` (``q - ctx_count``); a draft reads the first K + 1 slots (a flush
    first where more are queued). A row that is not live keeps its state, so it idles in place.

    ``synced`` [B]: whether the row's drafter cache holds its whole committed context. A row the slot engine
    decodes plainly under load may skip the drafter's work (:meth:`desync`); its drafts are then guesses
    from a stale context, which verification makes harmless (outputs never depend on the drafts) but which
    are not accepted often, so the engine's policy does not learn from them and counts only synced rows.
    """

    ctx_tokens: np.ndarray
    ctx_aux: jax.Array
    ctx_count: np.ndarray
    ctx_start: np.ndarray
    q: np.ndarray
    root: np.ndarray
    synced: np.ndarray

    @classmethod
    def start(cls, first_B, last_aux_BX, lengths_B, C: int) -> SpecState:
        """After the prefill: one context element per row (the first token with the aux of the last prompt
        position), at drafter position ``length - 1``; the root is the first token at ``length``."""
        B = len(first_B)
        ctx_tokens = np.zeros((B, C), np.int32)
        ctx_tokens[:, 0] = first_B
        ctx_aux = jnp.zeros((B, C, last_aux_BX.shape[-1]), last_aux_BX.dtype).at[:, 0].set(last_aux_BX)
        lengths = np.asarray(lengths_B, np.int32)
        first = np.asarray(first_B).copy()
        return cls(ctx_tokens, ctx_aux, np.ones(B, np.int32), lengths - 1, lengths.copy(), first, np.ones(B, bool))

    def rows(self, R: int) -> SpecState:
        """The first R rows (views of the host arrays; ``ctx_aux`` sliced when R < B)."""
        if R == len(self.q):
            return self
        s = self
        views = (s.ctx_tokens, s.ctx_aux, s.ctx_count, s.ctx_start, s.q, s.root, s.synced)
        return SpecState(*(x[:R] for x in views))

    def advance(self, tokens_RC, count_R, aux_RWX, live_R) -> None:
        """Commit a draft -> verify step's output for the live rows among the first R (= ``len(count_R)``);
        the others stay in place. ``aux_RWX``: the verify's aux states, W = K' + 1 <= C."""
        R, live_R = len(count_R), np.asarray(live_R, bool)
        self.ctx_start[:R] = np.where(live_R, self.q[:R], self.ctx_start[:R])
        self.q[:R] += np.where(live_R, count_R, 0).astype(np.int32)
        last_R = tokens_RC[np.arange(R), np.maximum(count_R - 1, 0)]
        self.root[:R] = np.where(live_R, last_R, self.root[:R])
        C = tokens_RC.shape[1]
        self.ctx_tokens[:R, :C] = np.where(live_R[:, None], tokens_RC, self.ctx_tokens[:R, :C])
        self.ctx_count[:R] = np.where(live_R, count_R, self.ctx_count[:R])
        # Host arguments: an eager jnp.zeros would be a device op of its own (~0.4 ms on the CPU, every step).
        self.ctx_aux = write_context(self.ctx_aux, aux_RWX, np.zeros(R, np.int32), live_R)

    def advance_plain(self, live_R) -> np.ndarray:
        """A plain step (:func:`plain_step`, which writes the root's aux state at slot ``ctx_count``) was
        launched: each live row (among the first R = ``len(live_R)``) moves on one position and one context
        element. Its new token, paired with that aux state, is filled in by :meth:`commit_plain` once read (a
        following plain step may be launched before). Returns each row's context slot for it [R]."""
        at_R = self.ctx_count[: len(live_R)].copy()
        rows = np.flatnonzero(live_R)
        self.ctx_count[rows] += 1
        self.q[rows] += 1
        return at_R

    def desync(self, rows, keep: int) -> None:
        """Stop keeping the drafter current for ``rows`` (indices): their queued context is dropped but for
        ``keep`` >= 1 elements (a draft reads at least one), with no drafter work; their later drafts run on
        a stale context until the slot engine re-seeds the drafter
        (:meth:`peagle_jax.serve.slots.SlotEngine._resync`, a prefill of the row's tokens)."""
        self.synced[rows] = False
        self.ctx_count[rows] = np.minimum(self.ctx_count[rows], keep)
        self.ctx_start[rows] = self.q[rows] - self.ctx_count[rows]

    def commit_plain(self, tokens_R, at_R, live_R) -> None:
        """The read tokens of a plain step join the live rows' context (at slots ``at_R``) and become their
        roots."""
        rows = np.flatnonzero(live_R)
        self.ctx_tokens[rows, at_R[rows]] = tokens_R[rows]
        self.root[rows] = tokens_R[rows]


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
        **kwargs,
    ):
        """With ``mesh`` (tensor parallelism) the drafter is replicated on it, or sharded by the target's
        rules when ``shard_drafter``. ``adaptive``: each step of :meth:`stream` picks a plain step, a chain of
        1 or ``tree`` by measured throughput (:class:`peagle_jax.adaptive.AdaptiveK`); outputs are the same."""
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
        self.mask_g = None if sequential else fused_mask_hidden(dparams, cfg=dcfg)
        self.embed = None if dcfg.own_embedding else params["embed_tokens"]
        self.spec = SpecStats(accepted_per_position=[0] * self.K)
        self.choices = step_trees(tree)  # the step lengths an adaptive policy chooses from: K' -> tree
        # Whether a step waits for its draft before launching the verify, to time the two apart
        # (SpecStats.draft_s; python -m peagle_jax.bench.spec). Otherwise the verify is launched on the
        # draft's unread tokens, so that its launch (~1.6 ms of host time for SmolLM2's ~330 arrays) overlaps
        # the draft instead of following it, and the draft's time is counted as verify, as with ``fused``.
        self.time_draft = False
        self.policy = adaptive_policy(tree) if adaptive else None

    def _fused(self, cache, dcache, ctx, root, q, seeds, sampling, tree: Tree, window: int, greedy_only: bool):
        """:func:`fused_step` (draft and verify in one graph) with ``ctx`` = (tokens, aux, count, start) of the
        queued draft context. Returns (verify output, cache, dcache)."""
        tokens, aux, count, start = ctx
        return fused_step(
            self.params, cache, self.dparams, dcache, jnp.asarray(tokens), aux, jnp.asarray(count),
            jnp.asarray(start), self.mask_g, self.embed, jnp.asarray(root), jnp.asarray(q), seeds, sampling,
            cfg=self.cfg, dcfg=self.dcfg, tree=tree, sequential=self.sequential, draft_window=window, window=window,
            greedy_only=greedy_only,
        )  # fmt: skip

    def _draft_window(self, start) -> int:
        return self.window(int(start.max()) + 2 * self.K + 1)

    def _draft(self, dcache, tokens, aux, count, start, tree: Tree | None = None):
        tree = tree or self.tree
        window = self._draft_window(start)
        args = (self.dparams, dcache, jnp.asarray(tokens), aux, jnp.asarray(count), jnp.asarray(start))
        kw = dict(cfg=self.dcfg, K=tree.depth, top_n=tree.width, window=window)
        if self.sequential:
            return sequential_draft(*args, self.embed, **kw)
        return parallel_draft(*args, self.mask_g, self.embed, **kw)

    def prefill_both(self, prompts: Sequence[Sequence[int]], batch: int, drafter: bool = True):
        """Prefill the target and seed the drafter with the prompts (padded to ``batch`` rows). Returns
        (last-token logits [batch, V], target cache, drafter cache, aux [batch, X] of each last prompt
        position: the aux half of the first draft's context element). Without ``drafter`` the drafter is
        not run (its cache is None), for a row the slot engine leaves unsynced (:attr:`SpecState.synced`)."""
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
                    window=self.window(start + T),
                )
            at = np.clip(lengths - 1 - start, 0, T - 1)
            here = jnp.asarray((lengths - 1 >= start) & (lengths - 1 < start + T))[:, None]
            aux_last = jnp.take_along_axis(out.aux, jnp.asarray(at)[:, None, None], axis=1)[:, 0]
            last_aux[0] = aux_last if last_aux[0] is None else jnp.where(here, aux_last, last_aux[0])

        logits, cache = self.prefill(prompts, batch, on_chunk=seed_drafter)
        return logits, cache, dcache, last_aux[0]

    def step(self, cache, dcache, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None):
        """One draft -> verify step over every row (``live`` [B] bool: rows whose results count; the others
        idle in place). Returns (tokens [B, K+1] host, count [B] host, aux [B, K+1, X], cache, dcache) and
        adds the live rows to :attr:`spec`; :meth:`SpecState.advance` then moves the rows on.

        ``tree`` (default the generator's) may be a smaller tree of depth K' <= K and no more nodes, e.g. a
        shorter chain under load: it drafts K' tokens over the same K + 1 context slots and verifies them;
        its tokens are padded to K + 1 columns (a count never exceeds K' + 1, so the padding is never read),
        its aux states are K' + 1. A plain step (``chain(0)``) goes through :meth:`run_step`.
        """
        tree = tree or self.tree
        if tree.depth > self.K or tree.size > self.tree.size or not tree.depth:
            raise ValueError(f"a step tree must fit the generator's (depth 1..{self.K}, <= {self.tree.size} nodes)")
        t0 = time.perf_counter()
        window = self.window(int(state.q[live].max(initial=0)) + tree.size + 1)
        C = self.K + 1  # the draft reads the first C of the Q queued slots (run_step flushed any beyond)
        ctx_tokens, ctx_aux = state.ctx_tokens[:, :C], state.ctx_aux  # the graphs read the first C aux slots
        if self.fused:
            # One window for both halves (the larger: a wider window is always safe), so the fused graphs
            # are one per window bucket, not one per (draft window, verify window) pair.
            window = max(window, self._draft_window(state.ctx_start))
            ctx = (ctx_tokens, ctx_aux, state.ctx_count, state.ctx_start)
            out, cache, dcache = self._fused(
                cache, dcache, ctx, state.root, state.q, seeds, sampling, tree, window, greedy_only
            )
            t1 = t0  # one launch: its whole time is counted as verify
        else:
            draft, dcache = self._draft(dcache, ctx_tokens, ctx_aux, state.ctx_count, state.ctx_start, tree)
            if self.time_draft:
                jax.block_until_ready(draft.tokens)
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
            )
        tokens, count, aux = np.asarray(out.tokens), np.asarray(out.count), out.aux
        if tree.depth < self.K:
            tokens = np.pad(tokens, ((0, 0), (0, self.K - tree.depth)))
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

    def run_step(self, cache, dcache, state: SpecState, seeds, sampling, *, greedy_only: bool, live, tree=None):
        """One step of ``tree`` (default the generator's) over the first R = ``len(live)`` rows of ``state``
        (which may hold more), committed into ``state`` for the live rows: a plain step for a tree of depth 0
        (:func:`plain_step`), else draft -> verify (:meth:`step`). ``seeds`` and ``sampling`` are R rows.
        Returns (tokens [R, K+1] host, count [R] host, the step's K', cache, dcache)."""
        R, tree = len(live), tree or self.tree
        if tree.depth:
            dcache = self.make_room(dcache, state, R, full=self.K + 2)  # a draft reads at most K + 1 queued
            tokens, count, aux, cache, dcache = self.step(
                cache, dcache, state.rows(R), seeds, sampling, greedy_only=greedy_only, live=live, tree=tree
            )
            state.advance(tokens, count, aux, live)
        else:
            tokens, count, cache, dcache = self._plain(cache, dcache, state, seeds, sampling, greedy_only, live)
        return tokens, count, tree.depth, cache, dcache

    def _plain(self, cache, dcache, state: SpecState, seeds, sampling, greedy_only: bool, live):
        """A plain step of :meth:`run_step`: one token per row, the drafter's context kept current."""
        t0 = time.perf_counter()
        next_R, at, cache, dcache = self._launch_plain(cache, dcache, state, seeds, sampling, greedy_only, live)
        next_R = np.asarray(next_R)
        state.commit_plain(next_R, at, live)
        self.spec.verify_s += time.perf_counter() - t0
        return self._plain_tokens(next_R), np.ones(len(live), np.int32), cache, dcache

    def _plain_tokens(self, next_R: np.ndarray) -> np.ndarray:
        """A plain step's tokens [R] as a step's [R, K + 1] (the first column; its count is 1)."""
        tokens = np.zeros((len(next_R), self.K + 1), np.int32)
        tokens[:, 0] = next_R
        return tokens

    def _launch_plain(
        self, cache, dcache, state: SpecState, seeds, sampling, greedy_only: bool, live, root=None, lazy=False
    ):
        """Launch a plain step over the first R = ``len(live)`` rows without waiting for it
        (:meth:`SpecState.advance_plain`). ``root`` [R] (on the device): the roots to decode, e.g. the unread
        output of the previous plain step; by default the host's. ``lazy``: see :meth:`make_room`. Returns
        (next token [R] on the device, each row's context slot for it, cache, dcache)."""
        R = len(live)
        dcache = self.make_room(dcache, state, R, lazy=lazy)
        # Copies: the host state moves on at once, maybe while the step still reads it.
        next_R, cache, state.ctx_aux = plain_step(
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
            window=self.window(int(state.q[:R][live].max(initial=0)) + 1),
            greedy_only=greedy_only,
        )
        at = state.advance_plain(live)
        self.stats.decode_steps += 1
        self.spec.plain_forwards += int(np.sum(live))
        return next_R, at, cache, dcache

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
        Q, full = self.Q, full or self.Q
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
            window=self.window(int(start.max()) + Q),
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
        # do: the next one is launched, on the unread token of the last, before the host reads that token,
        # so the host's bookkeeping (and the caller's) overlaps the device's work. ``pending``: a launched
        # plain step not read yet (next token on the device, context slots, live rows, launch time);
        # ``chosen``: the step chosen while it ran, when it could not be launched before the read.
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
                t0 = time.perf_counter()
                next_B, at, cache, dcache = self._launch_plain(cache, dcache, state, seeds, sampling, greedy_only, live)
                pending = (next_B, at, live, t0)
                continue
            else:
                following = None
                live_next = live & (produced + 1 < max_new_tokens)  # rows that may want a token after pending's
                if not tree.depth and live_next.any() and not self.needs_flush(state, B):
                    # (a flush embeds the queued tokens: it waits until pending's are read). Every row live now
                    # was live in pending, whose output is its root; the finished rows idle on any token.
                    t0 = time.perf_counter()
                    next_B, at, cache, dcache = self._launch_plain(
                        cache, dcache, state, seeds, sampling, greedy_only, live_next, root=pending[0]
                    )
                    following = (next_B, at, live_next, t0)
                else:
                    chosen = tree
                next_B, at, was_live, t_launch = pending
                next_B = np.asarray(next_B)
                state.commit_plain(next_B, at, was_live)
                # Its device time runs from its launch, or when it was launched before the last read
                # (overlapped), from that read; the policy learns the interval between reads (as above).
                now = time.perf_counter()
                self.spec.verify_s += now - max(t_launch, t_read)
                if self.policy is not None:
                    self.policy.record(B, 0, now - t_read)
                t_read = now
                tokens, count, pending = self._plain_tokens(next_B), np.ones(B, np.int32), following
                live = was_live & live
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
        from peagle_jax.engine import bucket

        policy = adaptive_policy(self.tree)
        B = bucket(batch, self.batch_buckets)
        cache, dcache = self._scratch_caches(B)
        X = len(self.cfg.aux_layer_ids) * self.cfg.hidden_size
        q = np.full(B, max(self.window_buckets[0] - self.tree.size - 1, 1), np.int32)  # the smallest window
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
        from peagle_jax import model

        cache = model.new_cache(self.cfg, B, self.cache_slots(B))
        dcache = new_drafter_cache(self.dcfg, B, self.cache_slots(B))
        if self.mesh is not None:
            from peagle_jax import sharding

            cache = sharding.shard_cache(cache, self.mesh)
            dcache = (sharding.shard_cache if self.shard_drafter else sharding.replicate)(dcache, self.mesh)
        return cache, dcache

    def _warm_windows(self, batch: int, prompt_len: int, max_new_tokens: int, greedy_only: bool) -> None:
        """One call per window bucket, with the root (q) and the draft context start placed so that the host
        loop's window rules (see :meth:`stream`) pick exactly that bucket; with the adaptive step length, for
        every step length (its draft and verify or fused graphs, the plain step and the context flush).
        Outputs are discarded."""
        from peagle_jax.engine import bucket

        B, K, Q = bucket(batch, self.batch_buckets), self.K, self.Q
        positions = range(prompt_len - 1, prompt_len + max_new_tokens + 1)
        draft_windows = sorted({self._draft_window(np.asarray([s])) for s in positions})
        cache, dcache = self._scratch_caches(B)
        X = len(self.cfg.aux_layer_ids) * self.cfg.hidden_size
        tokens, count = np.zeros((B, K + 1), np.int32), np.ones(B, np.int32)
        aux = jnp.zeros((B, Q, X), self.cfg.jnp_dtype)  # the whole queue, as step() passes it
        sampling = SamplingParams.make(B, 0.0 if greedy_only else 1.0)
        greedy_only = greedy_graph(sampling.temperature)  # the graphs such requests call
        seeds, root, live = jnp.zeros(B, jnp.uint32), jnp.zeros(B, jnp.int32), jnp.ones(B, bool)
        trees = [t for t in self.choices.values() if t.depth] if self.policy is not None else [self.tree]
        out = None
        for tree in trees:
            verify_windows = {self.window(q + tree.size + 1) for q in positions[1:]}
            for w in sorted(verify_windows | set(draft_windows)) if self.fused else sorted(verify_windows):
                q = jnp.full(B, max(w - tree.size - 1, 0), jnp.int32)
                start = np.full(B, max(w - 2 * K - 1, 0), np.int32)
                if self.fused:
                    ctx = (tokens, aux, count, start)
                    out, cache, dcache = self._fused(cache, dcache, ctx, root, q, seeds, sampling, tree, w, greedy_only)
                else:
                    drafts = jnp.zeros((B, tree.depth, tree.width), jnp.int32)
                    out, cache = verify(
                        self.params, cache, root, drafts, q, seeds, sampling, cfg=self.cfg, tree=tree, window=w,
                        greedy_only=greedy_only,
                    )  # fmt: skip
            for w in [] if self.fused else draft_windows:
                start = np.full(B, max(w - 2 * K - 1, 0), np.int32)
                out, dcache = self._draft(dcache, tokens, aux, count, start, tree)
        if self.policy is not None:  # plain steps, and the flushes of the context they queue
            for w in sorted({self.window(q + 1) for q in positions[1:]}):
                q = jnp.full(B, w - 1, jnp.int32)
                out, cache, aux = plain_step(
                    self.params, cache, aux, root, q, jnp.asarray(count), live, seeds, sampling, cfg=self.cfg,
                    window=w, greedy_only=greedy_only,
                )  # fmt: skip
            for w in sorted({self.window(s + Q) for s in positions}):
                start = jnp.full(B, max(w - Q, 0), jnp.int32)
                dcache, aux = flush_context(
                    self.dparams, dcache, jnp.zeros((B, Q), jnp.int32), aux, start, jnp.asarray(count), live,
                    self.embed, cfg=self.dcfg, window=w,
                )  # fmt: skip
        jax.block_until_ready(out)
