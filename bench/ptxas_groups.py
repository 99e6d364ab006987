"""ptxas on a layer's k-block functions alone against in groups (assemble.GROUP_LINES):
the ptxas CPU time of each way, and whether every function's code is the same.

    python bench/ptxas_groups.py CACHE_DIR [--workers 2] [--out groups.json]

CACHE_DIR is a build cache (bench/compile_model.py leaves one under /tmp,
sparseconv-<model>-*); every specialised PTX in it whose module assemble_cubin
would group is compiled both ways with `ptxas -c`, one module after the other,
on --workers threads. Needs ptxas, no GPU. Session 37 ran it on VGG-16's cache
on the 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

from sparseconv.assemble import GROUP_LINES, function_code, split_module
from sparseconv.compile import find_tool

FLAGS = ["-c", "-arch=sm_90", "-O3"]


def compile_modules(modules: List[str], folder: Path, workers: int) -> Tuple[Dict[str, bytes], float]:
    """Each module through ptxas -c: the code of every function, and the ptxas CPU seconds."""
    ptxas = str(find_tool("ptxas"))

    def one(i: int) -> Path:
        src, obj = folder / f"m{i}.ptx", folder / f"m{i}.o"
        src.write_text(modules[i])
        subprocess.run([ptxas, *FLAGS, str(src), "-o", str(obj)], check=True, capture_output=True)
        return obj

    before = os.times()
    with ThreadPoolExecutor(workers) as pool:
        objects = list(pool.map(one, range(len(modules))))
    after = os.times()
    code: Dict[str, bytes] = {}
    for obj in objects:
        code.update(function_code(obj.read_bytes()))
    return code, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cache_dir", type=Path)
    ap.add_argument("--workers", type=int, default=2, help="ptxas threads, as assemble_cubin's jobs")
    ap.add_argument("--out", type=Path, default=None, help="a .json file in an existing folder")
    a = ap.parse_args()
    if a.workers < 1:
        ap.error(f"--workers must be 1 or more, got {a.workers}")
    if a.out and (a.out.suffix != ".json" or not a.out.resolve().parent.is_dir()):
        ap.error(f"--out {a.out}: a .json file in a folder that exists")
    files = sorted((a.cache_dir / "kernel").glob("*/*.ptx"))
    if not files:
        ap.error(f"{a.cache_dir}: no specialised PTX under kernel/ (is it a sparseconv build cache?)")
    rows = []
    for f in files:
        ptx = f.read_text().split("\n", 1)[1]  # after the cache entry's header line
        alone, grouped = split_module(ptx), split_module(ptx, GROUP_LINES, 2 * a.workers)
        if len(grouped) == len(alone):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "a").mkdir()
            (Path(tmp) / "g").mkdir()
            code_a, cpu_a = compile_modules(alone[:-1], Path(tmp) / "a", a.workers)
            code_g, cpu_g = compile_modules(grouped[:-1], Path(tmp) / "g", a.workers)
        row = dict(ptx=f.name[:12], functions=len(alone) - 1, modules=len(grouped) - 1, cpu_alone_s=round(cpu_a, 2),
                   cpu_grouped_s=round(cpu_g, 2), same_code=code_a == code_g and all(code_a.values()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    total = dict(cpu_alone_s=round(sum(r["cpu_alone_s"] for r in rows), 1),
                 cpu_grouped_s=round(sum(r["cpu_grouped_s"] for r in rows), 1),
                 same_code=all(r["same_code"] for r in rows))
    print(json.dumps(total))
    if a.out:
        a.out.write_text(json.dumps(dict(rows=rows, total=total), indent=1))


if __name__ == "__main__":
    main()
