"""The per-slot request parameters of the serving engine: sampling, seeds, penalties, logit biases and grammar
state, as host arrays over the B slots and the device copies a step over the first R rows reads.

A slot's entries are set when a request is admitted (:meth:`SlotRows.admit`) and cleared when it leaves
(:meth:`SlotRows.clear`); a free slot keeps greedy defaults, so it never makes a step's graph a sampling one.
With ``rules`` (penalties, logit biases, grammars: :mod:`peagle_jax.logit_rules`) every step takes the first R
rows' :class:`~peagle_jax.logit_rules.LogitRules`; the generated-token counts and biases stay on the device
(``[B, V]``), and a row with a grammar gets its masks from its :class:`~peagle_jax.grammar.Constraint` on the
host: before a plain step its state now, before a draft -> verify step the mask of every tree node after its
own drafted path.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from peagle_jax.engine.generator import RequestError
from peagle_jax.engine.state import host_copy
from peagle_jax.grammar import Constraint, Grammars
from peagle_jax.logit_rules import LogitRules, check_penalties, count_tokens, mask_words, start_row
from peagle_jax.sampling import SamplingParams, check_sampling_args, greedy_graph
from peagle_jax.spec.tree import Tree


class SlotRows:
    """Request parameters of B slots (see the module docstring). ``vocab``: the target's vocabulary size."""

    def __init__(self, B: int, vocab: int, *, rules: bool = False, grammars: Grammars | None = None):
        self.B, self.vocab = B, vocab
        self.rules, self.grammars = rules or grammars is not None, grammars
        self.temperature = np.zeros(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.top_p = np.ones(B, np.float32)
        self.seeds = np.zeros(B, np.uint32)
        self.presence = np.zeros(B, np.float32)
        self.frequency = np.zeros(B, np.float32)
        self.penalized = np.zeros(B, bool)  # the slot's request has penalties or a logit bias
        self.constrained = np.zeros(B, bool)  # the slot's request has a grammar
        self.constraints: list[Constraint | None] = [None] * B  # its grammar state
        self.grammar_drafting = True  # a constrained row's drafts are replaced by the best its grammar allows
        self.grammar_s = 0.0  # host seconds in grammar masks and grammar-aware drafting
        self._device: dict[int, tuple] = {}  # per row count R: device copies, kept until a row changes
        self._free_masks: dict[tuple[int, int], tuple] = {}  # all-ones masks and no drafts per (R, nodes)
        self.reset()

    def reset(self) -> None:
        """Fresh device counts and biases (every row starts over at admission anyway)."""
        if self.rules:
            self.counts = jnp.zeros((self.B, self.vocab), jnp.int32)
            self.bias = jnp.zeros((self.B, self.vocab), jnp.float32)

    def check(self, req) -> None:
        """Raise :class:`RequestError` where ``req``'s parameters cannot be served."""
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
                check_penalties(req.presence_penalty, req.frequency_penalty, req.logit_bias, self.vocab)
            except ValueError as err:
                raise RequestError(str(err)) from None

    # -- one slot ----------------------------------------------------------------------------------------

    def first_rules(self, req) -> tuple[LogitRules | None, Constraint | None, np.ndarray | None]:
        """The rules of ``req``'s first token (no generated tokens yet: its bias and its grammar's start), its
        grammar state and its bias over the vocabulary; (None, None, None) without :attr:`rules`."""
        if not self.rules:
            return None, None, None
        V = self.vocab
        bias_V = np.zeros(V, np.float32)
        for tok, value in (req.logit_bias or {}).items():
            bias_V[int(tok)] = value
        constraint = None if req.grammar is None else self.grammars.constraint(req.grammar)
        allowed = np.full((1, 1, mask_words(V)), -1, np.int32)
        if constraint is not None:
            constraint.mask(allowed[0, 0])
        flags = [np.asarray([x], dt) for x, dt in ((req.presence_penalty, np.float32),
                 (req.frequency_penalty, np.float32), (req.penalized, bool))]  # fmt: skip
        rules = LogitRules(
            *flags, bias_V[None], np.zeros((1, V), np.int32), allowed, np.asarray([constraint is not None]),
            np.zeros((1, 0), np.int32),
        )  # fmt: skip
        return rules, constraint, bias_V

    def admit(self, b: int, req, first: int, constraint: Constraint | None, bias_V) -> None:
        """Slot b now serves ``req``, whose first token is ``first`` (it starts the row's token counts)."""
        self.temperature[b], self.top_k[b], self.top_p[b] = req.temperature, req.top_k, req.top_p
        self.seeds[b] = np.uint32(req.seed & 0xFFFFFFFF)
        self.presence[b], self.frequency[b] = req.presence_penalty, req.frequency_penalty
        self.penalized[b] = req.penalized
        if self.rules:
            self.counts, self.bias = start_row(self.counts, self.bias, jnp.int32(b), jnp.int32(first), bias_V)
            self.constraints[b], self.constrained[b] = constraint, constraint is not None
        self._device = {}

    def set_temperature(self, b: int, temperature: float) -> None:
        """A warm-up's scratch row: only its sampling mode matters."""
        self.temperature[b] = temperature
        self._device = {}

    def clear(self, b: int) -> None:
        """Slot b is free: greedy, no penalties, no grammar."""
        self.temperature[b] = 0.0
        self.presence[b] = self.frequency[b] = 0.0
        self.penalized[b] = self.constrained[b] = False
        self.constraints[b] = None
        self._device = {}

    def consume(self, b: int, token: int) -> None:
        """Row b emitted ``token``: its grammar moves on."""
        if self.constraints[b] is not None:
            self.constraints[b].consume([token])

    # -- a step over the first R rows --------------------------------------------------------------------

    def greedy_only(self, live_R) -> bool:
        """Whether a step over the live rows among the first R may use the greedy-only graph."""
        return greedy_graph(self.temperature[: len(live_R)][live_R])

    def sampling(self, R: int) -> tuple[SamplingParams, object]:
        """Device copies of the first R slots' sampling parameters and seeds (kept until a row changes)."""
        if R not in self._device:  # host copies: the host arrays change while steps may run
            self._device[R] = (
                SamplingParams(*(host_copy(x[:R]) for x in (self.temperature, self.top_k, self.top_p))),
                host_copy(self.seeds[:R]),
                tuple(host_copy(x[:R]) for x in (self.presence, self.frequency, self.penalized, self.constrained)),
            )
        return self._device[R][:2]

    def logit_rules(self, R: int, nodes: int = 1, allowed=None, drafted=None) -> LogitRules | None:
        """The first R slots' rules for a step of ``nodes`` tree nodes (None without :attr:`rules`);
        ``allowed`` [R, nodes, W] and ``drafted`` [R, nodes - 1] (host) where a row has a grammar, else every
        token allowed and nothing drafted on the host."""
        if not self.rules:
            return None
        self.sampling(R)
        presence, frequency, active, constrained = self._device[R][2]
        if allowed is None:
            key = (R, nodes)
            if key not in self._free_masks:
                self._free_masks[key] = (
                    jnp.full((R, nodes, mask_words(self.vocab)), -1, jnp.int32),
                    jnp.zeros((R, nodes - 1), jnp.int32),
                )
            allowed, drafted = self._free_masks[key]
        else:  # device arrays, as the free masks (a host array is another jit cache key)
            allowed, drafted = jnp.asarray(allowed), jnp.asarray(drafted)
        return LogitRules(presence, frequency, active, self.bias, self.counts, allowed, constrained, drafted)

    def grammar_rows(self, live_R) -> np.ndarray:
        """The rows among the first R = ``len(live_R)`` whose grammar decides this step."""
        return np.flatnonzero(self.constrained[: len(live_R)] & live_R)

    def plain_rules(self, live_R) -> LogitRules | None:
        """A plain step's rules over the first R rows: the grammar rows' masks of their state now."""
        rows = self.grammar_rows(live_R)
        if not len(rows):
            return self.logit_rules(len(live_R))
        t0 = time.perf_counter()
        allowed = np.full((len(live_R), 1, mask_words(self.vocab)), -1, np.int32)
        for b in rows:
            self.constraints[b].mask(allowed[b, 0])
        self.grammar_s += time.perf_counter() - t0
        return self.logit_rules(len(live_R), 1, allowed, np.zeros((len(live_R), 0), np.int32))

    def tree_rules(self, live_R, tree: Tree):
        """A draft -> verify step's rules over the first R rows: fixed, or, where a row has a grammar, a
        function of the drafted candidates [R, K, N] (host) that returns them with each node's mask after its
        own path and the grammar rows' node tokens (:meth:`peagle_jax.grammar.Constraint.tree_masks`)."""
        R, T = len(live_R), tree.size + 1
        rows = self.grammar_rows(live_R)
        if not len(rows):
            return self.logit_rules(R, T)

        def after_draft(drafts_RKN):
            t0 = time.perf_counter()
            allowed = np.full((R, T, mask_words(self.vocab)), -1, np.int32)
            drafted = np.zeros((R, T - 1), np.int32)
            for b in rows:
                drafted[b] = self.constraints[b].tree_masks(
                    tree, drafts_RKN[b], allowed[b], aware=self.grammar_drafting
                )
            self.grammar_s += time.perf_counter() - t0
            return self.logit_rules(R, T, allowed, drafted)

        return after_draft

    def count(self, tokens_R, n_R, live_R) -> None:
        """Add a step's tokens (``tokens_R`` [R] or [R, P], host or device; the first ``n_R`` of each row) to
        the counts, while a busy slot among the first R has penalties: the others' counts are never read (a
        row starts over at admission)."""
        if self.rules and self.penalized[: len(live_R)][live_R].any():
            tokens_RP = jnp.asarray(tokens_R if tokens_R.ndim == 2 else tokens_R[:, None])  # one jit key: device
            self.counts = count_tokens(self.counts, tokens_RP, np.asarray(n_R, np.int32))

    def warm_counts(self, rows: int, widths) -> None:
        """Compile the count update for ``rows`` rows and each token width in ``widths`` (a warm-up)."""
        for P in widths if self.rules else ():
            self.counts = count_tokens(self.counts, jnp.zeros((rows, P), jnp.int32), np.zeros(rows, np.int32))
