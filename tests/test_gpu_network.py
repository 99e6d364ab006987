"""GPU: the whole-network bench end to end on small inputs (every variant,
exactness of sparseconv vs the float64 original, the table and the plot)."""
import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)) + x)
        return self.fc(x.mean((2, 3)))


def test_tiny_network_bench_runs_every_variant(session_cache_dir, tmp_path):
    from sparseconv.benchmark.network import VARIANTS, format_table, plot_report, run_network_bench
    from sparseconv.zoo_torch import prune_convs_

    net = prune_convs_(Tiny(), 0.9).eval()
    report = run_network_bench(net, (1, 4), input_size=(16, 16), repeat=3, cache_dir=str(session_cache_dir),
                               progress=False)
    # routing may send a conv to the weight table at batch 1 ("mixed") or at both sizes ("table", both are
    # small); the fusion is in plan_layers
    assert sum(report.plan.values()) == 2 and set(report.plan) <= {"bn+relu", "bn+add+relu", "mixed", "table"}
    assert sorted(d["fused"] for d in report.plan_layers) == ["bn+add+relu", "bn+relu"]
    # each conv routed at the batch sizes timed, not sparsify's default 1 and 64
    for d in report.plan_layers:
        assert "batch 1: sparseconv" in d["reason"] and "batch 4: sparseconv" in d["reason"], d["reason"]
        assert "batch 64" not in d["reason"], d["reason"]
    got = {(t.variant, t.batch): t for t in report.timings}
    assert set(got) == {(v, b) for v in VARIANTS for b in (1, 4)}
    for b in (1, 4):
        ours = got["sparseconv", b]
        assert ours.us > 0 and ours.rel_l2 <= 1e-5 and ours.top1 == 1.0
        assert got["eager fp32", b].rel_l2 <= 1e-5
    assert report.failures() == []
    text = format_table([report])
    assert "| Tiny, 4 |" in text
    pytest.importorskip("matplotlib")
    assert plot_report(report, tmp_path / "tiny.png").stat().st_size > 0


def test_built_in_vgg16_small_input(session_cache_dir):
    from sparseconv.benchmark.network import run_network_bench

    report = run_network_bench("vgg16", (2,), input_size=(32, 32), variants=["sparseconv", "eager fp32"],
                               repeat=3, cache_dir=str(session_cache_dir), progress=False)
    # 13 convs with their ReLU fused; routed by measurement at batch 2 only, so a conv may run through cuDNN
    # or, on these small images, the weight table at every batch size ("dense", "table"); a pool may be fused
    assert sum(report.plan.values()) == 13 and set(report.plan) <= {"relu", "relu+maxpool", "dense", "table"}
    (ours,) = [t for t in report.timings if t.variant == "sparseconv"]
    assert ours.rel_l2 <= 1e-5 and ours.top1 == 1.0


def test_built_in_depthwise_network_small_input(session_cache_dir):
    """MobileNetV2's depthwise convs with ReLU6 and its projections with their
    shortcut, through sparsify at batch 1 and 3, against the float64 original.
    ~80 s on the H200, most of it the cold build. (ResNeXt-50's build is too
    long for a test: it ran past the 200 s its first run allowed, two smaller
    tests included; its grouped convs are tested layer by layer, test_gpu_conv's
    odd layers, and `bench --network resnext50` fails a run whose output is
    not exact.)"""
    from sparseconv.benchmark.network import run_network_bench

    convs = 52
    report = run_network_bench("mobilenet_v2", (1, 3), input_size=(32, 32), variants=["sparseconv"], repeat=3,
                               cache_dir=str(session_cache_dir), progress=False)
    assert sum(report.plan.values()) == convs and "kept" not in report.plan
    assert len(report.plan_layers) == convs and all(d["fused"].startswith("bn") for d in report.plan_layers)
    for t in report.timings:
        assert t.rel_l2 <= 1e-5 and t.top1 == 1.0 and t.us > 0


def test_an_onnx_file_runs_through_the_network_bench(session_cache_dir):
    """The shipped LeNet (ONNX), converted by onnx_torch: sparsify's kernels
    against float64 of the same converted network, at its own input size."""
    from pathlib import Path

    from sparseconv.benchmark.network import format_table, run_network_bench

    path = Path(__file__).resolve().parents[1] / "models" / "lenet_digits_pruned.onnx"
    report = run_network_bench(str(path), (1, 16), variants=["sparseconv", "eager fp32"], repeat=3,
                               cache_dir=str(session_cache_dir), progress=False)
    assert report.network == "lenet_digits_pruned.onnx" and report.input_size == (8, 8) and report.sparsity is None
    assert sum(report.plan.values()) >= 2   # its two convs, with their ReLU and 2x2 max pool fused
    assert all(d["fused"] == "relu+maxpool" for d in report.plan_layers if d["kind"] == "conv")
    for t in report.timings:
        assert t.us > 0 and t.rel_l2 <= 1e-5 and t.top1 == 1.0, t
    assert "| lenet_digits_pruned.onnx, 16 |" in format_table([report])


def test_queued_timing_leaves_out_the_hosts_submit_time():
    """time_forward_us(queue_ahead_us=...) times the GPU's work only: a call
    whose host part takes 2 ms before it launches ~0.05 ms of GPU work
    measures >= 2 ms from an idle GPU, and well under that queued behind a
    5 ms wait (the network bench's method since session 46)."""
    import time

    from sparseconv.benchmark.network import time_forward_us

    x = torch.randn(1 << 16, device="cuda")

    def slow_host_call(t):
        time.sleep(0.002)   # host work before the launch: Python, a busy host
        return t * 2.0 + 1.0

    plain = time_forward_us(slow_host_call, x, repeat=5)
    queued = time_forward_us(slow_host_call, x, repeat=5, queue_ahead_us=5000.0)
    assert plain >= 2000.0
    assert 0.0 < queued < 1000.0, (plain, queued)
