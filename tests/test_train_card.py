"""The training card's numbers (``python -m peagle_jax.train.card``) for a run that reads another run's answers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from peagle_jax.train.card import collect


def _write(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_a_run_counts_only_the_shards_it_read(tmp_path):
    """``data.from_run`` with ``data.max_prompts``: the run read the first shards of the other run's answers,
    which has regenerated more since; the card's answers and regeneration time are those of its shards."""
    data, run = tmp_path / "data", tmp_path / "run"
    regen = data / "regen"
    _write(regen / "regen.json", {"shard_size": 4})
    os.utime(regen / "regen.json", (1000, 1000))
    for i, mtime in enumerate((1600, 2200, 9000)):  # the third shard came later, for another stage
        shard = regen / f"shard-{i:05d}.jsonl"
        rows = [{"prompt_ids": [1], "response_ids": [7] * (i + 1)} for _ in range(4)]
        shard.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.utime(shard, (mtime, mtime))
    _write(run / "run.json", {"data": {"from_run": str(data), "max_prompts": 8, "shard_size": 4}})
    _write(run / "vocab.json", {"draft_vocab_size": 16})  # no recorded counts: the card counts the shards
    _write(run / "summary.json", {"steps": 1})
    info = collect(run)
    assert info["responses"] == 8
    assert info["response_tokens"] == 4 * 1 + 4 * 2
    assert info["regen_s"] == 1200

    _write(run / "run.json", {"data": {"from_run": str(data), "max_prompts": 0, "shard_size": 4}})  # all of them
    info = collect(run)
    assert (info["responses"], info["response_tokens"], info["regen_s"]) == (12, 24, 8000)
