"""``python -m peagle_jax.bench.full_size`` end to end on a tiny random GPT-OSS checkpoint in the hub's layout
(MXFP4 experts, held packed): every part of its report is there and consistent."""

from __future__ import annotations

import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "neuron" / "configs"


def test_the_full_size_bench_reports_every_part(tmp_path):
    from peagle_jax.bench.full_size import main
    from peagle_jax.models import random_checkpoint

    hf = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    tiny = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16)
    tiny.update(num_key_value_heads=2, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    tiny.update(num_local_experts=8, num_experts_per_tok=2, experts_per_token=2, layer_types=hf["layer_types"][:4])
    hf.update(tiny)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(hf))
    assert random_checkpoint.main(["--config", str(config), "--out", str(tmp_path / "model")]) == 0
    out = tmp_path / "out.json"
    argv = ["--model", str(tmp_path / "model"), "--k", "2", "--steps", "2", "--new-tokens", "4", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["experts"] == "packed" and r["load_s"] > 0 and r["startup_s"] >= r["load_s"]
    assert r["warm"]["decode_tokens_per_s"] > 0 and r["cold"]["first_token_s"] > r["warm"]["first_token_s"]
    step = r["decode_step"]
    assert step["bytes_accessed"] > step["active_bound_bytes"] > 0  # the bound is what a step reads at least
    # the weights it reads: the bound (the selected experts only), plus small arrays that more than one fusion reads
    assert step["active_bound_bytes"] <= step["weight_bytes_read"] < 1.05 * step["active_bound_bytes"]
    assert step["cache_bytes_read"] > 0
    assert set(r["spec"]["k"]) == {"2"} and r["spec"]["k"]["2"]["step_over_plain"] > 0
    assert r["peak_rss_gib"] >= r["rss_after_load_gib"] > 0
    assert main([*argv[:2], "--k", "0"]) == 2  # a bad flag is one error line
    only = tmp_path / "bytes.json"
    assert main([*argv[:2], "--bytes-only", "--json", str(only)]) == 0  # from the config alone: the same step
    bytes_only = json.loads(only.read_text())["decode_step"]
    assert bytes_only.pop("experts") == "packed" and bytes_only == {k: v for k, v in step.items() if k != "read_gib_s"}
