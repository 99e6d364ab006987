#!/usr/bin/env bash
# The whole GPU test suite in parallel shards (one device call), logs under $OUT.
#   bash bench/gpu_suite.sh            (on a machine with a GPU; OUT defaults to /tmp)
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
run() {  # name, pytest args...
    local name=$1; shift
    SPARSECONV_CACHE_DIR=/tmp/scc-$name timeout ${SHARD_TIMEOUT:-540} python -m pytest -q -m gpu -p no:cacheprovider \
        -W error::DeprecationWarning "$@" > "$OUT/gpu_$name.log" 2>&1
    echo "$name: $(tail -1 "$OUT/gpu_$name.log")"
}
run conv_a tests/test_gpu_conv.py -k "benchmark_layer" &
run conv_b tests/test_gpu_conv.py -k "not benchmark_layer and not fused_epilogue and not cluster" &
run conv_d tests/test_gpu_conv.py -k "cluster" &  # its own shard: with it conv_b ran past 540 s (session 15)
run conv_c tests/test_gpu_conv.py -k "fused_epilogue" &  # its own shard: conv_b ran past 560 s with it
run torch tests/test_gpu_torch.py tests/test_gpu_network.py &
run rest tests/test_gpu_tune.py tests/test_gpu_zoo.py tests/test_gpu_model.py tests/test_benchmark.py \
    tests/test_ptx_interpreter.py &
run onnx tests/test_gpu_onnx.py tests/test_gpu_onnx_fuse.py tests/test_gpu_onnx_graph.py &
run linear tests/test_gpu_linear.py &
wait
grep -h -E "^(FAILED|ERROR)" "$OUT"/gpu_*.log | head -40
