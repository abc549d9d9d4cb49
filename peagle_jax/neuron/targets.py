"""The target and drafter configs ``neuron export`` and ``neuron plan`` work from, without weights.

``--model`` is a model directory (Hugging Face or converted), ``smollm2``, or a bare ``config.json`` file:
``neuron/configs/`` holds the config.json of gpt-oss-20b, gpt-oss-120b and Qwen3-Coder-30B-A3B-Instruct,
so their full-size graphs and plans need no checkpoint.

Without ``--drafter``, the stand-in drafter has the shape of the released P-EAGLE drafter where one exists
for the target (:data:`RELEASED`: 4 layers, the target's width and heads, the full target vocabulary with
an identity ``d2t`` / ``t2d``, trained for K parallel tokens), else a 2-layer P-EAGLE drafter of the
target's shape. A graph's shapes do not depend on weights, so the stand-in is randomly initialised; only
its MLP width (the target's ``intermediate_size`` here) may differ from a released checkpoint's, which
``--drafter DIR`` reads exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from peagle_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Released:
    """A released P-EAGLE drafter: its target's identity (family, layers, experts) and its K."""

    name: str
    family: str
    num_layers: int
    num_experts: int
    k: int
    drafter_layers: int = 4


# The released P-EAGLE drafters (issue 34): GPT-OSS-20B trained for 10 parallel tokens, gpt-oss-120b for 8,
# Qwen3-Coder-30B-A3B for 18; 4 layers each, drafting over the whole target vocabulary.
RELEASED = (
    Released("gpt-oss-20b", "gpt_oss", 24, 32, 10),
    Released("gpt-oss-120b", "gpt_oss", 36, 128, 8),
    Released("Qwen3-Coder-30B-A3B-Instruct", "qwen3_moe", 48, 128, 18),
)


def released_for(cfg) -> Released | None:
    """The released drafter for a target of ``cfg``'s architecture, if any."""
    if cfg.moe is None:
        return None
    for r in RELEASED:
        if (cfg.family, cfg.num_layers, cfg.moe.num_experts) == (r.family, r.num_layers, r.num_experts):
            return r
    return None


def released_drafter_config(cfg, released: Released):
    """A drafter of the released shape for ``cfg`` (see the module doc)."""
    from peagle_jax.drafter.config import random_drafter_config

    dcfg = random_drafter_config(cfg, layers=released.drafter_layers)
    return dcfg.replace(
        layer=dcfg.layer.replace(tie_word_embeddings=False), full_vocab_map=True, speculative_tokens=released.k
    )


def read_target(model: str, dtype: str, aux_layer_ids=None, experts: str = "auto"):
    """The target config of ``--model``: a config.json file (its experts MXFP4 where its
    ``quantization_config`` says so, as on the hub), or what :func:`peagle_jax.loading.target_config` reads (a
    directory or ``smollm2``), with the expert format ``experts`` asks for."""
    from peagle_jax.loading import target_config
    from peagle_jax.models.hf_config import from_hf_config, read_json_object
    from peagle_jax.models.weights import resolve_experts
    from peagle_jax.neuron.plan import checkpoint_experts

    path = Path(model)
    if path.suffix != ".json":
        return target_config(model, dtype, aux_layer_ids, experts)
    if not path.is_file():
        raise UserError(f"--model {model}: no such file")
    cfg = from_hf_config(read_json_object(path, f"--model {model}"), dtype=dtype, aux_layer_ids=aux_layer_ids)
    stored = checkpoint_experts(model) == "packed"
    return resolve_experts(cfg, experts, mxfp4_stored=stored, where=f"--model {model}")


def configs(model: str, drafter: str | None, dtype: str, experts: str = "auto"):
    """(target config, drafter config, a line saying which drafter), without weights; a GPT-OSS target's
    experts packed or unpacked as ``experts`` (auto: as its checkpoint stores them)."""
    from peagle_jax import loading

    if drafter:
        from peagle_jax.drafter.load import load_drafter

        dcfg = load_drafter(drafter, dtype=dtype)[0]
        cfg = read_target(model, dtype, dcfg.aux_layer_ids, experts)
        return cfg, dcfg, f"drafter {drafter} ({dcfg.algorithm}, {dcfg.layer.num_layers} layers)"
    if Path(model).suffix != ".json":
        cfg, dcfg, note = loading.configs(model, None, dtype, experts)
        if not note.startswith("no --drafter"):  # a shipped drafter
            return cfg, dcfg, note
    else:
        cfg = read_target(model, dtype, experts=experts)
    released = released_for(cfg)
    if released is None:
        from peagle_jax.drafter.config import random_drafter_config

        note = (
            "no --drafter: a randomly initialised 2-layer P-EAGLE drafter of the target's shape "
            "(graph shapes do not depend on weights)"
        )
        return cfg, random_drafter_config(cfg), note
    note = (
        f"no --drafter: a randomly initialised P-EAGLE drafter of the released {released.name} drafter's shape "
        f"({released.drafter_layers} layers, width {cfg.hidden_size}, full vocabulary {cfg.vocab_size}, "
        f"trained for K = {released.k}; graph shapes do not depend on weights)"
    )
    return cfg, released_drafter_config(cfg, released), note
