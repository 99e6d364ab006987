# The device run behind docs/PERFORMANCE.md "Split (batch-1) variants at ptxas -O1" (H100, 2026-11-23):
# batch-1 split variants and batch-64 defaults at ptxas -O3 vs -O1.  bash bench/split_probe_o1.sh (OUT=dir)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECONV_CACHE_DIR=/tmp/scc OUT=${OUT:-/tmp}
R=resnet50
L1=$R:layer4.1.conv1,$R:layer4.0.conv3,$R:layer3.1.conv1,$R:layer2.1.conv1,$R:layer4.1.conv2,$R:layer3.0.downsample
L64=$R:layer2.1.conv1,$R:layer3.1.conv1,$R:layer4.1.conv3,$R:layer1.0.conv3,$R:layer4.1.conv2,$R:layer3.1.conv2,$R:layer4.0.downsample
timeout 260 python bench/split_probe.py --layers $L1 --cands default,default:O1,64x64x16:O1,64x128x32x16:O1 --out $OUT/probe_b1.json > $OUT/probe_b1.log 2>&1
timeout 300 python bench/split_probe.py --batch 64 --layers $L64 --cands default,default:O1 --out $OUT/probe_b64.json > $OUT/probe_b64.log 2>&1
grep -E " call " $OUT/probe_b1.log $OUT/probe_b64.log | cut -c1-220
