"""docs/cli.md is generated from the argparse parsers (``python -m peagle_jax.cli_reference``) and must not
drift from them."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from peagle_jax import cli_reference
from peagle_jax.cli_reference import COMMANDS, DEFAULT_OUT, render

FIX = "run `python -m peagle_jax.cli_reference` to regenerate it"


@pytest.fixture(scope="module")
def rendered() -> str:
    return render()


def test_docs_match_the_parsers(rendered):
    assert DEFAULT_OUT.is_file(), f"{DEFAULT_OUT} is missing; {FIX}"
    assert DEFAULT_OUT.read_text() == rendered, f"{DEFAULT_OUT} differs from the argparse parsers; {FIX}"


def test_rendering_ignores_the_terminal_width(rendered, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    assert render() == rendered


def _leaves(parser: argparse.ArgumentParser, name: str):
    subs = list(cli_reference._subcommands(parser))
    if not subs:
        yield name, parser
    for sub_name, _, sub in subs:
        yield from _leaves(sub, f"{name} {sub_name}")


@pytest.mark.parametrize("command,module,builder", COMMANDS, ids=[c for c, _, _ in COMMANDS])
def test_every_command_has_options_and_a_section(command, module, builder, rendered):
    for name, parser in _leaves(cli_reference.build(module, builder), command):
        assert cli_reference.options(parser), f"{name}: no option in the reference"
        assert f"\n## {name}\n" in rendered or f"\n### {name}\n" in rendered, name


def test_a_new_flag_is_caught(rendered, monkeypatch):
    mod = importlib.import_module("peagle_jax.bench.sampling")
    original = mod.build_parser

    def with_dummy():
        p = original()
        p.add_argument("--dummy-flag", help="not documented yet")
        return p

    monkeypatch.setattr(mod, "build_parser", with_dummy)
    changed = render()
    assert changed != rendered
    assert "| `--dummy-flag` |" in changed


def test_check_command(tmp_path, capsys):
    out = tmp_path / "cli.md"
    assert cli_reference.main(["--check", "--out", str(out)]) == 1
    assert "python -m peagle_jax.cli_reference" in capsys.readouterr().err
    assert cli_reference.main(["--out", str(out)]) == 0
    assert cli_reference.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("--max-new-tokens", "--max-tokens-new"))
    assert cli_reference.main(["--check", "--out", str(out)]) == 1


def test_building_the_parsers_loads_no_model():
    """Importing every CLI module and building its parser stays cheap: no torch or transformers."""
    code = (
        "import sys; from peagle_jax.cli_reference import render; render(); "
        "print(' '.join(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"building the CLI parsers imported: {done.stdout.strip()}"
