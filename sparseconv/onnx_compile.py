"""compile_model: a whole ONNX model on the GPU, through one of two front ends.

- "auto" (default): fx where torch with CUDA is installed and the
  conversion takes every node, else the runner; `model.front_end_note`
  says which and why.
- "fx": onnx_torch.py converts the graph to torch.fx and
  sparseconv.torch.sparsify runs the passes a PyTorch model goes through
  (onnx_fx.py): one set of passes for both kinds of model. Needs torch
  with CUDA.
- "runner": runner.py parses the graph into its own program, fuses it
  (onnx_fuse.py) and runs the non-conv operators as CuPy code; it takes
  the operators the conversion does (onnx_torch.CONVERTERS covers
  runner.OPS) and nodes it refuses (pads, slice bounds, axes or indices
  computed at run time), and needs no torch.

On ResNet-50 exported to ONNX both run the same kernels in the same time
(H100, bench/front_end_ab.py: 405.2 vs 404.9 us a forward at batch 1,
6,491 vs 6,514 at batch 64; docs/PERFORMANCE.md, session 31).

Both models are called the same way (a CuPy or NumPy input, CuPy outputs)
and both have .plan, .kernels, .routes and .graph_notes. This module sits
above both front ends, so neither imports the other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

from .model import ModelError
from .routing import check_route_batches
from .runner import compile_model as compile_runner

FRONT_ENDS = ("runner", "fx", "auto")


def torch_cuda_missing() -> str:
    """Why the fx front end cannot run here ("" when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no usable CUDA device"
    return ""


def compile_model(path: Path, *, front_end: str = "auto", input_size: Optional[Tuple[int, int]] = None,
                  cache_dir: Optional[str] = None, jobs: Optional[int] = None, progress: bool = True,
                  tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
                  cuda_graph: bool = False, fuse: bool = True, route_batches: Optional[Sequence[int]] = (1, 64),
                  table: bool = True) -> Any:
    """Compile every Conv (and pruned Gemm/MatMul) of the ONNX model at `path`
    and load the kernels on the current GPU, through `front_end` ("runner",
    "fx" or "auto"; see the module's doc). The other options are
    runner.compile_model's. Returns a runner.SparseModel or an
    onnx_fx.FxOnnxModel; its .front_end says which, and .front_end_note why
    ("auto" only)."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"compile_model: front_end must be one of {', '.join(FRONT_ENDS)}, got {front_end!r}")
    check_route_batches(route_batches, "compile_model")
    options = dict(input_size=input_size, cache_dir=cache_dir, jobs=jobs, progress=progress, tiling=tiling,
                   backend=backend, tune_batch=tune_batch, cuda_graph=cuda_graph, fuse=fuse,
                   route_batches=route_batches, table=table)
    note = ""
    if front_end != "runner":
        missing = torch_cuda_missing()
        if missing and front_end == "fx":
            raise ModelError(f"{path}: the fx front end needs torch with CUDA ({missing}); "
                             "use front_end='runner' (`--front-end runner`)")
        if not missing:
            from .onnx_fx import compile_onnx_fx

            try:
                model = compile_onnx_fx(Path(path), **options)
            except ModelError as exc:
                if front_end == "fx":
                    raise
                note = f"the ONNX runner: the fx conversion refused the graph ({exc})"
            else:
                model.front_end_note = "fx: every node converted" if front_end == "auto" else ""
                return model
        else:
            note = f"the ONNX runner: {missing}"
    model = compile_runner(Path(path), **options)
    model.front_end_note = note
    return model
