"""Serving buckets: the static shapes a deployment compiles, read from YAML.

On Neuron every distinct shape is one NEFF compiled ahead of time (minutes each for a large model), so a
deployment lists its shapes up front. The graph set follows from these fields exactly as the generators
derive it (:class:`peagle_jax.engine.generator.Generator`): batch buckets; prompt-length (prefill) buckets, the
largest being the chunk long prompts are split into; ``max_seq_len``, which sets the KV cache slots and
the attention-window buckets; the draft lengths K (a chain each) and static trees; and which graph
families to build. Example (``neuron/buckets.yaml``)::

    batch_buckets: [1, 4]
    prefill_buckets: [32, 128]
    max_seq_len: 256
    k_values: [4]
    trees: ["0,1,00,10"]
    sequential: true   # also the EAGLE-3 sequential draft graphs
    fused: true        # also the fused draft + verify graphs
    sampling: true     # also the sampling variants (temperature > 0), besides greedy
    adaptive: true     # also plain steps inside each K's cache (serve --load-k auto)
    adaptive_chains: [] # with adaptive, also a chain of each length inside each K's cache (serve --load-k auto:1)
    window_buckets: null # attention windows below max_seq_len (serve --window-buckets; null: 128, 256, ...)
    dtype: bfloat16
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from peagle_jax.errors import UserError
from peagle_jax.spec.tree import parse_tree


class BucketsError(UserError):
    """A bucket config that cannot be used; the message names the field."""


@dataclasses.dataclass(frozen=True)
class ServingBuckets:
    batch_buckets: tuple[int, ...] = (1, 4)
    prefill_buckets: tuple[int, ...] = (128,)
    max_seq_len: int = 256
    k_values: tuple[int, ...] = (4,)
    trees: tuple[str, ...] = ()
    sequential: bool = False
    fused: bool = False
    sampling: bool = True
    adaptive: bool = True
    adaptive_chains: tuple[int, ...] = ()
    window_buckets: tuple[int, ...] | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        for name in ("batch_buckets", "prefill_buckets", "k_values"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise BucketsError(f"{name} must be a non-empty list of positive integers, got {list(values)}")
        if any(not isinstance(c, int) or c < 1 for c in self.adaptive_chains):
            raise BucketsError(f"adaptive_chains must be positive integers, got {list(self.adaptive_chains)}")
        depths = [*self.k_values, *(parse_tree(t).depth for t in self.trees)]
        too_long = sorted({c for c in self.adaptive_chains if c >= min(depths)})
        if too_long:
            raise BucketsError(
                f"adaptive_chains {too_long}: each must be shorter than every draft (k_values, trees: depth "
                f"{min(depths)})"
            )
        if self.window_buckets is not None and any(not isinstance(w, int) or w < 1 for w in self.window_buckets):
            raise BucketsError(f"window_buckets must be positive integers or null, got {list(self.window_buckets)}")
        if self.max_seq_len < 2:
            raise BucketsError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.dtype not in ("float32", "bfloat16"):
            raise BucketsError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


def load_buckets(path: str | Path | None = None, **overrides) -> ServingBuckets:
    """The defaults, updated from a YAML file (if given), then from keyword overrides."""
    values: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise BucketsError(f"--buckets {path}: no such file")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise BucketsError(f"{path}: not valid YAML ({err})") from None
        if not isinstance(loaded, dict):
            raise BucketsError(f"{path}: expected a mapping of bucket fields")
        values.update(loaded)
    values.update(overrides)
    fields = {f.name for f in dataclasses.fields(ServingBuckets)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise BucketsError(f"unknown bucket field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}")
    for name in ("batch_buckets", "prefill_buckets", "k_values", "trees", "adaptive_chains", "window_buckets"):
        if name in values and values[name] is not None:
            v = values[name]
            values[name] = tuple(v) if isinstance(v, list | tuple) else (v,)
    return ServingBuckets(**values)
