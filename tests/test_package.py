"""The package's lazy public API: ``import peagle_jax`` is cheap, and each name resolves to its object."""

import importlib
import subprocess
import sys

import pytest

import peagle_jax
from peagle_jax.checkpoint import load_target_any
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.load import load_drafter
from peagle_jax.engine.generator import Generator
from peagle_jax.loading import GeneratorOptions, build_generator, load_tokenizer, resolve_model_dir
from peagle_jax.models.config import ModelConfig
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.tree import chain, parse_tree

PUBLIC = [
    Generator, SpeculativeGenerator, GeneratorOptions, build_generator, resolve_model_dir, load_tokenizer,
    load_drafter, load_target_any, parse_tree, chain, ModelConfig, DrafterConfig,
]  # fmt: skip
WHERE = {obj.__name__: obj for obj in PUBLIC}


def test_all_lists_the_entry_points():
    assert sorted(peagle_jax.__all__) == sorted(WHERE)
    assert set(WHERE) <= set(dir(peagle_jax))


@pytest.mark.parametrize("name", sorted(WHERE))
def test_lazy_names_resolve_to_their_objects(name):
    assert getattr(peagle_jax, name) is WHERE[name]


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


def test_no_pytorch_advisory_line_where_pytorch_is_absent():
    """peagle_jax uses transformers for tokenizers only; without PyTorch (hidden here) transformers would print
    "PyTorch was not found" on every run, unless imported through peagle_jax.hf_tokenizers."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"}
    hide = "import sys; sys.modules['torch'] = None; "

    def run(code: str):
        return subprocess.run([sys.executable, "-c", hide + code], capture_output=True, text=True, env=env)

    plain = run("import transformers")
    assert "PyTorch was not found" in plain.stderr  # the line this guards against exists
    ours = run("from peagle_jax.hf_tokenizers import transformers; transformers().AutoTokenizer")
    assert ours.returncode == 0, ours.stderr
    assert "PyTorch was not found" not in ours.stderr
