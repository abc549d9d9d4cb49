"""Continuous batching over B fixed slots: one static-shape cache, requests join and leave between steps.

The engine owns one target cache ``[B, ..., S]`` (and, with a drafter, one drafter cache) and one row state
(:class:`peagle_jax.engine.state.RowState`; with a drafter :class:`peagle_jax.spec.state.SpecState`, which adds
the queued draft context). A request is prefilled alone as a 1-row batch with the generator's bucketed
prefill graph (plus the drafter prefill), and its row is copied into a free slot by one jitted fixed-shape
update (:func:`put_row`, the slot index is data). Each :meth:`SlotEngine.step` then advances every slot at
once with the generator's graphs, in four phases:

1. **choose** the step: a plain step or a drafted tree (:class:`peagle_jax.serve.policy.StepPolicy`: load
   thresholds, the adaptive policy, the lazy drafter and its re-seeds, graphs still compiling);
2. **launch** it: a plain step through ``gen.launch_plain`` (both generators, on the same row state), a
   draft -> verify step through :meth:`peagle_jax.spec.stepper.SpecStepper.run_step`; the rows'
   sampling parameters, penalties and grammar masks come from :class:`peagle_jax.serve.rows.SlotRows`;
3. **read** its tokens: plain steps overlap the host (:mod:`peagle_jax.engine.overlap`): a step launches the
   next plain step on the unread device-side tokens of the last before it reads them, so the host's
   bookkeeping (events, admissions) runs while the device decodes. A row whose request ended in the step
   being read, or left (cancelled), has its token of the following step dropped; a row admitted since the
   last launch feeds its first token from the host (:func:`merge_roots`);
4. **emit** an event per request that gained tokens, freeing the slots of requests that ended.

Invariants. A free slot still runs through the step (shapes never change) at a small position inside its
own row, so it writes only its own row and nothing reads it; admitting a request overwrites the whole row.
A row's tokens depend only on its own prompt, parameters and seed (rows never attend across the batch;
sampling uniforms hash the row's seed and position), so a request's output is the same whatever the other
slots hold. Drafts never change outputs: every step length commits the tokens of plain decoding. The graphs
compile once per (row bucket, window bucket, step length; all-greedy or not where graphs cannot branch: see
:func:`peagle_jax.sampling.greedy_graph`) and prefill bucket; :meth:`SlotEngine.warmup` compiles them
(:mod:`peagle_jax.serve.warmup`, which also builds the shadow engine that compiles in the background while
this one serves), after which requests coming and going never compile.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine.generator import Generator, RequestError, sample_jit
from peagle_jax.engine.overlap import Launched, StepLoop, merge_roots
from peagle_jax.engine.state import RowState, host_copy
from peagle_jax.grammar import Grammars
from peagle_jax.logprobs import first_logprobs, host_logprobs, row_logprobs
from peagle_jax.models import model
from peagle_jax.sampling import SamplingParams, greedy_graph
from peagle_jax.serve import warmup as warming
from peagle_jax.serve.policy import StepPolicy
from peagle_jax.serve.rows import SlotRows
from peagle_jax.serve.slot_io import Slot, SlotEvent, SlotRequest
from peagle_jax.serve.warmup import WarmTask
from peagle_jax.spec.adaptive import AdaptiveK
from peagle_jax.spec.plan import StepKey
from peagle_jax.spec.state import SpecState
from peagle_jax.spec.stepper import DraftState, SpecStepper
from peagle_jax.spec.tree import Tree


@functools.partial(executables.jit, donate_argnames=("big",))
def put_row(big, row, b):
    """Copy a 1-row pytree ``row`` into row ``b`` (an int32 scalar) of the B-row pytree ``big``. A row longer
    than ``big``'s on another axis is cut to it: a one-row cache has :data:`peagle_jax.engine.buckets.ONE_ROW_PAD`
    slots more, never written."""

    def put(x, y):
        y = y[(slice(None), *(slice(0, n) for n in x.shape[1:]))]
        return jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), b, axis=0)

    return jax.tree.map(put, big, row)


def _valid(slots: list[Slot | None], launched: Launched) -> np.ndarray:
    """The rows of a launched step whose token counts: live at launch and still holding that request."""
    return np.array(
        [rid is not None and slots[b] is not None and slots[b].request.id == rid for b, rid in enumerate(launched.ids)]
    )


def _wants(slots: list[Slot | None], valid_R, live) -> np.ndarray:
    """The busy slots that want a token after those of a launched step (``valid_R``: its rows that gain one,
    :func:`_valid`); the rows it ends by length do not."""
    gains = np.zeros(len(slots), bool)
    gains[: len(valid_R)] = valid_R
    left = [s.request.max_new_tokens - s.produced if s is not None else 0 for s in slots]
    return np.array([live[b] and gains[b] < left[b] for b in range(len(slots))])


@dataclasses.dataclass
class _GroupPrefill:
    """The prefill the members of a request group (``n`` > 1: one prompt, other seeds) share: its members
    arrive one after another (the worker admits in order), so one is kept at a time."""

    group: int
    prefilled: tuple  # (logits, cache, drafter cache or None, aux or None) of the 1-row prefill
    echoed: list  # the prompt's log-probabilities, for echo requests
    left: int  # members still to admit


class SlotEngine:
    """B fixed slots over one generator: plain (:class:`Generator`) or speculative (a
    :class:`~peagle_jax.spec.stepper.SpecStepper`, e.g. :class:`~peagle_jax.spec.generator.SpeculativeGenerator`).

    Not thread-safe: one thread calls :meth:`admit`, :meth:`cancel` and :meth:`step` (the server's engine
    thread, :mod:`peagle_jax.serve.worker`).
    """

    def __init__(
        self,
        gen: Generator,
        max_batch: int,
        *,
        load_k: Sequence[tuple[int, int]] = (),
        adaptive: bool = False,
        chains: Sequence[int] | None = None,
        logprobs: bool = False,
        rules: bool = False,
        grammars: Grammars | None = None,
    ):
        """``load_k``: (n, K') pairs, with at least n active slots a step drafts and verifies a chain of K'
        (0: a plain step). ``adaptive``: each step picks plain, the generator's own tree or a chain of each
        length in ``chains`` (default: the generator's, see
        :class:`~peagle_jax.spec.generator.SpeculativeGenerator`) by measured throughput
        (:class:`peagle_jax.spec.adaptive.AdaptiveK`); excludes ``load_k``. ``logprobs``: every step (and
        admission) also returns the emitted tokens' raw log-probabilities and the top
        :data:`~peagle_jax.logprobs.TOP_LOGPROBS` (one flag for all graphs, so that requests that ask for
        them compile nothing; sets the generator's :attr:`~peagle_jax.engine.generator.Generator.logprobs`).
        ``rules``: every step takes the slots' presence/frequency penalties, logit biases and grammar masks
        (:mod:`peagle_jax.logit_rules`; again one flag for all graphs, so requests that use them compile nothing);
        without it such requests are refused. ``grammars``: the model's :class:`~peagle_jax.grammar.Grammars`,
        for requests with a grammar (structured outputs; needs ``rules``)."""
        if max_batch < 1:
            raise RequestError(f"max_batch must be >= 1, got {max_batch}")
        self.gen, self.B = gen, max_batch
        self.logprobs = gen.logprobs = logprobs
        self.speculative = isinstance(gen, SpecStepper)
        self.choice = StepPolicy(gen, speculative=self.speculative, load_k=load_k, adaptive=adaptive, chains=chains)
        self.rows = SlotRows(max_batch, gen.cfg.vocab_size, rules=rules, grammars=grammars)
        self.structured = {"requests": 0, "target_forwards": 0, "emitted": 0}  # of the rows with a grammar
        self.resyncs = 0  # rows re-seeded
        self.unsynced_admits = 0  # requests admitted without the drafter prefill
        self.steps_by_k: dict[int, int] = {}  # steps run at each K' (0: plain steps)
        self.overlapped = 0  # plain steps launched before the last one was read
        # A step runs only the first `rows` slots, the smallest bucket covering every busy one (admission
        # takes the lowest free slot), so a lightly loaded server does not pay for all B rows.
        self.row_buckets = tuple(sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)}))
        self.overlap = True  # plain steps launch the next one before reading their tokens
        self.reset()

    # The step-length policy's parts that the server and the tests read or replace.
    policy = property(lambda self: self.choice.adaptive, lambda self, p: setattr(self.choice, "adaptive", p))
    compiling = property(lambda self: self.choice.compiling)
    waiting_for = property(lambda self: self.choice.waiting_for)
    on_missing = property(lambda self: self.choice.on_missing, lambda self, f: setattr(self.choice, "on_missing", f))
    grammars = property(lambda self: self.rows.grammars)

    def describe(self) -> str:
        """One line on how steps decode: for the server's start-up message."""
        return self.choice.describe()

    def tree_for(self, active: int) -> Tree | None:
        """The load threshold's tree with ``active`` slots busy (None: the generator's own tree)."""
        return self.choice.tree_for(active)

    def adopt_times(self, calibrated: AdaptiveK) -> None:
        """Hand over step times calibrated by another engine (the background warm-up's :meth:`shadow`); this
        engine's thread adopts those it has not measured itself at its next step. Thread-safe."""
        self.choice.adopt_times(calibrated)

    def caches_lost(self) -> bool:
        """Whether a failed call consumed (donated) the caches, so that only :meth:`reset` can go on."""
        return any(x.is_deleted() for x in jax.tree.leaves([self.cache, self.drafter]))

    def reset(self) -> None:
        """Fresh caches and an all-free per-slot state (also after a failed step)."""
        gen, B = self.gen, self.B
        self.cache = model.new_cache(gen.cfg, B, gen.cache_slots(B))
        self.drafter, self.state = None, RowState.empty(B)  # the drafter's device state (spec.stepper.DraftState)
        if self.speculative:
            X = len(gen.cfg.aux_layer_ids) * gen.cfg.hidden_size
            aux = gen.context_aux(jnp.zeros((B, X), gen.cfg.jnp_dtype))
            self.drafter = DraftState(new_drafter_cache(gen.dcfg, B, gen.cache_slots(B)), aux)
            self.state = SpecState.start(np.zeros(B, np.int32), np.ones(B, np.int32), gen.Q)
        self.slots: list[Slot | None] = [None] * B
        self.rows.reset()
        self.choice.reset()
        self._group: _GroupPrefill | None = None  # the request group being admitted
        self._loop = StepLoop()  # holds the plain step launched and not read yet

    def forget_statistics(self) -> None:
        """Zero the counters (after a warm-up); in place where the server's /metrics holds them."""
        self.gen.reset_statistics()
        self.steps_by_k.clear()
        self.structured.update(dict.fromkeys(self.structured, 0))
        self.overlapped = self.resyncs = self.unsynced_admits = 0

    # -- slots -------------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def free(self) -> int:
        return self.B - self.active

    def check(self, req: SlotRequest) -> None:
        """Raise :class:`RequestError` when the request cannot be served (too long, bad ids or parameters)."""
        self.gen.check_request([req.prompt], req.max_new_tokens)
        self.rows.check(req)

    def rows_for(self, live) -> int:
        """The row bucket a step needs: the smallest covering the highest busy slot."""
        top = int(np.flatnonzero(live).max()) + 1
        return next(r for r in self.row_buckets if r >= top)

    def _live(self) -> np.ndarray:
        return np.array([s is not None for s in self.slots])

    def hold(self, b: int, req: SlotRequest) -> None:
        """Slot b serves ``req`` (its row state and parameters set by the caller; a warm-up's scratch request
        sets only its sampling mode)."""
        stops = self.gen.cfg.eos_token_ids if req.stop_token_ids is None else req.stop_token_ids
        self.slots[b] = Slot(req, frozenset(int(t) for t in stops))
        if self.rows.temperature[b] != req.temperature:
            self.rows.set_temperature(b, req.temperature)

    def release(self, b: int) -> None:
        """Free slot b; its row idles at a small position from now on."""
        self.slots[b] = None
        self.rows.clear(b)
        self.state.release(b)

    def _emit(self, b: int, tokens, logprobs=None) -> SlotEvent:
        """Row b's new tokens up to its stop token or length; frees the slot when the request ends.
        ``logprobs``: the tokens' (:attr:`SlotEvent.logprobs`), cut as they are."""
        slot = self.slots[b]
        out, finish = slot.gain(tokens)
        for tok in out:
            self.rows.consume(b, tok)
        if finish:
            self.release(b)
        return SlotEvent(slot.request, out, finish, None if logprobs is None else logprobs[: len(out)])

    # -- requests ----------------------------------------------------------------------------------------

    def admit(self, req: SlotRequest) -> SlotEvent:
        """Prefill ``req`` into a free slot and return its first token's event (which may already finish it).
        The members of a request group after the first reuse its prefill (the prompt's cache rows are copied
        into their slots) and sample their first token with their own seed."""
        self.check(req)
        b = self.slots.index(None)
        (logits, cache1, dcache1, aux1), echoed = self._prefill(req, b)
        rules, constraint, bias_V = self.rows.first_rules(req)
        sampling = SamplingParams.make(1, req.temperature, req.top_k, req.top_p)
        seed, position = jnp.asarray([req.seed], jnp.uint32), jnp.asarray([len(req.prompt)], jnp.int32)
        first = int(
            sample_jit(logits, sampling, seed, position, greedy_only=greedy_graph(req.temperature), rules=rules)[0]
        )
        lps = None
        if self.logprobs:
            lps = row_logprobs(host_logprobs(first_logprobs(logits[:, None], jnp.asarray([[first]])), 1), 0, 1)
        self.cache = put_row(self.cache, cache1, jnp.int32(b))
        if self.speculative:
            self._seed_context(b, len(req.prompt), dcache1, aux1, first)
        else:
            self.state.seed(b, len(req.prompt), first)
        self.rows.admit(b, req, first, constraint, bias_V)
        self.structured["requests"] += constraint is not None
        self.choice.admitted()
        self.hold(b, req)
        event = self._emit(b, [first], lps)
        if req.echo and self.logprobs:
            event.prompt_logprobs = echoed[:-1]  # the last predicts the first generated token: in ``logprobs``
        return event

    def admission_ready(self, req: SlotRequest) -> bool:
        """Whether admitting ``req`` calls only compiled graphs (:meth:`StepPolicy.ready`)."""
        return self.choice.ready(warming.admit_tasks(self.gen, len(req.prompt), req.temperature))

    def _prefill(self, req: SlotRequest, b: int) -> tuple[tuple, list]:
        """``req``'s 1-row prefill (shared within its request group) and its echoed prompt log-probabilities:
        ((last logits, cache, drafter cache or None, aux or None), log-probabilities)."""
        g = self._group
        if req.group is not None and g is not None and g.group == req.group:
            g.left -= 1
            if g.left <= 0:
                self._group = None
            return g.prefilled, g.echoed
        echoed, on_logprobs = [], None
        if req.echo and self.logprobs:

            def on_logprobs(lp, start, T):
                n = min(len(req.prompt) - start, T)
                echoed.extend(row_logprobs(host_logprobs(lp, T), 0, n))

        if self.speculative:
            live = self._live()
            live[b] = True
            synced = self.choice.sync_admission(self.rows_for(live))
            prefilled = self.gen.prefill_both([list(req.prompt)], 1, drafter=synced, on_logprobs=on_logprobs)
            self.unsynced_admits += not synced
        else:
            prefilled = (*self.gen.prefill([list(req.prompt)], 1, on_logprobs=on_logprobs), None, None)
        if req.group is not None and req.group_size > 1:
            self._group = _GroupPrefill(req.group, prefilled, echoed, req.group_size - 1)
        return prefilled, echoed

    def _seed_context(self, b: int, length: int, dcache1, aux1, root: int) -> None:
        """Row b's drafter state after a prefill of its first ``length`` committed tokens (all but the last,
        ``root``): the 1-row drafter cache (None: the drafter did not run, the row is unsynced) and the aux
        state of the last prefilled position, paired with ``root`` as the one queued context element."""
        dcache, aux = self.drafter
        if dcache1 is not None:
            dcache = put_row(dcache, dcache1, jnp.int32(b))
        self.drafter = DraftState(dcache, put_row(aux, self.gen.context_aux(aux1), jnp.int32(b)))
        self.state.seed(b, length, root, synced=dcache1 is not None)

    def _resync_row(self, R: int) -> int | None:
        """The unsynced busy row among the first R to re-seed now (:meth:`StepPolicy.resync_row`), or None."""
        if not self.choice.lazy:
            return None
        left = {b: s.request.max_new_tokens - s.produced for b, s in enumerate(self.slots[:R]) if s and s.tokens}
        b = self.choice.resync_row(R, left, self.state.synced)
        if b is not None and self.choice.missing(warming.admit_tasks(self.gen, int(self.state.q[b]))):
            return None  # its prefill still compiles: the row stays unsynced for now (drafts only cost)
        return b

    def _resync(self, b: int) -> None:
        """Re-seed row b's drafter (no step launched and unread): prefill its committed tokens but the last
        through the target (for the aux states; its own cache row is kept) and the drafter, as an admission
        does. The policy does not time the next step, as after an admission."""
        slot = self.slots[b]
        tokens = [*slot.request.prompt, *slot.tokens]
        assert self.state.q[b] == len(tokens) - 1 and self.state.root[b] == tokens[-1]
        _, _, dcache1, aux1 = self.gen.prefill_both([tokens[:-1]], 1)
        self._seed_context(b, len(tokens) - 1, dcache1, aux1, tokens[-1])
        self.resyncs += 1
        self.choice.admitted()

    def cancel(self, request_id: int) -> SlotEvent | None:
        """Free the slot of request ``request_id`` at once; None when it holds no slot."""
        for b, slot in enumerate(self.slots):
            if slot is not None and slot.request.id == request_id:
                self.release(b)
                return SlotEvent(slot.request, [], "cancelled")
        return None

    # -- the step ----------------------------------------------------------------------------------------

    def step(self, tree: Tree | None = None) -> list[SlotEvent]:
        """Advance the active slots by one step (1 token plain, 1..K+1 speculative) and return an event per
        slot whose tokens it read. A plain step is read one call later: the call that launches it reads the
        previous one (with :attr:`overlap`; the first of a run is launched and read by the same call), so a
        request admitted since the last call gains its first step's token at the next call. ``tree``
        overrides the policy and runs synchronously (a plain step for ``chain(0)``)."""
        # 1. Choose: the plain step launched by the last call (if it still counts for a row), else a new step.
        self.choice.take_times()
        loop, events = self._loop, []
        if loop.pending is not None and not _valid(self.slots, loop.pending).any():
            loop.pending = None  # its rows all ended or left: nothing to read
        if loop.pending is not None and tree is not None:  # a given step runs after the unread one is read
            pending, loop.pending = loop.pending, None
            events = self._read(pending, record=True)
        live = self._live()
        if not live.any():
            return events
        R, explicit = self.rows_for(live), tree is not None

        def choose() -> Tree | None:
            resync = None if explicit else self._resync_row(R)
            if resync is not None:
                self._resync(resync)
            chosen = tree or self._choose(R)
            # None: its graphs compile in the background (asked for next); the next call tries again.
            return chosen if explicit or self._compiled(R, chosen) else None

        # 2. Launch: a drafting step runs (and is read and emitted) at once; a plain one is launched, and the
        # one after it on its unread tokens where that can be (:meth:`_following`). 3. Read the plain step.
        turn = loop.turn(
            choose,
            lambda t: self._speculative_step(live, R, t, record=not explicit),
            lambda: self._launch(live[:R]),
            lambda pending: self._following(pending, live, R),
            overlap=self.overlap and not explicit,
        )
        if turn.launched is None:
            return events + (turn.result or [])
        # 4. Emit.
        return events + self._read(turn.launched, record=not explicit, next_R=turn.tokens)

    def _choose(self, R: int) -> Tree:
        """The tree of the next step over R rows (depth 0: a plain step): :meth:`StepPolicy.choose`."""
        busy = [b for b in range(R) if self.slots[b] is not None]
        synced = float(np.mean(self.state.synced[busy])) if busy and self.speculative else 1.0
        return self.choice.choose(R, active=self.active, synced=synced, key_of=lambda t: self._step_key(R, t))

    def _compiled(self, R: int, tree: Tree) -> bool:
        """Whether the step of ``tree`` over R rows calls only compiled graphs (:meth:`StepPolicy.ready`)."""
        return self.choice.ready([self._step_key(R, tree)])

    def _step_key(self, R: int, tree: Tree) -> StepKey:
        """The key of a step of ``tree`` over the first R rows now (:func:`peagle_jax.spec.plan.step_keys`)."""
        live = self._live()[:R]
        window = self.gen.windows.verify_window(self.state.q[:R][live], tree)
        return StepKey(R, tree, window, self.rows.greedy_only(live))

    def _following(self, launched: Launched, live, R: int):
        """How to launch the next step on ``launched``'s unread tokens (``launch_next(tokens_R)``), or None
        when it cannot be: the next step drafts (it is remembered for the next call), a drafter-context flush
        or re-seed is due (they embed the queued tokens: they wait until those are read), a row with a
        grammar needs its state after the unread tokens for its mask, the row bucket changes, or the next
        step's graph still compiles."""
        following = self._choose(R)
        valid = _valid(self.slots, launched)
        wants = _wants(self.slots, valid, live)[:R]
        blocked = self.gen.needs_flush(self.state, R, lazy=self.choice.lazy_at(R)) or self._resync_row(R) is not None
        blocked = blocked or bool(self.rows.constrained[:R].any()) or not self._compiled(R, following)
        if following.depth or not wants.any() or launched.R != R or blocked:
            self.choice.remember(R, following)
            return None
        fresh = wants & ~valid  # admitted since the launch: their first token comes from the host
        host = self.state.root[:R]

        def launch_next(tokens_R):
            root = merge_roots(host_copy(fresh), host_copy(host), tokens_R) if fresh.any() else tokens_R
            self.overlapped += 1
            return self._launch(wants, root=root)

        return launch_next

    def _launch(self, live_R, root=None) -> Launched:
        """Launch a plain step over the first R = ``len(live_R)`` rows without waiting for it; ``root`` [R]:
        the tokens to feed (on the device), by default the host's."""
        R = len(live_R)
        sampling, seeds = self.rows.sampling(R)
        launched, self.cache, self.drafter = self.gen.launch_plain(
            self.cache, self.drafter, self.state, seeds, sampling, self.rows.greedy_only(live_R), live_R, root,
            self.choice.lazy_at(R), rules=self.rows.plain_rules(live_R),
        )  # fmt: skip
        launched.ids = [self.slots[b].request.id if live_R[b] else None for b in range(R)]
        self.rows.count(launched.tokens, np.ones(R, np.int32), live_R)
        self.steps_by_k[0] = self.steps_by_k.get(0, 0) + 1
        return launched

    def _read(self, launched: Launched, record: bool, next_R=None) -> list[SlotEvent]:
        """Read a launched plain step's tokens (unless ``next_R`` holds them), commit them for its valid rows
        (:func:`_valid`) and emit their events; its time goes to the policy (:meth:`StepPolicy.record`)."""
        now = time.perf_counter()
        valid = _valid(self.slots, launched)
        next_R = self.gen.read_plain(launched, self.state, valid, self.choice.last_read, next_R)
        self.choice.record(launched.R, 0, now, learn=record)
        lp = None if launched.logprobs is None else host_logprobs(launched.logprobs, 1)
        return [
            self._emit(b, next_R[b : b + 1], None if lp is None else row_logprobs(lp, b, 1))
            for b in np.flatnonzero(valid)
        ]

    def _speculative_step(self, live, R: int, tree: Tree, record: bool) -> list[SlotEvent]:
        """A draft -> verify step of ``tree`` over the first R rows, read at once."""
        sampling, seeds = self.rows.sampling(R)
        live_R = live[:R]
        result, self.cache, self.drafter = self.gen.run_step(
            self.cache, self.drafter, self.state, seeds, sampling, greedy_only=self.rows.greedy_only(live_R),
            live=live_R, tree=tree, rules=self.rows.tree_rules(live_R, tree),
        )  # fmt: skip
        tokens, count, lp = result.tokens, result.count, result.logprobs
        self.rows.count(tokens, count, live_R)
        grammar_rows = self.rows.grammar_rows(live_R)
        self.structured["target_forwards"] += len(grammar_rows)
        self.structured["emitted"] += int(count[grammar_rows].sum())
        # The policy learns the acceptance of synced rows only: the others drafted from a stale context.
        self.choice.record(R, result.k, time.perf_counter(), count[live_R & self.state.synced[:R]], learn=record)
        self.steps_by_k[result.k] = self.steps_by_k.get(result.k, 0) + 1
        return [
            self._emit(b, tokens[b, : int(count[b])], None if lp is None else row_logprobs(lp, b, int(count[b])))
            for b in np.flatnonzero(live)
        ]

    # -- compilation (:mod:`peagle_jax.serve.warmup`) ----------------------------------------------------

    def warmup_tasks(self) -> list[WarmTask]:
        """Every graph a request can reach, as warm-up tasks (:func:`peagle_jax.serve.warmup.warmup_tasks`)."""
        return warming.warmup_tasks(self)

    def warmup(self, progress=None, tasks: Sequence[WarmTask] | None = None, *, calibrate: bool = True) -> float:
        """Compile ``tasks`` (default all) and calibrate the adaptive policy (:func:`peagle_jax.serve.warmup.warm_up`);
        returns the seconds spent."""
        return warming.warm_up(self, progress, tasks, calibrate=calibrate)

    def shadow(self) -> SlotEngine:
        """A twin engine that compiles on another thread (:func:`peagle_jax.serve.warmup.shadow`)."""
        return warming.shadow(self)
