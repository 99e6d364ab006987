"""The two ONNX front ends on one file: the ONNX runner (runner.py) and the fx
front end (onnx_fx.py: the graph converted to torch.fx, then sparsify's
passes). Both compiled with CUDA graphs and the default routing, then timed
alternately (ABAB) per forward at each batch size on fresh random inputs,
and their outputs compared with each other and, at batch 1, with the float64
reference of the graph as written.

    python bench/export_network.py resnet50 resnet50.onnx
    python bench/front_end_ab.py resnet50.onnx --batch 1 --batch 64 --out ab.json

A forward is timed as a user calls the model: a CuPy input copied in, the
graph replayed, the output copied out (CUDA events, median of many calls)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Tuple

import click
import cupy
import numpy as np

from sparseconv.cli_options import check_output_file
from sparseconv.onnx_compile import compile_model
from sparseconv.runner import load_program, run_reference
from sparseconv.testing import relative_l2
from sparseconv.timing import median_us

FRONT_ENDS = ("runner", "fx")


@click.command()
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--batch", "batches", type=click.IntRange(1), multiple=True, default=(1, 64), show_default=True)
@click.option("--rounds", type=click.IntRange(1), default=3, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(model: Path, batches: Tuple[int, ...], rounds: int, out: Path) -> None:
    check_output_file(out, "--out", ".json")  # before minutes of compiling
    program = load_program(model)
    shape = tuple(program.input_shape[1:])
    models, compile_s = {}, {}
    for front_end in FRONT_ENDS:
        t = time.perf_counter()
        models[front_end] = compile_model(model, front_end=front_end, cuda_graph=True, route_batches=batches)
        compile_s[front_end] = round(time.perf_counter() - t, 1)
    rng = cupy.random.default_rng()
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    result: Dict[str, object] = {"model": str(model), "compile_s": compile_s, "device": device,
                                 "date": time.strftime("%Y-%m-%d"), "batches": {}}
    for b in batches:
        x = rng.standard_normal((b,) + shape, dtype=cupy.float32)
        ys = {f: m(x) for f, m in models.items()}  # the first call captures the shape's graph
        times: Dict[str, List[float]] = {f: [] for f in FRONT_ENDS}
        for _ in range(rounds):
            for f, m in models.items():
                times[f].append(round(median_us(lambda: m(x), b, repeat=50 if b <= 8 else 20), 1))
        row: Dict[str, object] = {"us": times, "fx_vs_runner_rel_l2": relative_l2(ys["fx"].get(), ys["runner"].get()),
                                  "same_top1": float(np.mean(ys["fx"].get().argmax(1) == ys["runner"].get().argmax(1)))}
        if b == 1:
            ref = run_reference(program, x.get())[0]
            row["rel_l2_vs_float64"] = {f: relative_l2(y.get(), ref) for f, y in ys.items()}
        result["batches"][b] = row
        click.echo(f"batch {b}: " + ", ".join(f"{f} {min(t):.1f} us (runs {t})" for f, t in times.items())
                   + f"; fx vs runner rel L2 {row['fx_vs_runner_rel_l2']:.2e}, top-1 same {row['same_top1']:.3f}"
                   + (f"; vs float64 {row['rel_l2_vs_float64']}" if b == 1 else ""))
    result["plans"] = {f: m.plan for f, m in models.items()}
    click.echo(f"compile + route s: {compile_s}")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
