"""Code bytes per k-block copy of each layer's variant at one batch size, built
on the CPU (no GPU): what a block streams from DRAM when it runs cold inside a
network (docs/PERFORMANCE.md, session 8: about 6 us + 0.42 us per KB at
batch 1, at most one block per SM). Also each build's PTX lines and ptxas
seconds: what a tiling rule costs the build (session 49: `git apply` the rule
between two runs, --workers 1 so that each layer's ptxas has the cores).
--registers also runs `ptxas -v` on each specialised PTX, with the tiling's
-O level and register cap, for the most registers a function uses and its
spill bytes (session 56: are a layer's warps held back by registers?), and
the specialised PTX's instructions, FMAs and the rest. --input-loads
staged / prefetched builds each pointwise variant that can take it with its
chunk input staged by cp.async or prefetched into L1 (Tiling.input_loads;
session 57: what each costs the build).

    python bench/code_per_block.py resnet50 --layers layer3.1.conv1,layer3.1.conv3 [--batch 1] [--json out.json]
    python bench/code_per_block.py vgg16 --layers conv5_1 --batch 64 --workers 1 --json cost.json
    python bench/code_per_block.py vgg16 --layers conv3_2,conv4_2 --batch 64 --registers
    python bench/code_per_block.py vgg16 --layers conv4_2 --batch 64 --registers --input-loads staged

Without --layers, every layer of the model. Builds go to a cache of their own
(--cache-dir, default a fresh temporary directory)."""
import argparse
import json
from dataclasses import replace
import re
import subprocess
import tempfile

import numpy as np

from sparseconv.cache import ArtifactCache
from sparseconv.compile import find_tool
from sparseconv.parallel import LayerJob, build_many
from sparseconv.shapes import INPUT_LOADS, Target, check_tiling, launch_grid, n_kblocks
from sparseconv.tilings import variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.zoo import MODELS, model_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=list(MODELS))
    ap.add_argument("--layers", default="", help="comma-separated layer names (default: all)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--workers", type=int, default=None, help="build processes (default: one a core)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--registers", action="store_true",
                    help="also ptxas -v (registers and spill bytes) and the PTX's instructions")
    ap.add_argument("--input-loads", choices=INPUT_LOADS, default="registers",
                    help="Tiling.input_loads of the pointwise variants that can take it (default: registers)")
    args = ap.parse_args()
    if args.batch < 1:
        ap.error(f"--batch must be at least 1, not {args.batch}")
    if not 0 <= args.sparsity < 1:
        ap.error(f"--sparsity must be in [0, 1), not {args.sparsity}")
    if args.workers is not None and args.workers < 1:
        ap.error(f"--workers must be at least 1, not {args.workers}")
    layers = dict(model_layers(args.model))
    names = [n for n in args.layers.split(",") if n] or list(layers)
    unknown = [n for n in names if n not in layers]
    if unknown:
        ap.error(f"no layer {', '.join(unknown)} in {args.model}; its layers: {', '.join(layers)}")
    rng = np.random.default_rng(0)
    jobs = []
    for name in names:
        shape = layers[name]
        jobs.append(LayerJob(name, pruned_weight(rng, shape.weight_shape, args.sparsity), shape,
                             with_input_loads(shape, variant_for_batch(shape, args.batch), args.input_loads)))
    cache_dir = args.cache_dir or tempfile.mkdtemp()
    target = Target("sm_90")
    built = build_many(jobs, target=target, cache_dir=cache_dir, workers=args.workers, progress=True)
    rows = []
    extra = " registers (cap) | spill bytes | PTX FMAs | PTX other |" if args.registers else ""
    print(f"| layer | tiling (batch {args.batch}) | blocks | k-block copies | code KB | KB per copy | PTX lines "
          f"| ptxas s |{extra}")
    print("|---|---|---|---|---|---|---|---|" + "---|---|---|---|" * args.registers)
    for name in names:
        layer = built[name]
        gx, gy, gz = launch_grid(layer.shape, layer.tiling, args.batch)
        copies = n_kblocks(layer.shape, layer.tiling)
        kb = layer.stats["artifact_bytes"] / 1024
        ptxas_s = layer.stats["seconds"]["assemble"]
        row = dict(layer=name, tiling=layer.tiling.describe(), blocks=gx * gy * gz, copies=copies,
                   code_kb=kb, kb_per_copy=kb / copies, ptx_lines=layer.stats["ptx_lines"],
                   ptxas_s=round(ptxas_s, 1))
        cells = ""
        if args.registers:
            ptx = ArtifactCache(cache_dir).get_text("kernel", layer.ptx_sha256, ".ptx")
            row.update(ptxas_usage(ptx, target.arch, layer.tiling.ptxas_level, layer.tiling.max_registers))
            row.update(ptx_instructions(ptx))
            cells = (f" {row['registers']} ({row['register_cap']}) | {row['spill_bytes']} | {row['ptx_fmas']} "
                     f"| {row['ptx_other']} |")
        rows.append(row)
        print(f"| {name} | {layer.tiling.describe()} | {gx * gy * gz} | {copies} | {kb:.0f} | {kb / copies:.1f} "
              f"| {layer.stats['ptx_lines']} | {ptxas_s:.1f} |{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, sparsity=args.sparsity, rows=rows), f, indent=1)


def with_input_loads(shape, tiling, input_loads: str):
    """`tiling` with Tiling.input_loads set where the layer can take it (a
    pointwise variant check_tiling accepts), else as it is."""
    if tiling.family != "pointwise" or input_loads == tiling.input_loads:
        return tiling
    changed = replace(tiling, input_loads=input_loads)
    try:
        check_tiling(shape, changed)
    except ValueError:
        return tiling
    return changed


def ptx_instructions(ptx: str) -> dict:
    """The PTX's instructions (labels, directives and comments aside):
    fma.rn.f32 and the rest, and among the rest the ways input reaches the
    FMAs (global loads, cp.async copies, shared reads, prefetches) and the
    register moves (most are the specialiser's renames, which ptxas folds)."""
    lines = (line.strip() for line in ptx.splitlines())
    code = [line for line in lines if (line[:1].isalpha() or line[:1] == "@") and not line.endswith(":")]
    opcodes = [line.split()[0] if line[0] != "@" else line.split()[1] for line in code]
    fmas = sum(1 for op in opcodes if op == "fma.rn.f32")
    counts = dict(ptx_fmas=fmas, ptx_other=len(code) - fmas)
    for key, prefix in _COUNTED_OPCODES.items():
        counts[key] = sum(1 for op in opcodes if op.startswith(prefix))
    return counts


# Opcode prefixes ptx_instructions counts on their own.
_COUNTED_OPCODES = {"ptx_global_loads": "ld.global", "ptx_copies": "cp.async.ca", "ptx_shared_reads": "ld.shared",
                  "ptx_prefetches": "prefetch", "ptx_movs": "mov."}


def ptxas_usage(ptx: str, arch: str, opt_level: int, max_registers: int) -> dict:
    """`ptxas -v` on one specialised PTX, as the build assembles it (its -O
    level and register cap): the most registers any of its functions uses,
    and the spill stores and loads summed over them, in bytes."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(find_tool("ptxas")), f"-arch={arch}", f"-O{opt_level}",
                              f"-maxrregcount={max_registers}", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", out)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", out)]
    return dict(registers=max(registers), register_cap=max_registers, spill_bytes=sum(spills))


if __name__ == "__main__":
    main()
