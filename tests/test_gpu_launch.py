"""GPU: kernels launched to overlap the kernel before them (sparseconv.launch)
compute what they compute launched one after another: a chain of code, table
and pool kernels, each reading the one before's output (and one a residual
from two kernels back), eager and replayed as a CUDA graph, against float64
and bit for bit against the chain with the switch off."""
import numpy as np
import pytest

import sparseconv
import sparseconv.launch as launch_mod
from sparseconv.pool import MaxPoolShape, max_pool2d
from sparseconv.shapes import ConvShape, Epilogue
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

pytestmark = pytest.mark.gpu


def _chain(tmp_path):
    from sparseconv.table import TableConv2d

    rng = np.random.default_rng()
    c = 32
    s3 = ConvShape(c, c, 14, 14, 3, 3, padding=(1, 1))
    w_a, w_b = (pruned_weight(rng, s3.weight_shape, 0.9) for _ in range(2))
    w_c = pruned_weight(rng, (c, c, 1, 1), 0.9)
    a = sparseconv.compile_conv2d(w_a, input_size=(14, 14), padding=1, activation="relu", cache_dir=str(tmp_path))
    b = TableConv2d(w_b, None, s3, Epilogue("relu"), name="b")
    cc = sparseconv.compile_conv2d(w_c, input_size=(14, 14), activation="relu", residual=True,
                                   cache_dir=str(tmp_path))
    pool = MaxPoolShape.of(3, 1, 1)
    x = rng.standard_normal((1, c, 14, 14)).astype(np.float32)

    def reference():
        ya = np.maximum(conv2d_reference(x, w_a, None, (1, 1), (1, 1)), 0)
        yb = np.maximum(conv2d_reference(ya, w_b, None, (1, 1), (1, 1)), 0)
        yc = np.maximum(conv2d_reference(yb, w_c) + ya, 0)
        padded = np.pad(yc, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
        return np.max([padded[:, :, i:i + 14, j:j + 14] for i in range(3) for j in range(3)], axis=0)

    return a, b, cc, pool, x, reference()


def _run(a, b, cc, pool, x_dev, bufs):
    import cupy as cp

    ya, yb, yc, yp = bufs
    a(x_dev, out=ya)
    b(ya, out=yb)
    cc(yb, out=yc, residual=ya)  # the residual from two kernels back
    max_pool2d(cp.cuda.Device().id, yc, yp, pool)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_overlapped_launches_give_the_same_outputs(tmp_path, graph, monkeypatch):
    import cupy as cp

    a, b, cc, pool, x, ref = _chain(tmp_path)
    outputs = {}
    for overlap in (True, False):  # True first: it loads the driver's functions
        monkeypatch.setattr(launch_mod, "OVERLAP_LAUNCHES", overlap)
        assert launch_mod._overlaps(cp.cuda.Device().id) == overlap  # an H100: sm_90 and cuLaunchKernelEx
        attributes = []  # each launch's count of attributes: 1 where it overlaps the kernel before it
        driver = launch_mod._driver
        real = driver.launch_ex

        def recording(config, *argv, real=real):
            attributes.append(config._obj.numAttrs)  # config: byref(LaunchConfig)
            return real(config, *argv)

        monkeypatch.setattr(driver, "launch_ex", recording)
        x_dev = cp.asarray(x)
        bufs = [cp.full((1, 32, 14, 14), np.nan, cp.float32) for _ in range(4)]
        if graph:
            stream = cp.cuda.Stream(non_blocking=True)
            cp.cuda.get_current_stream().synchronize()
            with stream:
                stream.begin_capture()
                for _ in range(8):  # each replay runs the chain 8 times over, each reading the last's buffers
                    _run(a, b, cc, pool, x_dev, bufs)
                g = stream.end_capture()
            for _ in range(5):
                g.launch(stream=stream)
            stream.synchronize()
        else:
            for _ in range(8):
                _run(a, b, cc, pool, x_dev, bufs)
        # every launch goes through cuLaunchKernelEx: at least code, table, code, pool a chain, 8 chains
        assert len(attributes) >= 4 * 8, len(attributes)
        # overlapped only inside a capture (only a graph runs kernels back to back without the host between)
        assert set(attributes) == ({1} if graph and overlap else {0}), attributes
        y = bufs[3].get()
        assert not np.isnan(y).any()
        assert relative_l2(y, ref) <= 1e-5
        outputs[overlap] = y
    assert np.array_equal(outputs[False], outputs[True])


def test_pointer_launches_equal_the_checked_call(tmp_path):
    """launch_pointers called directly (the drop-in's eager path: raw
    pointers, no checks) on a stream that is not CuPy's current one computes
    what __call__ (the checks, then launch_pointers on CuPy's current stream)
    computes: a code kernel whose batch-1 variant sums its split reduction
    through the workspace and the reduction kernel, residual and ReLU fused,
    and a table kernel with a residual, at batch 1 and 3 (the prepared
    launches made at the first call, reused at the second); bit for bit
    against __call__ and within 1e-5 of float64."""
    import cupy as cp
    from dataclasses import replace

    from sparseconv.tilings import ANY_BATCH, variant_for_batch
    from sparseconv.table import TableConv2d

    rng = np.random.default_rng()
    s = ConvShape(512, 128, 7, 7, 3, 3, padding=(1, 1))
    w = pruned_weight(rng, s.weight_shape, 0.9)
    bias = rng.standard_normal(s.out_channels).astype(np.float32)
    split = replace(variant_for_batch(s, 1), slice_sum="kernel")
    assert split.slices > 1
    code = sparseconv.compile_conv2d(w, input_size=(7, 7), bias=bias, padding=1, activation="relu", residual=True,
                                     tiling=split, cache_dir=str(tmp_path), name="split")
    table = TableConv2d(w, bias, s, Epilogue("relu", residual=True), name="table")
    assert code.launches_pointers and table.launches_pointers
    assert code.variant(1)[1].tiling.slices > 1 and code.variant(ANY_BATCH)[1].tiling.slices > 1
    stream = cp.cuda.Stream(non_blocking=True)
    for batch in (1, 3):
        x = cp.asarray(rng.standard_normal((batch, 512, 7, 7)).astype(np.float32))
        r = cp.asarray(rng.standard_normal((batch, 128, 7, 7)).astype(np.float32))
        ref = np.maximum(conv2d_reference(x.get(), w, bias, (1, 1), (1, 1)) + r.get(), 0)
        for kernel in (code, table):
            checked = kernel(x, out=cp.full((batch, 128, 7, 7), np.nan, cp.float32), residual=r)
            raw = cp.full((batch, 128, 7, 7), np.nan, cp.float32)
            cp.cuda.get_current_stream().synchronize()
            with cp.cuda.Device(x.device.id):
                kernel.launch_pointers(x.data.ptr, raw.data.ptr, r.data.ptr, batch, stream.ptr)
            stream.synchronize()
            assert relative_l2(raw.get(), ref) <= 1e-5, kernel
            assert bool((raw.view(cp.uint32) == checked.view(cp.uint32)).all()), kernel


def _gpu_count() -> int:
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@pytest.mark.skipif(_gpu_count() < 2, reason="needs two GPUs")
def test_a_kernel_on_the_second_gpu_runs_there_whichever_gpu_is_current(tmp_path):
    """A code and a table kernel loaded on GPU 1, called while GPU 0 is
    current: the output is allocated on GPU 1 and the kernel runs there, on
    GPU 1's stream, within 1e-5 of float64."""
    import cupy as cp

    from sparseconv.table import TableConv2d

    rng = np.random.default_rng()
    s = ConvShape(16, 8, 10, 10, 3, 3, padding=(1, 1))
    w = pruned_weight(rng, s.weight_shape, 0.8)
    with cp.cuda.Device(1):
        code = sparseconv.compile_conv2d(w, input_size=(10, 10), padding=1, cache_dir=str(tmp_path), name="code")
        table = TableConv2d(w, None, s, name="table")
        x = cp.asarray(rng.standard_normal((2, 16, 10, 10)).astype(np.float32))
    ref = conv2d_reference(x.get(), w, None, (1, 1), (1, 1))
    assert code.device_id == table.device_id == 1
    with cp.cuda.Device(0):
        for kernel in (code, table):
            y = kernel(x)
            assert y.device.id == 1, kernel
            cp.cuda.Device(1).synchronize()
            assert relative_l2(y.get(), ref) <= 1e-5, kernel
