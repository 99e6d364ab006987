"""Compile time of every conv layer of a pruned zoo network (VGG-16, ResNet-50,
ResNeXt-50 32x4d, MobileNetV2, MNASNet 1.0): cold, then warm.

    python bench/compile_model.py vgg16 [--sparsity 0.9] [--jobs N] [--load] [--json out.json]

It builds what sparsify builds with its weight table on (no split code for
layers whose small batches the table runs, tilings.code_variants), each conv
with the epilogue sparsify fuses into it (its ReLU, residual add, VGG's max
pool: found by sparsify's fx pass on the same network, sparseconv.zoo_torch;
a pooled layer's kernel is another template than an unpooled one's, which
nvcc compiles anew); --all-variants builds every variant, as `sparseconv
compile` does; --plain-epilogues builds every conv with bias alone, as this
script did before session 52.
Cold = an empty cache; warm = the same build again (every layer a cache hit),
and with --load (needs a GPU) every kernel loaded and ready to call. Prints a
Markdown table per layer and the totals."""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import click

from sparseconv.benchmark.output import write_atomically
from sparseconv.cli_options import check_output_file
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import Epilogue
from sparseconv.tilings import ANY_BATCH, code_variants, default_tiling
from sparseconv.testing import conv2d_reference, relative_l2
from sparseconv.zoo import MODELS, pruned_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", choices=list(MODELS))
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--load", action="store_true", help="also load every kernel on the GPU (warm pass)")
    p.add_argument("--check", action="store_true",
                   help="run every layer once on the GPU against the float64 reference (implies --load)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plain-epilogues", action="store_true",
                   help="build every conv with bias alone, not with the epilogue sparsify fuses into it")
    p.add_argument("--all-variants", action="store_true",
                   help="also the split code of layers whose small batches the weight table runs in sparsify "
                        "(tilings.table_runs_small_batches), as `sparseconv compile` builds")
    a = p.parse_args()
    if not 0 <= a.sparsity < 1:
        p.error(f"--sparsity must lie in [0, 1), got {a.sparsity}")
    if a.jobs is not None and a.jobs < 1:
        p.error(f"--jobs must be 1 or more, got {a.jobs}")
    try:  # before minutes of building
        check_output_file(a.json, "--json", ".json")
    except click.BadParameter as exc:
        p.error(f"--json: {exc.message}")
    a.load = a.load or a.check
    # Every batch variant of every layer, as sparsify builds them with its weight table on (the default: no
    # split code where the table runs small batches, tilings.code_variants), or with --all-variants every one,
    # as compile_layers and `sparseconv compile` do.
    layers = pruned_model(a.model, a.sparsity)
    epilogues = [Epilogue()] * len(layers) if a.plain_epilogues else sparsify_epilogues(a.model, layers)
    jobs = [LayerJob(n if up_to == ANY_BATCH else f"{n}#split", w, s, t, ep)
            for (n, s, w), ep in zip(layers, epilogues)
            for up_to, t in code_variants(s, default_tiling(s), table_at_small_batches=not a.all_variants)]
    cache = tempfile.mkdtemp(prefix=f"sparseconv-{a.model}-")
    t = time.perf_counter()
    cold = build_many(jobs, cache_dir=cache, workers=a.jobs)
    cold_s = time.perf_counter() - t
    t = time.perf_counter()
    warm = build_many(jobs, cache_dir=cache, workers=a.jobs, progress=False)
    if a.load:
        from sparseconv.runtime import Conv2dKernel
        kernels = [Conv2dKernel(layer, None) for layer in warm.values()]
        assert len(kernels) == len(jobs)
    warm_s = time.perf_counter() - t
    errors = {}
    if a.check:
        errors = check_layers(jobs, kernels)
    missed = [name for name, layer in warm.items() if not layer.stats["kernel_cache_hit"]]
    if missed:  # session 42 (MNASNet 1.0): the sources were edited under the run (build_many warns since 47)
        sys.exit(f"the warm build missed the cache for {len(missed)} of {len(jobs)} layers: {', '.join(missed)} "
                 f"(cache {cache})")
    print(f"# {a.model}, {len(jobs)} builds ({'every variant' if a.all_variants else 'as sparsify builds'}), "
          f"{'bias alone' if a.plain_epilogues else 'the epilogues sparsify fuses'}, "
          f"sparsity {a.sparsity}, {time.strftime('%Y-%m-%d')}, "
          f"{platform.node()} ({os.cpu_count()} cores)\n")
    print("| layer | shape | nvcc s | specialise s | ptxas+nvlink s | wall s | nonzero | FMAs deleted | "
          "functions (k-blocks) | PTX lines | pass lines/s | cubin bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows, lines, spec_s = [], 0, 0.0
    for name, layer in cold.items():
        s = layer.stats
        sec = s["seconds"]
        lines += s["ptx_lines"]
        spec_s += sec["specialise"]
        sh = layer.shape
        print(f"| {name} | {sh.in_channels}->{sh.out_channels} {sh.kernel_h}x{sh.kernel_w} @{sh.in_h} s{sh.stride[0]} | "
              f"{sec['compile']:.2f} | {sec['specialise']:.2f} | {sec['assemble']:.2f} | {s['wall_s']:.1f} | "
              f"{s['nonzero_weights']} | {s['fmas_deleted']} | {s.get('pieces', s['kblocks'])} ({s['kblocks']}) | "
              f"{s['ptx_lines']} | "
              f"{s['ptx_lines'] / max(sec['specialise'], 1e-9):,.0f} | {s['artifact_bytes']} |")
        rows.append(dict(layer=name, **{k: v for k, v in s.items() if k not in ("template_key", "kernel_key")}))
    print(f"\ncold: {cold_s:.1f} s for {len(jobs)} layers; warm{' + load on the GPU' if a.load else ''}: "
          f"{warm_s:.2f} s; specialisation pass: {lines:,} PTX lines in {spec_s:.1f} s = "
          f"{lines / spec_s:,.0f} lines/s")
    if errors:
        worst = max(errors, key=errors.get)
        print(f"checked {len(errors)} layers on the GPU (batch 2, float64 reference): worst relative L2 "
              f"{errors[worst]:.2e} ({worst}); all <= 1e-5: {all(e <= 1e-5 for e in errors.values())}")
    if a.json:
        text = json.dumps(dict(rows=rows, cold_s=cold_s, warm_s=warm_s, errors=errors), indent=2, default=str)
        write_atomically(a.json, lambda tmp: tmp.write_text(text))
    if errors and not all(e <= 1e-5 for e in errors.values()):
        sys.exit(1)


def sparsify_epilogues(model, layers):
    """The epilogue sparsify fuses into each of `layers` (the zoo's convs of
    `model`, in forward order): sparsify's fx pass (fx.prepare) on the same
    network built in torch (zoo_torch), its convs matched in order, shape by
    shape."""
    import torch

    from sparseconv.fx import FusedConv2d, prepare
    from sparseconv.zoo_torch import build_network

    shape = layers[0][1]
    front = prepare(build_network(model), torch.randn(1, shape.in_channels, shape.in_h, shape.in_w))
    plans = [p for p in front.plans if p.kind == "conv"]
    if [p.shape for p in plans] != [s for _, s, _ in layers]:
        sys.exit(f"{model}: the torch network's convs do not match the zoo's in order; use --plain-epilogues")
    convs = [front.convs.get(p.name) for p in plans]
    return [Epilogue(c.activation, c.clip, c.residual, c.pool) if isinstance(c, FusedConv2d) else Epilogue()
            for c in convs]


def check_layers(jobs, kernels):
    """Relative L2 error of each layer, its epilogue included, on a fresh
    random batch of 2 (and residual), NaN-poisoned output."""
    import cupy as cp
    import numpy as np

    from sparseconv.dense import epilogue_reference

    rng = np.random.default_rng()
    errors = {}
    for job, kernel in zip(jobs, kernels):
        s = job.shape
        x = cp.asarray(rng.standard_normal((2, s.in_channels, s.in_h, s.in_w)).astype(np.float32))
        res = cp.asarray(rng.standard_normal((2, s.out_channels, s.out_h, s.out_w)).astype(np.float32)) \
            if job.epilogue.residual else None
        y = kernel(x, out=cp.full(kernel.output_shape(2), np.nan, cp.float32), residual=res)
        ref = conv2d_reference(x, cp.asarray(job.weight), None, s.stride, s.padding, s.dilation, s.groups, xp=cp)
        ref = epilogue_reference(ref, job.epilogue, res)
        errors[job.name] = float("inf") if bool(cp.isnan(y).any()) else relative_l2(y, ref, xp=cp)
    return errors


if __name__ == "__main__":
    main()
