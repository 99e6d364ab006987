#!/usr/bin/env bash
# The whole GPU test suite in parallel shards, logs under $OUT.
#   bash bench/gpu_suite.sh 1; bash bench/gpu_suite.sh 2   (two device calls of ~5-8 minutes each)
#   bash bench/gpu_suite.sh                                (both parts in one go: ~15 minutes)
#   bash bench/gpu_suite.sh two-gpus                       (part 1 on GPU 0, part 2 on GPU 1 at once:
#                                                           ~6 minutes on two H200s; logs in $OUT/gpu_logs.tgz)
# Each part finishes within one 10-minute device call: in one call of 560 s
# the two largest conv shards ran out of time (sessions 15-18), so they are
# split in two by test index, and the work is spread over two parts.
set -u
OUT=${OUT:-/tmp}
PART=${1:-all}
case $PART in
    1|2|all|two-gpus) ;;
    *) echo "usage: bash bench/gpu_suite.sh [1|2|all|two-gpus], not '$PART'" >&2; exit 2;;
esac
if [ "$PART" = two-gpus ]; then
    # one tarball: the device tool brings back at most 8 files, and the parts write 11 logs
    mkdir -p "$OUT/part1" "$OUT/part2"
    CUDA_VISIBLE_DEVICES=0 OUT=$OUT/part1 bash "$0" 1 > "$OUT/part1/summary.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 OUT=$OUT/part2 bash "$0" 2 > "$OUT/part2/summary.txt" 2>&1 &
    wait
    cat "$OUT/part1/summary.txt" "$OUT/part2/summary.txt"
    tar czf "$OUT/gpu_logs.tgz" -C "$OUT" part1 part2 && rm -rf "$OUT/part1" "$OUT/part2"
    exit 0
fi
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {  # name, pytest args...
    local name=$1; shift
    SPARSECONV_CACHE_DIR=/tmp/scc-$name timeout ${SHARD_TIMEOUT:-540} python -m pytest -q -m gpu -p no:cacheprovider \
        -W error::DeprecationWarning "$@" > "$OUT/gpu_$name.log" 2>&1
    echo "$name: $(tail -1 "$OUT/gpu_$name.log")"
}
half() {  # name, index (0 or 1), pytest args...: every other test of the selection, by collection order
    local name=$1 index=$2; shift 2
    local ids=()  # one node id an element: ids may hold spaces (test_gpu_torch's parameters do)
    mapfile -t ids < <(python -m pytest --collect-only -q -m gpu -p no:cacheprovider "$@" 2>/dev/null | grep '::' |
                       awk -v i="$index" 'NR % 2 == i')
    [ ${#ids[@]} -gt 0 ] || { echo "$name: nothing collected"; return; }
    run "$name" "${ids[@]}"
}
if [ "$PART" != 2 ]; then
    run conv_a tests/test_gpu_conv.py -k "benchmark_layer" &
    half conv_b0 0 tests/test_gpu_conv.py -k "not benchmark_layer and not fused_epilogue and not cluster" &
    half conv_b1 1 tests/test_gpu_conv.py -k "not benchmark_layer and not fused_epilogue and not cluster" &
    run conv_d tests/test_gpu_conv.py -k "cluster" &
    run torch tests/test_gpu_torch.py &
    wait
fi
if [ "$PART" != 1 ]; then
    half conv_c0 0 tests/test_gpu_conv.py -k "fused_epilogue" &
    half conv_c1 1 tests/test_gpu_conv.py -k "fused_epilogue" &
    run rest tests/test_gpu_tune.py tests/test_gpu_zoo.py tests/test_gpu_model.py tests/test_benchmark.py \
        tests/test_clocks.py tests/test_ptx_interpreter.py &
    run onnx tests/test_gpu_onnx.py tests/test_gpu_onnx_fuse.py tests/test_gpu_onnx_graph.py tests/test_gpu_onnx_fx.py &
    run linear tests/test_gpu_linear.py tests/test_gemv.py &
    run table tests/test_gpu_table.py tests/test_gpu_launch.py tests/test_gpu_pool_epilogue.py &
    # its own shard in the lighter part since session 41's MobileNetV2 test (~80 s): the torch shard took 331 s
    run network tests/test_gpu_network.py &
    wait
fi
grep -h -E "^(FAILED|ERROR)" "$OUT"/gpu_*.log | head -40
