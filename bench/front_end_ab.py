"""The two ONNX front ends on one file: the ONNX runner (runner.py) and the fx
front end (onnx_fx.py: the graph converted to torch.fx, then sparsify's
passes). Both compiled with CUDA graphs and the default routing, then timed
alternately (ABAB) per forward at each batch size on fresh random inputs,
and their outputs compared with each other and, at batch 1, with the float64
reference of the graph as written.

    python bench/export_network.py resnet50 resnet50.onnx
    python bench/front_end_ab.py resnet50.onnx --batch 1 --batch 64 --out ab.json

A forward is timed as a user calls the model: a CuPy input copied in, the
graph replayed, the output copied out (CUDA events, median of many calls).

--profile also splits one call of each front end among its kernels (CUPTI
through torch.profiler; each kernel's share of the call's span, as
bench/network_profile.py shares a replay) and prints the kernels whose
shares differ most between the two: where a gap between them comes from.

    python bench/front_end_ab.py vgg16.onnx --batch 64 --profile --out ab.json"""
from __future__ import annotations

import json
import time
from pathlib import Path
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

import click
import cupy
import numpy as np
from network_profile import category, graph_spans, last_call_kernels  # bench/, beside this script

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
@click.option("--profile", is_flag=True, help="Also split one call of each front end among its kernels.")
def main(model: Path, batches: Tuple[int, ...], rounds: int, out: Path, profile: bool) -> None:
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
        if profile:
            row["profile"] = {f: call_profile(lambda: m(x)) for f, m in models.items()}
            click.echo(profile_lines(row["profile"]))
        result["batches"][b] = row
        click.echo(f"batch {b}: " + ", ".join(f"{f} {min(t):.1f} us (runs {t})" for f, t in times.items())
                   + f"; fx vs runner rel L2 {row['fx_vs_runner_rel_l2']:.2e}, top-1 same {row['same_top1']:.3f}"
                   + (f"; vs float64 {row['rel_l2_vs_float64']}" if b == 1 else ""))
    result["plans"] = {f: m.plan for f, m in models.items()}
    click.echo(f"compile + route s: {compile_s}")
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


def call_profile(call: Callable[[], object], repeat: int = 5) -> Dict[str, object]:
    """One call's kernels (the last of `repeat`, after as many warm ones): its
    span, the gaps where no kernel ran, and each kernel name's summed share of
    the span (graph_spans), by name and by category."""
    for _ in range(repeat):
        call()
    last, events = last_call_kernels(call, repeat)
    if last is None:
        return {"not split": f"{events} kernel events over {repeat} calls"}
    shares, gaps = graph_spans(last)
    by_kernel: Dict[str, float] = defaultdict(float)
    by_category: Dict[str, float] = defaultdict(float)
    for name, us in shares:
        by_kernel[name] += us
        by_category[category(name)] += us
    return {"span_us": round(last[-1][2] - last[0][1], 1), "gaps_us": round(gaps, 1), "kernels": len(last),
            "by_category_us": {k: round(v, 1) for k, v in by_category.items()},
            "by_kernel_us": {k: round(v, 1) for k, v in sorted(by_kernel.items(), key=lambda kv: -kv[1])}}


def profile_lines(profiles: Dict[str, Dict[str, object]], top: int = 12) -> str:
    """The two calls' spans, gaps and categories, then the kernel names whose
    shares differ most (fx minus runner)."""
    if any("not split" in p for p in profiles.values()):
        return "  profile: " + "; ".join(f"{f}: {p.get('not split', 'split')}" for f, p in profiles.items())
    lines = [f"  {f}: span {p['span_us']} us, gaps {p['gaps_us']}, {p['kernels']} kernels, {p['by_category_us']}"
             for f, p in profiles.items()]
    runner, fx = profiles["runner"]["by_kernel_us"], profiles["fx"]["by_kernel_us"]
    diffs = sorted(((fx.get(k, 0.0) - runner.get(k, 0.0), k) for k in set(runner) | set(fx)), key=lambda d: -abs(d[0]))
    lines += [f"    {d:+9.1f} us  fx {fx.get(k, 0.0):9.1f}  runner {runner.get(k, 0.0):9.1f}  {k[:90]}"
              for d, k in diffs[:top]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
