"""Dense Linear layers above the gemv's batch sizes: is F.linear (addmm, the
bias fused into cuBLASLt's epilogue) as fast as a plain GEMM and a separate
bias add? Session 32 found the ONNX runner's VGG-16 at batch 64 (torch.matmul
into a buffer, then the bias as its own kernel) 3% faster than the fx front
end's, whose classifier runs F.linear, with the same conv routes.

Each variant on VGG-16's classifier shapes (and ResNet-50's fc), strict fp32
(TF32 off), timed by CUDA-graph replays (timing.time_gpu with torch's
graphs), results checked against float64.

    python bench/dense_linear_probe.py [--batch 16 --batch 64] [--out probe.json]
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import click
import torch
import torch.nn.functional as F

from sparseconv.cli_options import check_output_file
from sparseconv.dense import torch_flags
from sparseconv.timing import time_gpu, torch_graph

SHAPES = {"vgg16 fc6": (25088, 4096), "vgg16 fc7": (4096, 4096), "vgg16 fc8": (4096, 1000),
          "resnet50 fc": (2048, 1000)}


def variants(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Dict[str, Callable[[], torch.Tensor]]:
    wt = w.t()
    return {
        "F.linear": lambda: F.linear(x, w, b),
        "mm + bias": lambda: torch.mm(x, wt).add_(b),
        "matmul + bias": lambda: torch.matmul(x, wt) + b,
    }


@click.command()
@click.option("--batch", "batches", type=click.IntRange(1), multiple=True, default=(16, 64), show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(batches: Tuple[int, ...], out: Optional[Path]) -> None:
    check_output_file(out, "--out", ".json")
    dev = torch.device("cuda")
    rows: List[dict] = []
    with torch_flags(torch, tf32=False, cudnn_benchmark=False), torch.no_grad():
        for name, (fin, fout) in SHAPES.items():
            w = torch.randn(fout, fin, device=dev) / fin ** 0.5
            b = torch.randn(fout, device=dev)
            for batch in batches:
                x = torch.randn(batch, fin, device=dev)
                ref = (x.double() @ w.double().t() + b.double())
                row = {"layer": name, "batch": batch, "us": {}, "rel_l2": {}}
                for label, fn in variants(x, w, b).items():
                    y = fn()
                    row["rel_l2"][label] = float((y.double() - ref).norm() / ref.norm())
                    row["us"][label] = time_gpu(fn, repeat=20, max_seconds=0.3, capture=torch_graph).us
                rows.append(row)
                print(f"{name} batch {batch}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row["us"].items())
                      + f"; rel L2 {max(row['rel_l2'].values()):.1e}")
    if out is not None:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
