"""GPU: autotuning (tiling="auto") and the opt-in dense fallback (backend="auto"),
against a float64 reference on fresh random inputs."""
import numpy as np
import pytest

from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2

from sparseconv.tune import SPARSE_EVENTS

pytestmark = pytest.mark.gpu


def _check(conv, w, b, shape_kw, batch=3):
    import cupy as cp

    s = conv.shape
    x = cp.asarray(np.random.default_rng().standard_normal((batch, s.in_channels, s.in_h, s.in_w), np.float32))
    stream = cp.cuda.Stream(non_blocking=True)
    # x was copied in on the current stream, which a non-blocking one does not
    # wait for: without this the kernel may read the memory before the copy
    # lands (seen once with seven test shards sharing the GPU: the output of the
    # previous check's input, relative L2 1.35)
    cp.cuda.get_current_stream().synchronize()
    with stream:
        y = conv(x)
    stream.synchronize()
    ref = conv2d_reference(x.get(), w, b, **shape_kw)
    assert relative_l2(y.get(), ref) <= 1e-5


def test_autotune_picks_the_fastest_candidate_and_caches_the_choice(tmp_path):
    from sparseconv import compile_conv2d

    rng = np.random.default_rng()
    w, b = pruned_weight(rng, (32, 16, 3, 3), 0.9), rng.standard_normal(32).astype(np.float32)
    kw = dict(stride=(1, 1), padding=(1, 1))
    conv = compile_conv2d(w, input_size=(20, 20), bias=b, padding=1, tiling="auto", tune_batch=8,
                          cache_dir=str(tmp_path))
    t = conv.stats["tuning"]
    assert len(t["times_us"]) >= 2 and all(v > 0 for v in t["times_us"].values())
    assert t["tiling"] == min(t["times_us"], key=t["times_us"].get) == conv.stats["tiling"]
    assert not t["cache_hit"] and conv.backend == "sparseconv"
    _check(conv, w, b, kw)
    again = compile_conv2d(w, input_size=(20, 20), bias=b, padding=1, tiling="auto", tune_batch=8,
                           cache_dir=str(tmp_path))
    assert again.stats["tuning"]["cache_hit"] and again.stats["tiling"] == t["tiling"]
    assert again.stats["kernel_cache_hit"]  # the chosen kernel is rebuilt from the cache, not re-tuned
    _check(again, w, b, kw)


def test_backend_auto_routes_a_dense_layer_to_cudnn(tmp_path):
    pytest.importorskip("torch")
    from sparseconv import DenseConv2dKernel, compile_conv2d

    rng = np.random.default_rng()
    w, b = pruned_weight(rng, (64, 64, 3, 3), 0.0), rng.standard_normal(64).astype(np.float32)
    conv = compile_conv2d(w, input_size=(28, 28), bias=b, padding=1, backend="auto", tune_batch=32,
                          cache_dir=str(tmp_path))
    t = conv.stats["tuning"]
    assert set(t["times_us"]) >= {"dense", conv.stats["tiling"]}
    # No weight is zero: cuDNN (strict fp32) should win; whichever wins is what runs.
    assert conv.backend == t["backend"] == ("dense" if t["times_us"]["dense"] < t["times_us"][SPARSE_EVENTS]
                                            else "sparseconv")
    assert isinstance(conv, DenseConv2dKernel) == (conv.backend == "dense")
    _check(conv, w, b, dict(stride=(1, 1), padding=(1, 1)), batch=5)


def test_sparsify_reports_dense_layers(tmp_path):
    torch = pytest.importorskip("torch")
    from torch import nn

    import sparseconv.torch as sct

    net = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).cuda().eval()
    with torch.no_grad():
        net[2].weight.mul_((torch.rand_like(net[2].weight) > 0.99).float())
    x = torch.randn(4, 64, 28, 28, device="cuda")
    fast = sct.sparsify(net, x, backend="auto", tune_batch=16, cache_dir=str(tmp_path), route_batches=None)
    plan = {p.name: p for p in fast.sparseconv_plan}
    assert {plan["0"].action, plan["2"].action} <= {"sparseconv", "dense"}
    # the result is a torch.fx GraphModule: submodules keep the model's names
    assert plan["0"].action == fast.get_submodule("0").kernel.backend
    assert plan["2"].action == fast.get_submodule("2").kernel.backend
    with torch.no_grad():
        ref = net.double()(x.double())
        y = fast(x)
    assert float((y.double() - ref).norm() / ref.norm()) <= 1e-5
