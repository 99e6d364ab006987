"""The user-facing API: compile_conv2d(...) -> a loaded kernel, compile_layers(...).

It chains the build (sparseconv.build, CPU), the autotuner (sparseconv.tune,
GPU timing) and loading (sparseconv.runtime). Building alone needs no GPU:
build_conv2d(..., target=Target("sm_90")), or compile_conv2d(..., target=...),
which asks the GPU only to load the kernel.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .build import build_conv2d
from .cache import ArtifactCache
from .limits import check_layer
from .parallel import LayerJob, build_many
from .progress import StepLine, ptxas_counter
from .runtime import Conv2dKernel, DenseConv2dKernel, LinearKernel, device_target
from .shapes import ConvShape, Epilogue, IntPair, Target, Tiling, shape_from_weight
from .tilings import (ANY_BATCH, batch_variants, code_variants, default_tiling, pointwise_tiling, small_batch_tiling,
                      split_batch_limit)
from .tune import DENSE, tune_conv2d


def _host_array(a: Any, what: str) -> np.ndarray:
    """NumPy copy of a weight/bias given as NumPy, CuPy or torch."""
    if hasattr(a, "detach"):            # torch.Tensor
        a = a.detach().cpu().numpy()
    elif hasattr(a, "get") and hasattr(a, "__cuda_array_interface__"):  # cupy.ndarray
        a = a.get()
    arr = np.asarray(a)
    if arr.dtype.kind != "f":
        raise TypeError(f"{what} must be a floating-point array, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _target(target: Union[Target, str, None], name: str) -> Optional[Target]:
    """A Target from a Target, a string like 'sm_90' (the CLI's --target) or None."""
    if isinstance(target, str):
        try:
            target = Target(target)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if target is not None and not isinstance(target, Target):
        raise TypeError(f"{name}: target must be a sparseconv.Target or a string like 'sm_90', "
                        f"got {type(target).__name__}")
    return target


def _bias(bias: Any, shape: ConvShape, name: str) -> Optional[np.ndarray]:
    if bias is None:
        return None
    b = _host_array(bias, f"{name}: bias")
    if b.shape != (shape.out_channels,):
        raise ValueError(f"{name}: bias must have shape ({shape.out_channels},), got {b.shape}")
    return b


def _check_progress(progress: object, name: str) -> None:
    if not isinstance(progress, bool):
        raise TypeError(f"{name}: progress must be True or False, got {progress!r}")


def compile_conv2d(weight: Any, *, input_size: IntPair, bias: Any = None, stride: IntPair = 1,
                   padding: IntPair = 0, dilation: IntPair = 1, groups: int = 1,
                   activation: str = "none", clip: Optional[Tuple[float, float]] = None, residual: bool = False,
                   pool: bool = False, tiling: Union[Tiling, str, None] = None, backend: str = "sparseconv",
                   tune_batch: int = 64, cache_dir: Union[str, None] = None,
                   name: str = "conv", target: Union[Target, str, None] = None,
                   progress: bool = True) -> Conv2dKernel:
    """Compile a pruned conv layer into a kernel specialised to its weights.

    weight: (K, C/groups, R, S) floats (NumPy, CuPy or torch), zeros where pruned.
    input_size: (H, W) of the input images. bias: (K,) or None. stride, padding,
    dilation: int or pair, as torch.nn.functional.conv2d. The batch size is free
    at call time. Builds for `target` (default: the current CUDA device's) and
    loads on the current device; artifacts are cached in cache_dir (default:
    $SPARSECONV_CACHE_DIR or ptx_cache/). To build without a GPU, use
    sparseconv.build_conv2d(weight, shape, target=Target("sm_90")).

    The epilogue is fused into the store: y = act(conv(x) + bias + residual),
    with activation "none", "relu", "relu6" or "clip" (clip=(lo, hi)), and
    residual=True for a kernel called as kernel(x, residual=r). pool=True
    adds a 2x2 max pool of stride 2 after the activation (VGG's Conv -> ReLU
    -> MaxPool2d(2, 2)): the kernel returns (N, K, Ho // 2, Wo // 2), and a
    pointwise-family kernel takes the pool among its threads, so the conv's
    whole output is never written (a split variant pools as its slices are
    summed, other variants after the kernel).

    With the default tiling, a layer that gives too few blocks at small
    batches to fill the GPU also gets a variant with the input-channel
    reduction split over blocks (deterministic), used up to a batch size
    (kernel.stats["variants"]; tilings.batch_variants).

    tiling: None (the default heuristic), a Tiling, or "auto": time a bounded
    set of candidate tilings at batch `tune_batch` and keep the fastest.
    backend: "sparseconv", or "auto" (opt-in): also time cuDNN strict fp32
    (needs torch) and return a DenseConv2dKernel where it was faster. Tuning
    results are cached, so a second compile does not tune again;
    kernel.stats["tuning"] holds the times and the choice.

    progress (default on): a big layer's assembly (minutes, on few cores)
    counts its functions on stderr, and tuning draws its build's bar; cached
    and small builds print nothing. progress=False is silent."""
    if backend not in ("sparseconv", "auto"):
        raise ValueError(f"{name}: backend must be 'sparseconv' or 'auto', got {backend!r}")
    _check_progress(progress, name)
    try:
        epilogue = Epilogue(activation, clip, residual, pool)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    if isinstance(tiling, str) and tiling != "auto":
        raise ValueError(f"{name}: tiling must be a Tiling, None or 'auto', got {tiling!r}")
    if not isinstance(tune_batch, int) or tune_batch < 1:
        raise ValueError(f"{name}: tune_batch must be a positive int, got {tune_batch!r}")
    target = _target(target, name)
    w = _host_array(weight, f"{name}: weight")
    shape = shape_from_weight(w, input_size, stride, padding, dilation, groups)
    b = _bias(bias, shape, name)
    cache = ArtifactCache(cache_dir)
    target = target or device_target()
    tuning = None
    if tiling == "auto" or backend == "auto":
        candidates = None if tiling == "auto" else [tiling or default_tiling(shape)]
        layer, tuning = tune_conv2d(w, shape, b, target=target, cache=cache, name=name, batch=tune_batch,
                                    tilings=candidates, consider_dense=backend == "auto", epilogue=epilogue,
                                    progress=progress)
        variants = [(ANY_BATCH, layer)]
    else:
        chosen = [(ANY_BATCH, tiling)] if isinstance(tiling, Tiling) else batch_variants(shape, default_tiling(shape))
        for _, t in chosen:  # refuse what cannot be built before building anything
            try:
                check_layer(shape, t)
            except ValueError as exc:  # LimitError too
                raise type(exc)(f"{name}: {exc}") from None
        variants = [(up_to, build_conv2d(w, shape, tiling=t, target=target, cache=cache, name=name,
                                         epilogue=epilogue, on_function=ptxas_counter(name, progress, i, len(chosen))))
                    for i, (up_to, t) in enumerate(chosen)]
    t = time.perf_counter()
    kernel = DenseConv2dKernel(variants[-1][1], b, w) if tuning and tuning.backend == DENSE \
        else Conv2dKernel(variants, b)
    kernel.stats["seconds"] = dict(kernel.stats["seconds"], load=time.perf_counter() - t)
    if tuning is not None:
        kernel.stats["tuning"] = tuning.as_dict()
    return kernel


# -- fully connected layers -----------------------------------------------------------------------------------------
#
# A Linear layer y = x @ W.T + b is a 1x1 conv on a 1x1 input: ConvShape(in, out,
# 1, 1, 1, 1), the batch as the pixels of the pointwise family. Its tiling
# differs from a 1x1 conv's default (tilings.default_pointwise_tiling) in the
# threads per block only. That default gives deep layers 512 threads, one pixel
# each, so that many warps share the straight-line code; but a Linear layer has
# one pixel per image, and a thread whose pixel is past the batch still walks
# the whole body (it loads pixel 0 and stores nothing). At batch 64, 448 of 512
# threads would do nothing but issue. So: 32 threads (one warp) for the small-
# batch variant with the reduction split over blocks (tilings.small_batch_tiling, up
# to batch 16), and 64 threads for any batch. Output channels per block as in
# the pointwise default (128 where K <= 128, else 64). Not measured on a GPU
# yet: sparsify routes each layer to cuBLAS where it is faster, and
# tiling="auto" times the pointwise candidates.
LINEAR_THREADS = 64
LINEAR_SPLIT_THREADS = 32


def linear_shape(in_features: int, out_features: int) -> ConvShape:
    """The 1x1 conv on a 1x1 input that a Linear(in_features, out_features) is."""
    return ConvShape(in_features, out_features, 1, 1, 1, 1)


def linear_variants(shape: ConvShape) -> List[Tuple[int, Tiling]]:
    """The tilings a Linear layer (linear_shape) is built with, each for
    batches up to a size, as tilings.batch_variants: a split variant for small
    batches where the reduction is long enough to split, then one for any
    batch (see the comment above)."""
    k_block = 128 if shape.k_per_group <= 128 else 64
    split = small_batch_tiling(shape, pointwise_tiling(shape, k_block, 1, LINEAR_SPLIT_THREADS))
    whole = pointwise_tiling(shape, k_block, 1, LINEAR_THREADS)
    if split is None:
        return [(ANY_BATCH, whole)]
    return [(split_batch_limit(shape, split), split), (ANY_BATCH, whole)]


# A Linear layer is a candidate for sparsify and `sparseconv run` only with at
# least this share of zero weights: a dense classifier head gains nothing over
# cuBLAS and would cost compile time, so unpruned ones are left alone.
LINEAR_MIN_SPARSITY = 0.5
# Above this many weights a Linear layer is left to cuBLAS by default: its
# build would take minutes. Measured on the 2-core CPU machine
# (bench/compile_linear.py, docs/PERFORMANCE.md): VGG-16's fc8 (4096x1000 =
# 4.1M weights, 90% zeros) builds in 2 min, fc7 (4096x4096 = 16.8M) in 13 min.
MAX_LINEAR_WEIGHTS = 4_194_304


def linear_limits(shape: ConvShape) -> str:
    """Why a Linear layer (linear_shape) cannot be built (sparseconv.limits,
    for each of its linear_variants), or "" when it can."""
    try:
        for _, t in linear_variants(shape):
            check_layer(shape, t)
    except ValueError as exc:
        return str(exc)
    return ""


def _linear_weight(weight: Any, name: str) -> np.ndarray:
    w = _host_array(weight, f"{name}: weight")
    if w.ndim != 2:
        raise ValueError(f"{name}: weight must be 2-D (out_features, in_features), as nn.Linear.weight, "
                         f"got shape {w.shape}")
    if 0 in w.shape:
        raise ValueError(f"{name}: weight has shape {w.shape}; a Linear layer needs at least one input and "
                         "one output feature")
    return w


def compile_linear(weight: Any, *, bias: Any = None, activation: str = "none",
                   clip: Optional[Tuple[float, float]] = None, tiling: Union[Tiling, str, None] = None,
                   backend: str = "sparseconv", tune_batch: int = 64, cache_dir: Union[str, None] = None,
                   name: str = "linear", target: Union[Target, str, None] = None,
                   progress: bool = True) -> LinearKernel:
    """Compile a pruned fully connected layer, y = act(x @ weight.T + bias),
    into a kernel specialised to its weights (the pointwise family: a 1x1 conv
    on a 1x1 input, the batch as pixels; linear_variants).

    weight: (out_features, in_features) floats (NumPy, CuPy or torch), zeros
    where pruned, as nn.Linear.weight (an ONNX Gemm's B with transB=0 is its
    transpose). bias: (out_features,) or None. Returns a LinearKernel:
    kernel(x) maps an (N, in_features) float32 CUDA array to (N, out_features);
    the batch is free at call time. activation, clip, tiling, backend,
    tune_batch, cache_dir, target and progress as compile_conv2d."""
    _check_progress(progress, name)
    w = _linear_weight(weight, name)
    out_features, in_features = w.shape
    w4 = w.reshape(out_features, in_features, 1, 1)
    if tiling is not None or backend != "sparseconv":  # a given tiling, or tuning: compile_conv2d's way
        conv = compile_conv2d(w4, input_size=1, bias=bias, activation=activation, clip=clip, tiling=tiling,
                              backend=backend, tune_batch=tune_batch, cache_dir=cache_dir, name=name, target=target,
                              progress=progress)
        return LinearKernel(conv)
    # compile_conv2d's argument checks (same messages), then the Linear variants
    try:
        epilogue = Epilogue(activation, clip)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{name}: {exc}") from None
    target = _target(target, name)
    shape = linear_shape(in_features, out_features)
    b = _bias(bias, shape, name)
    variants = linear_variants(shape)
    for _, t in variants:  # refuse what cannot be built before building anything
        check_layer(shape, t)
    cache = ArtifactCache(cache_dir)
    target = target or device_target()
    built = [(up_to, build_conv2d(w4, shape, tiling=t, target=target, cache=cache, name=name, epilogue=epilogue,
                                  on_function=ptxas_counter(name, progress, i, len(variants))))
             for i, (up_to, t) in enumerate(variants)]
    t0 = time.perf_counter()
    conv = Conv2dKernel(built, b)
    conv.stats["seconds"] = dict(conv.stats["seconds"], load=time.perf_counter() - t0)
    return LinearKernel(conv)


def compile_layers(layers: Sequence[Tuple[str, np.ndarray, Optional[np.ndarray], ConvShape]], *,
                   tiling: Optional[str] = None, backend: str = "sparseconv", tune_batch: int = 64,
                   cache_dir: Optional[str] = None, jobs: Optional[int] = None,
                   progress: bool = True,
                   epilogues: Optional[Dict[str, Epilogue]] = None,
                   linears: Collection[str] = (),
                   table_layers: Collection[str] = ()) -> Dict[str, Union[Conv2dKernel, LinearKernel]]:
    """Compile and load many (name, weight, bias, shape) layers on the current
    GPU; name -> kernel. Without tuning they build in parallel (a process pool),
    every batch variant of every layer (tilings.batch_variants); with
    tiling="auto" or backend="auto" each layer's candidates build in parallel,
    one layer after another, then are timed. `progress` (default on): a bar
    or a line on stderr that names the layer being built or tuned.
    `epilogues`: name -> the epilogue fused into that layer (default: bias
    only). `linears`: the names
    of fully connected layers (weight (out, in) or (out, in, 1, 1), shape
    linear_shape(in, out)): built with linear_variants, returned as LinearKernel.
    `table_layers`: the names of convs whose small batches the caller will
    time through the weight table; those that tilings.table_runs_small_batches
    takes are built without their small-batch variant (tilings.code_variants)."""
    epilogues = epilogues or {}
    kernels: Dict[str, Union[Conv2dKernel, LinearKernel]] = {}
    for name, w, _, shape in layers:
        if name in linears and shape != linear_shape(shape.in_channels, shape.out_channels):
            raise ValueError(f"{name}: a Linear layer's shape is linear_shape(in, out), got {shape.describe()}")
    if tiling == "auto" or backend == "auto":
        # one layer after another (each builds its candidates in parallel): minutes for a whole network
        with StepLine(f"tuning (tiling={tiling}, backend={backend})", len(layers), progress) as line:
            for name, w, b, shape in layers:
                line.step(name)
                ep = epilogues.get(name, Epilogue())
                if name in linears:
                    kernels[name] = compile_linear(w.reshape(shape.out_channels, shape.in_channels), bias=b,
                                                   activation=ep.activation, clip=ep.clip, tiling=tiling,
                                                   backend=backend, tune_batch=tune_batch, cache_dir=cache_dir,
                                                   name=name, progress=False)
                    continue
                kernels[name] = compile_conv2d(w, input_size=(shape.in_h, shape.in_w), bias=b,
                                               stride=shape.stride, padding=shape.padding, dilation=shape.dilation,
                                               groups=shape.groups, activation=ep.activation, clip=ep.clip,
                                               residual=ep.residual, pool=ep.pool, tiling=tiling, backend=backend,
                                               tune_batch=tune_batch, cache_dir=cache_dir, name=name,
                                               progress=False)  # the line above names the layer
        return kernels

    def variants(name: str, shape: ConvShape) -> List[Tuple[int, Tiling]]:
        if name in linears:
            return linear_variants(shape)
        return code_variants(shape, default_tiling(shape), table_at_small_batches=name in table_layers)

    # Every variant of every layer in one pool; the any-batch variant keeps the layer's name.
    jobs_by_layer = {name: [(up_to, LayerJob(name if up_to == ANY_BATCH else f"{name}#split",
                                             w.reshape(shape.weight_shape) if name in linears else w, shape, t,
                                             epilogues.get(name, Epilogue())))
                            for up_to, t in variants(name, shape)]
                     for name, w, _, shape in layers}
    built = build_many([job for variants in jobs_by_layer.values() for _, job in variants], target=device_target(),
                       cache_dir=cache_dir, workers=jobs, progress=progress)
    for name, _, b, _ in layers:
        t = time.perf_counter()
        conv = Conv2dKernel([(up_to, replace(built[job.name], name=name)) for up_to, job in jobs_by_layer[name]], b)
        conv.stats["seconds"] = dict(conv.stats["seconds"], load=time.perf_counter() - t)
        kernels[name] = LinearKernel(conv) if name in linears else conv
    return kernels
