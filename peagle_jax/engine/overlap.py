"""Overlapping the host with the device: launch the next step before reading the last.

A jitted call returns as soon as its work is queued; reading its output waits for it. A decode loop that
reads a step's tokens before launching the next leaves the device idle while the host does its bookkeeping
(emitting tokens, stop checks, admitting requests). Every step loop here (plain generation,
:meth:`peagle_jax.engine.generator.Generator.stream`; speculative generation, whose plain steps overlap,
:meth:`peagle_jax.spec.generator.SpeculativeGenerator.stream`; the serving engine,
:meth:`peagle_jax.serve.slots.SlotEngine.step`) is a :class:`StepLoop`: it launches plain step n + 1 on the
unread device-side tokens of step n, then reads step n (:func:`launch_then_read`), and runs a drafting step,
which cannot overlap, at once.

Outputs do not change: step n + 1 takes exactly the tokens step n produced, only without a round trip
through the host. A row that turns out to have finished at step n has its token of step n + 1 dropped by
the caller (it stepped in place, writing only its own uncommitted slots).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax import executables


@dataclasses.dataclass
class Launched:
    """A step launched and not read yet: each row's next token on the device (``tokens`` [R]), the rows
    whose token counts (``live`` [R]), the launch time, and the loop's bookkeeping for it: in speculative
    decoding each row's draft-context slot for its token (``at`` [R], see
    :meth:`peagle_jax.spec.state.SpecState.advance_plain`), in the serving engine the request each row held
    at launch (``ids``); ``logprobs`` with a generator's :attr:`~peagle_jax.engine.generator.Generator.logprobs`."""

    tokens: jax.Array
    live: np.ndarray
    t_launch: float = dataclasses.field(default_factory=time.perf_counter)
    at: np.ndarray | None = None
    ids: list[int | None] | None = None
    logprobs: object = None  # the tokens' TokenLogprobs [R, 1] on the device, when the step computes them

    @property
    def R(self) -> int:
        return len(self.live)

    def device_seconds(self, t_last_read: float, now: float) -> float:
        """Its device time as seen from the host: from its launch, or, when it was launched before the last
        read (overlapped), from that read, to ``now``."""
        return now - max(self.t_launch, t_last_read)


@executables.jit
def merge_roots(fresh_R, host_R, device_R):
    """The tokens a plain step feeds: the host's for the ``fresh`` rows (admitted since the last launch),
    else the previous step's unread output."""
    return jnp.where(fresh_R, host_R, device_R)


def launch_then_read(
    pending: Launched, launch_next: Callable[[jax.Array], Launched] | None
) -> tuple[np.ndarray, Launched | None]:
    """Launch the following step on ``pending``'s unread tokens (``launch_next(tokens)``; None: no following
    step can be launched before the read, e.g. the next step is a draft, or a flush needs the tokens on the
    host), then read ``pending``'s tokens. Returns (its tokens on the host, the following step or None)."""
    following = None if launch_next is None else launch_next(pending.tokens)
    return np.asarray(pending.tokens), following


@dataclasses.dataclass
class Turn:
    """What one :meth:`StepLoop.turn` did: ran a synchronous step (``result``: what ``run`` returned), or read
    a plain step (``launched``) whose tokens are ``tokens`` (on the host); neither when it waited."""

    result: Any = None
    launched: Launched | None = None
    tokens: np.ndarray | None = None


class StepLoop:
    """The launch-before-read loop of one decoder: holds the plain step launched and not read yet
    (:attr:`pending`), and runs one step per :meth:`turn`."""

    def __init__(self, pending: Launched | None = None):
        self.pending = pending

    def turn(
        self,
        choose: Callable[[], Any],
        run: Callable[[Any], Any],
        launch: Callable[[], Launched],
        following: Callable[[Launched], Callable[[jax.Array], Launched] | None],
        *,
        overlap: bool = True,
    ) -> Turn:
        """One step. With nothing pending, ``choose()`` names the next step: None (wait: nothing runs), a
        drafting tree (``run(tree)`` runs it at once: the turn's ``result``) or a plain one (``launch()``
        launches it). Then the pending plain step is read, after ``following(pending)`` launched the next
        plain step on its unread tokens (``following`` returns the launcher, or None where the next step
        cannot be launched yet). Without ``overlap`` a plain step is read before the next is launched."""
        if self.pending is None:
            tree = choose()
            if tree is None:
                return Turn()
            if tree.depth:
                return Turn(result=run(tree))
            self.pending = launch()
        pending, self.pending = self.pending, None
        tokens, self.pending = launch_then_read(pending, following(pending) if overlap else None)
        return Turn(launched=pending, tokens=tokens)
