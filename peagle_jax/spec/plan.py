"""The graphs a decoding setup calls, listed in one place.

Every device graph is one jitted entry point at one shape bucket, so which graphs a setup can call follows
from its configuration alone: the rows of a step (the batch buckets of the batch generators, the row
buckets of the serving engine), the step trees (the drafted tree; with the adaptive step length also the
plain step it also picks, :func:`peagle_jax.spec.adaptive.step_trees`; a plain step is ``chain(0)``),
the attention windows a context reaches, the sampling modes (:func:`peagle_jax.sampling.greedy_modes`) and
the prefill chunks. This module enumerates them; its callers turn each key into graphs:

- the warm-ups run each key once on scratch inputs (:meth:`peagle_jax.engine.generator.Generator.warmup`,
  :meth:`peagle_jax.spec.generator.SpeculativeGenerator.warmup`, :meth:`peagle_jax.serve.slots.SlotEngine.warmup`);
- ``python -m peagle_jax.neuron export`` builds each key's graphs with abstract inputs
  (:mod:`peagle_jax.neuron.graphs`) and exports them.

The attention window of every graph follows one rule, :class:`Windows`: the bucket covering the highest cache
slot the graph reads or writes. Its inverses (the highest root position or context start whose graph lands in
a given window) are next to it, so the warm-ups place a scratch step in the window they compile instead of
inverting the rule by hand.

A step key stands for the graphs one step calls: the plain decode step (no drafter) or the plain step inside
speculative decoding (depth 0), else the draft at every draft window the step can meet, the verify (or the
fused draft + verify) and the context write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from peagle_jax.engine.buckets import bucket
from peagle_jax.spec.adaptive import step_trees
from peagle_jax.spec.tree import Tree, chain


@dataclasses.dataclass(frozen=True)
class StepKey:
    """One step's graphs: over ``rows`` rows (a batch or row bucket), drafting ``tree`` (depth 0: a plain
    step), at attention window ``window`` (of the verify, or of the decode step), greedy-only or not."""

    rows: int
    tree: Tree
    window: int
    greedy_only: bool


@dataclasses.dataclass(frozen=True)
class Windows:
    """The window rule of a decoder with window ``buckets`` (the top one the whole cache), drafting ``K`` deep
    over ``Q`` queued context slots (plain decoding: K = 0, Q = 1). Each ``*_window`` takes the rows' positions
    (host arrays or ints; the highest counts) and returns the bucket; each inverse takes a window and returns
    the highest such position whose graph lands in it."""

    buckets: tuple[int, ...]
    K: int = 0
    Q: int = 1

    def of(self, context: int) -> int:
        """The bucket covering ``context`` cache slots."""
        return bucket(context, self.buckets)

    def below(self, w: int) -> int:
        """The next smaller bucket than ``w`` (0 for the smallest)."""
        return max((x for x in self.buckets if x < w), default=0)

    def plain_window(self, q) -> int:
        """A plain step feeding roots at ``q``: it writes slot q."""
        return self.of(int(np.max(q, initial=0)) + 1)

    def verify_window(self, q, tree: Tree) -> int:
        """A verify of ``tree`` with roots at ``q``: the root and the tree nodes from q."""
        return self.of(int(np.max(q, initial=0)) + tree.size + 1)

    def draft_window(self, start) -> int:
        """A draft whose context starts at ``start``: up to K + 1 context elements and K - 1 mask slots past
        them, with room to spare (2K + 1)."""
        return self.of(int(np.max(start, initial=0)) + 2 * self.K + 1)

    def flush_window(self, start) -> int:
        """A write of the Q queued context elements from ``start`` into the drafter cache."""
        return self.of(int(np.max(start, initial=0)) + self.Q)

    def prefill_window(self, start: int, T: int) -> int:
        """A prefill chunk of T tokens from ``start``."""
        return self.of(start + T)

    def plain_q(self, w: int) -> int:
        return max(w - 1, 0)

    def verify_q(self, w: int, tree: Tree) -> int:
        return max(w - tree.size - 1, 0)

    def draft_start(self, w: int) -> int:
        return max(w - 2 * self.K - 1, 0)

    def flush_start(self, w: int) -> int:
        return max(w - self.Q, 0)


def step_keys(
    rows: Iterable[int], trees: Sequence[Tree], windows: Sequence[int], greedy_modes: Sequence[bool]
) -> list[StepKey]:
    """Every combination, rows outermost, then trees, windows and sampling modes."""
    return [StepKey(r, t, w, g) for r in rows for t in trees for w in windows for g in greedy_modes]


def serving_trees(
    tree: Tree | None, *, adaptive: bool = False, load_trees: Sequence[Tree] = (), chains: Sequence[int] | None = None
) -> list[Tree]:
    """The step trees a decoder runs: plain decoding (``tree`` None) only plain steps; a speculative one its
    tree and any trees it switches to under load; with the adaptive step length every step length it picks
    from (plain, the tree and any ``chains``: :func:`peagle_jax.spec.adaptive.step_trees`)."""
    if tree is None:
        return [chain(0)]
    if adaptive:
        return list(step_trees(tree, chains).values())
    return list(dict.fromkeys([tree, *load_trees]))


def windows_up_to(window_buckets: Sequence[int], context: int) -> list[int]:
    """The windows a context of up to ``context`` slots can use: every bucket up to the one covering it."""
    top = bucket(context, window_buckets)
    return [w for w in window_buckets if w <= top]


def windows_between(window_buckets: Sequence[int], first: int, last: int) -> list[int]:
    """The windows of contexts from ``first`` to ``last`` slots (both included)."""
    lo, hi = bucket(first, window_buckets), bucket(last, window_buckets)
    return [w for w in window_buckets if lo <= w <= hi]


def prefill_keys(prefill_buckets: Sequence[int], window_buckets: Sequence[int], max_len: int) -> list[tuple[int, int]]:
    """(chunk bucket T, window) pairs a prefill of prompts up to ``max_len`` tokens can call: prompts go in
    chunks of the largest bucket, the last padded to a bucket, each at the window covering its end."""
    chunk = prefill_buckets[-1]
    pairs = {(T, bucket(start + T, window_buckets)) for start in range(0, max_len, chunk) for T in prefill_buckets}
    return sorted(pairs)
