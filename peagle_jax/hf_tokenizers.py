"""``transformers``, which peagle_jax imports for its tokenizers only (they need no PyTorch)."""

from __future__ import annotations

import os


def transformers():
    """The ``transformers`` module, imported without its advisory line that PyTorch was not found (printed on
    every run where PyTorch is absent, which is the normal case for peagle_jax)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import transformers as module

    return module
