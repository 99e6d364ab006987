"""CPU: the whole-network bench's networks, pruning, report, table, plot and CLI
checks (the timing itself needs a GPU: tests/test_gpu_network.py)."""
import json

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402
from torch import nn  # noqa: E402

from sparseconv.benchmark.network import (NetworkBenchError, NetworkReport, NetworkTiming, exactness,  # noqa: E402
                                      format_table, network_command, parse_batches, plan_layers, plot_report,
                                      report_figure, run_network_bench)
from sparseconv.zoo_torch import (MNASNet, MobileNetV2, ResNeXt50, ResNet50, VGG16, build_network,  # noqa: E402
                                  prune_convs_)


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_resnet50_matches_torchvision_in_size_and_output_shape():
    m = ResNet50().eval()
    assert n_params(m) == 25_557_032
    convs = [c for c in m.modules() if isinstance(c, nn.Conv2d)]
    assert len(convs) == 53 and sum(isinstance(b, nn.BatchNorm2d) for b in m.modules()) == 53
    # torchvision's parameter names, so its state dicts would load
    names = dict(m.named_parameters())
    assert "layer1.0.downsample.0.weight" in names and "layer4.2.bn3.bias" in names and "fc.weight" in names
    assert m.layer2[0].conv2.stride == (2, 2) and m.layer2[0].conv1.stride == (1, 1)  # v1.5
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_vgg16_matches_torchvision_in_size_and_output_shape():
    m = VGG16().eval()
    assert n_params(m) == 138_357_544
    assert sum(isinstance(c, nn.Conv2d) for c in m.modules()) == 13
    assert not any(isinstance(b, nn.BatchNorm2d) for b in m.modules())
    with torch.no_grad():
        assert m(torch.randn(1, 3, 32, 32)).shape == (1, 1000)  # adaptive pooling to 7x7 as torchvision


def test_resnext50_matches_torchvision_in_size_and_has_32_group_3x3_convs():
    m = ResNeXt50().eval()
    assert n_params(m) == 25_028_904  # torchvision's resnext50_32x4d
    convs = {n: c for n, c in m.named_modules() if isinstance(c, nn.Conv2d)}
    assert len(convs) == 53
    grouped = [n for n, c in convs.items() if c.groups > 1]
    assert len(grouped) == 16 and all(convs[n].groups == 32 and convs[n].kernel_size == (3, 3) for n in grouped)
    assert convs["layer1.0.conv2"].in_channels == 128 and convs["layer4.2.conv3"].out_channels == 2048  # 32 x 4d
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


@pytest.mark.parametrize("network, params, depthwise_5x5, names", [
    (MobileNetV2, 3_504_872, 0, {"features.0.0.weight", "features.1.conv.0.0.weight", "features.1.conv.1.weight",
                                 "features.2.conv.3.weight", "features.18.1.bias", "classifier.1.weight"}),
    # MNASNet 1.0: 5x5 depthwise convs in stacks 2, 3 and 5
    (MNASNet, 4_383_312, 10, {"layers.0.weight", "layers.3.weight", "layers.7.bias", "layers.8.0.layers.3.weight",
                              "layers.13.0.layers.7.bias", "layers.14.weight", "classifier.1.weight"}),
])
def test_the_depthwise_networks_match_torchvision_in_size_and_names(network, params, depthwise_5x5, names):
    """torchvision's parameter counts (mobilenet_v2, mnasnet1_0) and names, so its state dicts would load."""
    m = network().eval()
    assert n_params(m) == params
    convs = {n: c for n, c in m.named_modules() if isinstance(c, nn.Conv2d)}
    assert len(convs) == 52
    depthwise = [c for c in convs.values() if c.groups > 1]
    assert len(depthwise) == 17 and all(c.groups == c.in_channels == c.out_channels for c in depthwise)
    assert sum(c.kernel_size == (5, 5) for c in depthwise) == depthwise_5x5
    assert names <= set(dict(m.named_parameters()))
    with torch.no_grad():
        assert m(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


@pytest.mark.parametrize("name", ["resnet50", "resnext50", "mobilenet_v2", "mnasnet1_0"])
def test_the_zoo_shapes_are_the_modules_convs(name):
    """sparseconv.zoo's layer lists (no torch: split_probe, bench --model) name
    and shape the convs as the torch modules run them at 224x224."""
    from sparseconv.zoo import model_layers
    from sparseconv.zoo_torch import NETWORKS

    m, seen = NETWORKS[name]().eval(), {}
    for layer, conv in m.named_modules():
        if isinstance(conv, nn.Conv2d):
            conv.register_forward_hook(lambda mod, args, out, layer=layer:
                                       seen.__setitem__(layer, (args[0].shape, mod)))
    with torch.no_grad():
        m(torch.randn(1, 3, 224, 224))
    zoo = dict(model_layers(name))
    if name != "mobilenet_v2":  # the zoo names ResNets' downsample convs without their Sequential's index
        seen = {n.replace("downsample.0", "downsample"): v for n, v in seen.items()}
    assert list(zoo) == list(seen)
    for layer, (x_shape, conv) in seen.items():
        s = zoo[layer]
        assert (s.in_channels, s.in_h, s.in_w) == tuple(x_shape[1:]), layer
        assert (s.out_channels, (s.kernel_h, s.kernel_w), s.stride, s.padding, s.groups) == \
            (conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.groups), layer


@pytest.mark.parametrize("name, fused", [
    # ResNeXt-50: as ResNet-50, every conv takes its BN, the last of a bottleneck its add and ReLU
    ("resnext50", {"bn+relu": 33, "bn": 4, "bn+add+relu": 16}),
    # MobileNetV2: ReLU6 after the expansions and depthwise convs, the projection adds its shortcut where it has one
    ("mobilenet_v2", {"bn+relu6": 35, "bn": 7, "bn+add": 10}),
    # MNASNet 1.0: as MobileNetV2 with ReLU
    ("mnasnet1_0", {"bn+relu": 35, "bn": 7, "bn+add": 10}),
])
def test_the_new_built_ins_go_through_the_fx_front_end_whole_and_exact(name, fused):
    """Every conv of the grouped and depthwise networks is compiled (none kept),
    BN folded and the epilogue fused, and the rewritten graph computes the
    original in float64 (the passes, not the kernels: those need a GPU)."""
    from collections import Counter

    from sparseconv.fx import prepare

    model = build_network(name, sparsity=0.9, seed=1).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    front = prepare(model, x, dtypes=(torch.float64,))
    assert front.traced and all(p.action == "sparseconv" for p in front.plans), \
        [(p.name, p.reason) for p in front.plans if p.action != "sparseconv"]
    assert Counter("+".join(p.fused) for p in front.plans) == fused
    with torch.no_grad():
        want, got = model(x), front.module(x)
    assert float((got - want).norm() / want.norm()) < 1e-12


@pytest.mark.parametrize("sparsity", [0.5, 0.9])
def test_pruning_hits_the_sparsity_in_every_conv_by_magnitude(sparsity):
    m = nn.Sequential(nn.Conv2d(3, 16, 3), nn.Conv2d(16, 32, 1))
    before = [c.weight.detach().clone() for c in m]
    prune_convs_(m, sparsity)
    for c, w in zip(m, before):
        zero = c.weight == 0
        assert abs(float(zero.double().mean()) - sparsity) <= 1.0 / w.numel()
        assert float(w.abs()[zero].max()) <= float(w.abs()[~zero].min())  # the smallest went
        assert torch.equal(c.weight[~zero], w[~zero])


def test_prune_linears_prunes_the_classifier_too_and_only_when_asked():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 64), nn.Linear(64, 10))
    prune_convs_(m, 0.75)
    assert float((m[0].weight == 0).double().mean()) == 0.75 and not (m[2].weight == 0).any()
    prune_convs_(m, 0.75, linears=True)
    for layer in (m[2], m[3]):
        assert float((layer.weight == 0).double().mean()) == 0.75


def test_built_in_network_is_pruned_seeded_and_in_eval_mode():
    a, b = build_network("resnet50", sparsity=0.9, seed=3), build_network("resnet50", sparsity=0.9, seed=3)
    assert not a.training
    assert torch.equal(a.layer3[1].conv2.weight, b.layer3[1].conv2.weight)
    assert torch.equal(a.layer3[1].bn2.running_var, b.layer3[1].bn2.running_var)
    for c in a.modules():
        if isinstance(c, nn.Conv2d):
            assert abs(float((c.weight == 0).double().mean()) - 0.9) < 1e-3
    with torch.no_grad():
        y = a(torch.randn(2, 3, 64, 64))
    assert torch.isfinite(y).all() and float(y.std()) > 0
    with pytest.raises(ValueError, match="unknown network 'alexnet'"):
        build_network("alexnet")


@pytest.mark.parametrize("name", ["resnext50", "mobilenet_v2", "mnasnet1_0"])
def test_the_grouped_and_depthwise_built_ins_are_pruned_in_every_conv(name):
    m = build_network(name, sparsity=0.9, seed=0)
    for c in m.modules():
        if isinstance(c, nn.Conv2d):
            # a depthwise 3x3 of 16 channels has 144 weights: 130 zeroed of them is 0.903
            assert abs(float((c.weight == 0).double().mean()) - 0.9) <= 0.5 / c.weight.numel() + 1e-9
    with torch.no_grad():
        y = m(torch.randn(2, 3, 64, 64))
    assert torch.isfinite(y).all() and float(y.std()) > 0


def test_exactness_is_relative_l2_and_top1_agreement():
    ref = torch.tensor([[0.0, 1.0, 0.5], [2.0, 0.0, 1.0]], dtype=torch.float64)
    y = ref.float().clone()
    y[1, 1] = 3.0  # image 1's top-1 changes
    rel, top1 = exactness(y, ref)
    assert abs(rel - 3.0 / float(ref.norm())) < 1e-7 and top1 == 0.5


def _report():
    r = NetworkReport("ResNet-50", "NVIDIA H100", "2026-11-23", "sparseconv bench --network resnet50", 0.9,
                      (224, 224), plan={"bn+relu": 33, "bn+add+relu": 16, "bn": 4})
    for batch, times in [(1, [400.0, 2191.0, 906.0, 2209.0, 530.0]), (64, [5000.0, 20028.0, 10876.0, None, 6999.0])]:
        for v, us in zip(["sparseconv", "eager fp32", "eager TF32", "compile fp32", "compile TF32"], times):
            tf32 = "TF32" in v
            r.timings.append(NetworkTiming("ResNet-50", batch, v, us, None if us is None else (5e-4 if tf32 else 4e-7),
                                           None if us is None else 1.0,
                                           "RuntimeError: inductor failed" if us is None else ""))
    return r


def test_table_has_times_speedups_exactness_and_failures():
    text = format_table([_report()])
    assert "| network, batch | sparseconv | eager fp32 | eager TF32 | compile fp32 | compile TF32 |" in text
    assert "| ResNet-50, 1 | 400 | 2,191 (5.48×) | 906 (2.27×) | 2,209 (5.52×) | 530 (1.32×) |" in text
    assert "| ResNet-50, 64 | 5,000 | 20,028 (4.01×) | 10,876 (2.18×) | – | 6,999 (1.40×) |" in text
    assert "4.0e-07 / 100%" in text and "5.0e-04 / 100%" in text
    assert "ResNet-50 batch 64 compile fp32: RuntimeError: inductor failed" in text


def test_a_run_whose_gpu_state_moved_says_so_under_the_table_and_in_the_json():
    r = _report()
    r.gpu_clocks = {"samples": 10, "sm_mhz": [1410, 1980]}
    r.run_warnings.append("the GPU's state moved during this run (the SM clock ranged 1410-1980 MHz; 10 samples)")
    assert format_table([r]).endswith("- warning, ResNet-50: the GPU's state moved during this run (the SM clock "
                                      "ranged 1410-1980 MHz; 10 samples)")
    data = json.loads(r.to_json())
    assert data["gpu_clocks"]["sm_mhz"] == [1410, 1980] and len(data["run_warnings"]) == 1
    assert "warning" not in format_table([_report()])


def test_report_json_round_trips_and_flags_inexact_sparseconv():
    r = _report()
    data = json.loads(r.to_json())
    assert data["plan"]["bn+add+relu"] == 16 and len(data["timings"]) == 10
    assert r.failures() == []
    r.timings.append(NetworkTiming("ResNet-50", 2, "sparseconv", 1.0, 3e-5, 1.0))
    assert r.failures() == ["ResNet-50 batch 2: sparseconv relative L2 3.00e-05 > 1e-05"]


def test_the_report_keeps_each_convs_path_and_the_times_behind_it():
    """The JSON says which convs went to cuDNN and why (session 10 needed it to
    explain a network that gained less than its layers)."""
    from sparseconv.fx import ConvPlan
    from sparseconv.shapes import ConvShape
    plans = [ConvPlan("features.0", "sparseconv", "", 0.9, ConvShape(3, 64, 32, 32, 3, 3), ("relu",)),
             ConvPlan("features.24", "mixed", "batch 1: sparseconv 40.7 us, cuDNN fp32 184.9 us; "
                      "batch 64: sparseconv 3978.0 us, cuDNN fp32 2101.4 us", 0.9,
                      ConvShape(512, 512, 28, 28, 3, 3), ("relu",)),
             ConvPlan("classifier.0", "kept", "not pruned", 0.0, None, kind="linear")]
    r = _report()
    r.plan_layers = plan_layers(plans)
    data = json.loads(r.to_json())["plan_layers"]
    assert [d["action"] for d in data] == ["sparseconv", "mixed", "kept"]
    assert data[1]["fused"] == "relu" and "cuDNN fp32 2101.4 us" in data[1]["reason"]
    assert data[2] == dict(name="classifier.0", kind="linear", action="kept", fused="", reason="not pruned")


def test_plot_writes_one_panel_per_batch(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    path = plot_report(_report(), tmp_path / "net.png")
    with Image.open(path) as im:
        w, h = im.size
    assert w > 1.5 * h  # two panels side by side


@pytest.mark.parametrize("batches,network", [((1,), "ResNet-50"), ((1, 64), "ResNet-50"),
                                            ((1,), "VGG-16 (Linears pruned too)")],
                         ids=["one-panel", "two-panels", "one-panel-long-name"])
def test_the_plot_title_fits_in_the_figure(batches, network):
    """Session 23's one-panel chart (a single --batch) cut its title at both ends."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    r = _report()
    r.network = network
    r.timings = [t for t in r.timings if t.batch in batches]
    r.device = "NVIDIA H100 80GB HBM3"
    fig = report_figure(r)
    fig.canvas.draw()
    title = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    plt.close(fig)
    assert fig.bbox.x0 <= title.x0 and title.x1 <= fig.bbox.x1
    assert title.y1 <= fig.bbox.y1


def test_parse_batches():
    assert parse_batches("1,64") == (1, 64)
    with pytest.raises(Exception, match="positive ints"):
        parse_batches("0,4")


def test_cli_refuses_unknown_networks_and_variants_with_usage_errors():
    runner = CliRunner()
    r = runner.invoke(network_command, ["--network", "alexnet"])
    assert r.exit_code == 2 and "unknown network 'alexnet'" in r.output
    r = runner.invoke(network_command, ["--network", "m.onnx"])
    assert r.exit_code == 2 and "m.onnx: no such ONNX file" in r.output
    r = runner.invoke(network_command, ["--variants", "eager fp16"])
    assert r.exit_code == 2 and "unknown eager fp16" in r.output
    r = runner.invoke(network_command, ["--batch", "x"])
    assert r.exit_code == 2


def test_prune_linears_is_refused_where_there_is_no_built_in_network_to_prune():
    from sparseconv.cli import main

    r = CliRunner().invoke(main, ["bench", "--prune-linears"])
    assert r.exit_code == 2 and "--prune-linears prunes a built-in network's classifier: use it with --network" \
        in r.output
    with pytest.raises(NetworkBenchError, match="prune_linears prunes a built-in network; a module or an ONNX file "
                                                "is timed as given"):
        run_network_bench(nn.Linear(2, 2), prune_linears=True)


def test_plot_and_json_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A figure that fails to save leaves the previous file as it was and no
    temporary file behind."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    path = tmp_path / "net.png"
    path.write_bytes(b"previous")

    def broken_savefig(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a PNG")
        raise OSError("No space left on device")

    monkeypatch.setattr(Figure, "savefig", broken_savefig)
    with pytest.raises(OSError, match="No space left"):
        plot_report(_report(), path)
    assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["net.png"]


def test_run_refuses_bad_arguments_before_building():
    with pytest.raises(NetworkBenchError, match="unknown variant"):
        run_network_bench("resnet50", variants=["sparseconv", "fast"])
    with pytest.raises(NetworkBenchError, match="unknown network"):
        run_network_bench("alexnet")

