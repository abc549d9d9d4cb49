"""Shape buckets: every device call is padded to one of these, so the graphs compiled are bounded by the
buckets, never by prompt lengths, positions or accepted counts."""

from __future__ import annotations

from collections.abc import Sequence

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WINDOW_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# Slots a one-row fp32 cache has past the top window bucket, never attended to. A decode step whose window
# is every slot of a one-row fp32 cache made XLA's CPU compiler fuse the cache write into the attention's
# operand (the reshape that drops the row axis), compute the write twice and copy each layer's K and V cache
# four times: a SmolLM2 decode step at 2064 slots took 101-104 ms, 47-48 ms with the window a slice of a
# longer cache (37 ms at the 1024 window). Where that does not happen the slice only costs: a step over
# 8 rows (120 ms whole, 146 ms as a slice), a bf16 cache (stored as integer bits: 37 ms whole, 40 ms as a
# slice), a tree verify step (73 ms whole, 81 ms as a slice). So only one-row fp32 caches on the CPU
# backend get the pad.
ONE_ROW_PAD = 8


def parse_window_buckets(text: str | None) -> tuple[int, ...] | None:
    """``--window-buckets``: None (the default: :data:`WINDOW_BUCKETS`), ``'none'`` -> () (only the whole
    cache), else comma-separated positive sizes, e.g. ``'256,1024'``. Raises ValueError naming the text."""
    if text is None:
        return None
    text = text.strip()
    if text == "none":
        return ()
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise ValueError(f"expected 'none' or comma-separated positive sizes, e.g. 256,1024; got {text!r}")
    return sizes


def bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (the largest bucket when n exceeds them all; callers chunk then)."""
    for b in buckets:
        if b >= n:
            return b
    return buckets[-1]
