#!/usr/bin/env bash
# The whole train/configs/smollm2-peagle.yaml study, every stage resumable (run it again after a stop).
# First a milestone that takes a few hours: the greedy answers to the first 12 shards of prompts (about 1.7M
# answer tokens) and the P-EAGLE drafter shipped before it trained on further on them with online features
# (smollm2-peagle-greedy12k, the shipped smollm2-peagle drafter), measured against the drafter it started from;
# those shards are the first of the full regeneration, not extra work. Then the full study: regenerate the
# rest and build the feature cache, train the P-EAGLE drafter, then the EAGLE-3 baseline on the same data, then
# compare three drafter shapes for the same training seconds; a held-out MT-Bench learning curve for each, and
# P-EAGLE's curve against EAGLE-3's (with the shipped drafters measured on the same answers beside them) and
# the shapes' curves on one plot each. The drafters the goals are measured on come first, the shape study (a
# measurement, not an input to the runs before it) last.
# usage: train/smollm2-peagle.sh [RUNS_DIR [KEY=VALUE ...]]   (default runs/)
# KEY=VALUE overrides go to every train.py call after the stage's own (optim.compute_dtype=bfloat16 on a CPU
# whose bf16 products are the faster: docs/bench/train/README.md), and $CURVE_ARGS to every learning
# curve: a scaled-down trial of every stage, e.g.
#   CURVE_ARGS="--questions 4 --max-new-tokens 16" train/smollm2-peagle.sh /tmp/trial data.max_prompts=8 \
#     data.shard_size=4 data.max_new_tokens=16 data.regen_slots=4 optim.warmup_steps=1 optim.total_steps=4 run.export_steps=2
set -euo pipefail
runs=${1:-runs}
shift $(($# > 0 ? 1 : 0))
recipe=train/configs/smollm2-peagle.yaml
main=$runs/smollm2-peagle
read -r -a curve_args <<<"${CURVE_ARGS:-}"
# The milestone: 12,288 prompts (12 shards of 1024) answered greedily; the drafter shipped before it
# (train/configs/smollm2-self2.yaml's, bf16 storage, taken from git at 5246cc4) warm-started on them for
# about 1.3 epochs of their packed rows. Its result is the shipped smollm2-peagle drafter.
first=(data.max_prompts=12288 data.extra_temperatures=)
init=$runs/smollm2-self2-shipped
if [ ! -s "$init/model.safetensors" ]; then
  mkdir -p "$init"
  for f in config.json model.safetensors; do
    git show "5246cc4:peagle_jax/drafter/shipped/smollm2-peagle/$f" >"$init/$f.tmp" && mv "$init/$f.tmp" "$init/$f"
  done
fi
python train/train.py --config $recipe --output "$main" --until data "${first[@]}" "$@"
python train/train.py --config $recipe --output "$runs/smollm2-peagle-greedy12k" data.from_run="$main" \
  "${first[@]}" batch.features=online drafter.init="$init" optim.lr=3e-4 \
  optim.warmup_steps=30 optim.total_steps=4000 run.export_steps=900,1800,3000 "$@"
python -m peagle_jax.train.curve "$runs/smollm2-peagle-greedy12k" "${curve_args[@]}" \
  --reference "$init" --reference smollm2-eagle3
python train/train.py --config $recipe --output "$main" --until features "$@"
python train/train.py --config $recipe --output "$main" "$@"
python -m peagle_jax.train.curve "$main" "${curve_args[@]}"
python train/train.py --config $recipe --output "$runs/smollm2-eagle3-baseline" \
  optim.objective=eagle3 batch.num_depths=4 data.from_run="$main" "$@"
python -m peagle_jax.train.curve "$runs/smollm2-eagle3-baseline" "${curve_args[@]}"
python -m peagle_jax.train.curve "$main" "$runs/smollm2-eagle3-baseline" "${curve_args[@]}" \
  --reference smollm2-peagle --reference smollm2-eagle3 \
  --json "$runs/curves-peagle-eagle3.json" --plot "$runs/curves-peagle-eagle3.png"
# name, steps (in the ratio of the fp32 step times in docs/bench/train/sweep-shapes-fp32.json), overrides
while read -r name steps overrides; do
  python train/train.py --config $recipe --output "$runs/shapes/$name" data.from_run="$main" \
    optim.total_steps="$steps" run.export_steps=$((steps / 2)) $overrides "$@"
  python -m peagle_jax.train.curve "$runs/shapes/$name" "${curve_args[@]}"
done <<'SHAPES'
layers2-vocab8192 1800
layers1-vocab8192 2661 drafter.num_layers=1
layers2-vocab4096 2310 drafter.draft_vocab_size=4096
SHAPES
python -m peagle_jax.train.curve "$runs"/shapes/*/ "${curve_args[@]}" --json "$runs/shapes/curves.json" \
  --plot "$runs/shapes/curves.png"
