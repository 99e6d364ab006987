"""Cold build of chosen zoo layers' variant for one batch size, one layer at
a time: PTX lines, seconds per stage, cubin bytes. Runs on the CPU (nvcc and
ptxas, no GPU); what a tiling rule costs the build, before and after it
(session 49: `git apply` the rule between two runs).

    python bench/build_cost.py --layers vgg16:conv5_1,resnet50:layer4.1.conv2 --batch 64 --json cost.json
"""
import argparse
import json
import tempfile
import time

import numpy as np

from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import Target, variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.zoo import find_layer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", required=True, help="comma-separated <network>:<layer>, e.g. vgg16:conv5_1")
    ap.add_argument("--batch", type=int, default=64, help="the batch whose variant is built (default 64)")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    names = [n for n in args.layers.split(",") if n]
    try:
        shapes = {n: find_layer(n) for n in names}
    except ValueError as e:
        ap.error(str(e))
    rng = np.random.default_rng(0)
    jobs = [LayerJob(n, pruned_weight(rng, s.weight_shape, args.sparsity), s, variant_for_batch(s, args.batch))
            for n, s in shapes.items()]
    start = time.time()
    # one worker: each layer's ptxas has the machine's cores to itself, as in a build of one layer
    built = build_many(jobs, target=Target("sm_90"), cache_dir=tempfile.mkdtemp(), workers=1, progress=False)
    rows = {n: dict(tiling=built[n].tiling.describe(), ptx_lines=built[n].stats["ptx_lines"],
                    seconds={k: round(v, 1) for k, v in built[n].stats["seconds"].items()},
                    artifact_bytes=built[n].stats["artifact_bytes"]) for n in names}
    for n, r in rows.items():
        print(f"{n:28s} {r['tiling']:62s} {r['ptx_lines']:8d} PTX lines, ptxas {r['seconds']['assemble']:6.1f} s, "
              f"{r['artifact_bytes'] / 1e6:.2f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=args.batch, wall_s=round(time.time() - start, 1), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
