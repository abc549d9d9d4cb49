"""The target's hidden states for training: computed online each step, or once into an on-disk cache.

:func:`target_features` runs the target over packed rows (a block-diagonal causal mask keeps conversations
apart, RoPE positions restart per conversation) and returns the training-aligned ``aux`` [B, T, X] and
``target_hidden`` [B, T, D] (the final normed state of the *next* slot, zero at a conversation's last slot;
see :mod:`peagle_jax.train.pack`), cast to the storage dtype. The online source calls it for each batch;
the cache stores its output for every row. Both go through this one jitted function on the same rows, so
they give the same batches bit for bit (tested).

Cache layout: ``DIR/features.json`` (shapes, dtype, rows per chunk, a digest of the rows), per chunk of
rows ``aux-{i:05d}.npy`` / ``hidden-{i:05d}.npy`` (bfloat16 stored as its uint16 bits, memory-mapped when
read), and ``DIR/chunks.jsonl``, a line per finished chunk with each file's size and sha256. A chunk counts
as built only once its line is written (after both files are renamed into place), so a build killed at any
point resumes by redoing the chunks without a line or whose files' sizes differ from it: no torn chunk is
ever read. The reader checks a chunk's checksums when it first opens it and refuses a changed file.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.train.pack import PackedRows
from peagle_jax.train.prompts import DataError

STORAGE_DTYPES = ("float32", "bfloat16")


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def target_features(params, tokens_BT, positions_BT, document_BT, *, cfg: ModelConfig, dtype: str):
    """``(aux [B, T, X], target_hidden [B, T, D])`` of B packed rows, in ``dtype``."""
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
    hidden_next_BTD = jnp.where((next_same_BT & (document_BT >= 0))[:, :, None], hidden_next_BTD, 0)
    return out.aux.astype(dtype), hidden_next_BTD.astype(dtype)


def rows_digest(rows: PackedRows) -> str:
    h = hashlib.sha256()
    for a in rows:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def _to_disk(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16) if a.dtype == jnp.bfloat16 else a


def _from_disk(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.view(jnp.bfloat16) if dtype == "bfloat16" else a


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
        path = directory / f"{name}-{i:05d}.npy"
        if not path.exists() or path.stat().st_size != rec[name][0]:
            return False
    return True


class FeatureCache:
    """Read access to a built cache; ``rows(idx)`` -> (aux, hidden) numpy arrays for those row ids."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        try:
            self.meta = json.loads((self.dir / "features.json").read_text())
        except (OSError, json.JSONDecodeError):
            raise DataError(f"{self.dir} is not a feature cache (no readable features.json)") from None
        self.chunk = self.meta["chunk_rows"]
        self.manifest = _manifest(self.dir)
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _chunk(self, i: int):
        if i not in self._open:
            rec = self.manifest.get(i)
            for name in ("aux", "hidden"):
                path = self.dir / f"{name}-{i:05d}.npy"
                if rec is None or not path.exists() or _digest(path) != rec[name]:
                    raise DataError(f"{path}: missing or changed since the cache was built; delete it and build again")
            dtype = self.meta["dtype"]
            aux = np.load(self.dir / f"aux-{i:05d}.npy", mmap_mode="r")
            hidden = np.load(self.dir / f"hidden-{i:05d}.npy", mmap_mode="r")
            self._open[i] = (_from_disk(aux, dtype), _from_disk(hidden, dtype))
        return self._open[i]

    def rows(self, idx) -> tuple[np.ndarray, np.ndarray]:
        parts = [self._chunk(int(r) // self.chunk) for r in idx]
        aux = np.stack([p[0][int(r) % self.chunk] for p, r in zip(parts, idx, strict=True)])
        hidden = np.stack([p[1][int(r) % self.chunk] for p, r in zip(parts, idx, strict=True)])
        return aux, hidden


def build_cache(
    params, cfg: ModelConfig, rows: PackedRows, directory: str | Path, *, dtype: str, chunk_rows: int = 8, progress=True
) -> FeatureCache:
    """Compute and store the features of every row (resumable); returns the cache."""
    if dtype not in STORAGE_DTYPES:
        raise DataError(f"feature dtype {dtype!r}: expected one of {', '.join(STORAGE_DTYPES)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    B = rows.tokens.shape[0]
    meta = {"rows": B, "seq_len": int(rows.tokens.shape[1]), "dtype": dtype, "chunk_rows": chunk_rows}
    meta["rows_digest"] = rows_digest(rows)
    meta_path = directory / "features.json"
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        # The chunk size is a storage detail (a cache built at another batch size reads the same rows).
        chunk_rows = meta["chunk_rows"] = have.get("chunk_rows", chunk_rows)
        if have != meta:
            raise DataError(f"{directory} caches features of other rows or settings; use a new directory")
    else:
        meta_path.write_text(json.dumps(meta, indent=1))
    chunks = -(-B // chunk_rows)
    done = _manifest(directory)
    for i in tqdm(range(chunks), desc="target features", unit="chunk", disable=not progress):
        if _chunk_whole(directory, i, done.get(i)):
            continue
        sl = slice(i * chunk_rows, min((i + 1) * chunk_rows, B))
        n = sl.stop - sl.start
        # Pad the last chunk to the full chunk so that one graph serves every chunk.
        take = np.minimum(np.arange(sl.start, sl.start + chunk_rows), B - 1)
        aux, hidden = target_features(
            params, rows.tokens[take], rows.positions[take], rows.document[take], cfg=cfg, dtype=dtype
        )
        rec = {"chunk": i}
        for name, arr in (("aux", aux), ("hidden", hidden)):
            tmp = directory / f"{name}-{i:05d}.tmp.npy"
            np.save(tmp, _to_disk(np.asarray(arr)[:n]))
            os.replace(tmp, directory / f"{name}-{i:05d}.npy")
            rec[name] = _digest(directory / f"{name}-{i:05d}.npy")
        with open(directory / "chunks.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
    return FeatureCache(directory)
