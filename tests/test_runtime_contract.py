"""CPU: the call checks every conv kernel family shares (runtime.CallContract)
refuse what no GPU is needed to refuse, with the layer's name."""
import numpy as np
import pytest

from sparseconv.runtime import CallContract
from sparseconv.shapes import ConvShape

CONTRACT = CallContract("layer3.0.conv2", ConvShape(8, 4, 6, 6, 3, 3, padding=(1, 1)), residual=False, device_id=0)


def test_output_shape():
    from dataclasses import replace

    assert CONTRACT.output_shape(5) == (5, 4, 6, 6)
    assert replace(CONTRACT, pool=True).output_shape(5) == (5, 4, 3, 3)  # Epilogue.pool's 2x2 max pool
    odd = CallContract("conv", ConvShape(8, 4, 7, 9, 1, 1), residual=False, device_id=0, pool=True)
    assert odd.output_shape(2) == (2, 4, 3, 4)  # floor mode


def test_host_arrays_and_other_objects_are_refused():
    with pytest.raises(TypeError, match="layer3.0.conv2: x is a NumPy"):
        CONTRACT.as_cupy(np.zeros((1, 8, 6, 6), np.float32))
    with pytest.raises(TypeError, match="layer3.0.conv2: x must be a CUDA array .* got list"):
        CONTRACT.as_cupy([[0.0]])


def test_a_tensor_that_requires_grad_gets_our_message_not_torchs():
    torch = pytest.importorskip("torch")
    # torch's own __cuda_array_interface__ raises RuntimeError for such a tensor: checked first
    with pytest.raises(ValueError, match="layer3.0.conv2: x requires grad; .*inference-only"):
        CONTRACT.as_cupy(torch.zeros(1, 8, 6, 6, requires_grad=True))
    with pytest.raises(TypeError, match=r"layer3.0.conv2: x is a CPU tensor; move it to the GPU first \(x.cuda\(\)\)"):
        CONTRACT.as_cupy(torch.zeros(1, 8, 6, 6))
