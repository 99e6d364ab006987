"""sparseconv: compile the conv layers of a pruned CNN into GPU kernels specialised
to their weights (zero-weight FMAs deleted, nonzero weights as instruction
immediates). Exact fp32.

    conv = sparseconv.compile_conv2d(w, input_size=(56, 56), bias=b, stride=1, padding=1)
    y = conv(x)   # x: (N, C, 56, 56) float32 on the GPU; y: CuPy array

    fc = sparseconv.compile_linear(w_fc, bias=b_fc, activation="relu")  # (N, in) -> (N, out)
    t = sparseconv.TableConv2d(w, b, shape)  # the weight-table family (small batches), same call as conv

    layer = sparseconv.build_conv2d(w, shape, target=sparseconv.Target("sm_90"))  # build only, no GPU
    model = sparseconv.compile_model("models/lenet_digits_pruned.onnx")  # a whole ONNX model
    sparseconv.torch.sparsify(torch_model, example_input)                # PyTorch drop-in

The public names load on first use (PEP 562), so importing one part of the
package (say sparseconv.build, on a machine without a GPU) does not import
the others: the build side never loads the run-time code.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "compile_conv2d": "api", "compile_linear": "api",
    "Conv2dKernel": "runtime", "DenseConv2dKernel": "runtime", "LinearKernel": "runtime",
    "TableConv2d": "table",
    "compile_model": "onnx_compile", "SparseModel": "runner",
    "build_conv2d": "build", "CompiledLayer": "build",
    "ConvShape": "shapes", "Tiling": "shapes", "Target": "shapes", "default_tiling": "tilings",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'sparseconv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_PUBLIC))
