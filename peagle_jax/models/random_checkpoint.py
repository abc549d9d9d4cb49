"""``python -m peagle_jax.models.random_checkpoint``: a random checkpoint in the hub's layout from a published
``config.json``, written tensor by tensor, so that a full-size model can be loaded and run without its weights.

    python -m peagle_jax.models.random_checkpoint --config neuron/configs/gpt-oss-20b.json --out DIR
    python -m peagle_jax.models.random_checkpoint --config CONFIG.json --out DIR --seed 1 --max-shard-size 2GB
    python -m peagle_jax.models.random_checkpoint --config CONFIG.json --out DIR --dry-run   # the layout only

``DIR`` gets ``config.json`` (the given file, byte for byte), ``generation_config.json`` and the weights:
``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` of at most ``--max-shard-size`` bytes
(a larger tensor gets a shard of its own) with ``model.safetensors.index.json``, as transformers writes them.

The tensors are the hub's, name for name, shape for shape and dtype for dtype: the names and shapes
come from the rule tables that load a checkpoint (:mod:`peagle_jax.models.weights`), so a checkpoint this
module writes is one that :func:`~peagle_jax.models.weights.load_target` and transformers' ``from_pretrained``
load without a missing or unexpected key. Floating tensors take the config's ``torch_dtype`` (``dtype``),
bfloat16 when it names none (GPT-OSS). Where the config's ``quantization_config`` says ``mxfp4`` (GPT-OSS
on the hub), each expert matrix ``NAME`` is the uint8 pair ``NAME_blocks`` ``(E, R, C/32, 16)`` and
``NAME_scales`` ``(E, R, C/32)`` of :mod:`peagle_jax.models.mxfp4`; a Qwen3-MoE checkpoint has one tensor per
expert (``experts.{e}.gate_proj.weight``), as on the hub. For gpt-oss-20b the total is 13,761,264,768 bytes,
the hub index's ``total_size``.

Values (random, not trained; enough to run every op on realistic magnitudes):

- matrices, embeddings, biases and GPT-OSS's attention sinks: normal with the config's ``initializer_range``
  (0.02 by default) as standard deviation; RMSNorm weights: ones;
- MXFP4 blocks: uniform random bytes, i.e. two uniform FP4 codes each (RMS value ``sqrt(68.5 / 8) = 2.93``);
- MXFP4 scales: uniform over three E8M0 exponents around ``log2(initializer_range / 2.93)`` (2**-8..2**-6 for
  0.02), so that dequantized experts have about the standard deviation of the other matrices: a layer's
  activations stay of order one and the model's logits finite.

Streaming: the shard plan and every safetensors header are computed from the shapes first; each file is
then written header first and each tensor's bytes in chunks of :data:`CHUNK_ELEMENTS` values as they are
generated, so peak memory is one chunk (tens of MB), never a tensor or the model. A file is written under a
temporary name and renamed when complete.

Determinism: a tensor's values depend only on the seed, its name, shape, dtype and kind (a random generator
per tensor, seeded with the seed and a hash of the name; fixed chunks), so the same seed gives the same
bytes whatever ``--max-shard-size`` is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from peagle_jax.errors import ArgumentParser, UserError, check_output_dir, report

__all__ = [
    "CHUNK_ELEMENTS",
    "GENERATION_IDS",
    "Layout",
    "TensorSpec",
    "build_parser",
    "generation_config",
    "layout",
    "main",
    "tensor_specs",
    "write_checkpoint",
]

CHUNK_ELEMENTS = 1 << 22  # values generated and written at a time (16 MiB of float32 temporaries)
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' default for save_pretrained
FP4_RMS = math.sqrt(68.5 / 8)  # RMS of the 16 FP4 values under uniform codes: (0^2 + .5^2 + ... + 6^2) / 8
_CODES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16, "U8": np.uint8}
_NAMES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
# The special ids of the published generation_config.json of the models whose vocabulary they index, by
# (model_type, vocab_size): gpt-oss-20b / 120b, and Qwen3-Coder-30B-A3B-Instruct (Qwen3's vocabulary).
GENERATION_IDS = {
    ("gpt_oss", 201088): dict(
        bos_token_id=199998, do_sample=True, eos_token_id=[200002, 199999, 200012], pad_token_id=199999
    ),
    ("qwen3_moe", 151936): dict(
        bos_token_id=151643, do_sample=True, eos_token_id=[151645, 151643], pad_token_id=151643
    ),
}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its hub name, shape, safetensors dtype code and how its values are drawn
    (``normal`` with ``std``, ``ones``, ``fp4`` random codes, ``e8m0`` exponents ``scale_codes``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    std: float = 0.0
    scale_codes: tuple[int, int] = (0, 0)  # e8m0: the lowest and highest code drawn

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(_CODES[self.dtype]).itemsize


@dataclasses.dataclass(frozen=True)
class Layout:
    """The files a checkpoint is written to: ``shards[i]`` holds ``files[i]``'s tensors, in order."""

    shards: tuple[tuple[TensorSpec, ...], ...]
    files: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for shard in self.shards for t in shard)

    @property
    def num_tensors(self) -> int:
        return sum(len(shard) for shard in self.shards)

    def index(self) -> dict:
        """``model.safetensors.index.json``'s content, as transformers writes it."""
        weight_map = {t.name: f for shard, f in zip(self.shards, self.files, strict=True) for t in shard}
        return {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}


def _float_dtype(hf: dict[str, Any]) -> str:
    name = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    if name not in _NAMES:
        raise UserError(f"config dtype {name!r}: expected one of {', '.join(_NAMES)}")
    return _NAMES[name]


def _hub_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of every tensor of a checkpoint of ``cfg`` in the rule tables' names (fused experts,
    none quantized), computed on zero-stride views so that no tensor-sized buffer is allocated or touched."""
    from peagle_jax.models import weights

    rules, out = weights._rules(cfg), {}
    for path, (shape, _) in weights.expected_shapes(cfg).items():
        for rule, hf in weights._parts(rules, path):
            full = np.broadcast_to(np.int8(0), shape)
            out[hf] = tuple(rule.to_hf(full if rule.index is None else full[rule.index]).shape)
    return out


def _natural_key(name: str):
    from peagle_jax.models.tensors import _natural_key as key

    return key(name)


def tensor_specs(hf: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of a hub checkpoint of the config ``hf`` (a parsed config.json), in natural order (layer 2
    before layer 10), with how its values are drawn (see the module doc)."""
    from peagle_jax.models.hf_config import from_hf_config
    from peagle_jax.models.mxfp4 import BLOCK_SIZE, BYTES_PER_BLOCK, E8M0_BIAS

    cfg = from_hf_config(hf)
    dtype = _float_dtype(hf)
    std = float(hf.get("initializer_range", 0.02))
    if not std > 0:
        raise UserError(f"config initializer_range {std!r}: must be positive")
    quant = hf.get("quantization_config") or {}
    mxfp4 = quant.get("quant_method") == "mxfp4"
    if quant and not mxfp4:
        raise UserError(f"quantization_config quant_method {quant.get('quant_method')!r}: only mxfp4 is written")
    if mxfp4 and cfg.family != "gpt_oss":
        raise UserError(f"MXFP4 experts are written for gpt_oss configs only, not {cfg.family}")
    center = E8M0_BIAS + round(math.log2(std / FP4_RMS))
    if not 1 <= center - 1 <= center + 1 <= 254:
        raise UserError(f"config initializer_range {std!r}: no MXFP4 scale gives experts that magnitude")
    specs = []
    for name, shape in _hub_shapes(cfg).items():
        is_expert = name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
        if is_expert and mxfp4:
            E, C, R = shape  # the parameter (E, C, R) is stored as (E, R, C) in blocks of 32 along C
            G = C // BLOCK_SIZE
            specs.append(TensorSpec(name + "_blocks", (E, R, G, BYTES_PER_BLOCK), "U8", "fp4"))
            specs.append(TensorSpec(name + "_scales", (E, R, G), "U8", "e8m0", scale_codes=(center - 1, center + 1)))
        elif is_expert and cfg.family == "qwen3_moe":  # per expert on the hub: gate and up [F, D], down [D, F]
            prefix, proj = name.rsplit(".", 1)
            E, rows, cols = shape
            parts = ("gate", "up") if proj == "gate_up_proj" else ("down",)
            rows //= len(parts)
            for e in range(E):
                specs += [
                    TensorSpec(f"{prefix}.{e}.{p}_proj.weight", (rows, cols), dtype, "normal", std) for p in parts
                ]
        elif name.endswith("norm.weight"):
            specs.append(TensorSpec(name, shape, dtype, "ones"))
        else:
            specs.append(TensorSpec(name, shape, dtype, "normal", std))
    return sorted(specs, key=lambda t: _natural_key(t.name))


def layout(hf: dict[str, Any], max_shard_size: int | None = None) -> Layout:
    """The shards of a checkpoint of ``hf``: tensors in natural order, a new shard where the next tensor would
    take the current one past ``max_shard_size`` bytes (a larger tensor alone; None: one file)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in tensor_specs(hf):
        if max_shard_size is not None and shards[-1] and size + spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    n = len(shards)
    files = tuple("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n))
    return Layout(tuple(tuple(s) for s in shards), files)


def generation_config(hf: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: the published one's special ids for a known vocabulary
    (:data:`GENERATION_IDS`), else the config's own."""
    known = GENERATION_IDS.get((hf.get("model_type"), hf.get("vocab_size")))
    if known is not None:
        out = dict(known)
    else:
        out = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    if hf.get("transformers_version"):
        out["transformers_version"] = hf["transformers_version"]
    return out


# -- values ---------------------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *words])))


def values(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The tensor's values, flat, in chunks of at most :data:`CHUNK_ELEMENTS`, in its dtype."""
    rng = _rng(seed, spec.name)
    np_dtype = np.dtype(_CODES[spec.dtype])
    total = math.prod(spec.shape)
    for start in range(0, total, CHUNK_ELEMENTS):
        n = min(CHUNK_ELEMENTS, total - start)
        if spec.kind == "normal":
            x = rng.standard_normal(n, dtype=np.float32)
            x *= np.float32(spec.std)
            yield x.astype(np_dtype)
        elif spec.kind == "ones":
            yield np.ones(n, np_dtype)
        elif spec.kind == "fp4":
            yield np.frombuffer(rng.bytes(n), np.uint8)
        elif spec.kind == "e8m0":
            low, high = spec.scale_codes
            yield rng.integers(low, high + 1, size=n, dtype=np.uint8)
        else:
            raise ValueError(f"unknown kind {spec.kind!r}")


def array(spec: TensorSpec, seed: int) -> np.ndarray:
    """The whole tensor in memory (for tests and small tensors): what the file holds."""
    return np.concatenate(list(values(spec, seed))).reshape(spec.shape)


# -- files ----------------------------------------------------------------------------------------------------


def _header(shard: tuple[TensorSpec, ...]) -> bytes:
    """A safetensors header: the 8-byte little-endian length, then JSON padded with spaces to a multiple of
    8 bytes (as safetensors writes it), tensors contiguous in the given order."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_shard(path: Path, shard: tuple[TensorSpec, ...], seed: int, advance: Callable[[int], Any]) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(_header(shard))
        for spec in shard:
            for chunk in values(spec, seed):
                f.write(chunk.view(np.uint8).data)
                advance(chunk.nbytes)
    os.replace(part, path)


def write_checkpoint(
    config: str | Path, out: str | Path, *, seed: int = 0, max_shard_size: int | None = None, progress: bool = False
) -> Layout:
    """Write a random checkpoint of the config.json file ``config`` into ``out`` (see the module doc)."""
    from tqdm import tqdm

    from peagle_jax.models.hf_config import read_json_object

    config, out = Path(config), Path(out)
    if not config.is_file():
        raise UserError(f"--config {config}: no such file")
    hf = read_json_object(config, f"--config {config}")
    plan = layout(hf, max_shard_size)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(config.read_bytes())
    (out / "generation_config.json").write_text(json.dumps(generation_config(hf), indent=2) + "\n")
    with tqdm(
        total=plan.total_bytes, unit="B", unit_scale=True, desc="writing", disable=None if progress else True
    ) as bar:
        for shard, name in zip(plan.shards, plan.files, strict=True):
            _write_shard(out / name, shard, seed, bar.update)
    index = out / "model.safetensors.index.json"
    if len(plan.files) > 1:
        index.write_text(json.dumps(plan.index(), indent=2) + "\n")
    elif index.exists():  # a single file: no index, as transformers writes it
        index.unlink()
    return plan


# -- command line ---------------------------------------------------------------------------------------------


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m peagle_jax.models.random_checkpoint", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="a model's config.json (e.g. neuron/configs/gpt-oss-20b.json)")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0); the same seed, the same bytes")
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest shard file, e.g. 5GB, 500MiB (default {DEFAULT_MAX_SHARD_SIZE}, as transformers)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the tensors, shards and bytes; write nothing")
    return p


def main(argv=None) -> int:
    from peagle_jax.models.tensors import parse_size

    args = build_parser().parse_args(argv)
    try:
        max_shard_size = parse_size(args.max_shard_size)
        if args.dry_run:
            from peagle_jax.models.hf_config import read_json_object

            config = Path(args.config)
            if not config.is_file():
                raise UserError(f"--config {config}: no such file")
            plan = layout(read_json_object(config, f"--config {config}"), max_shard_size)
        else:
            check_output_dir(args.out, "--out")
            plan = write_checkpoint(args.config, args.out, seed=args.seed, max_shard_size=max_shard_size, progress=True)
    except UserError as err:
        return report(err)
    counts: dict[str, int] = {}
    for shard in plan.shards:
        for t in shard:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
    by_dtype = ", ".join(f"{code} {n / 1e9:.3f} GB" for code, n in sorted(counts.items()))
    verb = "would write" if args.dry_run else "wrote"
    print(
        f"{verb} {plan.num_tensors} tensors, {plan.total_bytes:,} bytes ({by_dtype}) in {len(plan.files)} file(s) "
        f"to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
