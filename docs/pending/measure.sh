#!/usr/bin/env bash
# The runs that decide docs/pending/cold-split.patch (docs/pending/README.md),
# one device call each (< 600 s on the H100 host). Results under $OUT.
#   bash docs/pending/measure.sh layers    # each distinct ResNet-50 1x1 layer at batch 1, cold: main vs patch
#   bash docs/pending/measure.sh network   # ResNet-50 with the patch, batch 1 and 64
#   bash docs/pending/measure.sh deep3x3   # no patch: does the same fit hold for 3x3 on the pointwise family?
# Each stage applies the patch to the working tree and reverts it at the end.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECONV_CACHE_DIR=${SPARSECONV_CACHE_DIR:-/tmp/scc}
stage=${1:?stage: layers, network or deep3x3}
patch=docs/pending/cold-split.patch

apply() {  # [-R]: git apply works outside a repository too; patch(1) where git is missing
    if command -v git > /dev/null; then git apply $* "$patch"; else patch -p1 $* < "$patch"; fi
}

# One layer of each distinct 1x1 shape of ResNet-50 (stride and residual do not change the split rule's choice)
LAYERS=resnet50:layer1.1.conv1,resnet50:layer2.0.conv1,resnet50:layer2.0.conv3,resnet50:layer2.0.downsample
LAYERS=$LAYERS,resnet50:layer2.1.conv1,resnet50:layer3.0.conv1,resnet50:layer3.0.downsample,resnet50:layer3.1.conv1
LAYERS=$LAYERS,resnet50:layer3.1.conv3,resnet50:layer4.0.conv1,resnet50:layer4.0.downsample,resnet50:layer4.1.conv1
LAYERS=$LAYERS,resnet50:layer4.1.conv3

case $stage in
layers)
    python bench/split_probe.py --layers "$LAYERS" --cands default --cold --out "$OUT/split_main.json" \
        > "$OUT/split_main.log" 2>&1
    apply || { echo "$patch does not apply"; exit 1; }
    python bench/split_probe.py --layers "$LAYERS" --cands default --cold --out "$OUT/split_patch.json" \
        > "$OUT/split_patch.log" 2>&1
    apply -R
    grep -h " call " "$OUT/split_main.log" "$OUT/split_patch.log" | cut -c1-30,100-
    ;;
network)
    apply || { echo "$patch does not apply"; exit 1; }
    python -m sparseconv bench --network resnet50 --batch 1 --batch 64 --variants "sparseconv,compile TF32" \
        --json "$OUT/network_cold_split.json" > "$OUT/network_cold_split.md"
    apply -R
    cat "$OUT/network_cold_split.md"
    ;;
deep3x3)
    # The patch leaves 3x3 layers alone; these candidates are its rule applied by hand
    # (32 output channels a block, one pixel block, slices up to a wave), cold, at batch 1.
    python bench/split_probe.py --layers resnet50:layer3.1.conv2 --cands default,32x224x4,32x224x8:O1,32x224x16:O1 \
        --cold --out "$OUT/split_3x3_layer3.json" 2>/dev/null | cut -c1-30,100-
    python bench/split_probe.py --layers resnet50:layer4.1.conv2 --cands default,32x64x4,32x64x8:O1 \
        --cold --out "$OUT/split_3x3_layer4.json" 2>/dev/null | cut -c1-30,100-
    python bench/code_per_block.py resnet50 --layers layer3.1.conv2,layer4.1.conv2 2>/dev/null
    ;;
*)
    echo "stage must be layers, network or deep3x3"; exit 2 ;;
esac
