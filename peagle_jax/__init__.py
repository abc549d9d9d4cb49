"""P-EAGLE speculative decoding in JAX: a Llama / Qwen target, P-EAGLE and EAGLE-3 drafters, lossless
speculative generation, an OpenAI-compatible server, Neuron / TPU export and drafter training.

Packages, by role:

- :mod:`peagle_jax.models`: the target model (config, Flax layers, KV cache, checkpoint rules, GGUF import).
- :mod:`peagle_jax.drafter`: the drafter (config, Flax module, parallel and sequential draft graphs,
  checkpoint formats, the drafters shipped in the package).
- :mod:`peagle_jax.engine`: plain generation (:class:`Generator`), its shape buckets, and launching a step
  before reading the last.
- :mod:`peagle_jax.spec`: speculative decoding (draft trees, the verify graph, the step graphs, host state,
  :class:`SpeculativeGenerator`, the adaptive step length, the graphs a setup calls).
- :mod:`peagle_jax.serve`: the OpenAI-compatible server and its slot engine (``python -m peagle_jax.serve``).
- :mod:`peagle_jax.neuron`: export for Neuron and TPU, the Neuron lint, the roofline planner.
- :mod:`peagle_jax.train`: training drafters end to end (``python -m peagle_jax.train``).
- :mod:`peagle_jax.bench`: benchmarks that measure forms side by side (``python -m peagle_jax.bench.<name>``).

Modules: :mod:`peagle_jax.loading` (model directory, tokenizer, :class:`GeneratorOptions` ->
:func:`build_generator`), :mod:`peagle_jax.checkpoint` (JAX checkpoints; :func:`load_target_any` reads a
Hugging Face or a converted target), :mod:`peagle_jax.convert` (``python -m peagle_jax.convert``: PyTorch <->
JAX checkpoints), :mod:`peagle_jax.generate` (``python -m peagle_jax.generate``), and the numerical core
:mod:`peagle_jax.ops`, :mod:`peagle_jax.sampling`, :mod:`peagle_jax.sharding`, :mod:`peagle_jax.platform`.

The names below are imported on first use (PEP 562), so ``import peagle_jax`` stays cheap and imports no JAX.
Shape letters in names (``logits_BTV``): docs/glossary.md.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "Generator": "peagle_jax.engine.generator",
    "SpeculativeGenerator": "peagle_jax.spec.generator",
    "GeneratorOptions": "peagle_jax.loading",
    "build_generator": "peagle_jax.loading",
    "resolve_model_dir": "peagle_jax.loading",
    "load_tokenizer": "peagle_jax.loading",
    "load_drafter": "peagle_jax.drafter.load",
    "load_target_any": "peagle_jax.checkpoint",
    "parse_tree": "peagle_jax.spec.tree",
    "chain": "peagle_jax.spec.tree",
    "ModelConfig": "peagle_jax.models.config",
    "DrafterConfig": "peagle_jax.drafter.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
