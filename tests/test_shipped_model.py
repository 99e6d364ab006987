"""CPU: the shipped pruned LeNet (models/lenet_digits_pruned.onnx) imports, is >= 90%
sparse over its conv weights, compiles, and its specialised conv kernels compute
the right thing (PTX interpreter vs float64 reference)."""
import json

import numpy as np
import pytest

from sparseconv.build import build_conv2d
from sparseconv.cache import ArtifactCache
from sparseconv.model import load_model

from ptx_interpreter import run_kernel
from sparseconv.testing import conv2d_reference, relative_l2
from shipped_models import MODELS

pytest.importorskip("onnx")


def test_shipped_model_matches_its_record():
    m = load_model(MODELS / "lenet_digits_pruned.onnx")
    record = json.loads((MODELS / "lenet_digits.json").read_text())
    assert [(layer.shape.in_channels, layer.shape.out_channels, layer.shape.in_h) for layer in m.layers] == \
        [(1, 20, 8), (20, 50, 4)]
    zeros = sum(int(np.sum(layer.weight == 0)) for layer in m.layers)
    total = sum(layer.weight.size for layer in m.layers)
    assert zeros / total >= 0.9 and abs(zeros / total - record["conv_weight_sparsity_total"]) < 1e-6
    assert record["pruned_test_accuracy"] >= 0.95 and record["dense_test_accuracy"] >= 0.95


@pytest.mark.nvcc
def test_shipped_model_conv_kernels_compute_the_convolution(tmp_path):
    m = load_model(MODELS / "lenet_digits_pruned.onnx")
    rng = np.random.default_rng()
    for layer in m.layers:
        built = build_conv2d(layer.weight, layer.shape, cache=ArtifactCache(tmp_path), name=layer.name)
        ptx = ArtifactCache(tmp_path).get_text("kernel", built.ptx_sha256, ".ptx")
        s, t = layer.shape, built.tiling
        x = rng.random((3, s.in_channels, s.in_h, s.in_w)).astype(np.float32)
        y = np.full((3, s.out_channels, s.out_h, s.out_w), np.nan, np.float32)
        run_kernel(ptx, built.entry, grid=built.grid(3), block=(t.threads, 1, 1),
                   args=[x, y, layer.bias, 0, 3, built.chunks], dynamic_shared_bytes=built.shared_bytes)
        ref = conv2d_reference(x, layer.weight, layer.bias, s.stride, s.padding)
        assert not np.isnan(y).any() and relative_l2(y, ref) <= 1e-5, layer.name
