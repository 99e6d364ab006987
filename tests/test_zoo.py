"""CPU: model layer specs and the pruned-weight generator."""
import numpy as np
import pytest

from sparseconv.testing import he_pruned_weight, magnitude_prune
from sparseconv.zoo import find_layer, model_layers


def test_vgg16_has_13_convs_ending_at_14x14():
    layers = model_layers("vgg16")
    assert len(layers) == 13
    assert sum(s.out_channels * s.c_per_group * 9 for _, s in layers) == 14_710_464  # VGG-16 conv weights
    assert layers[-1][1].out_h == 14 and layers[0][1].in_channels == 3


def test_resnet50_has_53_convs_with_torchvision_shapes():
    layers = dict(model_layers("resnet50"))
    assert len(layers) == 53
    total = sum(s.out_channels * s.c_per_group * s.kernel_h * s.kernel_w for s in layers.values())
    assert total == 23_454_912  # ResNet-50 conv weights (torchvision), fc excluded
    assert layers["layer4.2.conv3"].out_h == 7 and layers["layer4.2.conv3"].out_channels == 2048
    assert layers["layer2.0.conv2"].stride == (2, 2) and layers["layer2.0.downsample"].out_h == 28


def test_magnitude_prune_zeroes_the_smallest():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    p = magnitude_prune(w, 0.9)
    assert abs(np.mean(p == 0) - 0.9) < 0.01
    assert np.abs(p[p != 0]).min() >= np.abs(w[p == 0]).max()


def test_he_pruned_weight_is_seeded_scaled_and_pruned():
    w = he_pruned_weight(np.random.default_rng(3), (32, 16, 3, 3), 0.8)
    assert w.dtype == np.float32 and abs(np.mean(w == 0) - 0.8) < 0.01
    np.testing.assert_array_equal(w, he_pruned_weight(np.random.default_rng(3), (32, 16, 3, 3), 0.8))
    # He scale: std sqrt(2 / (C*R*S)) before pruning, so no survivor is wildly out of it
    assert np.abs(w).max() < 6 * np.sqrt(2.0 / (16 * 9))


def test_find_layer_names_network_and_layer_or_says_what_is_expected():
    """The bench probes' --layers check: "<network>:<layer>", among the networks a probe takes."""
    assert find_layer("mnasnet1_0:layers.12.1.layers.3") == dict(model_layers("mnasnet1_0"))["layers.12.1.layers.3"]
    assert find_layer("vgg16:conv5_1", ("resnet50", "vgg16")).in_h == 14
    for text, networks, message in [
            ("resnet50:layer9.conv1", ("resnet50", "vgg16"), "'resnet50:layer9.conv1' is not <resnet50|vgg16>:<layer>"),
            ("mobilenet_v2:features.1.conv.0.0", ("resnet50", "vgg16"),  # a zoo network this probe does not take
             "'mobilenet_v2:features.1.conv.0.0' is not <resnet50|vgg16>:<layer>"),
            ("conv1", ("resnet50",), "'conv1' is not <resnet50>:<layer>")]:
        with pytest.raises(ValueError) as e:
            find_layer(text, networks)
        assert str(e.value) == message
