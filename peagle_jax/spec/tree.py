"""Static draft trees: which per-depth candidates a step drafts and verifies.

A tree is a static list of paths over per-depth candidate ranks: ``"0,00,000"`` is a chain of 3 (the top
candidate at depths 1, 2, 3); ``"0,1,00,10"`` puts the top two candidates at depth 1 and the top depth-2
candidate under each. A node's token is the draft's rank-r candidate at its depth (P-EAGLE's candidates
depend on the depth only), so siblings are distinct tokens. A tree is hashable: it is a static argument of
the graphs that verify it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from peagle_jax.errors import UserError, comma_list


@dataclasses.dataclass(frozen=True)
class Tree:
    """Static tree: node i (1-based; 0 is the root) has ``parents[i-1]``, ``depths[i-1]``, ``ranks[i-1]``.
    Nodes are ordered so that a parent comes before its children."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        """K: the deepest draft depth the tree uses (0 for ``chain(0)``: a plain step, the root alone)."""
        return max(self.depths, default=0)

    @property
    def width(self) -> int:
        """Candidates needed per depth (top-n of the draft)."""
        return max(self.ranks, default=0) + 1

    @property
    def is_chain(self) -> bool:
        return self.depths == tuple(range(1, self.size + 1)) and set(self.ranks) <= {0}

    def mask(self) -> np.ndarray:
        """[T, T] (T = size + 1): node i sees itself and its ancestors."""
        T = self.size + 1
        m = np.eye(T, dtype=bool)
        parent = (-1, *self.parents)
        for i in range(1, T):
            j = parent[i]
            while j >= 0:
                m[i, j] = True
                j = parent[j]
        return m

    def ancestors(self) -> np.ndarray:
        """[T, K] node index at each depth 1..K on the path to node i (0 = none beyond its depth)."""
        T, K = self.size + 1, self.depth
        out = np.zeros((T, K), np.int32)
        parent, depth = (-1, *self.parents), (0, *self.depths)
        for i in range(1, T):
            j = i
            while j > 0:
                out[i, depth[j] - 1] = j
                j = parent[j]
        return out

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Each node's candidate ranks from depth 1 down to it, in node order (what :func:`parse_tree` reads)."""
        ancestors = self.ancestors()
        return tuple(
            tuple(self.ranks[j - 1] for j in ancestors[i, : self.depths[i - 1]]) for i in range(1, self.size + 1)
        )

    def spec(self) -> str:
        """The ``--tree`` spelling of the tree, e.g. ``0,1,00,10``."""
        return ",".join("".join(map(str, path)) for path in self.paths())

    def describe(self) -> str:
        """``a chain of K`` or ``the tree SPEC (N drafts, K deep)``: for messages."""
        if self.is_chain:
            return f"a chain of {self.depth}"
        return f"the tree {self.spec()} ({self.size} drafts, {self.depth} deep)"


def chain(k: int) -> Tree:
    return Tree(tuple(range(k)), tuple(range(1, k + 1)), (0,) * k)


def parse_tree(spec: str) -> Tree:
    """``"0,00,000"`` (a chain of 3) or ``"0,1,00,10"``: comma-separated paths of candidate ranks."""
    paths = comma_list(spec, "--tree", "0,1,00,10")
    if any(not p.isdigit() for p in paths):
        raise UserError(f"--tree {spec!r}: expected comma-separated paths of candidate ranks, e.g. 0,1,00,10")
    if len(set(paths)) != len(paths):
        raise UserError(f"--tree {spec!r}: a path is listed twice")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise UserError(f"--tree {spec!r}: path {p} has no parent path {p[:-1]}")
    ordered = sorted(paths, key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(ordered)}
    return Tree(
        parents=tuple(index[p[:-1]] if len(p) > 1 else 0 for p in ordered),
        depths=tuple(len(p) for p in ordered),
        ranks=tuple(int(p[-1]) for p in ordered),
    )
