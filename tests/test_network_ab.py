"""bench/network_ab.py's switches put back the tiling rules as they were
before each landed (the A side of the A/B runs docs/PERFORMANCE.md reports).
Each runs in its own interpreter: a switch rebinds sparseconv.tilings' names."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

PROBE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("network_ab", "bench/network_ab.py")
ab = importlib.util.module_from_spec(spec); spec.loader.exec_module(ab)
for name in sys.argv[1:]:
    ab.RULES[name]()
from sparseconv.tilings import default_direct_tiling, variant_for_batch
from sparseconv.zoo import resnet50, vgg16
r50, vgg = dict(resnet50()), dict(vgg16())
t = variant_for_batch(r50["layer4.1.conv1"], 1)
d = variant_for_batch(vgg["conv3_1"], 1, default_direct_tiling(vgg["conv3_1"]))
w = variant_for_batch(vgg["conv3_2"], 1, default_direct_tiling(vgg["conv3_2"]))
i, j = variant_for_batch(vgg["conv4_2"], 1), variant_for_batch(vgg["conv3_2"], 1)
b = variant_for_batch(vgg["conv2_2"], 1)
print(t.slices, t.slice_sum, d.family, d.slice_sum, w.c_block, i.family + "/" + j.family, b.k_block)
"""


def variants(*without):
    out = subprocess.run([sys.executable, "-c", PROBE, *without], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    slices, pointwise_sum, family, direct_sum, c_block, whole, k_block = out.stdout.split()
    return int(slices), pointwise_sum, family, direct_sum, int(c_block), whole, int(k_block)


def test_the_landed_rules_and_each_switched_off():
    # Landed (session 16): layer4's 64-thread split fills two waves (16 slices);
    # VGG-16 conv3_1's direct split sums its 2 slices in a cluster. Session 17:
    # conv3_2's direct split (256 channels) stages 4 channels a chunk (its
    # default split is no longer direct since session 19: its direct tiling's).
    # Session 18: conv4_2 (28x28) splits as one pointwise block over the image;
    # session 19: conv3_1 and conv3_2 (56x56) as four, and conv2_2 (112x112)
    # runs blocks of 16 output channels, not its default's 32 (64 until
    # session 55). (conv3_1's direct split is read from its direct tiling.)
    pw, dd = "pointwise/pointwise", "direct/direct"
    assert variants() == (16, "cluster", "direct", "cluster", 4, pw, 16)
    assert variants("two-wave-splits") == (8, "cluster", "direct", "cluster", 4, pw, 16)
    assert variants("direct-cluster") == (16, "cluster", "direct", "kernel", 4, pw, 16)
    assert variants("two-wave-splits", "direct-cluster") == (8, "cluster", "direct", "kernel", 4, pw, 16)
    assert variants("cluster-sum") == (16, "kernel", "direct", "kernel", 4, pw, 16)
    assert variants("wide-direct-chunks") == (16, "cluster", "direct", "cluster", 2, pw, 16)
    assert variants("whole-image-split") == (16, "cluster", "direct", "cluster", 4, dd, 16)
    assert variants("large-image-blocks") == (16, "cluster", "direct", "cluster", 4, pw, 32)


SWITCHES = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("network_ab", "bench/network_ab.py")
ab = importlib.util.module_from_spec(spec); spec.loader.exec_module(ab)
for name in sys.argv[1:]:
    ab.RULES[name]()
"""


def printed(code: str, *without: str) -> str:
    """What `code` prints after bench/network_ab.py switched off the rules `without`, in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", SWITCHES + code, *without], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_the_gemv_switch_leaves_every_dense_linear_to_cublas():
    code = ("from torch import nn\nfrom sparseconv.fx import swap_dense_linears\n"
            "print(swap_dense_linears(nn.Sequential(nn.Linear(2048, 1000), nn.Linear(1000, 4096))))")
    assert printed(code) == "['0', '1']"
    assert printed(code, "gemv") == "[]"


def test_the_table_switch_times_no_batch_on_the_table():
    code = "import sparseconv.torch as sct\nprint(sct.MAX_TABLE_BATCH)"
    assert printed(code) == "8"
    assert printed(code, "table") == "0"


def network_profile():
    """bench/network_profile.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("network_profile", ROOT / "bench" / "network_profile.py")
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    return prof


def test_network_profile_attributes_kernels_and_sums_routes_with_the_table():
    prof = network_profile()
    kernels = [("sc_conv2d_a", 5.0), ("sc_reduce_slices", 2.0), ("sc_table_conv", 3.0), ("max_pool", 1.0),
               ("sc_conv2d_b", 4.0), ("sc_table_conv", 6.0)]
    calls = [("conv1", "sparseconv"), ("conv2", "table"), ("conv3", "dense"), ("conv4", "sparseconv"),
             ("conv5", "table")]
    assert prof.attribute_kernels(kernels, calls) == {"conv1": 7.0, "conv2": 3.0, "conv4": 4.0, "conv5": 6.0}
    assert prof.category("sc_table_conv") == "table"
    plan = ["conv1: mixed relu batch 1: sparseconv 25.0 us, table 15.0 us, cuDNN fp32 160.0 us; "
            "batch 64: sparseconv 170.0 us, cuDNN fp32 660.0 us",
            "conv2: sparseconv relu batch 1: sparseconv 5.0 us, cuDNN fp32 9.0 us"]
    assert prof.routed_sum_us(plan, 1) == 20.0 and prof.routed_sum_us(plan, 64) == 170.0


def test_graph_spans_share_the_replay_out_among_overlapping_kernels():
    prof = network_profile()
    # a starts at 0; b is let in early (starts at 8) and ends at 15; c waits 5 us
    # after b and ends inside nothing; d starts and ends inside c
    kernels = [("a", 0.0, 10.0), ("b", 8.0, 15.0), ("c", 20.0, 30.0), ("d", 22.0, 25.0)]
    shares, gaps = prof.graph_spans(kernels)
    assert shares == [("a", 10.0), ("b", 5.0), ("c", 10.0), ("d", 0.0)] and gaps == 5.0
    assert sum(us for _, us in shares) + gaps == 30.0 - 0.0


def test_the_overlap_switch_turns_overlapped_launches_off():
    code = "import sparseconv.launch as launch\nprint(launch.OVERLAP_LAUNCHES, launch._overlaps(0))"
    assert printed(code, "overlap-launches") == "False False"  # off before any device is asked
    assert printed("import sparseconv.launch as launch\nprint(launch.OVERLAP_LAUNCHES)") == "True"


@pytest.mark.parametrize("switch, layer", [("image-layer-blocks", "conv1"),
                                           ("expanding-pointwise-blocks", "layer1.0.conv3")])
def test_a_batch1_blocks_switch_leaves_its_layer_the_default_tiling_at_batch_1(switch, layer):
    code = ("from sparseconv.tilings import variant_for_batch, default_tiling\nfrom sparseconv.zoo import resnet50\n"
            f"s = dict(resnet50())[{layer!r}]\nprint(variant_for_batch(s, 1) == default_tiling(s))")
    assert printed(code) == "False"
    assert printed(code, switch) == "True"


def test_the_staged_entries_switch_leaves_the_table_reading_global_memory():
    code = ("from sparseconv.table import table_tiling\nfrom sparseconv.zoo import resnet50\n"
            "print(table_tiling(dict(resnet50())['layer4.1.conv2']).staged_entries)")
    assert printed(code) == "True"
    assert printed(code, "staged-table-entries") == "False"


def test_front_end_ab_lists_the_kernels_whose_shares_differ_most(monkeypatch):
    """bench/front_end_ab.py --profile: the two calls' spans, then kernel
    names by |fx - runner|, a kernel only one side ran counted as 0 on the other."""
    import importlib.util

    pytest.importorskip("cupy")
    monkeypatch.setitem(sys.modules, "network_profile", network_profile())  # as when run from bench/
    spec = importlib.util.spec_from_file_location("front_end_ab", ROOT / "bench" / "front_end_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    side = dict(span_us=100.0, gaps_us=1.0, kernels=3, by_category_us={"sparseconv": 90.0})
    profiles = {"runner": dict(side, by_kernel_us={"sc_conv2d_a": 60.0, "gemm": 30.0, "copy": 9.0}),
                "fx": dict(side, by_kernel_us={"sc_conv2d_a": 61.0, "gemm": 20.0, "bias_add": 5.0})}
    lines = ab.profile_lines(profiles, top=3).splitlines()
    assert lines[0] == "  runner: span 100.0 us, gaps 1.0, 3 kernels, {'sparseconv': 90.0}"
    assert [line.split()[-1] for line in lines[2:]] == ["gemm", "copy", "bias_add"]
    assert lines[2].split()[:5] == ["-10.0", "us", "fx", "20.0", "runner"]
    assert ab.profile_lines({"runner": {"not split": "7 kernel events over 5 calls"}, "fx": side}) == \
        "  profile: runner: 7 kernel events over 5 calls; fx: split"


def test_the_evict_first_switch_takes_the_l2_policy_off_the_weight_loads():
    code = ("from sparseconv.gemv import gemv_source\nfrom sparseconv.table import table_source, table_tiling\n"
            "from sparseconv.zoo import resnet50\ns = dict(resnet50())['layer4.1.conv2']\n"
            "print(' '.join(str(int('SC_EVICT_FIRST_WEIGHTS 1' in src)) for src in (gemv_source(1), "
            "table_source(s, table_tiling(s)))))")
    assert printed(code) == "1 1"
    assert printed(code, "evict-first-weights") == "0 0"
