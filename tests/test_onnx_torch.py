"""CPU: ONNX -> torch.fx (sparseconv/onnx_torch.py), checked against
onnxruntime, the oracle for ONNX semantics, on fresh random inputs; that
sparsify's front end folds and fuses the converted graph; and what the
conversion and `bench --network model.onnx` refuse."""
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from click.testing import CliRunner  # noqa: E402
from onnx import helper  # noqa: E402

from onnx_models import residual_net, save_model  # noqa: E402
from sparseconv.cli import main  # noqa: E402
from sparseconv.fx import LinearOptions, prepare  # noqa: E402
from sparseconv.model import ModelError  # noqa: E402
from sparseconv.onnx_torch import onnx_to_torch  # noqa: E402
from sparseconv.testing import pruned_weight, relative_l2  # noqa: E402

LENET = Path(__file__).resolve().parents[1] / "models" / "lenet_digits_pruned.onnx"
F32 = np.float32


def _onnxruntime(path, x):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _export(net, shape, path):
    """What users bring: `net` exported by torch.onnx (opset 17, a dynamic batch axis)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
        torch.onnx.export(net, torch.randn(1, *shape), str(path), dynamo=False, opset_version=17,
                          input_names=["x"], dynamic_axes={"x": {0: "N"}})
    return path


def _converts_like_onnxruntime(path, batch, tol=1e-5):
    """Convert `path`, run it on a fresh random batch and check it against
    onnxruntime; returns (module, input shape, x, the module's output)."""
    module, shape = onnx_to_torch(path)
    x = np.random.default_rng().standard_normal((batch,) + shape).astype(F32)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    assert relative_l2(got, _onnxruntime(path, x)) <= tol
    return module, shape, x, got


def test_the_shipped_lenet_converts_and_matches_onnxruntime():
    _, shape, _, _ = _converts_like_onnxruntime(LENET, 5, tol=1e-6)
    assert shape == (1, 8, 8)


def test_a_residual_net_converts_matches_onnxruntime_and_sparsify_folds_and_fuses_it(tmp_path):
    path = residual_net(tmp_path, np.random.default_rng(3))
    module, shape, x, got = _converts_like_onnxruntime(path, 3)
    assert shape == (3, 12, 12)
    types = {type(m).__name__ for m in module.modules()}
    assert {"Conv2d", "BatchNorm2d", "ReLU", "ReLU6", "MaxPool2d", "AdaptiveAvgPool2d", "Linear"} <= types
    # the image size can be changed, as for `sparseconv run`
    assert onnx_to_torch(path, (16, 20))[1] == (3, 16, 20)
    # what sparsify does with it: BN folded, the residual add and the ReLU fused
    front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
    assert front.traced
    assert [(p.name, p.fused) for p in front.plans if p.kind == "conv"] == [
        ("conv1", ("bn", "relu")), ("conv2", ("bn", "add", "relu"))]
    with torch.no_grad():
        assert relative_l2(front.module(torch.from_numpy(x)).numpy(), got) <= 1e-5


def test_an_operator_it_does_not_cover_is_refused_naming_the_node_and_the_alternative(tmp_path, monkeypatch):
    """CONVERTERS covers every operator of runner.OPS; one taken out stands
    for an operator the runner gains before the conversion does."""
    from sparseconv import onnx_torch

    monkeypatch.delitem(onnx_torch.CONVERTERS, "LayerNormalization")
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("LayerNormalization", ["c", "g"], ["out"], name="norm", axis=-1)]
    path = save_model(tmp_path / "ln.onnx", nodes, {"w": pruned_weight(rng, (4, 3, 1, 1), 0.5),
                                                     "g": np.ones(5, F32)}, [1, 3, 5, 5])
    with pytest.raises(ModelError, match=r"ln.onnx: node norm has operator LayerNormalization, which the ONNX -> "
                                         r"torch conversion does not cover .*; `sparseconv run` runs the model"):
        onnx_to_torch(path)


def test_bench_network_takes_an_onnx_file_and_refuses_what_does_not_apply_to_one(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["bench", "--network", str(tmp_path / "missing.onnx")])
    assert r.exit_code == 2 and "missing.onnx: no such ONNX file" in r.output
    r = runner.invoke(main, ["bench", "--network", str(LENET), "--prune-linears"])
    assert r.exit_code == 2 and "an ONNX file is timed with its own weights" in r.output
    r = runner.invoke(main, ["bench", "--network", str(LENET), "--sparsity", "0.5"])
    assert r.exit_code == 2 and "--sparsity prunes a built-in network" in r.output
    # the bench's own view of an ONNX network: its file name, the converted module, its input shape
    from sparseconv.benchmark.network import NetworkBenchError, load_network

    loaded = load_network(str(LENET))
    assert loaded.name == "lenet_digits_pruned.onnx" and loaded.input_shape == (1, 8, 8)
    assert not loaded.module.training and loaded.sparsity is None    # timed with its own weights
    assert load_network(str(LENET), input_size=(16, 16)).input_shape == (1, 16, 16)
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(NetworkBenchError, match="bad.onnx"):
        load_network(str(tmp_path / "bad.onnx"))


@pytest.mark.parametrize("axis", [0, 2, -1, 4])
def test_flatten_at_any_axis_matches_onnxruntime(tmp_path, axis):
    """Flatten before a dense head is axis 1; the others (0, inner, negative,
    the rank) take onnx_flatten."""
    rng = np.random.default_rng(axis + 10)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Flatten", ["c"], ["out"], axis=axis)]
    path = save_model(tmp_path / "flat.onnx", nodes, {"w": pruned_weight(rng, (4, 3, 3, 3), 0.5)}, [2, 3, 5, 6])
    module, shape = onnx_to_torch(path)
    x = rng.standard_normal((2,) + shape).astype(F32)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    want = _onnxruntime(path, x)
    assert got.shape == want.shape and relative_l2(got, want) <= 1e-6


def test_a_network_exported_by_torch_onnx_converts_and_matches_onnxruntime(tmp_path):
    """What users bring: a pruned residual CNN exported by torch.onnx (which
    folds BN into the convs and writes Flatten/Gemm heads), converted back:
    the same outputs as onnxruntime, and sparsify's front end fuses the
    residual add and ReLU into the second conv."""
    from torch import nn

    from sparseconv.zoo_torch import prune_convs_

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.bn0 = nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16)
            self.conv, self.bn1 = nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
            self.pool, self.fc = nn.MaxPool2d(3, 2, 1), nn.Linear(16, 10)

        def forward(self, x):
            x = self.pool(torch.relu(self.bn0(self.stem(x))))
            x = torch.relu(self.bn1(self.conv(x)) + x)
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))

    torch.manual_seed(0)
    net = prune_convs_(Block(), 0.8).eval()
    with torch.no_grad():
        for bn in (net.bn0, net.bn1):
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 2.0)
    path = _export(net, (3, 16, 16), tmp_path / "exported.onnx")
    module, shape, x, got = _converts_like_onnxruntime(path, 4)
    assert shape == (3, 16, 16)
    front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
    fused = sorted(p.fused for p in front.plans if p.kind == "conv")
    assert fused == [("add", "relu"), ("relu",)]   # BN was folded by the exporter already


def test_a_file_that_fixes_its_batch_size_is_benched_at_that_size_only(tmp_path):
    from sparseconv.benchmark.network import LoadedNetwork, NetworkBenchError, check_onnx_batches

    nodes = [helper.make_node("Conv", ["x", "w"], ["out"], name="conv")]
    path = save_model(tmp_path / "b1.onnx", nodes, {"w": pruned_weight(np.random.default_rng(0), (4, 3, 1, 1), 0.5)},
                      [1, 3, 5, 5])
    module, shape = onnx_to_torch(path)
    assert module.onnx_batch == 1 and onnx_to_torch(LENET)[0].onnx_batch is None
    loaded = LoadedNetwork(path.name, module, shape)
    check_onnx_batches(loaded, (1,))
    with pytest.raises(NetworkBenchError, match=r"b1.onnx: the file fixes the batch size to 1, asked for 1, 64; "
                                                r"export it with a dynamic batch axis"):
        check_onnx_batches(loaded, (1, 64))


def test_a_head_that_reshapes_by_the_input_batch_converts(tmp_path):
    """x.view(x.size(0), -1) exports as Shape -> Gather -> Unsqueeze -> Concat
    -> Reshape: kept as sizes traced from each call's input, so any batch
    runs, and sparsify's front end still traces the graph."""

    from torch import nn

    class ViewHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8 * 4 * 4, 10)

        def forward(self, x):
            x = nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(x.view(x.size(0), -1))

    path = _export(ViewHead().eval(), (3, 8, 8), tmp_path / "view.onnx")
    assert "Shape" in {n.op_type for n in onnx.load(str(path)).graph.node}
    module, shape = onnx_to_torch(path)
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch,) + shape).astype(F32)
        with torch.no_grad():
            got = module(torch.from_numpy(x)).numpy()
        assert got.shape == (batch, 10) and relative_l2(got, _onnxruntime(path, x)) <= 1e-5
    front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
    assert front.traced and [p.fused for p in front.plans if p.kind == "conv"] == [("relu", "maxpool")]
    with torch.no_grad():
        assert tuple(front.module(torch.randn(3, *shape)).shape) == (3, 10)


def _mobile_block():
    from torch import nn

    class MobileBlock(nn.Module):
        """MobileNetV2/V3 pieces: ReLU6, depthwise conv, a linear bottleneck with
        a residual add, squeeze-excite (pool, 1x1 convs, sigmoid, Mul), Hardswish."""

        def __init__(self):
            super().__init__()
            self.expand = nn.Sequential(nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
            self.depthwise = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, groups=32, bias=False),
                                           nn.BatchNorm2d(32), nn.ReLU6())
            self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(32, 8, 1), nn.ReLU(), nn.Conv2d(8, 32, 1),
                                    nn.Sigmoid())
            self.project = nn.Sequential(nn.Conv2d(32, 8, 1, bias=False), nn.BatchNorm2d(8))
            self.head = nn.Sequential(nn.Conv2d(8, 16, 1), nn.Hardswish(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                      nn.Linear(16, 10))

        def forward(self, x):
            y = self.depthwise(self.expand(x))
            return self.head(x + self.project(y * self.se(y)))

    return MobileBlock(), (8, 12, 12)


def _inception_block():
    from torch import nn

    class InceptionBlock(nn.Module):
        """GoogLeNet pieces: ceil_mode pools, branches concatenated on channels,
        an average pool that leaves the padding out of its count."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2, ceil_mode=True))
            self.b1 = nn.Conv2d(16, 8, 1)
            self.b2 = nn.Sequential(nn.Conv2d(16, 8, 1), nn.ReLU(), nn.Conv2d(8, 12, 3, padding=1))
            self.b3 = nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), nn.Conv2d(16, 4, 1))
            self.tail = nn.Sequential(nn.AvgPool2d(2, ceil_mode=True), nn.Flatten(), nn.LazyLinear(10))

        def forward(self, x):
            x = self.stem(x)
            return self.tail(torch.relu(torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)))

    return InceptionBlock(), (3, 15, 15)


@pytest.mark.parametrize("make", [_mobile_block, _inception_block], ids=["mobilenet-block", "inception-block"])
def test_exported_blocks_of_common_architectures_convert_and_match_onnxruntime(tmp_path, make):

    from sparseconv.zoo_torch import prune_convs_

    torch.manual_seed(0)
    net, shape = make()
    with torch.no_grad():
        net(torch.randn(1, *shape))   # LazyLinear's size
    net = prune_convs_(net, 0.5).eval()
    path = _export(net, shape, tmp_path / "block.onnx")
    module, got_shape, x, got = _converts_like_onnxruntime(path, 2)
    assert got_shape == shape
    front = prepare(module, torch.from_numpy(x[:1]), linear=LinearOptions())
    assert front.traced and sum(p.action == "sparseconv" for p in front.plans if p.kind == "conv") >= 4
    with torch.no_grad():
        assert relative_l2(front.module(torch.from_numpy(x)).numpy(), got) <= 1e-5


def test_inspect_says_whether_the_fx_front_end_can_take_the_file(tmp_path, monkeypatch):
    from sparseconv import onnx_torch

    r = CliRunner().invoke(main, ["inspect", str(LENET)])
    assert r.exit_code == 0 and r.output.splitlines()[-1] == \
        "fx front end (`run`, `bench --network`): converts to a torch.fx graph of 2 convs, input (N, 1, 8, 8)"
    monkeypatch.delitem(onnx_torch.CONVERTERS, "LayerNormalization")   # every runner operator converts now
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("LayerNormalization", ["c", "g"], ["out"], name="norm", axis=-1)]
    path = save_model(tmp_path / "ln.onnx", nodes, {"w": pruned_weight(rng, (4, 3, 1, 1), 0.5),
                                                     "g": np.ones(5, F32)}, [1, 3, 5, 5])
    r = CliRunner().invoke(main, ["inspect", str(path)])
    last = r.output.splitlines()[-1]
    assert r.exit_code == 0 and last.startswith(
        "fx front end (`run`, `bench --network`): cannot convert it (node norm has operator LayerNormalization")
    assert last.endswith("); `run` uses the ONNX runner, `bench --network` cannot time it"), last
