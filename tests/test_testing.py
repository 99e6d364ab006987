"""CPU: sparseconv.testing, the yardstick itself: the float64 reference conv
against torch.nn.functional.conv2d (float64, CPU), the pruned-weight makers."""
import numpy as np
import pytest

from sparseconv.testing import conv2d_reference, magnitude_prune, pruned_weight, relative_l2

CASES = [  # (C, K, H, W, R, S, stride, padding, dilation, groups)
    (3, 4, 9, 11, 3, 3, (1, 1), (1, 1), (1, 1), 1),
    (2, 3, 13, 12, 5, 3, (2, 3), (2, 0), (1, 1), 1),
    (4, 6, 10, 10, 3, 3, (1, 1), (2, 2), (2, 2), 2),
    (6, 6, 8, 7, 3, 3, (2, 1), (1, 1), (1, 2), 6),  # depthwise
    (3, 5, 17, 17, 11, 11, (4, 4), (2, 2), (1, 1), 1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_conv_has_torch_conv2d_semantics(case):
    torch = pytest.importorskip("torch")
    c, k, h, w, r, s, stride, padding, dilation, groups = case
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, c, h, w))
    wt = pruned_weight(rng, (k, c // groups, r, s), 0.5).astype(np.float64)
    b = rng.standard_normal(k)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(wt), torch.from_numpy(b), stride,
                                      padding, dilation, groups).numpy()
    got = conv2d_reference(x, wt, b, stride, padding, dilation, groups)
    assert got.dtype == np.float64 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_pruned_weight_zeroes_the_fraction_and_the_first_channels():
    w = pruned_weight(np.random.default_rng(1), (64, 32, 3, 3), 0.7, zero_channels=2)
    assert w.dtype == np.float32 and not w[:2].any()
    assert abs(np.mean(w[2:] == 0) - 0.7) < 0.02


def test_magnitude_prune_keeps_the_largest_and_leaves_its_input_alone():
    w = np.array([[0.1, -3.0], [2.0, -0.2]], np.float32)
    p = magnitude_prune(w, 0.5)
    np.testing.assert_array_equal(p, [[0.0, -3.0], [2.0, 0.0]])
    assert w[0, 0] == np.float32(0.1) and magnitude_prune(w, 0.0) is not w


def test_relative_l2_edges():
    assert relative_l2(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_l2(np.ones(3), np.zeros(3)) == float("inf")
    assert relative_l2(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(1.0)
