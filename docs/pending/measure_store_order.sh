#!/usr/bin/env bash
# The device call that decides docs/pending/store-order.patch (docs/pending/README.md):
# the layers it should restore, cold and hot, at batch 1 and 64, on main and
# then with the patch, in one call (~4 min on the H100 host). Results under $OUT.
#   bash docs/pending/measure_store_order.sh
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECONV_CACHE_DIR=${SPARSECONV_CACHE_DIR:-/tmp/scc}
patch=docs/pending/store-order.patch
layers=resnet50:layer1.1.conv1,resnet50:layer1.0.conv1,resnet50:layer2.1.conv1,resnet50:layer2.0.conv1,resnet50:conv1,vgg16:conv1_1

apply() {  # [-R]: git apply works outside a repository too; patch(1) where git is missing
    if command -v git > /dev/null; then git apply $* "$patch"; else patch -p1 $* < "$patch"; fi
}

probe() {  # label
    for b in 1 64; do
        python bench/split_probe.py --cold --batch $b --layers "$layers" --cands default \
            --out "$OUT/store_order_$1_b$b.json" 2> "$OUT/store_order_$1_b$b.err" | sed "s/^/$1 b$b /"
    done
}
probe main
apply || { echo "$patch does not apply"; exit 1; }
probe patch
apply -R
