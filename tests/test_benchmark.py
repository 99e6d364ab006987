"""`sparseconv bench`: the pure parts on the CPU (floor, geomean, im2col against
the float64 reference, formatting, option errors, the no-GPU message) and a
short real run on the GPU."""
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv import benchmark as bm
from sparseconv.benchmark import baselines as bl
from sparseconv.benchmark.cli import bench, parse_baselines, parse_sparsities
from sparseconv.dense import conv2d_im2col, im2col, torch_flags
from sparseconv.shapes import ConvShape
from sparseconv.testing import conv2d_reference, pruned_weight, relative_l2
from sparseconv.timing import Timing

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- floor and geomean

def test_floor_matches_hand_computed_numbers():
    vgg2 = ConvShape(64, 64, 224, 224, 3, 3, (1, 1), (1, 1))
    # memory-bound: 4 B x 64 images x (64 + 64) x 224 x 224 = 1,644,167,168 B at 3.0e12 B/s
    assert bm.floor_us(vgg2, 64, 3618) == pytest.approx(548.0557, rel=1e-6)
    alex2 = ConvShape(64, 192, 27, 27, 5, 5, (1, 1), (2, 2))
    # compute-bound: 2 x 30955 x 64 x 27 x 27 = 2,888,472,960 FLOP at 66.9e12 FLOP/s
    assert bm.floor_us(alex2, 64, 30955) == pytest.approx(43.1760, rel=1e-5)
    assert bm.floor_us(alex2, 64, 0) == pytest.approx(15.9252, rel=1e-5)  # no FMAs left: bytes alone


def test_geomean():
    assert bm.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert bm.geomean([0.5, 2.0, 1.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        bm.geomean([1.0, 0.0])
    with pytest.raises(ValueError):
        bm.geomean([])


# --------------------------------------------------------------------------- im2col

SHAPES = [
    ConvShape(3, 4, 9, 11, 3, 3, (1, 1), (1, 1)),
    ConvShape(2, 3, 13, 12, 5, 3, (2, 3), (2, 0)),
    ConvShape(4, 6, 10, 10, 3, 3, (1, 1), (2, 2), (2, 2), groups=2),
    ConvShape(3, 5, 17, 17, 11, 11, (4, 4), (2, 2)),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.describe())
def test_im2col_conv_matches_direct_float64_conv(shape):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, shape.in_channels, shape.in_h, shape.in_w))
    w = pruned_weight(rng, shape.weight_shape, 0.5)
    b = rng.standard_normal(shape.out_channels)
    y = conv2d_im2col(x, w, shape, b)
    ref = conv2d_reference(x, w, b, shape.stride, shape.padding, shape.dilation, shape.groups)
    assert y.shape == (3, shape.out_channels, shape.out_h, shape.out_w)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    assert relative_l2(y, ref) < 1e-14


def test_im2col_rows_follow_the_weight_flattening():
    shape = ConvShape(2, 1, 4, 4, 3, 3, (1, 1), (0, 0))
    x = np.arange(2 * 16, dtype=np.float64).reshape(1, 2, 4, 4)
    cols = im2col(x, shape)
    assert cols.shape == (2 * 9, 4)
    # row (c=1, r=2, s=0), column (ho=1, wo=0) reads x[0, 1, 3, 0]
    assert cols[1 * 9 + 2 * 3 + 0, 1 * 2 + 0] == x[0, 1, 3, 0]


# --------------------------------------------------------------------------- weights, parsing, selection

def test_layer_weight_is_seeded_per_layer_and_sparsity():
    layers = bm.benchmark_layers()
    assert len(layers) == 10
    vgg = next(layer for layer in layers if layer.name == "vgg-conv3")
    w = bm.layer_weight(vgg, 0.9, seed=0)
    assert w.shape == vgg.shape.weight_shape and w.dtype == np.float32
    assert abs((w == 0).mean() - 0.9) < 0.01
    np.testing.assert_array_equal(w, bm.layer_weight(vgg, 0.9, seed=0))
    assert not np.array_equal(w, bm.layer_weight(vgg, 0.9, seed=1))
    assert abs((bm.layer_weight(vgg, 0.3, seed=0) == 0).mean() - 0.3) < 0.01
    own = bm.BenchLayer("m", vgg.shape, weight=w[::-1].copy())
    np.testing.assert_array_equal(bm.layer_weight(own, None, seed=5), w[::-1])


def test_parse_sparsities_and_baselines():
    assert parse_sparsities("0.9") == (0.9,)
    assert parse_sparsities("0.9,0.5,0.9") == (0.5, 0.9)
    for bad in ("1.0", "-0.1", "abc", ""):
        with pytest.raises(ValueError):
            parse_sparsities(bad)
    assert parse_baselines("all") == bm.BASELINES
    assert parse_baselines("none") == ()
    assert parse_baselines("cusparse_spmm, cudnn_fp32") == ("cudnn_fp32", "cusparse_spmm")
    with pytest.raises(ValueError, match="cudnn_fp16"):
        parse_baselines("cudnn_fp16")


def test_select_layers():
    layers = bm.benchmark_layers()
    assert [layer.name for layer in bm.select_layers(layers, "vgg-*,lenet-conv1")] == \
        ["lenet-conv1", "vgg-conv1", "vgg-conv2", "vgg-conv3"]
    with pytest.raises(ValueError, match="matches no layer"):
        bm.select_layers(layers, "mobilenet-*")


# --------------------------------------------------------------------------- rows, geomeans, table, JSON

SHAPE = ConvShape(8, 8, 6, 6, 3, 3, (1, 1), (1, 1))


def _row(layer, batch, sparsity, us, graph=True, check_ok=True, shape=SHAPE, floor=2.0):
    """A synthetic row as run_bench fills it: us maps method -> microseconds."""
    row = bm.BenchRow(layer=layer, shape=shape, batch=batch, sparsity=sparsity, nnz=10, weights=100, tiling="",
                      floor_us=floor)
    for m, v in us.items():  # events include the host's launch gap
        row.record(m, Timing(v if graph else v + 20, "graph" if graph else "events", v + 20, 15.0,
                             v if graph else None, 7 if graph else 0))
    row.add_check("sparseconv", bm.Check.of("cudnn_fp32", 1e-7 if check_ok else 0.5))
    return row


def test_row_record_fills_every_method_column_and_serialises_with_the_old_keys():
    row = _row("a", 64, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 40.0}, check_ok=False)
    row.fail("cublas_gemm", "RuntimeError: boom")
    d = json.loads(json.dumps(row.to_dict()))
    assert list(d) == ["layer", "shape", "batch", "sparsity", "weight_sparsity", "nnz", "weights", "tiling",
                       "floor_us", "host_us", "us", "timing", "events_us", "graph_us", "graph_launches",
                       "timing_notes", "speedup", "check", "errors", "path"]
    assert d["shape"] == SHAPE.describe() and d["weight_sparsity"] == pytest.approx(0.9)
    assert d["us"] == {"sparseconv": 10.0, "cudnn_fp32": 40.0} and d["graph_launches"]["cudnn_fp32"] == 7
    assert d["host_us"] == 15.0 and d["speedup"] == {"cudnn_fp32": pytest.approx(4.0)}
    assert d["check"] == {"sparseconv": {"ref": "cudnn_fp32", "rel_l2": 0.5, "ok": False}}
    assert d["errors"] == {"cublas_gemm": "RuntimeError: boom"} and not row.checks_ok
    failed = bm.Check("float64 im2col", None, False, "ValueError: no")
    assert failed.to_dict()["error"] == "ValueError: no" and "error" not in bm.Check.of("x", 0.0).to_dict()
    with pytest.raises(Exception):
        row.batch = 1  # the identity of a row is fixed


def test_speedups_pair_times_of_the_same_method():
    row = _row("a", 1, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 40.0})
    assert row.speedup == {"cudnn_fp32": pytest.approx(4.0)}
    row.graph_us["cudnn_fp32"] = None  # cuDNN fell back to events: both sides use events
    assert row.speedup["cudnn_fp32"] == pytest.approx(60.0 / 30.0)


def test_the_sparseconv_figure_is_the_faster_path_compared_like_with_like():
    row = _row("a", 1, None, {"code": 12.0, "table": 7.0, "cudnn_fp32": 42.0})
    assert row.take_fastest() == "table" and row.us["sparseconv"] == 7.0 and row.path == {"sparseconv": "table"}
    assert row.speedup == {"cudnn_fp32": pytest.approx(6.0)}  # code and table are no baselines
    assert row.host_us == row.host_times_us["table"] and row.to_dict()["path"] == "table"
    # the table has no graph figure: events against events, where the code wins
    row.graph_us["table"], row.events_us["table"] = None, 40.0  # the code's events: 32
    assert row.take_fastest() == "code" and row.us["sparseconv"] == 12.0
    assert _row("b", 64, None, {"code": 12.0}).take_fastest() == "code"
    assert _row("c", 64, None, {"cudnn_fp32": 1.0}).take_fastest() is None


def test_bench_config_times_the_table_where_routing_would():
    from sparseconv.table import MAX_TABLE_BATCH

    dense, grouped = _shape(16, 16, 8, 3), ConvShape(16, 16, 8, 8, 3, 3, (1, 1), (1, 1), groups=4)
    both = bm.BenchConfig()
    assert both.times_table(dense, 1) and both.times_table(dense, MAX_TABLE_BATCH)
    assert not both.times_table(dense, MAX_TABLE_BATCH + 1) and not both.times_table(grouped, 1)
    only = bm.BenchConfig(paths=("table",))
    assert only.times_table(dense, 64) and not only.times_table(grouped, 64)
    assert not bm.BenchConfig(paths=("code",)).times_table(dense, 1)
    for bad in ((), ("tabel",), ("code", "cudnn")):
        with pytest.raises(ValueError, match="paths must be"):
            bm.BenchConfig(paths=bad)


def test_table_shows_both_paths_and_the_class_summary_counts_table_layers():
    c3 = _shape(8, 8, 8, 3)
    rows = []
    for name, us in (("conv1", {"code": 3.0, "table": 9.0, "cudnn_fp32": 6.0}),
                     ("b.conv2", {"code": 4.0, "table": 2.0, "cudnn_fp32": 8.0})):
        rows.append(_row(name, 1, None, us, shape=c3))
        rows[-1].take_fastest()
    text = bm.format_table(_result(rows))
    header = next(line for line in text.splitlines() if line.startswith("| layer"))
    assert header.startswith("| layer | N | sparsity | sparseconv | code | table | cuDNN fp32 |")
    assert "| b.conv2 | 1 | model | 2.0 | 4.0 | 2.0 | 8.0 | 4.00 |" in text
    assert "the faster of its two paths" in text
    got = {c["layer_class"]: c for c in _result(rows).classes}
    assert got["3x3"]["on_table"] == 1 and got["3x3"]["sparseconv_us"] == pytest.approx(2.0)
    assert "| 3x3 | 1 | 1 (1) | 2.0 | 8.0 |" in text
    # a run without the table keeps the old columns
    plain = bm.format_table(_result([_row("a", 1, 0.9, {"sparseconv": 1.0, "cudnn_fp32": 2.0})]))
    assert "| sparseconv | cuDNN fp32 |" in plain and "| code |" not in plain


def test_bench_cli_refuses_paths_with_a_network():
    res = CliRunner().invoke(bench, ["--network", "resnet50", "--paths", "table"])
    assert res.exit_code == 2 and "leave out --paths" in res.output
    res = CliRunner().invoke(bench, ["--paths", "tabel"])
    assert res.exit_code == 2 and "'tabel' is not one of" in res.output


def test_geomean_speedups_per_sparsity_and_batch():
    rows = [_row("a", 64, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 20.0, "cublas_gemm": 5.0}),
            _row("b", 64, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 80.0}),
            _row("a", 1, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 10.0})]
    g = {(x["batch"], x["baseline"]): x for x in bm.geomean_speedups(rows)}
    assert g[(64, "cudnn_fp32")]["geomean"] == pytest.approx(4.0)
    assert g[(64, "cudnn_fp32")]["layers"] == 2
    assert g[(64, "cublas_gemm")]["geomean"] == pytest.approx(0.5)
    assert g[(64, "cublas_gemm")]["slower_layers"] == 1
    assert g[(1, "cudnn_fp32")]["geomean"] == pytest.approx(1.0)
    assert (1, "cudnn_tf32") not in g


# --------------------------------------------------------------------------- summary by layer class

def _shape(c, k, size, r, stride=1):
    return ConvShape(c, k, size, size, r, r, (stride, stride), (r // 2, r // 2))


def test_layer_classes_of_resnet50():
    from sparseconv.zoo import model_layers

    layers = model_layers("resnet50")
    classes = [bm.layer_class(s, i == 0) for i, (_, s) in enumerate(layers)]
    counts = {c: classes.count(c) for c in set(classes)}
    # stem; 16 bottlenecks x (1x1 in, 1x1 out) = 32 1x1; 13 stride-1 3x3; 3 strided 3x3 (v1.5);
    # 4 downsamples, of which layer1's is stride 1 (a plain 1x1)
    assert counts == {"stem": 1, "1x1": 33, "3x3": 13, "strided 3x3": 3, "strided 1x1": 3}
    assert bm.layer_class(_shape(3, 64, 224, 3), first=False) == "stem"  # C <= 4 reads an image
    assert bm.layer_class(ConvShape(8, 8, 9, 9, 1, 3), first=False) == "other"  # 1x3 is no k x k
    # MobileNetV2's and ResNeXt-50's own classes, whatever their kernel and stride
    assert bm.layer_class(ConvShape(96, 96, 112, 112, 3, 3, (2, 2), (1, 1), groups=96), first=False) == "depthwise"
    assert bm.layer_class(ConvShape(8, 16, 9, 9, 3, 3, groups=8), first=False) == "depthwise"  # multiplier 2
    assert bm.layer_class(ConvShape(128, 128, 56, 56, 3, 3, padding=(1, 1), groups=32), first=False) == "grouped"
    from sparseconv.zoo import mobilenet_v2
    classes = [bm.layer_class(s, i == 0) for i, (_, s) in enumerate(mobilenet_v2())]
    assert {c: classes.count(c) for c in set(classes)} == {"stem": 1, "depthwise": 17, "1x1": 34}


def test_class_summary_sums_times_and_floors_per_class_and_batch():
    stem, c3, c1, down = _shape(3, 8, 16, 7, 2), _shape(8, 8, 8, 3), _shape(8, 16, 8, 1), _shape(8, 16, 8, 1, 2)
    s3, odd = _shape(8, 8, 8, 3, 2), ConvShape(8, 8, 9, 9, 1, 3)
    rows = []
    for batch in (1, 64):
        f = 1 if batch == 1 else 10
        rows += [_row("conv1", batch, None, {"sparseconv": 3.0 * f, "cudnn_fp32": 6.0 * f}, shape=stem),
                 _row("b.conv2", batch, None, {"sparseconv": 2.0 * f, "cudnn_fp32": 8.0 * f,
                                               "cudnn_tf32": 4.0 * f}, shape=c3, floor=1.0),
                 _row("c.conv2", batch, None, {"sparseconv": 6.0 * f, "cudnn_fp32": 4.0 * f,
                                               "cudnn_tf32": 2.0 * f}, shape=c3, floor=1.0),
                 _row("b.conv3", batch, None, {"sparseconv": 5.0 * f, "cudnn_fp32": 5.0 * f}, shape=c1),
                 _row("b.down", batch, None, {"sparseconv": 1.0 * f, "cudnn_fp32": 2.0 * f}, shape=down),
                 _row("d.conv2", batch, None, {"sparseconv": 1.0 * f, "cudnn_fp32": 3.0 * f}, shape=s3),
                 _row("e.conv", batch, None, {"sparseconv": 1.0 * f, "cudnn_fp32": 1.0 * f}, shape=odd)]
    result = _result(rows)
    got = {(c["batch"], c["layer_class"]): c for c in result.classes}
    assert [(c["batch"], c["layer_class"]) for c in result.classes] == \
        [(b, c) for b in (1, 64) for c in ("stem", "3x3", "strided 3x3", "1x1", "strided 1x1", "other")]
    # every layer is in exactly one class: none drops out of the summary
    assert all(sum(c["layers"] for c in result.classes if c["batch"] == b) == 7 for b in (1, 64))
    assert got[(64, "strided 3x3")]["x_cudnn_fp32"] == pytest.approx(3.0)
    three = got[(64, "3x3")]
    assert three["layers"] == 2 and three["sparseconv_us"] == pytest.approx(80.0)
    assert three["cudnn_fp32_us"] == pytest.approx(120.0) and three["cudnn_tf32_us"] == pytest.approx(60.0)
    assert three["x_cudnn_fp32"] == pytest.approx(1.5) and three["x_cudnn_tf32"] == pytest.approx(0.75)
    assert three["floor_us"] == pytest.approx(2.0) and three["per_floor"] == pytest.approx(40.0)
    # no TF32 time for the stem: no partial sum, no ratio
    assert got[(1, "stem")]["cudnn_tf32_us"] is None and got[(1, "stem")]["x_cudnn_tf32"] is None
    assert got[(1, "stem")]["x_cudnn_fp32"] == pytest.approx(2.0)
    text = bm.format_table(result)
    assert "Summed by layer class" in text
    assert "| 3x3 | 64 | 2 | 80.0 | 120.0 | 60.0 | 2.0 | 1.50 | 0.75 | 40.00 |" in text
    assert "| stem | 1 | 1 | 3.0 | 6.0 | - | 2.0 | 2.00 | - | 1.50 |" in text
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["classes"] == result.classes


def test_no_class_summary_for_random_masks():
    result = _result([_row("vgg-conv1", 1, 0.9, {"sparseconv": 1.0, "cudnn_fp32": 2.0})])
    assert result.classes == [] and "classes" not in result.to_dict()
    assert "Summed by layer class" not in bm.format_table(result)


def _result(rows, notes=()):
    return bm.BenchResult(dict(device="Test GPU", date="2026-11-22T00:00:00+00:00", command="sparseconv bench"),
                          rows, list(notes))


def test_table_marks_methods_failures_and_absent_columns():
    rows = [_row("lenet-conv1", 1, 0.9, {"sparseconv": 5.0, "cublas_gemm": 20.0}),
            _row("lenet-conv2", 1, 0.9, {"sparseconv": 8.0, "cublas_gemm": 4.0}, graph=False, check_ok=False)]
    text = bm.format_table(_result(rows, ["torch is not installed, so the cuDNN columns are absent"]))
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| layer"))
    assert "cuBLAS im2col+GEMM" in header and "cuDNN" not in header and "SpMM" not in header
    first = next(line for line in lines if line.startswith("| lenet-conv1"))
    assert "| 5.0 | 20.0 | 4.00 | 2.0 | 2.5 | 15.0 | ok |" in first
    second = next(line for line in lines if line.startswith("| lenet-conv2"))
    assert "| 28.0* | 24.0* |" in second and "FAIL sparseconv 5.0e-01" in second
    assert "batch 1, sparsity 0.9: geomean speedup over cuBLAS im2col+GEMM 1.85x (1 of 2 layers slower)" in text
    assert "Note: torch is not installed" in text


def test_json_round_trip():
    rows = [_row("a", 64, 0.9, {"sparseconv": 10.0, "cudnn_fp32": 20.0})]
    doc = json.loads(json.dumps(_result(rows).to_dict()))
    assert set(doc) == {"meta", "rows", "geomeans", "notes"}
    assert doc["rows"][0]["speedup"]["cudnn_fp32"] == pytest.approx(2.0)
    assert doc["geomeans"][0]["baseline"] == "cudnn_fp32"


def test_plot_of_a_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(name, b, sp, {"sparseconv": 10.0 * (1 - sp) + 1, "cusparse_spmm": 20.0})
            for name in ("a", "b") for b in (1, 64) for sp in (0.5, 0.9)]
    out = tmp_path / "sweep.png"
    assert bm.plot_sweep(_result(rows), str(out)) == ("cusparse_spmm",)  # no cuDNN in these rows: falls back
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="sweep"):
        bm.plot_sweep(_result(rows[:1]), str(out))


@pytest.mark.parametrize("batches", [(64,), (1, 64)])
def test_sweep_plot_puts_tf32_beside_fp32_and_clips_no_text(batches):
    """One row of panels per batch, cuDNN fp32 and TF32 side by side on one
    scale; every title and label inside the figure, also with a single batch
    (one narrow row), where the old one-line title was cut at both ends."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    rows = [_row(name, b, sp, {"sparseconv": 10.0 * (1 - sp) + 1, "cudnn_fp32": 20.0, "cudnn_tf32": 8.0})
            for name in ("resnet-conv2", "googlenet-conv2") for b in batches for sp in (0.5, 0.9)]
    result = _result(rows)
    result.meta["device"] = "NVIDIA H100 80GB HBM3"
    fig, baselines = bm.sweep_figure(json.loads(json.dumps(result.to_dict())))  # as bench --json wrote it
    try:
        assert baselines == ("cudnn_fp32", "cudnn_tf32")
        axes = fig.get_axes()
        titles = [f"over cuDNN {p}, batch {b}" for b in batches for p in ("fp32", "TF32")]
        assert [ax.get_title() for ax in axes] == titles
        for left, right in zip(axes[::2], axes[1::2]):  # side by side, one y scale
            assert left.get_position().x1 <= right.get_position().x0
            assert left.get_ylim() == right.get_ylim()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        texts = [fig._suptitle] + [t for ax in axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label)]
        for text in texts:
            box = text.get_window_extent(renderer)
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, \
                text.get_text()
        assert "NVIDIA H100 80GB HBM3, 2026-11-22" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_torch_flags_are_restored():
    torch = pytest.importorskip("torch")
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark)
    with pytest.raises(RuntimeError):
        with torch_flags(torch, tf32=not before[0], cudnn_benchmark=not before[2]):
            assert (cudnn.allow_tf32, matmul.allow_tf32) == (not before[0], not before[0])
            raise RuntimeError("inside")
    assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.benchmark) == before


# --------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("args, message", [
    (["--sparsity", "1.5"], "[0, 1)"),
    (["--sparsity", "lots"], "comma list"),
    (["--sparsity", "0.5", "--sweep"], "not both"),
    (["--model", "models/lenet_digits_pruned.onnx", "--sweep"], "do not apply with --model"),
    (["--baselines", "mkl"], "unknown baseline"),
    (["--layers", "mobilenet-*"], "matches no layer"),
    (["--plot", "sweep.svg", "--sweep"], "PNG"),
    (["--plot", "one.png"], "needs a sweep"),
    (["--batch", "0"], "x>=1"),
    (["--model", "no/such/model.onnx"], "no such file"),
])
def test_bad_options_exit_2(args, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    res = CliRunner().invoke(bench, args)
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_plot_without_matplotlib_exits_2_with_the_install_hint(monkeypatch):
    def missing():
        raise bm.BenchError("the PNG plot needs matplotlib: pip install 'sparseconv[bench]'")

    monkeypatch.setattr("sparseconv.benchmark.cli.require_matplotlib", missing)
    res = CliRunner().invoke(bench, ["--sweep", "--plot", "x.png"])
    assert res.exit_code == 2
    assert "needs matplotlib" in res.output


def test_no_gpu_gives_a_clear_message(monkeypatch):
    import cupy

    def no_device():
        raise cupy.cuda.runtime.CUDARuntimeError(100)  # cudaErrorNoDevice

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", no_device)
    res = CliRunner().invoke(bench, ["--layers", "lenet-conv1", "--batch", "1"])
    assert res.exit_code == 1
    assert "no CUDA GPU found" in res.output
    assert "Traceback" not in res.output


def test_help_shows_examples():
    res = CliRunner().invoke(bench, ["--help"])
    assert res.exit_code == 0
    assert "Examples:" in res.output and "sparseconv bench --sweep" in res.output


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.describe())
def test_gpu_im2col_matches_the_generic_one_in_both_orders(shape):
    import cupy

    x = cupy.random.standard_normal((3, shape.in_channels, shape.in_h, shape.in_w), dtype=cupy.float32)
    ref = im2col(x, shape, cupy)
    for order in ("C", "F"):
        cols = cupy.full(ref.shape, cupy.nan, dtype=cupy.float32, order=order)
        bl.gpu_im2col(x, shape, cols)
        cupy.testing.assert_array_equal(cols, ref)


@pytest.mark.gpu
def test_a_wrong_im2col_fails_the_baseline_check(monkeypatch):
    import cupy

    shape = ConvShape(3, 4, 9, 9, 3, 3, (1, 1), (1, 1))
    w = pruned_weight(np.random.default_rng(0), shape.weight_shape, 0.5)
    w[:, 0, 0, 0] = 1.0  # so the column the broken im2col zeroes matters
    rng = cupy.random.default_rng(0)
    good = bl.check_baselines(shape, w, ["cublas_gemm", "cusparse_spmm"], rng)
    assert all(c.ok for c in good.values()) and set(good) == {"cublas_gemm", "cusparse_spmm"}
    real = bl.gpu_im2col
    monkeypatch.setattr(bl, "gpu_im2col", lambda x, s, cols: (real(x, s, cols), cols.__setitem__(0, 0)))
    bad = bl.check_baselines(shape, w, ["cublas_gemm", "cusparse_spmm"], rng)
    assert not any(c.ok for c in bad.values())


@pytest.mark.gpu
def test_bench_runs_two_small_layers(session_cache_dir):
    layers = bm.select_layers(bm.benchmark_layers(), "lenet-conv1,resnet-conv2")
    config = bm.BenchConfig(batches=(1, 4), sparsities=(0.9,), repeat=5, max_seconds=0.5,
                            cache_dir=str(session_cache_dir), jobs=2)
    result = bm.run_bench(layers, config, command="test", log=lambda s: None)
    rows = [r.to_dict() for r in result.rows]
    assert [(r["layer"], r["batch"]) for r in rows] == \
        [("lenet-conv1", 1), ("lenet-conv1", 4), ("resnet-conv2", 1), ("resnet-conv2", 4)]
    for r in rows:
        assert not r["errors"], r["errors"]
        assert set(r["us"]) >= {"sparseconv", "cublas_gemm", "cusparse_spmm"}
        assert all(v > 0 for v in r["us"].values())
        assert r["host_us"] > 0 and r["floor_us"] > 0
        assert r["check"]["sparseconv"]["ok"] and r["check"]["table"]["ok"], r["check"]  # batch <= 8: both
        assert all(c["ok"] for c in r["check"].values()), r["check"]
        assert set(r["speedup"]) == set(r["us"]) - {"sparseconv", "code", "table"}
        assert r["us"]["sparseconv"] == min(r["us"]["code"], r["us"]["table"]) == r["us"][r["path"]]
    assert result.meta["device"] and result.meta["cupy"]
    if result.meta["torch"] is not None:
        assert result.meta["cudnn"] and "cudnn_fp32" in rows[0]["us"]
    assert "| resnet-conv2 | 4 |" in bm.format_table(result)
    json.dumps(result.to_dict())


@pytest.mark.gpu
def test_bench_times_the_table_alone_at_any_batch(session_cache_dir):
    layers = bm.select_layers(bm.benchmark_layers(), "resnet-conv2")
    config = bm.BenchConfig(batches=(16,), repeat=3, max_seconds=0.2, cache_dir=str(session_cache_dir),
                            baselines=("cudnn_fp32",), paths=("table",))
    (row,) = [r.to_dict() for r in bm.run_bench(layers, config, log=lambda s: None).rows]
    assert not row["errors"] and row["path"] == "table" and "code" not in row["us"]
    assert row["us"]["sparseconv"] == row["us"]["table"] > 0
    assert row["check"]["table"]["ok"] and "sparseconv" not in row["check"], row["check"]
    assert row["tiling"].startswith("weight table")


@pytest.mark.gpu
def test_bench_cli_on_the_shipped_model(tmp_path, session_cache_dir, monkeypatch):
    pytest.importorskip("onnx")
    monkeypatch.chdir(ROOT)
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(bench, ["--model", "models/lenet_digits_pruned.onnx", "--batch", "8", "--repeat", "3",
                                     "--max-seconds", "0.2", "--cache-dir", str(session_cache_dir),
                                     "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert [r["layer"] for r in doc["rows"]] == ["/conv1/Conv", "/conv2/Conv"]
    assert all(r["sparsity"] is None and r["check"]["sparseconv"]["ok"] for r in doc["rows"])
    assert doc["meta"]["sparsities"] is None
    assert doc["meta"]["gpu_clocks"]["samples"] == 2 and doc["meta"]["gpu_clocks"]["sm_mhz"][0] > 0  # one a row
    assert [(c["layer_class"], c["layers"]) for c in doc["classes"]] == [("stem", 1), ("3x3", 1)]
    assert "Summed by layer class" in res.output
