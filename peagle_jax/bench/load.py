"""``python -m peagle_jax.bench.load``: host memory while a GPT-OSS checkpoint with MXFP4 experts loads, per layer.

Writes (once, into ``--dir``) a checkpoint of gpt-oss-20b's shapes (``neuron/configs/gpt-oss-20b.json``: hidden
2880, 32 experts of width 2880, vocabulary 201088) cut to ``--layers`` layers, with random weights and the
experts stored as the hub stores them (MXFP4 ``*_blocks`` / ``*_scales`` pairs, one safetensors shard per
layer). Then loads it in a fresh process as ``generate`` and ``serve`` do (:func:`peagle_jax.models.weights.load_target`
in ``--dtype``), reading the process's resident memory (``VmRSS``) and its peak (``VmHWM``) after each parameter
is placed, and reports per layer: the bytes placed, the peak, and the peak above the baseline less everything
placed so far (what loading holds beyond the parameters). Prints a markdown table; ``--json FILE`` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from peagle_jax import errors

CONFIG = Path(__file__).resolve().parents[2] / "neuron" / "configs" / "gpt-oss-20b.json"
MIB = 2**20


def shaped_config(layers: int) -> dict:
    """gpt-oss-20b's config.json cut to ``layers`` layers (sliding and full alternating, as in the model)."""
    config = json.loads(CONFIG.read_text())
    config.pop("quantization_config", None)
    return {**config, "num_hidden_layers": layers, "layer_types": config["layer_types"][:layers]}


def write_checkpoint(out: Path, config: dict, seed: int = 0) -> None:
    """A random checkpoint of ``config``: bf16 tensors, experts as MXFP4 pairs, a shard per layer + an index."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file
    from tqdm import tqdm

    from peagle_jax.models.hf_config import from_hf_config
    from peagle_jax.models.weights import hf_shapes

    rng = np.random.default_rng(seed)
    shards: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in hf_shapes(from_hf_config(config)).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else "top"
        shards.setdefault(layer, {})[name] = shape
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, shapes in enumerate(tqdm(shards.values(), desc="writing", unit="shard", file=sys.stderr)):
        tensors = {}
        for name, shape in shapes.items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, C, R]: blocks [E, R, C/32, 16]
                E, C, R = shape
                tensors[name + "_blocks"] = rng.integers(0, 256, (E, R, C // 32, 16), dtype=np.uint8)
                tensors[name + "_scales"] = rng.integers(118, 125, (E, R, C // 32), dtype=np.uint8)
            else:
                tensors[name] = (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))  # last: a complete checkpoint has it


def _memory() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def measure(model_dir: str, dtype: str) -> dict:
    """Load ``model_dir`` as load_target does, recording memory after each placed parameter (run in a fresh
    process: the peak is the process's)."""
    import jax
    import numpy as np

    from peagle_jax.models.hf_config import load_hf_config
    from peagle_jax.models.tensors import open_safetensors
    from peagle_jax.models.weights import params_from_hf

    jax.devices()
    jax.device_put(np.zeros(8)).block_until_ready()
    baseline, _ = _memory()
    cfg = load_hf_config(model_dir, dtype=dtype)
    records = []

    def place(path: str, value):
        placed = jax.device_put(value)
        placed.block_until_ready()
        rss, hwm = _memory()
        records.append({"path": path, "bytes": int(value.nbytes), "rss": rss, "hwm": hwm})
        return placed

    params_from_hf(open_safetensors(model_dir), cfg, place=place)
    return {"baseline": baseline, "records": records}


def per_layer(result: dict) -> list[dict]:
    """Rows in load order, one per layer (``layer`` its index) and one per top-level tensor (``lm_head``,
    ``embed_tokens``, ``norm``): its bytes, the running total placed and the RSS once its last parameter is
    placed, and ``over``: the most that the process's peak rose above the baseline plus everything placed,
    while this row's parameters loaded (``None`` where the peak did not rise)."""
    rows: dict[str, dict] = {}
    placed, last_hwm = 0, 0
    for r in result["records"]:
        head = r["path"].split("/")[0]
        layer = head.removeprefix("layers.")
        placed += r["bytes"]
        row = rows.setdefault(layer, {"layer": layer, "bytes": 0, "largest": 0, "over": None})
        row["bytes"] += r["bytes"]
        row["largest"] = max(row["largest"], r["bytes"])
        row.update(placed=placed, rss=r["rss"], peak=r["hwm"])
        if r["hwm"] > last_hwm:
            over = r["hwm"] - result["baseline"] - placed
            row["over"] = over if row["over"] is None else max(row["over"], over)
        last_hwm = r["hwm"]
    return list(rows.values())


def build_parser() -> argparse.ArgumentParser:
    p = errors.ArgumentParser(prog="python -m peagle_jax.bench.load", description=__doc__.split("\n")[0])
    p.add_argument(
        "--layers", type=int, default=2, help="decoder layers of the gpt-oss-20b-shaped checkpoint (default 2)"
    )
    p.add_argument(
        "--dir",
        default=str(Path.home() / ".cache" / "peagle_jax" / "bench-load"),
        help="where the checkpoint is written (once per layer count, as gpt-oss-20b-L<layers>; default "
        "~/.cache/peagle_jax/bench-load)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="run dtype (default bfloat16)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the measuring process: a checkpoint directory
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.dtype)))
        return 0
    if args.layers < 1:
        print(f"error: --layers must be >= 1, got {args.layers}", file=sys.stderr)
        return 2
    ckpt = Path(args.dir) / f"gpt-oss-20b-L{args.layers}"
    if not (ckpt / "config.json").is_file():
        write_checkpoint(ckpt, shaped_config(args.layers))
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    run = subprocess.run(
        [sys.executable, "-m", "peagle_jax.bench.load", "--child", str(ckpt), "--dtype", args.dtype],
        capture_output=True,
        text=True,
        env=env,
    )
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
        return 1
    result = json.loads(run.stdout.strip().splitlines()[-1])
    rows = per_layer(result)
    files = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    placed = rows[-1]["placed"]
    peak_over = max(r["over"] for r in rows if r["over"] is not None)
    largest = max(r["largest"] for r in rows)
    print(
        f"gpt-oss-20b shapes, {args.layers} layers: files {files / MIB:.0f} MiB (MXFP4 experts), "
        f"parameters {placed / MIB:.0f} MiB in {args.dtype}; baseline RSS {result['baseline'] / MIB:.0f} MiB\n"
    )
    print(
        "| layer | placed (MiB) | largest tensor (MiB) | total placed (MiB) | RSS (MiB) | peak RSS (MiB) "
        "| peak rise above baseline + placed (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['layer']} | {r['bytes'] / MIB:.0f} | {r['largest'] / MIB:.0f} | {r['placed'] / MIB:.0f} "
            f"| {r['rss'] / MIB:.0f} | {r['peak'] / MIB:.0f} | {'-' if r['over'] is None else round(r['over'] / MIB)} |"
        )
    print(
        f"\npeak above the placed parameters: {peak_over / MIB:.0f} MiB "
        f"({peak_over / largest:.2f}x the largest tensor, {peak_over / placed:.2f}x all parameters)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": str(CONFIG.relative_to(CONFIG.parents[2])),
                    "layers": args.layers,
                    "dtype": args.dtype,
                    "file_bytes": files,
                    "baseline_rss": result["baseline"],
                    "per_layer": rows,
                    "records": result["records"],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
