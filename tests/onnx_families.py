"""Small CNNs of the families exporters ship (MobileNetV3-like with squeeze-
excite and hardswish, a ResNet basic block, a UNet/FPN-like head), pruned to
90% by magnitude and exported with torch.onnx.export in two weight forms:
as exported (initializers), and with every initializer moved into Constant
nodes behind Cast and Identity (what other exporters and optimisers write).
Shared by test_onnx_exporters.py (CPU) and test_gpu_onnx.py (GPU)."""
import warnings
from pathlib import Path
from typing import Tuple

import numpy as np

FAMILIES = ("mobilenetv3", "resnet_block", "unet_head")
FORMS = ("initializers", "constants")
SIZE = (16, 16)


def _modules():
    import torch.nn as nn
    import torch.nn.functional as F
    import torch

    class SqueezeExcite(nn.Module):  # GlobalAveragePool -> Conv -> ReLU -> Conv -> HardSigmoid -> Mul
        def __init__(self, c: int, r: int) -> None:
            super().__init__()
            self.pool, self.fc1, self.fc2 = nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, r, 1), nn.Conv2d(r, c, 1)

        def forward(self, x):
            return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(self.pool(x)))))

    class MobileNetV3Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem, self.bn = nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8)
            self.dw, self.se, self.pw = nn.Conv2d(8, 8, 3, 1, 1, groups=8), SqueezeExcite(8, 2), nn.Conv2d(8, 8, 1)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            x = F.hardswish(self.bn(self.stem(x)))
            y = self.pw(self.se(F.relu6(self.dw(x))))
            return self.head((x + y).mean((2, 3)))

    class ResNetBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
            self.c2, self.b2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
            self.c3, self.down = nn.Conv2d(8, 16, 3, 2, 1), nn.Conv2d(8, 16, 1, 2)
            self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(16, 4)

        def forward(self, x):
            x = F.relu(self.b1(self.c1(x)))
            x = F.relu(x + self.b2(self.c2(x)))
            x = self.pool(F.relu(self.c3(x) + self.down(x)))
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    class UNetHead(nn.Module):
        """Resize to another tensor's size (nearest), by a scale (bilinear,
        half_pixel), to the input's size (bilinear, align_corners); a
        ConvTranspose and a Concat skip."""

        def __init__(self) -> None:
            super().__init__()
            self.e1, self.e2, self.e3 = nn.Conv2d(3, 8, 3, 1, 1), nn.Conv2d(8, 16, 3, 2, 1), nn.Conv2d(16, 16, 3, 2, 1)
            self.up, self.lat = nn.ConvTranspose2d(16, 8, 2, 2), nn.Conv2d(16, 8, 1)
            self.d, self.out = nn.Conv2d(16, 8, 3, 1, 1), nn.Conv2d(8, 2, 1)

        def forward(self, x):
            a = F.relu(self.e1(x))
            b = F.relu(self.e2(a))
            c = F.relu(self.e3(b))
            p = self.lat(b) + F.interpolate(self.up(c), size=b.shape[2:], mode="nearest")
            q = torch.cat([F.interpolate(p, scale_factor=2.0, mode="bilinear", align_corners=False), a], 1)
            r = self.out(F.relu(self.d(q)))
            return torch.sigmoid(F.interpolate(r, size=(x.shape[2], x.shape[3]), mode="bilinear",
                                               align_corners=True))

    return {"mobilenetv3": MobileNetV3Block, "resnet_block": ResNetBlock, "unet_head": UNetHead}


def build(family: str, seed: int = 0):
    """The family's module in eval mode, BN statistics set, every conv (and
    the ConvTranspose) pruned to 90% by magnitude."""
    import torch
    import torch.nn as nn
    from torch.nn.utils import prune

    torch.manual_seed(seed)
    model = _modules()[family]()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            prune.l1_unstructured(m, "weight", amount=0.9)
            prune.remove(m, "weight")
    return model.eval()


def export(family: str, path: Path, form: str = "initializers", dynamic_hw: bool = False) -> Path:
    """Export with the legacy TorchScript exporter (the dynamo one needs
    onnxscript), batch always dynamic; image size dynamic when asked (then
    `--input-size` must fix it). form="constants" moves the weights."""
    import torch

    model = build(family)
    axes = {0: "N", 2: "H", 3: "W"} if dynamic_hw else {0: "N"}
    with warnings.catch_warnings():  # the legacy exporter warns that it is legacy
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(model, (torch.zeros(1, 3, *SIZE),), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": axes, "y": {0: "N"}})
    if form == "constants":
        move_weights_into_constant_nodes(path)
    return path


def move_weights_into_constant_nodes(path: Path) -> None:
    """Every initializer becomes a Constant node; float ones are stored in
    float64 and reach their old name through Cast(to=float) and Identity, a
    static subgraph the importer must fold."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    front = []
    for t in graph.initializer:
        a = numpy_helper.to_array(t)
        if a.dtype == np.float32:
            front += [helper.make_node("Constant", [], [t.name + "/f64"], value=numpy_helper.from_array(
                          a.astype(np.float64), t.name + "/f64")),
                      helper.make_node("Cast", [t.name + "/f64"], [t.name + "/f32"], to=TensorProto.FLOAT),
                      helper.make_node("Identity", [t.name + "/f32"], [t.name])]
        else:
            front.append(helper.make_node("Constant", [], [t.name], value=t))
    nodes = front + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def inputs(n: int = 3, size: Tuple[int, int] = SIZE, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3) + tuple(size)).astype(np.float32)


def onnxruntime_outputs(path: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]
