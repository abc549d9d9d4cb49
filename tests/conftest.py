"""Shared fixtures: random tiny Hugging Face models written with ``save_pretrained``; one JAX compilation
cache for the whole run."""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_numpy_rank_promotion", "raise")

# The run's compilation cache: made by the first pytest process, found by its xdist workers here. Unbounded:
# a size bound makes JAX lock the directory and total its files at every write, which slowed the suite. An
# entry read while another process still writes it fails JAX's check: a warning, and the graph compiles.
RUN_CACHE = "PEAGLE_JAX_TEST_COMPILATION_CACHE"
_OWNED = pytest.StashKey[str]()  # the directory this process made, removed at its end


def pytest_configure(config):
    """One persistent compilation cache for the test run, in this process, its xdist workers and every
    process a test starts (through JAX's environment variables): a graph that several tests compile (the
    tiny models', a training step in each of a recipe's runs) compiles once. The graphs are the same as
    compiled afresh; tests that need a cold start give their own cache directory or ``--compilation-cache
    none``, and the no-recompile tests count a function's compiled entries, which a cache hit adds too."""
    path = os.environ.get(RUN_CACHE)
    if path is None:
        path = os.environ[RUN_CACHE] = tempfile.mkdtemp(prefix="peagle-jax-test-cache-")
        config.stash[_OWNED] = path
    settings = {"compilation_cache_dir": path, "persistent_cache_min_compile_time_secs": 0}
    for name, value in settings.items():
        os.environ[f"JAX_{name.upper()}"] = str(value)
        jax.config.update(f"jax_{name}", value)


def pytest_unconfigure(config):
    if path := config.stash.get(_OWNED, None):
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_graphs():
    """Drop JAX's compiled executables after each test module. XLA's CPU backend maps every compiled kernel
    into memory separately, and one pytest process compiling the whole suite's graphs would otherwise
    approach Linux's per-process limit (vm.max_map_count, 65530), where compiling fails (and where the
    serving warm-up's budget check, peagle_jax.platform.MapBudget, rightly refuses to go on)."""
    yield
    jax.clear_caches()
    from peagle_jax import executables

    executables.clear()


TINY = dict(hidden_size=64, intermediate_size=128, vocab_size=128, num_hidden_layers=4, head_dim=16)


def tiny_hf_model(family: str, *, seed: int = 0, heads: int = 4, kv_heads: int = 2, tied: bool = False, **extra):
    """A random tiny transformers model of ``family`` (llama, qwen2, qwen3), in eval mode."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[family]
    kwargs = {**TINY, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "tie_word_embeddings": tied}
    kwargs.update(extra)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # non-trivial norms and biases so that their mapping is tested too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def save_hf(tmp_path):
    """Save a transformers model (safetensors) into a fresh directory and return the path."""

    def save(model, name="model", **kwargs):
        path = tmp_path / name
        model.save_pretrained(path, **kwargs)
        return path

    return save
