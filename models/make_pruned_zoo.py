"""Pruned conv weights for VGG-16 or ResNet-50 (ImageNet shapes), as one .npz.

He-initialised weights, magnitude-pruned per layer to the given unstructured
sparsity (exact zeros), deterministic for a seed. Nothing large is committed:
run this to make the file.

    python models/make_pruned_zoo.py vgg16 --sparsity 0.9 --out models/vgg16_pruned.npz
"""
import argparse
import json
from pathlib import Path

import numpy as np

from sparseconv.zoo import MODELS, pruned_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    out = a.out or Path(__file__).resolve().parent / f"{a.model}_pruned.npz"
    layers = pruned_model(a.model, a.sparsity, a.seed)
    spec = [dict(name=n, **s.as_dict()) for n, s, _ in layers]
    np.savez(out, **{n: w for n, _, w in layers}, __spec__=np.frombuffer(json.dumps(spec).encode(), np.uint8))
    nnz = sum(int(np.count_nonzero(w)) for _, _, w in layers)
    total = sum(w.size for _, _, w in layers)
    print(f"wrote {out}: {len(layers)} conv layers, {total} weights, {1 - nnz / total:.1%} zeros")


if __name__ == "__main__":
    main()
