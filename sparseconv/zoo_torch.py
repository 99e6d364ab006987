"""ResNet-50, VGG-16, ResNeXt-50, MobileNetV2 and MNASNet 1.0 as torch
modules, for the whole-network bench.

torchvision is not a dependency, so these are small faithful copies of
torchvision's definitions (ResNet-50 v1.5: the stride sits in the 3x3 conv of
each bottleneck; VGG-16 without BN, with torchvision's classifier;
ResNeXt-50 32x4d: ResNet-50 with 32-group 3x3 convs twice as wide;
MobileNetV2: depthwise 3x3 convs between 1x1 expansions and projections,
ReLU6; MNASNet 1.0: the same with ReLU and 5x5 depthwise convs in three of
its six stacks), with the same parameter names and counts (25,557,032,
138,357,544, 25,028,904, 3,504,872 and 4,383,312), seeded random weights,
and every conv prunable to a given sparsity by magnitude. The last three
bring the layer classes the first two lack: grouped and depthwise convs.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from .zoo import MNASNET_DEPTHS, MNASNET_STACKS, MOBILENET_V2_SETTING, RESNET50_STAGES


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 groups: int = 1, out: Optional[int] = None) -> None:
        super().__init__()
        out = width * self.expansion if out is None else out
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    # ResNet-50 has one group of 64 channels a bottleneck per 64 of its planes; ResNeXt-50 32x4d, 32 of 4
    GROUPS, WIDTH_PER_GROUP = 1, 64

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        c_in = 64
        for i, (planes, blocks, stride) in enumerate(RESNET50_STAGES, 1):
            width = planes * self.WIDTH_PER_GROUP // 64 * self.GROUPS
            layers: List[nn.Module] = []
            for b in range(blocks):
                s = stride if b == 0 else 1
                down = None
                if b == 0 and (s != 1 or c_in != planes * 4):
                    down = nn.Sequential(nn.Conv2d(c_in, planes * 4, 1, stride=s, bias=False),
                                         nn.BatchNorm2d(planes * 4))
                layers.append(Bottleneck(c_in, width, s, down, self.GROUPS, planes * 4))
                c_in = planes * 4
            setattr(self, f"layer{i}", nn.Sequential(*layers))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResNeXt50(ResNet50):
    """ResNeXt-50 32x4d (torchvision's resnext50_32x4d): 3x3 convs of 32 groups."""
    GROUPS, WIDTH_PER_GROUP = 32, 4


def conv_bn_relu6(c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """torchvision's Conv2dNormActivation with ReLU6: the names its state dict uses (0 conv, 1 BN)."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.use_res_connect = stride == 1 and c_in == c_out
        layers: List[nn.Module] = [conv_bn_relu6(c_in, hidden, 1)] if expand != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),  # depthwise
                   nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out)]  # linear projection: no ReLU
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: List[nn.Module] = [conv_bn_relu6(3, 32, 3, 2)]
        c_in = 32
        for t, c, n, s in MOBILENET_V2_SETTING:
            for i in range(n):
                layers.append(InvertedResidual(c_in, c, s if i == 0 else 1, t))
                c_in = c
        layers.append(conv_bn_relu6(c_in, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


class MNASNetBlock(nn.Module):
    """torchvision's mnasnet._InvertedResidual: 1x1 expansion, depthwise k x k, 1x1 projection (no ReLU)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = c_in * expand
        self.apply_residual = c_in == c_out and stride == 1
        self.layers = nn.Sequential(
            nn.Conv2d(c_in, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, hidden, kernel, stride, kernel // 2, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU(inplace=True),
            nn.Conv2d(hidden, c_out, 1, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) + x if self.apply_residual else self.layers(x)


class MNASNet(nn.Module):
    """torchvision's mnasnet1_0 (BN momentum aside, which eval mode does not use)."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        d = MNASNET_DEPTHS
        layers: List[nn.Module] = [
            nn.Conv2d(3, d[0], 3, 2, 1, bias=False), nn.BatchNorm2d(d[0]), nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[0], 3, 1, 1, groups=d[0], bias=False), nn.BatchNorm2d(d[0]), nn.ReLU(inplace=True),
            nn.Conv2d(d[0], d[1], 1, bias=False), nn.BatchNorm2d(d[1])]
        c_in = d[1]
        for (kernel, stride, expand, blocks), c in zip(MNASNET_STACKS, d[2:]):
            layers.append(nn.Sequential(*[MNASNetBlock(c_in if b == 0 else c, c, kernel, stride if b == 0 else 1,
                                                       expand) for b in range(blocks)]))
            c_in = c
        layers += [nn.Conv2d(c_in, 1280, 1, bias=False), nn.BatchNorm2d(1280), nn.ReLU(inplace=True)]
        self.layers = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.layers(x).mean([2, 3]))


class VGG16(nn.Module):
    CFG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        c_in = 3
        for v in self.CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c_in, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                c_in = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(0.5),
                                        nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(0.5),
                                        nn.Linear(4096, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


NETWORKS: Dict[str, Callable[[], nn.Module]] = {"resnet50": ResNet50, "vgg16": VGG16, "resnext50": ResNeXt50,
                                                "mobilenet_v2": MobileNetV2, "mnasnet1_0": MNASNet}


def prune_convs_(model: nn.Module, sparsity: float, *, rescale: bool = False,
                 linears: bool = False) -> nn.Module:
    """Zero the smallest-magnitude fraction `sparsity` of every conv's weights
    (and every nn.Linear's with linears=True), in place. rescale=True
    multiplies the survivors by 1/sqrt(1 - sparsity), keeping each layer's
    output variance (as fine-tuning after pruning would), so a deep random
    network does not fade to its biases."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    kinds = (nn.Conv2d, nn.Linear) if linears else (nn.Conv2d,)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, kinds):
                w = m.weight
                k = int(round(sparsity * w.numel()))
                if k:
                    order = torch.argsort(w.abs().flatten(), stable=True)
                    w.view(-1)[order[:k]] = 0.0
                    if rescale:
                        w.mul_(1.0 / (1.0 - sparsity) ** 0.5)
    return model


def build_network(name: str, *, sparsity: float = 0.9, seed: int = 0, prune_linears: bool = False) -> nn.Module:
    """A built-in network in eval mode with seeded random weights: torchvision's
    init (Kaiming normal convs, N(0, 0.01) linears), every conv (and with
    prune_linears every nn.Linear: the classifier) pruned to `sparsity` by
    magnitude (survivors rescaled), then BN statistics measured on a random
    batch and random BN affine parameters, so folding them matters and the
    logits are far from ties (top-1 agreement means something)."""
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; built in: {', '.join(NETWORKS)}")
    rng_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = NETWORKS[name]()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                    if m.bias is not None:
                        nn.init.zeros_(m.bias)
                elif isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, 0, 0.01)
                    nn.init.zeros_(m.bias)
        prune_convs_(model, sparsity, rescale=True, linears=prune_linears)
        bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
        if bns:
            for m in bns:
                m.momentum = None            # cumulative average over the calibration batch
            model.train()
            with torch.no_grad():
                model(torch.randn(4, 3, 64, 64))
                for m in bns:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.2, 0.2)
                    m.momentum = 0.1
    finally:
        torch.random.set_rng_state(rng_state)
    return model.eval()
