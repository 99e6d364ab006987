"""The largest layers sparseconv accepts, checked in one place before anything
is built: check_layer (the CLI and build_many, so every build path, call it;
the model loader calls check_indexing alone).

Why these limits (README, "Limits"):
  * MAX_INDEX: the kernel template computes offsets inside one image in 32-bit
    `int` (input rows, patch offsets, output positions); only the offset of an
    image in the batch and of a group's channels are 64-bit. So one image's
    input (C*H*W) and output (K*Ho*Wo) must each hold fewer than 2**31
    elements, or offsets would wrap and the kernel read and write the wrong
    memory. The batch size is free: image offsets are 64-bit, and the launcher
    slices batches over 65535 images.
  * MAX_GRID_Y: one block row per block of output channels (gridDim.y), which
    CUDA caps at 65535.
  * MAX_BODY_COPIES: the specialised kernel holds one copy of the template body
    per (block of output channels, chunk of input channels); each costs about
    20 ms to specialise and assemble (measured: 1024 depthwise groups, 20 s),
    so this bound keeps that overhead of one layer under about 5 minutes. The
    conv layers of VGG-16 and ResNet-50 need 4096 copies or fewer; a 100,000-
    group conv would need 100,000 and is refused instead of grinding.
"""
from __future__ import annotations

from typing import Optional

from .shapes import ConvShape, Tiling, check_tiling, n_chunks, n_kblocks
from .tilings import default_tiling

MAX_INDEX = 2 ** 31 - 1
MAX_GRID_Y = 65535
MAX_BODY_COPIES = 16384


class LimitError(ValueError):
    """A layer beyond what the kernel can compute correctly or build in reasonable time."""


def check_indexing(shape: ConvShape) -> None:
    """Raise LimitError when one image's offsets would not fit the kernel's
    32-bit ints. The model loader calls this one alone: a layer that size is
    never a real model's, while a layer over the build limits below may be
    (VGG's fc6 as a conv) and is refused only if chosen for a build."""
    s = shape
    image_in = s.in_channels * s.in_h * s.in_w
    image_out = s.out_channels * s.out_h * s.out_w
    padded = max(s.in_h + 2 * s.padding[0], s.in_w + 2 * s.padding[1])
    if max(image_in, image_out, padded) > MAX_INDEX:
        raise LimitError(f"{s.describe()}: one image has {image_in} input and {image_out} output elements; the "
                         f"kernel indexes an image with 32-bit ints, so each must be at most {MAX_INDEX} (2**31-1)")


def check_layer(shape: ConvShape, tiling: Optional[Tiling] = None) -> Tiling:
    """Raise LimitError when `shape` (with `tiling`, default: the default
    tiling) is beyond the limits above, or ValueError when the tiling cannot
    serve it; return the tiling. Cheap: arithmetic only, no build."""
    s = shape
    check_indexing(s)
    try:
        t = tiling or default_tiling(s)
    except ValueError as exc:
        raise LimitError(f"{s.describe()}: {exc} (dilation or kernel too large for one block's "
                         "input patch)") from None
    check_tiling(s, t)
    kblocks, chunks = n_kblocks(s, t), n_chunks(s, t)
    if kblocks > MAX_GRID_Y:
        raise LimitError(f"{s.describe()}: {kblocks} blocks of output channels (groups {s.groups}); CUDA allows "
                         f"at most {MAX_GRID_Y} along the grid's y axis")
    if kblocks * chunks > MAX_BODY_COPIES:
        raise LimitError(f"{s.describe()}: the kernel would hold {kblocks * chunks} copies of its body "
                         f"(blocks of output channels x chunks of input channels); at most {MAX_BODY_COPIES} "
                         "build in reasonable time: leave this layer to cuDNN")
    return t
