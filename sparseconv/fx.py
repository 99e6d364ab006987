"""The PyTorch graph front end: trace a module with torch.fx, fold eval-mode
BatchNorm into the conv before it, fuse Conv -> (BN) -> (Add) -> (ReLU/ReLU6/
clip) chains into one FusedConv2d node (and, when asked, pruned Linear ->
(ReLU/ReLU6/clip) into one FusedLinear), and say per layer what happened.

Everything here runs on the CPU: a FusedConv2d without a compiled kernel (or on
a CPU tensor) computes its chain with torch (F.conv2d + residual + activation),
so each pass is checked in CI against the original module. sparseconv.torch
compiles the FusedConv2d kernels on the GPU afterwards.

Modules that torch.fx cannot trace (data-dependent control flow, ...) keep the
per-module path: each eligible nn.Conv2d is swapped for an unfused FusedConv2d,
and the plan says why nothing was fused.
"""
from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn

from .api import LINEAR_MIN_SPARSITY, MAX_LINEAR_WEIGHTS, linear_limits, linear_shape
from .dense import fold_batchnorm as fold_arrays, torch_flags
from .gemv import (MAX_GEMV_BATCH, gemv_supported, gemv_takes, linear_gemv_pointers, linear_sparse_gemv,
                   sparse_gemv_takes, sparse_rows)
from .pool import FUSED_POOL, MaxPoolShape, max_pool2d_pointers
from .shapes import ConvShape, shape_from_weight

ACTIVATIONS = ("none", "relu", "relu6", "clip")


@dataclass(frozen=True)
class ConvPlan:
    """What the front end does with one nn.Conv2d: compile it, or keep it and why."""

    name: str
    action: str                  # "sparseconv", "dense" (cuDNN measured faster), "mixed" (by batch size) or "kept"
    reason: str                  # why it was kept, or how it was handled ("" when plainly compiled)
    sparsity: float
    shape: Optional[ConvShape]   # None when the conv cannot be compiled
    fused: Tuple[str, ...] = ()  # what was folded/fused into it, in order: "bn", "add", "relu", "relu6", "clip"
    kind: str = "conv"           # "conv" (nn.Conv2d) or "linear" (nn.Linear, as a 1x1 conv on a 1x1 input)


@dataclass(frozen=True)
class FrontEnd:
    """The result of prepare(): the rewritten module, the plan, and the fused
    convs to compile (name -> module; in the module's order)."""

    module: nn.Module
    plans: List[ConvPlan]
    convs: Dict[str, Union["FusedConv2d", "FusedLinear"]]  # FusedLinear: an nn.Linear's (plan kind "linear")
    traced: bool                 # False: fell back to the per-module swap
    trace_error: str = ""


def linear_gemm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ weight.T + bias, as F.linear, but for a 2-D CUDA x as a plain GEMM
    and a separate bias add: in strict fp32, F.linear's cuBLASLt GEMM with the
    bias in its epilogue took 1.4-4.2x as long on VGG-16's and ResNet-50's
    classifiers at batch 16 and 64 (VGG-16's fc6 at 64: 553 against 299 us;
    bench/dense_linear_probe.py, H100, session 32)."""
    if not x.is_cuda or x.dim() != 2:
        return F.linear(x, weight, bias)
    y = torch.mm(x, weight.t())
    return y if bias is None else y.add_(bias)


# torch dtype -> NumPy dtype, for the zero-copy CuPy views of cupy_view
_VIEW_DTYPES = {torch.float32: np.float32, torch.int32: np.int32, torch.int64: np.int64}
# (GPU, torch's stream handle) -> CuPy's wrapper of it; torch hands out streams from a fixed pool, so it stays small
_CUPY_STREAMS: Dict[Tuple[int, int], Any] = {}


def cupy_view(t: torch.Tensor) -> Any:
    """A CuPy array on a contiguous CUDA tensor's memory (no copy), built from
    its pointer. torch's __dlpack__ and CuPy's from_dlpack cost ~100 us of host
    time a conv call between them (ResNet-50 called eagerly at batch 1: 11.9 ms
    a forward against 0.41 in a CUDA graph; bench/eager_forward.py, session 34),
    mostly a stream handshake, and the kernels launch on torch's stream anyway.
    Other tensors go through DLPack."""
    import cupy

    dtype = _VIEW_DTYPES.get(t.dtype)
    if dtype is None or not t.is_contiguous() or t.numel() == 0:
        return cupy.from_dlpack(t)
    # The device id given: CuPy then skips asking the driver where the pointer lives.
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(memory, 0))


# torch's current stream as its raw handle, without making a torch.cuda.Stream
# (~13 us a call through current_stream; inductor's generated code reads it
# this way too). Private, so the public call stands in where it is missing.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def torch_stream_handle(device: Union[int, torch.device]) -> int:
    """The handle (cudaStream_t as an int) of torch's current stream on `device` (an index or a torch.device)."""
    index = device if isinstance(device, int) else device.index
    if _raw_stream is not None:
        return int(_raw_stream(index))
    return torch.cuda.current_stream(index).cuda_stream


_SAME_DEVICE = contextlib.nullcontext()


def _on_device(index: int) -> Any:
    """cupy.cuda.Device(index), to launch on GPU `index` (a function belongs to
    its GPU's context), where another GPU is current; a context that does
    nothing where `index` is current already: the usual case, and Device's
    exit sets the device again whatever it found."""
    import cupy

    return _SAME_DEVICE if cupy.cuda.runtime.getDevice() == index else cupy.cuda.Device(index)


def on_torch_stream(device: torch.device, what: str) -> Any:
    """CuPy's wrapper of torch's current stream on `device` (one per stream,
    cached), to launch in `with cupy.cuda.Device(i), on_torch_stream(...)`:
    kernels then run in torch's order and are captured by torch's graphs."""
    from . import runtime

    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    wrapper = _CUPY_STREAMS.get(key)
    if wrapper is None:
        wrapper = _CUPY_STREAMS[key] = runtime.as_cupy_stream(stream, device.index, what)
    return wrapper


def act_forward(y: torch.Tensor, activation: str, clip: Optional[Tuple[float, float]]) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(y)
    if activation == "relu6":
        return torch.clamp(y, 0.0, 6.0)
    if activation == "clip":
        assert clip is not None
        return torch.clamp(y, clip[0], clip[1])
    return y


class _KernelNode(nn.Module):
    """What FusedConv2d and FusedLinear share: the weight and bias buffers, the
    activation, the compiled kernel once attached, the per-batch route between
    it and the dense torch path."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
                 clip: Optional[Tuple[float, float]], name: str, fused: Tuple[str, ...]) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {ACTIVATIONS}, got {activation!r}")
        if (activation == "clip") != (clip is not None):
            raise ValueError(f"{name}: clip=(lo, hi) goes with activation='clip' and only with it")
        # Buffers, not parameters: inference only, and .double()/.cuda() still convert them.
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.activation, self.clip = activation, clip
        self.layer_name, self.fused = name, fused
        self.kernel: Any = None      # the sparseconv kernel, attached after compiling
        # The weight-table kernel (sparseconv.table; for a FusedLinear the sparse
        # gemv, gemv.SparseLinearTable), attached where routing timed it, kept
        # where some batch size takes it
        self.table: Any = None
        # (up to batch size, "sparseconv", "table" or "dense"), ascending, the
        # last for any batch: which path runs a CUDA input of that batch (set by
        # sparseconv.torch.sparsify from measurements). Empty: the kernel always.
        self.route: List[Tuple[int, str]] = []
        self.route_choice: Any = None  # routing.RouteChoice: the times behind `route`, where it was measured

    def path(self, batch: int) -> str:
        """"sparseconv", "table" or "dense": the path a CUDA input of this batch size takes."""
        for up_to, path in self.route:
            if batch <= up_to:
                return path
        return "sparseconv"

    def _kernel_repr(self) -> str:
        """extra_repr's tail: the kernel's backend and the route, where set."""
        text = f", backend {self.kernel.backend}" if self.kernel is not None else ""
        if self.route:
            text += ", route " + ", ".join(f"<={u}: {p}" if u < 1 << 62 else f"else {p}" for u, p in self.route)
        return text


class FusedConv2d(_KernelNode):
    """conv (+ folded BN) + bias (+ residual) then an activation (then a 2x2
    max pool of stride 2, `pool`), as one node.

    forward(x, residual=None). With a compiled kernel attached (`.kernel`,
    set by sparseconv.torch.sparsify) and a CUDA input, one sparseconv kernel
    computes it all; otherwise torch does (F.conv2d, add, activation), in the
    input's dtype: the reference path CPU tests compare against."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, stride: Tuple[int, int],
                 padding: Tuple[int, int], dilation: Tuple[int, int], groups: int, activation: str = "none",
                 clip: Optional[Tuple[float, float]] = None, residual: bool = False, pool: bool = False,
                 name: str = "conv", fused: Tuple[str, ...] = ()) -> None:
        super().__init__(weight, bias, activation, clip, name, fused)  # .kernel: a Conv2dKernel
        if pool and residual:
            raise ValueError(f"{name}: a fused conv pools or adds a residual, not both (shapes.Epilogue)")
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.residual, self.pool = residual, pool

    def reference(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The chain in torch, in x's dtype."""
        y = self._before_pool(x, residual)
        return F.max_pool2d(y, 2, 2) if self.pool else y

    def _before_pool(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """conv + bias (+ residual), then the activation, in torch, in x's dtype."""
        b = None if self.bias is None else self.bias.to(x.dtype)
        y = F.conv2d(x, self.weight.to(x.dtype), b, self.stride, self.padding, self.dilation, self.groups)
        if residual is not None:
            y = y + residual
        return act_forward(y, self.activation, self.clip)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.residual != (residual is not None):
            raise TypeError(f"{self.layer_name}: this fused conv {'takes' if self.residual else 'takes no'} "
                            "residual input")
        if self.kernel is None or not x.is_cuda:
            return self.reference(x, residual)
        path = self.path(x.shape[0])
        if path == "dense":
            return self._run_dense(x, residual)
        if path == "table" and self.table is not None:
            return self._run_kernel(x, residual, self.table)
        return self._run_kernel(x, residual, self.kernel)

    def _run_dense(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> torch.Tensor:
        """cuDNN in strict fp32 (TF32 off whatever the global setting), where it
        measured faster than the kernel at this batch size."""
        with torch_flags(torch, tf32=False, cudnn_benchmark=torch.backends.cudnn.benchmark):
            y = self._before_pool(x.detach(), None if residual is None else residual.detach())
        return self._pool_after(y) if self.pool else y  # the pool without indices, as the other paths

    def _pool_after(self, y: torch.Tensor) -> torch.Tensor:
        """The fused pool on y where cuDNN made y (the sparseconv kernels and
        the weight table pool as they store): sparseconv.pool's kernel, on
        torch's stream (capturable), no indices written."""
        y = y.contiguous()
        out = y.new_empty(y.shape[:2] + FUSED_POOL.output_size(y.shape[2], y.shape[3]))
        if out.numel():
            index = y.get_device()
            with _on_device(index):
                max_pool2d_pointers(index, y.data_ptr(), out.data_ptr(), tuple(y.shape), FUSED_POOL,
                                    torch_stream_handle(index))
        return out

    def _run_kernel(self, x: torch.Tensor, residual: Optional[torch.Tensor], kernel: Any) -> torch.Tensor:
        """Through `kernel`: the sparseconv kernel, or the weight table.

        At batch 1 an eager forward waits on this host code, not on the GPU
        (bench/eager_forward.py), so it keeps to what the launch needs: the
        device as an int (x.device makes a torch.device), the output from
        x.new_empty (x's dtype and device, no keyword parsing), no detached
        copies of the tensors (only their pointers are read), and no device
        switch where the input's GPU is current already."""
        import cupy

        s = kernel.shape
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{self.layer_name}: sparseconv kernels are inference-only (no backward); run the "
                               "model under torch.no_grad() or torch.inference_mode()")
        if x.dtype != torch.float32:
            raise TypeError(f"{self.layer_name}: expected a float32 CUDA tensor, got {x.dtype} on {x.device}")
        if x.dim() != 4 or x.shape[1:] != (s.in_channels, s.in_h, s.in_w):
            raise ValueError(f"{self.layer_name}: compiled for inputs (N, {s.in_channels}, {s.in_h}, {s.in_w}), "
                             f"got {tuple(x.shape)}; call sparsify again with an example of this size")
        device = x.get_device()
        if device != kernel.device_id:
            raise ValueError(f"{self.layer_name}: input on {x.device}, kernel loaded on "
                             f"cuda:{kernel.device_id}")
        out_shape = kernel.output_shape(x.shape[0])
        if residual is not None:
            if residual.shape != out_shape or residual.dtype != torch.float32 \
                    or residual.get_device() != device:
                raise ValueError(f"{self.layer_name}: the residual must be a float32 tensor of shape "
                                 f"{tuple(out_shape)} on {x.device}, got {residual.dtype} "
                                 f"{tuple(residual.shape)} on {residual.device}")
            residual = residual.contiguous()
        x = x.contiguous()
        out = x.new_empty(out_shape)  # pooled where the layer pools: every kernel takes its epilogue's pool
        if not x.shape[0]:
            return out
        # On torch's current stream: no sync, no copy, and so capturable in a CUDA graph.
        if kernel.launches_pointers:
            # Checked above: the pointers and stream handle alone, no CuPy views and no second
            # checks (ResNet-50 eagerly at batch 1: ~100 us of host time a conv with them, session 35).
            with _on_device(device):
                kernel.launch_pointers(x.data_ptr(), out.data_ptr(), 0 if residual is None else residual.data_ptr(),
                                       x.shape[0], torch_stream_handle(device))
        else:
            with cupy.cuda.Device(device), on_torch_stream(x.device, self.layer_name):
                kwargs = {} if residual is None else {"residual": cupy_view(residual.detach())}
                kernel(cupy_view(x.detach()), out=cupy_view(out), **kwargs)
        return out

    def extra_repr(self) -> str:
        text = (f"{self.layer_name}: {tuple(self.weight.shape)}, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, groups={self.groups}, fused={'+'.join(self.fused) or 'nothing'}")
        return text + self._kernel_repr()


class FusedLinear(_KernelNode):
    """An nn.Linear (+ a following ReLU / ReLU6 / hardtanh / clamp) as one node:
    y = act(x @ weight.T + bias) for x of shape (N, in_features).

    With a compiled kernel attached (`.kernel`, a sparseconv LinearKernel set
    by sparseconv.torch.sparsify) and a CUDA input, the kernel computes it;
    otherwise torch does (linear_gemm, activation), in the input's dtype: the
    reference path CPU tests compare against. `route` as FusedConv2d's:
    "dense" runs linear_gemm in strict fp32 (cuBLAS, TF32 off)."""

    residual = False  # the epilogue of a Linear layer: bias and activation only

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], *, activation: str = "none",
                 clip: Optional[Tuple[float, float]] = None, name: str = "linear",
                 fused: Tuple[str, ...] = ()) -> None:
        super().__init__(weight, bias, activation, clip, name, fused)  # .kernel: a LinearKernel
        if weight.dim() != 2:
            raise ValueError(f"{name}: weight must be 2-D (out_features, in_features), got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The chain in torch, in x's dtype."""
        b = None if self.bias is None else self.bias.to(x.dtype)
        return act_forward(linear_gemm(x, self.weight.to(x.dtype), b), self.activation, self.clip)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if residual is not None:  # FusedConv2d's signature, so callers can treat both alike
            raise TypeError(f"{self.layer_name}: a fused Linear takes no residual input")
        if self.kernel is None or not x.is_cuda:
            return self.reference(x)
        path = self.path(x.shape[0])
        if path == "dense":
            with torch_flags(torch, tf32=False, cudnn_benchmark=torch.backends.cudnn.benchmark):
                return self.reference(x.detach())
        if path == "table" and self.table is not None and x.shape[0] <= MAX_GEMV_BATCH:
            return self._run_kernel(x, self.table)
        return self._run_kernel(x, self.kernel)

    def _run_kernel(self, x: torch.Tensor, kernel: Any) -> torch.Tensor:
        """Through `kernel`: the sparseconv kernel, or the sparse gemv (gemv.SparseLinearTable)."""
        import cupy

        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{self.layer_name}: sparseconv kernels are inference-only (no backward); run the "
                               "model under torch.no_grad() or torch.inference_mode()")
        if x.dtype != torch.float32:
            raise TypeError(f"{self.layer_name}: expected a float32 CUDA tensor, got {x.dtype} on {x.device}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"{self.layer_name}: compiled for inputs (N, {self.in_features}), got "
                             f"{tuple(x.shape)}")
        if x.device.index != kernel.device_id:
            raise ValueError(f"{self.layer_name}: input on {x.device}, kernel loaded on "
                             f"cuda:{kernel.device_id}")
        x = x.detach().contiguous()
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.float32, device=x.device)
        if x.shape[0]:
            with cupy.cuda.Device(x.device.index), on_torch_stream(x.device, self.layer_name):
                kernel(cupy_view(x), out=cupy_view(out))
        return out

    def extra_repr(self) -> str:
        text = (f"{self.layer_name}: {self.in_features} -> {self.out_features}, "
                f"fused={'+'.join(self.fused) or 'nothing'}")
        return text + self._kernel_repr()


class IndexFreeMaxPool2d(nn.Module):
    """An nn.MaxPool2d whose CUDA float32 inputs run sparseconv.pool's kernel:
    the same maxima, without the int64 indices torch's CUDA pool also writes.
    Other inputs (CPU, other dtypes, unbatched, autograd) run F.max_pool2d.
    (Small planes too: VGG-16's pool5, 7x7 outputs, took torch's pool until
    session 33, when sparseconv.pool's one loop over the tensor took 8.5 us
    at batch 64 against torch's 20.9.)"""

    def __init__(self, pool: nn.MaxPool2d, name: str) -> None:
        super().__init__()
        self.shape = MaxPoolShape.of(pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)
        self.layer_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        ours = x.is_cuda and x.dtype == torch.float32 and x.dim() == 4 \
            and not (x.requires_grad and torch.is_grad_enabled())
        if not ours:
            return F.max_pool2d(x, s.kernel, s.stride, s.padding, s.dilation, s.ceil_mode)
        x = x.contiguous()
        out = x.new_empty(x.shape[:2] + s.output_size(x.shape[2], x.shape[3]))
        if out.numel():  # on torch's stream, zero-copy: capturable in a CUDA graph, like the convs
            index = x.get_device()
            with _on_device(index):  # on raw pointers, as FusedConv2d's kernels
                max_pool2d_pointers(index, x.data_ptr(), out.data_ptr(), tuple(x.shape), s,
                                    torch_stream_handle(index))
        return out

    def extra_repr(self) -> str:
        return f"{self.layer_name}: {self.shape}, no indices"


def swap_max_pools(module: nn.Module) -> List[str]:
    """Replace each nn.MaxPool2d submodule of `module` (a graph module or a
    plain one, changed in place) that does not return indices by an
    IndexFreeMaxPool2d; returns the names replaced."""
    names = [name for name, m in module.named_modules()
             if name and type(m) is nn.MaxPool2d and not m.return_indices]
    swapped = []
    for name in names:
        try:
            pool = IndexFreeMaxPool2d(module.get_submodule(name), name)
        except (TypeError, ValueError):  # a window torch itself refuses: left to torch
            continue
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, pool)
        swapped.append(name)
    return swapped


class SkipIdentityPool(nn.Module):
    """A pool that leaves its input as it is, returned without running:
    an adaptive pool whose output size is its input's (VGG's
    AdaptiveAvgPool2d((7, 7)) after 7x7 features; checked at each call, other
    sizes run the pool) or a 1x1 window at stride 1 without padding (always).
    Each window is then one element, and its mean or max is that element,
    exactly. skip_identity_pools puts it only where no in-place op after it
    can write into its output (then its input), so nothing can tell."""

    def __init__(self, pool: nn.Module, name: str) -> None:
        super().__init__()
        self.pool, self.layer_name = pool, name
        size = getattr(pool, "output_size", None)
        self.output_size = None if size is None else (size, size) if isinstance(size, int) else tuple(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_size is None or x.dim() in (3, 4) and \
                all(o is None or o == n for o, n in zip(self.output_size, x.shape[-2:])):
            return x
        return self.pool(x)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: returns its input where the pool leaves it as it is"


def identity_pool(m: nn.Module) -> bool:
    """Whether m is a 2-D pool that can leave its input as it is (SkipIdentityPool)."""
    if type(m) in (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d):
        return not getattr(m, "return_indices", False)
    if type(m) in (nn.AvgPool2d, nn.MaxPool2d):
        one = all(v in (1, (1, 1), [1, 1]) for v in (m.kernel_size, m.stride))
        unpadded = m.padding in (0, (0, 0), [0, 0])
        return one and unpadded and getattr(m, "divisor_override", None) is None \
            and not getattr(m, "return_indices", False)
    return False


class GemvLinear(nn.Module):
    """A dense nn.Linear (same weight and bias parameters) whose CUDA float32
    calls on (N, in_features) inputs with N <= MAX_GEMV_BATCH run
    sparseconv.gemv's kernel: the weights streamed once, exact fp32 sums in a
    fixed order. Other calls (CPU, other dtypes or ranks, larger batches,
    autograd) run linear_gemm (cuBLAS)."""

    def __init__(self, linear: nn.Linear, name: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        # the kernel always adds a bias: zeros where the layer has none (not saved, moves with .to())
        self.register_buffer("zero_bias", None if linear.bias is not None else
                             torch.zeros(linear.out_features, dtype=linear.weight.dtype,
                                         device=linear.weight.device), persistent=False)
        self.layer_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        bias = self.bias if self.bias is not None else self.zero_bias
        ours = x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_GEMV_BATCH \
            and x.shape[1] == self.in_features and tuple(w.shape) == (self.out_features, self.in_features) \
            and tuple(bias.shape) == (self.out_features,) \
            and w.dtype == bias.dtype == torch.float32 and w.device == bias.device == x.device \
            and w.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        if ours:
            x = x.contiguous()
            ours = gemv_supported(x.shape[0], self.in_features, x.data_ptr(), w.data_ptr())
        if not ours:
            return linear_gemm(x, w, self.bias)
        out = x.new_empty((x.shape[0], self.out_features))
        index = x.get_device()
        bias = bias.contiguous()
        # on torch's stream, zero-copy: capturable in a CUDA graph, like the convs
        with _on_device(index):  # on raw pointers, checked above: dtypes, devices, sizes, alignment
            linear_gemv_pointers(index, x.data_ptr(), w.data_ptr(), bias.data_ptr(), out.data_ptr(), x.shape[0],
                                 self.in_features, self.out_features, torch_stream_handle(index))
        return out

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, sparseconv.gemv at batch <= {MAX_GEMV_BATCH}")


class SparseGemvLinear(nn.Module):
    """A pruned nn.Linear left uncompiled (too large to build as code, or
    linear=False) whose CUDA float32 calls on (N, in_features) inputs with
    N <= MAX_GEMV_BATCH run sparseconv.gemv's sparse kernel: only its nonzero
    weights are read, as (column, value) entries, exact fp32 sums in a fixed
    order. The entries are taken when the module is made, as a compiled
    layer's weights are; other calls (CPU, other dtypes or ranks, larger
    batches, autograd) run linear_gemm (cuBLAS) on the same weight and bias parameters."""

    def __init__(self, linear: nn.Linear, name: str) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        rows = sparse_rows(linear.weight.detach().float().cpu().numpy())
        self.nnz = rows.nnz
        device = linear.weight.device
        # derived from the weight, so not saved; they move with .to(). int32 here, uint32 to the kernel.
        self.register_buffer("entries", torch.from_numpy(rows.entries.view(np.int32)).to(device), persistent=False)
        self.register_buffer("row_start", torch.from_numpy(rows.row_start).to(device), persistent=False)
        self.register_buffer("zero_bias", None if linear.bias is not None else
                             torch.zeros(linear.out_features, dtype=torch.float32, device=device), persistent=False)
        self.layer_name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.bias is not None else self.zero_bias
        ours = x.is_cuda and x.dtype == torch.float32 and x.dim() == 2 and 1 <= x.shape[0] <= MAX_GEMV_BATCH \
            and x.shape[1] == self.in_features and bias.dtype == torch.float32 \
            and self.entries.device == bias.device == x.device \
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        if not ours:
            return linear_gemm(x, self.weight, self.bias)
        import cupy

        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        index = x.device.index
        with cupy.cuda.Device(index), on_torch_stream(x.device, self.layer_name):
            linear_sparse_gemv(index, cupy_view(x), cupy_view(self.entries).view(cupy.uint32),
                               cupy_view(self.row_start), cupy_view(bias.detach().contiguous()), cupy_view(out))
        return out

    def extra_repr(self) -> str:
        return (f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {self.nnz:,} nonzero weights, "
                f"sparseconv's sparse gemv at batch <= {MAX_GEMV_BATCH}")


# Modules and functions whose output is a new tensor, never a view of an
# input: where skip_identity_pools stops following what a pool's output may
# alias. Anything else (flatten, view, getitem, dropout, ...) may return its
# input or a view of it, and is followed.
_FRESH_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.cat, F.linear,
                    F.conv2d, torch.relu, F.relu, torch.sigmoid, torch.tanh)
# (an activation module with inplace=True is found by _mutates before it is asked)
_FRESH_MODULES = (nn.Conv2d, nn.Linear, nn.BatchNorm2d, nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Sigmoid)


def _fresh(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        m = modules.get(str(node.target))
        return isinstance(m, _FRESH_MODULES + (_KernelNode, IndexFreeMaxPool2d, GemvLinear, SparseGemvLinear))
    return node.op == "call_function" and node.target in _FRESH_FUNCTIONS


def _mutated_downstream(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether an in-place op may write into node's value or a view of it:
    any user that mutates, following users that may alias their input."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if _mutates(user, modules):
                return True
            if not _fresh(user, modules):
                todo.append(user)
    return False


def skip_identity_pools(gm: fx.GraphModule) -> List[str]:
    """Replace, in place, each pool module of the traced `gm` that can leave
    its input as it is (identity_pool) by a SkipIdentityPool, where no
    in-place op downstream can write into its output (which is then its
    input) and that input is not the graph's own, at every call of the
    module; returns the names."""
    modules = dict(gm.named_modules())
    calls: Dict[str, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and identity_pool(modules[node.target]):
            calls.setdefault(node.target, []).append(node)

    def safe(node: fx.Node) -> bool:
        source = node.args[0] if len(node.args) == 1 and not node.kwargs else None
        return isinstance(source, fx.Node) and source.op != "placeholder" and not _mutated_downstream(node, modules)

    skipped = []
    for name, nodes in calls.items():
        if all(safe(n) for n in nodes):  # a module called twice is one module: every call must qualify
            parent, _, attr = name.rpartition(".")
            setattr(gm.get_submodule(parent) if parent else gm, attr, SkipIdentityPool(modules[name], name))
            skipped.append(name)
    return skipped


def swap_dense_linears(module: nn.Module) -> List[str]:
    """Replace each plain nn.Linear submodule of `module` (changed in place;
    compiled ones are FusedLinear by now) that sparseconv.gemv takes: by a
    SparseGemvLinear where it is pruned (gemv.sparse_gemv_takes: at least
    MIN_GEMV_FEATURES outputs and MIN_SPARSE_GEMV_SPARSITY zeros), else by a
    GemvLinear (gemv_takes: at least MIN_GEMV_FEATURES outputs, a multiple
    of 4 inputs). Returns the names."""
    names = []
    for name, m in list(module.named_modules()):
        if not name or type(m) is not nn.Linear:
            continue
        if sparse_gemv_takes(m.out_features, sparsity_of(m.weight.detach())):
            swapped: nn.Module = SparseGemvLinear(m, name)
        elif gemv_takes(m.out_features, m.in_features):
            swapped = GemvLinear(m, name)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, attr, swapped)
        names.append(name)
    return names


# -- eligibility ---------------------------------------------------------------------------------------------------

def conv_padding(conv: nn.Conv2d) -> Tuple[Optional[Tuple[int, int]], str]:
    """Symmetric (pad_h, pad_w), or None and why not."""
    if conv.padding_mode != "zeros":
        return None, f"padding_mode={conv.padding_mode!r} (only 'zeros' compiles)"
    if conv.padding == "valid":
        return (0, 0), ""
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size)]
        if any(t % 2 for t in total):
            return None, "padding='same' needs asymmetric padding for this kernel size"
        return (total[0] // 2, total[1] // 2), ""
    return (int(conv.padding[0]), int(conv.padding[1])), ""


def sparsity_of(w: torch.Tensor) -> float:
    return float((w == 0).sum()) / max(1, w.numel())


def check_conv(conv: nn.Conv2d, sizes: Set[Any], min_sparsity: float,
               dtypes: Sequence[torch.dtype]) -> Tuple[Optional[ConvShape], str]:
    """The ConvShape this conv compiles to, or None and why it stays as it is.
    `sizes`: the (H, W) input sizes it was called with (None: not a 4-D tensor)."""
    w = conv.weight.detach()
    padding, why = conv_padding(conv)
    if not sizes:
        why = "not called by the forward pass on example_input"
    elif len(sizes) != 1 or None in sizes:
        why = f"called with several input sizes {sorted(map(str, sizes))}"
    elif w.dtype not in dtypes:
        why = f"weight dtype {w.dtype} (only {', '.join(str(d) for d in dtypes)} compiles)"
    elif sparsity_of(w) < min_sparsity:
        why = f"sparsity {sparsity_of(w):.3f} < min_sparsity {min_sparsity}"
    if why:
        return None, why
    (hw,) = sizes
    assert padding is not None
    try:
        return shape_from_weight(w.cpu().numpy(), hw, tuple(conv.stride), padding, tuple(conv.dilation),
                                 conv.groups), ""
    except ValueError as exc:
        return None, str(exc)


@dataclass(frozen=True)
class LinearOptions:
    """Which nn.Linear modules the front end compiles: none (enabled=False), or
    those with sparsity >= max(min_sparsity, LINEAR_MIN_SPARSITY), at most
    max_weights weights (None: no bound but the build limits), called on 2-D
    inputs."""

    enabled: bool = True
    max_weights: Optional[int] = MAX_LINEAR_WEIGHTS


def linear_candidate(linear: nn.Linear, min_sparsity: float, options: LinearOptions) -> bool:
    """Whether an nn.Linear is sparse enough to be considered (and listed in the plan)."""
    return options.enabled and sparsity_of(linear.weight.detach()) >= max(min_sparsity, LINEAR_MIN_SPARSITY)


def check_linear(linear: nn.Linear, ndims: Set[Any], dtypes: Sequence[torch.dtype],
                 options: LinearOptions) -> Tuple[Optional[ConvShape], str]:
    """The shape (api.linear_shape) a candidate nn.Linear compiles to, or None
    and why it stays as it is. `ndims`: the ranks of the inputs it was called
    with (None: not a tensor)."""
    w = linear.weight.detach()
    if not ndims:
        return None, "not called by the forward pass on example_input"
    if ndims != {2}:
        shown = ", ".join(f"{d}-D" if d is not None else "non-tensor" for d in sorted(ndims, key=str))
        return None, f"called on {shown} inputs (only 2-D (N, in_features) compiles)"
    if w.dtype not in dtypes:
        return None, f"weight dtype {w.dtype} (only {', '.join(str(d) for d in dtypes)} compiles)"
    if options.max_weights is not None and w.numel() > options.max_weights:
        return None, (f"{w.numel():,} weights > max_linear_weights {options.max_weights:,} (its build would take "
                      "minutes; pass max_linear_weights=None to compile it anyway)")
    shape = linear_shape(linear.in_features, linear.out_features)
    why = linear_limits(shape)
    return (None, why) if why else (shape, "")


def plan(model: nn.Module, example_input: torch.Tensor, min_sparsity: float = 0.0,
         dtypes: Sequence[torch.dtype] = (torch.float32,), linear: LinearOptions = LinearOptions(enabled=False)
         ) -> List[ConvPlan]:
    """Run `model` once on `example_input` (no grad) to learn each conv's input
    size, and decide per nn.Conv2d (and candidate nn.Linear, with `linear`
    enabled) whether it compiles (no fusion: the per-module view). Works on
    any device."""
    sizes: Dict[nn.Module, set] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: sizes.setdefault(mod, set()).add(
        tuple(args[0].shape[2:]) if args and isinstance(args[0], torch.Tensor) and args[0].dim() == 4 else None))
        for m in model.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_pre_hook(lambda mod, args: sizes.setdefault(mod, set()).add(
        args[0].dim() if args and isinstance(args[0], torch.Tensor) else None))
        for m in model.modules() if isinstance(m, nn.Linear) and linear_candidate(m, min_sparsity, linear)]
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for h in hooks:
            h.remove()
    plans, seen = [], set()
    for name, conv in model.named_modules():
        if isinstance(conv, nn.Linear) and id(conv) not in seen and linear_candidate(conv, min_sparsity, linear):
            seen.add(id(conv))
            shape, why = check_linear(conv, sizes.get(conv, set()), dtypes, linear)
            plans.append(ConvPlan(name or "linear", "kept" if why else "sparseconv", why,
                                  sparsity_of(conv.weight.detach()), shape, kind="linear"))
            continue
        if not isinstance(conv, nn.Conv2d) or id(conv) in seen:
            continue
        seen.add(id(conv))
        shape, why = check_conv(conv, sizes.get(conv, set()), min_sparsity, dtypes)
        plans.append(ConvPlan(name or "conv", "kept" if why else "sparseconv", why,
                              sparsity_of(conv.weight.detach()), shape))
    return plans


def unfused(conv: nn.Conv2d, shape: ConvShape, name: str) -> FusedConv2d:
    return FusedConv2d(conv.weight, conv.bias, stride=shape.stride, padding=shape.padding,
                       dilation=shape.dilation, groups=shape.groups, name=name)


def swap_modules(model: nn.Module, plans: List[ConvPlan]) -> Dict[str, Union[FusedConv2d, FusedLinear]]:
    """The per-module path: replace each planned conv by an unfused FusedConv2d
    (each planned Linear by a FusedLinear) in every parent that holds it;
    returns name -> module."""
    convs = {name or ("linear" if isinstance(m, nn.Linear) else "conv"): m for name, m in model.named_modules()}
    chosen = {id(convs[p.name]): FusedLinear(convs[p.name].weight, convs[p.name].bias, name=p.name)
              if p.kind == "linear" else unfused(convs[p.name], p.shape, p.name)
              for p in plans if p.action == "sparseconv" and p.shape is not None}
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if id(child) in chosen:
                setattr(parent, child_name, chosen[id(child)])
    return {m.layer_name: m for m in chosen.values()}


# -- the graph passes -------------------------------------------------------------------------------------------------

def fold_batchnorm(weight: torch.Tensor, bias: Optional[torch.Tensor],
                   bn: nn.BatchNorm2d) -> Tuple[torch.Tensor, torch.Tensor]:
    """Conv weight/bias with an eval-mode BatchNorm2d after it folded in:
    w' = w * gamma / sqrt(var + eps) per output channel, b' = (b - mean) * scale + beta.
    Computed in float64 (dense.fold_batchnorm, the ONNX front end's too),
    returned in the weight's dtype and device; a zero weight stays zero."""
    def host(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
        return None if t is None else t.detach().cpu().double().numpy()

    var = host(bn.running_var)
    gamma = host(bn.weight) if bn.weight is not None else np.ones_like(var)
    beta = host(bn.bias) if bn.bias is not None else np.zeros_like(var)
    w, b = fold_arrays(host(weight), host(bias), gamma, beta, host(bn.running_mean), var, bn.eps)
    return (torch.from_numpy(w).to(weight.device, weight.dtype),
            torch.from_numpy(b).to(weight.device, weight.dtype))


def _activation(node: fx.Node, modules: Dict[str, nn.Module]) -> Optional[Tuple[str, Optional[Tuple[float, float]]]]:
    """(activation, clip) when `node` applies ReLU / ReLU6 / hardtanh / clamp to
    its first argument alone (module, function or method, in-place or not)."""
    def bounds(lo: Any, hi: Any) -> Optional[Tuple[str, Optional[Tuple[float, float]]]]:
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in (lo, hi)):
            return None                      # a tensor bound: not an epilogue
        if lo is None and hi is None:
            return None
        # one bound only (an ONNX Clip with min or max alone) clamps at an infinite other end, as onnx_fuse does
        lo, hi = -math.inf if lo is None else float(lo), math.inf if hi is None else float(hi)
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            return None
        if (lo, hi) == (0.0, math.inf):
            return "relu", None
        return ("relu6", None) if (lo, hi) == (0.0, 6.0) else ("clip", (lo, hi))

    if node.op == "call_module":
        m = modules.get(str(node.target))
        if type(m) is nn.ReLU:
            return "relu", None
        if type(m) is nn.ReLU6:
            return "relu6", None
        if type(m) is nn.Hardtanh:
            return bounds(m.min_val, m.max_val)
        return None
    args, kw = list(node.args[1:]), dict(node.kwargs)
    kw.pop("inplace", None)
    if node.op == "call_function":
        t = node.target
        if t in (F.relu, torch.relu, torch.relu_, F.relu_) and not args and not kw:
            return "relu", None
        if t is F.relu6 and not args and not kw:
            return "relu6", None
        if t in (F.hardtanh, F.hardtanh_):
            vals = args + [None] * 2
            lo = kw.pop("min_val", vals[0] if args else -1.0)
            hi = kw.pop("max_val", vals[1] if len(args) > 1 else 1.0)
            return bounds(lo, hi) if not kw else None
        if t in (torch.clamp, torch.clip, torch.clamp_, torch.clip_):
            vals = args + [None] * 2
            lo, hi = kw.pop("min", vals[0]), kw.pop("max", vals[1])
            return bounds(lo, hi) if not kw else None
        return None
    if node.op == "call_method":
        if node.target in ("relu", "relu_") and not args and not kw:
            return "relu", None
        if node.target in ("clamp", "clamp_", "clip", "clip_"):
            vals = args + [None] * 2
            lo, hi = kw.pop("min", vals[0]), kw.pop("max", vals[1])
            return bounds(lo, hi) if not kw else None
    return None


_ADDS = (operator.add, operator.iadd, torch.add)


def _residual_operand(node: fx.Node, value: fx.Node) -> Optional[fx.Node]:
    """The other tensor when `node` is value + other (operator.add/iadd,
    torch.add, Tensor.add/add_ without alpha), else None."""
    if node.op == "call_function" and node.target in _ADDS \
            or node.op == "call_method" and node.target in ("add", "add_"):
        if node.kwargs or len(node.args) != 2:
            return None                      # alpha=, out=: not a plain add
        a, b = node.args
        if (node.target in ("add_", operator.iadd)) and a is not value:
            return None                      # other.add_(value) writes into other: its other users would see it
        other = b if a is value else a if b is value else None
        if isinstance(other, fx.Node) and other is not value:
            return other
    return None


def _meta(node: Any) -> Any:
    return node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None


def _mutates(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether a node may write into one of its inputs (an in-place op)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method" and str(node.target).endswith("_"):
        return True
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.startswith("_") or node.target in (operator.iadd, operator.imul,
                                                                                   operator.isub, operator.itruediv)
    if node.op == "call_module":
        return bool(getattr(modules.get(str(node.target)), "inplace", False))
    return False


def _chain(conv_node: fx.Node, modules: Dict[str, nn.Module], fuse: bool,
           fuse_pools: bool = True) -> Tuple[List[fx.Node], Dict[str, Any]]:
    """The nodes after conv_node that fuse into it (each the only user of the
    one before), and what they are: {"bn", "residual", "activation", "clip",
    "pool" (only with fuse_pools)}."""
    found: Dict[str, Any] = {}
    chain: List[fx.Node] = []
    cur = conv_node
    if not fuse:
        return chain, found

    def only_user(n: fx.Node) -> Optional[fx.Node]:
        users = list(n.users)
        return users[0] if len(users) == 1 else None

    nxt = only_user(cur)
    if nxt is not None and nxt.op == "call_module" and isinstance(modules.get(str(nxt.target)), nn.BatchNorm2d):
        bn = modules[str(nxt.target)]
        if not bn.training and bn.running_mean is not None and nxt.args == (cur,) and not nxt.kwargs:
            found["bn"] = bn
            chain.append(nxt)
            cur = nxt
            nxt = only_user(cur)
    if nxt is not None:
        other = _residual_operand(nxt, cur)
        m_cur, m_other = _meta(cur), _meta(other)
        # Only a same-shape add is a residual: a broadcast add (a bias map, a scalar tensor) is not.
        if other is not None and m_cur is not None and m_other is not None and \
                tuple(m_other.shape) == tuple(m_cur.shape) and m_other.dtype == m_cur.dtype:
            found["residual"] = other
            chain.append(nxt)
            cur = nxt
            nxt = only_user(cur)
    if nxt is not None and nxt.args and nxt.args[0] is cur:
        act = _activation(nxt, modules)
        if act is not None:
            found["activation"], found["clip"] = act
            chain.append(nxt)
            cur = nxt
            nxt = only_user(cur)
    # A pool after a residual add is left alone (shapes.Epilogue takes one or the other).
    if fuse_pools and nxt is not None and "residual" not in found and _fused_pool(nxt, cur, modules):
        found["pool"] = True
        chain.append(nxt)
    return chain, found


# F.max_pool2d's parameters in order, for a call_function node's positional arguments
_MAX_POOL_PARAMS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")


def _fused_pool(node: fx.Node, value: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether `node` is a max pool of `value` that the conv's epilogue takes:
    an nn.MaxPool2d or F.max_pool2d of window 2 and stride 2, no padding or
    dilation, no indices, on a 4-D input (ceil_mode only where both sides are
    even, so that it pools as floor mode does)."""
    if node.op == "call_module" and type(modules.get(str(node.target))) is nn.MaxPool2d:
        m = modules[str(node.target)]
        if node.args != (value,) or node.kwargs:
            return False
        params = dict(kernel_size=m.kernel_size, stride=m.stride, padding=m.padding, dilation=m.dilation,
                      ceil_mode=m.ceil_mode, return_indices=m.return_indices)
    elif node.op == "call_function" and node.target in (F.max_pool2d, torch.max_pool2d):
        params = dict(zip(_MAX_POOL_PARAMS, node.args), **node.kwargs)
        if params.pop("input", None) is not value or not set(params) <= set(_MAX_POOL_PARAMS):
            return False
    else:
        return False
    try:
        window = MaxPoolShape.of(params.get("kernel_size"), params.get("stride"), params.get("padding", 0),
                                 params.get("dilation", 1), bool(params.get("ceil_mode", False)))
    except (TypeError, ValueError):
        return False
    meta = _meta(value)
    if params.get("return_indices") or meta is None or len(meta.shape) != 4:
        return False
    even = meta.shape[2] % 2 == 0 and meta.shape[3] % 2 == 0
    return window == replace(FUSED_POOL, ceil_mode=window.ceil_mode) and (even or not window.ceil_mode)


def _between(first: fx.Node, last: fx.Node) -> List[fx.Node]:
    """The nodes strictly between first and last in graph order."""
    out, n = [], first.next
    while n is not last and n.op != "root":
        out.append(n)
        n = n.next
    return out


def _shape_prop(gm: fx.GraphModule, example_input: torch.Tensor) -> None:
    from torch.fx.passes.shape_prop import ShapeProp

    with torch.no_grad():
        ShapeProp(gm).propagate(example_input)


def prepare(model: nn.Module, example_input: torch.Tensor, *, min_sparsity: float = 0.0, fuse: bool = True,
            dtypes: Sequence[torch.dtype] = (torch.float32,),
            linear: LinearOptions = LinearOptions(enabled=False), fuse_pools: bool = True) -> FrontEnd:
    """Trace `model` (left unchanged), fold BN and fuse epilogues into
    FusedConv2d nodes for every eligible conv; fall back to the per-module swap
    on a deep copy when torch.fx cannot trace it. Runs the model once on
    example_input (any device) to learn the shapes. `dtypes`: the weight dtypes
    that count as compilable (float32 for the GPU kernels; tests also use
    float64 to check the passes to 1e-10). `linear` (enabled by
    sparseconv.torch.sparsify): also turn eligible nn.Linear modules, with a
    following activation, into FusedLinear nodes (LinearOptions).
    fuse_pools (with fuse): also fuse a following 2x2 max pool of stride 2
    (sparsify's pools=False leaves every pool to torch)."""
    import copy

    # One forward first: it also turns torch.nn.utils.prune's computed `weight`
    # into a plain tensor, which deepcopy and tracing need.
    with torch.no_grad():
        model(example_input)
    model = copy.deepcopy(model)
    try:
        if isinstance(model, nn.Conv2d):
            raise TypeError("the model is a single nn.Conv2d")  # traced, it would be F.conv2d: nothing to swap
        if isinstance(model, nn.Linear) and linear.enabled:
            raise TypeError("the model is a single nn.Linear")
        gm = fx.symbolic_trace(model)
        _shape_prop(gm, example_input)
    except Exception as exc:  # noqa: BLE001 -- any tracing failure means: per-module path
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        plans = plan(model, example_input, min_sparsity, dtypes, linear)
        single = isinstance(model, nn.Conv2d) or isinstance(model, nn.Linear) and linear.enabled
        kind = "Linear" if isinstance(model, nn.Linear) else "Conv2d"
        note = (f"the model is one nn.{kind}: swapped whole" if single else
                f"not traceable by torch.fx ({error}): per-module swap, nothing fused")
        convs = swap_modules(model, plans)
        if single and convs:
            model = next(iter(convs.values()))
        plans = [p if p.action == "kept" else ConvPlan(p.name, p.action, note, p.sparsity, p.shape, kind=p.kind)
                 for p in plans]
        return FrontEnd(model, plans, convs, False, error)
    return _rewrite(model, gm, min_sparsity, fuse, dtypes, linear, fuse_pools)


def _rewrite(model: nn.Module, gm: fx.GraphModule, min_sparsity: float, fuse: bool,
             dtypes: Sequence[torch.dtype], linear: LinearOptions = LinearOptions(enabled=False),
             fuse_pools: bool = True) -> FrontEnd:
    modules = dict(gm.named_modules())
    graph = gm.graph
    calls: Dict[str, List[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(modules.get(str(node.target)), nn.Conv2d):
            calls.setdefault(str(node.target), []).append(node)
    checked: Dict[str, Tuple[Optional[ConvShape], str]] = {}
    for name, nodes in calls.items():
        metas = [_meta(n.args[0]) if n.args else None for n in nodes]
        sizes = {tuple(m.shape[2:]) if m is not None and len(m.shape) == 4 else None for m in metas}
        checked[name] = check_conv(modules[name], sizes, min_sparsity, dtypes)

    convs: Dict[str, FusedConv2d] = {}
    fused_of: Dict[str, Tuple[str, ...]] = {}
    for node in list(graph.nodes):
        name = str(node.target)
        if node.op != "call_module" or name not in checked or checked[name][0] is None or name in convs:
            continue
        shape = checked[name][0]
        conv = modules[name]
        single = len(calls[name]) == 1 and len(node.args) == 1 and not node.kwargs
        chain, found = _chain(node, modules, fuse and single, fuse_pools)
        # The fused node runs where the chain ends: nothing in between may write
        # into the conv's input or the residual in place.
        if chain and any(_mutates(n, modules) for n in _between(node, chain[-1]) if n not in chain):
            chain, found = [], {}
        w, b = conv.weight.detach(), None if conv.bias is None else conv.bias.detach()
        what: List[str] = []
        if "bn" in found:
            w, b = fold_batchnorm(w, b, found["bn"])
            what.append("bn")
        if "residual" in found:
            what.append("add")
        act = found.get("activation", "none")
        if act != "none":
            what.append(act)
        if "pool" in found:
            what.append("maxpool")
        fused = FusedConv2d(w, b, stride=shape.stride, padding=shape.padding, dilation=shape.dilation,
                            groups=shape.groups, activation=act, clip=found.get("clip"),
                            residual="residual" in found, pool="pool" in found, name=name, fused=tuple(what))
        gm.add_submodule(name, fused)  # replaces the conv: every call of it now runs the FusedConv2d
        convs[name], fused_of[name] = fused, tuple(what)
        if chain:
            last = chain[-1]
            with graph.inserting_before(last):
                args = (node.args[0],) + ((found["residual"],) if "residual" in found else ())
                new = graph.call_module(name, args)
            new.meta = dict(last.meta)
            last.replace_all_uses_with(new)
            for n in reversed(chain):
                graph.erase_node(n)
            graph.erase_node(node)
    linears = _rewrite_linears(gm, modules, min_sparsity, fuse, dtypes, linear)
    graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()

    plans: List[ConvPlan] = []
    for name, conv in model.named_modules():  # the model's: the graph module holds only what it calls
        if name in linears:
            plans.append(linears[name])
            continue
        if isinstance(conv, nn.Linear) and linear_candidate(conv, min_sparsity, linear):
            plans.append(ConvPlan(name, "kept", "not called by the forward pass on example_input",
                                  sparsity_of(conv.weight.detach()), None, kind="linear"))
            continue
        if not isinstance(conv, nn.Conv2d):
            continue
        shape, why = checked.get(name, (None, "not called by the forward pass on example_input"))
        if name in convs and len(calls[name]) > 1:
            why = f"called {len(calls[name])} times: compiled once, nothing fused"
        plans.append(ConvPlan(name, "sparseconv" if name in convs else "kept", why,
                              sparsity_of(conv.weight.detach()), shape, fused_of.get(name, ())))
    for name, p in linears.items():
        if p.action == "sparseconv":
            convs[name] = gm.get_submodule(name)
    return FrontEnd(gm, plans, convs, True)


def _rewrite_linears(gm: fx.GraphModule, modules: Dict[str, nn.Module], min_sparsity: float, fuse: bool,
                     dtypes: Sequence[torch.dtype], options: LinearOptions) -> Dict[str, ConvPlan]:
    """Replace each eligible nn.Linear of the graph (called once, on 2-D
    inputs) and a following activation by a FusedLinear node; name -> its
    plan, for every candidate Linear (linear_candidate) of the graph."""
    if not options.enabled:
        return {}
    graph = gm.graph
    calls: Dict[str, List[fx.Node]] = {}
    for node in graph.nodes:
        m = modules.get(str(node.target)) if node.op == "call_module" else None
        if isinstance(m, nn.Linear) and linear_candidate(m, min_sparsity, options):
            calls.setdefault(str(node.target), []).append(node)
    plans: Dict[str, ConvPlan] = {}
    for name, nodes in calls.items():
        lin = modules[name]
        metas = [_meta(n.args[0]) if n.args else None for n in nodes]
        shape, why = check_linear(lin, {len(m.shape) if m is not None else None for m in metas}, dtypes, options)
        if shape is not None and len(nodes) > 1:
            shape, why = None, f"called {len(nodes)} times (a Linear compiles when called once)"
        elif shape is not None and (len(nodes[0].args) != 1 or nodes[0].kwargs):
            shape, why = None, "called with keyword or extra arguments (only fc(x) compiles)"
        sparsity = sparsity_of(lin.weight.detach())
        if shape is None:
            plans[name] = ConvPlan(name, "kept", why, sparsity, None, kind="linear")
            continue
        (node,) = nodes
        act: Optional[Tuple[str, Optional[Tuple[float, float]]]] = None
        users = list(node.users)
        nxt = users[0] if len(users) == 1 else None
        if fuse and nxt is not None and nxt.args and nxt.args[0] is node:
            act = _activation(nxt, modules)
            if act is not None and any(_mutates(n, modules) for n in _between(node, nxt)):
                act = None  # the fused node runs where the activation was: nothing between may write its input
        activation, clip = act if act is not None else ("none", None)
        fused = FusedLinear(lin.weight, lin.bias, activation=activation, clip=clip, name=name,
                            fused=(activation,) if act is not None else ())
        gm.add_submodule(name, fused)
        if act is not None:
            with graph.inserting_before(nxt):
                new = graph.call_module(name, (node.args[0],))
            new.meta = dict(nxt.meta)
            nxt.replace_all_uses_with(new)
            graph.erase_node(nxt)
            graph.erase_node(node)
        plans[name] = ConvPlan(name, "sparseconv", "", sparsity, shape, fused.fused, kind="linear")
    return plans
