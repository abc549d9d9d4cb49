"""The drafters shipped inside the package, and which one a run uses by default.

``peagle_jax/drafter/shipped/<name>/`` holds a speculators-format drafter (``config.json``, bf16
``model.safetensors``) and its training card (``README.md``). The embedded default target (``smollm2``) is
speculated with ``smollm2-peagle`` unless ``--k 0`` turns speculation off; other targets have no default
drafter (pass ``--drafter``). A shipped drafter may name the static draft tree that ``generate`` and ``serve``
draft when neither ``--k`` nor ``--tree`` is given (:data:`DEFAULT_TREE`, through :func:`default_tree`);
without one, a chain of the drafter config's K.
"""

from __future__ import annotations

from pathlib import Path

from peagle_jax.errors import UserError

SHIPPED_DIR = Path(__file__).resolve().parent
# target name (as --model spells it) -> shipped drafter used by default
DEFAULT_FOR_MODEL = {"smollm2": "smollm2-peagle"}
# shipped drafter -> the tree generate and serve draft when neither --k nor --tree is given: the 7-node tree
# `python -m peagle_jax.bench.trees` grew for it (it verifies as many tokens per step as a chain of 7 and
# drafts only 2 deep; MT-Bench acceptance in docs/bench/trees/README.md)
DEFAULT_TREE = {"smollm2-peagle": "0,1,2,3,4,00,01"}


def shipped_drafter(name: str) -> Path:
    """The directory of the shipped drafter ``name``."""
    path = SHIPPED_DIR / name
    if not (path / "config.json").is_file():
        have = sorted(p.name for p in SHIPPED_DIR.glob("*/config.json"))
        raise UserError(f"no shipped drafter {name!r} in {SHIPPED_DIR} (shipped: {', '.join(have) or 'none'})")
    return path


def resolve_drafter(model: str, drafter: str | None, k: int | None) -> str | None:
    """The drafter a run uses: ``--drafter``; else the shipped default of ``--model``; none with ``--k 0``."""
    if k == 0:
        return None
    if drafter is not None:
        return drafter
    name = DEFAULT_FOR_MODEL.get(model)
    return None if name is None else str(shipped_drafter(name))


def default_tree(drafter: str | None, k: int | None, tree: str | None) -> str | None:
    """The tree a run drafts: ``--tree``; else, without ``--k``, the :data:`DEFAULT_TREE` of a shipped
    drafter; else None (a chain of ``--k``, or of the drafter config's K)."""
    if tree or k is not None or drafter is None:
        return tree
    path = Path(drafter).resolve()
    return DEFAULT_TREE.get(path.name) if path.parent == SHIPPED_DIR else None


def check_speculation_flags(drafter: str | None, k: int | None, flags: dict[str, object]) -> None:
    """One-line errors for speculation flags that cannot apply: with ``--k 0`` (off) or without a drafter.
    ``flags`` maps flag names to their values (falsy = not given)."""
    given = [name for name, value in flags.items() if value]
    if k == 0 and given:
        raise UserError(f"--k 0 turns speculative decoding off; {', '.join(given)} need it on")
    if k is not None and k < 0:
        raise UserError(f"--k must be >= 0 (0 = no speculation), got {k}")
    if drafter is None and k is not None and k > 0:
        given = ["--k", *given]
    if drafter is None and given:
        raise UserError(
            f"{', '.join(given)} need a drafter: pass --drafter DIR (only the embedded smollm2 target has a "
            "shipped default drafter)"
        )
