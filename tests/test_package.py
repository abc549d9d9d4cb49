"""The package's lazy public API: ``import peagle_jax`` is cheap, and each name resolves to its object."""

import importlib
import subprocess
import sys

import pytest

import peagle_jax

WHERE = {
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


def test_all_lists_the_entry_points():
    assert sorted(peagle_jax.__all__) == sorted(WHERE)
    assert set(WHERE) <= set(dir(peagle_jax))


@pytest.mark.parametrize("name", sorted(WHERE))
def test_lazy_names_resolve_to_their_objects(name):
    assert getattr(peagle_jax, name) is getattr(importlib.import_module(WHERE[name]), name)


def test_from_import_and_submodules_still_work():
    from peagle_jax import ModelConfig, chain, ops

    assert ModelConfig is importlib.import_module("peagle_jax.models.config").ModelConfig
    assert chain(2).depth == 2
    assert ops.__name__ == "peagle_jax.ops"


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        peagle_jax.no_such_name  # noqa: B018
    assert not hasattr(peagle_jax, "Tree")  # importable from peagle_jax.spec.tree, not re-exported


def test_import_does_not_import_jax():
    code = "import sys, peagle_jax; assert 'jax' not in sys.modules, 'jax imported'; print(peagle_jax.__all__[0])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Generator"
