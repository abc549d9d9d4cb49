"""``from_hf_config`` / ``to_hf_config``: round trips, agreement with transformers' config classes, and
refusal (a :class:`ConfigError` naming the attribute) of everything that changes the math but is not
implemented."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import transformers

from peagle_jax.models.config import ConfigError
from peagle_jax.models.hf_config import from_hf_config, load_hf_config, to_hf_config

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=131072,
)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


def hf_dict(family: str, **overrides) -> dict:
    """A config.json as transformers writes it for ``family``."""
    return CONFIG_CLASSES[family](**{**SMALL, **overrides}).to_dict()


def raw_llama(**overrides) -> dict:
    """A hand-written llama config.json (for forms transformers would rewrite, or attributes it drops)."""
    return {"model_type": "llama", **SMALL, **overrides}


ROUND_TRIP = {
    "llama": lambda: hf_dict("llama", rms_norm_eps=1e-5, eos_token_id=[2, 7], tie_word_embeddings=True),
    "llama-bias": lambda: hf_dict("llama", attention_bias=True, mlp_bias=True, num_key_value_heads=4),
    "llama3-rope_parameters": lambda: hf_dict(
        "llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}
    ),
    "llama3-rope_scaling": lambda: raw_llama(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3}),
    "llama3-rope_scaling-type": lambda: raw_llama(rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3}),
    "qwen2": lambda: hf_dict("qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3": lambda: hf_dict("qwen3", head_dim=32, eos_token_id=5, bos_token_id=4),
    "aux-ids": lambda: hf_dict("qwen3", eagle_aux_hidden_state_layer_ids=[0, 3, 5]),
}


@pytest.mark.parametrize("case", ROUND_TRIP)
def test_round_trip(case):
    cfg = from_hf_config(ROUND_TRIP[case]())
    assert from_hf_config(to_hf_config(cfg)) == cfg
    assert from_hf_config(json.loads(json.dumps(to_hf_config(cfg)))) == cfg  # survives config.json


def test_what_is_read():
    cfg = from_hf_config(ROUND_TRIP["llama3-rope_scaling"]())
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (6, 4, 2, 16)
    assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (
        "llama3",
        5e5,
        8.0,
        8192,
    )
    assert cfg.aux_layer_ids == (2, 3, 3)  # EAGLE-3 default [2, L//2, L-3]
    qwen2, qwen3 = from_hf_config(hf_dict("qwen2")), from_hf_config(hf_dict("qwen3"))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    assert qwen3.qk_norm and not qwen3.qkv_bias
    assert from_hf_config(hf_dict("llama", eos_token_id=[2, 7])).eos_token_ids == (2, 7)


def test_old_and_new_rope_forms_agree():
    new = from_hf_config(ROUND_TRIP["llama3-rope_parameters"]())
    old = from_hf_config(ROUND_TRIP["llama3-rope_scaling"]())
    assert old == new.replace(bos_token_id=None, eos_token_ids=())  # the raw dict has no bos/eos
    assert transformers.LlamaConfig(
        **raw_llama(rope_theta=5e5, rope_scaling={"rope_type": "llama3", **LLAMA3})
    ).to_dict()["rope_parameters"] == {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}


@pytest.mark.parametrize("case", ROUND_TRIP)
def test_to_hf_config_loads_in_transformers(case):
    cfg = from_hf_config(ROUND_TRIP[case]())
    hf = to_hf_config(cfg)
    loaded = CONFIG_CLASSES[cfg.family](**hf).to_dict()
    for key, value in hf.items():
        assert loaded[key] == value, key
    assert from_hf_config(loaded) == cfg


def test_load_hf_config_reads_a_directory(tmp_path):
    cfg = from_hf_config(hf_dict("qwen3"))
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    assert load_hf_config(tmp_path) == cfg
    assert load_hf_config(tmp_path, aux_layer_ids=(1, 4)).aux_layer_ids == (1, 4)
    assert load_hf_config(tmp_path, dtype="bfloat16").dtype == "bfloat16"


REFUSED = {
    "yarn-mscale": (  # YaRN itself is implemented (tests/test_moe_targets.py); DeepSeek's mscale is not
        lambda: raw_llama(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 0.7,
            }
        ),
        "rope parameters ['mscale'] are not implemented for rope_type 'yarn'",
    ),
    "longrope": (lambda: raw_llama(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope'"),
    "dynamic": (lambda: raw_llama(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type 'dynamic'"),
    "linear": (lambda: raw_llama(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear'"),
    "default-rope-with-factor": (lambda: raw_llama(rope_scaling={"rope_type": "default", "factor": 2.0}), "factor"),
    "llama3-incomplete": (
        lambda: raw_llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        "high_freq_factor",
    ),
    "qwen2-sliding": (lambda: hf_dict("qwen2", use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
    "qwen3-sliding": (lambda: hf_dict("qwen3", use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
    "llama-sliding": (lambda: raw_llama(sliding_window=4096), "sliding_window=4096"),
    "layer-types": (lambda: raw_llama(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    "num_experts": (lambda: raw_llama(num_experts=8), "num_experts"),
    "num_local_experts": (lambda: raw_llama(num_local_experts=8), "num_local_experts"),
    "gelu": (lambda: raw_llama(hidden_act="gelu"), "hidden_act='gelu'"),
    "partial-rotary": (lambda: raw_llama(partial_rotary_factor=0.5), "partial_rotary_factor"),
    "qwen2-no-bias": (lambda: {**hf_dict("qwen2"), "attention_bias": False}, "attention_bias"),
    "softcapping": (lambda: raw_llama(final_logit_softcapping=30.0), "final_logit_softcapping"),
    "mistral": (lambda: {**raw_llama(), "model_type": "mistral"}, "model_type 'mistral'"),
    "no-model-type": (lambda: {k: v for k, v in raw_llama().items() if k != "model_type"}, "model_type None"),
    "missing-width": (lambda: {k: v for k, v in raw_llama().items() if k != "hidden_size"}, "hidden_size"),
    "aux-id-too-large": (
        lambda: raw_llama(eagle_aux_hidden_state_layer_ids=[2, 6]),
        "eagle_aux_hidden_state_layer_ids: 6",
    ),
    "aux-id-negative": (
        lambda: raw_llama(eagle_aux_hidden_state_layer_ids=[-1]),
        "eagle_aux_hidden_state_layer_ids: -1",
    ),
    "gqa-mismatch": (lambda: raw_llama(num_key_value_heads=3), "num_key_value_heads=3"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_with_the_attribute_named(case):
    make, message = REFUSED[case]
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_hf_config(make())


def test_aux_layer_ids_argument_out_of_range():
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids: 6 is outside 0..5"):
        from_hf_config(raw_llama(), aux_layer_ids=(0, 6))


def test_unsupported_dtype():
    with pytest.raises(ConfigError, match="float16"):
        from_hf_config(raw_llama(), dtype="float16")


def test_unknown_attribute_is_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="peagle_jax.models.hf_config"):
        from_hf_config(raw_llama(my_new_knob=3))
    assert "my_new_knob" in caplog.text


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_hf_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_hf_config(tmp_path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_hf_config(tmp_path)


RELEASED = Path(__file__).resolve().parent.parent / "neuron" / "configs"


@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "Qwen3-Coder-30B-A3B-Instruct"])
def test_released_moe_configs_load_without_warnings(name, caplog):
    """Every attribute of the hub configs of the released drafters' targets is read, or checked to agree
    with the math transformers runs; a disagreeing value is refused by name."""
    hf = json.loads((RELEASED / f"{name}.json").read_text())
    with caplog.at_level(logging.WARNING, logger="peagle_jax.models.hf_config"):
        from_hf_config(hf)
    assert "not read" not in caplog.text
    changed = (
        {"experts_per_token": 2, "initial_context_length": 8192}
        if hf["model_type"] == "gpt_oss"
        else {"qkv_bias": True, "use_qk_norm": False, "shared_expert_intermediate_size": 512}
    )
    for key, value in changed.items():
        with pytest.raises(ConfigError, match=f"config attribute {key}={value!r} is not supported"):
            from_hf_config({**hf, key: value})
