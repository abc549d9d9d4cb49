"""Training data at scale: every user turn as a prompt, history fitted to the prompt budget, the held-out split
fixed by conversation, packing in log time, continuous-batching regeneration, several temperatures, and
``--until``."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_train_data import CFG, _rows  # the tiny target and packed rows of the data tests

from peagle_jax.engine.generator import Generator
from peagle_jax.models import model
from peagle_jax.train.data import split_records
from peagle_jax.train.pack import pack
from peagle_jax.train.prompts import DataError, held_out_score, load_prompt_items, turn_prompts
from peagle_jax.train.recipe import load_recipe
from peagle_jax.train.regen import fitted_prompt_ids, read_shards, regenerate
from peagle_jax.train.slot_regen import SlotGenerator


def _msg(role, content):
    return {"role": role, "content": content}


def test_every_user_turn_is_a_prompt_with_its_history(tmp_path):
    conv = [_msg("system", "s"), _msg("user", "a"), _msg("assistant", "A"), _msg("user", " "), _msg("user", "b")]
    assert turn_prompts(conv) == [conv[:2], conv]
    lines = [
        {"messages": conv},
        {"messages": [_msg("user", "q"), _msg("assistant", "Q"), _msg("user", "r")]},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    first = load_prompt_items(str(path))
    assert [c for c, _ in first] == [1, 2] and first[0][1] == conv[:2]
    every = load_prompt_items(str(path), turns="all")
    assert sorted((c, len(p)) for c, p in every) == [(1, 2), (1, 5), (2, 1), (2, 3)]
    # A fixed order: the same every time, and a smaller limit is a prefix of a larger one.
    assert load_prompt_items(str(path), turns="all") == every
    assert load_prompt_items(str(path), 3, turns="all") == every[:3]


class _Tok:
    """A chat template of one id per character plus 2 per message: lengths are easy to reason about."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        ids = []
        for m in messages:
            ids += [1] + [ord(c) % 90 + 5 for c in m["content"]] + [2]
        return ids + [4]


def test_a_long_history_keeps_its_latest_turns():
    tok = _Tok()
    conv = [_msg("system", "sys"), _msg("user", "u" * 10), _msg("assistant", "a" * 10)]
    conv += [_msg("user", "v" * 10), _msg("assistant", "b" * 10), _msg("user", "w" * 10)]
    whole = fitted_prompt_ids(tok, conv, 1000)
    assert len(whole) == 5 + 5 * 12 + 1
    # 40 tokens: the system message (5) and the last user turn (12) + the generation prompt fit, and one pair
    # more (24) does too; two pairs more do not.
    cut = fitted_prompt_ids(tok, conv, 42)
    assert cut == tok.apply_chat_template([conv[0]] + conv[3:], True, True)
    alone = fitted_prompt_ids(tok, conv, 20)
    assert alone == tok.apply_chat_template([conv[0], conv[5]], True, True)
    # Too long even alone: the ids come back whole (regenerate skips the prompt and says why).
    assert len(fitted_prompt_ids(tok, conv, 10)) == len(whole)


def test_the_held_out_split_is_fixed_per_conversation():
    records = [{"index": i, "conversation": i // 3, "response_ids": [i]} for i in range(600)]
    train, held = split_records(records, 0.1)
    held_convs = {r["conversation"] for r in held}
    assert held_convs == {c for c in range(200) if held_out_score(c) < 0.1}
    assert 5 <= len(held_convs) <= 40
    assert not held_convs & {r["conversation"] for r in train}  # every turn of a conversation on one side
    # More data (new conversations, a second temperature's answers) moves no conversation across.
    more = records + [{"index": 600 + i, "conversation": i // 2, "response_ids": [0]} for i in range(800)]
    _, held2 = split_records(more, 0.1)
    assert {r["conversation"] for r in held2} & set(range(200)) == held_convs
    # Tiny data: at least one conversation on each side.
    few = records[:6]
    t, h = split_records(few, 0.01)
    assert len(h) == 3 and len(t) == 3
    assert split_records(few, 0.0) == (few, [])


def _first_fit_reference(lengths, seq_len):
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, f in enumerate(free):
            if f >= lengths[i]:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def test_packing_is_first_fit_decreasing():
    rng = np.random.default_rng(3)
    lengths = rng.integers(3, 200, 400).tolist()
    convs = [([7] * n, [1] * n) for n in lengths]
    rows = pack(convs, 256)
    want = _first_fit_reference(lengths, 256)
    assert rows.tokens.shape[0] == len(want)
    for r, members in enumerate(want):
        assert [int((rows.document[r] == d).sum()) for d in range(len(members))] == [lengths[i] for i in members]


class _Stop(Exception):
    pass


def test_a_run_stopped_inside_a_shard_keeps_its_answers(tmp_path):
    """Each answer is kept in its shard's partial file as it ends; a run killed while two shards are open
    (here after 5 answers of 3 shards of 4 prompts, the last line torn as by a kill while writing) resumes
    with those, generates only the rest, and its shards equal an uninterrupted run's."""

    params = model.init_params(CFG, jax.random.key(1))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(5, 100, int(n)).tolist() for n in rng.integers(2, 20, 12)]
    kw = dict(max_prompt_tokens=24, max_new_tokens=10, shard_size=4, temperature=1.0, progress=False)
    gen = SlotGenerator(CFG, params, slots=2, max_seq_len=40)
    whole = read_shards(regenerate(gen, prompts, tmp_path / "whole", **kw))
    real, drawn, die_after = gen.stream_answers, [], [5]

    def dying(items, on_answer, **k):
        answers = []

        def counted():
            for item in items:
                drawn.append(item)
                yield item

        def count(key, res):
            on_answer(key, res)
            answers.append(key)
            if len(answers) == die_after[0]:
                raise _Stop

        return real(counted(), on_answer=count, **k)

    gen.stream_answers = dying
    with pytest.raises(_Stop):
        regenerate(gen, prompts, tmp_path / "cut", **kw)
    partials = sorted(p.name for p in (tmp_path / "cut").glob("*.partial"))
    assert len(drawn) == 6 and len(partials) >= 1  # 5 answered, one in a slot when it died
    last = tmp_path / "cut" / partials[-1]
    last.write_text(last.read_text() + '{"index": 7, "prompt_ids": [1, ')  # torn by the kill
    done = len(list((tmp_path / "cut").glob("shard-*.jsonl")))
    drawn.clear()
    die_after[0] = None
    resumed = read_shards(regenerate(gen, prompts, tmp_path / "cut", **kw))
    assert len(drawn) == 12 - 5 and resumed == whole and done + len(partials) >= 2
    assert not list((tmp_path / "cut").glob("*.partial"))
    gen.stream_answers = real


def test_the_next_shard_fills_the_slots_a_shard_leaves(tmp_path):
    """The slot engine answers the shards as one stream: prompts of shard 1 enter slots before shard 0 is
    written, and the shards equal those answered one at a time (per shard, through ``generate``)."""
    from peagle_jax.engine.generator import Generator as BatchGenerator

    params = model.init_params(CFG, jax.random.key(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 100, int(n)).tolist() for n in rng.integers(2, 20, 10)]
    kw = dict(max_prompt_tokens=24, max_new_tokens=9, shard_size=4, temperature=0.0, progress=False)
    gen = SlotGenerator(CFG, params, slots=3, max_seq_len=40)
    admit, early = gen.engine.admit, []

    def admitted(req):
        j = prompts.index(list(req.prompt))
        early.append(j >= 4 and not (tmp_path / "s" / "shard-00000.jsonl").exists())
        return admit(req)

    gen.engine.admit = admitted
    streamed = read_shards(regenerate(gen, prompts, tmp_path / "s", **kw))
    one_by_one = read_shards(regenerate(BatchGenerator(CFG, params, max_seq_len=40), prompts, tmp_path / "b", **kw))
    assert any(early) and len(early) == 10
    assert [(r["index"], r["response_ids"]) for r in streamed] == [(r["index"], r["response_ids"]) for r in one_by_one]
    # Answers that end at their admission (one token) leave every slot free at once: the stream goes on.
    gen.engine.admit = admit
    short = read_shards(regenerate(gen, prompts, tmp_path / "one", **{**kw, "max_new_tokens": 1}))
    assert [r["response_ids"] for r in short] == [r["response_ids"][:1] for r in one_by_one]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_batching_regenerates_what_the_batch_generator_does(tmp_path, temperature):
    params = model.init_params(CFG, jax.random.key(1))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, 100, int(n)).tolist() for n in rng.integers(2, 30, 11)]
    kw = dict(max_prompt_tokens=24, max_new_tokens=12, shard_size=6, temperature=temperature, progress=False)
    batch = regenerate(Generator(CFG, params, max_seq_len=40), prompts, tmp_path / "b", batch=4, **kw)
    slots = regenerate(
        SlotGenerator(CFG, params, slots=3, max_seq_len=40), prompts, tmp_path / "s", batch=2,
        conversations=list(range(100, 111)), **kw,
    )  # fmt: skip
    a, b = read_shards(batch), read_shards(slots)
    assert len(a) == len(b) == sum(len(p) <= 24 for p in prompts)
    for x, y in zip(a, b, strict=True):
        assert (x["index"], x["response_ids"], x["finish_reason"]) == (
            y["index"],
            y["response_ids"],
            y["finish_reason"],
        )
        assert y["conversation"] == 100 + y["index"]
    assert json.loads((tmp_path / "s" / "regen.json").read_text())["dtype"] == "float32"


def test_until_stops_after_the_data_with_every_temperature(tmp_path):
    from peagle_jax.train.cli import main

    out = tmp_path / "run"
    main([
        "--config", "train/configs/tiny.yaml", "data.max_prompts=16", "--output", str(out), "data.turns=all",
        "data.regen_slots=4", "data.extra_temperatures=1.0", "--until", "data", "run.progress=false",
    ])  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["regen", "regen-t1", "run.json", "target"]
    greedy, sampled = (read_shards(sorted((out / d).glob("shard-*.jsonl"))) for d in ("regen", "regen-t1"))
    assert [r["index"] for r in greedy] == [r["index"] for r in sampled] and greedy
    assert any(g["response_ids"] != s["response_ids"] for g, s in zip(greedy, sampled, strict=True))
    assert json.loads((out / "regen-t1" / "regen.json").read_text())["temperature"] == 1.0


def test_a_killed_feature_cache_build_resumes_without_a_torn_chunk(tmp_path, monkeypatch):
    from peagle_jax.train import features
    from peagle_jax.train.prompts import DataError

    params = model.init_params(CFG, jax.random.key(2))
    rows = _rows(R=8)
    kw = dict(dtype="bfloat16", chunk_rows=2, progress=False)
    want = features.build_cache(params, CFG, rows, tmp_path / "whole", **kw)
    chunks = -(-rows.tokens.shape[0] // 2)

    # Killed after chunk 1's files are both in place but before its manifest line: the files look whole.
    real_digest, calls = features._digest, []

    def dying_digest(path):
        calls.append(path.name)
        if path.name == "hidden-00001.bin":
            raise KeyboardInterrupt
        return real_digest(path)

    monkeypatch.setattr(features, "_digest", dying_digest)
    with pytest.raises(KeyboardInterrupt):
        features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    monkeypatch.setattr(features, "_digest", real_digest)
    assert (tmp_path / "f" / "hidden-00001.bin").exists() and sorted(features._manifest(tmp_path / "f")) == [0]
    # A reader refuses the unrecorded chunk rather than reading it.
    with pytest.raises(DataError, match="hidden-00001.bin|aux-00001.bin"):
        features.FeatureCache(tmp_path / "f").rows([2])

    computed = []
    real_features = features.target_features
    monkeypatch.setattr(features, "target_features", lambda *a, **k: computed.append(1) or real_features(*a, **k))
    cache = features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    assert len(computed) == chunks - 1  # chunk 0 kept; chunk 1 (torn) and the rest built
    assert sorted(features._manifest(tmp_path / "f")) == list(range(chunks))
    monkeypatch.setattr(features, "OPEN_CHUNKS", 2)  # a reader maps only the chunks it read last
    for r in [*range(rows.tokens.shape[0]), 0, 7, 1]:
        for got, ref in zip(cache.rows([r]), want.rows([r]), strict=True):
            np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))
        assert len(cache._open) <= 2

    # A chunk changed on disk after the build is refused when first read, naming the file.
    path = tmp_path / "f" / "aux-00002.bin"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="aux-00002.bin: missing or changed"):
        features.FeatureCache(tmp_path / "f").rows([4])
    # The build checks sizes only (the reader the checksums): with a file of the chunk removed it is rebuilt.
    (tmp_path / "f" / "hidden-00002.bin").unlink()
    features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    np.testing.assert_array_equal(
        features.FeatureCache(tmp_path / "f").rows([4])[0].view(np.uint16), want.rows([4])[0].view(np.uint16)
    )


def test_features_from_a_bf16_target_and_the_target_saved_in_fp32(tmp_path, capsys):
    from peagle_jax.checkpoint import load_target_any
    from peagle_jax.train.cli import main
    from peagle_jax.train.features import FeatureCache

    out = tmp_path / "run"
    main(["--config", "train/configs/tiny.yaml", "--output", str(out), "data.max_prompts=16", "target.dtype=bfloat16",
          "--until", "features", "run.progress=false"])  # fmt: skip
    assert "features in bfloat16" in capsys.readouterr().err
    cfg, params = load_target_any(out / "target")
    assert cfg.dtype == "float32" and params["embed_tokens"].dtype == np.float32
    aux, _ = FeatureCache(out / "features").rows([0])
    assert np.isfinite(aux.astype(np.float32)).all() and np.abs(aux.astype(np.float32)).max() > 0


def test_regeneration_buckets_answer_as_the_batch_generator(tmp_path):
    """The slot engine with the regeneration's finer buckets (prefill every 32 tokens, windows every 64
    slots) answers as the batch generator with a server's buckets (fp32), over prompts and answers long
    enough to cross several windows."""
    from peagle_jax.train.slot_regen import regen_buckets

    assert regen_buckets(200) == ((32, 64, 96, 128, 160, 192, 200), (64, 128, 192))
    params = model.init_params(CFG, jax.random.key(5))
    rng = np.random.default_rng(6)
    prompts = [rng.integers(5, 100, int(n)).tolist() for n in rng.integers(2, 130, 9)]
    kw = dict(max_prompt_tokens=140, max_new_tokens=60, shard_size=5, temperature=0.0, progress=False)
    gen = SlotGenerator(CFG, params, slots=3, max_seq_len=200)
    assert gen.engine.gen.window_buckets == (64, 128, 192, 200) and gen.engine.gen.num_slots == 200
    fine = read_shards(regenerate(gen, prompts, tmp_path / "s", **kw))
    batch = read_shards(regenerate(Generator(CFG, params, max_seq_len=200), prompts, tmp_path / "b", batch=4, **kw))
    assert [(r["index"], r["response_ids"]) for r in fine] == [(r["index"], r["response_ids"]) for r in batch]
    assert max(len(p) + len(r["response_ids"]) for p, r in zip(prompts, fine, strict=True)) > 128
    with pytest.raises(ValueError, match="buckets must be"):
        SlotGenerator(CFG, params, slots=3, max_seq_len=200, buckets="fine")


def test_a_feature_cache_build_stops_cleanly_on_a_full_disk(tmp_path, monkeypatch):
    """Projected from its first chunk, a cache the disk cannot hold is refused before the rest is computed; a
    disk that fills up anyway ends the build with one line, no temporary file left; both resume."""
    import errno
    import shutil

    from peagle_jax.train import features
    from peagle_jax.train.prompts import DataError

    params = model.init_params(CFG, jax.random.key(2))
    rows = _rows(R=8)
    kw = dict(dtype="bfloat16", chunk_rows=2, progress=False)
    want = features.build_cache(params, CFG, rows, tmp_path / "whole", **kw)
    per_chunk = want.sizes()[0] / 4
    usage = shutil.disk_usage(tmp_path)

    def free(n):
        monkeypatch.setattr(features.shutil, "disk_usage", lambda _: usage._replace(free=int(n)))

    free(2.5 * per_chunk)  # three chunks to go after the first: about 3 x per_chunk
    with pytest.raises(DataError, match=r"needs about .* GiB more and the disk has .* GiB free"):
        features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    assert sorted(features._manifest(tmp_path / "f")) == [0]

    real_encode = features._encode_row
    written = []

    def filling_encode(row, dtype):
        written.append(1)
        if len(written) > 2:  # chunk 1's second row: the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_encode(row, dtype)

    free(3.5 * per_chunk)
    monkeypatch.setattr(features, "_encode_row", filling_encode)
    with pytest.raises(DataError, match="the disk is full"):
        features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    assert sorted(features._manifest(tmp_path / "f")) == [0]
    assert not list((tmp_path / "f").glob("*.tmp"))

    monkeypatch.setattr(features, "_encode_row", real_encode)
    cache = features.build_cache(params, CFG, rows, tmp_path / "f", **kw)
    for r in range(8):
        for got, ref in zip(cache.rows([r]), want.rows([r]), strict=True):
            np.testing.assert_array_equal(got.view(np.uint16), ref.view(np.uint16))


def test_regeneration_workers_write_the_shards_one_process_writes(tmp_path):
    """``data.regen_workers=2``: two processes, each on its own core and every other shard of every pass,
    write the same shards as one process (fp32), and compile into the run's compilation cache; a worker
    that fails ends the run with one line."""
    from peagle_jax.train.cli import main
    from peagle_jax.train.regen_workers import core_shares, regenerate_in_workers

    common = ["--config", "train/configs/tiny.yaml", "data.max_prompts=10", "data.shard_size=3", "data.regen_slots=4"]
    common += ["data.extra_temperatures=1.0", "--until", "data", "run.progress=false"]
    main([*common, "--output", str(tmp_path / "one")])
    # In a process of its own, whose compilation cache the test chooses (JAX fixes it at the first compile).
    cache = tmp_path / "jax-cache"
    two = [*common, "--output", str(tmp_path / "two"), "data.regen_workers=2", f"run.compilation_cache={cache}"]
    proc = subprocess.run([sys.executable, "train/train.py", *two], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Only the workers decode (the run's own process finds every shard answered).
    assert any(p.name.startswith("jit_decode_step-") for p in cache.iterdir())
    for d in ("regen", "regen-t1"):
        one, two = (sorted((tmp_path / name / d).glob("shard-*.jsonl")) for name in ("one", "two"))
        assert [p.name for p in one] == [p.name for p in two] and len(one) == 4
        for a, b in zip(one, two, strict=True):
            assert a.read_text() == b.read_text()
        assert not list((tmp_path / "two" / d).glob("*.partial")) and not list((tmp_path / "two" / d).glob("*.tmp"))

    shares = core_shares(2)
    assert shares == [None, None] or (not shares[0] & shares[1] and len(shares[0] | shares[1]) >= 2)
    recipe = load_recipe("train/configs/tiny.yaml", ["data.regen_workers=2", "data.regen_slots=4"])
    with pytest.raises(DataError, match=r"regeneration worker 1 of 2 stopped with exit code 1 .*run again to resume"):
        regenerate_in_workers(recipe, tmp_path / "bad", str(tmp_path / "missing"), [[5, 6]], [0], [2], print)


def test_a_regeneration_worker_ends_with_the_process_that_started_it():
    code = "import time; from peagle_jax.train.regen_workers import _exit_with_parent as e; e(-1); time.sleep(60)"
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 1  # its parent is not -1
