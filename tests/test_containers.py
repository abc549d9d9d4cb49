"""The container files name modules that exist: each ``python -c "..."`` check a Dockerfile runs at build time
imports only what the package (or the Neuron plugin) provides, so a moved module fails here, not in a build."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parent.parent / "serve"
PLUGINS = {"jax_neuronx"}  # installed from the Neuron pip repository only, in the Neuron image


def _imports(text: str) -> list[tuple[str, str | None]]:
    """(module, name) for every ``from M import N`` and ``import M`` inside the ``python -c`` strings."""
    found = []
    for script in re.findall(r'python -c "([^"]*)"', text):
        for stmt in script.split(";"):
            stmt = stmt.strip()
            if m := re.match(r"from ([\w.]+) import (\w+)", stmt):
                found.append((m.group(1), m.group(2)))
            elif m := re.match(r"import ([\w., ]+)", stmt):
                found += [(mod.strip(), None) for mod in m.group(1).split(",")]
    return found


@pytest.mark.parametrize("dockerfile", sorted(SERVE.glob("Dockerfile.*")), ids=lambda p: p.name)
def test_dockerfile_checks_import(dockerfile: Path) -> None:
    imports = _imports(dockerfile.read_text())
    assert any(mod.startswith("peagle_jax") for mod, _ in imports), "the image checks no peagle_jax import"
    for mod, name in imports:
        if mod in PLUGINS:
            continue
        module = importlib.import_module(mod)
        if name is not None:
            assert hasattr(module, name), f"{dockerfile.name}: {mod} has no {name}"


def test_a_moved_module_is_caught() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(_imports('python -c "from peagle_jax.gguf_loader import default_model_dir"')[0][0])
