"""A float64 direct convolution, the yardstick for every numerical test.

Works with NumPy or CuPy (`xp`); padding is explicit zeros, like
torch.nn.functional.conv2d, so NaN/Inf weights propagate the same way."""
from __future__ import annotations

from typing import Any, Optional, Tuple


def conv2d_reference(x: Any, w: Any, bias: Optional[Any] = None, stride: Tuple[int, int] = (1, 1),
                     padding: Tuple[int, int] = (0, 0), dilation: Tuple[int, int] = (1, 1),
                     groups: int = 1, xp: Any = None) -> Any:
    if xp is None:
        import numpy as xp
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
    if xp is None:
        import numpy as xp
    y = xp.asarray(y, dtype=xp.float64)
    num = float(xp.linalg.norm((y - ref).ravel()))
    den = float(xp.linalg.norm(ref.ravel()))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def pruned_weight(rng: Any, shape: Tuple[int, ...], sparsity: float, zero_channels: int = 0) -> Any:
    """Random normal weights, a `sparsity` fraction set to exactly 0 (unstructured),
    and the first `zero_channels` output channels all zero."""
    import numpy as np

    w = rng.standard_normal(shape).astype(np.float32)
    w[rng.random(shape) < sparsity] = 0.0
    w[:zero_channels] = 0.0
    return w
