"""``python -m peagle_jax.convert``: PyTorch checkpoints <-> JAX checkpoints, for drafters and targets.

    to-jax SRC DST [--experts auto|packed|unpacked] [--force]
        SRC: a speculators drafter (peagle / eagle3), an EAGLE / AWS-layout drafter, or a Hugging Face
        Llama / Qwen2 / Qwen3 / GPT-OSS / Qwen3-MoE model directory. DST: a JAX checkpoint (see
        :mod:`peagle_jax.checkpoint`).
    to-torch SRC DST [--layout speculators|eagle] [--max-shard-size 2GB] [--dtype bfloat16]
                     [--verifier NAME] [--experts auto|packed|unpacked] [--force]
        SRC: a JAX checkpoint, or a PyTorch directory (to change a drafter's layout, dtype or sharding).
        DST: config.json plus model.safetensors, or shards and model.safetensors.index.json.
        --dtype casts every floating tensor (how the shipped drafters are stored in bf16); --verifier
        names the target a speculators drafter was trained for (what vLLM's --model should be).

PyTorch -> JAX -> PyTorch reproduces every tensor bit for bit (names, shapes, dtypes, values) and, when the
layout is unchanged, the config.json itself. GPT-OSS's MXFP4 experts stay packed by default (``--experts
auto``): the uint8 blocks and scales, written back byte for byte; ``--experts unpacked`` dequantizes them to
bfloat16, as transformers does, and writes them unquantized. A layout change rewrites the config from the parsed
:class:`DrafterConfig` (the EAGLE layout has no verifier entry, so that is lost on the way through it).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from peagle_jax.checkpoint import (
    META_FILE,
    PARAMS_DIR,
    CheckpointMeta,
    detect_kind,
    is_jax_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from peagle_jax.errors import ArgumentParser, UserError, check_output_dir, report
from peagle_jax.models.hf_config import read_config_json
from peagle_jax.models.weights import EXPERT_CHOICES

LAYOUT_CHOICES = ("speculators", "eagle")
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
# Small files copied along both ways (tokenizer, generation config, chat template ...).
SIDE_SUFFIXES = {".json", ".txt", ".model", ".jinja", ".tiktoken"}
OWN_FILES = {"config.json", META_FILE, "model.safetensors.index.json"}


def read_source(src: str | Path, experts: str = "auto") -> tuple[CheckpointMeta, dict]:
    """(meta, params) of a JAX checkpoint, or of a PyTorch directory as :func:`to_jax` would save it; a
    target's MXFP4 experts packed or unpacked (to bfloat16) as ``experts`` says
    (:func:`peagle_jax.models.weights.resolve_experts`)."""
    from peagle_jax.drafter.load import read_torch_drafter
    from peagle_jax.drafter.weights import IGNORED, drafter_params_from_tensors
    from peagle_jax.models.hf_config import from_hf_config
    from peagle_jax.models.tensors import dequantized, open_safetensors
    from peagle_jax.models.weights import SKIPPED, params_from_hf, resolve_experts, stores_mxfp4

    src = Path(src)
    if is_jax_checkpoint(src):
        meta, params = load_checkpoint(src)
        return _experts_as(meta, params, experts, src)
    if detect_kind(read_config_json(src)) == "drafter":
        _drafter_experts(experts)
        cfg, layout, config, tensors = read_torch_drafter(src)
        params = drafter_params_from_tensors(tensors, cfg, layout)
        dtypes = {name: str(t.dtype) for name, t in tensors.items() if not IGNORED.match(name)}
        return CheckpointMeta("drafter", layout, config, dtypes, own_embedding=cfg.own_embedding), params
    config = read_config_json(src)
    tensors = open_safetensors(src)
    cfg = resolve_experts(from_hf_config(config), experts, mxfp4_stored=stores_mxfp4(tensors), where=str(src))
    if cfg.moe is None or cfg.moe.experts == "unpacked":
        tensors = dequantized(tensors, "bfloat16")  # MXFP4 experts are written back unquantized
    params = params_from_hf(tensors, cfg, keep_dtype=True)
    dtypes = {name: str(tensors.dtype(name)) for name in tensors if not SKIPPED.match(name)}
    return CheckpointMeta("target", "hf", config, dtypes), params


def _drafter_experts(experts: str) -> None:
    if experts != "auto":
        raise UserError(f"--experts {experts} applies to target models; this is a drafter")


def _experts_as(meta: CheckpointMeta, params: dict, experts: str, src: Path) -> tuple[CheckpointMeta, dict]:
    """A JAX checkpoint's (meta, params) with its experts as ``experts`` asks: packed ones unpacked to
    bfloat16 (their names in ``meta.tensors`` then the unquantized ones) where it says ``unpacked``."""
    from peagle_jax.models import mxfp4
    from peagle_jax.models.hf_config import from_hf_config
    from peagle_jax.models.weights import resolve_experts, stored_experts, unpacked_experts

    if meta.kind != "target":
        _drafter_experts(experts)
        return meta, params
    stored = stored_experts(params)
    cfg = resolve_experts(from_hf_config(meta.config), experts, mxfp4_stored=stored == "packed", where=str(src))
    if stored == "packed" and cfg.moe.experts == "unpacked":
        params = unpacked_experts(params, "bfloat16")
        pairs = mxfp4.mxfp4_pairs(meta.tensors)
        tensors = {n: d for n, d in meta.tensors.items() if not mxfp4.is_mxfp4_name(n)}
        meta = dataclasses.replace(meta, tensors={**tensors, **dict.fromkeys(pairs, "bfloat16")})
    return meta, params


def _main_dtype(dtypes: dict[str, str]) -> str:
    """The dtype most floating tensors have (what a written config.json declares)."""
    floats = [d for d in dtypes.values() if d in FLOAT_DTYPES]
    return collections.Counter(floats).most_common(1)[0][0] if floats else "float32"


def _drafter_config_in(cfg, layout: str, dtypes: dict[str, str]) -> dict[str, Any]:
    from peagle_jax.drafter.config import to_eagle_config, to_speculators_config

    d = to_speculators_config(cfg) if layout == "speculators" else to_eagle_config(cfg)
    d["dtype"] = _main_dtype(dtypes)
    if "transformer_layer_config" in d:
        d["transformer_layer_config"]["dtype"] = d["dtype"]
    return d


def torch_tensors(meta: CheckpointMeta, params: dict, layout: str | None = None) -> tuple[dict, dict[str, Any]]:
    """(tensors, config dict) of the PyTorch checkpoint for ``meta`` and ``params`` in ``layout`` (drafters;
    default: the source's), each tensor in the dtype the source had."""
    from peagle_jax.drafter.config import drafter_config_from_dict
    from peagle_jax.drafter.weights import drafter_params_to_tensors, rename_for_layout
    from peagle_jax.models.hf_config import from_hf_config
    from peagle_jax.models.weights import (
        check_params,
        expected_shapes,
        flatten,
        params_to_hf,
        stored_experts,
        with_experts,
    )

    if meta.kind == "target":
        if layout not in (None, "hf"):
            raise UserError(f"--layout {layout} applies to drafters; this is a target model")
        cfg = with_experts(from_hf_config(meta.config), stored_experts(params))
        check_params(flatten(params), expected_shapes(cfg), f"{cfg.family} model")
        tensors = params_to_hf(params, cfg, dtypes=meta.tensors)
        if cfg.tie_word_embeddings and "lm_head.weight" in meta.tensors:  # the source stored a copy; so do we
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].astype(meta.tensors["lm_head.weight"])
        return tensors, meta.config
    out = layout or meta.layout
    cfg, _ = drafter_config_from_dict(meta.config)
    full_vocab_map = "d2t" in params and cfg.draft_vocab_size == cfg.layer.vocab_size
    cfg = cfg.replace(own_embedding="embed_tokens" in params, full_vocab_map=full_vocab_map)
    dtypes = {rename_for_layout(name, meta.layout, out): dtype for name, dtype in meta.tensors.items()}
    config = meta.config if out == meta.layout else _drafter_config_in(cfg, out, dtypes)
    return drafter_params_to_tensors(params, cfg, out, dtypes), config


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise UserError(f"{src}: no such directory")
    if dst.exists() and not dst.is_dir():
        raise UserError(f"{dst} exists and is not a directory")
    check_output_dir(dst, "DST")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UserError(f"SRC and DST are the same directory ({src})")
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UserError(f"{dst} is not empty; pass --force to overwrite it")


def _source_kind(src: Path) -> tuple[str, str]:
    """(kind, layout) of ``src`` from its config alone, before any weight is read: a flag that does not
    apply is refused at once."""
    from peagle_jax.checkpoint import read_meta
    from peagle_jax.drafter.config import drafter_config_from_dict

    if is_jax_checkpoint(src):
        meta = read_meta(src)
        return meta.kind, meta.layout
    config = read_config_json(src)
    if detect_kind(config) == "target":
        return "target", "hf"
    return "drafter", drafter_config_from_dict(config)[1]


def _check_flags(src: Path, layout: str | None, verifier: str | None) -> None:
    """The checks of :func:`torch_tensors` and :func:`_with_overrides` that need only the config."""
    if layout is None and verifier is None:
        return
    kind, src_layout = _source_kind(src)
    if kind == "target" and layout is not None:
        raise UserError(f"--layout {layout} applies to drafters; this is a target model")
    if verifier is not None and (kind != "drafter" or (layout or src_layout) != "speculators"):
        raise UserError("--verifier applies to drafters written in the speculators layout")


def _clear(dst: Path) -> None:
    """Remove what a previous conversion wrote (stale shards would be read back); leave other files alone."""
    if not dst.is_dir():
        return
    for f in dst.iterdir():
        if f.name == PARAMS_DIR and f.is_dir():
            shutil.rmtree(f)
        elif f.is_file() and (f.name in OWN_FILES or (f.name.startswith("model") and f.suffix == ".safetensors")):
            f.unlink()


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix in SIDE_SUFFIXES and f.name not in OWN_FILES:
            shutil.copy2(f, dst / f.name)


def to_jax(src: str | Path, dst: str | Path, *, experts: str = "auto", force: bool = False) -> CheckpointMeta:
    """Convert the PyTorch directory ``src`` (drafter or target) into the JAX checkpoint ``dst`` (a target's
    MXFP4 experts packed or unpacked as ``experts`` says)."""
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst, force)
    if is_jax_checkpoint(src):
        raise UserError(f"{src} is already a JAX checkpoint ({META_FILE}); to-torch converts it back")
    meta, params = read_source(src, experts)
    _clear(dst)
    save_checkpoint(dst, params, meta)
    _copy_side_files(src, dst)
    return meta


def to_torch(
    src: str | Path,
    dst: str | Path,
    *,
    layout: str | None = None,
    max_shard_size: int | str | None = None,
    dtype: str | None = None,
    verifier: str | None = None,
    experts: str = "auto",
    force: bool = False,
    progress: bool = False,
) -> list[Path]:
    """Write the JAX checkpoint (or PyTorch directory) ``src`` as a PyTorch directory ``dst``; returns the
    safetensors files written (several, plus an index, when they exceed ``max_shard_size``). ``dtype``
    casts the floating tensors (and declares it in config.json); ``verifier`` sets a speculators drafter's
    ``speculators_config.verifier.name_or_path``; ``experts``: a target's MXFP4 experts written back packed
    (as read, byte for byte) or unpacked (bfloat16)."""
    from peagle_jax.models.weights import parse_size, write_safetensors

    src, dst = Path(src), Path(dst)
    if layout is not None and layout not in LAYOUT_CHOICES:
        raise UserError(f"--layout must be one of {', '.join(LAYOUT_CHOICES)}, got {layout!r}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    try:
        shard_bytes = None if max_shard_size is None else parse_size(max_shard_size)
    except UserError as err:
        raise UserError(f"--max-shard-size: {err}") from None
    _check_paths(src, dst, force)
    _check_flags(src, layout, verifier)
    meta, params = read_source(src, experts)
    if dtype is not None:
        cast = {name: dtype if d in FLOAT_DTYPES else d for name, d in meta.tensors.items()}
        meta = dataclasses.replace(meta, tensors=cast)
    tensors, config = torch_tensors(meta, params, layout)
    config = _with_overrides(config, dtype, verifier, meta.kind, layout or meta.layout)
    _clear(dst)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    files = write_safetensors(dst, tensors, max_shard_size=shard_bytes, progress=progress)
    _copy_side_files(src, dst)
    return files


def _with_overrides(config: dict, dtype: str | None, verifier: str | None, kind: str, layout: str) -> dict:
    """A copy of ``config`` declaring ``dtype`` and naming ``verifier``."""
    config = json.loads(json.dumps(config))
    if dtype is not None:
        for d in (config, config.get("transformer_layer_config")):
            if isinstance(d, dict):
                d["dtype"] = dtype
                d.pop("torch_dtype", None)
    if verifier is not None:
        if kind != "drafter" or layout != "speculators":
            raise UserError("--verifier applies to drafters written in the speculators layout")
        spec = config.setdefault("speculators_config", {})
        spec.setdefault("verifier", {})["name_or_path"] = verifier
    return config


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m peagle_jax.convert",
        description="Convert drafter (speculators / EAGLE layout) and target (Hugging Face) checkpoints "
        "between PyTorch safetensors and JAX (orbax) directories, losslessly.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    j = sub.add_parser("to-jax", help="PyTorch directory -> JAX checkpoint directory")
    t = sub.add_parser("to-torch", help="JAX checkpoint (or PyTorch) directory -> PyTorch safetensors directory")
    for s in (j, t):
        s.add_argument("src", help="source directory")
        s.add_argument("dst", help="destination directory (created; must be empty unless --force)")
        s.add_argument("--force", action="store_true", help="overwrite the checkpoint files in a non-empty DST")
        s.add_argument(
            "--experts",
            choices=EXPERT_CHOICES,
            default="auto",
            help="a GPT-OSS target's MXFP4 experts: packed = the uint8 blocks and scales, kept byte for byte; "
            "unpacked = dequantized to bfloat16 (as transformers does) and written unquantized; auto (default): "
            "packed where the source stores them so",
        )
    t.add_argument(
        "--layout",
        choices=LAYOUT_CHOICES,
        help="drafter tensor and config layout to write (default: the source's); eagle = layer 0 as "
        "midlayer.*, flat Llama config with ptd_token_id (Llama layers only)",
    )
    t.add_argument(
        "--max-shard-size",
        default=None,
        help="split the weights into shards of at most this size, e.g. 2GB or 500MB (default: one file)",
    )
    t.add_argument(
        "--dtype",
        choices=FLOAT_DTYPES,
        help="cast every floating tensor to this dtype, e.g. bfloat16 to halve a drafter (default: keep each)",
    )
    t.add_argument(
        "--verifier",
        help="target model a speculators drafter drafts for, written to speculators_config.verifier.name_or_path "
        "(default: keep the source's)",
    )
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "to-jax":
            meta = to_jax(args.src, args.dst, experts=args.experts, force=args.force)
            what = f"{meta.kind} ({meta.layout} layout, {len(meta.tensors)} tensors)"
        else:
            files = to_torch(
                args.src,
                args.dst,
                layout=args.layout,
                max_shard_size=args.max_shard_size,
                dtype=args.dtype,
                verifier=args.verifier,
                experts=args.experts,
                force=args.force,
                progress=True,
            )
            what = f"{len(files)} safetensors file{'s' if len(files) > 1 else ''}"
    except (UserError, FileNotFoundError) as err:
        return report(err)
    print(f"wrote {what} to {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
