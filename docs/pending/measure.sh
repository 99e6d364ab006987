#!/usr/bin/env bash
# The runs that decide the pending patches (docs/pending/README.md), in stages
# that each fit one device call (< 600 s on the H100 host). Results under $OUT.
#   bash docs/pending/measure.sh a   # cold-code hypothesis + routing on cold times
#   bash docs/pending/measure.sh b   # pointwise grid in L2-sized groups (batch 64)
# Each stage applies its patch to the working tree and reverts it at the end.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECONV_CACHE_DIR=${SPARSECONV_CACHE_DIR:-/tmp/scc}
stage=${1:?stage a or b}

apply() {  # [-R] patch: git apply works outside a repository too; patch(1) where git is missing
    local reverse=""
    if [ "$1" = -R ]; then reverse=-R; shift; fi
    if command -v git > /dev/null; then git apply $reverse "$1"; else patch -p1 $reverse < "$1"; fi
}

with_patch() {  # patch, command...: run the command with the patch applied, then revert it
    local patch=docs/pending/$1; shift
    apply "$patch" || { echo "$patch does not apply"; return 1; }
    "$@"
    apply -R "$patch"
}

case $stage in
a)
    # Does a layer lose inside the network what it loses with L2 cold?
    python bench/network_profile.py resnet50 --batch 1 --per-layer --out "$OUT/profile_b1_per_layer.json" \
        > "$OUT/profile_b1_per_layer.log" 2>&1
    tail -70 "$OUT/profile_b1_per_layer.log"
    # Routing on cold times: the network, sparseconv against torch.compile TF32.
    with_patch cold-routing.patch python -m sparseconv bench --network resnet50 --batch 1 --batch 64 \
        --variants "sparseconv,compile TF32" --json "$OUT/network_cold_routing.json" > "$OUT/network_cold_routing.md"
    cat "$OUT/network_cold_routing.md"
    ;;
b)
    python models/make_pruned_zoo.py resnet50 --out /tmp/resnet50_pruned.npz > /dev/null
    sparseconv_model() {  # name: the by-layer bench of ResNet-50 at batch 64
        python -m sparseconv bench --model /tmp/resnet50_pruned.npz --batch 64 --baselines cudnn_fp32 \
            --json "$OUT/layers_$1.json" > "$OUT/layers_$1.md" 2>&1
    }
    sparseconv_model before
    with_patch l2-grouped-grid.patch sparseconv_model grouped
    tail -25 "$OUT/layers_before.md"
    tail -25 "$OUT/layers_grouped.md"
    ;;
*)
    echo "stage must be a or b"; exit 2 ;;
esac
