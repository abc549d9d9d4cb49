"""The JAX side of a converted checkpoint, and loading a target from either side.

A JAX checkpoint is a directory holding

    peagle_config.json   {"format": "peagle_jax", "version": 1,
                          "kind": "drafter" | "target",
                          "layout": "speculators" | "eagle" | "hf",      the layout it was converted from
                          "config": {...},                               that source's config.json, verbatim
                          "tensors": {"<source tensor name>": "<dtype>", ...},   every tensor written back
                          "own_embedding": true | false}                 drafters: whether embed_tokens is there
    params/              an orbax checkpoint (StandardCheckpointer) of the parameter tree; each leaf keeps
                         its source dtype (bf16 stays bf16), except the drafter's d2t, which is int32

plus any tokenizer / generation files the source directory had. The source config and tensor dtypes are
what ``python -m peagle_jax.convert to-torch`` needs to write the original back exactly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.drafter.config import EAGLE_ARCHITECTURE, MASK_TOKEN_KEYS
from peagle_jax.errors import UserError
from peagle_jax.models.config import ARCHITECTURES, DTYPES, FAMILIES, ConfigError, ModelConfig
from peagle_jax.models.hf_config import from_hf_config
from peagle_jax.models.weights import (
    check_params,
    expected_shapes,
    flatten,
    load_target,
    resolve_experts,
    stored_experts,
    stores_mxfp4,
    unpacked_experts,
    with_experts,
)

FORMAT, VERSION = "peagle_jax", 1
META_FILE, PARAMS_DIR = "peagle_config.json", "params"
KINDS = ("drafter", "target")


class CheckpointError(UserError):
    """A JAX checkpoint directory that cannot be read; the message names the file."""


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What ``peagle_config.json`` records (see the module docstring)."""

    kind: str
    layout: str
    config: dict[str, Any]
    tensors: dict[str, str]
    own_embedding: bool | None = None

    def to_json(self) -> dict[str, Any]:
        d = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        if self.own_embedding is None:
            del d["own_embedding"]
        return d


def is_jax_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_FILE).is_file()


def detect_kind(config: dict[str, Any]) -> str:
    """``drafter`` (speculators or EAGLE layout) or ``target`` (Llama / Qwen2 / Qwen3), from a config dict."""
    archs = config.get("architectures") or []
    drafter_keys = ("speculators_model_type", "draft_vocab_size", *MASK_TOKEN_KEYS)
    if EAGLE_ARCHITECTURE in archs or any(k in config for k in drafter_keys):
        return "drafter"
    model_type = config.get("model_type")
    unknown = [a for a in archs if a not in ARCHITECTURES.values()]
    if model_type not in FAMILIES or unknown:
        raise ConfigError(
            f"unknown architecture (model_type={model_type!r}, architectures={archs}): expected a speculators "
            f"drafter (peagle / eagle3), an EAGLE-layout drafter ({EAGLE_ARCHITECTURE}) or a "
            f"{' / '.join(ARCHITECTURES.values())} model"
        )
    return "target"


def save_checkpoint(path: str | Path, params: dict, meta: CheckpointMeta) -> None:
    """Write ``params`` (numpy or JAX leaves) and ``meta`` into directory ``path`` (created; ``params/`` must
    not exist yet)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / PARAMS_DIR, params)
        ckptr.wait_until_finished()
    (path / META_FILE).write_text(json.dumps(meta.to_json(), indent=2) + "\n")


def read_meta(path: str | Path) -> CheckpointMeta:
    file = Path(path) / META_FILE
    try:
        d = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {META_FILE} (not a converted JAX checkpoint)") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise CheckpointError(f"{file}: not a {FORMAT} checkpoint description")
    if d.get("version") != VERSION:
        raise CheckpointError(f"{file}: format version {d.get('version')!r}; this peagle_jax reads version {VERSION}")
    if d.get("kind") not in KINDS or not isinstance(d.get("config"), dict) or not isinstance(d.get("tensors"), dict):
        raise CheckpointError(f"{file}: needs kind ({' or '.join(KINDS)}), a config object and a tensors object")
    return CheckpointMeta(d["kind"], d.get("layout", "hf"), d["config"], d["tensors"], d.get("own_embedding"))


def restore_params(path: str | Path) -> dict:
    """The parameter tree saved by :func:`save_checkpoint`, as numpy arrays in their saved dtypes."""
    import orbax.checkpoint as ocp

    params_dir = Path(path).absolute() / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{path}: no {PARAMS_DIR}/ directory (an incomplete conversion?)")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            tree = ckptr.restore(params_dir)
        except (ValueError, FileNotFoundError, OSError) as err:
            raise CheckpointError(f"{params_dir}: not a readable orbax checkpoint ({err})") from None
    return jax.tree.map(np.asarray, tree)


def load_checkpoint(path: str | Path) -> tuple[CheckpointMeta, dict]:
    return read_meta(path), restore_params(path)


def cast_floats(params: dict, dtype: str) -> dict:
    """Floating leaves cast to ``dtype`` (float32 or bfloat16) on the default device; ids and masks kept."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} not supported; choose one of {sorted(DTYPES)}")

    def cast(x):
        x = jnp.asarray(x)
        return x.astype(DTYPES[dtype]) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.tree.map(cast, params)


def stores_mxfp4_experts(path: str | Path) -> bool:
    """Whether a target directory (Hugging Face or converted JAX) stores MXFP4 experts, from its headers or
    ``peagle_config.json`` alone (a directory without weights: False; they are refused when loaded)."""
    from peagle_jax.models.tensors import WeightsError, open_safetensors

    if is_jax_checkpoint(path):
        return stores_mxfp4(read_meta(path).tensors)
    try:
        return stores_mxfp4(open_safetensors(path))
    except WeightsError:
        return False


def load_target_any(
    path: str | Path, *, dtype: str = "float32", aux_layer_ids=None, experts: str = "auto"
) -> tuple[ModelConfig, dict]:
    """(cfg, params) of a target: a Hugging Face directory (:func:`peagle_jax.models.weights.load_target`) or a
    converted JAX directory, params cast to ``dtype`` and placed on the default device. ``experts``: packed
    or unpacked MXFP4 experts (:func:`peagle_jax.models.weights.resolve_experts`); a JAX checkpoint saved
    packed is unpacked on the host when asked to."""
    if not is_jax_checkpoint(path):
        return load_target(path, dtype=dtype, aux_layer_ids=aux_layer_ids, experts=experts)
    meta = read_meta(path)
    if meta.kind != "target":
        raise CheckpointError(f"{path} holds a {meta.kind}, not a target model")
    cfg = from_hf_config(meta.config, dtype=dtype, aux_layer_ids=aux_layer_ids)
    params = restore_params(path)
    stored = stored_experts(params)
    check_params(flatten(params), expected_shapes(with_experts(cfg, stored)), f"{cfg.family} model")
    cfg = resolve_experts(cfg, experts, mxfp4_stored=stored == "packed", where=str(path))
    if stored == "packed" and cfg.moe.experts == "unpacked":
        params = unpacked_experts(params, dtype)
    return cfg, cast_floats(params, dtype)
