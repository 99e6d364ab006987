"""PyTorch drop-in: compile a model's pruned convs, with BN and epilogues fused.

    import sparseconv.torch
    fast = sparseconv.torch.sparsify(model.cuda().eval(), example_input.cuda())
    with torch.no_grad():
        y = fast(x)

sparsify traces the model with torch.fx (sparseconv/fx.py), folds eval-mode
BatchNorm into the conv before it, fuses Conv -> (BN) -> (Add) -> (ReLU /
ReLU6 / clip) chains into one FusedConv2d, and compiles every eligible conv
into one sparseconv kernel (one parallel build). A FusedConv2d calls its
kernel on the tensor's memory (DLPack, zero copy) on torch's current stream.
Models that torch.fx cannot trace keep the per-module swap (nothing fused).
The input size of every conv is taken from one forward pass on
`example_input`: any batch size works later, only that image size. Inference
only: the kernels have no backward, so an input that requires grad is refused.
`fast.sparseconv_plan` says which path each conv took, what was fused, and why.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .api import compile_layers
from .fx import (MAX_LINEAR_WEIGHTS, ConvPlan, FusedConv2d, FusedLinear, LinearOptions, SparseGemvLinear, conv_padding,
                 plan, prepare, skip_identity_pools, swap_dense_linears, swap_max_pools, swap_modules)
from .gemv import MAX_GEMV_BATCH, SparseLinearTable
from .progress import StepLine
from .routing import check_route_batches, choose_route, route_from_choices, timing_label
from .shapes import Epilogue
from .tilings import ANY_BATCH, table_runs_small_batches
from .table import MAX_TABLE_BATCH, routable_table, table_timed
from .timing import one_line
from .tune import DENSE, SPARSE_EVENTS

SparseConv2d = FusedConv2d  # the name of the unfused swap before the fx front end
__all__ = ["sparsify", "plan", "ConvPlan", "FusedConv2d", "FusedLinear", "SparseConv2d", "CudaGraphModule",
           "conv_padding", "route_from_choices"]  # route_from_choices: re-exported, it lives in sparseconv.routing


class CudaGraphModule(nn.Module):
    """Runs `module` through one torch.cuda.CUDAGraph per input (shape, dtype,
    device): the first call of a shape warms up and captures it with static
    input/output buffers, later calls copy the input in and replay.

    The result is a clone of the static output, not the buffer itself: a
    caller keeping y from one call would otherwise see it overwritten by the
    next replay, silently. For a network's output (logits, a feature map) the
    clone is one small device copy inside the same stream order.
    A shape whose forward synchronizes with the host through torch (.item(),
    .cpu(), nonzero: no capture can hold it) is found in the warm-up, before
    any capture, and runs `module` eagerly from then on, as the ONNX runner's
    SparseModel does; `graph_notes` says which happened for each shape, and
    why. A capture that fails otherwise raises. CPU inputs run `module`
    directly (no graph)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        # (shape, dtype, device) -> (graph, static input, static output), or None where it runs eagerly
        self._graphs: Dict[Tuple[Any, ...], Optional[Tuple[Any, torch.Tensor, Any]]] = {}
        self.graph_notes: Dict[Tuple[int, ...], str] = {}  # input shape -> "captured" or why it runs eagerly

    def forward(self, x: torch.Tensor) -> Any:
        if not x.is_cuda:
            return self.module(x)
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("the CUDA-graph model is inference-only; call it under torch.no_grad()")
        # Host time here is part of every forward (docs/PERFORMANCE.md, session 26, run bh): one
        # dict lookup, the torch.Size as it is (a tuple), no tree walk for a single-tensor output.
        entry = self.graph_for(x)
        if entry is None:
            return self.module(x)
        graph, static_in, static_out = entry
        static_in.copy_(x)
        graph.replay()
        if isinstance(static_out, torch.Tensor):
            return static_out.clone()
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, static_out)

    def graph_for(self, x: torch.Tensor) -> Optional[Tuple[Any, torch.Tensor, Any]]:
        """(graph, static input, static output) of x's shape, captured now if
        new, or None where that shape runs eagerly (graph_notes says why): for
        a caller that copies in and out itself (onnx_fx.FxOnnxModel, from
        CuPy arrays)."""
        key = (x.shape, x.dtype, x.device)
        if key not in self._graphs:
            self._graphs[key] = self._capture(x)
        return self._graphs[key]

    def _capture(self, x: torch.Tensor) -> Optional[Tuple[Any, torch.Tensor, Any]]:
        static_in = x.detach().clone()
        shape = tuple(x.shape)
        caller = torch.cuda.current_stream(x.device)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(caller)
        # Warm-up on a side stream, as torch's docs ask before a capture (lazy
        # inits, cuDNN heuristics, autotuning all happen outside the graph). The
        # last run refuses host syncs (.item(), .cpu(), nonzero): a forward that
        # makes one cannot be captured, and finding it here, before any capture
        # begins, leaves torch's state as it was.
        try:
            with torch.no_grad(), torch.cuda.stream(side):
                for _ in range(2):
                    self.module(static_in)
                with _host_syncs_refused():
                    self.module(static_in)
        except RuntimeError as exc:
            caller.wait_stream(side)
            if "synchronizing" not in str(exc):
                raise
            self.graph_notes[shape] = f"not captured, runs eagerly: it synchronizes with the host ({one_line(exc)})"
            return None
        caller.wait_stream(side)
        # A capture that fails past that check (a sync torch does not see, CuPy's say) raises: torch.cuda.graph
        # ending one half way leaves its stream current, its pool open and the RNG flagged as capturing, and
        # putting those back by hand through torch's private calls aborted the process later (session 32).
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_out = self.module(static_in)
        self.graph_notes[shape] = "captured"
        return graph, static_in, static_out

    def captured_shapes(self) -> List[Tuple[int, ...]]:
        return [tuple(k[0]) for k, entry in self._graphs.items() if entry is not None]


@contextlib.contextmanager
def _host_syncs_refused() -> Iterator[None]:
    """torch raises on an operation that synchronizes with the host, inside."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")  # on every capture
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)


def _host(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
    return None if t is None else np.ascontiguousarray(t.detach().cpu().numpy(), dtype=np.float32)


def _compile(convs: Dict[str, Any], shapes: Dict[str, Any], *, tiling: Optional[str], backend: str,
             tune_batch: int, cache_dir: Optional[str], jobs: Optional[int], progress: bool,
             table_layers: Sequence[str] = ()) -> Dict[str, Any]:
    """Compile every fused conv and Linear on the current GPU (name -> kernel),
    each with its epilogue: one parallel build of every layer and batch
    variant (table_layers: see compile_layers); with tiling/backend "auto",
    one tuned compile per layer."""
    layers = [(name, _host(m.weight), _host(m.bias), shapes[name]) for name, m in convs.items()]
    epilogues = {name: Epilogue(activation=m.activation, clip=m.clip, residual=m.residual,
                                pool=getattr(m, "pool", False)) for name, m in convs.items()}
    linears = {name for name, m in convs.items() if isinstance(m, FusedLinear)}
    return compile_layers(layers, tiling=tiling, backend=backend, tune_batch=tune_batch, cache_dir=cache_dir,
                          jobs=jobs, progress=progress, epilogues=epilogues, linears=linears,
                          table_layers=table_layers)


def small_batch_table_layers(convs: Dict[str, Any], shapes: Dict[str, Any], route_batches: Optional[Sequence[int]],
                             table: bool) -> List[str]:
    """The convs whose small batches route_by_batch will time through the
    weight table (table on, table.table_timed) and the table is known to win
    there (tilings.table_runs_small_batches): built without their split code."""
    if not (table and route_batches):
        return []
    return [name for name, m in convs.items() if isinstance(m, FusedConv2d)
            and table_timed(shapes[name], route_batches) and table_runs_small_batches(shapes[name])]


def route_by_batch(convs: Dict[str, Any], batches: Sequence[int], device: torch.device,
                   progress: bool = False, table: bool = True) -> Dict[str, str]:
    """Time each compiled conv (FusedConv2d) or Linear (FusedLinear; the dense
    path is cuBLAS through fx.linear_gemm) at each batch size through both paths, its
    sparseconv kernel and cuDNN in strict fp32, epilogue included, by CUDA-graph
    replays, and a conv at batches up to MAX_TABLE_BATCH also through the
    weight table (sparseconv.table; `table` False: not); set its route so each
    batch size runs the fastest (a batch between two measured ones takes the
    nearer one's, geometrically). A conv keeps its table kernel only where
    the route takes it. Returns name -> the measurements and the choice, as
    text for the plan.

    Each call is timed as a network would meet it: L2 overwritten first (our
    kernel's code and cuDNN's weights no longer in it), then the inputs read
    back in, as the layer before would have left them. Replayed back to back
    instead, a kernel's code stays in L2, and ResNet-50's batch-1 convs summed
    to 650 us alone but took 1,163 us inside the network
    (bench/network_profile.py, docs/PERFORMANCE.md)."""
    from .timing import l2_flush, l2_scratch_floats, time_cold, torch_graph

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    flush = torch.empty(l2_scratch_floats(l2), device=device)
    sizes = sorted(set(int(b) for b in batches))
    notes: Dict[str, str] = {}
    items = [(n, m) for n, m in convs.items() if m.kernel is not None and m.kernel.backend == "sparseconv"]
    line = StepLine(timing_label(table), len(items), progress)
    for name, m in items:
        line.step(name)
        s = m.kernel.shape

        def inputs(b: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
            """Fresh random x of batch b, and a residual where the layer adds one."""
            x = torch.randn(b, s.in_channels, device=device) if isinstance(m, FusedLinear) \
                else torch.randn(b, s.in_channels, s.in_h, s.in_w, device=device)
            r = torch.randn(b, s.out_channels, s.out_h, s.out_w, device=device) if m.residual else None
            return x, r

        def time_both(b: int) -> Tuple[float, float]:
            x, r = inputs(b)
            us = []
            for path in ("sparseconv", "dense"):
                m.route = [(ANY_BATCH, path)]
                us.append(time_cold(lambda: m(x, r), l2_flush(flush, x, r), repeat=20, max_seconds=0.2,
                                    capture=torch_graph).us)
            return us[0], us[1]

        def time_table(b: int) -> Optional[float]:
            if m.table is None or b > (MAX_GEMV_BATCH if isinstance(m, FusedLinear) else MAX_TABLE_BATCH):
                return None
            x, r = inputs(b)
            m.route = [(ANY_BATCH, "table")]
            return time_cold(lambda: m(x, r), l2_flush(flush, x, r), repeat=20, max_seconds=0.2,
                             capture=torch_graph).us

        if table and isinstance(m, FusedConv2d):
            import cupy
            with cupy.cuda.Device(device.index):
                m.table = routable_table(_host(m.weight), _host(m.bias), s, m.kernel.epilogue, sizes, name)
        elif table and isinstance(m, FusedLinear) and min(sizes) <= MAX_GEMV_BATCH:
            import cupy
            with cupy.cuda.Device(device.index):  # the sparse gemv, timed beside the code at small batches
                m.table = SparseLinearTable(_host(m.weight), _host(m.bias), m.activation, m.clip)
        choice = choose_route(time_both, sizes, time_table=time_table)
        m.route, m.route_choice = list(choice.route), choice
        if all(path != "table" for _, path in m.route):
            m.table = None
        # the dense path of a Linear is cuBLAS (fx.linear_gemm), not cuDNN
        notes[name] = choice.describe().replace("cuDNN", "cuBLAS").replace("table", "sparse gemv") \
            if isinstance(m, FusedLinear) else choice.describe()
    line.close()
    return notes


def sparsify(model: nn.Module, example_input: torch.Tensor, *, min_sparsity: float = 0.0,
             tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
             cache_dir: Optional[str] = None, jobs: Optional[int] = None, progress: bool = True,
             inplace: bool = False, fuse: bool = True, cuda_graph: bool = False,
             route_batches: Optional[Sequence[int]] = (1, 64), linear: bool = True,
             max_linear_weights: Optional[int] = MAX_LINEAR_WEIGHTS, pools: bool = True,
             gemv: bool = True, table: bool = True) -> nn.Module:
    """Return `model` with each eligible nn.Conv2d (and pruned nn.Linear)
    compiled to a sparseconv kernel.

    model and example_input must be on one CUDA device. Convs that are not
    float32, use a non-zero padding_mode, see several input sizes, or are less
    sparse than `min_sparsity` stay as they are. fuse=True folds eval-mode
    BatchNorm into the conv and fuses a following residual add and ReLU /
    ReLU6 / hardtanh / clamp into the kernel's epilogue, and (with pools) a
    2x2 max pool of stride 2 after them (VGG's): the plan says what fused. The layers compile in
    parallel (`jobs` processes, a progress bar on stderr unless
    progress=False) and are cached in `cache_dir`. tiling="auto" times
    candidate tilings per layer; backend="auto" also times cuDNN strict fp32
    and runs the layer through it where it was faster.

    The result is a torch.fx GraphModule (the model itself is not changed), or
    for a model torch.fx cannot trace a copy with its convs swapped (the model
    itself with inplace=True). cuda_graph=True wraps it in a CudaGraphModule:
    one CUDA graph per input shape, replayed on later calls (see its doc).
    Without it each kernel is launched from Python, and at batch 1 the GPU
    waits on the host (ResNet-50 on an H100: 1.8-2.9 ms a forward from call
    to result, by the host's CPU, against 0.41 replayed; bench/eager_forward.py,
    sessions 35-36).
    `result.sparseconv_plan` lists every conv: action ("sparseconv", "dense"
    or "kept"), what was fused into it, and why.

    route_batches (default 1 and 64): each compiled conv is timed at these
    batch sizes through its kernel and through cuDNN in strict fp32 (epilogue
    included, CUDA-graph replays, L2 overwritten before each call as inside a
    network), and each batch size then runs the faster
    path, so a layer is never slower by default than the exact cuDNN
    convolution at the sizes you name; the plan shows the times ("mixed":
    the choice depends on the batch). None or () turns this off.

    table=True (default) also times each conv, at the route_batches of at
    most table.MAX_TABLE_BATCH images, through the weight-table family
    (sparseconv.table: the nonzero weights read as data instead of fetched
    as code, ~1.5-2x faster on ResNet-50's 7x7 and 14x14 layers at batch 1)
    and routes those batch sizes to it where it is the fastest. Deep convs
    larger than 1x1 on images of 14x14 or less (VGG-16's conv5_x, ResNet-50's
    layer4.x.conv2), where the table has beaten the split code in every run,
    are then built without that code (tilings.table_runs_small_batches): a
    shorter build, and the plan says so.

    linear=True (default) also compiles each nn.Linear that is called once on
    2-D (N, in_features) inputs and has at least max(min_sparsity, 0.5) of its
    weights zero (api.LINEAR_MIN_SPARSITY: unpruned heads are left alone and
    unlisted), with a following ReLU / ReLU6 / hardtanh / clamp fused, as a
    1x1 conv on a 1x1 input (sparseconv.compile_linear); routed against
    cuBLAS's F.linear in strict fp32 like the convs and, at batch <= 8 with
    table=True, against the sparse gemv with its activation fused (VGG-16's
    pruned fc8 at batch 1: 5.6 us against cuBLAS's 9.4). Layers with more than
    max_linear_weights weights (default 4,194,304: VGG-16's fc8 builds in 2
    minutes on 2 cores, fc7 in 13) are kept, as are those over the build limits
    (fc6); max_linear_weights=None lifts the first bound. The plan lists them
    with kind "linear".

    pools=True (default) fuses VGG's 2x2 max pools into the conv before them
    (with fuse; not after a residual add) and swaps each other
    nn.MaxPool2d (without return_indices) for sparseconv.pool's kernel on CUDA float32 inputs: the same maxima,
    without the int64 indices torch's CUDA pool also writes (ResNet-50's pool
    at batch 64 moves ~30% fewer bytes). `result.sparseconv_pools` lists them.
    In a traced model it also skips each pool that leaves its input as it is
    (an adaptive pool to its input's size, as VGG's after 7x7 features, or a
    1x1 window at stride 1): `result.sparseconv_skipped_pools`. pools=False
    leaves every pool to torch.

    gemv=True (default) runs each nn.Linear that is not compiled (at least
    gemv.MIN_GEMV_FEATURES outputs) through a sparseconv.gemv kernel at
    batch <= 8 on CUDA float32 inputs, exact fp32: a dense one through the
    dense kernel, the weights streamed once (VGG-16's fc7 at batch 1: 39 ->
    28 us against cuBLAS); a pruned one (gemv.MIN_SPARSE_GEMV_SPARSITY zeros
    or more, e.g. a pruned fc6 over the build limits) through the sparse
    kernel, which reads only its nonzero weights. Other calls run F.linear.
    `result.sparseconv_gemv` lists them, and the plan names the sparse ones."""
    if not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"sparsify: min_sparsity must be in [0, 1], got {min_sparsity}")
    for option, value in (("linear", linear), ("pools", pools), ("gemv", gemv), ("table", table)):
        if not isinstance(value, bool):
            raise TypeError(f"sparsify: {option} must be True or False, got {value!r}")
    if max_linear_weights is not None and (isinstance(max_linear_weights, bool) or
                                           not isinstance(max_linear_weights, int) or max_linear_weights < 1):
        raise ValueError(f"sparsify: max_linear_weights must be a positive int or None, got {max_linear_weights!r}")
    check_route_batches(route_batches, "sparsify")
    if not isinstance(example_input, torch.Tensor) or not example_input.is_cuda:
        raise ValueError("sparsify: example_input must be a CUDA tensor (the model runs on the GPU); "
                         "move the model and the example with .cuda()")
    import cupy

    device = example_input.device
    if any(p.device != device for p in model.parameters()):
        raise ValueError(f"sparsify: every parameter of the model must be on {device}, like example_input")
    front = prepare(model, example_input, min_sparsity=min_sparsity, fuse=fuse,
                    linear=LinearOptions(linear, max_linear_weights), fuse_pools=pools)
    result, convs = front.module, front.convs
    if inplace and not front.traced and not isinstance(model, nn.Conv2d):
        # The per-module path swapped a copy's convs: swap the model's own instead.
        convs, result = swap_modules(model, front.plans), model
    shapes = {p.name: p.shape for p in front.plans if p.name in convs}
    tuned = tiling == "auto" or backend == "auto"  # compile_layers then builds each layer's own candidates
    table_layers = [] if tuned else small_batch_table_layers(convs, shapes, route_batches, table)
    with cupy.cuda.Device(device.index):
        kernels = _compile(convs, shapes, tiling=tiling, backend=backend, tune_batch=tune_batch,
                           cache_dir=cache_dir, jobs=jobs, progress=progress, table_layers=table_layers)
    for name, m in convs.items():
        m.to(device)
        m.kernel = kernels[name]
    routed = route_by_batch(convs, route_batches, device, progress, table) if route_batches else {}
    plans = front.plans
    for i, p in enumerate(plans):
        k = kernels.get(p.name)
        if k is not None and k.backend == "dense":
            t = k.stats["tuning"]["times_us"]
            plans[i] = replace(p, action="dense", reason=f"cuDNN measured faster ({t[DENSE]:.1f} us vs "
                               f"{t[SPARSE_EVENTS]:.1f} us)")
        elif p.name in routed:
            paths = {path for _, path in convs[p.name].route}
            action = "mixed" if len(paths) > 1 else paths.pop()
            reason = routed[p.name]
            if p.name in table_layers:
                reason += "; no split code built for small batches (tilings.table_runs_small_batches)"
            plans[i] = replace(p, action=action, reason=reason)
    skipped = skip_identity_pools(result) if pools and isinstance(result, torch.fx.GraphModule) else []
    pooled = swap_max_pools(result) if pools else []
    gemvs = swap_dense_linears(result) if gemv else []
    for i, p in enumerate(plans):  # a kept pruned Linear now runs the sparse gemv: the plan says so
        if p.kind == "linear" and p.action == "kept" and p.name in gemvs \
                and isinstance(result.get_submodule(p.name), SparseGemvLinear):
            plans[i] = replace(p, reason=f"{p.reason}; runs sparseconv's sparse gemv at batch <= {MAX_GEMV_BATCH} "
                                         f"(only its nonzero weights read), F.linear above")
    if cuda_graph:
        result = CudaGraphModule(result)
    result.sparseconv_plan = plans
    result.sparseconv_pools = pooled
    result.sparseconv_skipped_pools = skipped
    result.sparseconv_gemv = gemvs
    return result


def format_plan(plans: List[ConvPlan]) -> str:
    """The plan as aligned text lines: name, action, fused, reason."""
    width = max((len(p.name) for p in plans), default=4)
    return "\n".join(f"{p.name:<{width}}  {p.action:<10}  {'+'.join(p.fused) or '-':<14}  {p.reason}".rstrip()
                     for p in plans)
