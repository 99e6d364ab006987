"""ptxas time against a function's length, and what the specialiser's pieces
save, on one zoo layer's weights (CPU only: nvcc, ptxas and nvlink).

  lengths  the layer's weights cut to each of --channels input channels, the
           whole layer's default (batch-64) tiling for all, so only the
           number of chunks changes; the first k-block function alone
           through `ptxas -c` at the tiling's -O level: PTX lines, seconds
           and µs a line
  pieces   the whole layer at --pieces-threads threads a block (where the
           pieces' loop state fits in shared memory), specialised with whole
           k-blocks and with each --piece-lines budget, assembled with one
           ptxas job: functions, seconds, cubin bytes

    python bench/ptxas_scaling.py --layer vgg16:conv5_2 --out ptxas.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from sparseconv.assemble import assemble_cubin, split_module
from sparseconv.compile import compile_to_ptx, find_tool
from sparseconv.render import render
from sparseconv.shapes import ConvShape, Target
from sparseconv.tilings import default_tiling
from sparseconv.specialise import analyse_template, specialise
from sparseconv.zoo import pruned_model

WHOLE = 1 << 62  # a piece budget no k-block reaches


def _layer(spec: str, sparsity: float):
    """(shape, weight) of model:layer, or None where the zoo has no such layer."""
    model, _, name = spec.partition(":")
    if model not in ("vgg16", "resnet50"):
        return None
    return next(((shape, weight) for n, shape, weight in pruned_model(model, sparsity) if n == name), None)


def lengths(shape: ConvShape, weight: np.ndarray, channels, tmp: Path):
    rows = []
    t = default_tiling(shape)
    for c in channels:
        s = replace(shape, in_channels=c)
        w = np.ascontiguousarray(weight[:, :c])
        r = render(s, t)
        ptx, _ = specialise(compile_to_ptx(r.source, Target()), r, w)
        first = split_module(ptx)[0]
        src = tmp / f"c{c}.ptx"
        src.write_text(first)
        start = time.perf_counter()
        subprocess.run([str(find_tool("ptxas")), "-c", f"-arch={Target().arch}", f"-O{t.ptxas_level}",
                        f"-maxrregcount={t.max_registers}", str(src), "-o", str(tmp / f"c{c}.o")], check=True)
        seconds = time.perf_counter() - start
        lines = first.count("\n")
        rows.append({"channels": c, "tiling": t.describe(), "ptx_lines": lines, "ptxas_s": round(seconds, 2),
                     "us_per_line": round(seconds / lines * 1e6, 1)})
        print(f"lengths: C {c}: {lines:,} lines, {seconds:.2f} s, {seconds / lines * 1e6:.0f} us a line", flush=True)
    return rows


def pieces(shape: ConvShape, weight: np.ndarray, threads: int, budgets):
    t = replace(default_tiling(shape), tile_w=threads)
    r = render(shape, t)
    template = compile_to_ptx(r.source, Target())
    layout = analyse_template(template, r)
    rows = []
    for budget in (WHOLE, *budgets):
        ptx, _ = specialise(template, r, weight, layout, piece_lines=budget)
        start = time.perf_counter()
        cubin = assemble_cubin(ptx, Target(), "ptxas_scaling", jobs=1, max_registers=t.max_registers,
                               opt_level=t.ptxas_level)
        seconds = time.perf_counter() - start
        label = "whole" if budget == WHOLE else f"{budget:,} lines"
        rows.append({"pieces": label, "tiling": t.describe(), "functions": len(split_module(ptx)),
                     "ptx_lines": ptx.count("\n"), "assemble_s": round(seconds, 1), "cubin_bytes": len(cubin)})
        print(f"pieces: {label}: {rows[-1]['functions']} functions, {seconds:.1f} s, {len(cubin):,} bytes", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", default="vgg16:conv5_2", help="model:layer of the zoo")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--channels", default="64,128,256,512", help="input channels to cut the weights to")
    ap.add_argument("--pieces-threads", type=int, default=128)
    ap.add_argument("--piece-lines", default="20000,8000", help="piece budgets besides whole k-blocks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        channels = [int(c) for c in args.channels.split(",")]
        budgets = [int(b) for b in args.piece_lines.split(",")]
    except ValueError:
        ap.error("--channels and --piece-lines take comma-separated integers")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    found = _layer(args.layer, args.sparsity)
    if found is None:
        ap.error(f"--layer {args.layer}: not a layer of the zoo (vgg16:<name> or resnet50:<name>)")
    shape, weight = found
    if not all(1 <= c <= shape.in_channels for c in channels) or min(budgets) < 1:
        ap.error(f"--channels must lie in 1..{shape.in_channels} and --piece-lines be positive")
    with tempfile.TemporaryDirectory(prefix="ptxas-scaling-") as tmp:
        result = {"layer": args.layer, "lengths": lengths(shape, weight, channels, Path(tmp)),
                  "pieces": pieces(shape, weight, args.pieces_threads, budgets)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
