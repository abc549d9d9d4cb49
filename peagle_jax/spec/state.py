"""Host state between speculative steps: each row's committed length, root and queued draft context
(:class:`SpecState`), the counters of a run (:class:`SpecStats`), and the context and cache sizes a step
needs."""

from __future__ import annotations

import dataclasses

import numpy as np

from peagle_jax.engine.state import RowState
from peagle_jax.spec.tree import Tree

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
class SpecState(RowState):
    """Per-row host state between speculative steps (B rows, Q >= K + 1 context slots, see :func:`queue_slots`).

    ``q`` is the position of each row's root (its last committed token, not yet in the target cache) and
    ``root`` that token; the drafter's next context is the ``ctx_count`` elements committed since the last
    draft or flush (``ctx_tokens`` [B, Q]; their target aux states are on the device, in the stepper's
    :class:`~peagle_jax.spec.stepper.DraftState`), the first at
    drafter position ``ctx_start`` (``q - ctx_count``); a draft reads the first K + 1 slots (a flush
    first where more are queued). A row that is not live keeps its state, so it idles in place.

    ``synced`` [B]: whether the row's drafter cache holds its whole committed context. A row the slot engine
    decodes plainly under load may skip the drafter's work (:meth:`desync`); its drafts are then guesses
    from a stale context, which verification makes harmless (outputs never depend on the drafts) but which
    are not accepted often, so the engine's policy does not learn from them and counts only synced rows.
    """

    ctx_tokens: np.ndarray
    ctx_count: np.ndarray
    ctx_start: np.ndarray
    synced: np.ndarray

    @classmethod
    def start(cls, first_B, lengths_B, Q: int) -> SpecState:
        """After the prefill: one context element per row (the first token; its aux state, the last prompt
        position's, is the drafter state's: :meth:`peagle_jax.spec.stepper.SpecStepper.context_aux`) in Q
        context slots, at drafter position ``length - 1``; the root is the first token at ``length``."""
        B = len(first_B)
        ctx_tokens = np.zeros((B, Q), np.int32)
        ctx_tokens[:, 0] = first_B
        lengths = np.asarray(lengths_B, np.int32)
        first = np.asarray(first_B).copy()
        return cls(lengths.copy(), first, ctx_tokens, np.ones(B, np.int32), lengths - 1, np.ones(B, bool))

    def rows(self, R: int) -> SpecState:
        """The first R rows (views of the host arrays)."""
        if R == len(self.q):
            return self
        s = self
        views = (s.q, s.root, s.ctx_tokens, s.ctx_count, s.ctx_start, s.synced)
        return SpecState(*(x[:R] for x in views))

    def seed(self, b: int, length: int, first: int, *, synced: bool = True) -> None:
        """Row b after a prefill of ``length`` tokens whose next token is ``first``: one queued context
        element (``first``, paired with the aux state of the last prompt position, which the caller writes
        into the drafter state), at drafter position ``length - 1``. ``synced``: the drafter saw the prompt."""
        self.ctx_tokens[b] = 0
        self.ctx_tokens[b, 0] = first
        self.ctx_count[b], self.ctx_start[b], self.q[b], self.root[b] = 1, length - 1, length, first
        self.synced[b] = synced

    def release(self, b: int) -> None:
        """Row b is free: it idles at position 1 with one queued element (a draft reads at least one)."""
        self.ctx_count[b], self.ctx_start[b], self.q[b], self.root[b] = 1, 0, 1, 0

    def advance(self, tokens_RC, count_R, live_R) -> None:
        """Commit a draft -> verify step's output for the live rows among the first R (= ``len(count_R)``);
        the others stay in place. ``tokens_RC``: the emitted tokens padded to the C = K + 1 slots a draft
        reads. The verify's aux states go into the drafter state on the device, by the stepper
        (:meth:`peagle_jax.spec.stepper.SpecStepper.run_step`)."""
        R, live_R = len(count_R), np.asarray(live_R, bool)
        self.ctx_start[:R] = np.where(live_R, self.q[:R], self.ctx_start[:R])
        self.q[:R] += np.where(live_R, count_R, 0).astype(np.int32)
        last_R = tokens_RC[np.arange(R), np.maximum(count_R - 1, 0)]
        self.root[:R] = np.where(live_R, last_R, self.root[:R])
        C = tokens_RC.shape[1]
        self.ctx_tokens[:R, :C] = np.where(live_R[:, None], tokens_RC, self.ctx_tokens[:R, :C])
        self.ctx_count[:R] = np.where(live_R, count_R, self.ctx_count[:R])

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
