"""`sparseconv bench`, the library part: time sparseconv kernels beside the
dense and sparse libraries a user would pick instead, on one GPU, in one run.

For each layer, sparsity and batch size it times:
  * sparseconv       the faster of sparseconv's two kernels in the row
                     (--paths): "code", the weight-specialised kernel
                     (`compile_conv2d`), and "table", the weight table
                     (`sparseconv.table.TableConv2d`, at batch <= 8 when both
                     are timed, as routing does); each has its own column too;
  * cudnn_fp32       torch.nn.functional.conv2d, TF32 off (exact fp32);
  * cudnn_tf32       the same with TF32 on (PyTorch's default for convs);
  * cublas_gemm      im2col + cupy.matmul (cuBLAS SGEMM), im2col included;
  * cusparse_spmm    im2col + cuSPARSE SpMM with the weight as CSR, im2col included.

Each figure is the median of CUDA-event timings (`cupyx.profiler.benchmark`).
Where the work can be captured, it is a CUDA graph of k back-to-back launches
replayed and divided by k ("graph": launch overhead excluded); otherwise the
events bracket each Python call ("events": the host's launch gap included).
Each row says which. The host-side latency of the sparseconv call is reported
separately, and the performance floor of ../shared/DESIGN.md beside it.

Inputs are fresh random normals. The sparseconv output is checked against
cuDNN fp32 (or a float64 im2col reference without torch) at every batch (the
table's output too, check key "table"), and
the im2col baselines against the float64 reference once per layer and
weights, so a wrong kernel or baseline cannot produce a flattering ratio.

After each row the GPU's SM clock, temperature, power and slowdown reasons
are read through NVML (clocks.py): the JSON keeps their ranges, and a run
whose clocks fell, was slowed by heat or power, or shared the GPU with
another process ends with a note saying its times are suspect.

torch and matplotlib are optional: without torch the cuDNN columns are absent,
and only the PNG plot needs matplotlib.

The package: rows.py (the row record, the floor), baselines.py (cuDNN, cuBLAS,
cuSPARSE, im2col), clocks.py (the GPU's state over the run), run.py
(run_bench), report.py (geomeans, the summary by layer class, the table, the
plot), cli.py (the click command)."""
from .report import (BenchResult, class_summary, format_table, geomean, geomean_speedups, layer_class, plot_sweep,
                     sweep_figure)
from .rows import BASELINES, MAX_REL_L2, PATHS, BenchError, BenchRow, Check, floor_us
from .run import BenchConfig, BenchLayer, benchmark_layers, layer_weight, model_bench_layers, run_bench, select_layers

__all__ = ["BASELINES", "MAX_REL_L2", "PATHS", "BenchConfig", "BenchError", "BenchLayer", "BenchResult", "BenchRow",
           "Check", "benchmark_layers", "class_summary", "floor_us", "format_table", "geomean", "geomean_speedups",
           "layer_class", "layer_weight", "model_bench_layers", "plot_sweep", "run_bench", "select_layers",
           "sweep_figure"]
