"""PyTorch drop-in: swap a model's pruned nn.Conv2d layers for sparseconv kernels.

    import sparseconv.torch
    fast = sparseconv.torch.sparsify(model.cuda().eval(), example_input.cuda())
    with torch.no_grad():
        y = fast(x)

Each eligible nn.Conv2d becomes a SparseConv2d that calls the compiled kernel
on the tensor's memory (DLPack, zero copy) on torch's current stream. The input
size of every conv is taken from one forward pass on `example_input`; a
SparseConv2d accepts any batch size but only that image size. Inference only:
the kernels have no backward, so an input that requires grad is refused.
`fast.sparseconv_plan` says which path each conv took and why.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import nn

from .runtime import Conv2dKernel, as_cupy_stream
from .shapes import ConvShape, shape_from_weight
from .tune import DENSE, SPARSE_EVENTS


@dataclass(frozen=True)
class ConvPlan:
    """What sparsify does with one nn.Conv2d: compile it, or keep it and why."""

    name: str
    action: str                  # "sparseconv", "dense" (backend="auto" measured cuDNN faster) or "kept"
    reason: str                  # why it was kept ("" when compiled)
    sparsity: float
    shape: Optional[ConvShape]   # None when the conv cannot be compiled


def _padding(conv: nn.Conv2d) -> Tuple[Optional[Tuple[int, int]], str]:
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


def plan(model: nn.Module, example_input: torch.Tensor, min_sparsity: float = 0.0) -> List[ConvPlan]:
    """Run `model` once on `example_input` (no grad) to learn each conv's input
    size, and decide per nn.Conv2d whether it compiles. Works on any device."""
    sizes: Dict[nn.Module, set] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: sizes.setdefault(mod, set()).add(
        tuple(args[0].shape[2:]) if args and isinstance(args[0], torch.Tensor) else None))
        for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for h in hooks:
            h.remove()
    plans, seen = [], set()
    for name, conv in model.named_modules():
        if not isinstance(conv, nn.Conv2d) or id(conv) in seen:
            continue
        seen.add(id(conv))
        w = conv.weight.detach()
        sparsity = float((w == 0).sum()) / w.numel()
        padding, why = _padding(conv)
        if conv not in sizes:
            why = "not called by the forward pass on example_input"
        elif len(sizes[conv]) != 1 or None in sizes[conv]:
            why = f"called with several input sizes {sorted(map(str, sizes[conv]))}"
        elif w.dtype != torch.float32:
            why = f"weight dtype {w.dtype} (only float32 compiles)"
        elif sparsity < min_sparsity:
            why = f"sparsity {sparsity:.3f} < min_sparsity {min_sparsity}"
        shape = None
        if not why:
            (hw,) = sizes[conv]
            try:
                shape = shape_from_weight(w, hw, tuple(conv.stride), padding, tuple(conv.dilation), conv.groups)
            except ValueError as exc:
                why = str(exc)
        plans.append(ConvPlan(name or "conv", "kept" if why else "sparseconv", why, sparsity, shape))
    return plans


class SparseConv2d(nn.Module):
    """An nn.Conv2d replaced by its weight-specialised kernel (inference only)."""

    def __init__(self, kernel: Conv2dKernel, name: str) -> None:
        super().__init__()
        self.kernel = kernel
        self.layer_name = name
        self._streams: Dict[int, Any] = {}

    def _cupy_stream(self, device: torch.device) -> Any:
        stream = torch.cuda.current_stream(device)
        if stream.cuda_stream not in self._streams:  # cached: one wrapper per torch stream
            self._streams[stream.cuda_stream] = as_cupy_stream(stream, device.index, self.layer_name)
        return self._streams[stream.cuda_stream]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import cupy

        s = self.kernel.shape
        if x.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"{self.layer_name}: sparseconv kernels are inference-only (no backward); run the "
                               "model under torch.no_grad() or torch.inference_mode()")
        if not x.is_cuda or x.dtype != torch.float32:
            raise TypeError(f"{self.layer_name}: expected a float32 CUDA tensor, got {x.dtype} on {x.device}")
        if x.dim() != 4 or tuple(x.shape[1:]) != (s.in_channels, s.in_h, s.in_w):
            raise ValueError(f"{self.layer_name}: compiled for inputs (N, {s.in_channels}, {s.in_h}, {s.in_w}), "
                             f"got {tuple(x.shape)}; call sparsify again with an example of this size")
        if x.device.index != self.kernel.device_id:
            raise ValueError(f"{self.layer_name}: input on {x.device}, kernel loaded on cuda:{self.kernel.device_id}")
        x = x.contiguous()
        out = torch.empty(self.kernel.output_shape(x.shape[0]), dtype=torch.float32, device=x.device)
        if x.shape[0]:
            # Zero-copy views, launched on torch's current stream: no sync, no copy.
            with cupy.cuda.Device(x.device.index), self._cupy_stream(x.device):
                self.kernel(cupy.from_dlpack(x.detach()), out=cupy.from_dlpack(out))
        return out

    def extra_repr(self) -> str:
        st = self.kernel.stats
        return (f"{self.layer_name}: {self.kernel.shape.describe()}, {st['nonzero_weights']}/{st['weights']} "
                f"nonzero weights, tiling {st['tiling']}, backend {self.kernel.backend}")


def sparsify(model: nn.Module, example_input: torch.Tensor, *, min_sparsity: float = 0.0,
             tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
             cache_dir: Optional[str] = None, jobs: Optional[int] = None, progress: bool = False,
             inplace: bool = False) -> nn.Module:
    """Return `model` with each eligible nn.Conv2d replaced by a SparseConv2d.

    model and example_input must be on one CUDA device. Convs that are not
    float32, use a non-zero padding_mode, see several input sizes, or are less
    sparse than `min_sparsity` stay as they are. The layers compile in parallel
    (`jobs` processes) and are cached in `cache_dir`. tiling="auto" times
    candidate tilings per layer; backend="auto" also times cuDNN strict fp32
    and runs the layer through it where it was faster. A deep copy is changed
    unless inplace=True. The result's `sparseconv_plan` lists every conv's path
    ("sparseconv", "dense" or "kept") and why."""
    import cupy

    from .api import compile_layers

    if not 0.0 <= min_sparsity <= 1.0:
        raise ValueError(f"sparsify: min_sparsity must be in [0, 1], got {min_sparsity}")
    if not isinstance(example_input, torch.Tensor) or not example_input.is_cuda:
        raise ValueError("sparsify: example_input must be a CUDA tensor (the model runs on the GPU); "
                         "move the model and the example with .cuda()")
    device = example_input.device
    if any(p.device != device for p in model.parameters()):
        raise ValueError(f"sparsify: every parameter of the model must be on {device}, like example_input")
    # plan() first: its no-grad forward also turns torch.nn.utils.prune's
    # computed `weight` into a graph leaf, which deepcopy needs.
    plans = plan(model, example_input, min_sparsity)
    model = model if inplace else copy.deepcopy(model)
    convs = {name or "conv": m for name, m in model.named_modules()}
    chosen = [p for p in plans if p.action == "sparseconv"]

    def host(t: Optional[torch.Tensor]) -> Optional[np.ndarray]:
        return None if t is None else t.detach().cpu().numpy().astype(np.float32)

    with cupy.cuda.Device(device.index):
        kernels = compile_layers([(p.name, host(convs[p.name].weight), host(convs[p.name].bias), p.shape)
                                  for p in chosen], tiling=tiling, backend=backend, tune_batch=tune_batch,
                                 cache_dir=cache_dir, jobs=jobs, progress=progress)
    replacements = {id(convs[p.name]): SparseConv2d(kernels[p.name], p.name) for p in chosen}
    for i, p in enumerate(plans):
        if p.name in kernels and kernels[p.name].backend == "dense":
            t = kernels[p.name].stats["tuning"]["times_us"]
            plans[i] = replace(p, action="dense", reason=f"cuDNN measured faster ({t[DENSE]:.1f} us vs "
                               f"{t[SPARSE_EVENTS]:.1f} us)")
    # Swap in every parent that holds a chosen conv (a conv shared by two
    # parents is swapped in both).
    for parent in model.modules():
        for child_name, child in list(parent.named_children()):
            if id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])
    model = replacements.get(id(model), model)  # the model itself was one conv
    model.sparseconv_plan = plans
    return model
