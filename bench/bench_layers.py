"""Kernel time of the benchmark layers (or a model's) against cuDNN fp32/TF32,
cuBLAS im2col+GEMM and cuSPARSE im2col+SpMM: the `sparseconv bench` command as
a script, with the same options.

    python bench/bench_layers.py --batch 1 --batch 64 --json bench.json
    python bench/bench_layers.py --sweep --layers 'resnet-*' --plot sweep.png

See sparseconv/benchmark.py for the method."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from sparseconv.bench_cli import bench  # noqa: E402

if __name__ == "__main__":
    bench(prog_name="bench_layers.py")
