"""Training data: prompt salvage and formats, resumable regeneration, draft vocabulary, packing and the
EAGLE-shifted layout, online vs cached features, batches as a pure function of the data position."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.engine.generator import Generator
from peagle_jax.models import model
from peagle_jax.models.config import ModelConfig
from peagle_jax.train.data import TrainData
from peagle_jax.train.features import FeatureCache, _decode_row, _encode_row, build_cache, target_features
from peagle_jax.train.objective import element_positions, loss_weights
from peagle_jax.train.pack import PackedRows, conversation, pack, training_layout
from peagle_jax.train.prompts import DataError, read_chat_jsonl, read_sharegpt, salvage_json_array
from peagle_jax.train.regen import read_shards, regenerate
from peagle_jax.train.vocab import coverage, draft_vocab, token_counts, unused_token_id

CFG = ModelConfig(
    family="llama",
    vocab_size=101,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    eos_token_ids=(3,),
)


def test_salvage_truncated_json_array():
    records = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} ]}}"}]} for i in range(3)]
    text = json.dumps(records)
    assert salvage_json_array(text) == (records, False)
    cut = text[: text.index('{"id": 2') + 12]
    assert salvage_json_array(cut) == (records[:2], True)
    with pytest.raises(DataError):
        salvage_json_array('{"not": "an array"}')


def test_prompt_formats(tmp_path):
    sharegpt = [
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
            ]
        },
        {"conversations": [{"from": "gpt", "value": "starts with the answer"}]},  # no user turn first: skipped
        {"conversations": [{"from": "human", "value": "  "}]},  # empty: skipped
        {"conversations": [{"from": "human", "value": "second"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(sharegpt)[:-30])  # truncated inside the last record
    prompts, complete = read_sharegpt(path)
    assert complete == 3
    assert prompts == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    jl = tmp_path / "chat.jsonl"
    jl.write_text(
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
        + "\n\n"
        + json.dumps([{"role": "user", "content": "c"}])
        + "\n"
    )
    assert read_chat_jsonl(jl) == [[{"role": "user", "content": "a"}], [{"role": "user", "content": "c"}]]
    # With the dataset's answers (data.responses: dataset): only first turns answered right after them.
    assert read_chat_jsonl(jl, replies=True) == [
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ]
    assert read_sharegpt(path, replies=True) == (
        [
            [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ]
        ],
        3,
    )
    jl.write_text(json.dumps({"messages": [{"role": "robot", "content": "a"}]}) + "\n")
    with pytest.raises(DataError, match="chat.jsonl:1.*unknown role 'robot'"):
        read_chat_jsonl(jl)
    jl.write_text("{not json\n")
    with pytest.raises(DataError, match="chat.jsonl:1: not valid JSON"):
        read_chat_jsonl(jl)


@pytest.mark.slow
def test_sharegpt_asset_salvage_count():
    from peagle_jax.assets import fetch

    prompts, complete = read_sharegpt(fetch("sharegpt"))
    assert complete == 17_671  # the complete records before the cut (assets.md)
    assert len(prompts) == 11_157  # of which start with a non-empty human turn
    assert all(p[-1]["role"] == "user" and p[-1]["content"].strip() for p in prompts)


class _Interrupt(Exception):
    pass


def test_regeneration_resumes_without_loss_or_duplicates(tmp_path):
    params = model.init_params(CFG, jax.random.key(0))
    gen = Generator(CFG, params, max_seq_len=64)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(4, 100, n)) for n in (5, 9, 3, 40, 7, 2, 11)]  # the 40-token one is too long
    kw = dict(max_prompt_tokens=30, max_new_tokens=6, batch=2, shard_size=3, progress=False)
    whole = read_shards(regenerate(gen, prompts, tmp_path / "whole", **kw))

    calls = {"n": 0}
    real = gen.generate

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # dies inside the second shard
            raise _Interrupt
        return real(*a, **k)

    gen.generate = dying
    with pytest.raises(_Interrupt):
        regenerate(gen, prompts, tmp_path / "resumed", **kw)
    assert sorted(p.name for p in (tmp_path / "resumed").glob("shard-*.jsonl")) == ["shard-00000.jsonl"]
    gen.generate = real
    resumed = read_shards(regenerate(gen, prompts, tmp_path / "resumed", **kw))
    assert resumed == whole
    assert [r["index"] for r in whole] == [0, 1, 2, 4, 5, 6]
    skipped = [json.loads(line) for line in (tmp_path / "whole" / "shard-00001.jsonl").read_text().splitlines()]
    assert skipped[1] == {"index": 3, "skipped": "prompt has 40 > 30 tokens"}
    # Each response is the target's own greedy continuation.
    for r in whole:
        assert r["response_ids"] == gen.generate([r["prompt_ids"]], max_new_tokens=6)[0].token_ids
    with pytest.raises(DataError, match="max_new_tokens"):
        regenerate(gen, prompts, tmp_path / "whole", **{**kw, "max_new_tokens": 7})

    # A larger run later: finished shards are kept, the short last one is completed, new ones added.
    more = prompts + [list(rng.integers(4, 100, n)) for n in (6, 8, 4)]
    calls["n"] = 0
    counted = []
    gen.generate = lambda rows, **k: counted.append(len(rows)) or real(rows, **k)
    grown = read_shards(regenerate(gen, more, tmp_path / "whole", **kw))
    assert grown[: len(whole) - 1] == whole[:-1] and [r["index"] for r in grown][-4:] == [6, 7, 8, 9]
    assert sum(counted) == 4  # prompts 6..9: shards 0 and 1 were not regenerated
    with pytest.raises(DataError, match="other prompts"):
        regenerate(gen, [[5, 5]] + more[1:], tmp_path / "whole", **kw)


def test_draft_vocab():
    counts = np.array([0, 5, 2, 9, 2, 0, 1], np.int64)
    used, d2t, t2d = draft_vocab(counts, 4)
    np.testing.assert_array_equal(used, [1, 2, 3, 4])  # 3, 1, then the tie 2 / 4 both kept
    np.testing.assert_array_equal(used, np.arange(4) + d2t)
    np.testing.assert_array_equal(np.flatnonzero(t2d), used)
    used, _, _ = draft_vocab(counts, 3)
    np.testing.assert_array_equal(used, [1, 2, 3])  # tie between 2 and 4 goes to the smaller id
    used, _, _ = draft_vocab(np.array([0, 3, 0, 0]), 3)
    np.testing.assert_array_equal(used, [0, 1, 2])  # unseen ids fill up in id order
    assert coverage(counts, np.array([3])) == pytest.approx(9 / 19)
    assert token_counts([[1, 1, 3], []], 5).tolist() == [0, 2, 0, 1, 0]
    assert unused_token_id(counts, reserved=[5]) == 0
    with pytest.raises(ValueError):
        draft_vocab(counts, 8)


def test_packing_and_training_layout():
    convs = [([10, 11, 12, 13, 14], [0, 0, 1, 1, 1]), ([20, 21, 22], [0, 1, 1]), ([30, 31], [0, 1])]
    rows = pack(convs, 8)  # the 2-token conversation carries no signal and is dropped
    np.testing.assert_array_equal(rows.tokens[0], [10, 11, 12, 13, 14, 20, 21, 22])
    np.testing.assert_array_equal(rows.positions[0], [0, 1, 2, 3, 4, 0, 1, 2])
    np.testing.assert_array_equal(rows.document[0], [0, 0, 0, 0, 0, 1, 1, 1])
    tokens, loss_mask, docs = training_layout(rows)
    # slot r: token x[r+1]; loss where x[r+1] is a response token and x[r+2] exists; -1 at a last slot.
    np.testing.assert_array_equal(tokens[0], [11, 12, 13, 14, 0, 21, 22, 0])
    np.testing.assert_array_equal(loss_mask[0], [0, 1, 1, 0, 0, 1, 0, 0])
    np.testing.assert_array_equal(docs[0], [0, 0, 0, 0, -1, 1, 1, -1])
    rows = pack([([1] * 6, [1] * 6), ([2] * 5, [1] * 5), ([3] * 3, [1] * 3)], 8)  # first fit decreasing
    assert rows.tokens.shape == (2, 8)
    np.testing.assert_array_equal(rows.document[0], [0] * 6 + [-1] * 2)
    np.testing.assert_array_equal(rows.tokens[1], [2] * 5 + [3] * 3)
    assert conversation({"prompt_ids": [1, 2], "response_ids": [3]}) == ([1, 2, 3], [0, 0, 1])


def _rows(R=6, T=24, seed=0):
    rng = np.random.default_rng(seed)
    convs = [(list(rng.integers(4, 100, n)), [0] * 3 + [1] * (n - 3)) for n in rng.integers(5, T, 2 * R)]
    return pack(convs, T)


def test_target_features_are_the_targets_per_conversation():
    """Packed rows give each conversation exactly the features of a forward over it alone."""
    params = model.init_params(CFG, jax.random.key(1))
    rows = _rows()
    aux, hidden = target_features(params, rows.tokens, rows.positions, rows.document, cfg=CFG, dtype="float32")
    r = 0
    for d in range(int(rows.document[r].max()) + 1):
        idx = np.flatnonzero(rows.document[r] == d)
        x = rows.tokens[r, idx][None]
        out, _ = model.forward(params, model.new_cache(CFG, 1, len(idx)), x, np.zeros(1, np.int32), cfg=CFG)
        np.testing.assert_allclose(aux[r, idx], out.aux[0], atol=1e-5)
        np.testing.assert_allclose(hidden[r, idx[:-1]], out.hidden[0, 1:], atol=1e-5)  # the next slot's state
        np.testing.assert_array_equal(np.asarray(hidden[r, idx[-1]]), 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cached_row_is_stored_losslessly_and_its_zeros_take_almost_no_room(dtype):
    # A row of target_hidden is zero off the loss positions (about half of a row): here 40 of 64 positions.
    row = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    row[:40] = 0
    row = row.astype(jnp.bfloat16) if dtype == "bfloat16" else row
    high, low = _encode_row(row, dtype)
    back = _decode_row(np.frombuffer(high + low, np.uint8), 0, (len(high), len(low)), row.shape, dtype)
    assert back.dtype == row.dtype
    np.testing.assert_array_equal(back.view(np.uint8), row.view(np.uint8))
    # The zeros cost under 1% of the row's raw bytes beyond what its 24 nonzero positions take alone.
    nonzero = sum(len(p) for p in _encode_row(row[40:], dtype))
    assert len(high) + len(low) <= nonzero + 0.01 * row.nbytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_online_and_cached_features_give_the_same_batches(tmp_path, dtype):
    params = model.init_params(CFG, jax.random.key(2))
    rows = _rows()
    B = 2
    train = np.arange(rows.tokens.shape[0])
    kw = dict(batch_size=B, num_depths=3, seed=5, feature_dtype=dtype)
    cache = build_cache(params, CFG, rows, tmp_path / "f", dtype=dtype, chunk_rows=B, progress=False)
    cached = TrainData(rows, train, features=cache, **kw)
    online = TrainData(rows, train, target=(params, CFG), **kw)
    for pos in (0, 1, 7):
        a, b = cached.batch_at(pos), online.batch_at(pos)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        # Lazy features (a process of a multi-process run) give each row range what the whole batch holds,
        # with the shape and dtype announced before any row is computed: read from the cache bit for bit;
        # from the target, run on fewer rows, equal up to rounding.
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-6)
        for data, check in ((cached, np.testing.assert_array_equal), (online, None)):
            lazy = data.batch_at(pos, lazy_features=True)
            for got, want in ((lazy.aux_BTX, a.aux_BTX), (lazy.target_hidden_BTD, a.target_hidden_BTD)):
                assert got.shape == want.shape and got.dtype == want.dtype
                for part, sl in ((got[1:2], np.s_[1:2]), (got[0:1, :, :5], np.s_[0:1, :, :5])):
                    want_part = np.asarray(want)[sl]
                    if check is None:
                        np.testing.assert_allclose(part.astype(np.float32), want_part.astype(np.float32), **tol)
                    else:
                        check(part, want_part)
            assert len(lazy.aux_BTX.memo) == 2  # rows 1:2 and 0:1, each computed once for the pair
    # Stored losslessly in fewer bytes than the values (both byte planes deflated).
    stored, raw = cache.sizes()
    assert stored == sum(p.stat().st_size for p in (tmp_path / "f").glob("*.bin"))
    assert raw == sum(a.nbytes for a in cache.rows(train))
    assert stored < {"bfloat16": 0.8, "float32": 0.9}[dtype] * raw
    # A second build over the same directory finds every chunk and recomputes nothing.
    again = build_cache(None, CFG, rows, tmp_path / "f", dtype=dtype, chunk_rows=B, progress=False)
    np.testing.assert_array_equal(np.asarray(again.rows([3])[0]), np.asarray(cache.rows([3])[0]))
    # ... also at another batch size: the cache keeps its chunking and still computes nothing.
    resized = build_cache(None, CFG, rows, tmp_path / "f", dtype=dtype, chunk_rows=B + 1, progress=False)
    assert resized.chunk == B
    np.testing.assert_array_equal(np.asarray(resized.rows([1, 4])[1]), np.asarray(cache.rows([1, 4])[1]))
    other = PackedRows(*(a[:4] for a in rows))
    with pytest.raises(DataError, match="other rows"):
        build_cache(params, CFG, other, tmp_path / "f", dtype=dtype, chunk_rows=B, progress=False)
    # A cache in another storage format (no "format" in its features.json) is refused, not misread.
    meta = json.loads((tmp_path / "f" / "features.json").read_text())
    (tmp_path / "f" / "features.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "format"}))
    for make in (
        lambda: FeatureCache(tmp_path / "f"),
        lambda: build_cache(None, CFG, rows, tmp_path / "f", dtype=dtype),
    ):
        with pytest.raises(DataError, match="another storage format"):
            make()


def test_batches_are_a_pure_function_of_the_position():
    rows = _rows(R=5)
    R = rows.tokens.shape[0]
    train = np.arange(R - 1)
    cache = type(
        "Zeros", (), {"rows": lambda self, idx: (np.zeros((len(idx), 24, 96)), np.zeros((len(idx), 24, 32)))}
    )()
    data = TrainData(rows, train, batch_size=2, num_depths=3, seed=1, features=cache)
    again = TrainData(rows, train, batch_size=2, num_depths=3, seed=1, features=cache)
    np.testing.assert_array_equal(np.asarray(data.batch_at(3).anchor_BY), np.asarray(again.batch_at(3).anchor_BY))
    # Padded to the batch's bucket, the elements are those of one shape for every batch (element_buckets=1),
    # and loss_at_BM lists every element with loss weight.
    one = TrainData(rows, train, batch_size=2, num_depths=3, seed=1, features=cache, element_buckets=1)
    for pos in range(4):
        b, w = data.batch_at(pos), one.batch_at(pos)
        Y = b.anchor_BY.shape[1]
        assert Y <= w.anchor_BY.shape[1] and b.loss_at_BM.shape[1] <= Y
        assert not np.asarray(w.valid_BY)[:, Y:].any()
        for f in ("anchor_BY", "depth_BY", "valid_BY"):
            np.testing.assert_array_equal(np.asarray(getattr(b, f)), np.asarray(getattr(w, f))[:, :Y])
        weight = np.asarray(loss_weights(b, element_positions(b.anchor_BY, b.depth_BY, b.tokens_BT.shape[1])))
        for r in range(2):
            at = np.asarray(b.loss_at_BM[r])
            assert set(np.flatnonzero(weight[r])) <= set(at[at >= 0].tolist())
    # One epoch visits every training row once.
    n = len(train)
    seen = np.concatenate([data.rows_at(p) for p in range(n // 2)])
    assert len(set(seen.tolist())) == len(seen) and set(seen.tolist()) <= set(train.tolist())
