"""Stage 1, render: Jinja2 template -> CUDA C source with placeholder weights.

Each weight of the template body (k_block x c_block x R x S of them) is a
unique placeholder float. After compilation a placeholder's bit pattern says
which (kb, cb, r, s) an instruction belongs to, whatever order NVVM chose.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple

import jinja2

from .launch import GRID_DEPENDENCY_CUDA
from .pool import POOL_MAX_CUDA, QUAD_WALK_CUDA
from .tilings import pools_in_kernel
from .shapes import (INPUT_STAGES, PREFETCH_AHEAD, ConvShape, Epilogue, Tiling, check_tiling, kernel_shape, n_chunks,
                     n_kblocks, padded_channels, patch_size, residual_after_loop, stage_steps, tap_predicates)

TEMPLATE_NAME = "conv2d_direct.cu.j2"  # the direct family's; template_name(family) for any
ENTRY_NAME = "sc_conv2d"
KBLOCK_FUNC = "sc_kblock"

# Placeholders are floats in [1, 2): exponent fixed at 127, mantissa drawn from
# an odd-multiplier permutation of 1..2^23-1. Distinct by construction, never 0,
# +-1, +-2, 0.5 or any power of two (mantissa 0 is never produced).
_PLACEHOLDER_EXP = 0x3F800000
_MANTISSA_BITS = 23
_MULTIPLIER = 0x2B3C5  # odd, so i -> i*M mod 2^23 is a bijection


def placeholder_bits(index: int) -> int:
    """The float32 bit pattern of placeholder number `index` (0-based)."""
    limit = (1 << _MANTISSA_BITS) - 1
    if not 0 <= index < limit:
        raise ValueError(f"placeholder index {index} out of range [0, {limit})")
    mantissa = ((index + 1) * _MULTIPLIER) & limit
    if mantissa == 0:  # cannot happen for index+1 < 2^23 with an odd multiplier
        raise AssertionError("placeholder mantissa 0")
    return _PLACEHOLDER_EXP | mantissa


def placeholder_value(index: int) -> float:
    return struct.unpack("<f", struct.pack("<I", placeholder_bits(index)))[0]


def template_name(family: str) -> str:
    """The template file of a kernel family."""
    return f"conv2d_{family}.cu.j2"


def f32_literal(value: float) -> str:
    """A float32 constant as CUDA C, exact to the bit."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return f"__int_as_float(0x{bits:08X})"


def epilogue_code(epilogue: Epilogue, indent: str = " " * 12) -> str:
    """CUDA C applied to each output `v` before the store: the activation as a
    clamp. `v` already holds conv + bias + residual (HAS_RESIDUAL): the
    templates start each sum with bias + residual, or add the residual after
    the chunk loop, its loads all before the first store
    (shapes.residual_after_loop), so that they are in flight together instead
    of one at a time at the store.
    A NaN stays NaN, as in torch (comparisons with NaN are false)."""
    lines = []
    lo, hi = epilogue.bounds
    if lo is not None:
        lines.append(f"v = v < {f32_literal(lo)} ? {f32_literal(lo)} : v;")
    if hi is not None:
        lines.append(f"v = v > {f32_literal(hi)} ? {f32_literal(hi)} : v;")
    return "\n".join(indent + line for line in lines) or indent + "// (none)"


@dataclass(frozen=True)
class RenderedTemplate:
    source: str
    shape: ConvShape
    tiling: Tiling
    # placeholder bit pattern -> (kb, cb, r, s) inside the body
    placeholders: Dict[int, Tuple[int, int, int, int]]
    epilogue: Epilogue = Epilogue()

    @property
    def source_sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


def template_dir() -> Path:
    """templates/ ships inside the wheel as sparseconv/templates, and sits at the
    repository root in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "templates", here.parent / "templates"):
        if (candidate / TEMPLATE_NAME).is_file():
            return candidate
    raise FileNotFoundError(f"{TEMPLATE_NAME} not found in {here / 'templates'} or {here.parent / 'templates'}; "
                            "reinstall sparseconv (pip install -e .)")


def body_index(shape: ConvShape, tiling: Tiling, kb: int, cb: int, r: int, s: int) -> int:
    return ((kb * tiling.c_block + cb) * shape.kernel_h + r) * shape.kernel_w + s


def render(shape: ConvShape, tiling: Tiling, epilogue: Epilogue = Epilogue()) -> RenderedTemplate:
    check_tiling(shape, tiling)
    if epilogue.pool and not pools_in_kernel(shape, tiling):
        raise ValueError(f"{tiling.describe()} cannot take the pool in the kernel (tilings.pools_in_kernel); "
                         "build_conv2d builds such a variant without it and the runtime pools after")
    layer_shape, shape = shape, kernel_shape(shape, tiling)  # several depthwise groups a block: see there
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(template_dir())),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    placeholders: Dict[int, Tuple[int, int, int, int]] = {}

    def placeholder(kb: int, cb: int, r: int, s: int) -> str:
        bits = placeholder_bits(body_index(shape, tiling, kb, cb, r, s))
        placeholders[bits] = (kb, cb, r, s)
        return f"0x{bits:08X}"

    name = template_name(tiling.family)
    family_vars = {}
    if tiling.family == "direct":
        ph, pw = patch_size(shape, tiling)
        family_vars = dict(
            BH=tiling.thread_h, BW=tiling.thread_w, TH=tiling.tile_h, TW=tiling.tile_w,
            TILES_W=-(-shape.out_w // tiling.tile_w), THREADS_X=tiling.threads_x,
            R=shape.kernel_h, S=shape.kernel_w,
            PATCH_H=ph, PATCH_W=pw, STAGE_STEPS=stage_steps(shape, tiling),
            ROW_W=(tiling.thread_w - 1) * shape.stride[1] + (shape.kernel_w - 1) * shape.dilation[1] + 1)
    else:
        family_vars = dict(PIXELS=tiling.thread_w, PADDED=padded_channels(shape, tiling),
                           TAP_PREDICATES=int(tap_predicates(shape, tiling)), R=shape.kernel_h, S=shape.kernel_w,
                           RESIDUAL_AFTER_LOOP=int(residual_after_loop(shape, tiling)),
                           PIXEL_QUADS=int(tiling.pixel_order == "quads"),
                           STAGED_INPUT=int(tiling.input_loads == "staged"), INPUT_STAGES=INPUT_STAGES,
                           PREFETCH_INPUT=int(tiling.input_loads == "prefetched"), PREFETCH_AHEAD=PREFETCH_AHEAD,
                           POOL=int(epilogue.pool))
    source = env.get_template(name).render(
        template_name=name, entry_name=ENTRY_NAME, grid_dependency=GRID_DEPENDENCY_CUDA, pool_max=POOL_MAX_CUDA,
        quad_walk=QUAD_WALK_CUDA,
        shape_comment=shape.describe(), tiling_comment=tiling.describe(),
        epilogue_comment=epilogue.describe(), epilogue_code=epilogue_code(epilogue),
        HAS_RESIDUAL=int(epilogue.residual), SLICES=tiling.slices,
        CLUSTER_SUM=int(tiling.slice_sum == "cluster"), CHUNKS_PER_SLICE=n_chunks(shape, tiling),
        K=shape.out_channels, C=shape.in_channels,
        K_PER_GROUP=shape.k_per_group, C_PER_GROUP=shape.c_per_group,
        K_TAIL=int(shape.k_per_group % tiling.k_block != 0),
        KBLOCKS_PER_GROUP=n_kblocks(shape, tiling) // (shape.groups * tiling.slices),
        H=shape.in_h, W=shape.in_w, HO=shape.out_h, WO=shape.out_w,
        STRIDE_H=shape.stride[0], STRIDE_W=shape.stride[1],
        PAD_H=shape.padding[0], PAD_W=shape.padding[1],
        DIL_H=shape.dilation[0], DIL_W=shape.dilation[1],
        KB=tiling.k_block, CB=tiling.c_block, THREADS=tiling.threads,
        placeholder=placeholder, **family_vars,
    )
    expected = tiling.k_block * tiling.c_block * shape.kernel_h * shape.kernel_w
    if len(placeholders) != expected:
        raise AssertionError(f"template rendered {len(placeholders)} placeholders, expected {expected}")
    return RenderedTemplate(source, layer_shape, tiling, placeholders, epilogue)
