"""An ONNX model through the fx front end: onnx_torch converts the graph to a
torch.fx module, and sparseconv.torch.sparsify folds BatchNorm, fuses the
epilogues, compiles, routes and captures it: the same passes a PyTorch model
goes through, written once (issue 13, item 0).

    model = compile_onnx_fx("models/lenet_digits_pruned.onnx")   # FxOnnxModel
    logits = model(x)     # x: CuPy or NumPy (N, 1, 8, 8) float32 -> CuPy array

`sparseconv run --front-end fx` and `compile_model(..., front_end="fx")` use
this; the ONNX runner (runner.py) stays for models the conversion refuses and
for machines without torch. Needs torch with CUDA.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .fx import ConvPlan
from .model import ModelError
from .onnx_fuse import fusion_totals
from .onnx_torch import onnx_to_torch
from .routing import RouteChoice
from .timing import one_line
from .torch import CudaGraphModule, sparsify

FRONT_END = "fx"


class FxOnnxModel:
    """A pruned ONNX model converted to torch.fx and sparsified: its convs (and
    pruned Gemm/MatMul layers) sparseconv kernels, the rest torch. Called like
    runner.SparseModel: a CuPy or NumPy input, CuPy outputs on the current
    device. `plans` is sparsify's plan (one ConvPlan a conv or Linear), `plan`
    the same as text lines with each captured input shape."""

    front_end = FRONT_END

    def __init__(self, path: Path, module: torch.nn.Module, input_shape: Tuple[int, ...],
                 onnx_batch: Optional[int]) -> None:
        self.path = path
        self.module = module                  # what sparsify returned (a CudaGraphModule with cuda_graph=True)
        self.input_shape = input_shape        # (C, H, W)
        self.onnx_batch = onnx_batch          # the batch size the file fixes, or None
        self.front_end_note = ""              # why onnx_compile.compile_model(front_end="auto") took this one
        self.route_note = ""                  # as SparseModel's: sparsify always has torch, so routing always runs
        self._views: Dict[Tuple[int, ...], Tuple[Any, Any, List[Any]]] = {}  # shape -> graph, CuPy in, CuPy outs
        self.plans: List[ConvPlan] = list(getattr(module, "sparseconv_plan", []))
        graph_module = module.module if isinstance(module, CudaGraphModule) else module
        # name -> FusedConv2d / FusedLinear, the layers that carry a kernel
        self.layers: Dict[str, Any] = {name: m for name, m in graph_module.named_modules()
                                       if getattr(m, "kernel", None) is not None}

    @property
    def kernels(self) -> Dict[str, Any]:
        """Layer name -> its compiled sparseconv kernel (as SparseModel.kernels)."""
        return {name: m.kernel for name, m in self.layers.items()}

    @property
    def routes(self) -> Dict[str, RouteChoice]:
        """Layer name -> the route measured for it, where routing ran."""
        return {name: m.route_choice for name, m in self.layers.items() if m.route_choice is not None}

    @property
    def graph_notes(self) -> Dict[Tuple[int, ...], str]:
        """Each input shape met so far with cuda_graph=True: "captured", or why it runs eagerly."""
        return dict(self.module.graph_notes) if isinstance(self.module, CudaGraphModule) else {}

    def _input(self, x: Any) -> torch.Tensor:
        """x (CuPy, float32 on the current device) as a torch tensor, zero copy,
        after checking its shape; DLPack orders torch after CuPy's stream."""
        if x.ndim != 4 or tuple(x.shape[1:]) != self.input_shape:
            raise ValueError(f"{self.path}: input of shape {tuple(x.shape)}, the model takes "
                             f"(N, {', '.join(map(str, self.input_shape))})")
        if self.onnx_batch is not None and x.shape[0] != self.onnx_batch:
            raise ValueError(f"{self.path}: the file fixes the batch size to {self.onnx_batch}, got a batch of "
                             f"{x.shape[0]}; export it with a dynamic batch axis")
        import cupy

        return torch.from_dlpack(cupy.ascontiguousarray(x))

    def run(self, x: Any) -> List[Any]:
        """All graph outputs, as CuPy float32 arrays (asynchronous on CuPy's current stream)."""
        import cupy

        x = cupy.asarray(x, dtype=cupy.float32)  # a host input is uploaded here
        # The graph is replayed from CuPy's side, as SparseModel replays its own: CuPy views of the static
        # buffers made once per shape, so a call costs one copy in, the replay and the copies out (the
        # DLPack exchanges and the module call cost ~16 us a call at batch 1, bench/front_end_ab.py).
        views = self._views.get(x.shape) if isinstance(self.module, CudaGraphModule) else None
        if views is None and isinstance(self.module, CudaGraphModule):
            with torch.no_grad():
                entry = self.module.graph_for(self._input(x))  # None: runs eagerly (graph_notes says why)
            if entry is not None:
                graph, static_in, static_out = entry
                outs = list(static_out) if isinstance(static_out, (tuple, list)) else [static_out]
                views = self._views[x.shape] = (graph, cupy.from_dlpack(static_in),
                                                [cupy.from_dlpack(t) for t in outs])
        if views is None:
            with torch.no_grad():
                y = self.module(self._input(x))  # a CudaGraphModule runs a shape it could not capture eagerly
            outputs = list(y) if isinstance(y, (tuple, list)) else [y]
            return [cupy.from_dlpack(t.contiguous()) for t in outputs]  # CuPy's stream waits for torch's
        graph, static_in, outs = views
        cupy.copyto(static_in, x)
        self._replay(graph, cupy.cuda.get_current_stream().ptr, static_in.device.id)
        return [y.copy() for y in outs]

    @staticmethod
    def _replay(graph: Any, stream_ptr: int, device: int) -> None:
        """Replay on CuPy's current stream (after the copy in, before the copies
        out): directly where torch's current stream is the same one (both on
        the default stream, as usual), else inside an ExternalStream of it."""
        if torch.cuda.current_stream(device).cuda_stream == stream_ptr:
            graph.replay()
            return
        with torch.cuda.stream(torch.cuda.ExternalStream(stream_ptr, device=device)):
            graph.replay()

    def __call__(self, x: Any) -> Any:
        return self.run(x)[0]

    @property
    def plan(self) -> List[str]:
        """One line per conv and Linear (its path, what fused into it, and the
        times behind the route), the pools and gemvs, and the CUDA graphs."""
        routes = self.routes
        lines = [plan_line(p, routes.get(p.name)) for p in self.plans]
        graph_module = self.module.module if isinstance(self.module, CudaGraphModule) else self.module
        lines += [f"{name}: MaxPool, sparseconv.pool (no indices)" for name in getattr(self.module, "sparseconv_pools",
                                                                                        [])]
        lines += [f"{name}: {type(graph_module.get_submodule(name)).__name__}"
                  for name in getattr(self.module, "sparseconv_gemv", [])]
        lines += [f"{name}: {type(graph_module.get_submodule(name).pool).__name__}, skipped where it leaves its input "
                  "as it is" for name in getattr(self.module, "sparseconv_skipped_pools", [])]
        lines += [f"CUDA graph for input {'x'.join(map(str, s))}: {note}" for s, note in self.graph_notes.items()]
        return lines

    def fused(self, name: str) -> Tuple[str, ...]:
        """What was folded or fused into layer `name` ("bn", "add", "relu", ...)."""
        return next((p.fused for p in self.plans if p.name == name), ())

    def fusion_lines(self) -> List[str]:
        """The totals of what was folded and fused (as onnx_fuse.fusion_lines' first line)."""
        return conv_fusion_totals(self.plans)


def plan_line(p: ConvPlan, route: Optional[RouteChoice] = None) -> str:
    """One plan entry as text: name, kind and shape, what fused, the path and
    why (for a layer whose path depends on the batch, which batch takes which)."""
    kind = "Conv" if p.kind == "conv" else "Linear"
    shape = f" {p.shape.describe()}" if p.shape is not None and p.kind == "conv" else \
        f" {p.shape.in_channels}->{p.shape.out_channels}" if p.shape is not None else ""
    fused = f", fused {'+'.join(p.fused)}" if p.fused else ""
    reason = p.reason
    if route is not None and p.action == "mixed":
        # a Linear's "table" path is the sparse gemv (route_by_batch names it so in the reason too)
        which = route.describe_route().replace("table", "sparse gemv") if p.kind == "linear" else route.describe_route()
        reason = f"{which}; {reason}"
    return f"{p.name}: {kind}{shape}{fused}, {p.action}" + (f" ({reason})" if reason else "")


def conv_fusion_totals(plans: Sequence[ConvPlan]) -> List[str]:
    """The totals line of what fused into the compiled convs; nothing when none compiled."""
    convs = [p for p in plans if p.kind == "conv" and p.action != "kept"]
    return [fusion_totals([p.fused for p in convs])] if convs else []


def compile_onnx_fx(path: Path, *, input_size: Optional[Tuple[int, int]] = None, cache_dir: Optional[str] = None,
                    jobs: Optional[int] = None, progress: bool = True, tiling: Optional[str] = None,
                    backend: str = "sparseconv", tune_batch: int = 64, cuda_graph: bool = False, fuse: bool = True,
                    route_batches: Optional[Sequence[int]] = (1, 64), table: bool = True) -> FxOnnxModel:
    """Convert the ONNX model at `path` to torch.fx (onnx_torch.onnx_to_torch)
    and sparsify it on the current CuPy device; the options are
    runner.compile_model's, with sparsify's meaning. Raises model.ModelError
    (naming the file and node) where the conversion refuses the graph."""
    import cupy

    module, shape = onnx_to_torch(Path(path), input_size)
    device = torch.device("cuda", cupy.cuda.Device().id)
    module = module.to(device)
    example = example_input(Path(path), module, shape, device)
    fast = sparsify(module, example, tiling=tiling, backend=backend, tune_batch=tune_batch,
                    cache_dir=cache_dir, jobs=jobs, progress=progress, fuse=fuse, cuda_graph=cuda_graph,
                    route_batches=route_batches, table=table)
    return FxOnnxModel(Path(path), fast, shape, module.onnx_batch)


def example_input(path: Path, module: torch.nn.Module, shape: Tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A random input the converted module runs on, for sparsify to trace and
    learn the shapes with: the batch the file fixes, else batch 1, else 2 (a
    model that halves its batch, y.view(y.size(0) // 2, -1), fails at 1).
    Raises ModelError naming the file when the module runs on neither."""
    fixed = getattr(module, "onnx_batch", None)
    errors = []
    for batch in (fixed,) if fixed else (1, 2):
        x = torch.randn((batch,) + tuple(shape), device=device)
        try:
            with torch.no_grad():
                module(x)
        except Exception as exc:  # noqa: BLE001 -- any failure of the user's graph: say which and try the next
            errors.append(f"batch {batch}: {one_line(exc)}")
        else:
            return x
    raise ModelError(f"{path}: the converted graph does not run on a random input of shape "
                     f"(N, {', '.join(map(str, shape))}) ({'; '.join(errors)}); check the model with onnxruntime, "
                     "or run it with front_end='runner' (`--front-end runner`)")
