"""sparseconv: compile the conv layers of a pruned CNN into GPU kernels specialised
to their weights (zero-weight FMAs deleted, nonzero weights as instruction
immediates). Exact fp32.

    conv = sparseconv.compile_conv2d(w, input_size=(56, 56), bias=b, stride=1, padding=1)
    y = conv(x)   # x: (N, C, 56, 56) float32 on the GPU; y: CuPy array

    model = sparseconv.compile_model("models/lenet_digits_pruned.onnx")  # a whole ONNX model
    sparseconv.torch.sparsify(torch_model, example_input)                # PyTorch drop-in
"""
__version__ = "0.1.0"

from .build import CompiledLayer, build_conv2d  # noqa: E402
from .kernel import Conv2dKernel, DenseConv2dKernel, compile_conv2d  # noqa: E402
from .runner import SparseModel, compile_model  # noqa: E402
from .shapes import ConvShape, Target, Tiling, default_tiling  # noqa: E402

__all__ = ["compile_conv2d", "Conv2dKernel", "DenseConv2dKernel", "compile_model", "SparseModel", "build_conv2d",
           "CompiledLayer", "ConvShape", "Tiling", "Target", "default_tiling", "__version__"]
