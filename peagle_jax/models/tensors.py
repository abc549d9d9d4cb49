"""Named tensors read on demand: a checkpoint directory's safetensors files, and the views that turn the
hub's storage into the tensors the rule tables name, without reading anything before it is needed.

A :class:`TensorSource` is a read-only mapping ``name -> array`` that knows each tensor's shape and dtype
without reading it, and reads a tensor only when it is looked up. Loading a target goes through one, a
parameter at a time (:func:`peagle_jax.models.weights.flat_from_tensors`), so that peak host memory is the
parameters already placed plus the parts of one parameter: never a second copy of the whole model.

Views (each a :class:`TensorSource` over another):

- :func:`dequantized`: each MXFP4 pair (``NAME_blocks``, ``NAME_scales``) becomes ``NAME`` in a float dtype,
  dequantized when ``NAME`` is read (:mod:`peagle_jax.models.mxfp4`);
- :func:`fused_experts`: per-expert Qwen3-MoE tensors (``experts.{e}.{gate,up,down}_proj.weight``, as on the
  hub) become transformers 5's fused ``experts.gate_up_proj`` [E, 2F, D] and ``experts.down_proj`` [E, D, F],
  stacked when read;
- :meth:`TensorSource.without`: some names left out.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from peagle_jax.errors import UserError


class WeightsError(UserError):
    """A checkpoint that does not fit the config; the message names the tensor or file."""


# safetensors dtype codes -> numpy dtypes (what ``safe_open(..., framework="numpy")`` returns).
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class _Entry:
    __slots__ = ("shape", "dtype", "read")

    def __init__(self, shape, dtype, read: Callable[[], np.ndarray]):
        self.shape, self.dtype, self.read = tuple(shape), np.dtype(dtype), read


def _natural_key(name: str):
    """``layers.10`` after ``layers.9``: the order a loader reads (and reports) layers in."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class TensorSource(Mapping):
    """A read-only ``name -> np.ndarray`` mapping whose tensors are read when looked up; :meth:`shape` and
    :meth:`dtype` answer without reading. Iteration is in natural order (layer 2 before layer 10)."""

    def __init__(self, entries: dict[str, _Entry]):
        self._entries = {name: entries[name] for name in sorted(entries, key=_natural_key)}

    @classmethod
    def of(cls, tensors: Mapping) -> TensorSource:
        """A source over tensors already in memory (a dict), or ``tensors`` itself if it is a source."""
        if isinstance(tensors, TensorSource):
            return tensors
        return cls(
            {
                name: _Entry(np.shape(array), getattr(array, "dtype", np.float32), lambda a=array: np.asarray(a))
                for name, array in tensors.items()
            }
        )

    def __getitem__(self, name: str) -> np.ndarray:
        return self._entries[name].read()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self._entries[name].dtype

    def nbytes(self, name: str) -> int:
        return int(np.prod(self.shape(name), dtype=np.int64)) * self.dtype(name).itemsize

    def without(self, names) -> TensorSource:
        names = set(names)
        return TensorSource({k: v for k, v in self._entries.items() if k not in names})

    def replaced(self, drop, add: dict[str, _Entry]) -> TensorSource:
        """This source less ``drop``, plus ``add``."""
        drop = set(drop)
        return TensorSource({**{k: v for k, v in self._entries.items() if k not in drop}, **add})


# -- safetensors files ----------------------------------------------------------------------------------------


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a directory (single file, or the shards its index names)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shard_names = set(weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise WeightsError(f"{index}: not a safetensors index with a 'weight_map' ({err!r})") from None
        files = sorted({model_dir / f for f in shard_names})
        for f in files:
            if not f.is_file():
                raise WeightsError(f"{index} names shard {f.name}, which is missing")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
            raise WeightsError(
                f"{model_dir} holds only pickled PyTorch weights (*.bin); they are refused because unpickling "
                "can run code. Convert them to safetensors first (transformers: from_pretrained, then "
                "save_pretrained, which writes safetensors)"
            )
        raise WeightsError(f"{model_dir}: no *.safetensors weights found")
    return files


def _header(path: Path) -> tuple[int, dict]:
    """(offset of the data, header) of a safetensors file: an 8-byte little-endian header length, then the
    JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= path.stat().st_size - 8:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as err:
        raise WeightsError(f"{path}: not a readable safetensors file ({err})") from None
    header.pop("__metadata__", None)
    return 8 + size, header


def _reader(path: Path, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> Callable[[], np.ndarray]:
    """Reads one tensor straight into a new array (one copy, freed as soon as it is dropped)."""
    count = int(np.prod(shape, dtype=np.int64))

    def read() -> np.ndarray:
        array = np.fromfile(path, dtype=dtype, count=count, offset=offset)
        if array.size != count:
            raise WeightsError(f"{path}: the file ends inside a tensor (truncated?)")
        return array.reshape(shape)

    return read


def open_safetensors(model_dir: str | Path) -> TensorSource:
    """Every tensor of a directory's safetensors files, read on demand (only the headers are read here)."""
    entries: dict[str, _Entry] = {}
    for f in safetensors_files(model_dir):
        start, header = _header(f)
        for name, info in header.items():
            if name in entries:
                raise WeightsError(f"tensor {name!r} appears in more than one shard")
            try:
                code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{f}: tensor {name!r} has a malformed header entry {info!r}") from None
            dtype = _DTYPES.get(code)
            if dtype is None:
                raise WeightsError(f"{f}: tensor {name!r} has dtype {code}, which is not supported")
            dtype = np.dtype(dtype)
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise WeightsError(f"{f}: tensor {name!r} spans {end - begin} bytes, not {shape} of {dtype}")
            entries[name] = _Entry(shape, dtype, _reader(f, start + begin, shape, dtype))
    return TensorSource(entries)


def read_safetensors(model_dir: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a directory's ``*.safetensors`` (single file or sharded via the index), in memory."""
    return dict(open_safetensors(model_dir).items())


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str | int) -> int:
    """Bytes in ``'2GB'`` (decimal units, as transformers reads them), ``'500MiB'`` or ``12345``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).upper() if m else None
    if unit not in _SIZE_UNITS:
        raise UserError(f"not a size: {text!r} (examples: 2GB, 500MB, 512MiB)")
    size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise UserError(f"size must be positive, got {text!r}")
    return size


def _file_mode() -> int:
    """The mode a new file gets under the process's umask (``open`` creates 0o666 & ~umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_safetensors(
    model_dir: str | Path, tensors: Mapping[str, np.ndarray], *, max_shard_size: int | None = None, progress=False
) -> list[Path]:
    """Write ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` bytes each (a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``, as transformers does. Returns the files written."""
    from tqdm import tqdm

    model_dir = Path(model_dir)
    total = sum(int(t.nbytes) for t in tensors.values())
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = int(tensors[name].nbytes)
        if max_shard_size is not None and shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    n = len(shards)
    files = [
        model_dir / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)
    ]
    for shard, f in tqdm(
        list(zip(shards, files, strict=True)), desc="writing", unit="file", disable=None if progress else True
    ):
        save_file(shard, str(f), metadata={"format": "pt"})
        f.chmod(_file_mode())  # safetensors creates its files readable by the owner only
    if n > 1:
        weight_map = {name: f.name for shard, f in zip(shards, files, strict=True) for name in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (model_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


# -- views ----------------------------------------------------------------------------------------------------


class _Meta:
    """``shape`` and ``dtype`` of a tensor not yet read, for the MXFP4 checks."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


def dequantized(tensors: Mapping, dtype) -> TensorSource:
    """``tensors`` with each MXFP4 pair replaced by its parameter in ``dtype``, dequantized when read (pairs
    are checked here, from their shapes and dtypes). Other tensors pass through."""
    from peagle_jax.models import mxfp4

    source = TensorSource.of(tensors)
    pairs = mxfp4.mxfp4_pairs(source)
    if not pairs:
        return source
    out_dtype = mxfp4._resolve_dtype(dtype)
    add = {}
    for base, (blocks, scales) in pairs.items():
        meta = [_Meta(source.shape(n), source.dtype(n)) for n in (blocks, scales)]
        mxfp4.check_pair(*meta, base)

        def read(base=base, blocks=blocks, scales=scales):
            return mxfp4.dequantize(source[blocks], source[scales], out_dtype, name=base)

        add[base] = _Entry(mxfp4.parameter_shape(source.shape(blocks)), out_dtype, read)
    return source.replaced([n for pair in pairs.values() for n in pair], add)


_PER_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fused_experts(tensors: Mapping, num_experts: int) -> TensorSource:
    """Per-expert hub tensors ``<layer>.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-MoE on the hub) as
    transformers 5's fused ``experts.gate_up_proj`` [E, 2F, D] and ``experts.down_proj`` [E, D, F], stacked
    when read; every other tensor passes through. Each of the E experts must appear exactly once, with the
    shape of the others."""
    source = TensorSource.of(tensors)
    groups: dict[str, dict[tuple[int, str], str]] = {}
    for name in source:
        m = _PER_EXPERT.match(name)
        if m is None:
            continue
        e = int(m.group(2))
        if not 0 <= e < num_experts:
            raise WeightsError(f"unexpected tensor {name!r}: the config has {num_experts} experts")
        groups.setdefault(m.group(1), {})[e, m.group(3)] = name
    add = {}
    for prefix, parts in groups.items():
        missing = [
            f"{prefix}.{e}.{w}_proj.weight"
            for e in range(num_experts)
            for w in ("gate", "up", "down")
            if (e, w) not in parts
        ]
        if missing:
            raise WeightsError(f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for fused in (prefix + ".gate_up_proj", prefix + ".down_proj"):
            if fused in source:
                raise WeightsError(f"tensor {fused!r} is given both fused and per expert")
        for kinds, fused in ((("gate", "up"), prefix + ".gate_up_proj"), (("down",), prefix + ".down_proj")):
            names = [[parts[e, kind] for kind in kinds] for e in range(num_experts)]
            shapes = {source.shape(n) for row in names for n in row}
            if len(shapes) != 1 or len(shapes.pop()) != 2:
                shown = sorted({source.shape(n) for row in names for n in row})
                raise WeightsError(f"the experts of {prefix!r} have mismatched shapes {shown}")
            rows, cols = source.shape(names[0][0])
            dtype = np.result_type(*[source.dtype(n) for row in names for n in row])
            add[fused] = _Entry((num_experts, rows * len(kinds), cols), dtype, _stacker(source, names, dtype))
    return source.replaced([n for parts in groups.values() for n in parts.values()], add)


def _stacker(source: TensorSource, names: list[list[str]], dtype) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        rows, cols = source.shape(names[0][0])
        out = np.empty((len(names), rows * len(names[0]), cols), dtype)
        for e, row in enumerate(names):
            for i, name in enumerate(row):
                out[e, i * rows : (i + 1) * rows] = source[name]
        return out

    return read
