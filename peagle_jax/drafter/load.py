"""Loading a drafter for inference from a PyTorch directory (speculators or EAGLE layout) or a converted JAX one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from peagle_jax.checkpoint import CheckpointError, cast_floats, is_jax_checkpoint, load_checkpoint
from peagle_jax.drafter.config import DrafterConfig, drafter_config_from_dict
from peagle_jax.drafter.weights import (
    check_drafter_params,
    drafter_params_from_tensors,
    with_embedding_of,
)
from peagle_jax.models.config import ConfigError
from peagle_jax.models.hf_config import read_config_json
from peagle_jax.models.weights import flatten, read_safetensors


def read_torch_drafter(
    path: str | Path, *, dtype: str = "float32"
) -> tuple[DrafterConfig, str, dict[str, Any], dict[str, np.ndarray]]:
    """(cfg, layout, config dict, tensors) of a PyTorch drafter directory: ``config.json`` plus
    ``*.safetensors`` (single or sharded; pickled ``.bin`` weights are refused). Tensors keep their dtypes;
    ``cfg.own_embedding`` follows whether the checkpoint carries ``embed_tokens.weight``."""
    config = read_config_json(path)
    cfg, layout = drafter_config_from_dict(config, dtype=dtype)
    tensors = read_safetensors(path)
    return with_embedding_of(cfg, tensors), layout, config, tensors


def load_drafter(path: str | Path, *, dtype: str = "float32") -> tuple[DrafterConfig, dict]:
    """(cfg, params) of a drafter directory, PyTorch or converted JAX, float params cast to ``dtype`` (ids in
    ``d2t`` stay int32, ``t2d`` bool) and placed on the default device."""
    path = Path(path)
    if is_jax_checkpoint(path):
        meta, params = load_checkpoint(path)
        if meta.kind != "drafter":
            raise CheckpointError(f"{path} holds a {meta.kind} model, not a drafter")
        cfg, _ = drafter_config_from_dict(meta.config, dtype=dtype)
        full_vocab_map = "d2t" in params and cfg.draft_vocab_size == cfg.layer.vocab_size
        cfg = cfg.replace(own_embedding="embed_tokens" in params, full_vocab_map=full_vocab_map)
        check_drafter_params(flatten(params), cfg)
    elif path.is_dir():
        cfg, layout, _, tensors = read_torch_drafter(path, dtype=dtype)
        params = drafter_params_from_tensors(tensors, cfg, layout)
    else:
        raise ConfigError(f"{path}: no such directory")
    return cfg, cast_floats(params, dtype)


def save_drafter(
    path: str | Path, cfg: DrafterConfig, params, *, layout: str = "speculators", max_shard_size: int | None = None
) -> list[Path]:
    """Write a drafter as a PyTorch directory (``config.json`` + safetensors) in the speculators or EAGLE
    layout, as trained or built in JAX; the inverse of :func:`load_drafter` on such a directory."""
    import json

    from peagle_jax.drafter.config import to_eagle_config, to_speculators_config
    from peagle_jax.drafter.weights import drafter_params_to_tensors
    from peagle_jax.models.weights import write_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = to_speculators_config(cfg) if layout == "speculators" else to_eagle_config(cfg)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return write_safetensors(path, drafter_params_to_tensors(params, cfg, layout), max_shard_size=max_shard_size)
