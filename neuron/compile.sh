#!/bin/sh
# Compile every graph exported by `python -m peagle_jax.neuron export --out OUT` into NEFFs with neuronx-cc,
# running the exact commands the export wrote to OUT/neuron/compile.sh, for one target, JOBS at a time.
#
#   neuron/compile.sh OUT [trn1|inf2|trn2] [JOBS]
#
# Needs neuronx-cc on PATH (the Neuron pip repository, see neuron/README.md); the NEFFs land next to the
# .hlo.pb files in OUT/neuron/.
set -eu
if [ $# -lt 1 ]; then
    echo "usage: $0 OUT [trn1|inf2|trn2] [JOBS]" >&2
    exit 2
fi
out=$1
target=${2:-trn1}
jobs=${3:-$(nproc 2>/dev/null || echo 1)}
case $target in
    trn1|inf2|trn2) ;;
    *) echo "error: target must be trn1, inf2 or trn2, got $target" >&2; exit 2 ;;
esac
commands=$out/neuron/compile.sh
if [ ! -f "$commands" ]; then
    echo "error: $commands not found; run python -m peagle_jax.neuron export --out $out first" >&2
    exit 2
fi
if ! command -v neuronx-cc >/dev/null 2>&1; then
    echo "error: neuronx-cc is not on PATH; pip install --extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-cc" >&2
    exit 2
fi
cd "$out/neuron"
n=$(grep -c -- "--target $target " compile.sh || true)
echo "compiling $n graphs for $target, $jobs at a time"
grep -- "--target $target " compile.sh | xargs -P "$jobs" -I CMD sh -c 'CMD > "$(echo "CMD" | sed "s/.*--output //").log" 2>&1 || { echo "failed: CMD"; exit 255; }'
echo "done: $(ls ./*."$target".neff | wc -l) NEFFs in $out/neuron"
