"""The baselines `sparseconv bench` times beside sparseconv: cuDNN through torch
(fp32 and TF32), cuBLAS im2col+GEMM and cuSPARSE im2col+SpMM through CuPy, and
the one-launch GPU im2col they share. Each returns a capturable launch with its
buffers allocated outside it. cupy and torch are imported inside the functions
(torch is optional; neither is needed to import this module)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import numpy as np

from ..dense import columns_to_nchw, conv2d_im2col
from ..shapes import ConvShape
from ..testing import relative_l2
from ..timing import Launch, one_line
from .rows import Check

CHECK_BATCH = 2  # the im2col baselines are checked on this many images (exercises the batch index)
IM2COL_BASELINES = ("cublas_gemm", "cusparse_spmm")


def import_torch() -> Tuple[Any, str]:
    """(torch, '') when torch with CUDA is importable, else (None, why not)."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed, so the cuDNN columns are absent (pip install 'sparseconv[bench]')"
    if not torch.cuda.is_available():
        return None, f"torch {torch.__version__} has no CUDA here, so the cuDNN columns are absent"
    return torch, ""


_IM2COL_SOURCE = r"""
IDX ii = (IDX)i;
IDX crs = C * R * S;
IDX row, q;
if (fortran) { row = ii % crs; q = ii / crs; } else { row = ii / M; q = ii % M; }
IDX wo = q % Wo, t = q / Wo, ho = t % Ho, n = t / Ho;
IDX s = row % S, r = (row / S) % R, c = row / (R * S);
IDX h = ho * sh - ph + r * dh, w = wo * sw - pw + s * dw;
cols[ii] = (h >= 0 && h < H && w >= 0 && w < W) ? x[((n * C + c) * H + h) * W + w] : (T)0;
"""
_IM2COL_PARAMS = ("C", "H", "W", "R", "S", "Ho", "Wo", "M", "sh", "sw", "ph", "pw", "dh", "dw")
_im2col_kernels: Dict[str, Any] = {}


def _im2col_kernel(index_type: str) -> Any:
    """The im2col ElementwiseKernel with int32 or int64 index math. Scalars do
    not decide CuPy type placeholders, so the index type is spelled out."""
    import cupy

    if index_type not in _im2col_kernels:
        ctype = {"int32": "int", "int64": "long long"}[index_type]
        params = "raw T x, " + ", ".join(f"{index_type} {p}" for p in _IM2COL_PARAMS) + ", bool fortran"
        _im2col_kernels[index_type] = cupy.ElementwiseKernel(
            params, "raw T cols", _IM2COL_SOURCE, f"sparseconv_im2col_{index_type}",
            preamble=f"typedef {ctype} IDX;")
    return _im2col_kernels[index_type]


def gpu_im2col(x: Any, shape: ConvShape, cols: Any) -> None:
    """im2col in one launch into a preallocated (C*R*S, N*Ho*Wo) float32 array,
    C- or F-ordered (cuSPARSE wants F). 32-bit index math when it fits."""
    s = shape
    index_type = "int64" if max(cols.size, x.size) >= 2 ** 31 - 1 else "int32"
    args = [s.in_channels, s.in_h, s.in_w, s.kernel_h, s.kernel_w, s.out_h, s.out_w, cols.shape[1],
            *s.stride, *s.padding, *s.dilation]
    fortran = not cols.flags.c_contiguous
    flat = cols.T.ravel() if fortran else cols.ravel()  # a 1-D view in memory order: cols[i] is offset i
    _im2col_kernel(index_type)(x, *args, fortran, flat, size=cols.size)


def im2col_runners(shape: ConvShape, w: np.ndarray, x: Any, names: Sequence[str]) -> Dict[str, Tuple[Launch, Launch]]:
    """name -> (launch, NCHW output) for the im2col baselines. Buffers are
    allocated here, outside the timed launch, so the launch is capturable. The
    final (K, N*Ho*Wo) -> NCHW transpose is left out of both (it favours them)."""
    import cupy

    s, n = shape, x.shape[0]
    crs, m = s.c_per_group * s.kernel_h * s.kernel_w * s.groups, n * s.out_h * s.out_w
    out: Dict[str, Tuple[Launch, Launch]] = {}
    if "cublas_gemm" in names:
        cols_c = cupy.empty((crs, m), cupy.float32)
        y_c = cupy.empty((s.groups, s.k_per_group, m), cupy.float32)
        wg = cupy.asarray(w.reshape(s.groups, s.k_per_group, -1))
        if s.groups == 1:  # a plain SGEMM rather than a batch of one
            wg, y_c, cols_view = wg[0], y_c[0], cols_c
        else:
            cols_view = cols_c.reshape(s.groups, -1, m)

        def gemm() -> None:
            gpu_im2col(x, s, cols_c)
            cupy.matmul(wg, cols_view, out=y_c)

        out["cublas_gemm"] = (gemm, lambda: columns_to_nchw(y_c.reshape(s.out_channels, m), n, s))
    if "cusparse_spmm" in names:
        import cupyx.cusparse
        import cupyx.scipy.sparse

        # The grouped weight as one block-diagonal (K, C*R*S) matrix; the CSR skips the zeros.
        dense = np.zeros((s.out_channels, crs), np.float32)
        kg, cg = s.k_per_group, s.c_per_group * s.kernel_h * s.kernel_w
        for g in range(s.groups):
            dense[g * kg:(g + 1) * kg, g * cg:(g + 1) * cg] = w[g * kg:(g + 1) * kg].reshape(kg, cg)
        csr = cupyx.scipy.sparse.csr_matrix(cupy.asarray(dense))
        csr.sum_duplicates()  # spmm wants canonical CSR (sorted, no duplicates)
        cols_f = cupy.empty((crs, m), cupy.float32, order="F")
        y_f = cupy.empty((s.out_channels, m), cupy.float32, order="F")

        def spmm() -> None:
            gpu_im2col(x, s, cols_f)
            cupyx.cusparse.spmm(csr, cols_f, c=y_f)  # what csr @ cols runs, minus its copies and zero fill

        out["cusparse_spmm"] = (spmm, lambda: columns_to_nchw(y_f, n, s))
    return out


def cudnn_launch(torch: Any, shape: ConvShape, w: np.ndarray, bias: Optional[np.ndarray], x: Any) -> Launch:
    s, F = shape, torch.nn.functional
    xt = torch.as_tensor(x, device="cuda")
    wt = torch.tensor(w, device="cuda")  # a copy: a model's weights may be read-only arrays
    bt = torch.tensor(bias, device="cuda") if bias is not None else None
    return lambda: F.conv2d(xt, wt, bt, s.stride, s.padding, s.dilation, s.groups)


def check_baselines(shape: ConvShape, w: np.ndarray, baselines: Sequence[str], rng: Any) -> Dict[str, Check]:
    """Run the im2col baselines once on CHECK_BATCH fresh images against the float64 reference."""
    import cupy

    names = [b for b in baselines if b in IM2COL_BASELINES]
    if not names:
        return {}
    x = rng.standard_normal((CHECK_BATCH, shape.in_channels, shape.in_h, shape.in_w), dtype=cupy.float32)
    ref = conv2d_im2col(x, w, shape, None, cupy)
    out: Dict[str, Check] = {}
    for name in names:
        try:
            launch, output = im2col_runners(shape, w, x, [name])[name]
            launch()
            out[name] = Check.of("float64 im2col", relative_l2(output(), ref, cupy))
        except Exception as exc:  # a baseline that cannot run is a failed check, not a crashed bench
            out[name] = Check("float64 im2col", None, False, one_line(exc))
    return out
