"""The torch.fx front end on torchvision's CNN families, on the CPU: each model's
convs pruned to 90% zeros by magnitude (zoo_torch.prune_convs_, as the
built-in networks are; BN statistics randomised so folding is checked), traced and fused by `sparseconv.fx.prepare` in float64, and its
output compared with the original's. Prints, per model, whether it traced,
the relative error, and what each conv had fused into it (or why it was kept).

    pip install torchvision   # not a sparseconv dependency; match your torch
    python bench/torchvision_front_end.py [model ...]

No GPU and no compiling: this checks the graph passes, not the kernels."""
from __future__ import annotations

import sys
import time
from collections import Counter

import torch
from torch import nn

from sparseconv.fx import prepare
from sparseconv.zoo_torch import prune_convs_

MODELS = ["mobilenet_v2", "mobilenet_v3_small", "densenet121", "efficientnet_b0", "squeezenet1_1", "regnet_y_400mf",
          "convnext_tiny", "shufflenet_v2_x0_5", "googlenet", "resnext50_32x4d", "vgg11_bn", "alexnet", "mnasnet0_5"]


def pruned(model: nn.Module, generator: torch.Generator) -> nn.Module:
    prune_convs_(model, 0.9)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=generator)
                m.running_var.uniform_(0.5, 1.5, generator=generator)
    return model.eval()


def main() -> None:
    try:
        import torchvision
    except ImportError as exc:
        sys.exit(f"bench/torchvision_front_end.py needs torchvision ({exc}): pip install torchvision")
    names = sys.argv[1:] or MODELS
    unknown = [n for n in names if not callable(getattr(torchvision.models, n, None))]
    if unknown:
        print(f"unknown torchvision model {unknown[0]!r}; e.g. {', '.join(MODELS)}", file=sys.stderr)
        sys.exit(2)
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}; float64, CPU, 1x3x224x224")
    generator = torch.Generator().manual_seed(0)
    for name in names:
        extra = {"aux_logits": False, "init_weights": True} if name == "googlenet" else {}
        model = pruned(getattr(torchvision.models, name)(weights=None, **extra), generator).double()
        x = torch.randn(1, 3, 224, 224, dtype=torch.float64, generator=generator)
        t = time.perf_counter()
        front = prepare(model, x, dtypes=(torch.float64,))
        with torch.no_grad():
            want, got = model(x), front.module(x)
        rel = float((got - want).norm() / want.norm())
        fused = Counter(f"{p.action}:{'+'.join(p.fused) or '-'}" for p in front.plans)
        kept = sorted({p.reason for p in front.plans if p.action != "sparseconv"})
        print(f"{name}: traced={front.traced} rel={rel:.1e} {dict(fused)} ({time.perf_counter() - t:.1f} s)"
              + (f" kept: {kept}" if kept else ""))


if __name__ == "__main__":
    main()
