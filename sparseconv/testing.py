"""Helpers for testing and measuring sparseconv kernels (as triton.testing and
cupy.testing are for theirs): pruned weights, a float64 reference convolution,
the error measure the tests and the bench check against.

    w = pruned_weight(np.random.default_rng(0), (64, 64, 3, 3), 0.9)
    ref = conv2d_reference(x, w, bias, stride=(1, 1), padding=(1, 1))
    assert relative_l2(y, ref) <= 1e-5

A leaf module: NumPy only (CuPy arrays work through `xp=cupy`), nothing of
sparseconv's, so the yardstick shares no code with what it measures."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np


def pruned_weight(rng: np.random.Generator, shape: Tuple[int, ...], sparsity: float,
                  zero_channels: int = 0) -> np.ndarray:
    """Random normal float32 weights, a `sparsity` fraction set to exactly 0
    (unstructured, at random positions), and the first `zero_channels` output
    channels all zero (a case the kernels must handle)."""
    w = rng.standard_normal(shape).astype(np.float32)
    w[rng.random(shape) < sparsity] = 0.0
    w[:zero_channels] = 0.0
    return w


def magnitude_prune(w: np.ndarray, sparsity: float) -> np.ndarray:
    """A copy of w with the smallest-magnitude `sparsity` fraction set to exactly 0
    (unstructured magnitude pruning; ties at the threshold are pruned too)."""
    k = int(round(sparsity * w.size))
    if k == 0:
        return w.copy()
    threshold = np.partition(np.abs(w).ravel(), k - 1)[k - 1]
    out = w.copy()
    out[np.abs(out) <= threshold] = 0.0
    return out


def he_pruned_weight(rng: np.random.Generator, shape: Tuple[int, int, int, int], sparsity: float) -> np.ndarray:
    """He-initialised (K, C, R, S) float32 weights, magnitude-pruned to `sparsity`:
    what a trained-then-pruned layer's weights look like in scale and zeros."""
    k, c, r, s = shape
    w = (rng.standard_normal((k, c, r, s)) * np.sqrt(2.0 / (c * r * s))).astype(np.float32)
    return magnitude_prune(w, sparsity)


def conv2d_reference(x: Any, w: Any, bias: Optional[Any] = None, stride: Tuple[int, int] = (1, 1),
                     padding: Tuple[int, int] = (0, 0), dilation: Tuple[int, int] = (1, 1),
                     groups: int = 1, xp: Any = None) -> Any:
    """Direct convolution in float64, with the semantics of
    torch.nn.functional.conv2d (NCHW, weight (K, C/groups, R, S), stride,
    explicit zero padding, dilation, groups), so NaN/Inf weights propagate the
    same way. NumPy by default; pass xp=cupy for CuPy arrays."""
    if xp is None:
        xp = np
    x = xp.asarray(x, dtype=xp.float64)
    w = xp.asarray(w, dtype=xp.float64)
    n, c, h, wd = x.shape
    k, cg, r, s = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    ho = (h + 2 * ph - dh * (r - 1) - 1) // sh + 1
    wo = (wd + 2 * pw - dw * (s - 1) - 1) // sw + 1
    xpad = xp.zeros((n, c, h + 2 * ph, wd + 2 * pw), dtype=xp.float64)
    xpad[:, :, ph:ph + h, pw:pw + wd] = x
    out = xp.zeros((n, k, ho, wo), dtype=xp.float64)
    kg = k // groups
    for g in range(groups):
        xs = xpad[:, g * cg:(g + 1) * cg]
        for i in range(r):
            for j in range(s):
                patch = xs[:, :, i * dh: i * dh + sh * (ho - 1) + 1: sh, j * dw: j * dw + sw * (wo - 1) + 1: sw]
                out[:, g * kg:(g + 1) * kg] += xp.einsum("nchw,kc->nkhw", patch, w[g * kg:(g + 1) * kg, :, i, j])
    if bias is not None:
        out += xp.asarray(bias, dtype=xp.float64)[None, :, None, None]
    return out


def relative_l2(y: Any, ref: Any, xp: Any = None) -> float:
    """||y - ref|| / ||ref|| in float64 (NumPy, or CuPy with xp=cupy). A zero
    reference gives 0 when y equals it and inf otherwise."""
    if xp is None:
        xp = np
    ref = xp.asarray(ref, dtype=xp.float64)
    num = float(xp.linalg.norm((xp.asarray(y, dtype=xp.float64) - ref).ravel()))
    den = float(xp.linalg.norm(ref.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
