"""Finished pieces of a long benchmark, saved after each one so that ``--resume`` continues a stopped run.

The file (``OUT/progress.json``) holds a signature of the settings that decide the results (target, drafters,
prompts, answer length), the plain-decoding reference tokens per temperature and the finished acceptance rows.
A resumed run with other settings is refused rather than mixing results of two setups.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from peagle_jax.errors import UserError


def digest(obj) -> str:
    """A short stable hash of a JSON-serialisable value (the prompts' token ids)."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":")).encode()).hexdigest()[:16]


class Progress:
    def __init__(self, path: Path, signature: dict, *, resume: bool):
        self.path = Path(path)
        self.data = {"signature": signature, "references": {}, "acceptance": []}
        if resume and self.path.is_file():
            try:
                old = json.loads(self.path.read_text())
                old_sig = old["signature"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"--resume: {self.path} is not a progress file of this benchmark") from None
            changed = sorted(k for k in set(signature) | set(old_sig) if signature.get(k) != old_sig.get(k))
            if changed:
                raise UserError(
                    f"--resume: {self.path} is from a run with other settings ({', '.join(changed)}); "
                    "use the same settings, another --out, or drop --resume"
                )
            self.data = old

    @property
    def finished(self) -> int:
        return len(self.data["references"]) + len(self.data["acceptance"])

    def reference(self, temperature: float):
        return self.data["references"].get(repr(float(temperature)))

    def set_reference(self, temperature: float, tokens) -> None:
        self.data["references"][repr(float(temperature))] = tokens
        self.save()

    def row(self, method: str, shape: str, temperature: float):
        for r in self.data["acceptance"]:
            if (r["method"], r["shape"], r["temperature"]) == (method, shape, temperature):
                return r
        return None

    def add(self, row: dict) -> None:
        self.data["acceptance"].append(row)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data))
        os.replace(tmp, self.path)  # a run killed mid-write keeps the previous file

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
