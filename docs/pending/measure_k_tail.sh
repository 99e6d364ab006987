#!/usr/bin/env bash
# The device call that decides docs/pending/k-tail.patch (docs/pending/README.md):
# a whole network at batch 1 and 64 on main, then with the patch, in one call
# (< 600 s on the H100 host). Results under $OUT.
#   bash docs/pending/measure_k_tail.sh resnet50
#   bash docs/pending/measure_k_tail.sh vgg16
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECONV_CACHE_DIR=${SPARSECONV_CACHE_DIR:-/tmp/scc}
net=${1:?network: resnet50 or vgg16}
case $net in resnet50|vgg16) ;; *) echo "network must be resnet50 or vgg16"; exit 2 ;; esac
patch=docs/pending/k-tail.patch

apply() {  # [-R]: git apply works outside a repository too; patch(1) where git is missing
    if command -v git > /dev/null; then git apply $* "$patch"; else patch -p1 $* < "$patch"; fi
}

bench() {  # label
    python -m sparseconv bench --network "$net" --batch 1 --batch 64 --variants "sparseconv,compile TF32" \
        --json "$OUT/network_${net}_$1.json" > "$OUT/network_${net}_$1.md" 2> "$OUT/network_${net}_$1.err"
    head -4 "$OUT/network_${net}_$1.md"
}
bench main
apply || { echo "$patch does not apply"; exit 1; }
bench k_tail
apply -R
