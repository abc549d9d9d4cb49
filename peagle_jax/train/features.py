"""The target's hidden states for training: computed online each step, or once into an on-disk cache.

:func:`target_features` runs the target over packed rows (a block-diagonal causal mask keeps conversations
apart, RoPE positions restart per conversation) and returns the training-aligned ``aux`` [B, T, X] and
``target_hidden`` [B, T, D] (the final normed state of the *next* slot, zero at a conversation's last slot
and wherever the loss mask is 0; see :mod:`peagle_jax.train.pack`), cast to the storage dtype. The online
source calls it for each batch; the cache stores its output for every row. Both go through this one jitted
function on the same rows, so they give the same batches bit for bit (tested).

Cache layout: ``DIR/features.json`` (shapes, dtype, rows per chunk, a digest of the rows), per chunk of rows
``aux-{i:05d}.bin`` / ``hidden-{i:05d}.bin``, and ``DIR/chunks.jsonl``, a line per finished chunk with each
file's size, sha256, row shape and per-row layout. A row is stored as two parts, each deflated: the byte
plane that holds each value's sign and exponent (its most significant byte, which takes few distinct values in
hidden states), then the other bytes of every value (mantissa bits hardly compress, but the zeros of
``target_hidden`` off the loss positions do). That is lossless and smaller than the raw values
(:meth:`FeatureCache.sizes`), and a row decodes in milliseconds; the files are memory-mapped and only the rows
a batch needs are decoded. A chunk counts as built only once its line is written (after both files are renamed
into place), so a build killed at any point resumes by redoing the chunks without a line or whose files' sizes
differ from it: no torn chunk is ever read. The reader checks a chunk's checksums when it first opens it
and refuses a changed file.
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import json
import os
import shutil
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.train.pack import PackedRows, training_layout
from peagle_jax.train.prompts import DataError

STORAGE_DTYPES = ("float32", "bfloat16")


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def target_features(params, tokens_BT, positions_BT, document_BT, loss_mask_BT=None, *, cfg: ModelConfig, dtype: str):
    """``(aux [B, T, X], target_hidden [B, T, D])`` of B packed rows, in ``dtype``. With the rows'
    ``loss_mask_BT`` (of the training layout), ``target_hidden`` is zero where it is 0: the objectives read it
    only where the loss is (tested), and zeros take no room in the cache, whose rows are half prompt."""
    B, T = tokens_BT.shape
    t_T = jnp.arange(T, dtype=jnp.int32)
    same_BTT = document_BT[:, :, None] == document_BT[:, None, :]
    causal_TT = t_T[:, None] >= t_T[None, :]
    mask_BTT = (same_BTT & causal_TT[None]) | jnp.eye(T, dtype=bool)[None]  # padding slots see themselves
    out, _ = model.forward(
        params,
        model.new_cache(cfg, B, T),
        tokens_BT,
        jnp.zeros((B,), jnp.int32),
        cfg=cfg,
        mask_BTT=mask_BTT,
        positions_BT=positions_BT,
        logits_at_BM=jnp.zeros((B, 1), jnp.int32),  # the LM head is not needed: one row keeps it cheap
    )
    next_same_BT = jnp.concatenate([document_BT[:, 1:] == document_BT[:, :-1], jnp.zeros((B, 1), bool)], axis=1)
    hidden_next_BTD = jnp.concatenate([out.hidden[:, 1:], jnp.zeros_like(out.hidden[:, :1])], axis=1)
    keep_BT = next_same_BT & (document_BT >= 0)
    if loss_mask_BT is not None:
        keep_BT = keep_BT & (loss_mask_BT != 0)
    hidden_next_BTD = jnp.where(keep_BT[:, :, None], hidden_next_BTD, 0)
    return out.aux.astype(dtype), hidden_next_BTD.astype(dtype)


def rows_digest(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for a in rows:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


FORMAT = "planes-deflate"  # features.json's "format": the row layout above
OPEN_CHUNKS = 256  # chunks a reader keeps memory-mapped


def _storage(dtype: str) -> np.dtype:
    """The little-endian dtype a row's values are stored as (bf16 as its uint16 bits)."""
    return np.dtype("<u2") if dtype == "bfloat16" else np.dtype("<f4")


def _encode_row(row: np.ndarray, dtype: str) -> tuple[bytes, bytes]:
    """``(sign-and-exponent bytes, the other bytes)`` of one row's values, each deflated."""
    k = _storage(dtype).itemsize
    b = np.ascontiguousarray(row).view(_storage(dtype)).view(np.uint8).reshape(-1, k)
    return zlib.compress(b[:, k - 1].tobytes(), 1), zlib.compress(b[:, : k - 1].tobytes(), 1)


def _decode_row(buf: np.ndarray, offset: int, parts: tuple[int, int], shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The row that :func:`_encode_row` stored at ``offset`` of ``buf`` (a memory-mapped chunk file) in two
    parts of ``parts`` bytes."""
    st = _storage(dtype)
    k, n = st.itemsize, int(np.prod(shape))
    high, low = parts
    out = np.empty((n, k), np.uint8)
    out[:, k - 1] = np.frombuffer(zlib.decompress(buf[offset : offset + high]), np.uint8)
    out[:, : k - 1] = np.frombuffer(zlib.decompress(buf[offset + high : offset + high + low]), np.uint8).reshape(
        n, k - 1
    )
    values = out.view(st).reshape(shape)
    return values.view(jnp.bfloat16) if dtype == "bfloat16" else values


def _digest(path: Path) -> list:
    """``[size, sha256]`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return [path.stat().st_size, h.hexdigest()]


def _manifest(directory: Path) -> dict[int, dict]:
    """Chunk -> its line of ``chunks.jsonl``; a last line cut short by a kill is ignored."""
    out = {}
    path = directory / "chunks.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[int(rec["chunk"])] = rec
    return out


def _chunk_whole(directory: Path, i: int, rec: dict | None) -> bool:
    """Whether chunk i's files are there at the sizes its manifest line records."""
    if rec is None:
        return False
    for name in ("aux", "hidden"):
        path = directory / f"{name}-{i:05d}.bin"
        if not path.exists() or path.stat().st_size != rec[name]["file"][0]:
            return False
    return True


def _check_format(directory: Path, meta: dict) -> None:
    """Refuse a cache written in another storage format (``features.json``'s ``format``)."""
    if meta.get("format") != FORMAT:
        raise DataError(f"{directory} holds features in another storage format; delete it and build again")


class FeatureCache:
    """Read access to a built cache; ``rows(idx)`` -> (aux, hidden) numpy arrays for those row ids."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        try:
            self.meta = json.loads((self.dir / "features.json").read_text())
        except (OSError, json.JSONDecodeError):
            raise DataError(f"{self.dir} is not a feature cache (no readable features.json)") from None
        _check_format(self.dir, self.meta)
        self.chunk = self.meta["chunk_rows"]
        self.manifest = _manifest(self.dir)
        self._open: collections.OrderedDict[int, dict[str, tuple]] = collections.OrderedDict()
        self._checked: set[int] = set()

    def _chunk(self, i: int) -> dict[str, tuple]:
        """Chunk i's files, checked (once) and memory-mapped: name -> (bytes, row offsets, the sizes of
        each row's two parts, row shape). The :data:`OPEN_CHUNKS` most recently read stay mapped: an epoch of
        a large cache reads every chunk, and a process may hold only so many mappings."""
        if i in self._open:
            self._open.move_to_end(i)
            return self._open[i]
        rec = self.manifest.get(i)
        chunk = {}
        for name in ("aux", "hidden"):
            path = self.dir / f"{name}-{i:05d}.bin"
            if rec is None or not path.exists() or (i not in self._checked and _digest(path) != rec[name]["file"]):
                raise DataError(f"{path}: missing or changed since the cache was built; delete it and build again")
            shape, parts = tuple(rec[name]["shape"]), [tuple(p) for p in rec[name]["row_parts"]]
            offsets = np.concatenate([[0], np.cumsum([sum(p) for p in parts])[:-1]]).tolist()
            chunk[name] = (np.memmap(path, np.uint8, mode="r"), offsets, parts, shape)
        self._checked.add(i)
        self._open[i] = chunk
        while len(self._open) > OPEN_CHUNKS:
            self._open.popitem(last=False)
        return chunk

    def spec(self) -> tuple[tuple[tuple[int, ...], np.dtype], tuple[tuple[int, ...], np.dtype]]:
        """((shape, dtype) of a row's aux features, the same of its target hidden states), decoding none."""
        chunk = self._chunk(0)
        dtype = np.dtype(jnp.bfloat16) if self.meta["dtype"] == "bfloat16" else np.dtype(np.float32)
        return tuple((chunk[name][3], dtype) for name in ("aux", "hidden"))

    def sizes(self) -> tuple[int, int]:
        """``(bytes stored, bytes of the raw values)`` of the chunks built so far."""
        stored = raw = 0
        k = _storage(self.meta["dtype"]).itemsize
        for rec in self.manifest.values():
            for name in ("aux", "hidden"):
                stored += rec[name]["file"][0]
                raw += len(rec[name]["row_parts"]) * int(np.prod(rec[name]["shape"])) * k
        return stored, raw

    def row(self, r: int) -> tuple[np.ndarray, np.ndarray]:
        """``(aux [T, X], hidden [T, D])`` of row r."""
        chunk, j = self._chunk(r // self.chunk), r % self.chunk
        out = []
        for name in ("aux", "hidden"):
            buf, offsets, parts, shape = chunk[name]
            out.append(_decode_row(buf, offsets[j], parts[j], shape, self.meta["dtype"]))
        return out[0], out[1]

    def rows(self, idx) -> tuple[np.ndarray, np.ndarray]:
        parts = [self.row(int(r)) for r in idx]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])


def build_cache(
    params, cfg: ModelConfig, rows: PackedRows, directory: str | Path, *, dtype: str, chunk_rows: int = 8, progress=True
) -> FeatureCache:
    """Compute and store the features of every row (resumable); returns the cache."""
    if dtype not in STORAGE_DTYPES:
        raise DataError(f"feature dtype {dtype!r}: expected one of {', '.join(STORAGE_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    B = rows.tokens.shape[0]
    meta = {"rows": B, "seq_len": int(rows.tokens.shape[1]), "dtype": dtype, "chunk_rows": chunk_rows, "format": FORMAT}
    meta["rows_digest"] = rows_digest(rows)
    meta_path = directory / "features.json"
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        # The chunk size is a storage detail (a cache built at another batch size reads the same rows).
        chunk_rows = meta["chunk_rows"] = have.get("chunk_rows", chunk_rows)
        _check_format(directory, have)
        if have != meta:
            raise DataError(f"{directory} caches features of other rows or settings; use a new directory")
    else:
        meta_path.write_text(json.dumps(meta, indent=1))
    chunks = -(-B // chunk_rows)
    loss_mask = training_layout(rows)[1]
    done = _manifest(directory)
    bar = tqdm(range(chunks), desc="target features", unit="chunk", disable=not progress)
    checked = False
    for i in bar:
        if _chunk_whole(directory, i, done.get(i)):
            continue
        sl = slice(i * chunk_rows, min((i + 1) * chunk_rows, B))
        n = sl.stop - sl.start
        # Pad the last chunk to the full chunk so that one graph serves every chunk.
        take = np.minimum(np.arange(sl.start, sl.start + chunk_rows), B - 1)
        aux, hidden = target_features(
            params, rows.tokens[take], rows.positions[take], rows.document[take], loss_mask[take], cfg=cfg, dtype=dtype
        )
        try:
            done[i] = _write_chunk(directory, i, {"aux": aux, "hidden": hidden}, n, dtype)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            raise DataError(
                f"{directory}: the disk is full; free some space and run again (the chunks built so far are kept)"
            ) from None
        if not checked:  # once, after the first chunk this call builds
            bar.set_postfix_str(_check_room(directory, done, chunks))
            checked = True
    return FeatureCache(directory)


def _write_chunk(directory: Path, i: int, arrays: dict, n: int, dtype: str) -> dict:
    """Chunk i's files (its first n rows) and then its manifest line, which makes it count as built; returns
    the line. A file is written under a temporary name and renamed into place, so a kill leaves no torn file
    behind a name (a temporary one is removed when the disk runs full)."""
    rec = {"chunk": i}
    for name, arr in arrays.items():
        arr = np.asarray(arr)[:n]
        path, tmp = directory / f"{name}-{i:05d}.bin", directory / f"{name}-{i:05d}.tmp"
        parts = []
        try:
            with open(tmp, "wb") as f:
                for row in arr:
                    head, rest = _encode_row(row, dtype)
                    f.write(head)
                    f.write(rest)
                    parts.append([len(head), len(rest)])
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
        rec[name] = {"file": _digest(path), "shape": list(arr.shape[1:]), "row_parts": parts}
    with open(directory / "chunks.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")
    return rec


def _check_room(directory: Path, done: dict[int, dict], chunks: int) -> str:
    """Refuse to go on when the disk will not hold the rest of the cache, projected from the chunks built so
    far; returns the projected size of the whole cache for the progress bar."""
    stored = sum(rec[name]["file"][0] for rec in done.values() for name in ("aux", "hidden"))
    per_chunk, left = stored / len(done), chunks - len(done)
    free = shutil.disk_usage(directory).free
    if per_chunk * left > free:
        raise DataError(
            f"{directory}: the feature cache needs about {per_chunk * left / 2**30:.1f} GiB more and the disk has "
            f"{free / 2**30:.1f} GiB free; free some space and run again (the chunks built so far are kept), "
            "or train with batch.features: online"
        )
    return f"{per_chunk * chunks / 2**30:.1f} GiB when built"
