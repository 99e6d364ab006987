"""Running a specialised conv kernel in the PTX interpreter as the run time
launches it (sparseconv.runtime.Conv2dKernel._launch), for the CPU tests: the
entry's arguments, a split variant's workspace, and the ordered sum of its
slices with the epilogue after it (what sc_reduce_slices does on the GPU), or,
for a cluster sum, the output itself (the kernel adds the slices)."""
import numpy as np

from sparseconv.dense import max_pool_2x2
from sparseconv.render import ENTRY_NAME
from sparseconv.shapes import dynamic_shared_bytes, launch_grid, n_chunks

from ptx_interpreter import run_kernel


def run_ptx(ptx, rendered, x, bias, residual=None, shared_bytes=None):
    """Run the specialised kernel in the interpreter. With a split reduction
    the slices' partial sums are added here in slice order (as the run-time's
    reduction kernel does) and the epilogue applied after, unless the kernel
    sums them in its clusters (Tiling.slice_sum). `shared_bytes`: the dynamic
    shared memory to launch with (SpecialiseStats.launch_shared_bytes; by
    default the input patch's)."""
    shape, t = rendered.shape, rendered.tiling
    n = x.shape[0]
    outputs = 1 if t.slice_sum == "cluster" else t.slices
    y = np.full((outputs, n, shape.out_channels) + rendered.epilogue.output_hw(shape), np.nan, np.float32)
    run_kernel(ptx, ENTRY_NAME, grid=launch_grid(shape, t, n), block=(t.threads, 1, 1),
               args=[np.ascontiguousarray(x), y, bias, residual if residual is not None else 0, n,
                     n_chunks(shape, t)],
               dynamic_shared_bytes=dynamic_shared_bytes(shape, t) if shared_bytes is None else shared_bytes)
    if outputs == 1:
        return y[0]
    out = y[0]
    for s in range(1, t.slices):
        out = out + y[s]
    return apply_epilogue(out, rendered.epilogue, residual)


def apply_epilogue(y, epilogue, residual):
    """y + residual, then the activation's clamp, then the 2x2 max pool
    (floor mode), in y's dtype (the reference's side)."""
    if epilogue.residual:
        y = y + residual
    lo, hi = epilogue.bounds
    if lo is not None:
        y = np.where(y < lo, lo, y).astype(y.dtype)
    if hi is not None:
        y = np.where(y > hi, hi, y).astype(y.dtype)
    return max_pool_2x2(y) if epilogue.pool else y
