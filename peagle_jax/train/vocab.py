"""The draft vocabulary (``d2t`` / ``t2d``) from token frequencies, and the drafter's LM head from the target's.

The drafter predicts over U <= V ids: the U target ids most frequent in the regenerated responses (ties to
the smaller id; when fewer than U ids occur, the smallest unused ids fill up), sorted ascending. Draft id i
is target id ``used[i] = i + d2t[i]``; ``t2d[v]`` says whether target id v is in the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def token_counts(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """How often each target id occurs in ``sequences``: int64 [V]."""
    counts = np.zeros(vocab_size, np.int64)
    for seq in sequences:
        if len(seq):
            counts += np.bincount(np.asarray(seq, np.int64), minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts_V: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(used [U] int32 ascending, d2t [U] int32, t2d [V] bool)`` for the U most frequent ids."""
    V = counts_V.shape[0]
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{V}")
    # Stable sort on -count: equal counts keep ascending id order, so ties go to the smaller id and
    # never-seen ids come last in id order.
    order = np.argsort(-counts_V, kind="stable")
    used = np.sort(order[:draft_vocab_size]).astype(np.int32)
    d2t = (used - np.arange(draft_vocab_size, dtype=np.int32)).astype(np.int32)
    t2d = np.zeros(V, bool)
    t2d[used] = True
    return used, d2t, t2d


def coverage(counts_V: np.ndarray, used: np.ndarray) -> float:
    """The fraction of token occurrences that the draft vocabulary covers."""
    total = counts_V.sum()
    return float(counts_V[used].sum() / total) if total else 1.0


def unused_token_id(counts_V: np.ndarray, reserved: Iterable[int] = ()) -> int:
    """The largest id that never occurs and is not reserved (e.g. EOS): a safe default mask token."""
    never = np.flatnonzero(counts_V == 0)
    never = never[~np.isin(never, np.asarray(list(reserved), np.int64))]
    if never.size == 0:
        raise ValueError("every token id occurs in the data; set mask_token_id explicitly")
    return int(never[-1])
