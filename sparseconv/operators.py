"""The benchmark layers (sparseconv/data/operators.json, copied from the project brief)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

from .shapes import ConvShape

DATA = Path(__file__).resolve().parent / "data" / "operators.json"


@dataclass(frozen=True)
class Operator:
    name: str
    shape: ConvShape


def benchmark_operators() -> List[Operator]:
    doc = json.loads(DATA.read_text())
    ops = []
    for name, c, h, w, k, r, s, stride, pad in doc["operators"]:
        ops.append(Operator(name, ConvShape(c, k, h, w, r, s, (stride, stride), (pad, pad))))
    return ops


def baseline_h100_us() -> Dict[Tuple[str, int], Dict[str, float]]:
    """(name, batch) -> {'cudnn_fp32': us, 'cudnn_tf32': us, 'floor': us}."""
    doc = json.loads(DATA.read_text())["baseline_h100_us"]
    fields = doc["fields"]
    return {(row[0], row[1]): dict(zip(fields[2:], row[2:])) for row in doc["rows"]}
