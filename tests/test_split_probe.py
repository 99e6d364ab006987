"""bench/split_probe.py's CPU side: order-independent weight draws and the
SASS load-depth reading that --sass reports."""
import importlib.util
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sparseconv.zoo import resnet50, vgg16

spec = importlib.util.spec_from_file_location("split_probe", Path(__file__).parent.parent / "bench" / "split_probe.py")
split_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(split_probe)

SASS = """
        /*0000*/                   LDG.E.CONSTANT R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E.CONSTANT R5, desc[UR4][R2.64+0x100] ;
        /*0020*/                   LDG.E R6, desc[UR4][R8.64] ;
        /*0030*/                   FFMA R10, R4, 1.5, R10 ;
        /*0040*/                   MOV R6, RZ ;
        /*0050*/                   FFMA R11, R4.reuse, -2, R11 ;
        /*0060*/               @P0 FFMA R12, R5, 0.25, R12 ;
        /*0070*/                   STG.E desc[UR4][R2.64], R10 ;
"""


def test_load_depths_count_instructions_to_the_first_read():
    # R4 (instruction 0) first read at 3; R5 (1) at 6, a predicated read;
    # R6 is overwritten before any read, so it has no depth
    assert split_probe.load_depths(SASS) == [3, 5]


def test_a_layers_random_weights_do_not_depend_on_the_other_layers_named():
    shapes = dict(vgg16())
    w = split_probe.layer_weight(0, "vgg16:conv1_2", shapes["conv1_2"])
    assert np.array_equal(w, split_probe.layer_weight(0, "vgg16:conv1_2", shapes["conv1_2"]))
    assert not np.array_equal(w, split_probe.layer_weight(1, "vgg16:conv1_2", shapes["conv1_2"]))
    assert 0.85 < (w == 0).mean() < 0.95 and w.dtype == np.float32


def test_suffixes_set_their_tiling_fields():
    """(A misspelt candidate's refusal is in the fault suite, tests/test_faults.py.)"""
    assert split_probe.suffix_fields(["O1", "B2", "Scluster"]) == dict(ptxas_level=1, min_blocks=2, slice_sum="cluster")


def test_c_block_suffix_sets_the_chunk_width_of_either_family():
    shapes = dict(vgg16())
    assert split_probe.suffix_fields(["C8"]) == dict(c_block=8)
    default = split_probe.parse_cand(shapes["conv4_2"], "direct", 1)
    direct = split_probe.parse_cand(shapes["conv4_2"], "direct:C8", 1)
    assert direct.family == "direct" and direct.c_block == 8 != default.c_block
    assert direct == replace(default, c_block=8)  # only c_block moves
    assert split_probe.parse_cand(shapes["conv5_2"], "32x224x8:C16", 1).c_block == 16


def test_a_and_l_suffixes_stage_or_prefetch_a_pointwise_candidates_input():
    conv4_2 = dict(vgg16())["conv4_2"]
    default = split_probe.parse_cand(conv4_2, "default", 64)
    assert split_probe.parse_cand(conv4_2, "default:A", 64) == replace(default, input_loads="staged")
    assert split_probe.parse_cand(conv4_2, "default:L", 64) == replace(default, input_loads="prefetched")
    with pytest.raises(ValueError, match="pointwise-family path"):
        split_probe.parse_cand(conv4_2, "direct:A", 64)


def test_pixels_suffix_sets_the_pixels_a_thread_of_a_pointwise_candidate():
    from sparseconv.zoo import mobilenet_v2

    dw = dict(mobilenet_v2())["features.16.conv.1.0"]
    t = split_probe.parse_cand(dw, "1x256x1:P4", 64)
    assert (t.family, t.k_block, t.threads, t.thread_w, t.tile_w) == ("pointwise", 1, 256, 4, 1024)
    assert split_probe.parse_cand(dw, "1x256x1", 64).thread_w == 1
    # c_block on a depthwise layer: that many groups a block, k_block with them (shapes.kernel_shape)
    t = split_probe.parse_cand(dw, "4x256x1x4:B2", 64)
    assert (t.k_block, t.c_block, t.min_blocks) == (4, 4, 2)
    assert split_probe.parse_cand(dw, "8x256x1x4", 64).k_block == 4  # the merged group's 4 output channels
    assert split_probe.parse_cand(dict(vgg16())["conv4_2"], "32x256x1x8", 1).k_block == 32  # others as before
    with pytest.raises(ValueError, match="pointwise candidate"):
        split_probe.parse_cand(dict(vgg16())["conv4_2"], "direct:P2", 1)
    with pytest.raises(ValueError, match="pointwise candidate"):  # not silently dropped from a default
        split_probe.parse_cand(dw, "default:P2", 64)


def test_sparsity_one_leaves_no_weight_and_the_draw_stays_per_layer():
    shapes = dict(vgg16())
    assert not split_probe.layer_weight(0, "vgg16:conv4_2", shapes["conv4_2"], 1.0).any()
    dense = split_probe.layer_weight(0, "vgg16:conv4_2", shapes["conv4_2"], 0.0)
    assert (dense != 0).all()
    half = split_probe.layer_weight(0, "vgg16:conv4_2", shapes["conv4_2"], 0.5)
    assert 0.45 < (half == 0).mean() < 0.55


def test_a_d_candidate_is_an_unsplit_direct_tiling_of_that_block():
    shapes = dict(resnet50())
    t = split_probe.parse_cand(shapes["conv1"], "d8x1x256", 1)
    assert (t.family, t.k_block, t.thread_w, t.threads, t.slices) == ("direct", 8, 1, 256, 1)
    assert split_probe.parse_cand(shapes["conv1"], "d16x2x128:O1", 1).ptxas_level == 1
