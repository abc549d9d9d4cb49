"""Overlapping the host with the device: launch the next step before reading the last.

A jitted call returns as soon as its work is queued; reading its output waits for it. A decode loop that
reads a step's tokens before launching the next leaves the device idle while the host does its bookkeeping
(emitting tokens, stop checks, admitting requests). Every step loop here (plain generation,
:meth:`peagle_jax.engine.generator.Generator.stream`; the plain steps inside speculative decoding,
:meth:`peagle_jax.spec.generator.SpeculativeGenerator.stream`; the serving engine,
:meth:`peagle_jax.serve.slots.SlotEngine.step`) instead launches step n + 1 on the unread device-side
tokens of step n, then reads step n: :func:`launch_then_read` is the one place that order is written.

Outputs do not change: step n + 1 takes exactly the tokens step n produced, only without a round trip
through the host. A row that turns out to have finished at step n has its token of step n + 1 dropped by
the caller (it stepped in place, writing only its own uncommitted slots).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np


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


def launch_then_read(
    pending: Launched, launch_next: Callable[[jax.Array], Launched] | None
) -> tuple[np.ndarray, Launched | None]:
    """Launch the following step on ``pending``'s unread tokens (``launch_next(tokens)``; None: no following
    step can be launched before the read, e.g. the next step is a draft, or a flush needs the tokens on the
    host), then read ``pending``'s tokens. Returns (its tokens on the host, the following step or None)."""
    following = None if launch_next is None else launch_next(pending.tokens)
    return np.asarray(pending.tokens), following
