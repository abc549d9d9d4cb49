"""Speculative decoding end to end: greedy and seeded sampling equal plain decoding token for token;
sampling is lossless by distribution; trees compact the cache; graphs compile once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from peagle_jax.drafter import draft as D
from peagle_jax.drafter.config import DrafterConfig
from peagle_jax.drafter.model import init_drafter_params
from peagle_jax.engine.generator import Generator
from peagle_jax.errors import UserError, comma_ints, comma_list
from peagle_jax.models import model as M
from peagle_jax.models.config import ModelConfig
from peagle_jax.sampling import SamplingParams, processed_logits
from peagle_jax.spec import verify as V
from peagle_jax.spec.generator import SpeculativeGenerator
from peagle_jax.spec.graphs import fused_step

# A 6-token vocabulary and large weights: random models then agree often enough that drafts are accepted
# at every depth, which is what these tests must exercise.
CFG = ModelConfig(
    family="llama",
    vocab_size=6,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
DCFG = DrafterConfig(
    layer=CFG.replace(num_layers=1, aux_layer_ids=(0,)), algorithm="peagle", mask_token_id=5, own_embedding=False
)
PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 0, 1, 2], [3, 4, 1], [0, 0, 1, 1, 2]]


def _scaled(tree, s):
    return jax.tree.map(lambda x: x * s if x.dtype == jnp.float32 and x.ndim > 1 else x, tree)


@pytest.fixture(scope="module")
def models():
    return _scaled(M.init_params(CFG, jax.random.key(1)), 30), _scaled(init_drafter_params(DCFG, jax.random.key(2)), 30)


@pytest.fixture(scope="module")
def plain_greedy(models):
    return Generator(CFG, models[0], max_seq_len=64).generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])


@pytest.mark.parametrize(
    "k,tree,sequential,fused",
    [
        (1, None, False, False),
        (3, None, False, False),
        (7, None, False, False),
        (3, None, True, False),
        (3, None, False, True),
        (4, None, True, True),
        (None, "0,1,00,10,000", False, False),
        (None, "0,1,2,00,000", True, False),
    ],
)
def test_greedy_equals_plain_greedy(models, plain_greedy, k, tree, sequential, fused):
    params, dparams = models
    gen = SpeculativeGenerator(
        CFG,
        params,
        DCFG,
        dparams,
        k=k,
        tree=V.parse_tree(tree) if tree else None,
        sequential=sequential,
        fused=fused,
        max_seq_len=64,
    )
    launches = fused_step._cache_size()
    results = gen.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_greedy]
    # The verify is launched on the draft's unread tokens (without time_draft): no draft time of its own.
    assert gen.spec.draft_s == 0.0
    assert not fused or fused_step._cache_size() > launches
    assert gen.spec.accepted_per_position[0] > 0  # drafts were accepted: acceptance was exercised
    assert gen.spec.acceptance_length > 1.0


@pytest.mark.parametrize("fused", [False, True])
def test_time_draft_times_the_draft_launch_apart(models, plain_greedy, fused):
    """bench.spec's draft and verify columns: with ``time_draft`` a step waits for its draft before launching
    the verify and times the two apart (--fused has one launch: all of it is verify); the tokens are the same."""
    params, dparams = models
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, fused=fused, max_seq_len=64)
    gen.time_draft = True
    results = gen.generate(PROMPTS, max_new_tokens=24, stop_token_ids=[])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain_greedy]
    assert (gen.spec.draft_s > 0.0) != fused
    assert gen.spec.verify_s > 0.0


def test_seeded_sampling_equals_plain_sampling_token_for_token(models):
    params, dparams = models
    kw = dict(
        max_new_tokens=24,
        stop_token_ids=[],
        temperature=[0.9, 1.2, 0.0],
        top_k=[0, 4, 0],
        top_p=[0.9, 1.0, 1.0],
        seed=[3, 4, 5],
    )
    plain = Generator(CFG, params, max_seq_len=64).generate(PROMPTS, **kw)
    for tree in (None, V.parse_tree("0,1,00,10")):
        gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3 if tree is None else None, tree=tree, max_seq_len=64)
        assert [r.token_ids for r in gen.generate(PROMPTS, **kw)] == [r.token_ids for r in plain]
        assert gen.spec.accepted_per_position[0] > 0


def test_stop_tokens_and_lengths_per_row(models, plain_greedy):
    params, dparams = models
    stop = plain_greedy[0].token_ids[5]
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=64)
    res = gen.generate(PROMPTS, max_new_tokens=10, stop_token_ids=[stop])
    for r, p in zip(res, plain_greedy, strict=True):
        cut = p.token_ids[:10]
        if stop in cut:
            cut = cut[: cut.index(stop) + 1]
        assert r.token_ids == cut


def test_a_row_does_not_depend_on_the_others(models):
    params, dparams = models
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=64)
    kw = dict(max_new_tokens=16, stop_token_ids=[], temperature=1.0, seed=7)
    alone = gen.generate([PROMPTS[1]], **kw)[0].token_ids
    together = gen.generate([PROMPTS[0], PROMPTS[1], [5, 5, 5, 5]], **kw)[1].token_ids
    assert alone == together


def test_first_two_tokens_follow_the_target_distribution(models):
    """Chi-square of (token 1, token 2) from 768 seeds against the exact distribution of the target
    (temperature 1.3, top-k 4, top-p 0.95, in the plain sampler's order)."""
    params, dparams = models
    prompt, temp, top_k, top_p = [3, 4, 1], 1.3, 4, 0.95
    sp = SamplingParams.make(1, temp, top_k, top_p)

    def dist(tokens):
        out, _ = M.forward_jit(params, M.new_cache(CFG, 1, 16), jnp.asarray([tokens]), jnp.zeros(1, jnp.int32), cfg=CFG)
        return np.asarray(jax.nn.softmax(processed_logits(out.logits[:, -1], sp)))[0].astype(np.float64)

    p1 = dist(prompt)
    exact = {(a, b): p1[a] * pb for a in range(6) if p1[a] > 0 for b, pb in enumerate(dist(prompt + [a]))}
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=64)
    counts: dict[tuple[int, int], int] = {}
    n = 0
    for start in range(0, 768, 64):
        for r in gen.generate(
            [prompt] * 64,
            max_new_tokens=2,
            stop_token_ids=[],
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            seed=list(range(start, start + 64)),
        ):
            key = tuple(r.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
            n += 1
    assert set(counts) <= {k for k, p in exact.items() if p > 0}
    big = [k for k, p in exact.items() if p * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    expected = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    _, pvalue = stats.chisquare(observed, np.asarray(expected) * sum(observed) / sum(expected))
    assert pvalue > 1e-3


def test_verify_accepts_a_perfect_chain_and_compacts_a_tree(models):
    """Drafts equal to the target's own greedy continuation are all accepted; when the right branch is the
    second candidate of a tree, the accepted path is moved into place and decoding continues exactly."""
    params, _ = models
    prompt = PROMPTS[0]
    ref = Generator(CFG, params, max_seq_len=64).generate([prompt], max_new_tokens=8, stop_token_ids=[])[0].token_ids
    L, K = len(prompt), 3
    sp = SamplingParams.make(1)

    def prefilled():
        cache = M.new_cache(CFG, 1, 64)
        _, cache = M.forward_jit(params, cache, jnp.asarray([prompt]), jnp.zeros(1, jnp.int32), cfg=CFG)
        return cache

    root, q = jnp.asarray([ref[0]]), jnp.asarray([L], jnp.int32)
    # Chain: candidates [B, K, 1] = the true continuation.
    drafts = jnp.asarray([[[t] for t in ref[1 : 1 + K]]], jnp.int32)
    out, _ = V.verify(
        params,
        prefilled(),
        root,
        drafts,
        q,
        jnp.zeros(1, jnp.uint32),
        sp,
        cfg=CFG,
        tree=V.chain(K),
        window=64,
        greedy_only=True,
    )
    assert int(out.count[0]) == K + 1 and out.tokens[0].tolist() == ref[1 : K + 2]
    # Tree "0,1,00,10": the true token is candidate 1 at depth 1, candidate 0 at depth 2.
    wrong = (ref[1] + 1) % 6
    drafts = jnp.asarray([[[wrong, ref[1]], [ref[2], (ref[2] + 1) % 6]]], jnp.int32)
    tree = V.parse_tree("0,1,00,10")
    out, cache = V.verify(
        params,
        prefilled(),
        root,
        drafts,
        q,
        jnp.zeros(1, jnp.uint32),
        sp,
        cfg=CFG,
        tree=tree,
        window=64,
        greedy_only=True,
    )
    assert int(out.count[0]) == 3 and out.tokens[0, :3].tolist() == ref[1:4]
    # Continue with single-token steps from the compacted cache: must reproduce the reference.
    tok, pos = ref[3], L + 3
    for expected in ref[4:8]:
        step, cache = M.forward_jit(params, cache, jnp.asarray([[tok]]), jnp.asarray([pos], jnp.int32), cfg=CFG)
        tok, pos = int(jnp.argmax(step.logits[0, -1])), pos + 1
        assert tok == expected


def test_every_graph_compiles_once_over_varied_steps(models):
    params, dparams = models
    gen = SpeculativeGenerator(CFG, params, DCFG, dparams, k=3, max_seq_len=64)
    gen.generate(PROMPTS, max_new_tokens=4, stop_token_ids=[])
    graphs = (V.verify, D.parallel_draft, D.drafter_prefill)
    before = [g._cache_size() for g in graphs]
    steps = gen.spec.steps
    gen.generate([[2, 1, 0], [4, 4, 4, 4, 4], [1, 2]], max_new_tokens=40, stop_token_ids=[])
    assert gen.spec.steps - steps >= 20
    assert [g._cache_size() for g in graphs] == before


def test_tree_specs():
    t = V.parse_tree("0,1,00,10,000")
    assert (t.size, t.depth, t.width) == (5, 3, 2)
    assert t.parents == (0, 0, 1, 2, 3) and t.depths == (1, 1, 2, 2, 3) and t.ranks == (0, 1, 0, 0, 0)
    assert V.parse_tree("0,00,000").is_chain and not t.is_chain
    for bad in ("", "0,x", "00", "0,0"):
        with pytest.raises(ValueError):
            V.parse_tree(bad)
    for bad in ("0,,1", "0,1,", ",0", " "):  # an empty item is a typo, not a tree
        with pytest.raises(UserError, match="--tree .*without empty ones"):
            V.parse_tree(bad)


def test_mismatched_drafter_is_refused(models):
    params, dparams = models
    eagle3 = DCFG.replace(algorithm="eagle3")
    with pytest.raises(ValueError, match="sequential"):
        SpeculativeGenerator(CFG, params, eagle3, dparams, k=3)
    with pytest.raises(ValueError, match="depth"):
        SpeculativeGenerator(CFG, params, DCFG, dparams, k=2, tree=V.parse_tree("0,00,000"))


def _tiny_drafter_dir(path, hidden: int, vocab: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 16):
    from peagle_jax.drafter.load import save_drafter

    layer = ModelConfig(
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        aux_layer_ids=(0,),
    )
    dcfg = DrafterConfig(
        layer=layer, algorithm="peagle", mask_token_id=vocab - 1, own_embedding=False, speculative_tokens=3
    )
    save_drafter(path, dcfg, init_drafter_params(dcfg, jax.random.key(3)))
    return path


def test_generate_cli_with_a_drafter(save_hf, tmp_path):
    import json
    import subprocess
    import sys

    from conftest import tiny_hf_model

    hf = tiny_hf_model("llama", seed=3)
    model_dir = save_hf(hf)
    drafter = _tiny_drafter_dir(tmp_path / "drafter", 64, 128)
    base = [
        sys.executable,
        "-m",
        "peagle_jax.generate",
        "--model",
        str(model_dir),
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    plain = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    fixed = ["--k-policy", "fixed"]  # draft at every step (the default may decode plainly: what it measured fastest)
    for extra in ([], ["--k", "2", "--sequential", *fixed], ["--tree", "0,1,00", "--fused", *fixed]):
        run = subprocess.run(base + ["--drafter", str(drafter), *extra], capture_output=True, text=True, check=True)
        spec = json.loads(run.stdout)
        assert spec["token_ids"] == plain["token_ids"]
        assert len(spec["accepted_per_position"]) == (2 if "--sequential" in extra else 3 if not extra else 2)
        if extra:
            assert spec["plain_steps"] == 0 and spec["target_forwards"] >= 1 and spec["acceptance_length"] >= 1.0
        else:  # every step is a plain step or a speculative one
            assert spec["plain_steps"] + spec["target_forwards"] >= 1
    bad = subprocess.run(base + ["--k", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "--drafter" in bad.stderr


@pytest.mark.slow
def test_real_smollm2_greedy_speculative_equals_plain(tmp_path):
    """SmolLM2-135M with a random SmolLM2-sized drafter (shared embedding): acceptance is low, but every
    emitted token must be the target's own greedy token, for fused chains (parallel and sequential), a chain
    of 1, and one row. The unfused chain of 7, the default tree and sequential drafting are checked on SmolLM2
    with the shipped trained drafters (tests/test_shipped_drafters.py), where drafts are also accepted."""
    from transformers import AutoTokenizer

    from peagle_jax.drafter.load import load_drafter
    from peagle_jax.models.gguf import default_model_dir
    from peagle_jax.models.weights import load_target

    model_dir = default_model_dir()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "List three uses of a paperclip."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    cfg, params = load_target(model_dir)
    dcfg, dparams = load_drafter(_tiny_drafter_dir(tmp_path / "d", 576, 49152, heads=9, kv_heads=3, head_dim=64))
    plain = Generator(cfg, params, max_seq_len=256).generate(
        [prompt, prompt[:20]], max_new_tokens=24, stop_token_ids=[]
    )
    variants = (dict(k=1), dict(k=3, fused=True), dict(k=2, sequential=True, fused=True))
    for kw in variants:
        gen = SpeculativeGenerator(cfg, params, dcfg, dparams, max_seq_len=256, **kw)
        res = gen.generate([prompt, prompt[:20]], max_new_tokens=24, stop_token_ids=[])
        assert [r.token_ids for r in res] == [r.token_ids for r in plain]
    single = SpeculativeGenerator(cfg, params, dcfg, dparams, max_seq_len=256, k=3)  # batch 1
    assert single.generate([prompt], max_new_tokens=24, stop_token_ids=[])[0].token_ids == plain[0].token_ids


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_verify_moves_the_accepted_path_in_place(dtype):
    """Compacting a tree's accepted path writes K slots per row into the donated cache: the compiled verify
    neither copies a layer's cache nor rebuilds it from per-row pieces (the first version stacked the rows,
    the second wrote them back one by one; each copied every layer's whole cache at each tree step), with
    more rows in the cache than in the step."""
    import re

    cfg = CFG.replace(dtype=dtype)
    params = M.init_params(cfg, jax.random.key(0))
    B, S, tree = 3, 64, V.parse_tree("0,1,00,10,000")
    cache = M.new_cache(cfg, 4, S)  # 4 rows: the step runs the first 3
    text = (
        V.verify.lower(
            params,
            cache,
            jnp.zeros(B, jnp.int32),
            jnp.zeros((B, tree.depth, tree.width), jnp.int32),
            jnp.full(B, 5, jnp.int32),
            jnp.zeros(B, jnp.uint32),
            SamplingParams.make(B),
            cfg=cfg,
            tree=tree,
            window=S,
            greedy_only=True,
        )
        .compile()
        .as_text()
    )
    shape = rf"\[4,{cfg.num_kv_heads},{S},{cfg.head_dim}\]"
    ops = re.findall(rf"= \w+{shape}\S* (\S+)\(", text)
    assert "copy" not in ops and "concatenate" not in ops, sorted(set(ops))


def test_comma_lists_refuse_empty_items():
    assert comma_list(" a, b ", "--x", "a,b") == ["a", "b"]
    assert comma_ints("4,12", "--k", "3,7") == [4, 12]
    for bad in ("", "1,,2", "1,2,", ","):
        with pytest.raises(UserError, match=f"--k {bad!r}: expected comma-separated items without empty ones"):
            comma_ints(bad, "--k", "3,7")
    with pytest.raises(UserError, match="--k '1,x': expected comma-separated integers, e.g. 3,7"):
        comma_ints("1,x", "--k", "3,7")
