"""Does VGG-16's dense classifier (494 MB of weights read through L2 every
forward) evict the conv layers' code from L2 between forwards? VGG-16 at
batch 1 is sparsified with and without its classifier (replaced by Identity),
alternately, and each variant's conv kernel times inside the network are
compared (bench/network_profile.py's profile). If the code stayed in L2
without the classifier, the convs would run faster there.

    python bench/classifier_l2_probe.py > classifier_l2.txt
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch

from sparseconv.benchmark.network import time_forward_us
from sparseconv.torch import CudaGraphModule, sparsify
from sparseconv.zoo_torch import build_network

spec = importlib.util.spec_from_file_location("network_profile", Path(__file__).with_name("network_profile.py"))
network_profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(network_profile)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: refuse stray ones
    dev = torch.device("cuda")
    x = torch.randn(1, 3, 224, 224, device=dev)
    print(f"device: {torch.cuda.get_device_name()}")
    with torch.no_grad():
        for variant in ("full", "features", "full", "features"):
            net = build_network("vgg16", sparsity=0.9, seed=0).to(dev).eval()
            if variant == "features":
                net.classifier = torch.nn.Identity()
            fast = sparsify(net, x, progress=False)
            replay = time_forward_us(CudaGraphModule(fast), x)
            prof = network_profile.profile(fast, x)
            by_category = {k: round(v, 1) for k, v in prof["by_category_us"].items()}
            per_conv = {k: round(v, 1) for k, v in prof["in_network_us"].items()}
            print(f"{variant}: replay {replay:.1f} us, kernel sum {prof['kernel_sum_us']:.1f} us, by category "
                  f"{by_category}, per conv {per_conv}", flush=True)


if __name__ == "__main__":
    main()
