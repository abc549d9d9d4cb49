"""Continuous batching over B fixed slots: one static-shape cache, requests join and leave between steps.

The engine owns one target cache ``[B, ..., S]`` (and, with a drafter, one drafter cache and the draft
context of every row). A request is prefilled alone as a 1-row batch with the generator's bucketed prefill
graph (plus the drafter prefill), and its row is copied into a free slot by one jitted fixed-shape update
(:func:`put_row`, the slot index is data). Each :meth:`SlotEngine.step` then advances every slot at once
with the same graphs the batch generators use: :func:`peagle_jax.engine.generator.decode_step` for plain decoding,
:meth:`peagle_jax.spec.generator.SpeculativeGenerator.run_step` (draft -> verify) or a plain step with a drafter.

With the adaptive policy the drafter's own work is lazy: where drafting does not pay at the current load, a
request is admitted without the drafter prefill and a row's queued draft context is dropped when full rather
than written into the drafter cache (:meth:`peagle_jax.spec.state.SpecState.desync`); when drafting pays
again, rows are re-seeded one per step (:meth:`SlotEngine._resync`). Drafts never change outputs, so a row
with a stale drafter context costs only acceptance, which the policy accounts for.

Plain steps (every step without a drafter; the steps where the adaptive policy or a load threshold does not
draft) overlap the host the way :meth:`peagle_jax.engine.generator.Generator.stream` does: a step launches the next
plain step on the unread device-side tokens of the last before it reads them, so the host's bookkeeping
(events, admissions) runs while the device decodes. A row whose request ended in the step being read, or
left (cancelled), has its token of the following step dropped; a row admitted since the last launch feeds
its first token from the host (:func:`merge_roots`).

Invariants. A free slot still runs through the step (shapes never change) at a small position inside its
own row, so it writes only its own row and nothing reads it; admitting a request overwrites the whole row.
Sampling parameters and seeds are per-slot arrays, and a row's tokens depend only on its own prompt,
parameters and seed (rows never attend across the batch; sampling uniforms hash the row's seed and
position), so a request's output is the same whatever the other slots hold. The graphs compile once per
(row bucket, window bucket, step length; all-greedy or not where graphs cannot branch: see
:func:`peagle_jax.sampling.greedy_graph`) and prefill bucket; :meth:`SlotEngine.warmup` compiles them (all of
them, or a list of :meth:`SlotEngine.warmup_tasks`), after which requests coming and going never compile.

Compiling while serving. The server compiles the first tasks (:func:`first_tasks`: what a short prompt's
first request needs) before it serves and the rest in the background, on a :meth:`SlotEngine.shadow`: an
engine of the same shapes with its own caches, whose warm-up steps compile into the same jit caches while
this engine serves. Until a drafting step's graphs are compiled (:attr:`SlotEngine.compiling`), a step that
would draft runs a plain step instead; outputs do not change (every step length commits the tokens of plain
decoding), only the speed. A plain step or a prefill whose graph is not compiled yet compiles when first
called. The shadow's calibrated step times reach the adaptive policy through :meth:`SlotEngine.adopt_times`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables
from peagle_jax.drafter.model import new_drafter_cache
from peagle_jax.engine.generator import Generator, RequestError, StepStats, decode_step, sample_jit
from peagle_jax.engine.overlap import Launched, launch_then_read
from peagle_jax.grammar import Constraint, Grammars
from peagle_jax.logit_rules import LogitRules, check_penalties, count_tokens, mask_words, start_row
from peagle_jax.logprobs import first_logprobs, host_logprobs, row_logprobs
from peagle_jax.models import model
from peagle_jax.platform import MapBudget
from peagle_jax.sampling import SamplingParams, check_sampling_args, greedy_graph, greedy_modes
from peagle_jax.spec.adaptive import CALIBRATION_STEPS, AdaptiveK, adaptive_policy, step_trees
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.plan import StepKey, serving_trees, step_keys
from peagle_jax.spec.state import SpecState, SpecStats, host_copy
from peagle_jax.spec.tree import Tree, chain

_ids = itertools.count(1)


def next_request_id() -> int:
    """A new request id (also used to name a request group)."""
    return next(_ids)


@dataclasses.dataclass
class SlotRequest:
    """One generation request: token ids in, at most ``max_new_tokens`` out, stopping after any of
    ``stop_token_ids`` (None: the model's EOS ids). ``group`` / ``group_size``: the choices of one API request
    with ``n`` > 1 (the same prompt, other seeds) share one prefill (:meth:`SlotEngine.admit`)."""

    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: Sequence[int] | None = None
    group: int | None = None
    group_size: int = 1
    id: int = dataclasses.field(default_factory=next_request_id)
    echo: bool = False  # the admission's event also carries the prompt's log-probabilities (needs logprobs)
    # :mod:`peagle_jax.logit_rules` (need the engine's ``rules``): penalties over the tokens generated so far,
    # a bias added to the logits of token ids, and a grammar the answer follows (:meth:`Grammars.compile
    # <peagle_jax.grammar.Grammars.compile>`; needs the engine's ``grammars``)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        """Whether the request changes the logits (penalties or a logit bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclasses.dataclass
class SlotEvent:
    """Tokens a request gained in one step; ``finish_reason`` is set on its last event: "stop" (a stop
    token, included in ``tokens``), "length" or "cancelled". With the engine's :attr:`SlotEngine.logprobs`,
    ``logprobs`` holds per token its raw log-probability and the top ones:
    (logprob, [(token id, logprob), ...]), most likely first (:func:`peagle_jax.logprobs.row_logprobs`)."""

    request: SlotRequest
    tokens: list[int]
    finish_reason: str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # An echo request's admission: the log-probabilities of its prompt tokens after the first, as ``logprobs``.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclasses.dataclass
class _Slot:
    request: SlotRequest
    stops: frozenset[int]
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far (to re-seed the drafter)

    @property
    def produced(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Admit:
    """A warm-up task: admitting a prompt of ``length`` tokens (its prefill chunks and the first-token
    sampler, greedy or sampling by ``temperature``)."""

    length: int
    temperature: float = 0.0


WarmTask = Admit | StepKey


def first_tasks(tasks: Sequence[WarmTask], smallest_window: int) -> tuple[list[WarmTask], list[WarmTask]]:
    """Split an ordered :meth:`SlotEngine.warmup_tasks` list into what a server compiles before it serves (the
    admissions of prompts within the smallest window and the plain step over one row there) and the rest."""

    def first(task: WarmTask) -> bool:
        if isinstance(task, Admit):
            return task.length <= smallest_window
        return task.rows == 1 and task.window == smallest_window and not task.tree.depth

    return [t for t in tasks if first(t)], [t for t in tasks if not first(t)]


@executables.jit
def merge_roots(fresh_R, host_R, device_R):
    """The tokens a plain step feeds: the host's for the ``fresh`` rows (admitted since the last launch),
    else the previous step's unread output."""
    return jnp.where(fresh_R, host_R, device_R)


@functools.partial(executables.jit, donate_argnames=("big",))
def put_row(big, row, b):
    """Copy a 1-row pytree ``row`` into row ``b`` (an int32 scalar) of the B-row pytree ``big``. A row longer
    than ``big``'s on another axis is cut to it: a one-row cache has :data:`peagle_jax.engine.buckets.ONE_ROW_PAD`
    slots more, never written."""

    def put(x, y):
        y = y[(slice(None), *(slice(0, n) for n in x.shape[1:]))]
        return jax.lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), b, axis=0)

    return jax.tree.map(put, big, row)


class SlotEngine:
    """B fixed slots over one generator (plain :class:`Generator` or :class:`SpeculativeGenerator`).

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
        (:class:`peagle_jax.spec.adaptive.AdaptiveK`); excludes ``load_k``. ``logprobs``:
        every step (and admission) also returns the emitted tokens' raw log-probabilities and the top
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
        self.rules, self.grammars = rules or grammars is not None, grammars
        # Grammar-aware drafting: a constrained row's drafted tokens are replaced by the best ones its grammar
        # allows before the verify (peagle_jax.grammar); outputs are the same either way.
        self.grammar_drafting = True
        self.structured = {"requests": 0, "target_forwards": 0, "emitted": 0}  # of the rows with a grammar
        self.grammar_s = 0.0  # host seconds in grammar masks and grammar-aware drafting
        self.speculative = isinstance(gen, SpeculativeGenerator)
        chains = gen.chains if chains is None and self.speculative else chains
        self._load_k, self._adaptive, self._chains = tuple(load_k), adaptive, chains
        # The step keys whose graphs still compile in the background (see the module docstring): a drafting
        # step among them runs a plain step instead. Another thread removes keys as they compile.
        self.compiling: set[StepKey] = set()
        self._times: AdaptiveK | None = None  # step times calibrated elsewhere, adopted on the next step
        self.load_trees: list[tuple[int, Tree]] = []
        if (load_k or adaptive) and not self.speculative:
            raise RequestError("a smaller K under load needs a drafter")
        if load_k and adaptive:
            raise RequestError("choose either fixed load thresholds or the adaptive K, not both")
        for n, k in sorted(load_k):
            if n < 1 or not 0 <= k <= gen.K:
                raise RequestError(
                    f"load K {n}:{k}: need at least 1 active slot and 0 <= K' <= K = {gen.K} (the depth of "
                    f"{gen.tree.describe()})"
                )
            self.load_trees.append((n, chain(k)))
        # the step lengths the adaptive policy picks from: K' -> its tree
        try:
            self.choices = step_trees(gen.tree, chains) if adaptive else {}
        except ValueError as err:
            raise RequestError(str(err)) from None
        self.policy = None
        if adaptive:
            self.policy = adaptive_policy(gen.tree, chains)
        # With the adaptive policy, the drafter's work is lazy: where drafting does not pay (the policy's
        # :meth:`~peagle_jax.spec.adaptive.AdaptiveK.pays`), a request is admitted without the drafter prefill and
        # a row whose context queue fills is desynced rather than flushed (SpecState.desync); once drafting
        # pays again, one unsynced row per step is re-seeded (:meth:`_resync`).
        self.lazy = adaptive
        # A re-seed costs about a prefill of the row's tokens (at 16 busy rows on a CPU, about two plain
        # steps), and where drafting pays it saves a fraction of a plain step per token: only a row with this
        # many tokens left is re-seeded (in a 16-client benchmark of 48-token requests, re-seeding rows with
        # 16 or more left cost about a tenth of the throughput).
        self.resync_min_left = 64
        self.resyncs = 0  # rows re-seeded
        self.unsynced_admits = 0  # requests admitted without the drafter prefill
        self.steps_by_k: dict[int, int] = {}  # steps run at each K' (0: plain steps)
        self.overlapped = 0  # plain steps launched before the last one was read
        self.slots: list[_Slot | None] = [None] * max_batch
        B = max_batch
        self.temperature = np.zeros(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.top_p = np.ones(B, np.float32)
        self.seeds = np.zeros(B, np.uint32)
        self.presence = np.zeros(B, np.float32)
        self.frequency = np.zeros(B, np.float32)
        self.penalized = np.zeros(B, bool)  # the slot's request has penalties or a logit bias
        self.constrained = np.zeros(B, bool)  # the slot's request has a grammar
        self.constraints: list[Constraint | None] = [None] * B  # its grammar state
        # A step runs only the first `rows` slots, the smallest bucket covering every busy one (admission
        # takes the lowest free slot), so a lightly loaded server does not pay for all B rows.
        self.row_buckets = tuple(sorted({min(1 << i, B) for i in range(B.bit_length() + 1)}))
        self._device_params = {}
        self._free_masks = {}  # all-ones masks and no host drafts per (rows, nodes), on the device
        self.overlap = True  # plain steps launch the next one before reading their tokens
        self.reset()

    def describe(self) -> str:
        """One line on how steps decode: for the server's start-up message."""
        if not self.speculative:
            return "plain (no drafter)"
        tree = self.gen.tree.describe()
        if self.policy is not None:
            ks = "/".join(str(k) for k in self.policy.candidates)
            chains = list(self.choices)[1:-1]
            steps = ["a plain step", *(f"a chain of {c}" for c in chains), tree]
            flag = "auto" + (":" + ",".join(map(str, chains)) if chains else "")
            return (
                f"speculative, each step drafts {ks} deep ({', '.join(steps[:-1])} or {steps[-1]}), whichever was "
                f"measured fastest (--load-k {flag})"
            )
        if self.load_trees:
            rules = ", ".join(
                f"{f'a chain of {t.depth}' if t.depth else 'plain steps'} from {n} active" for n, t in self.load_trees
            )
            return f"speculative, {tree} per step ({rules})"
        return f"speculative, {tree} per step"

    def caches_lost(self) -> bool:
        """Whether a failed call consumed (donated) the caches, so that only :meth:`reset` can go on."""
        caches = [self.cache] + ([self.dcache, self.state.ctx_aux] if self.speculative else [])
        return any(x.is_deleted() for x in jax.tree.leaves(caches))

    def reset(self) -> None:
        """Fresh caches and an all-free per-slot state (also after a failed step)."""
        gen, B = self.gen, self.B
        self.cache = model.new_cache(gen.cfg, B, gen.cache_slots(B))
        if self.speculative:
            self.dcache = new_drafter_cache(gen.dcfg, B, gen.cache_slots(B))
            X = len(gen.cfg.aux_layer_ids) * gen.cfg.hidden_size
            self.state = SpecState.start(
                np.zeros(B, np.int32), jnp.zeros((B, X), gen.cfg.jnp_dtype), np.ones(B, np.int32), gen.Q
            )
        else:
            self.pending = np.zeros(B, np.int32)  # the token each row feeds next, at ``positions``
            self.positions = np.zeros(B, np.int32)
        self.slots = [None] * B
        if self.rules:  # each slot's generated-token counts and logit bias (rows start over at admission)
            V = gen.cfg.vocab_size
            self.counts, self.bias = jnp.zeros((B, V), jnp.int32), jnp.zeros((B, V), jnp.float32)
        # (group, prefill outputs, members still to admit, echoed prompt log-probabilities) of the request group
        # being admitted: its members arrive one after another (the worker admits in order), so one entry is
        # enough
        self._shared: list | None = None
        self._launched: Launched | None = None  # a plain step not read yet
        self._chosen: tuple[int, Tree] | None = None  # (rows, tree) chosen while it ran, for the next step
        self._t_read = self._t_admit = 0.0  # when a step's tokens were last read; when a request was admitted

    # -- bookkeeping -------------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def free(self) -> int:
        return self.B - self.active

    def check(self, req: SlotRequest) -> None:
        """Raise :class:`RequestError` when the request cannot be served (too long, bad ids or parameters)."""
        self.gen.check_request([req.prompt], req.max_new_tokens)
        try:
            check_sampling_args(req.temperature, req.top_k, req.top_p)
        except ValueError as err:
            raise RequestError(str(err)) from None
        if req.grammar is not None and self.grammars is None:
            raise RequestError("this engine serves no structured outputs (no grammars)")
        if req.penalized:
            if not self.rules:
                raise RequestError("this engine takes no presence/frequency penalties or logit_bias")
            try:
                check_penalties(req.presence_penalty, req.frequency_penalty, req.logit_bias, self.gen.cfg.vocab_size)
            except ValueError as err:
                raise RequestError(str(err)) from None

    def _sampling(self, rows: int):
        """Device copies of the first ``rows`` slots' sampling parameters and seeds (kept until they change)."""
        if rows not in self._device_params:  # host copies: the host arrays change while steps may run
            self._device_params[rows] = (
                SamplingParams(*(host_copy(x[:rows]) for x in (self.temperature, self.top_k, self.top_p))),
                host_copy(self.seeds[:rows]),
                tuple(host_copy(x[:rows]) for x in (self.presence, self.frequency, self.penalized, self.constrained)),
            )
        return self._device_params[rows][:2]

    def _rules(self, rows: int, nodes: int = 1, allowed=None, drafted=None) -> LogitRules | None:
        """The first ``rows`` slots' :class:`~peagle_jax.logit_rules.LogitRules` for a step of ``nodes`` tree
        nodes (None without :attr:`rules`); ``allowed`` [rows, nodes, W] and ``drafted`` [rows, nodes - 1]
        (host) where a row has a grammar, else every token allowed and nothing drafted on the host."""
        if not self.rules:
            return None
        self._sampling(rows)
        presence, frequency, active, constrained = self._device_params[rows][2]
        if allowed is None:
            key = ("free", rows, nodes)
            if key not in self._free_masks:
                W = mask_words(self.gen.cfg.vocab_size)
                self._free_masks[key] = (
                    jnp.full((rows, nodes, W), -1, jnp.int32),
                    jnp.zeros((rows, nodes - 1), jnp.int32),
                )
            allowed, drafted = self._free_masks[key]
        else:  # device arrays, as the free masks (a host array is another jit cache key)
            allowed, drafted = jnp.asarray(allowed), jnp.asarray(drafted)
        return LogitRules(presence, frequency, active, self.bias, self.counts, allowed, constrained, drafted)

    def _grammar_rows(self, live_R) -> np.ndarray:
        """The rows among the first R = ``len(live_R)`` whose grammar decides this step."""
        return np.flatnonzero(self.constrained[: len(live_R)] & live_R)

    def _plain_rules(self, live_R) -> LogitRules | None:
        """A plain step's rules over the first R rows: the grammar rows' masks of their state now."""
        rows = self._grammar_rows(live_R)
        if not len(rows):
            return self._rules(len(live_R))
        t0 = time.perf_counter()
        allowed = np.full((len(live_R), 1, mask_words(self.gen.cfg.vocab_size)), -1, np.int32)
        for b in rows:
            self.constraints[b].mask(allowed[b, 0])
        self.grammar_s += time.perf_counter() - t0
        return self._rules(len(live_R), 1, allowed, np.zeros((len(live_R), 0), np.int32))

    def _tree_rules(self, live_R, tree: Tree):
        """A draft -> verify step's rules over the first R rows: fixed, or, where a row has a grammar, a
        function of the drafted candidates [R, K, N] (host) that returns them with each node's mask after its
        own path and the grammar rows' node tokens (:meth:`peagle_jax.grammar.Constraint.tree_masks`)."""
        R, T = len(live_R), tree.size + 1
        rows = self._grammar_rows(live_R)
        if not len(rows):
            return self._rules(R, T)

        def after_draft(drafts_RKN):
            t0 = time.perf_counter()
            allowed = np.full((R, T, mask_words(self.gen.cfg.vocab_size)), -1, np.int32)
            drafted = np.zeros((R, T - 1), np.int32)
            aware = self.grammar_drafting
            for b in rows:
                drafted[b] = self.constraints[b].tree_masks(tree, drafts_RKN[b], allowed[b], aware=aware)
            self.grammar_s += time.perf_counter() - t0
            return self._rules(R, T, allowed, drafted)

        return after_draft

    def _count(self, tokens_R, n_R, live_R) -> None:
        """Add a step's tokens (``tokens_R`` [R] or [R, P], host or device; the first ``n_R`` of each row) to
        the slot counts, while a busy slot among the first R has penalties: the others' counts are never read
        (a row starts over at admission)."""
        if self.rules and self.penalized[: len(live_R)][live_R].any():
            tokens_RP = jnp.asarray(tokens_R if tokens_R.ndim == 2 else tokens_R[:, None])  # one jit key: device
            self.counts = count_tokens(self.counts, tokens_RP, np.asarray(n_R, np.int32))

    def rows_for(self, live) -> int:
        """The row bucket a step needs: the smallest covering the highest busy slot."""
        top = int(np.flatnonzero(live).max()) + 1
        return next(r for r in self.row_buckets if r >= top)

    def _emit(self, b: int, tokens, logprobs=None) -> SlotEvent:
        """Row b's new tokens up to its stop token or length; frees the slot when the request ends.
        ``logprobs``: the tokens' (:attr:`SlotEvent.logprobs`), cut as they are."""
        slot = self.slots[b]
        out, finish = [], None
        constraint = self.constraints[b]
        for tok in tokens:
            out.append(int(tok))
            slot.tokens.append(int(tok))
            if constraint is not None:
                constraint.consume([tok])
            if int(tok) in slot.stops:
                finish = "stop"
            elif slot.produced >= slot.request.max_new_tokens:
                finish = "length"
            if finish:
                self._release(b)
                break
        return SlotEvent(slot.request, out, finish, None if logprobs is None else logprobs[: len(out)])

    def _release(self, b: int) -> None:
        """Free slot b; its row idles at a small position from now on."""
        self.slots[b] = None
        self.temperature[b] = 0.0
        self.presence[b] = self.frequency[b] = 0.0
        self.penalized[b] = self.constrained[b] = False
        self.constraints[b] = None
        self._device_params = {}
        if self.speculative:
            s = self.state
            s.ctx_count[b], s.ctx_start[b], s.q[b], s.root[b] = 1, 0, 1, 0
        else:
            self.pending[b], self.positions[b] = 0, 0

    # -- requests ----------------------------------------------------------------------------------------

    def admit(self, req: SlotRequest) -> SlotEvent:
        """Prefill ``req`` into a free slot and return its first token's event (which may already finish it).
        The members of a request group after the first reuse its prefill (the prompt's cache rows are copied
        into their slots) and sample their first token with their own seed."""
        self.check(req)
        b = self.slots.index(None)
        gen, prompt = self.gen, list(req.prompt)
        sampling = SamplingParams.make(1, req.temperature, req.top_k, req.top_p)
        seed = jnp.asarray([req.seed], jnp.uint32)
        greedy = greedy_graph(req.temperature)
        echoed = []  # the prompt's log-probabilities per chunk, for an echo
        on_logprobs = None
        if req.echo and self.logprobs:

            def on_logprobs(lp, start, T):
                n = min(len(prompt) - start, T)
                echoed.extend(row_logprobs(host_logprobs(lp, T), 0, n))

        grouped = req.group is not None and self._shared is not None and self._shared[0] == req.group
        shared = self._shared if grouped else None
        if shared is not None:
            prefilled, echoed = shared[1], shared[3]
            shared[2] -= 1
            if shared[2] <= 0:
                self._shared = None
        elif self.speculative:
            live = np.array([s is not None or i == b for i, s in enumerate(self.slots)])
            R = self.rows_for(live)
            # The drafter is kept current where drafting pays, or where an exploration is due: it measures
            # the acceptance on this row (AdaptiveK.explore_due), so a low estimate can still recover.
            synced = not self.lazy or self.policy.pays(R) or self.policy.explore_due(R)
            prefilled = gen.prefill_both([prompt], 1, drafter=synced, on_logprobs=on_logprobs)
            self.unsynced_admits += not synced
        else:
            prefilled = gen.prefill([prompt], 1, on_logprobs=on_logprobs)
        if shared is None and req.group is not None and req.group_size > 1:
            self._shared = [req.group, prefilled, req.group_size - 1, echoed]
        if self.speculative:
            logits, cache1, dcache1, aux1 = prefilled
        else:
            logits, cache1 = prefilled
        position = jnp.asarray([len(prompt)], jnp.int32)
        if self.rules:  # no generated tokens yet: the bias and the grammar's start
            V = gen.cfg.vocab_size
            bias_V = np.zeros(V, np.float32)
            for tok, value in (req.logit_bias or {}).items():
                bias_V[int(tok)] = value
            constraint = None if req.grammar is None else self.grammars.constraint(req.grammar)
            allowed = np.full((1, 1, mask_words(V)), -1, np.int32)
            if constraint is not None:
                constraint.mask(allowed[0, 0])
            flags = [np.asarray([x], dt) for x, dt in ((req.presence_penalty, np.float32),
                     (req.frequency_penalty, np.float32), (req.penalized, bool))]  # fmt: skip
            rules1 = LogitRules(
                *flags, bias_V[None], np.zeros((1, V), np.int32), allowed, np.asarray([constraint is not None]),
                np.zeros((1, 0), np.int32),
            )  # fmt: skip
            first = int(sample_jit(logits, sampling, seed, position, greedy_only=greedy, rules=rules1)[0])
            self.counts, self.bias = start_row(self.counts, self.bias, jnp.int32(b), jnp.int32(first), bias_V)
        else:
            first = int(sample_jit(logits, sampling, seed, position, greedy_only=greedy)[0])
        lps = None
        if self.logprobs:
            lps = row_logprobs(host_logprobs(first_logprobs(logits[:, None], jnp.asarray([[first]])), 1), 0, 1)
        self.cache = put_row(self.cache, cache1, jnp.int32(b))
        if self.speculative:
            self._seed_context(b, len(prompt), dcache1, aux1, first)
        else:
            self.pending[b], self.positions[b] = first, len(prompt)
        self.temperature[b], self.top_k[b], self.top_p[b] = req.temperature, req.top_k, req.top_p
        self.seeds[b] = np.uint32(req.seed & 0xFFFFFFFF)
        self.presence[b], self.frequency[b] = req.presence_penalty, req.frequency_penalty
        self.penalized[b] = req.penalized
        if self.rules:
            self.constraints[b], self.constrained[b] = constraint, constraint is not None
            self.structured["requests"] += constraint is not None
        self._device_params = {}
        self._t_admit = time.perf_counter()
        stops = gen.cfg.eos_token_ids if req.stop_token_ids is None else req.stop_token_ids
        self.slots[b] = _Slot(req, frozenset(int(t) for t in stops))
        event = self._emit(b, [first], lps)
        if req.echo and self.logprobs:
            event.prompt_logprobs = echoed[:-1]  # the last predicts the first generated token: in ``logprobs``
        return event

    def _seed_context(self, b: int, length: int, dcache1, aux1, root: int) -> None:
        """Row b's drafter state after a prefill of its first ``length`` committed tokens (all but the last,
        ``root``): the 1-row drafter cache (None: the drafter did not run, the row is unsynced) and the aux
        state of the last prefilled position, paired with ``root`` as the one queued context element."""
        s = self.state
        if dcache1 is not None:
            self.dcache = put_row(self.dcache, dcache1, jnp.int32(b))
        ctx_aux1 = jnp.zeros((1, *s.ctx_aux.shape[1:]), aux1.dtype).at[:, 0].set(aux1)
        s.ctx_aux = put_row(s.ctx_aux, ctx_aux1, jnp.int32(b))
        s.ctx_tokens[b] = 0
        s.ctx_tokens[b, 0] = root
        s.ctx_count[b], s.ctx_start[b], s.q[b], s.root[b] = 1, length - 1, length, root
        s.synced[b] = dcache1 is not None

    def _resync_row(self, R: int) -> int | None:
        """The unsynced busy row among the first R to re-seed now (:meth:`_resync`), where drafting pays at R:
        the one with the most tokens left, if at least :attr:`resync_min_left`. None: no row to re-seed."""
        if not self.lazy or self.state.synced[:R].all() or not self.policy.pays(R):
            return None
        left = {
            b: s.request.max_new_tokens - s.produced
            for b, s in enumerate(self.slots[:R])
            if s is not None and not self.state.synced[b] and s.tokens
        }
        b = max(left, key=left.get, default=None)
        return b if b is not None and left[b] >= self.resync_min_left else None

    def _resync(self, b: int) -> None:
        """Re-seed row b's drafter (no step launched and unread): prefill its committed tokens but the last
        through the target (for the aux states; its own cache row is kept) and the drafter, as an admission
        does. The policy does not time the next step (:meth:`_record`), as after an admission."""
        slot = self.slots[b]
        tokens = [*slot.request.prompt, *slot.tokens]
        assert self.state.q[b] == len(tokens) - 1 and self.state.root[b] == tokens[-1]
        _, _, dcache1, aux1 = self.gen.prefill_both([tokens[:-1]], 1)
        self._seed_context(b, len(tokens) - 1, dcache1, aux1, tokens[-1])
        self.resyncs += 1
        self._t_admit = time.perf_counter()

    def cancel(self, request_id: int) -> SlotEvent | None:
        """Free the slot of request ``request_id`` at once; None when it holds no slot."""
        for b, slot in enumerate(self.slots):
            if slot is not None and slot.request.id == request_id:
                self._release(b)
                return SlotEvent(slot.request, [], "cancelled")
        return None

    def tree_for(self, active: int) -> Tree | None:
        """The draft tree of a step with ``active`` slots busy: the smallest K' whose load it reaches (None:
        the generator's own tree)."""
        tree = None
        for n, t in self.load_trees:
            if active >= n:
                tree = t
        return tree

    def step(self, tree: Tree | None = None) -> list[SlotEvent]:
        """Advance the active slots by one step (1 token plain, 1..K+1 speculative) and return an event per
        slot whose tokens it read. A plain step is read one call later: the call that launches it reads the
        previous one (with :attr:`overlap`; the first of a run is launched and read by the same call), so a
        request admitted since the last call gains its first step's token at the next call. ``tree``
        overrides the policy and runs synchronously (a plain step for ``chain(0)``)."""
        times, self._times = self._times, None
        if times is not None and self.policy is not None:
            self.policy.adopt(times)
        launched, self._launched = self._launched, None
        if launched is not None and not self._valid(launched).any():
            launched = None  # its rows all ended or left: nothing to read
        if launched is not None and tree is not None:  # read it first, then run the given step
            return self._read(launched, record=True) + self.step(tree)
        live = np.array([s is not None for s in self.slots])
        if not live.any():
            return []
        R = self.rows_for(live)
        if launched is None:
            explicit = tree is not None
            resync = None if explicit else self._resync_row(R)
            if resync is not None:
                self._resync(resync)
            tree = tree or self._choose(R)
            if tree.depth:
                return self._speculative_step(live, R, tree, record=not explicit)
            launched = self._launch(live[:R])
            if explicit or not self.overlap:
                return self._read(launched, record=not explicit)
        # The next step is chosen now; a plain one is launched on the unread tokens of this one, unless a
        # drafter-context flush or re-seed is due (they embed the queued tokens: they wait until those are
        # read) or the row bucket changes.
        following = self._choose(R)
        valid = self._valid(launched)
        wants = self._wants(valid, live)[:R]
        flush = self.speculative and self.gen.needs_flush(self.state, R, lazy=self._lazy(R))
        flush = flush or self._resync_row(R) is not None
        launch_next = None
        # A row with a grammar needs its state after the unread tokens for the next step's mask.
        flush = flush or bool(self.constrained[:R].any())
        if not following.depth and wants.any() and launched.R == R and not flush:
            fresh = wants & ~valid
            host = self.state.root[:R] if self.speculative else self.pending[:R]

            def launch_next(tokens_R):
                root = merge_roots(host_copy(fresh), host_copy(host), tokens_R) if fresh.any() else tokens_R
                self.overlapped += 1
                return self._launch(wants, root=root)

        else:
            self._chosen = (R, following)
        next_R, self._launched = launch_then_read(launched, launch_next)  # engine.overlap
        return self._read(launched, record=True, valid=valid, next_R=next_R)

    def _choose(self, R: int) -> Tree:
        """The tree of the next step over R rows (depth 0: a plain step); a choice made while the last plain
        step ran (and not launched) is used first. A drafting tree whose graphs are still compiling in the
        background (:attr:`compiling`) gives way to a plain step."""
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen[0] == R:
            tree = chosen[1]
        elif not self.speculative:
            return chain(0)
        elif self.policy is not None:
            busy = [b for b in range(R) if self.slots[b] is not None]
            synced = float(np.mean(self.state.synced[busy])) if busy else 1.0
            tree = self.choices[self.policy.choose(R, synced)]
        else:
            tree = self.tree_for(self.active) or self.gen.tree
        return chain(0) if tree.depth and self.compiling and self._step_key(R, tree) in self.compiling else tree

    def _step_key(self, R: int, tree: Tree) -> StepKey:
        """The key of a step of ``tree`` over the first R rows now (:func:`peagle_jax.spec.plan.step_keys`)."""
        live = np.array([s is not None for s in self.slots[:R]])
        window = self.gen.verify_window(self.state.q[:R][live], tree)
        return StepKey(R, tree, window, greedy_graph(self.temperature[:R][live]))

    def adopt_times(self, calibrated: AdaptiveK) -> None:
        """Hand over step times calibrated by another engine (the background warm-up's :meth:`shadow`); this
        engine's thread adopts those it has not measured itself at its next step. Thread-safe."""
        self._times = calibrated

    def _lazy(self, R: int) -> bool:
        """Whether plain steps over R rows leave the drafter behind (see :attr:`lazy`): drafting does not pay."""
        return self.lazy and not self.policy.pays(R)

    def _valid(self, launched: Launched) -> np.ndarray:
        """The rows of a launched step whose token counts: live at launch and still holding that request."""
        return np.array(
            [
                rid is not None and self.slots[b] is not None and self.slots[b].request.id == rid
                for b, rid in enumerate(launched.ids)
            ]
        )

    def _wants(self, valid_R, live) -> np.ndarray:
        """The busy slots that want a token after those of a launched step (``valid_R``: its rows that gain
        one, :meth:`_valid`); the rows it ends by length do not."""
        gains = np.zeros(self.B, bool)
        gains[: len(valid_R)] = valid_R
        left = [s.request.max_new_tokens - s.produced if s is not None else 0 for s in self.slots]
        return np.array([live[b] and gains[b] < left[b] for b in range(self.B)])

    def _launch(self, live_R, root=None) -> Launched:
        """Launch a plain step over the first R = ``len(live_R)`` rows without waiting for it; ``root`` [R]:
        the tokens to feed (on the device), by default the host's."""
        gen, R = self.gen, len(live_R)
        sampling, seeds = self._sampling(R)
        greedy_only = greedy_graph(self.temperature[:R][live_R])
        ids = [self.slots[b].request.id if live_R[b] else None for b in range(R)]
        if self.speculative:
            launched, self.cache, self.dcache = gen.launch_plain(
                self.cache, self.dcache, self.state, seeds, sampling, greedy_only, live_R, root, self._lazy(R),
                rules=self._plain_rules(live_R),
            )  # fmt: skip
            launched.ids = ids
        else:
            t0 = time.perf_counter()
            positions = self.positions[:R]
            next_R, self.cache, *lp = decode_step(
                gen.params,
                self.cache,
                host_copy(self.pending[:R]) if root is None else root,
                host_copy(positions),
                seeds,
                sampling,
                cfg=gen.cfg,
                greedy_only=greedy_only,
                window=gen.window(int(positions[live_R].max()) + 1),
                logprobs=self.logprobs,
                rules=self._plain_rules(live_R),
            )
            positions += live_R.astype(np.int32)  # in place: the first R of self.positions
            launched = Launched(next_R, np.array(live_R, bool), t0, ids=ids, logprobs=lp[0] if lp else None)
        self._count(launched.tokens, np.ones(R, np.int32), live_R)
        self.steps_by_k[0] = self.steps_by_k.get(0, 0) + 1
        return launched

    def _read(self, launched: Launched, record: bool, valid=None, next_R=None) -> list[SlotEvent]:
        """Read a launched plain step's tokens, commit them for its valid rows (:meth:`_valid`, unless given)
        and emit their events; its time goes to the policy (:meth:`_record`)."""
        next_R = np.asarray(launched.tokens) if next_R is None else next_R
        now = time.perf_counter()
        valid = self._valid(launched) if valid is None else valid
        if self.speculative:
            self.state.commit_plain(next_R, launched.at, valid)
            self.gen.spec.verify_s += launched.device_seconds(self._t_read, now)
        else:
            self.pending[: launched.R] = np.where(valid, next_R, self.pending[: launched.R])
        self._record(launched.R, 0, now, learn=record)
        lp = None if launched.logprobs is None else host_logprobs(launched.logprobs, 1)
        return [
            self._emit(b, next_R[b : b + 1], None if lp is None else row_logprobs(lp, b, 1))
            for b in np.flatnonzero(valid)
        ]

    def _record(self, R: int, k: int, now: float, counts=(), *, learn: bool = True) -> None:
        """A step of ``k`` over R rows was read at ``now``: the policy learns the time since the last read
        (every step length alike: the host's work between steps, e.g. handing out events, is part of each
        step's period; an overlapped plain step runs during it), unless a request was admitted in between
        (a prefill: then only the acceptance ``counts`` are learnt)."""
        if learn and self.policy is not None:
            self.policy.record(R, k, now - self._t_read if self._t_admit < self._t_read else None, counts)
        self._t_read = now

    def _speculative_step(self, live, R: int, tree: Tree, record: bool) -> list[SlotEvent]:
        """A draft -> verify step of ``tree`` over the first R rows, read at once."""
        sampling, seeds = self._sampling(R)
        greedy_only = greedy_graph(self.temperature[live])
        tokens, count, k, self.cache, self.dcache = self.gen.run_step(
            self.cache, self.dcache, self.state, seeds, sampling, greedy_only=greedy_only, live=live[:R], tree=tree,
            rules=self._tree_rules(live[:R], tree),
        )  # fmt: skip
        self._count(tokens, count, live[:R])
        grammar_rows = self._grammar_rows(live[:R])
        self.structured["target_forwards"] += len(grammar_rows)
        self.structured["emitted"] += int(count[grammar_rows].sum())
        # The policy learns the acceptance of synced rows only: the others drafted from a stale context.
        self._record(R, k, time.perf_counter(), count[live[:R] & self.state.synced[:R]], learn=record)
        self.steps_by_k[k] = self.steps_by_k.get(k, 0) + 1
        lp = self.gen.step_logprobs if self.logprobs else None
        return [
            self._emit(b, tokens[b, : int(count[b])], None if lp is None else row_logprobs(lp, b, int(count[b])))
            for b in np.flatnonzero(live)
        ]

    # -- compilation -------------------------------------------------------------------------------------

    def warmup_tasks(self) -> list[WarmTask]:
        """Every graph a request can reach, as warm-up tasks in the order requests are likely to need them
        (small windows, few rows and plain steps first): the 1-row admission of each prefill length bucket
        (greedy; where the first-token sampler has a sampling variant, one sampled admission too) and the
        step of every (row bucket, step tree, attention window, sampling mode: see
        :func:`peagle_jax.sampling.greedy_modes`)."""
        gen = self.gen
        chunk = gen.prefill_buckets[-1]
        starts = range(0, gen.max_seq_len - 1, chunk)
        lengths = sorted({min(start + T, gen.max_seq_len - 1) for start in starts for T in gen.prefill_buckets})
        trees = serving_trees(
            gen.tree if self.speculative else None,
            adaptive=self.policy is not None,
            chains=self._chains,
            load_trees=[t for _, t in self.load_trees],
        )
        keys = step_keys(self.row_buckets, trees, gen.window_buckets, greedy_modes())
        admits = [Admit(n) for n in lengths] + [Admit(lengths[0], 1.0)] * (len(greedy_modes()) - 1)

        def order(task: WarmTask):
            if isinstance(task, Admit):
                return gen.window(task.length), 1, 0, task.temperature > 0
            return task.window, task.rows, task.tree.depth > 0, not task.greedy_only

        return sorted([*admits, *keys], key=order)  # stable: admissions by length, keys as step_keys lists them

    def warmup(self, progress=None, tasks: Sequence[WarmTask] | None = None, *, calibrate: bool = True) -> float:
        """Compile ``tasks`` (default every :meth:`warmup_tasks`) and the small graphs around them (the slot
        copy, the root merge of an overlapped plain step); with the adaptive policy and ``calibrate``, then
        time every step length at every row bucket (:meth:`AdaptiveK.calibrate_all`). A step key leaves
        :attr:`compiling` once compiled. ``progress(done, total)`` is called as it goes. Returns the seconds
        spent."""
        t0 = time.perf_counter()
        gen = self.gen
        tasks = self.warmup_tasks() if tasks is None else list(tasks)
        calibration = len(self.row_buckets) * len(self.choices) * CALIBRATION_STEPS if self.policy and calibrate else 0
        total = len(tasks) + calibration  # the calibration's timed steps compile nothing: not in the budget
        budget = MapBudget(len(tasks), f"{self.B} slots x {gen.max_seq_len} tokens ({self.describe()})")
        done = 0
        # Every row keeps its drafter current meanwhile, so that the flushes compile too (a warm-up that
        # fails leaves the engine unserved: the worker reports it and takes no request).
        lazy, self.lazy = self.lazy, False

        def advance():
            nonlocal done
            done += 1
            if done <= len(tasks):
                budget.check(done)
            if progress:
                progress(done, total)

        for rows in self.row_buckets:  # the root merge of an overlapped plain step (admissions since its launch)
            merge_roots(*(jnp.zeros(rows, dt) for dt in (bool, np.int32, np.int32)))
            for P in sorted({1, gen.K + 1} if self.speculative else {1}) if self.rules else ():
                self.counts = count_tokens(self.counts, jnp.zeros((rows, P), jnp.int32), np.zeros(rows, np.int32))
        for task in tasks:
            if isinstance(task, Admit):
                ev = self.admit(SlotRequest([0] * task.length, 1, temperature=task.temperature, stop_token_ids=[]))
                assert ev.finish_reason == "length"
            else:  # one live row (the last of the row bucket) placed so that the step's window is the key's
                self._warm_step(task.window, 0.0 if task.greedy_only else 1.0, task.tree, slot=task.rows - 1)
                self.compiling.discard(task)
            advance()
        if self.policy is not None:  # the steps above compiled: their times and acceptance mean nothing
            self.policy = adaptive_policy(gen.tree, self._chains)
            for rows in self.row_buckets if calibrate else ():
                self.policy.calibrate_all(rows, lambda k, r=rows: self._time_step(self.choices[k], slot=r - 1), advance)
        if self.speculative:
            gen.spec.reset()  # in place: the server's /metrics reads this object
        self.steps_by_k.clear()
        self.structured.update(dict.fromkeys(self.structured, 0))  # in place: /metrics reads this dict
        self.overlapped = self.resyncs = self.unsynced_admits = 0
        self.lazy = lazy
        self.reset()
        return time.perf_counter() - t0

    def shadow(self) -> SlotEngine:
        """An engine of the same shapes and graphs with its own caches, statistics and policy, sharing this
        one's :attr:`compiling` set: its :meth:`warmup` compiles, on another thread, the graphs this engine
        then calls without compiling (the jit caches are shared). It holds a second set of caches."""
        gen = copy.copy(self.gen)
        gen.stats = StepStats()
        if self.speculative:
            gen.spec = SpecStats(accepted_per_position=[0] * gen.K)
        twin = SlotEngine(
            gen, self.B, load_k=self._load_k, adaptive=self._adaptive, chains=self._chains, logprobs=self.logprobs,
            grammars=self.grammars,
            rules=self.rules,
        )  # fmt: skip
        twin.overlap, twin.compiling = self.overlap, self.compiling
        return twin

    def _time_step(self, tree: Tree, slot: int) -> float:
        """Seconds of one compiled greedy step drafting ``tree`` (depth 0: a plain step) with one busy slot
        (``slot``: the row bucket) in the smallest window. The adaptive policy starts from these times, so
        the first requests at each load do not pay for measuring the slower step lengths (the times are
        refined by every step served; the acceptance is learnt from traffic only)."""
        gen, b, s = self.gen, slot, self.state
        self.slots[b] = _Slot(SlotRequest([0], 1 << 30, temperature=0.0, stop_token_ids=[]), frozenset())
        self._device_params = {}
        q = max(gen.window_buckets[0] - gen.tree.size - 1, 1)
        s.q[b], s.ctx_start[b], s.ctx_count[b] = q, q - 1, 1  # one queued context element: no flush
        t0 = time.perf_counter()
        self.step(tree)
        seconds = time.perf_counter() - t0
        self._release(b)
        return seconds

    def _warm_step(self, w: int, temperature: float, tree: Tree | None = None, slot: int = 0) -> None:
        """One step with a single busy slot (``slot``, which sets the row bucket) placed so that the step's
        window is ``w``."""
        gen, b = self.gen, slot
        req = SlotRequest([0], 1 << 30, temperature=temperature, stop_token_ids=[])
        self.slots[b] = _Slot(req, frozenset())
        self.temperature[b] = temperature
        self._device_params = {}
        if not self.speculative:
            self.positions[b] = w - 1
            self.step(chain(0))
        else:
            s, tree = self.state, tree or gen.tree
            lower = max((x for x in gen.window_buckets if x < w), default=0)
            # q at the top and the bottom of the bucket, ctx_start up to K + 1 behind q: every draft window
            # a step with verify window w can meet (the fused graph compiles per pair). A plain step runs
            # with a full queue, so that it also compiles make_room's drafter write for this window.
            for q in sorted({max(w - tree.size - 1, 1), max(lower - tree.size, 1)}):
                for start in sorted({max(q - 1 - gen.K, 0), q - 1}):
                    count = gen.Q if tree.depth == 0 else 1
                    s.q[b], s.ctx_start[b], s.ctx_count[b] = q, max(q - count, 0) if tree.depth == 0 else start, count
                    self.step(tree)
        self._release(b)
