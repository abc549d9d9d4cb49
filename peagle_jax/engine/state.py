"""Per-row host state between decode steps: each row's root (its last committed token, not yet in the target
cache) and the root's position. Plain decoding needs nothing more; speculative decoding adds the queued draft
context (:class:`peagle_jax.spec.state.SpecState`, a subclass), so that one engine drives both on one state.

A row that is not live keeps its state, so it idles in place; a freed row (:meth:`RowState.release`) idles
at a small position inside its own row, writing only slots nothing reads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def host_copy(x: np.ndarray) -> jax.Array:
    """A device array of a host array that will change while a graph launched on it may still run: on the
    CPU, ``jnp.asarray`` (and ``jnp.array``'s copy, itself launched asynchronously) may read the host buffer
    in place, so it is copied on the host first."""
    return jnp.asarray(np.array(x, copy=True))


@dataclasses.dataclass
class RowState:
    """``q`` [B]: the position of each row's root; ``root`` [B]: that token (fed by the next step)."""

    q: np.ndarray
    root: np.ndarray

    @classmethod
    def empty(cls, B: int) -> RowState:
        return cls(np.zeros(B, np.int32), np.zeros(B, np.int32))

    def rows(self, R: int) -> RowState:
        """The first R rows (views of the host arrays)."""
        return self if R == len(self.q) else RowState(self.q[:R], self.root[:R])

    def seed(self, b: int, length: int, first: int) -> None:
        """Row b after a prefill of ``length`` tokens whose next token is ``first``."""
        self.q[b], self.root[b] = length, first

    def release(self, b: int) -> None:
        """Row b is free: it idles at position 0."""
        self.q[b], self.root[b] = 0, 0

    def advance_plain(self, live_R) -> np.ndarray | None:
        """A plain step was launched: each live row (among the first R = ``len(live_R)``) moves on one
        position; its new root is filled in by :meth:`commit_plain` once read (a following plain step may be
        launched before). Returns what :meth:`commit_plain` needs besides the tokens (here nothing)."""
        self.q[np.flatnonzero(live_R)] += 1
        return None

    def commit_plain(self, tokens_R, at_R, live_R) -> None:
        """The read tokens of a plain step become the live rows' roots."""
        rows = np.flatnonzero(live_R)
        self.root[rows] = tokens_R[rows]
