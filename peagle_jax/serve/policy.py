"""What the serving engine's next step runs: a plain step or a drafted tree, and how much drafter work it keeps.

:class:`StepPolicy` holds every rule that picks a step's length:

- fixed load thresholds (``--load-k n:K'``: with at least n busy slots a chain of K'), or the adaptive policy
  (:class:`peagle_jax.spec.adaptive.AdaptiveK`: plain, the drafted tree or a chain, whichever was measured
  fastest at the current row bucket), which learns from the step times :meth:`StepPolicy.record` hands it;
- the lazy drafter: with the adaptive policy, where drafting does not pay, a request is admitted without the
  drafter prefill and a row's queued draft context is dropped when full (:meth:`StepPolicy.lazy_at`); when
  drafting pays again, one row per step is re-seeded (:meth:`StepPolicy.resync_row`);
- compiling while serving: a drafting step whose graphs still compile in the background
  (:attr:`StepPolicy.compiling`) gives way to a plain step where plain steps are served (the adaptive policy,
  a load threshold of K' = 0); outputs never change, only the speed.

A plain engine (no drafter) always runs plain steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from peagle_jax.engine.generator import RequestError
from peagle_jax.spec.adaptive import AdaptiveK, adaptive_policy, step_trees
from peagle_jax.spec.plan import serving_trees
from peagle_jax.spec.tree import Tree, chain


class StepPolicy:
    """The step-length rules of one engine over ``gen`` (see the module docstring). ``load_k``: (n, K') pairs;
    ``adaptive``: pick by measured throughput among plain, the generator's tree and a chain of each length in
    ``chains``; the two exclude each other and need a drafter (``speculative``)."""

    def __init__(
        self, gen, *, speculative: bool, load_k: Sequence[tuple[int, int]] = (), adaptive: bool = False, chains=None
    ):
        if (load_k or adaptive) and not speculative:
            raise RequestError("a smaller K under load needs a drafter")
        if load_k and adaptive:
            raise RequestError("choose either fixed load thresholds or the adaptive K, not both")
        self.speculative, self.tree = speculative, gen.tree if speculative else None
        self.chains = getattr(gen, "chains", None) if chains is None and speculative else chains
        self.load_k = tuple(load_k)
        self.load_trees: list[tuple[int, Tree]] = []
        for n, k in sorted(load_k):
            if n < 1 or not 0 <= k <= gen.K:
                raise RequestError(
                    f"load K {n}:{k}: need at least 1 active slot and 0 <= K' <= K = {gen.K} (the depth of "
                    f"{gen.tree.describe()})"
                )
            self.load_trees.append((n, chain(k)))
        try:  # the step lengths the adaptive policy picks from: K' -> its tree
            self.choices = step_trees(gen.tree, self.chains) if adaptive else {}
        except ValueError as err:
            raise RequestError(str(err)) from None
        self.adaptive: AdaptiveK | None = adaptive_policy(gen.tree, self.chains) if adaptive else None
        self.lazy = adaptive
        # A re-seed costs about a prefill of the row's tokens (at 16 busy rows on a CPU, about two plain
        # steps), and where drafting pays it saves a fraction of a plain step per token: only a row with this
        # many tokens left is re-seeded (in a 16-client benchmark of 48-token requests, re-seeding rows with
        # 16 or more left cost about a tenth of the throughput).
        self.resync_min_left = 64
        # The step keys whose graphs still compile in the background: a drafting step among them runs a plain
        # step instead. Another thread removes keys as they compile.
        self.compiling: set = set()  # of warm-up tasks (StepKey, peagle_jax.serve.warmup.Admit)
        # The engine's thread never compiles one of those: a step or an admission that needs one waits (see
        # :meth:`ready`) and asks for it through ``on_missing(task)`` (the server's background compiler then
        # takes it next), so that the thread stays free to take cancellations. ``waiting_for``: the task
        # waited for, else None.
        self.on_missing = None
        self.waiting_for = None
        self._times: AdaptiveK | None = None  # step times calibrated elsewhere, adopted on the next step
        # Whether plain steps are among the steps served (their graphs warm-up tasks): only then does a
        # drafting step still compiling give way to one (else it waits for its graphs, compiling nothing).
        self.plain_served = chain(0) in self.trees()
        self.reset()

    def reset(self) -> None:
        self._chosen: tuple[int, Tree] | None = None  # (rows, tree) chosen while a plain step ran
        self.last_read = self._t_admit = 0.0  # when a step's tokens were last read; when a request was admitted

    def fresh_adaptive(self) -> None:
        """Forget every time and acceptance measured (after a warm-up, whose steps compiled)."""
        if self.adaptive is not None:
            self.adaptive = adaptive_policy(self.tree, self.chains)

    def describe(self) -> str:
        """One line on how steps decode: for the server's start-up message."""
        if not self.speculative:
            return "plain (no drafter)"
        tree = self.tree.describe()
        if self.adaptive is not None:
            ks = "/".join(str(k) for k in self.adaptive.candidates)
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

    def trees(self) -> list[Tree]:
        """Every step tree this policy can pick (:func:`peagle_jax.spec.plan.serving_trees`)."""
        return serving_trees(
            self.tree,
            adaptive=self.adaptive is not None,
            chains=self.chains,
            load_trees=[t for _, t in self.load_trees],
        )

    # -- choosing ----------------------------------------------------------------------------------------

    def adopt_times(self, calibrated: AdaptiveK) -> None:
        """Hand over step times calibrated by another engine (the background warm-up's shadow); adopted at
        the next :meth:`take_times`. Thread-safe."""
        self._times = calibrated

    def take_times(self) -> None:
        """Adopt the step times handed over since the last step (on the engine's thread)."""
        times, self._times = self._times, None
        if times is not None and self.adaptive is not None:
            self.adaptive.adopt(times)

    def tree_for(self, active: int) -> Tree | None:
        """The load threshold's tree with ``active`` slots busy (None: the generator's own tree)."""
        tree = None
        for n, t in self.load_trees:
            if active >= n:
                tree = t
        return tree

    def choose(self, R: int, *, active: int, synced: float, key_of) -> Tree:
        """The tree of the next step over R rows (depth 0: a plain step) with ``active`` busy slots of which a
        fraction ``synced`` keeps its drafter current; a choice :meth:`remember`-ed for R is used first. A
        drafting tree whose step key (``key_of(tree)``) still compiles gives way to a plain step where plain
        steps are served (:attr:`plain_served`)."""
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen[0] == R:
            tree = chosen[1]
        elif not self.speculative:
            return chain(0)
        elif self.adaptive is not None:
            tree = self.choices[self.adaptive.choose(R, synced)]
        else:
            tree = self.tree_for(active) or self.tree
        compiling = tree.depth and self.compiling and key_of(tree) in self.compiling
        return chain(0) if compiling and self.plain_served else tree

    def remember(self, R: int, tree: Tree) -> None:
        """Keep a choice made while a plain step ran (and not launched on it) for the next step over R rows."""
        self._chosen = (R, tree)

    def missing(self, tasks) -> list:
        """Those of ``tasks`` still compiling in the background."""
        compiling = self.compiling
        return [t for t in tasks if t in compiling] if compiling else []

    def ready(self, tasks) -> bool:
        """Whether the graphs of ``tasks`` are compiled; if not, the missing ones are asked for (the first
        named first) and :attr:`waiting_for` names the first."""
        missing = self.missing(tasks)
        self.waiting_for = missing[0] if missing else None
        for task in reversed(missing) if self.on_missing is not None else ():
            self.on_missing(task)
        return not missing

    # -- the lazy drafter --------------------------------------------------------------------------------

    def lazy_at(self, R: int) -> bool:
        """Whether plain steps over R rows leave the drafter behind: drafting does not pay there."""
        return self.lazy and not self.adaptive.pays(R)

    def sync_admission(self, R: int) -> bool:
        """Whether a request admitted with R rows busy gets the drafter prefill: where drafting pays, or where
        an exploration is due (it measures the acceptance on this row, so a low estimate can still recover)."""
        return not self.lazy or self.adaptive.pays(R) or self.adaptive.explore_due(R)

    def resync_row(self, R: int, left: dict[int, int], synced) -> int | None:
        """The unsynced busy row among the first R to re-seed now, where drafting pays at R: of ``left`` (busy
        row -> tokens it may still generate), the one with the most left, if at least :attr:`resync_min_left`.
        ``synced`` [B]: whether each row's drafter is current."""
        if not self.lazy or synced[:R].all() or not self.adaptive.pays(R):
            return None
        left = {b: n for b, n in left.items() if b < R and not synced[b]}
        b = max(left, key=left.get, default=None)
        return b if b is not None and left[b] >= self.resync_min_left else None

    # -- learning ----------------------------------------------------------------------------------------

    def admitted(self) -> None:
        """A prefill ran (an admission or a re-seed): the next step's time is not a step time."""
        self._t_admit = time.perf_counter()

    def record(self, R: int, k: int, now: float, counts=(), *, learn: bool = True) -> None:
        """A step of ``k`` over R rows was read at ``now``: the policy learns the time since the last read
        (every step length alike: the host's work between steps, e.g. handing out events, is part of each
        step's period; an overlapped plain step runs during it), unless a request was admitted in between
        (a prefill: then only the acceptance ``counts`` are learnt)."""
        if learn and self.adaptive is not None:
            seconds = now - self.last_read if self._t_admit < self.last_read else None
            self.adaptive.record(R, k, seconds, counts)
        self.last_read = now
