"""Structured outputs (peagle_jax.grammar, llguidance): constrained speculative decoding equals constrained
plain decoding token for token (chains, trees, fused, the adaptive step length, grammar-aware drafting on and
off; greedy and seeded sampling; batches mixing constrained and free rows), every finished constrained output
matches its grammar (hypothesis-generated JSON schemas, validated with jsonschema), grammar-aware drafting
raises the acceptance, and bad grammars are refused."""

from __future__ import annotations

import json
import re

import pytest
from serve_fixtures import EOS_ID, char_tokenizer, write_tiny_drafter, write_tiny_model

from peagle_jax.checkpoint import load_target_any
from peagle_jax.drafter.load import load_drafter
from peagle_jax.engine.generator import Generator, RequestError
from peagle_jax.errors import UserError
from peagle_jax.grammar import Grammars
from peagle_jax.serve.slots import SlotEngine, SlotRequest
from peagle_jax.spec import verify as V
from peagle_jax.spec.generator import SpeculativeGenerator

MAX_SEQ = 192
REGEX = r"[0-9]{3}-[a-f]+"
CHOICES = ["yes", "no", "maybe"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grammar")
    cfg, params = load_target_any(write_tiny_model(root / "target"))
    dcfg, dparams = load_drafter(write_tiny_drafter(root / "drafter", k=3))
    grammars = Grammars(char_tokenizer(), cfg.vocab_size, [EOS_ID])
    return cfg, params, dcfg, dparams, grammars


def _encode(text):
    return char_tokenizer().encode(text, add_special_tokens=False)


def _requests(grammars):
    g = grammars.compile
    return [
        dict(prompt=_encode("json please"), max_new_tokens=120, grammar=g("json_schema", SCHEMA)),
        dict(prompt=_encode("free"), max_new_tokens=20),
        dict(prompt=_encode("code: "), max_new_tokens=30, temperature=0.9, seed=3, grammar=g("regex", REGEX)),
        dict(prompt=_encode("pick"), max_new_tokens=12, temperature=1.1, seed=8, grammar=g("choice", CHOICES)),
        dict(prompt=_encode("any json"), max_new_tokens=60, temperature=0.8, seed=1, grammar=g("json_object", None)),
        dict(prompt=_encode("again"), max_new_tokens=120, temperature=0.7, seed=5, grammar=g("json_schema", SCHEMA),
             presence_penalty=0.5),
        dict(prompt=_encode("free sampled"), max_new_tokens=25, temperature=1.0, seed=2),
    ]  # fmt: skip


def _run(engine, requests):
    reqs = [SlotRequest(stop_token_ids=[EOS_ID], **r) for r in requests]
    out, finish = {r.id: [] for r in reqs}, {}
    waiting = list(reqs)
    while waiting or engine.active:
        events = [engine.admit(waiting.pop(0))] if waiting and engine.free else []
        for ev in events + engine.step():
            out[ev.request.id] += ev.tokens
            finish[ev.request.id] = ev.finish_reason
    return [out[r.id] for r in reqs], [finish[r.id] for r in reqs]


def _text(tokens):
    return char_tokenizer().decode([t for t in tokens if t != EOS_ID])


def _check_matches(requests, outs, finishes):
    """Every constrained answer that ended by its grammar (EOS) matches it."""
    import jsonschema

    ended = 0
    for r, out, finish in zip(requests, outs, finishes, strict=True):
        if "grammar" not in r or finish != "stop":
            continue
        ended += 1
        text = _text(out)
        kind = {0: "schema", 2: "regex", 3: "choice", 4: "object", 5: "schema"}[requests.index(r)]
        if kind == "schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert isinstance(json.loads(text), dict)
    return ended


def test_plain_decoding_follows_the_grammars(setup):
    cfg, params, _, _, grammars = setup
    requests = _requests(grammars)
    engine = SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 3, grammars=grammars)
    outs, finishes = _run(engine, requests)
    assert _check_matches(requests, outs, finishes) >= 4
    free = _run(SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 3), [requests[1], requests[6]])[0]
    assert [outs[1], outs[6]] == free  # the free rows beside constrained ones: untouched


@pytest.mark.parametrize(
    "spec",
    [
        dict(k=3),
        dict(tree="0,1,00,10"),
        dict(tree="0,1,2,00,10,000", fused=True),
        dict(k=3, adaptive=True),
        dict(tree="0,1,00,10", aware=False),
    ],
)
def test_speculative_equals_plain_under_grammars(setup, spec):
    cfg, params, dcfg, dparams, grammars = setup
    requests = _requests(grammars)
    plain, _ = _run(SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 3, grammars=grammars), requests)
    kw = dict(spec)
    tree, adaptive, aware = kw.pop("tree", None), kw.pop("adaptive", False), kw.pop("aware", True)
    gen = SpeculativeGenerator(
        cfg, params, dcfg, dparams, tree=V.parse_tree(tree) if tree else None, max_seq_len=MAX_SEQ, **kw
    )
    engine = SlotEngine(gen, 3, grammars=grammars, adaptive=adaptive)
    engine.rows.grammar_drafting = aware
    outs, finishes = _run(engine, requests)
    assert outs == plain
    assert engine.structured["requests"] == 5 and engine.structured["emitted"] > 0


def test_grammar_aware_drafting_raises_the_acceptance(setup):
    """The JSON schema forces most of its tokens (keys, quotes, separators): drafting them where the random
    drafter proposes anything else lifts the constrained rows' tokens per target forward."""
    cfg, params, dcfg, dparams, grammars = setup
    requests = [r for r in _requests(grammars) if "grammar" in r]
    lengths = {}
    for aware in (False, True):
        engine = SlotEngine(
            SpeculativeGenerator(cfg, params, dcfg, dparams, k=3, max_seq_len=MAX_SEQ), 3, grammars=grammars
        )
        engine.rows.grammar_drafting = aware
        _run(engine, requests)
        lengths[aware] = engine.structured["emitted"] / engine.structured["target_forwards"]
    assert lengths[True] > lengths[False] + 0.3, lengths


def test_hypothesis_schemas_validate(setup):
    """Random JSON schemas (objects of bounded strings, integers, booleans, enums, arrays, nested objects):
    every constrained answer that ends is valid JSON of its schema, with speculation and without."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cfg, params, dcfg, dparams, grammars = setup
    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 99}),
        st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.text("abcxyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
            lambda xs: {"enum": xs}
        ),
    )
    value = st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, inner, st.integers(0, 2)),
            st.dictionaries(st.text("kvw", min_size=1, max_size=3), inner, min_size=1, max_size=3).map(
                lambda props: {
                    "type": "object",
                    "properties": props,
                    "required": sorted(props),
                    "additionalProperties": False,
                }
            ),  # fmt: skip
        ),
        max_leaves=5,
    )
    schemas = st.dictionaries(st.text("abcd", min_size=1, max_size=4), value, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    )
    plain = SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 2, grammars=grammars)
    spec = SlotEngine(SpeculativeGenerator(cfg, params, dcfg, dparams, k=3, max_seq_len=MAX_SEQ), 2, grammars=grammars)
    ended = []

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(schemas, st.integers(0, 2**31 - 1))
    def check(schema, seed):
        r = dict(
            prompt=_encode("{"), max_new_tokens=MAX_SEQ - 8, temperature=0.8, seed=seed,
            grammar=grammars.compile("json_schema", schema),
        )  # fmt: skip
        (out,), (finish,) = _run(plain, [r])
        assert _run(spec, [r])[0] == [out]
        if finish == "stop":
            jsonschema.validate(json.loads(_text(out)), schema)
            ended.append(schema)

    check()
    assert len(ended) >= 6


@pytest.mark.parametrize(
    "kind,value,message",
    [
        ("json_schema", {"type": "foo"}, "json_schema: .*foo"),
        ("regex", "[a-", "regex: .*regex"),
        ("choice", [], "choice: a choice needs at least one string"),
    ],
)
def test_bad_grammars_are_refused(setup, kind, value, message):
    with pytest.raises(UserError, match=message):
        setup[4].compile(kind, value)


def test_an_engine_without_grammars_refuses_them(setup):
    cfg, params, _, _, grammars = setup
    engine = SlotEngine(Generator(cfg, params, max_seq_len=MAX_SEQ), 2)
    with pytest.raises(RequestError, match="serves no structured outputs"):
        engine.admit(SlotRequest(_encode("x"), 3, grammar=grammars.compile("regex", "a+")))
    assert engine.active == 0


def test_no_compiles_after_warmup_with_grammars(setup):
    from peagle_jax.drafter import draft as D
    from peagle_jax.engine.generator import sample_jit
    from peagle_jax.models import model as M
    from peagle_jax.serve.slots import put_row
    from peagle_jax.spec.graphs import plain_step

    cfg, params, dcfg, dparams, grammars = setup
    gen = SpeculativeGenerator(cfg, params, dcfg, dparams, k=3, max_seq_len=MAX_SEQ)
    engine = SlotEngine(gen, 2, grammars=grammars, logprobs=True)
    engine.warmup()
    graphs = (M.prefill, sample_jit, put_row, V.verify, D.parallel_draft, D.drafter_prefill, plain_step)
    before = [g._cache_size() for g in graphs]
    _run(engine, _requests(grammars)[:4])
    assert [g._cache_size() for g in graphs] == before
    assert not engine.rows.constrained.any()  # every slot freed
