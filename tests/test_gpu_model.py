"""GPU: the shipped pruned LeNet end to end (ONNX runner and `sparseconv run`)
against the dense float64 model."""
import json

import numpy as np
import pytest
from click.testing import CliRunner

from sparseconv.testing import relative_l2
from shipped_models import DIGITS, LENET, MODELS

pytestmark = pytest.mark.gpu


def test_shipped_lenet_gives_the_dense_predictions_on_the_whole_test_split(session_cache_dir):
    pytest.importorskip("onnx")
    import cupy as cp

    from sparseconv.runner import compile_model  # the runner (the fx front end: test_gpu_onnx_fx.py)
    from sparseconv.runner import load_data, predict, run_reference

    model = compile_model(LENET, cache_dir=str(session_cache_dir))
    assert sorted(model.kernels) == ["/conv1/Conv", "/conv2/Conv"]
    x, labels = load_data(DIGITS, model.program)
    y = predict(model, x, 128)
    ref = predict(lambda b: run_reference(model.program, b)[0], x, 450)
    assert np.array_equal(y.argmax(1), ref.argmax(1))  # all 450 predictions
    assert relative_l2(y, ref) <= 1e-5
    record = json.loads((MODELS / "lenet_digits.json").read_text())
    assert int(np.sum(y.argmax(1) == labels)) == round(record["pruned_test_accuracy"] * len(x))
    # A fresh random batch too (never only the dataset).
    xr = cp.random.default_rng().random((7, 1, 8, 8), dtype=cp.float32)
    assert relative_l2(model(xr).get(), run_reference(model.program, xr)[0]) <= 1e-5


def test_cli_run_checks_against_the_dense_reference(session_cache_dir, tmp_path):
    pytest.importorskip("onnx")
    from sparseconv.cli import main

    out = tmp_path / "logits.npy"
    r = CliRunner().invoke(main, ["run", str(LENET), "--data", str(DIGITS), "--check", "--json", "-o", str(out),
                                  "--cache-dir", str(session_cache_dir)])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output[r.output.index("{"):])
    assert s["same_predictions"] == 450 and s["relative_l2_vs_reference"] <= 1e-5 and s["conv_layers"] == 2
    assert np.load(out).shape == (450, 10)
