"""The training run configuration: a frozen dataclass, read from YAML with ``key=value`` overrides.

One style for every entry point: ``load_config(path, ["lr=1e-4", "compute_dtype=bfloat16"])`` reads the
YAML mapping (every key must be a field), applies the overrides (values parsed as YAML scalars), coerces
each value to its field's type and validates the result. Unknown keys and bad values raise
:class:`~peagle_jax.models.config.ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from peagle_jax.errors import yaml_problem
from peagle_jax.models.config import ConfigError

COMPUTE_DTYPES = ("float32", "bfloat16")
OBJECTIVES = ("peagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer, schedule, precision and checkpointing of one run; static (hashable) in the jitted step.

    The learning rate rises linearly from 0 to ``lr`` over ``warmup_steps`` and then follows a cosine to
    ``lr * min_lr_ratio`` at ``total_steps``. Master weights and the optimizer are always fp32;
    ``compute_dtype`` is the dtype of the forward (and backward) pass. ``objective``: ``peagle`` (parallel
    drafting, COD elements) or ``eagle3`` (sequential drafting, training-time test); ``segments`` > 1
    partitions each row's P-EAGLE elements into that many passes with exact gradients (less memory).
    """

    lr: float = 6e-4
    warmup_steps: int = 100
    total_steps: int = 10_000
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    compute_dtype: str = "float32"
    keep_last: int = 3
    save_every: int = 1000
    seed: int = 0
    objective: str = "peagle"
    segments: int = 1

    def __post_init__(self):
        checks = [
            ("lr", self.lr > 0, "must be > 0"),
            ("warmup_steps", self.warmup_steps >= 0, "must be >= 0"),
            ("total_steps", self.total_steps > self.warmup_steps, f"must be > warmup_steps ({self.warmup_steps})"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "must be in [0, 1]"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("clip_norm", self.clip_norm > 0, "must be > 0"),
            ("b1", 0 <= self.b1 < 1, "must be in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "must be in [0, 1)"),
            ("eps", self.eps > 0, "must be > 0"),
            ("compute_dtype", self.compute_dtype in COMPUTE_DTYPES, f"must be one of {', '.join(COMPUTE_DTYPES)}"),
            ("keep_last", self.keep_last >= 1, "must be >= 1"),
            ("save_every", self.save_every >= 1, "must be >= 1"),
            ("objective", self.objective in OBJECTIVES, f"must be one of {', '.join(OBJECTIVES)}"),
            ("segments", self.segments >= 1, "must be >= 1"),
            ("segments", self.segments == 1 or self.objective == "peagle", "partitioning is for the peagle objective"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ConfigError(f"train config: {key}={getattr(self, key)!r} {why}")

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _coerce(cls, key: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind`` (int, float, str or bool); YAML 1.1 reads ``6e-4`` as a string, so numbers
    written that way are accepted too, and a list of strings given for a string key is read as its
    comma-separated form (keys that take several values, as ``data.regen_endpoints``)."""
    bad = ConfigError(f"{cls.__name__}: {key} expects a {kind.__name__}, got {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if isinstance(value, bool):
        raise bad
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float):  # a one-value list key (data.extra_temperatures: 0.8)
            return str(value)
        if isinstance(value, list) and value and all(isinstance(v, str | int | float) for v in value):
            if not any(isinstance(v, bool) for v in value):
                return ",".join(str(v) for v in value)
        raise bad
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is float:
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    raise TypeError(f"{cls.__name__}.{key}: unsupported field type {kind}")


def config_from_dict(cls, d: dict[str, Any]):
    """An instance of the dataclass ``cls`` from a dict; a field whose type is itself a config dataclass takes a
    nested mapping (a YAML section). Unknown keys and bad values raise ConfigError naming the key."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - fields)
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{cls.__name__}: unknown key(s) {', '.join(unknown)}; known keys: {known}")
    values = {}
    for k, v in d.items():
        if dataclasses.is_dataclass(hints[k]):
            if not isinstance(v, dict):
                raise ConfigError(f"{cls.__name__}: {k} expects a mapping of key: value, got {v!r}")
            values[k] = config_from_dict(hints[k], v)
        else:
            values[k] = _coerce(cls, k, v, hints[k])
    return cls(**values)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"optim.lr": 1}`` -> ``{"optim": {"lr": 1}}``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: {part} is not a section")
        node[last] = value
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``["lr=1e-4", "optim.seed=3"]`` -> ``{"lr": 1e-4, "optim": {"seed": 3}}``; values are parsed as YAML
    scalars, dotted keys address sections."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: cannot parse the value ({yaml_problem(e)})") from None
    return _nest(out)


def load_config(path: str | Path | None, overrides=(), cls=TrainConfig):
    """``cls`` from the YAML mapping at ``path`` (None: defaults only), then the ``key=value`` overrides."""
    d: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({yaml_problem(e)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of key: value, got {type(loaded).__name__}")
        d.update(loaded)
    d = _merge(d, parse_overrides(list(overrides)))
    return config_from_dict(cls, d)
