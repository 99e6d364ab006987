"""Conv layer shapes of VGG-16, ResNet-50, ResNeXt-50 32x4d, MobileNetV2 and MNASNet 1.0 (torchvision, ImageNet
224x224 input), and seeded pruned weights for them (models/make_pruned_zoo.py writes those to .npz)."""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import numpy as np

from .shapes import ConvShape
from .testing import he_pruned_weight


def vgg16() -> List[Tuple[str, ConvShape]]:
    plan = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
            (256, 256, 56), (256, 512, 28), (512, 512, 28), (512, 512, 28), (512, 512, 14), (512, 512, 14),
            (512, 512, 14)]
    names = ["conv1_1", "conv1_2", "conv2_1", "conv2_2", "conv3_1", "conv3_2", "conv3_3", "conv4_1", "conv4_2",
             "conv4_3", "conv5_1", "conv5_2", "conv5_3"]
    return [(n, ConvShape(c, k, h, h, 3, 3, (1, 1), (1, 1))) for n, (c, k, h) in zip(names, plan)]


# (planes, bottlenecks, stride of the first) of ResNet-50's four stages, torchvision's; zoo_torch builds from it too
RESNET50_STAGES = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))
# (expansion, output channels, blocks, stride of the first), torchvision's inverted_residual_setting
MOBILENET_V2_SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                        (6, 320, 1, 1))

# MNASNet 1.0 (B1), torchvision's: channels of the stem, the separable conv and the six stacks; then per stack
# (kernel of its depthwise convs, stride of the first block, expansion, blocks)
MNASNET_DEPTHS = (32, 16, 24, 40, 80, 96, 192, 320)
MNASNET_STACKS = ((3, 2, 3, 3), (5, 2, 3, 3), (5, 2, 6, 3), (3, 1, 6, 2), (5, 2, 6, 4), (3, 1, 6, 1))


def resnet50(groups: int = 1, width_per_group: int = 64) -> List[Tuple[str, ConvShape]]:
    """53 convs: the stem, then per bottleneck 1x1 -> 3x3 (stride here, v1.5) -> 1x1, plus one
    1x1 downsample in the first block of each stage. groups / width_per_group as torchvision's
    (ResNeXt-50 32x4d: 32 / 4, its 3x3 convs in 32 groups, twice ResNet-50's width)."""
    layers = [("conv1", ConvShape(3, 64, 224, 224, 7, 7, (2, 2), (3, 3)))]
    c_in, size = 64, 56
    for stage, (planes, blocks, stride) in enumerate(RESNET50_STAGES, 1):
        width = planes * width_per_group // 64 * groups
        for b in range(blocks):
            s = stride if b == 0 else 1
            out = size // s
            p = f"layer{stage}.{b}"
            layers.append((f"{p}.conv1", ConvShape(c_in, width, size, size, 1, 1)))
            layers.append((f"{p}.conv2", ConvShape(width, width, size, size, 3, 3, (s, s), (1, 1), groups=groups)))
            layers.append((f"{p}.conv3", ConvShape(width, 4 * planes, out, out, 1, 1)))
            if b == 0:
                layers.append((f"{p}.downsample", ConvShape(c_in, 4 * planes, size, size, 1, 1, (s, s))))
            c_in, size = 4 * planes, out
    return layers


def resnext50() -> List[Tuple[str, ConvShape]]:
    """ResNeXt-50 32x4d's 53 convs, named as ResNet-50's."""
    return resnet50(groups=32, width_per_group=4)


def mobilenet_v2() -> List[Tuple[str, ConvShape]]:
    """52 convs, named as torchvision's (and zoo_torch.MobileNetV2's) modules:
    the stem, then per inverted residual a 1x1 expansion (not in the first),
    a depthwise 3x3 (the stride here) and a 1x1 projection; a last 1x1 to 1280."""
    layers = [("features.0.0", ConvShape(3, 32, 224, 224, 3, 3, (2, 2), (1, 1)))]
    c_in, size, i = 32, 112, 1
    for t, c, n, s in MOBILENET_V2_SETTING:
        for b in range(n):
            stride = s if b == 0 else 1
            hidden, p, j = c_in * t, f"features.{i}.conv", 0
            if t != 1:
                layers.append((f"{p}.0.0", ConvShape(c_in, hidden, size, size, 1, 1)))
                j = 1
            layers.append((f"{p}.{j}.0", ConvShape(hidden, hidden, size, size, 3, 3, (stride, stride), (1, 1),
                                                   groups=hidden)))
            size //= stride
            layers.append((f"{p}.{j + 1}", ConvShape(hidden, c, size, size, 1, 1)))
            c_in, i = c, i + 1
    layers.append((f"features.{i}.0", ConvShape(c_in, 1280, size, size, 1, 1)))
    return layers


def mnasnet1_0() -> List[Tuple[str, ConvShape]]:
    """52 convs, named as torchvision's (and zoo_torch.MNASNet's) modules: the
    stem, a depthwise 3x3 and a 1x1, then per inverted residual a 1x1
    expansion, a depthwise 3x3 or 5x5 (the stride here) and a 1x1 projection;
    a last 1x1 to 1280. Its ten 5x5 depthwise convs are a class the other
    networks lack."""
    d = MNASNET_DEPTHS
    layers = [("layers.0", ConvShape(3, d[0], 224, 224, 3, 3, (2, 2), (1, 1))),
              ("layers.3", ConvShape(d[0], d[0], 112, 112, 3, 3, (1, 1), (1, 1), groups=d[0])),
              ("layers.6", ConvShape(d[0], d[1], 112, 112, 1, 1))]
    c_in, size = d[1], 112
    for i, ((kernel, stride, expand, blocks), c) in enumerate(zip(MNASNET_STACKS, d[2:])):
        for b in range(blocks):
            s = stride if b == 0 else 1
            hidden, p = c_in * expand, f"layers.{8 + i}.{b}.layers"
            layers.append((f"{p}.0", ConvShape(c_in, hidden, size, size, 1, 1)))
            layers.append((f"{p}.3", ConvShape(hidden, hidden, size, size, kernel, kernel, (s, s),
                                               (kernel // 2, kernel // 2), groups=hidden)))
            size //= s
            layers.append((f"{p}.6", ConvShape(hidden, c, size, size, 1, 1)))
            c_in = c
    layers.append(("layers.14", ConvShape(c_in, 1280, size, size, 1, 1)))
    return layers


MODELS: Dict[str, object] = {"vgg16": vgg16, "resnet50": resnet50, "resnext50": resnext50, "mobilenet_v2": mobilenet_v2,
                             "mnasnet1_0": mnasnet1_0}


def model_layers(name: str) -> List[Tuple[str, ConvShape]]:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]()  # type: ignore[operator]


def find_layer(text: str, networks: Sequence[str] = tuple(MODELS)) -> ConvShape:
    """The shape of a layer named "<network>:<layer>" (e.g. resnet50:layer4.1.conv2), the network one of
    `networks`; ValueError saying what is expected otherwise (the bench probes' --layers)."""
    net, _, name = text.partition(":")
    layers = dict(model_layers(net)) if net in networks else {}
    if name not in layers:
        raise ValueError(f"{text!r} is not <{'|'.join(networks)}>:<layer>")
    return layers[name]


def pruned_model(name: str, sparsity: float, seed: int = 0) -> List[Tuple[str, ConvShape, np.ndarray]]:
    """(layer name, shape, weight) of every conv: He-initialised, magnitude-pruned
    per layer to `sparsity`, deterministic for a seed."""
    rng = np.random.default_rng(seed)
    return [(layer, shape, he_pruned_weight(rng, shape.weight_shape, sparsity))
            for layer, shape in model_layers(name)]
