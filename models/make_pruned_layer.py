"""Write a pruned conv layer to .npy files (weights ~90% zeros, plus a bias), for
the README example and `sparseconv layer`. Unstructured magnitude pruning of a
He-initialised (K, C, R, S) tensor: the smallest |w| are set to exactly 0.

    python models/make_pruned_layer.py --out models/layer3 --shape 64,64,3,3 --sparsity 0.9
"""
import argparse
from pathlib import Path

import numpy as np

from sparseconv.testing import he_pruned_weight


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models/layer3"), help="path prefix of the .npy files")
    p.add_argument("--shape", default="64,64,3,3", help="K,C,R,S")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    k, c, r, s = (int(v) for v in a.shape.split(","))
    rng = np.random.default_rng(a.seed)
    w = he_pruned_weight(rng, (k, c, r, s), a.sparsity)
    b = (0.1 * rng.standard_normal(k)).astype(np.float32)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(a.out.with_suffix(".npy"), w)
    np.save(a.out.parent / (a.out.name + "_bias.npy"), b)
    print(f"wrote {a.out.with_suffix('.npy')} {w.shape} ({np.mean(w == 0):.1%} zeros) and its bias")


if __name__ == "__main__":
    main()
