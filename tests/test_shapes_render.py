"""CPU: layer shapes, tilings, placeholders and template rendering."""
import struct

import numpy as np
import pytest

from sparseconv.render import placeholder_bits, placeholder_value, render
from sparseconv.shapes import ConvShape, Tiling, check_tiling, pair
from sparseconv.tilings import default_tiling


def test_pair_accepts_int_or_pair_only():
    assert pair(3, "stride") == (3, 3)
    assert pair((1, 2), "stride") == (1, 2)
    for bad in ("1", 1.5, (1, 2, 3), True, (1, "2")):
        with pytest.raises(TypeError, match="stride"):
            pair(bad, "stride")


def test_conv_shape_output_size_matches_torch_formula():
    s = ConvShape(3, 8, 224, 224, 11, 11, (4, 4), (2, 2))
    assert (s.out_h, s.out_w) == (55, 55)
    s = ConvShape(4, 6, 12, 19, 3, 2, (1, 2), (3, 1), (2, 3))
    assert (s.out_h, s.out_w) == ((12 + 6 - 4 - 1) // 1 + 1, (19 + 2 - 3 - 1) // 2 + 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(in_channels=6, out_channels=4, groups=4), "divisible by groups"),
    (dict(in_channels=0, out_channels=4), "in_channels"),
    (dict(in_channels=3, out_channels=4, stride=(0, 1)), "stride"),
    (dict(in_channels=3, out_channels=4, padding=(-1, 0)), "padding"),
    (dict(in_channels=3, out_channels=4, in_h=2, kernel_h=5), "output would be empty"),
])
def test_conv_shape_rejects_bad_layers(kwargs, message):
    base = dict(in_h=8, in_w=8, kernel_h=3, kernel_w=3)
    base.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ConvShape(**base)


SHAPES = [
    ConvShape(1, 20, 28, 28, 5, 5),
    ConvShape(3, 64, 224, 224, 11, 11, (4, 4), (2, 2)),
    ConvShape(512, 512, 14, 14, 3, 3, (1, 1), (1, 1)),
    ConvShape(64, 64, 56, 56, 1, 1),
    ConvShape(32, 32, 112, 112, 3, 3, (2, 2), (1, 1), groups=32),
    ConvShape(7, 9, 1, 1, 1, 1),
    ConvShape(2048, 512, 7, 7, 1, 1),
    ConvShape(3, 5, 3, 400, 3, 7, (1, 3), (0, 3), (1, 2)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.describe())
def test_default_tiling_is_valid_and_bounded(shape):
    t = default_tiling(shape)
    check_tiling(shape, t)
    assert 1 <= t.threads <= 1024
    assert t.k_block * t.c_block * shape.kernel_h * shape.kernel_w <= 2304


def test_tiling_validation():
    with pytest.raises(ValueError, match="multiple"):
        Tiling(8, 1, 5, 8, 2, 4)
    with pytest.raises(ValueError, match="1024"):
        Tiling(8, 1, 64, 64, 1, 1)
    with pytest.raises(ValueError, match="do not fit on one SM"):
        Tiling(8, 1, 16, 64, 1, 1, min_blocks=3)  # 3 x 1024 threads


def test_register_cap_follows_blocks_per_sm():
    assert Tiling(8, 1, 4, 32).max_registers == 255        # 128 threads: ptxas's own limit
    assert Tiling(8, 1, 8, 64, 1, 2).max_registers == 255  # 256 threads x 256 registers fill the SM
    assert Tiling(8, 1, 8, 64, 1, 2, min_blocks=2).max_registers == 128
    assert Tiling(8, 1, 8, 64, 1, 1).max_registers == 128  # 512 threads
    assert Tiling(8, 1, 8, 64, 1, 1, min_blocks=2).max_registers == 64
    assert Tiling(8, 1, 14, 14, min_blocks=2).max_registers == 128  # 7 warps: 2 on some sub-partitions
    with pytest.raises(ValueError, match="shared memory"):
        check_tiling(ConvShape(64, 64, 224, 224, 3, 3), Tiling(8, 16, 32, 64, 1, 4))
    with pytest.raises(ValueError, match="k_block"):
        check_tiling(ConvShape(4, 4, 8, 8, 3, 3), Tiling(8, 1, 4, 4))


def test_placeholders_are_unique_nonzero_and_not_special():
    n = 1 << 17
    bits = np.array([placeholder_bits(i) for i in range(n)], dtype=np.uint32)
    assert len(np.unique(bits)) == n
    vals = bits.view(np.float32)
    assert np.all(vals >= 1.0) and np.all(vals < 2.0)
    mantissa = bits & 0x7FFFFF
    assert np.all(mantissa != 0)          # no power of two (1.0 included)
    assert not np.any(np.isin(vals, [0.0, 0.5, 1.0, 2.0, -1.0, -2.0]))
    assert placeholder_value(5) == struct.unpack("<f", struct.pack("<I", placeholder_bits(5)))[0]
    with pytest.raises(ValueError):
        placeholder_bits(-1)
    with pytest.raises(ValueError):
        placeholder_bits((1 << 23) - 1)


def test_render_puts_each_placeholder_once():
    shape = ConvShape(5, 6, 9, 13, 3, 5, (2, 1), (0, 2))
    t = Tiling(3, 2, 4, 8, 1, 2)
    r = render(shape, t)
    assert len(r.placeholders) == 3 * 2 * 3 * 5
    for bits in r.placeholders:
        assert r.source.count(f"0x{bits:08X}") == 1
    assert sorted(r.placeholders.values()) == sorted(
        (kb, cb, i, j) for kb in range(3) for cb in range(2) for i in range(3) for j in range(5))
    assert "#pragma unroll 1" in r.source


@pytest.mark.parametrize("family", ["direct", "pointwise"])
def test_output_channel_tests_only_where_a_k_block_runs_past_the_channels(family):
    """K_TAIL: with K_PER_GROUP % K_BLOCK == 0 no output channel needs a bounds
    test (the tests were a third of a split 1x1 block's code); the interpreter
    tests (test_numeric_cpu) check both cases compute the convolution."""
    def t(k_block):
        return Tiling(k_block, 2, 1, 32, 1, 1, family="pointwise") if family == "pointwise" else \
            Tiling(k_block, 2, 4, 8, 1, 2)
    assert "#define K_TAIL         0" in render(ConvShape(4, 12, 9, 9, 1, 1), t(4)).source
    assert "#define K_TAIL         1" in render(ConvShape(4, 12, 9, 9, 1, 1), t(8)).source
    assert "#define K_TAIL         0" in render(ConvShape(4, 12, 9, 9, 1, 1, groups=2), t(6)).source  # per group


@pytest.mark.nvcc
@pytest.mark.parametrize("slices", [1, 4])
def test_a_one_pixel_pointwise_body_compiles_to_the_ptx_of_its_loop_form(slices):
    """The pointwise template writes each one-pixel FMA out instead of a
    one-pass #pragma unroll loop, because nvcc took ~1.8x as long on thousands
    of those loops (docs/PERFORMANCE.md, session 25). The generated code must
    not change: put the loops back and compare the PTX."""
    import re

    from sparseconv.compile import compile_to_ptx
    from sparseconv.shapes import Epilogue, Target
    from sparseconv.tilings import pointwise_tiling

    shape = ConvShape(64, 48, 9, 9, 3, 3, padding=(1, 1))
    r = render(shape, pointwise_tiling(shape, 16, 1, 128, slices=slices), Epilogue("relu", residual=True))
    one = re.compile(r"^( +)acc\[(\d+)\]\[0\] = __fmaf_rn\(v\[(\d+)\]\[0\], w, acc\[\d+\]\[0\]\);$", re.M)
    assert len(one.findall(r.source)) == len(r.placeholders) and "i < PIXELS; ++i) acc" not in r.source
    looped = one.sub(lambda m: f"#pragma unroll\n{m.group(1)}for (int i = 0; i < PIXELS; ++i) "
                               f"acc[{m.group(2)}][i] = __fmaf_rn(v[{m.group(3)}][i], w, acc[{m.group(2)}][i]);",
                     r.source)

    def code(ptx):
        return [line for line in ptx.splitlines() if not line.lstrip().startswith("//")]

    assert code(compile_to_ptx(r.source, Target())) == code(compile_to_ptx(looped, Target()))


@pytest.mark.parametrize("out_h, out_w", [(2, 2), (6, 8), (14, 14)])
def test_quad_order_walks_the_output_by_2x2_windows(out_h, out_w):
    """Tiling.pixel_order "quads": the template's SC_PIXEL, evaluated as
    rendered (with pool.QUAD_WALK_CUDA's helpers), maps the image's walk
    onto every pixel once, four consecutive indices a 2x2 window (what a max
    pool among four threads would need); "rows" leaves the walk row-major."""
    import re

    shape = ConvShape(4, 4, out_h, out_w, 1, 1)
    for order in ("quads", "rows"):
        source = render(shape, Tiling(4, 4, 1, 32, family="pointwise", pixel_order=order)).source
        quads = re.search(r"#define PIXEL_QUADS\s+(\d)", source).group(1)
        assert quads == ("1" if order == "quads" else "0")
        # the macro of the #if branch the defines select (integer arithmetic: '/' is C's on non-negative ints)
        branches = re.search(r"#if PIXEL_QUADS\n#define SC_PIXEL\(i\) (.*?)\n#else\n"
                             r"#define SC_PIXEL\(i\) (.*?)\n#endif", source, re.S)
        expr = branches.group(1 if quads == "1" else 2).replace("\\\n", " ")
        expr = expr.replace("OUT_W", str(out_w)).replace("/", "//")
        # the walk's helpers (pool.QUAD_WALK_CUDA) as rendered, where the quads order takes them
        helpers = {name: eval(f"lambda i, windows_w: {body.replace('/', '//')}")
                   for name, body in re.findall(r"int (sc_quad_\w+)\(int i, int windows_w\)\s*\{\s*return (.*?);",
                                                source)}
        assert sorted(helpers) == (["sc_quad_col", "sc_quad_row"] if quads == "1" else [])
        walk = [eval(expr, {"i": i, **helpers}) for i in range(out_h * out_w)]
        assert sorted(walk) == list(range(out_h * out_w))
        if order == "rows":
            assert walk == list(range(out_h * out_w))
            continue
        for start in range(0, out_h * out_w, 4):
            rows = sorted({p // out_w for p in walk[start:start + 4]})
            cols = sorted({p % out_w for p in walk[start:start + 4]})
            assert len(rows) == len(cols) == 2 and rows[0] % 2 == 0 and cols[0] % 2 == 0
            assert rows[1] == rows[0] + 1 and cols[1] == cols[0] + 1


def test_an_epilogue_pool_is_checked_described_and_rendered_only_where_the_kernel_takes_it():
    from dataclasses import replace

    from sparseconv.shapes import Epilogue
    from sparseconv.tilings import pooled_tiling, pools_in_kernel

    with pytest.raises(ValueError, match="pool=True with residual=True"):
        Epilogue(pool=True, residual=True)
    with pytest.raises(TypeError, match="pool must be a bool"):
        Epilogue(pool=1)
    shape = ConvShape(8, 8, 10, 14, 3, 3, padding=(1, 1))
    ep = Epilogue("relu", pool=True)
    assert ep.describe() == "bias -> relu -> max pool 2x2"
    assert ep.output_hw(shape) == (5, 7) and Epilogue().output_hw(shape) == (10, 14)
    assert ep.output_hw(ConvShape(8, 8, 7, 9, 1, 1)) == (3, 4)  # floor mode, as nn.MaxPool2d(2, 2)
    from sparseconv.pool import FUSED_POOL
    from sparseconv.shapes import pooled_hw
    for h, w in [(2, 2), (3, 2), (7, 9), (28, 28), (15, 224)]:  # the one size rule, and the pool kernel's own
        assert pooled_hw(h, w) == FUSED_POOL.output_size(h, w) == (h // 2, w // 2)
    rows = Tiling(8, 4, 1, 64, 1, 1, family="pointwise")
    quads = pooled_tiling(shape, rows)
    assert quads == replace(rows, pixel_order="quads") and pools_in_kernel(shape, quads)
    source = render(shape, quads, ep).source
    assert "#define POOL           1" in source and "__shfl_xor_sync" in source
    assert "#define POOL           0" in render(shape, quads, Epilogue("relu")).source
    # what cannot pool among its threads keeps its tiling, and render refuses the pool for it
    for tiling, why in [(replace(rows, slices=2), "split"), (Tiling(8, 4, 4, 8), "direct"),
                        (Tiling(8, 4, 1, 48, 1, 1, family="pointwise"), "partial warps")]:
        assert pooled_tiling(shape, tiling) == tiling and not pools_in_kernel(shape, tiling), why
        with pytest.raises(ValueError, match="cannot take the pool in the kernel"):
            render(shape, tiling, ep)
    odd = ConvShape(8, 8, 7, 9, 1, 1)
    assert pooled_tiling(odd, rows) == rows and not pools_in_kernel(odd, rows)
