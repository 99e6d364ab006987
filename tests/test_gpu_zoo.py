"""GPU: a sample of the big VGG-16 / ResNet-50 layers (ImageNet shapes, 90% sparse)
against the float64 reference. bench/compile_model.py --check runs all of them."""
import numpy as np
import pytest

import sparseconv
from sparseconv.zoo import model_layers

from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.gpu

# The biggest shapes (512x512 3x3), a strided 3x3, the 7x7 stem and a 2048-channel 1x1.
SAMPLE = [("vgg16", "conv5_3"), ("resnet50", "conv1"), ("resnet50", "layer3.0.conv2"),
          ("resnet50", "layer4.2.conv1"), ("resnet50", "layer4.2.conv2")]


@pytest.mark.parametrize("model, layer", SAMPLE, ids=[f"{m}-{n}" for m, n in SAMPLE])
def test_big_layer_matches_reference(model, layer, session_cache_dir):
    import cupy as cp

    shape = dict(model_layers(model))[layer]
    rng = np.random.default_rng()
    w = pruned_weight(rng, shape.weight_shape, 0.9)
    bias = rng.standard_normal(shape.out_channels).astype(np.float32)
    conv = sparseconv.compile_conv2d(w, input_size=(shape.in_h, shape.in_w), bias=bias, stride=shape.stride,
                                     padding=shape.padding, cache_dir=str(session_cache_dir), name=layer)
    x = cp.asarray(rng.standard_normal((2, shape.in_channels, shape.in_h, shape.in_w)).astype(np.float32))
    y = conv(x, out=cp.full(conv.output_shape(2), np.nan, cp.float32))
    ref = conv2d_reference(x, cp.asarray(w), cp.asarray(bias), shape.stride, shape.padding, xp=cp)
    assert not bool(cp.isnan(y).any())
    assert relative_l2(y, ref, xp=cp) <= 1e-5
