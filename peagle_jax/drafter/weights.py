"""Drafter checkpoints (speculators or EAGLE / AWS layout) <-> the drafter's parameter tree.

The decoder layers use the target's rules (:func:`peagle_jax.models.weights.decoder_layer_rules`): layer 0 reads
2D-wide inputs and is named ``layers.0.*`` (speculators) or ``midlayer.*`` (EAGLE / AWS); layers 1..L-1 are
``layers.{i}.*`` in both. The drafter's own top-level tensors map one to one. Conversion keeps each tensor's
dtype (bf16 stays bf16), except ``d2t``, which is int32 here (speculators saves int64) and goes back to the
dtype the caller names, so that PyTorch -> JAX -> PyTorch is bit for bit.
"""

from __future__ import annotations

import re

import jax
import numpy as np

from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.models.weights import (
    _SAME,
    WeightsError,
    check_params,
    decoder_layer_rules,
    flat_from_tensors,
    flat_to_tensors,
    flatten,
    make_rules,
    tree_shapes,
    unflatten,
)

LAYOUTS = ("speculators", "eagle")
# The one difference between the layouts' tensor names: what layer 0 is called.
LAYER0_PREFIX = {"speculators": "layers.0.", "eagle": "midlayer."}
# Tensors that drafter checkpoints may carry but that inference does not use: speculators' training-only copies
# of the verifier's head and norm (never saved by speculators itself, but seen in the wild) and RoPE buffers.
IGNORED = re.compile(r"(verifier_lm_head\.weight|verifier_norm\.weight|(.*\.)?rotary_emb\..*)$")


def _d2t_to_jax(w: np.ndarray) -> np.ndarray:
    """``d2t`` holds offsets (target id = draft id + d2t[draft id]); int32 here, as every device wants ids."""
    if not np.issubdtype(w.dtype, np.integer):
        raise WeightsError(f"tensor 'd2t' must hold integer offsets, got dtype {w.dtype}")
    info = np.iinfo(np.int32)
    if w.size and (w.min() < info.min or w.max() > info.max):
        raise WeightsError(f"tensor 'd2t' holds offsets outside int32 ({w.min()}..{w.max()})")
    return w.astype(np.int32)


_D2T = (_d2t_to_jax, lambda p: p.astype(np.int64))  # int64 back, as speculators and EAGLE save it
_T2D = (lambda w: w.astype(np.bool_), lambda p: p)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise WeightsError(f"unknown drafter layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def drafter_rules(cfg: DrafterConfig, layout: str):
    """The drafter's top-level rules, then layer 0's (2D inputs), then layers 1..L-1 (D inputs); layer 0's
    rules come first so that they name ``layers.0`` in either layout."""
    _check_layout(layout)
    lc, D = cfg.layer, cfg.hidden_size
    top = [
        ("embed_tokens.weight", "embed_tokens", _SAME, None),
        ("fc.weight", "fc/weight", _SAME, None),
        ("input_norm.weight", "input_norm/weight", _SAME, None),
        ("fc_norm.{}.weight", "fc_norm.{}/weight", _SAME, None),
        ("norm.weight", "norm/weight", _SAME, None),
        ("lm_head.weight", "lm_head/weight", _SAME, None),
        ("mask_hidden", "mask_hidden", _SAME, None),
        ("d2t", "d2t", _D2T, None),
        ("t2d", "t2d", _T2D, None),
    ]
    return (
        make_rules(top)
        + decoder_layer_rules(lc, LAYER0_PREFIX[layout], "layers.0/", 2 * D)
        + decoder_layer_rules(lc, "layers.{}.", "layers.{}/", D)
    )


def expected_drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flat ``path -> (shape, dtype)`` of the drafter's parameters, from the module at zero memory cost."""
    from peagle_jax.drafter.model import init_drafter_params

    return tree_shapes(jax.eval_shape(lambda: init_drafter_params(cfg, jax.random.key(0))))


def _what(cfg: DrafterConfig, layout: str) -> str:
    return f"{cfg.algorithm} drafter in the {layout} layout"


def drafter_params_from_tensors(tensors: dict[str, np.ndarray], cfg: DrafterConfig, layout: str) -> dict:
    """The drafter parameter tree of a checkpoint's tensors, each in its own dtype (``d2t`` as int32).

    ``cfg.own_embedding`` must say whether ``embed_tokens.weight`` is there (:func:`with_embedding_of` sets
    it). Missing, unexpected (other than :data:`IGNORED`) or mis-shaped tensors are a :class:`WeightsError`.
    """
    _check_layout(layout)
    if cfg.parallel and "mask_hidden" not in tensors:
        raise WeightsError(
            "the checkpoint has no 'mask_hidden', which a parallel (P-EAGLE) drafter needs for its placeholder "
            "slots; an EAGLE-3 drafter's config has no mask token id"
        )
    flat = flat_from_tensors(
        tensors,
        drafter_rules(cfg, layout),
        expected_drafter_shapes(cfg),
        what=_what(cfg, layout),
        keep_dtype=True,
        skip=IGNORED,
    )
    return unflatten(flat)


def check_drafter_params(flat: dict[str, object], cfg: DrafterConfig) -> None:
    """Every parameter of ``cfg`` present, nothing else, each with the shape ``cfg`` implies."""
    check_params(flat, expected_drafter_shapes(cfg), f"{cfg.algorithm} drafter")


def drafter_params_to_tensors(
    params: dict, cfg: DrafterConfig, layout: str, dtypes: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    """The inverse of :func:`drafter_params_from_tensors`: tensor name -> numpy array in ``layout``.

    Each tensor keeps its parameter's dtype unless ``dtypes`` (name -> dtype name) says otherwise; ``d2t``
    defaults to int64, as speculators and EAGLE save it.
    """
    flat = flatten(params)
    check_drafter_params(flat, cfg)
    return flat_to_tensors(flat, drafter_rules(cfg, layout), dtypes)


def with_embedding_of(cfg: DrafterConfig, names) -> DrafterConfig:
    """``cfg`` following the optional tensors among ``names``: ``own_embedding`` whether
    ``embed_tokens.weight`` is there, ``full_vocab_map`` whether a full-vocabulary drafter carries ``d2t``."""
    full = cfg.draft_vocab_size == cfg.layer.vocab_size and "d2t" in names
    return cfg.replace(own_embedding="embed_tokens.weight" in names, full_vocab_map=full)


def rename_for_layout(name: str, src: str, dst: str) -> str:
    """A tensor name of layout ``src`` as layout ``dst`` spells it (only layer 0's prefix differs)."""
    _check_layout(src)
    _check_layout(dst)
    old, new = LAYER0_PREFIX[src], LAYER0_PREFIX[dst]
    return new + name[len(old) :] if name.startswith(old) else name
