"""Where the time of a split-reduction (small batch) variant goes: for each
layer and candidate pointwise tiling (k_block x threads x slices), the whole
call (main kernel + ordered reduction), the main kernel alone, and the
reduction kernel alone, timed by CUDA-graph replays at one batch size.

    python bench/split_probe.py --layers resnet50:layer4.1.conv1 --cands default,default:O1,64x64x16:O1 --out probe.json

A candidate "default" is the variant the rules build (tilings.batch_variants).
With --no-time the script only runs each kernel a few times (for ncu).
With --cold each call is also timed with L2 overwritten and x read back
first, as a layer meets it inside a network (timing.time_cold).
--epilogue times each candidate with each fused epilogue given (none, relu,
add+relu: the residual add of a ResNet block's last conv, then ReLU).
With --sparsity (repeatable) each candidate is built at each given sparsity
of random weights: at 1 no FMA is left, so the time left is the kernel's
fixed cost (its loads may then be dead code too; read --sass).
With --sass nothing runs (no GPU needed): each candidate is built for sm_90
and its registers, stack and load depth (how many instructions ahead of
their first use its loads are issued) are read from the cubin with cuobjdump.

Random weights are drawn from --seed and the layer's name, so a layer gets
the same weights whichever layers come before it in --layers (until session
14 they were drawn in --layers order, and two calls timed one layer with
different weights: docs/DESIGN.md, "ptxas -O3's load schedule").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import replace

import numpy as np

from sparseconv.compile import ToolNotFoundError, find_tool
from sparseconv.parallel import LayerJob, build_many
from sparseconv.runtime import Conv2dKernel, reduce_slices
from sparseconv.shapes import Epilogue, Target, check_tiling, kernel_shape
from sparseconv.tilings import default_direct_tiling, pointwise_tiling, tiling_for, variant_for_batch
from sparseconv.testing import pruned_weight
from sparseconv.timing import cupy_graph, l2_flush, l2_scratch_floats, time_cold, time_gpu
from sparseconv.zoo import find_layer, pruned_model


def parse_cand(shape, text: str, batch: int):
    """"default", "direct" (the direct family's default and its split variant
    for this batch), "d" k_block x outputs a thread along W x threads (the
    direct family, unsplit: tilings.tiling_for, e.g. d8x2x128) or
    k_block x threads x slices[x c_block] (the pointwise family; on a depthwise layer
    c_block groups a block, shapes.kernel_shape), each with optional
    suffixes ":O<level>" (ptxas optimisation level), ":B<n>" (min_blocks:
    n blocks per SM, which caps the registers per thread) and ":Skernel" /
    ":Scluster" (how the slices are summed, Tiling.slice_sum), ":Q" (the
    pointwise family's pixels in 2x2 quads, Tiling.pixel_order), ":A" (its
    chunk input staged by cp.async) and ":L" (prefetched into L1; both
    Tiling.input_loads), e.g. 64x256x1:B2, default:A."""
    text, *suffixes = text.split(":")
    fields = suffix_fields(suffixes)
    if "thread_w" in fields and not text[:1].isdigit():
        raise ValueError(":P<pixels> sets the pixels a thread of a pointwise candidate (<k_block>x<threads>x<slices>)")
    pixels = fields.pop("thread_w", 1)  # set with tile_w, by pointwise_tiling
    if text == "default":
        t = variant_for_batch(shape, batch)
    elif text == "direct":
        t = variant_for_batch(shape, batch, default_direct_tiling(shape))
    elif text.startswith("d"):
        kb, thread_w, threads = (int(v) for v in text[1:].split("x"))
        t = tiling_for(shape, kb, thread_w, 1, threads)
    else:
        kb, threads, slices, *cb = (int(v) for v in text.split("x"))
        t = replace(pointwise_tiling(shape, kb, pixels, threads), slices=slices)
        if cb:  # on a depthwise layer c_block > 1 takes that many groups a block, and k_block may grow with it
            t = replace(t, c_block=cb[0])
            t = replace(t, k_block=min(kb, kernel_shape(shape, t).k_per_group))
    return replace(t, **fields)


CAND_BASE = re.compile(r"default|direct|d\d+x\d+x\d+|\d+x\d+x\d+(x\d+)?")


def suffix_fields(suffixes) -> dict:
    """The Tiling fields a candidate's suffixes set; ValueError for one that
    is not :O<level>, :B<blocks per SM>, :Skernel, :Scluster, :C<c_block>,
    :P<pixels a thread>, :Q (pixels in 2x2 quads), :A (input staged) or :L
    (input prefetched)."""
    fields = {}
    for suffix in suffixes:
        if suffix[:1] == "O" and suffix[1:].isdigit():
            fields["ptxas_level"] = int(suffix[1:])
        elif suffix[:1] == "B" and suffix[1:].isdigit():
            fields["min_blocks"] = int(suffix[1:])
        elif suffix in ("Skernel", "Scluster"):
            fields["slice_sum"] = suffix[1:]
        elif suffix[:1] == "C" and suffix[1:].isdigit():
            fields["c_block"] = int(suffix[1:])
        elif suffix[:1] == "P" and suffix[1:].isdigit() and int(suffix[1:]) >= 1:
            fields["thread_w"] = int(suffix[1:])  # pixels a thread (pointwise candidates; parse_cand)
        elif suffix == "Q":
            fields["pixel_order"] = "quads"  # 2x2 windows of the output (Tiling.pixel_order)
        elif suffix == "A":
            fields["input_loads"] = "staged"  # copied by cp.async into shared memory (Tiling.input_loads)
        elif suffix == "L":
            fields["input_loads"] = "prefetched"  # asked for in L1 ahead of its loads (Tiling.input_loads)
        else:
            raise ValueError(f"unknown suffix :{suffix} (use :O<level>, :B<blocks per SM>, :Skernel, :Scluster, "
                             f":C<c_block>, :P<pixels a thread>, :Q, :A or :L)")
    return fields


def max_active_clusters(fn, grid, block, shared_bytes: int) -> int:
    """How many of a cluster kernel's clusters the GPU runs at once
    (cuOccupancyMaxActiveClusters): a grid with more clusters than this runs
    in more than one wave. Driver API through ctypes (CuPy has no wrapper)."""
    import ctypes

    class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]

    cuda = ctypes.CDLL("libcuda.so.1")
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, None, None, 0)
    n = ctypes.c_int()
    status = cuda.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(getattr(fn, "kernel", fn).ptr),
                                               ctypes.byref(config))
    if status:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed: CUDA error {status}")
    return n.value


def layer_weight(seed: int, lname: str, shape, sparsity: float = 0.9) -> np.ndarray:
    """Normal weights, a `sparsity` fraction zeroed at random, drawn from (seed, layer name)."""
    return pruned_weight(np.random.default_rng([seed, zlib.crc32(lname.encode())]), shape.weight_shape, sparsity)


# SASS opcodes whose first operand is read, not written
_NO_DEST = ("ST", "RED", "ATOM", "BRA", "EXIT", "BAR", "CALL", "RET", "BSYNC", "BSSY", "WARPSYNC", "NOP")


def load_depths(sass: str) -> list:
    """For each global load in `sass` (cuobjdump -sass text), how many
    instructions later its destination register is first read (straight-line
    order; a load whose register is overwritten or never read is left out)."""
    pending, depths, i = {}, [], 0
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);", line)
        if not m:
            continue
        op, operands = m.group(1), m.group(2).split(",")
        has_dest = not op.startswith(_NO_DEST) and len(operands) > 1
        reads = operands[1:] if has_dest else operands
        for reg in {r for text in reads for r in re.findall(r"\bR(\d+)\b", text)}:
            if reg in pending:
                depths.append(i - pending.pop(reg))
        if has_dest:
            dest = re.match(r"\s*R(\d+)\b", operands[0])
            if dest:
                pending.pop(dest.group(1), None)
                if op.startswith("LDG"):
                    pending[dest.group(1)] = i
        i += 1
    return depths


def cubin_stats(cubin: bytes) -> dict:
    """Registers, stack bytes and the median load depth of a cubin (cuobjdump)."""
    try:
        tool = str(find_tool("cuobjdump"))  # $SPARSECONV_CUOBJDUMP, PATH or $CUDA_HOME/bin, as nvcc and ptxas
    except ToolNotFoundError as exc:
        sys.exit(f"--sass: {exc} (pip: nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "layer.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        try:
            sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
            res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError as exc:  # e.g. cuobjdump -sass needs nvdisasm on PATH
            sys.exit(f"--sass: {tool} failed: {(exc.stderr or exc.stdout).strip().splitlines()[-1]}")
    depths = load_depths(sass)
    return dict(registers=max(int(r) for r in re.findall(r"REG:(\d+)", res)),
                stack_bytes=max(int(r) for r in re.findall(r"STACK:(\d+)", res)),
                loads=len(depths), median_load_depth=statistics.median(depths) if depths else None,
                # straight-line code: the instructions a block runs, about
                instructions=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", required=True, help="comma-separated, e.g. resnet50:layer4.1.conv1")
    ap.add_argument("--cands", default="default",
                    help="default, direct and/or k_block x threads x slices[x c_block], each with optional :O<level>, "
                         ":B<blocks per SM>, :Skernel/:Scluster, :C<c_block>, :P<pixels a thread> and :Q (pixels "
                         "in 2x2 quads), comma-separated")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--epilogue", default="none",
                    help="comma-separated among none, relu, add+relu (residual add then ReLU)")
    ap.add_argument("--weights", choices=["random", "zoo"], default="random",
                    help="random: 90%% of normal weights zeroed at random, drawn from --seed and the layer's name; "
                         "zoo: the weights bench --model times (zoo.pruned_model, He-initialised, "
                         "magnitude-pruned to 90%%, seed 0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--sparsity", type=float, action="append", default=[],
                    help="random weights only: zeroed fraction (repeatable, default 0.9); 1 keeps no FMA, "
                         "so what is left is the kernel's fixed cost")
    ap.add_argument("--sass", action="store_true",
                    help="no GPU: print each build's registers, stack and median load depth (cuobjdump)")
    ap.add_argument("--out", default="split_probe.json")
    ap.add_argument("--no-time", action="store_true", help="run each kernel 3 times, no timing (for ncu)")
    ap.add_argument("--cold", action="store_true",
                    help="also time each call with L2 overwritten first and x read back (as inside a network)")
    args = ap.parse_args()
    if args.sparsity and args.weights == "zoo":
        ap.error("--sparsity draws random weights; it does not apply to --weights zoo")
    if not all(0 <= v <= 1 for v in args.sparsity):
        ap.error(f"--sparsity must lie in [0, 1], got {args.sparsity}")
    epilogues = {"none": Epilogue(), "relu": Epilogue("relu"), "add+relu": Epilogue("relu", residual=True)}
    chosen = args.epilogue.split(",")
    if not set(chosen) <= set(epilogues):
        ap.error(f"--epilogue: each of {chosen} must be one of {sorted(epilogues)}")
    for c in args.cands.split(","):  # a misspelt candidate is a usage error, not a tiling that misfits a layer
        if not CAND_BASE.fullmatch(c.split(":")[0]):
            ap.error(f"--cands {c}: {c.split(':')[0]!r} is not default, direct, d<k_block>x<outputs along W>x"
                     f"<threads> or <k_block>x<threads>x<slices>[x<c_block>]")
        try:
            suffix_fields(c.split(":")[1:])
        except ValueError as e:
            ap.error(f"--cands {c}: {e}")
    for lname in args.layers.split(","):
        try:
            find_layer(lname)
        except ValueError as e:
            ap.error(f"--layers: {e}, e.g. mobilenet_v2:features.16.conv.1.0")
    rng = np.random.default_rng(0)
    used = {lname.split(":")[0] for lname in args.layers.split(",")}
    zoo = {net: {name: w for name, _, w in pruned_model(net, 0.9)} for net in used} if args.weights == "zoo" else {}
    jobs, plan = [], []
    for lname in args.layers.split(","):
        net, name = lname.split(":")
        shape = find_layer(lname)
        for sparsity in (args.sparsity or [None]):
            w = zoo[net][name] if zoo else layer_weight(args.seed, lname, shape, 0.9 if sparsity is None else sparsity)
            for c in args.cands.split(","):
                try:
                    t = parse_cand(shape, c, args.batch)
                    check_tiling(shape, t)
                except ValueError as e:
                    print(f"skip {lname} {c}: {e}", file=sys.stderr)
                    continue
                label = c if sparsity is None else f"{c} s{sparsity:g}"
                for e in chosen:
                    key = f"{lname}|{t.describe()}|{e}|{sparsity}"
                    if key not in {j.name for j in jobs}:
                        jobs.append(LayerJob(key, w, shape, t, epilogues[e]))
                        plan.append((lname, label if e == "none" else f"{label} {e}", shape, key, sparsity))
    t0 = time.time()
    built = build_many(jobs, target=Target("sm_90"), progress=True)
    print(f"built {len(jobs)} kernels in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = []
    if args.sass:
        for lname, c, shape, key, sparsity in plan:
            layer = built[key]
            if layer.artifact_suffix != ".cubin":
                sys.exit("--sass needs ptxas on PATH (the build made PTX, not a cubin)")
            rows.append(dict(layer=lname, cand=c, sparsity=sparsity, tiling=layer.tiling.describe(),
                             **cubin_stats(layer.artifact)))
            r = rows[-1]
            print(f"{lname:26s} {c:16s} {layer.tiling.describe():64s} registers {r['registers']:3d} "
                  f"stack {r['stack_bytes']:3d} B  loads ahead of use: median {r['median_load_depth']} "
                  f"instructions; {r['instructions']} instructions", flush=True)
        json.dump(rows, open(args.out, "w"), indent=1)
        return
    import cupy
    n = args.batch
    flush = cupy.empty(l2_scratch_floats(cupy.cuda.Device().attributes.get("L2CacheSize")), cupy.float32)
    for lname, c, shape, key, sparsity in plan:
        layer = built[key]
        x = cupy.asarray(rng.standard_normal((n, shape.in_channels, shape.in_h, shape.in_w), dtype=np.float32))
        out = cupy.empty((n, shape.out_channels, shape.out_h, shape.out_w), cupy.float32)
        k = Conv2dKernel(layer, rng.standard_normal(shape.out_channels).astype(np.float32))
        res = cupy.asarray(rng.standard_normal(out.shape, dtype=np.float32)) if layer.epilogue.residual else None
        k(x, out=out, residual=res)
        _, _, fn = k.variant(n)
        workspace = layer.tiling.slices > 1 and layer.tiling.slice_sum == "kernel"
        ws = cupy.empty((layer.tiling.slices,) + out.shape, cupy.float32) if workspace else out

        def main_only():
            fn(layer.grid(n), (layer.tiling.threads, 1, 1),
               (x, ws, k._bias, np.uint64(0) if res is None or workspace else res, np.int32(n),
                np.int32(layer.chunks)), shared_mem=layer.shared_bytes)

        def reduce_only():
            reduce_slices(k.device_id, ws, out)
        if args.no_time:
            for _ in range(3):
                k(x, out=out, residual=res)
            cupy.cuda.Device().synchronize()
            continue
        row = dict(layer=lname, cand=c, sparsity=sparsity, epilogue=layer.epilogue.describe(),
                   shape=shape.describe(), batch=n, tiling=layer.tiling.describe(),
                   grid=list(layer.grid(n)), threads=layer.tiling.threads,
                   cubin_bytes=layer.stats.get("artifact_bytes"),
                   registers=fn.attributes["num_regs"] if hasattr(fn, "attributes") else None,
                   call_us=time_gpu(lambda: k(x, out=out, residual=res), repeat=30, max_seconds=0.3, capture=cupy_graph).us,
                   main_us=time_gpu(main_only, repeat=30, max_seconds=0.3, capture=cupy_graph).us)
        if layer.tiling.slice_sum == "cluster":
            row["clusters"] = row["grid"][0] * row["grid"][1] * row["grid"][2] // layer.tiling.slices
            row["max_active_clusters"] = max_active_clusters(fn, layer.grid(n), (layer.tiling.threads, 1, 1),
                                                             layer.shared_bytes)
        if workspace:
            row["reduce_us"] = time_gpu(reduce_only, repeat=30, max_seconds=0.3, capture=cupy_graph).us
        if args.cold:
            row["call_cold_us"] = time_cold(lambda: k(x, out=out, residual=res), l2_flush(flush, x), repeat=30,
                                            max_seconds=0.3, capture=cupy_graph).us
        rows.append(row)
        cold = f" cold {row['call_cold_us']:6.1f}" if args.cold else ""
        waves = (f" clusters {row['clusters']}/{row['max_active_clusters']} at once"
                 if "clusters" in row else "")
        print(f"{lname:26s} {c:12s} {layer.tiling.describe():64s} grid {row['grid']} regs {row['registers']}"
              f"{waves} call {row['call_us']:6.1f}{cold} main {row['main_us']:6.1f} "
              f"reduce {row.get('reduce_us', 0):5.1f} us", flush=True)
    if rows:
        json.dump(rows, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
