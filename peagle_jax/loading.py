"""Loading what a run decodes with: the model directory, its tokenizer, its configs, and the generator.

The library side of the command-line entry points (``generate``, ``serve``, ``neuron``, the benchmarks):
they parse flags into a :class:`GeneratorOptions` and call :func:`build_generator`; nothing here reads an
``argparse.Namespace``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

DEFAULT_MODEL = "smollm2"  # the embedded default target: SmolLM2-135M-Instruct from a PyPI wheel


@dataclasses.dataclass(frozen=True)
class GeneratorOptions:
    """How to build a generator. ``drafter`` is a resolved directory (see
    :func:`peagle_jax.drafter.shipped.resolve_drafter`), or None for plain decoding; ``tree`` a static tree
    spec (:func:`peagle_jax.spec.tree.parse_tree`), or None for a chain of ``k`` (or of the drafter config's
    K); ``adaptive``: each step's length is chosen by measured throughput
    (:meth:`peagle_jax.spec.generator.SpeculativeGenerator.stream`); ``expert_split``: how a mesh splits a
    mixture-of-experts target's experts (:func:`peagle_jax.sharding.expert_split`); ``experts``: whether a
    GPT-OSS target's MXFP4 experts stay packed (``auto``: where the checkpoint stores them so; see
    :func:`peagle_jax.models.weights.resolve_experts`); ``window_buckets``: the attention windows below the
    whole cache (None: the default buckets, see :class:`peagle_jax.engine.generator.Generator`)."""

    dtype: str = "float32"
    max_seq_len: int = 2048
    drafter: str | None = None
    k: int | None = None
    tree: str | None = None
    sequential: bool = False
    fused: bool = False
    adaptive: bool = False
    expert_split: str = "auto"
    experts: str = "auto"
    window_buckets: tuple[int, ...] | None = None


def resolve_model_dir(model: str) -> Path:
    """``smollm2`` -> the cached embedded default (fetched and converted on first use); anything else must be
    an existing directory."""
    if model == DEFAULT_MODEL:
        from peagle_jax.models.gguf import default_model_dir

        return default_model_dir()
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"--model {model}: no such directory")
    return path


# tokenizer_config.json classes that AutoTokenizer resolves to transformers' generic fast tokenizer
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer, or None when it has none (then only token-id prompts work). A tokenizer
    whose config names the generic fast class is built from that class directly: the same tokenizer
    AutoTokenizer builds, without it reading the model config, which imports the model's transformers module
    (and PyTorch where it is installed): most of a server's tokenizer time."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from peagle_jax.hf_tokenizers import transformers

    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        named = None
    if named in GENERIC_TOKENIZERS and (model_dir / "tokenizer.json").exists():
        return transformers().PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return transformers().AutoTokenizer.from_pretrained(str(model_dir))


def target_config(model: str, dtype: str, aux_layer_ids=None, experts: str = "auto"):
    """The target's config only (no weights): Hugging Face or converted JAX directory, or ``smollm2``; its
    experts packed or unpacked as a load with ``experts`` holds them (from the weights' headers)."""
    from peagle_jax.checkpoint import is_jax_checkpoint, read_meta, stores_mxfp4_experts
    from peagle_jax.models.hf_config import from_hf_config, read_config_json
    from peagle_jax.models.weights import resolve_experts

    path = resolve_model_dir(model)
    config = read_meta(path).config if is_jax_checkpoint(path) else read_config_json(path)
    cfg = from_hf_config(config, dtype=dtype, aux_layer_ids=aux_layer_ids)
    return resolve_experts(cfg, experts, mxfp4_stored=stores_mxfp4_experts(path), where=str(path))


def configs(model: str, drafter: str | None, dtype: str, experts: str = "auto"):
    """(target config, drafter config, a line saying which drafter) for a model and drafter, without weights:
    the given drafter, else the shipped default of the model, else a random P-EAGLE drafter of the target's
    shape (:func:`peagle_jax.drafter.config.random_drafter_config`; graph shapes do not depend on weights).
    ``experts``: as :func:`target_config`."""
    from peagle_jax.drafter.config import random_drafter_config
    from peagle_jax.drafter.shipped import resolve_drafter

    drafter = drafter or resolve_drafter(model, None, None)
    if drafter:
        from peagle_jax.drafter.load import load_drafter

        dcfg = load_drafter(drafter, dtype=dtype)[0]
        cfg = target_config(model, dtype, dcfg.aux_layer_ids, experts)
        return cfg, dcfg, f"drafter {drafter} ({dcfg.algorithm}, {dcfg.layer.num_layers} layers)"
    cfg = target_config(model, dtype, experts=experts)
    note = (
        "no --drafter: a randomly initialised 2-layer P-EAGLE drafter of the target's shape "
        "(graph shapes do not depend on weights)"
    )
    return cfg, random_drafter_config(cfg), note


def _placed(cfg, params, mesh, opts: GeneratorOptions):
    """The target's parameters on ``mesh`` with the experts split as ``opts.expert_split`` says (a generator
    keeps a placement it is given), or as they are without a mesh."""
    if mesh is None:
        return params
    from peagle_jax.sharding import shard_target

    return shard_target(cfg, params, mesh, opts.expert_split)


def speculative_generator(opts: GeneratorOptions, model_dir: Path, mesh=None):
    """Target + drafter (``opts.drafter``), with the drafter's aux taps applied to the target."""
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.spec.generator import SpeculativeGenerator
    from peagle_jax.spec.tree import parse_tree

    dcfg, dparams = load_drafter(opts.drafter, dtype=opts.dtype)
    cfg, params = load_target_any(model_dir, dtype=opts.dtype, aux_layer_ids=dcfg.aux_layer_ids, experts=opts.experts)
    params = _placed(cfg, params, mesh, opts)
    return SpeculativeGenerator(
        cfg,
        params,
        dcfg,
        dparams,
        k=opts.k,
        tree=parse_tree(opts.tree) if opts.tree else None,
        sequential=opts.sequential,
        fused=opts.fused,
        max_seq_len=opts.max_seq_len,
        mesh=mesh,
        adaptive=opts.adaptive,
        window_buckets=opts.window_buckets,
    )


def build_generator(opts: GeneratorOptions, model_dir: Path, mesh=None):
    """A :class:`~peagle_jax.engine.generator.Generator` (no drafter) or a
    :class:`~peagle_jax.spec.generator.SpeculativeGenerator`."""
    if opts.drafter is not None:
        return speculative_generator(opts, model_dir, mesh)
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.engine.generator import Generator

    cfg, params = load_target_any(model_dir, dtype=opts.dtype, experts=opts.experts)
    params = _placed(cfg, params, mesh, opts)
    return Generator(cfg, params, max_seq_len=opts.max_seq_len, mesh=mesh, window_buckets=opts.window_buckets)


def add_experts_flag(p) -> None:
    """``--experts`` of the commands that decode (``generate``, ``serve``): how a GPT-OSS target holds its
    MXFP4 experts (:func:`peagle_jax.models.weights.resolve_experts`)."""
    p.add_argument(
        "--experts",
        choices=["auto", "packed", "unpacked"],
        default="auto",
        help="a GPT-OSS target's MXFP4 experts: packed = kept as the checkpoint's uint8 blocks and scales (4.25 "
        "bits per weight; each step unpacks the experts it reads), unpacked = dequantized to --dtype at load; "
        "auto (default): packed where the checkpoint stores its experts as MXFP4, else unpacked",
    )
