"""Adaptive draft length: per step, the K' (0 = a plain step) that is expected to emit the most tokens per
second, from the step times and the acceptance measured while serving.

Speculation pays only where the acceptance length exceeds the cost of a speculative step over a plain one,
and both move: the cost grows with the busy rows (a verify of B x (K'+1) tokens is compute-bound sooner than
a decode of B tokens), the acceptance with the traffic. The policy keeps, per row bucket R and candidate K':

- the step time, an exponential moving average of the measured seconds per step (the first sample of each
  (R, K') is dropped: it may include a compilation or a cold cache);
- per draft depth d, the acceptance rate given that depth d - 1 was accepted, ``p_d`` (decayed counts
  with a 0.5 prior worth ``prior_weight`` rows), shared by every K' when the candidates are chains (a
  parallel draft's depth d does not depend on K'); a tree keeps its own (``shared=False``): with several
  candidates at a depth it is accepted there more often than a chain of 1 is, and mixing the two would hide
  what the tree gains.

It chooses ``argmax_K' E(K') / time(R, K')`` with ``E(K') = 1 + sum_{d <= K'} p_1 ... p_d`` tokens per row
and step. At the first row bucket it tries every candidate in turn until each has enough timed steps; at a
later one only the shortest (the plain step), whose time is scaled by each other candidate's cost relative
to it at the nearest row bucket that timed both, until that candidate has its own times there (so learning
a new load costs a few plain steps, not a few slow ones); the engines' warm-ups record these times for every
row bucket before serving (:meth:`record` without counts). While a shorter K' wins it still runs the longest
one now and then, so that the acceptance estimate stays current: every ``explore_every`` steps times how much
slower that one is, and twice as long after each exploration that did not bring it closer to winning, up to
``max_explore_gap`` times ``explore_every`` (so a drafter that keeps losing costs ~0.2% of the steps, not
~2%); the interval starts over when an exploration narrows the gap by a quarter against the last one at the
same row bucket, or the longest K' wins. Where the longest K' would lose even with every draft accepted
(K + 1 tokens per step against the best shorter K' at its measured rate), it is not explored at all.

While a drafting K' wins, the plain step is run again every ``retime_every`` steps at that row bucket, so
that its time stays current too (the new time replaces the stale average; otherwise it would come only
from the warm-up, and a machine that got faster or slower since, or a window that grew, would keep the
policy drafting at a loss for the server's whole life). Likewise an exploration of the longest K' that
comes ``retime_every`` steps or more after it last ran there replaces its time: a warm-up that timed it
too slow would otherwise take many backed-off explorations, each moving the average by a fifth, to be
corrected, and the policy would keep a shorter K' meanwhile. And a drafting K' must beat the plain step by
``margin`` (5%): a plain step run between drafted ones does not overlap the host like a run of plain steps
does, and closer calls are within the step times' noise, so they go to the plain step. Outputs never
depend on the choice: every K' commits exactly the tokens of plain decoding (greedy and sampled alike, see
:mod:`peagle_jax.spec.verify`), so the policy changes only the speed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from peagle_jax.spec.tree import Tree, chain

# Steps a warm-up times per step length and row bucket, the step lengths taking turns: the first is dropped
# (a cold cache), the median of the rest is the step time (:meth:`AdaptiveK.calibrate`).
CALIBRATION_STEPS = 6


# Chains the adaptive step length picks from besides a plain step and the drafted tree, by default: none.
# A chain of 1 (serve --load-k auto:1) was measured on the serving benchmark side by side with the default:
# docs/bench/serve/README.md ("Step lengths").
DEFAULT_CHAINS: tuple[int, ...] = ()


def step_trees(tree: Tree, chains: Sequence[int] | None = None) -> dict[int, Tree]:
    """The candidates of a generator drafting ``tree``: K' -> its tree, a plain step (0), ``tree`` itself
    and a chain of each length in ``chains`` (default :data:`DEFAULT_CHAINS`; each shorter than ``tree``)."""
    chains = DEFAULT_CHAINS if chains is None else tuple(chains)
    bad = [c for c in chains if not 0 < c < tree.depth]
    if bad:
        raise ValueError(
            f"chain length(s) {', '.join(map(str, bad))}: a chain the step length picks must be 1.."
            f"{tree.depth - 1}, shorter than the draft ({tree.describe()})"
        )
    return {0: chain(0), **{c: chain(c) for c in sorted(chains)}, tree.depth: tree}


def adaptive_policy(tree: Tree, chains: Sequence[int] | None = None) -> AdaptiveK:
    """The policy of a generator drafting ``tree``: its :func:`step_trees`, acceptance shared between them
    when ``tree`` is a chain."""
    return AdaptiveK(sorted(step_trees(tree, chains)), shared=tree.is_chain)


class AdaptiveK:
    def __init__(
        self,
        candidates: Sequence[int],
        *,
        explore_every: int = 32,
        max_explore_gap: float = 16.0,
        retime_every: int = 64,
        margin: float = 0.05,
        shared: bool = True,
        min_samples: int = 2,
        decay: float = 0.99,
        smoothing: float = 0.2,
        prior_weight: float = 8.0,
    ):
        if not candidates or min(candidates) < 0:
            raise ValueError(f"candidates must be draft lengths >= 0, got {candidates}")
        self.candidates = tuple(sorted(set(candidates)))
        self.K = max(self.candidates)
        self.explore_every, self.max_explore_gap, self.min_samples = explore_every, max_explore_gap, min_samples
        self.retime_every, self.margin = retime_every, margin
        self.last_timed: dict[tuple[int, int], int] = {}  # (rows, K') -> self.steps when last timed
        self.decay, self.smoothing = decay, smoothing
        # The 0.5 prior per depth counts as this many rows. With one, the first few rejected drafts of a
        # request (a server's first steps, or a prompt the drafter guesses badly at its start) put a tree's
        # estimate so low that a chain of 1 or the plain step won, the tree ran only as a backed-off
        # exploration, and its real acceptance was never learnt (a serving benchmark at one client: 3 tree
        # steps in 269, 0.98x where the tree at every step ran at 1.25x).
        self.prior_weight = prior_weight
        # Acceptance counts per group of candidates (one group when shared; else the longest K' alone):
        # per depth, rows that reached it (every earlier depth accepted) and rows that accepted it.
        self.shared = shared
        self._counts = {g: (np.zeros(self.K), np.zeros(self.K)) for g in {self._group(k) for k in self.candidates}}
        self.tries, self.accepts = self._counts[self._group(self.K)]  # the longest K''s (views, updated in place)
        self.seen: dict[tuple[int, int], int] = {}  # (rows, K') -> steps recorded
        self.step_s: dict[tuple[int, int], float] = {}  # (rows, K') -> smoothed seconds per step
        self.steps = 0
        self.explored = 0  # the step that last ran the longest K' to refresh the acceptance estimate
        self.backoff = 0  # explorations since the longest K' last won or gained: each doubles the interval
        self.explored_gap: dict[int, float] = {}  # rows -> how much slower the longest K' was when last explored

    def _group(self, k: int) -> int:
        return 0 if self.shared or k != self.K else 1

    def acceptance(self, k: int | None = None) -> np.ndarray:
        """``p_d`` per depth d = 1..K of candidate ``k`` (default the longest): the rate of accepting depth d
        having accepted d - 1."""
        tries, accepts = self._counts[self._group(self.K if k is None else k)]
        return (accepts + 0.5 * self.prior_weight) / (tries + self.prior_weight)

    def expected_tokens(self, k: int, synced: float = 1.0) -> float:
        """Tokens a row emits per step drafting ``k``: 1 + the expected accepted prefix, of which only the
        ``synced`` fraction of rows (those whose drafter context is current, see the slot engine) get any."""
        return 1.0 + synced * float(np.cumprod(self.acceptance(k)[:k]).sum())

    def _scores(self, rows: int, synced: float = 1.0) -> dict[int, float] | None:
        """Expected tokens per second of each candidate at ``rows`` (the plain step's with the margin), or
        None while one's step time is unknown."""
        times = {k: self.step_time(rows, k) for k in self.candidates}
        if any(t is None for t in times.values()):
            return None
        score = {k: self.expected_tokens(k, synced) / times[k] for k in self.candidates}
        score[self.candidates[0]] *= 1.0 + self.margin  # a drafting K' must win by the margin
        return score

    def pays(self, rows: int) -> bool:
        """Whether drafting is expected to beat the plain step at ``rows`` with every row's drafter current
        (True while a step time there is unknown). No side effects: the slot engine asks it whether to keep
        the drafter current for a row (a prefill, a flush), :meth:`choose` what to run."""
        score = self._scores(rows)
        return score is None or max(score, key=score.get) != self.candidates[0]

    def _stale(self, rows: int, k: int) -> bool:
        """Whether ``k`` was timed at ``rows`` before, but not in the last ``retime_every`` steps."""
        return self.steps - self.last_timed.get((rows, k), self.steps) >= self.retime_every

    def _timed(self, rows: int, k: int) -> bool:
        return self.seen.get((rows, k), 0) >= self.min_samples + 1  # + 1: the dropped first sample

    def step_time(self, rows: int, k: int) -> float | None:
        """Seconds per step of ``k`` at ``rows``: measured there, else the plain step's time there times
        ``k``'s cost relative to it at the nearest row bucket that timed both; None when neither is known."""
        if self._timed(rows, k):
            return self.step_s[(rows, k)]
        base = self.candidates[0]
        if k == base or not self._timed(rows, base):
            return None
        known = [r for (r, kk) in self.step_s if kk == k and self._timed(r, k) and self._timed(r, base)]
        if not known:
            return None
        near = min(known, key=lambda r: (abs(np.log2(r) - np.log2(rows)), r))
        return self.step_s[(rows, base)] * self.step_s[(near, k)] / self.step_s[(near, base)]

    def choose(self, rows: int, synced: float = 1.0) -> int:
        """The draft length of the next step over ``rows`` rows, of which the ``synced`` fraction of the
        live ones have a current drafter context (none: a plain step, nothing could be accepted or learnt)."""
        self.steps += 1
        for k in self.candidates:
            if self.step_time(rows, k) is None:
                return k
        base = self.candidates[0]
        if synced <= 0:
            return base
        score = self._scores(rows, synced)
        best = max(self.candidates, key=score.get)
        if best != base and self._stale(rows, base):
            return base  # re-time the plain step: its time may have moved since it last ran here
        if best == self.K:
            self.backoff = 0
            return best
        gap = self._gap(score, best)
        # Catching up, compared at the same row bucket (a move to a bucket where drafting loses by less is a
        # change of load, not of the traffic): look again soon.
        if rows in self.explored_gap and gap < 0.75 * self.explored_gap[rows]:
            self.backoff, self.explored_gap[rows] = 0, gap
        if self._explore_now(gap) and self._could_win(rows, score[best]):
            self.explored, self.explored_gap[rows] = self.steps, gap
            self.backoff = min(self.backoff + 1, 16)
            return self.K
        return best

    def _could_win(self, rows: int, best_score: float) -> bool:
        """Whether the longest K' would beat ``best_score`` at ``rows`` if every draft were accepted (K + 1
        tokens per step). Where it would not (a step that costs more than K + 1 plain steps: on a CPU, a
        7-node tree at 8 or 16 busy rows), exploring it only costs time, whatever the acceptance is."""
        return (self.K + 1) / self.step_time(rows, self.K) > best_score

    def _gap(self, score: dict[int, float], best: int) -> float:
        """How much slower exploring the longest K' is than ``best`` (at most 8x)."""
        return min(score[best] / max(score[self.K], 1e-12), 8.0)

    def _explore_now(self, gap: float, ahead: int = 0) -> bool:
        """Whether the backed-off interval since the last exploration has passed (``ahead`` steps from now)."""
        interval = self.explore_every * min(gap * 2.0**self.backoff, self.max_explore_gap)
        return self.steps + ahead - self.explored >= interval

    def explore_due(self, rows: int) -> bool:
        """Whether a shorter K' wins at ``rows`` (with every row's drafter current) and the longest is due
        for an exploration, which :meth:`choose` runs at the next step that has a synced row. No side effects.
        The slot engine keeps an admitted request's drafter current then even where drafting does not pay:
        its lazy rows have no current drafter, and :meth:`choose` explores only with synced rows, so an
        acceptance estimate that fell below break-even (a few unlucky first drafts) would otherwise never be
        measured again, and the engine would decode plainly for its whole life."""
        score = self._scores(rows)
        if score is None:
            return False
        best = max(self.candidates, key=score.get)
        if best == self.K or not self._could_win(rows, score[best]):
            return False
        return self._explore_now(self._gap(score, best), ahead=1)  # choose() counts first

    def calibrate(self, rows: int, k: int, seconds: Sequence[float]) -> None:
        """Set the step time of ``k`` at ``rows`` to the median of ``seconds``, steps timed by a warm-up
        (after a dropped first one; best interleaved with the other candidates', so that the machine's noise
        hits all alike). One sample off by a burst of noise would otherwise steer the choice until an
        exploration or a re-timing corrects it."""
        if not len(seconds):
            raise ValueError("calibrate needs at least one timed step")
        key = (rows, k)
        self.step_s[key] = float(np.median(seconds))
        self.seen[key] = max(self.seen.get(key, 0), self.min_samples + 1)
        self.last_timed[key] = self.steps

    def adopt(self, other: AdaptiveK) -> None:
        """Take ``other``'s step times (calibrated elsewhere: the server's background warm-up) for every
        (rows, K') this policy has not timed itself."""
        for (rows, k), seconds in other.step_s.items():
            if k in self.candidates and other._timed(rows, k) and not self._timed(rows, k):
                self.calibrate(rows, k, [seconds])

    def calibrate_all(self, rows: int, time_step: Callable[[int], float], each: Callable[[], None] | None = None):
        """Calibrate every candidate at ``rows``: ``CALIBRATION_STEPS`` steps each, timed by ``time_step(k)``
        (seconds), the candidates taking turns; each one's first step is dropped (a cold cache) and the
        median of the rest is its time (:meth:`calibrate`). ``each()`` is called after every step."""
        times = {k: [] for k in self.candidates}
        for _ in range(CALIBRATION_STEPS):
            for k, ts in times.items():
                ts.append(time_step(k))
                if each is not None:
                    each()
        for k, ts in times.items():
            self.calibrate(rows, k, ts[1:])

    def record(self, rows: int, k: int, seconds: float | None, counts: Sequence[int] = ()) -> None:
        """A step of ``rows`` rows drafting ``k`` took ``seconds`` (None: not timed); ``counts``: tokens each
        live row gained (1 + its accepted drafts; ignored for a plain step)."""
        key = (rows, k)
        n = self.seen.get(key, 0)
        if seconds is not None:
            self.seen[key] = n + 1
            # A step not timed here for ``retime_every`` steps (a re-timed plain step, an exploration of the
            # longest K') replaces the stale average rather than nudging it.
            stale = self._stale(rows, k)
            self.last_timed[key] = self.steps
            if n == 1 or (n > 1 and stale):
                self.step_s[key] = seconds
            elif n > 1:
                self.step_s[key] += self.smoothing * (seconds - self.step_s[key])
        if k and len(counts):
            c = np.asarray(counts)[:, None]
            d = np.arange(1, k + 1)[None, :]
            tries, accepts = self._counts[self._group(k)]
            tries *= self.decay
            accepts *= self.decay
            tries[:k] += (c >= d).sum(axis=0)  # reached depth d: the d - 1 before it accepted
            accepts[:k] += (c >= d + 1).sum(axis=0)

    def snapshot(self) -> dict:
        """What the policy believes now (for logs and tests)."""
        return {
            "acceptance": self.acceptance().round(4).tolist(),
            "step_ms": {f"{r}x{k}": round(s * 1e3, 3) for (r, k), s in sorted(self.step_s.items())},
        }
