"""Packing regenerated conversations into fixed-shape rows, and the EAGLE-shifted training layout.

A conversation is ``x = prompt_ids + response_ids`` (n tokens) with ``response[i]`` = 1 on the tokens the
target generated: the chat template's assistant turn, so the loss covers assistant tokens only. Several
conversations are packed first-fit-decreasing into rows of T slots (``document`` = the conversation's index
in the row, -1 for padding; RoPE ``positions`` restart at 0 per conversation). A conversation longer than T
is cut to its first T tokens. The packing is fixed once; epochs shuffle the order of rows.

Training layout of a packed row (what :class:`peagle_jax.train.objective.PEagleBatch` holds), for slot r of a
conversation: ``tokens[r] = x[r+1]``, ``aux[r]`` = the target's aux states at r, ``target_hidden[r]`` = its
final normed state at r+1 (whose logits give the distribution of x[r+2]), ``loss_mask[r] = response[r+1]``
when r+2 is still inside the conversation, else 0 (the distribution after the last token is never
drafted), and ``document_ids[r]`` = the conversation, or -1 at its last slot (it has no next token; as
padding it is seen by no query). So element r pairs x[r+1] with g[r] and learns the target's distribution of
x[r+2]: the EAGLE shift.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class PackedRows(NamedTuple):
    """Target inputs of B packed rows of T slots: ``tokens``, ``positions``, ``document`` (int32) and
    ``response`` (0/1), each [B, T]."""

    tokens: np.ndarray
    positions: np.ndarray
    document: np.ndarray
    response: np.ndarray


def conversation(record: dict) -> tuple[list[int], list[int]]:
    """``(x, response mask)`` of one regenerated record."""
    prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
    return prompt + response, [0] * len(prompt) + [1] * len(response)


def pack(conversations: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int) -> PackedRows:
    """First-fit-decreasing packing into rows of ``seq_len`` slots (deterministic: ties keep input order).
    Conversations of fewer than 3 tokens carry no training signal and are dropped. The first row with room
    is found in a tree of the rows' free slots (log time per conversation: millions of tokens pack in
    seconds)."""
    items = [(list(x)[:seq_len], list(m)[:seq_len]) for x, m in conversations if len(x) >= 3]
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
    rows: list[list[int]] = []
    free = _FreeTree(len(items))
    for i in order:
        n = len(items[i][0])
        r = free.first_at_least(n)
        if r < 0:
            r = len(rows)
            rows.append([])
            free.set(r, seq_len)
        rows[r].append(i)
        free.set(r, free.get(r) - n)
    B = len(rows)
    out = PackedRows(
        np.zeros((B, seq_len), np.int32),
        np.zeros((B, seq_len), np.int32),
        np.full((B, seq_len), -1, np.int32),
        np.zeros((B, seq_len), np.int32),
    )
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            x, m = items[i]
            n = len(x)
            out.tokens[r, at : at + n] = x
            out.positions[r, at : at + n] = np.arange(n)
            out.document[r, at : at + n] = d
            out.response[r, at : at + n] = m
            at += n
    return out


class _FreeTree:
    """Free slots per row in a max segment tree: the first row with at least n free slots in O(log rows)."""

    def __init__(self, capacity: int):
        self.size = 1 << max(capacity, 1).bit_length()
        self.tree = [-1] * (2 * self.size)  # -1: no row there yet

    def get(self, r: int) -> int:
        return self.tree[self.size + r]

    def set(self, r: int, value: int) -> None:
        i = self.size + r
        self.tree[i] = value
        i //= 2
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i //= 2

    def first_at_least(self, n: int) -> int:
        """The lowest row index with at least ``n`` free slots, or -1."""
        if self.tree[1] < n:
            return -1
        i = 1
        while i < self.size:
            i = 2 * i if self.tree[2 * i] >= n else 2 * i + 1
        return i - self.size


def concat_rows(a: PackedRows, b: PackedRows) -> PackedRows:
    """The rows of ``a`` then those of ``b`` (the same row length)."""
    return PackedRows(*(np.concatenate([x, y]) for x, y in zip(a, b, strict=True)))


def _next(a_BT: np.ndarray, k: int, fill) -> np.ndarray:
    """``a[:, r + k]``, ``fill`` past the end."""
    out = np.full_like(a_BT, fill)
    out[:, : a_BT.shape[1] - k] = a_BT[:, k:]
    return out


def training_layout(rows: PackedRows) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, loss_mask, document_ids)`` [B, T] of the training layout (module docstring)."""
    doc = rows.document
    same1 = (_next(doc, 1, -1) == doc) & (doc >= 0)
    same2 = (_next(doc, 2, -1) == doc) & (doc >= 0)
    tokens = np.where(same1, _next(rows.tokens, 1, 0), 0).astype(np.int32)
    loss_mask = (same2 & (_next(rows.response, 1, 0) != 0)).astype(np.int32)
    document_ids = np.where(same1, doc, -1).astype(np.int32)
    return tokens, loss_mask, document_ids


def packing_stats(rows: PackedRows) -> dict:
    """Rows, conversations, filled fraction and loss tokens: for the run's log."""
    docs = int(sum(len(np.unique(d[d >= 0])) for d in rows.document))
    _, loss_mask, _ = training_layout(rows)
    return {
        "rows": int(rows.tokens.shape[0]),
        "conversations": docs,
        "fill": float((rows.document >= 0).mean()) if rows.tokens.size else 0.0,
        "loss_tokens": int(loss_mask.sum()),
    }
