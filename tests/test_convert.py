"""Checkpoint conversion (``python -m peagle_jax.convert``): drafters saved by the ``speculators`` package and
tiny Hugging Face targets go PyTorch -> JAX -> PyTorch bit for bit, the output loads back into speculators
with no missing or unexpected keys, layouts and shards convert both ways, and user mistakes end in one-line
errors."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from conftest import tiny_hf_model
from safetensors.torch import load_file, save_file

from peagle_jax.checkpoint import META_FILE, load_target_any, read_meta, restore_params
from peagle_jax.convert import main, to_jax, to_torch
from peagle_jax.drafter.config import DrafterConfig, drafter_config_from_dict
from peagle_jax.drafter.load import load_drafter
from peagle_jax.drafter.weights import drafter_params_from_tensors, drafter_params_to_tensors, with_embedding_of
from peagle_jax.errors import UserError
from peagle_jax.models.weights import WeightsError, flatten, load_target, read_safetensors

V, U = 128, 96  # target vocab, draft vocab


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str = "peagle"
    family: str = "llama"
    draft_vocab: bool = True
    embed: bool = True
    dtype: torch.dtype = torch.float32
    flags: tuple[str, ...] = ()

    def __str__(self):
        parts = [self.algorithm, self.family, str(self.dtype).removeprefix("torch.")]
        parts += ["vocab" if self.draft_vocab else "fullvocab", "embed" if self.embed else "noembed", *self.flags]
        return "-".join(parts)


CASES = [
    Case(),
    Case(dtype=torch.bfloat16, flags=("norm_before_fc",)),
    Case(family="qwen3", draft_vocab=False, flags=("fc_norm",)),
    Case(draft_vocab=False, embed=False, dtype=torch.bfloat16, flags=("norm_output", "norm_before_residual")),
    Case(algorithm="eagle3", embed=False, flags=("norm_before_residual",)),
    Case(algorithm="eagle3", family="qwen3", embed=False, dtype=torch.bfloat16, flags=("norm_before_fc",)),
    Case(algorithm="eagle3", draft_vocab=False, dtype=torch.bfloat16, flags=("fc_norm", "norm_output")),
]
LLAMA_CASES = [c for c in CASES if c.family == "llama"]


def speculators_model(case: Case, seed: int = 0):
    """A random tiny speculators drafter (P-EAGLE or EAGLE-3) with non-trivial norms and vocab map."""
    import transformers
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[case.family]
    layer = layer_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        head_dim=16,
    )
    layer._attn_implementation = "eager"
    spec = SpeculatorsConfig(
        algorithm=case.algorithm,
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=5)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    )
    kwargs = dict(
        transformer_layer_config=layer,
        draft_vocab_size=U if case.draft_vocab else V,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=spec,
        **{flag: True for flag in case.flags},
    )
    if case.algorithm == "peagle":
        config_cls, model_cls = PEagleSpeculatorConfig, PEagleDraftModel
        kwargs["mask_token_id"] = V - 1
    else:
        config_cls, model_cls = Eagle3SpeculatorConfig, Eagle3DraftModel
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
        if case.draft_vocab:
            ids = torch.sort(torch.randperm(V)[:U]).values
            model.t2d.zero_()
            model.t2d[ids] = True
            model.d2t.copy_(ids - torch.arange(U))
    return model.to(case.dtype)


def save_speculators(case: Case, path: Path, seed: int = 0, **save_kwargs) -> Path:
    speculators_model(case, seed).save_pretrained(path, **save_kwargs)
    if not case.embed:  # as EAGLE-3 checkpoints that share the target's table
        state = load_file(path / "model.safetensors")
        del state["embed_tokens.weight"]
        save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    return path


def eagle_copy(spec_dir: Path, path: Path) -> Path:
    """The EAGLE / AWS layout of a speculators Llama drafter, written by hand: a flat Llama config with
    ``ptd_token_id`` and layer 0 as ``midlayer.*``."""
    d = json.loads((spec_dir / "config.json").read_text())
    flat = {**d["transformer_layer_config"], "architectures": ["LlamaForCausalLMEagle3"]}
    keys = ("draft_vocab_size", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    flat.update({k: d[k] for k in keys}, eagle_aux_hidden_state_layer_ids=d["eagle_aux_hidden_state_layer_ids"])
    flat["speculative_tokens"] = d["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    if d.get("mask_token_id") is not None:
        flat["ptd_token_id"] = d["mask_token_id"]
    path.mkdir()
    (path / "config.json").write_text(json.dumps(flat, indent=2))
    state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in load_file(spec_dir / "model.safetensors").items()}
    save_file(state, str(path / "model.safetensors"), {"format": "pt"})
    return path


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Names, dtypes, shapes and bytes all equal."""
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


def parsed(path: Path) -> DrafterConfig:
    cfg, _ = drafter_config_from_dict(json.loads((path / "config.json").read_text()))
    return with_embedding_of(cfg, read_safetensors(path))


def without_verifier(cfg: DrafterConfig) -> DrafterConfig:
    return cfg.replace(verifier_name_or_path=None, verifier_architectures=())


def load_in_speculators(path: Path, embed: bool) -> None:
    """speculators builds the model from our config.json and takes our tensors with no unexpected key and no
    missing key beyond its training-only verifier copies (and the shared embedding when there is none)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    algorithm = json.loads((path / "config.json").read_text())["speculators_model_type"]
    config_cls, model_cls = {
        "peagle": (PEagleSpeculatorConfig, PEagleDraftModel),
        "eagle3": (Eagle3SpeculatorConfig, Eagle3DraftModel),
    }[algorithm]
    config = config_cls.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    model = model_cls(config)
    state = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    result = model.load_state_dict(state, strict=False)
    assert result.unexpected_keys == []
    allowed = {"verifier_lm_head.weight", "verifier_norm.weight"} | (set() if embed else {"embed_tokens.weight"})
    assert set(result.missing_keys) == allowed
    loaded = model.state_dict()
    for name, value in state.items():
        assert torch.equal(loaded[name].to(value.dtype), value), name


@pytest.mark.parametrize("case", CASES, ids=str)
def test_speculators_drafter_round_trip_is_bit_for_bit(tmp_path, case):
    src = save_speculators(case, tmp_path / "src")
    meta = to_jax(src, tmp_path / "jax")
    assert (meta.kind, meta.layout, meta.own_embedding) == ("drafter", "speculators", case.embed)
    leaves = flatten(restore_params(tmp_path / "jax"))
    assert leaves["fc/weight"].dtype == np.dtype(str(case.dtype).removeprefix("torch."))  # bf16 stays bf16
    if case.draft_vocab:
        assert leaves["d2t"].dtype == np.int32 and read_meta(tmp_path / "jax").tensors["d2t"] == "int64"

    to_torch(tmp_path / "jax", tmp_path / "back")
    assert_same_tensors(read_safetensors(tmp_path / "back"), read_safetensors(src))
    config, back_config = (json.loads((p / "config.json").read_text()) for p in (src, tmp_path / "back"))
    assert back_config == config
    assert parsed(tmp_path / "back") == parsed(src)
    assert parsed(src).own_embedding == case.embed and parsed(src).has_vocab_map == case.draft_vocab
    load_in_speculators(tmp_path / "back", case.embed)


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4]], ids=str)
def test_load_drafter_from_pytorch_and_jax_directories(tmp_path, case):
    src = save_speculators(case, tmp_path / "src")
    to_jax(src, tmp_path / "jax")
    cfg, params = load_drafter(src)
    cfg_jax, params_jax = load_drafter(tmp_path / "jax")
    assert cfg_jax == cfg and cfg.own_embedding == case.embed
    flat, flat_jax = flatten(params), flatten(params_jax)
    assert flat.keys() == flat_jax.keys()
    for path, value in flat.items():
        np.testing.assert_array_equal(np.asarray(flat_jax[path]), np.asarray(value), err_msg=path)
        if path not in ("d2t", "t2d"):
            assert value.dtype == np.float32, path
    if case.draft_vocab:
        assert flat["d2t"].dtype == np.int32 and flat["t2d"].dtype == np.bool_
    cfg16, params16 = load_drafter(tmp_path / "jax", dtype="bfloat16")
    assert cfg16.layer.dtype == "bfloat16"
    assert {str(x.dtype) for x in jax.tree.leaves(params16)} <= {"bfloat16", "int32", "bool"}


@pytest.mark.parametrize("case", LLAMA_CASES, ids=str)
def test_speculators_to_eagle_layout_and_back(tmp_path, case):
    src = save_speculators(case, tmp_path / "src")
    to_torch(src, tmp_path / "eagle", layout="eagle")  # a PyTorch source converts directly
    by_hand = eagle_copy(src, tmp_path / "by_hand")
    assert_same_tensors(read_safetensors(tmp_path / "eagle"), read_safetensors(by_hand))
    assert parsed(tmp_path / "eagle") == parsed(by_hand) == without_verifier(parsed(src))
    assert json.loads((tmp_path / "eagle/config.json").read_text())["dtype"] == str(case.dtype).removeprefix("torch.")

    to_jax(by_hand, tmp_path / "jax")
    to_torch(tmp_path / "jax", tmp_path / "back", layout="speculators")
    assert_same_tensors(read_safetensors(tmp_path / "back"), read_safetensors(src))
    assert parsed(tmp_path / "back") == without_verifier(parsed(src))
    load_in_speculators(tmp_path / "back", case.embed)
    to_torch(tmp_path / "jax", tmp_path / "eagle_again")  # default: the source's (EAGLE) layout, verbatim config
    eagle_again, hand_config = (
        json.loads((p / "config.json").read_text()) for p in (tmp_path / "eagle_again", by_hand)
    )
    assert eagle_again == hand_config


def test_cast_to_bfloat16_and_name_the_verifier(tmp_path):
    """How the shipped drafters are stored: a float32 drafter written in bf16 (rounded as torch rounds),
    ids untouched, config declaring bf16 and the verifier; speculators loads it."""
    case = CASES[0]
    src = save_speculators(case, tmp_path / "src")
    to_torch(src, tmp_path / "bf16", dtype="bfloat16", verifier="HuggingFaceTB/SmolLM2-135M-Instruct")
    back, orig = load_file(tmp_path / "bf16/model.safetensors"), load_file(src / "model.safetensors")
    assert back.keys() == orig.keys()
    for name, value in orig.items():
        want = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    config = json.loads((tmp_path / "bf16/config.json").read_text())
    assert config["dtype"] == config["transformer_layer_config"]["dtype"] == "bfloat16"
    assert config["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert parsed(tmp_path / "bf16").verifier_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    load_in_speculators(tmp_path / "bf16", case.embed)
    with pytest.raises(UserError, match="speculators layout"):
        to_torch(src, tmp_path / "eagle", layout="eagle", verifier="x")
    with pytest.raises(UserError, match="--dtype"):
        to_torch(src, tmp_path / "x", dtype="int8")


def test_sharded_output_and_input(tmp_path):
    case = CASES[1]
    src = save_speculators(case, tmp_path / "src")
    to_jax(src, tmp_path / "jax")
    files = to_torch(tmp_path / "jax", tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded/model.safetensors.index.json").read_text())
    assert len(files) > 1 and {f.name for f in files} == set(index["weight_map"].values())
    umask = os.umask(0)
    os.umask(umask)
    # Readable as any file the user writes (safetensors alone creates them 0600: a server container running
    # as another user could not read a converted model).
    assert {f.stat().st_mode & 0o777 for f in files} == {0o666 & ~umask}
    assert sorted(index["weight_map"]) == sorted(read_safetensors(src))
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_safetensors(src).values())
    assert_same_tensors(read_safetensors(tmp_path / "sharded"), read_safetensors(src))
    load_in_speculators(tmp_path / "sharded", case.embed)

    sharded_src = tmp_path / "spec_sharded"
    speculators_model(case).save_pretrained(sharded_src, max_shard_size="20KB")
    assert (sharded_src / "model.safetensors.index.json").is_file()
    to_jax(sharded_src, tmp_path / "jax2")
    to_torch(tmp_path / "jax2", tmp_path / "single")
    assert not (tmp_path / "single/model.safetensors.index.json").exists()
    assert_same_tensors(read_safetensors(tmp_path / "single"), read_safetensors(src))


@pytest.mark.parametrize(
    "family,dtype,tied",
    [("llama", torch.float32, False), ("qwen3", torch.bfloat16, False), ("llama", torch.float32, True)],
    ids=["llama-fp32", "qwen3-bf16", "llama-tied"],
)
def test_target_round_trip_is_bit_for_bit(tmp_path, save_hf, family, dtype, tied):
    hf_dir = save_hf(tiny_hf_model(family, seed=5, tied=tied).to(dtype), "hf")
    meta = to_jax(hf_dir, tmp_path / "jax")
    assert (meta.kind, meta.layout) == ("target", "hf")
    assert (tmp_path / "jax/generation_config.json").is_file()  # side files travel along
    to_torch(tmp_path / "jax", tmp_path / "back")
    assert_same_tensors(read_safetensors(tmp_path / "back"), read_safetensors(hf_dir))
    assert json.loads((tmp_path / "back/config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())

    cfg, params = load_target(hf_dir)
    cfg_jax, params_jax = load_target_any(tmp_path / "jax")
    assert cfg_jax == cfg
    for (path, a), (_, b) in zip(sorted(flatten(params).items()), sorted(flatten(params_jax).items()), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=path)
    assert load_target_any(hf_dir)[0] == cfg


def test_tied_target_that_stores_a_head_copy(tmp_path, save_hf):
    """Some tied checkpoints also store lm_head.weight (a copy of the embedding); it is written back too."""
    hf = tiny_hf_model("llama", seed=6, tied=True)
    hf_dir = save_hf(hf, "hf")
    state = load_file(hf_dir / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(hf_dir / "model.safetensors"), {"format": "pt"})
    to_jax(hf_dir, tmp_path / "jax")
    to_torch(tmp_path / "jax", tmp_path / "back")
    assert_same_tensors(read_safetensors(tmp_path / "back"), read_safetensors(hf_dir))


def test_jax_directories_of_the_wrong_kind_or_broken(tmp_path, save_hf):
    to_jax(save_speculators(CASES[4], tmp_path / "drafter"), tmp_path / "jax_drafter")
    to_jax(save_hf(tiny_hf_model("llama", seed=7), "hf"), tmp_path / "jax_target")
    with pytest.raises(UserError, match="holds a drafter, not a target"):
        load_target_any(tmp_path / "jax_drafter")
    with pytest.raises(UserError, match="holds a target model, not a drafter"):
        load_drafter(tmp_path / "jax_target")
    with pytest.raises(UserError, match="--layout eagle applies to drafters"):
        to_torch(tmp_path / "jax_target", tmp_path / "out", layout="eagle")
    (tmp_path / "jax_target" / META_FILE).write_text("{not json")
    with pytest.raises(UserError, match=f"{META_FILE}: not valid JSON"):
        load_target_any(tmp_path / "jax_target")
    shutil.rmtree(tmp_path / "jax_drafter" / "params")
    with pytest.raises(UserError, match="no params/ directory"):
        load_drafter(tmp_path / "jax_drafter")


def test_refuses_to_overwrite_unless_forced(tmp_path):
    src = save_speculators(CASES[0], tmp_path / "src")
    to_jax(src, tmp_path / "jax")
    with pytest.raises(UserError, match="not empty.*--force"):
        to_jax(src, tmp_path / "jax")
    (tmp_path / "back").mkdir()
    (tmp_path / "back/README.md").write_text("keep me")
    (tmp_path / "back/model-00001-of-00009.safetensors").write_text("stale shard")
    with pytest.raises(UserError, match="not empty"):
        to_torch(tmp_path / "jax", tmp_path / "back")
    to_torch(tmp_path / "jax", tmp_path / "back", force=True)
    assert (tmp_path / "back/README.md").read_text() == "keep me"
    assert not (tmp_path / "back/model-00001-of-00009.safetensors").exists()
    assert_same_tensors(read_safetensors(tmp_path / "back"), read_safetensors(src))
    to_jax(src, tmp_path / "jax", force=True)


def test_function_errors_name_the_problem(tmp_path):
    case = CASES[0]
    src = save_speculators(case, tmp_path / "src")
    tensors = read_safetensors(src)
    cfg = parsed(src)
    params = drafter_params_from_tensors(tensors, cfg, "speculators")
    drop = {k: v for k, v in tensors.items() if k != "layers.1.mlp.down_proj.weight"}
    with pytest.raises(WeightsError, match=r"missing tensor.*layers\.1\.mlp\.down_proj\.weight"):
        drafter_params_from_tensors(drop, cfg, "speculators")
    with pytest.raises(WeightsError, match=r"unexpected tensor 'layers\.0\.self_attn\.foo\.weight'"):
        drafter_params_from_tensors(
            {**tensors, "layers.0.self_attn.foo.weight": tensors["norm.weight"]}, cfg, "speculators"
        )
    with pytest.raises(WeightsError, match=r"'fc\.weight' has shape \(64, 128\).*\(64, 192\)"):
        drafter_params_from_tensors({**tensors, "fc.weight": tensors["fc.weight"][:, :128]}, cfg, "speculators")
    with pytest.raises(WeightsError, match="mask_hidden"):
        drafter_params_from_tensors({k: v for k, v in tensors.items() if k != "mask_hidden"}, cfg, "speculators")
    with pytest.raises(WeightsError, match="d2t.*int32"):
        drafter_params_from_tensors({**tensors, "d2t": tensors["d2t"] + 2**40}, cfg, "speculators")
    with pytest.raises(
        WeightsError, match=r"'layers\.0\.hidden_norm\.weight'.*names it 'midlayer\.hidden_norm\.weight'"
    ):
        drafter_params_from_tensors(tensors, cfg, "eagle")
    with pytest.raises(WeightsError, match="embed_tokens"):
        drafter_params_from_tensors(tensors, cfg.replace(own_embedding=False), "speculators")
    ignored = {**tensors, "verifier_lm_head.weight": tensors["lm_head.weight"], "rotary_emb.inv_freq": np.ones(8)}
    assert flatten(drafter_params_from_tensors(ignored, cfg, "speculators")).keys() == flatten(params).keys()
    back = drafter_params_to_tensors(params, cfg, "speculators", {"d2t": "int32"})
    assert back["d2t"].dtype == np.int32 and back["fc.weight"].dtype == np.float32


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    """Source directories with one mistake each, built once for the module."""
    root = tmp_path_factory.mktemp("broken")
    good = save_speculators(CASES[0], root / "good")
    qwen = save_speculators(CASES[2], root / "qwen")
    tensors = load_file(good / "model.safetensors")

    def variant(name, state=None, config=None) -> Path:
        path = root / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config or json.loads((good / "config.json").read_text())))
        if state is not None:
            save_file(state, str(path / "model.safetensors"), {"format": "pt"})
        return path

    config = json.loads((good / "config.json").read_text())
    bin_only = variant("bin_only")
    torch.save(tensors, bin_only / "pytorch_model.bin")
    nonempty = root / "nonempty"
    nonempty.mkdir()
    (nonempty / "notes.txt").write_text("x")
    return {
        "good": good,
        "qwen": qwen,
        "nonempty": nonempty,
        "bin_only": bin_only,
        "missing": variant("missing", {k: v for k, v in tensors.items() if k != "layers.1.mlp.down_proj.weight"}),
        "unexpected": variant("unexpected", {**tensors, "layers.1.mlp.foo.weight": tensors["norm.weight"].clone()}),
        "shape": variant("shape", {**tensors, "fc.weight": tensors["fc.weight"][:, :128].contiguous()}),
        "no_mask_hidden": variant("no_mask_hidden", {k: v for k, v in tensors.items() if k != "mask_hidden"}),
        "mistral": variant("mistral", tensors, {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}),
        "mtp": variant("mtp", tensors, {**config, "speculators_model_type": "mtp"}),
        "mask_id": variant("mask_id", tensors, {**config, "mask_token_id": 100000}),
    }


ERRORS = [
    # (argv with {name} placeholders, expected fragment of the error line)
    ("to-jax {missing} {out}", "missing tensor(s) ['layers.1.mlp.down_proj.weight']"),
    ("to-jax {unexpected} {out}", "unexpected tensor 'layers.1.mlp.foo.weight'"),
    ("to-jax {shape} {out}", "'fc.weight' has shape (64, 128)"),
    ("to-jax {no_mask_hidden} {out}", "no 'mask_hidden'"),
    ("to-jax {mistral} {out}", "unknown architecture (model_type='mistral'"),
    ("to-jax {mtp} {out}", "speculators_model_type 'mtp' is not supported"),
    ("to-jax {mask_id} {out}", "mask token id 100000 is outside the vocabulary"),
    ("to-jax {bin_only} {out}", "pickled PyTorch weights"),
    ("to-jax {good} {nonempty}", "is not empty; pass --force"),
    ("to-jax {good}/nowhere {out}", "no such directory"),
    ("to-torch {qwen} {out} --layout eagle", "Llama drafter layers only"),
    ("to-torch {good} {out} --max-shard-size lots", "not a size: 'lots'"),
    ("to-torch {good} {good}", "same directory"),
]


def _argv(template: str, broken: dict[str, Path], out: Path) -> list[str]:
    return template.format(out=out, **{k: str(v) for k, v in broken.items()}).split()


@pytest.mark.parametrize("template,fragment", ERRORS, ids=[t.split()[1].strip("{}") for t, _ in ERRORS])
def test_cli_errors_are_one_line(tmp_path, capsys, broken, template, fragment):
    assert main(_argv(template, broken, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing half-written


def test_cli_as_a_user_runs_it(tmp_path, broken):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run(template: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "peagle_jax.convert", *_argv(template, broken, tmp_path / "out")]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    for template, fragment in [ERRORS[0], ERRORS[3], ERRORS[4], ERRORS[9]]:
        proc = run(template)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1 and fragment in proc.stderr
    proc = run("to-jax {good} {out}")
    assert proc.returncode == 0 and (tmp_path / "out" / META_FILE).is_file(), proc.stderr
    shutil.move(tmp_path / "out", tmp_path / "jax")
    proc = run(f"to-torch {tmp_path / 'jax'} {{out}} --layout eagle --max-shard-size 30KB")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out/model.safetensors.index.json").is_file()
    assert_same_tensors(
        read_safetensors(tmp_path / "out"), read_safetensors(eagle_copy(broken["good"], tmp_path / "e"))
    )
