"""The layer's weights in the order the template body holds its placeholders."""
from __future__ import annotations

import numpy as np

from ..shapes import ConvShape, Tiling, kernel_shape, n_chunks, n_kblocks


def arrange_weights(weight: np.ndarray, shape: ConvShape, tiling: Tiling) -> np.ndarray:
    """(K, C/groups, R, S) -> (kblocks, chunks, body) in placeholder body order,
    k-block copy b = blockIdx.y = output-channel block * slices + slice, each
    slice its own run of chunks. Channels past K or C of a group (padding up to
    whole blocks, chunks and slices) get weight 0. Where the kernel takes
    several depthwise groups a block (shapes.kernel_shape), each output
    channel's weights sit at its own group's input channel, zeros elsewhere."""
    kshape = kernel_shape(shape, tiling)
    if kshape != shape:  # block-diagonal: output channel k reads channel k // k_per_group of the layer
        merged = np.zeros(kshape.weight_shape, dtype=np.float32)
        k = np.arange(shape.out_channels)
        merged[k, (k // shape.k_per_group) % kshape.c_per_group] = np.asarray(weight, dtype=np.float32)[:, 0]
        weight, shape = merged, kshape
    g, kpg, cpg = shape.groups, shape.k_per_group, shape.c_per_group
    kb, cb, sl = tiling.k_block, tiling.c_block, tiling.slices
    kbpg = n_kblocks(shape, tiling) // (g * sl)
    nch = n_chunks(shape, tiling)  # per slice
    r, s = shape.kernel_h, shape.kernel_w
    w = np.asarray(weight, dtype=np.float32).reshape(g, kpg, cpg, r, s)
    padded = np.zeros((g, kbpg * kb, sl * nch * cb, r, s), dtype=np.float32)
    padded[:, :kpg, :cpg] = w
    padded = padded.reshape(g, kbpg, kb, sl, nch, cb, r, s).transpose(0, 1, 3, 4, 2, 5, 6, 7)
    return np.ascontiguousarray(padded.reshape(g * kbpg * sl, nch, kb * cb * r * s))
