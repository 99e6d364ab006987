"""bench/code_per_block.py: bad arguments refused before it builds anything
(exit 2, one line naming the argument, no JSON written); its ptxas and PTX
instruction readings; the input path it builds each layer with."""
import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent.parent / "bench" / "code_per_block.py"
_spec = importlib.util.spec_from_file_location("code_per_block", SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


@pytest.mark.parametrize("args, says", [
    (["resnet50", "--layers", "layer9.conv1"], "no layer layer9.conv1 in resnet50"),
    (["resnet50", "--batch", "0"], "--batch must be at least 1"),
    (["vgg16", "--sparsity", "1.0"], "--sparsity must be in [0, 1)"),
    (["vgg16", "--workers", "0"], "--workers must be at least 1"),
    (["alexnet"], "invalid choice: 'alexnet'"),
    (["vgg16", "--input-loads", "texture"], "invalid choice: 'texture'"),
])
def test_bad_arguments_exit_2_naming_the_argument(tmp_path, args, says):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True,
                       cwd=SCRIPT.parent.parent)
    assert r.returncode == 2
    error = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and says in error[0], r.stderr
    assert not out.exists()


def test_registers_reads_ptxas_use_and_spills_under_the_cap():
    """--registers' ptxas_usage: one kernel with 48 loads live at once, as
    the build would assemble it, uncapped (no spills) and capped at 32
    registers (spills, and no more than the cap)."""
    from sparseconv.compile import compile_to_ptx
    from sparseconv.shapes import Target

    ptx = compile_to_ptx(r'''
extern "C" __global__ void live48(const float* __restrict__ x, float* y) {
    float v[48];
#pragma unroll
    for (int i = 0; i < 48; ++i) v[i] = x[i * blockDim.x + threadIdx.x];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 48; ++i) s = fmaf(s, v[47 - i], v[i]);
    y[threadIdx.x] = s;
}''', Target("sm_90"), "a 48-live-value kernel")
    free = script.ptxas_usage(ptx, "sm_90", 3, 255)
    assert free["spill_bytes"] == 0 and 48 < free["registers"] <= 255 and free["register_cap"] == 255
    capped = script.ptxas_usage(ptx, "sm_90", 3, 32)
    assert capped["spill_bytes"] > 0 and capped["registers"] <= 32 and capped["register_cap"] == 32
    counts = script.ptx_instructions(ptx)
    assert counts["ptx_fmas"] == ptx.count("fma.rn.f32") and counts["ptx_other"] >= 48  # the 48 loads at least


def test_ptx_instructions_counts_instructions_not_labels_directives_or_comments():
    ptx = """.version 8.0
.target sm_90
.visible .func sc_kblock_0(
	.param .b64 p
)
{
	.reg .f32 %f<4>;
	// chunk 0 of output-channel block 0
	ld.shared.f32 %f1, [%r1];
	fma.rn.f32 %f2, %f1, 0f3F800001, %f3;
$L__BB0_2:
	@%p1 bra $L__BB0_2;
	cp.async.ca.shared.global [%r2+128], [%rd1], 4;
	fma.rn.f32 %f3, %f1, 0f3F800002, %f2;
	ret;
}
"""
    assert script.ptx_instructions(ptx) == dict(ptx_fmas=2, ptx_other=4, ptx_global_loads=0, ptx_copies=1,
                                                ptx_shared_reads=1, ptx_prefetches=0, ptx_movs=0)


def test_input_loads_stages_the_pointwise_variants_that_can_take_it():
    from sparseconv.shapes import ConvShape, Tiling
    from sparseconv.tilings import default_direct_tiling, variant_for_batch
    from sparseconv.zoo import vgg16

    conv4_2 = dict(vgg16())["conv4_2"]
    pointwise = variant_for_batch(conv4_2, 64)
    assert script.with_input_loads(conv4_2, pointwise, "staged") == replace(pointwise, input_loads="staged")
    direct = default_direct_tiling(conv4_2)
    assert script.with_input_loads(conv4_2, direct, "staged") == direct  # the direct family stages anyway
    narrow = ConvShape(2, 8, 6, 6, 3, 3, (1, 1), (1, 1))  # padded taps behind tests: not staged
    t = Tiling(8, 2, 1, 32, family="pointwise")
    assert script.with_input_loads(narrow, t, "staged") == t
