"""CPU: pruned fully connected layers (compile_linear): their shape and
tilings, the specialised PTX of a Linear layer run in the PTX interpreter
against float64 x @ W.T + b, and the argument errors raised before any build."""
import numpy as np
import pytest

import sparseconv
from sparseconv.api import LINEAR_SPLIT_THREADS, LINEAR_THREADS, linear_shape, linear_variants
from sparseconv.compile import compile_to_ptx
from sparseconv.limits import LimitError, check_layer
from sparseconv.render import render
from sparseconv.shapes import ConvShape, Epilogue, Target, n_chunks, n_kblocks
from sparseconv.tilings import ANY_BATCH
from sparseconv.specialise import specialise
from sparseconv.testing import pruned_weight, relative_l2

from specialised_runs import run_ptx


def test_a_linear_layer_is_a_1x1_conv_on_a_1x1_input():
    s = linear_shape(40, 24)
    assert s == ConvShape(40, 24, 1, 1, 1, 1)
    assert (s.out_h, s.out_w, s.weight_shape) == (1, 1, (24, 40, 1, 1))


def test_linear_variants_use_the_pointwise_family_with_few_threads():
    """Pixels = batch: one warp for the split small-batch variant, two warps for
    any batch (not the 512 threads a deep 1x1 conv gets, most of which would
    walk the code without a pixel)."""
    fc7 = linear_shape(4096, 4096)
    (small_up_to, small), (up_to, whole) = linear_variants(fc7)
    assert up_to == ANY_BATCH and small_up_to == 16
    assert {small.family, whole.family} == {"pointwise"}
    assert (small.threads, whole.threads) == (LINEAR_SPLIT_THREADS, LINEAR_THREADS) == (32, 64)
    assert whole.slices == 1 and small.slices == 32 and small.k_block == whole.k_block == 64
    assert sparseconv.default_tiling(fc7).threads == 512  # the conv default it departs from
    # a narrow classifier head: one block covers every output; too short a reduction to split
    head = linear_variants(linear_shape(256, 10))
    assert len(head) == 1 and (head[0][1].k_block, head[0][1].slices, head[0][1].threads) == (10, 1, 64)
    # 512 inputs: 4 chunks of 128, split 4 ways up to batch 16
    assert [(u, t.slices) for u, t in linear_variants(linear_shape(512, 10))] == [(16, 4), (ANY_BATCH, 1)]


def test_vgg16_classifier_limits():
    """fc7 and fc8 build; fc6 (25088->4096, 103M weights) needs more copies of
    the kernel body than the build limit and is refused, naming the fix."""
    for cin, cout in ((4096, 4096), (4096, 1000)):
        for _, t in linear_variants(linear_shape(cin, cout)):
            check_layer(linear_shape(cin, cout), t)
    fc6 = linear_shape(25088, 4096)
    _, whole = linear_variants(fc6)[-1]
    assert n_kblocks(fc6, whole) * n_chunks(fc6, whole) > 16384
    with pytest.raises(LimitError, match="leave this layer to cuDNN"):
        check_layer(fc6, whole)


def _run(ptx, rendered, x, bias):
    """The specialised kernel in the interpreter on x (N, C), as the run time launches it."""
    n = x.shape[0]
    y = run_ptx(ptx, rendered, np.ascontiguousarray(x.reshape(n, -1, 1, 1)), bias)
    return y.reshape(n, rendered.shape.out_channels)


@pytest.mark.nvcc
@pytest.mark.parametrize("cin, cout, which", [(40, 24, -1), (512, 10, 0)])
def test_specialised_linear_computes_relu_x_wt_plus_b(cin, cout, which):
    """40->24 at batch 3 (the any-batch variant) and 512->10 through its split
    variant (4 slices): relu(x @ W.T + b) against float64."""
    shape = linear_shape(cin, cout)
    variants = linear_variants(shape)
    if which == 0:
        assert len(variants) == 2 and variants[0][1].slices > 1
    tiling = variants[which][1]
    rendered = render(shape, tiling, Epilogue("relu"))
    tptx = compile_to_ptx(rendered.source, Target(), f"linear_{cin}_{cout}")
    rng = np.random.default_rng(12)
    w = pruned_weight(rng, (cout, cin), 0.8)
    w[1] = 0.0  # an output with no weight: its bias, through the relu
    b = rng.standard_normal(cout).astype(np.float32)
    x = rng.standard_normal((3, cin)).astype(np.float32)
    ptx, stats = specialise(tptx, rendered, w.reshape(cout, cin, 1, 1))
    y = _run(ptx, rendered, x, b)
    ref = np.maximum(x.astype(np.float64) @ w.T.astype(np.float64) + b, 0.0)
    assert not np.isnan(y).any()
    assert relative_l2(y, ref) <= 1e-6
    assert stats.fmas_deleted > 0
    np.testing.assert_array_equal(y[:, 1], np.float32(max(b[1], 0.0)))


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(weight=np.ones((4, 3, 1, 1), np.float32)), ValueError, r"fc1: weight must be 2-D \(out_features, "),
    (dict(weight=np.ones((4,), np.float32)), ValueError, "fc1: weight must be 2-D"),
    (dict(weight=np.ones((0, 3), np.float32)), ValueError, "at least one input and one output"),
    (dict(weight=np.ones((4, 3), np.int32)), TypeError, "fc1: weight must be a floating-point array"),
    (dict(bias=np.ones(3, np.float32)), ValueError, r"fc1: bias must have shape \(4,\)"),
    (dict(activation="gelu"), ValueError, "fc1: activation must be one of"),
    (dict(clip=(0.0, 1.0)), ValueError, "fc1: clip=.* with activation='clip'"),
    (dict(activation="clip", clip=(2.0, 1.0)), ValueError, "lo <= hi"),
    (dict(target="gfx90a"), ValueError, "fc1: target arch must look like 'sm_90'"),
    (dict(target=90), TypeError, "fc1: target must be a sparseconv.Target"),
    (dict(tiling="fast"), ValueError, "fc1: tiling must be a Tiling, None or 'auto'"),
    (dict(backend="cublas"), ValueError, "fc1: backend must be 'sparseconv' or 'auto'"),
    (dict(progress=1), TypeError, "fc1: progress must be True or False, got 1"),
])
def test_compile_linear_refuses_bad_arguments_before_building(tmp_path, kwargs, error, needle):
    args = dict(weight=np.ones((4, 3), np.float32), name="fc1", cache_dir=str(tmp_path), target="sm_90")
    args.update(kwargs)
    with pytest.raises(error, match=needle):
        sparseconv.compile_linear(args.pop("weight"), **args)
    assert not any(tmp_path.iterdir()), "nothing may be built or cached"


def test_compile_linear_refuses_a_layer_over_the_limits_before_building(tmp_path):
    w = np.zeros((4096, 25088), np.float32)
    w[::7, ::3] = 1.0
    with pytest.raises(LimitError, match="copies of its body"):
        sparseconv.compile_linear(w, name="fc6", cache_dir=str(tmp_path), target="sm_90")
    assert not any(tmp_path.iterdir())
