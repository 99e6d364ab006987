"""A tiling rule on and off inside a whole network: runs bench/network_profile.py
(one network, one batch size) with the named rules of sparseconv.tilings
switched back to what they were before, and prints one line to compare:
graph replay, kernel sum and each conv's kernel time inside the network.

    for m in "" two-wave-splits "" two-wave-splits; do
        python bench/network_ab.py resnet50 --batch 1 --without "$m" --out ab.json
    done

Run the two settings alternately (ABAB) in one device call: the replay of
one forward moves by a few percent from run to run, the per-kernel sums by
well under one (session 16, docs/PERFORMANCE.md). The compile cache keeps
both settings' kernels, so after the first pass a run takes about a minute.

Rules (each was measured this way before it landed):
  two-wave-splits   batch-1 splits of 64-thread blocks fill two waves
                    (tilings.COLD_SPLIT_TWO_WAVE_MAX_THREADS), not one
  direct-cluster    the direct family's slices summed in a cluster
                    (tilings.summed_in_cluster), not by the reduction kernel
  cluster-sum       any slices summed in a cluster (session 15): with it off,
                    every split adds its slices in the reduction kernel
  wide-direct-chunks  direct-family splits of 256+ input channels stage 4
                    channels a chunk (tilings.SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS),
                    not 2
  whole-image-split  deep 28x28- and 56x56-class k x k convs (256+ input
                    channels; 128+ where the image takes several blocks)
                    split on the pointwise family, as few blocks as cover
                    the image (tilings.whole_image_split), not on the direct
                    family
  large-image-blocks  VGG-16's 112x112 3x3 convs at batch 1 in 800-thread
                    blocks of 16 channels (tilings.large_image_blocks), not the
                    default's blocks (256 threads x 64 channels on conv2_1,
                    512 x 32 on conv2_2)
  gemv              dense nn.Linear layers of 1,000+ features at batch <= 8
                    through sparseconv.gemv (gemv.MIN_GEMV_FEATURES), not
                    cuBLAS's F.linear
  table             convs at batch <= 8 timed through the weight-table family
                    too (sparseconv.table, routed by measurement), not only
                    the code and cuDNN
  overlap-launches  our kernels launched to overlap the kernel before them
                    (sparseconv.launch, programmatic dependent launch), not
                    one after another
  long-table-channels  table layers of 256+ entries a channel and 128+ output
                    pixels at 4 pixels a lane and 16 warps
                    (table.VERY_LONG_CHANNEL), not table_tiling's other rules
  image-layer-blocks  the image layer (3-4 input channels) at batch 1 in
                    16-channel blocks of 256 threads (tilings.image_layer_blocks),
                    not its default direct tiling
  expanding-pointwise-blocks  expanding 1x1 convs (K >= 2C, stride 1, 28x28
                    to 56x56) at batch 1 in 16-channel blocks
                    (tilings.expanding_pointwise_blocks), not their pointwise
                    default or its cold split
  staged-table-entries  the table kernel's entries staged in shared memory
                    before it waits on the kernel before (table.STAGE_ENTRIES),
                    not read by each warp from global memory
  evict-first-weights  weights read as data (the table's entries, the gemv's
                    weights and entries) loaded with an L2 evict-first policy
                    (sparseconv.weight_loads.EVICT_FIRST), not a normal one
"""
from __future__ import annotations

import argparse
import json
import runpy
import sys
from pathlib import Path

import sparseconv.tilings as tilings


def without_two_wave_splits() -> None:
    tilings.COLD_SPLIT_TWO_WAVE_MAX_THREADS = 0


def without_direct_cluster() -> None:
    summed_in_cluster = tilings.summed_in_cluster

    def pointwise_only(shape, split):
        return split if split.family == "direct" else summed_in_cluster(shape, split)

    tilings.summed_in_cluster = pointwise_only  # looked up at call time by small_batch_tiling


def without_cluster_sum() -> None:
    tilings.summed_in_cluster = lambda shape, split: split


def without_wide_direct_chunks() -> None:
    tilings.SPLIT_DIRECT_WIDE_CHUNK_MIN_CHANNELS = 1 << 30


def without_whole_image_split() -> None:
    tilings.whole_image_split = lambda shape: None  # looked up at call time by small_batch_tiling


def without_large_image_blocks() -> None:
    tilings.large_image_blocks = lambda shape: None  # looked up at call time by small_batch_tiling


def without_gemv() -> None:
    import sparseconv.gemv as gemv

    gemv.MIN_GEMV_FEATURES = 1 << 62  # no layer is that wide: gemv_takes refuses every one


def without_table() -> None:
    import sparseconv.torch as sc_torch

    sc_torch.MAX_TABLE_BATCH = 0  # looked up at call time by route_by_batch: no batch is timed on the table


def without_long_table_channels() -> None:
    import sparseconv.table as table

    table.VERY_LONG_CHANNEL = float("inf")  # read at call time by table_tiling


def without_overlap_launches() -> None:
    import sparseconv.launch as launch

    launch.OVERLAP_LAUNCHES = False  # read at each launch


def without_image_layer_blocks() -> None:
    tilings.image_layer_blocks = lambda shape, tiling: None  # looked up at call time by batch1_blocks


def without_staged_table_entries() -> None:
    import sparseconv.table as table

    table.STAGE_ENTRIES = False  # read by table_tiling at each call


def without_evict_first_weights() -> None:
    import sparseconv.weight_loads as weight_loads

    weight_loads.EVICT_FIRST = False  # read when a table or gemv kernel's source is made


def without_expanding_pointwise_blocks() -> None:
    tilings.expanding_pointwise_blocks = lambda shape, tiling: None  # looked up at call time by batch1_blocks


RULES = {"two-wave-splits": without_two_wave_splits, "direct-cluster": without_direct_cluster,
         "cluster-sum": without_cluster_sum, "wide-direct-chunks": without_wide_direct_chunks,
         "whole-image-split": without_whole_image_split, "large-image-blocks": without_large_image_blocks,
         "gemv": without_gemv, "table": without_table, "overlap-launches": without_overlap_launches,
         "long-table-channels": without_long_table_channels, "image-layer-blocks": without_image_layer_blocks,
         "expanding-pointwise-blocks": without_expanding_pointwise_blocks,
         "staged-table-entries": without_staged_table_entries,
         "evict-first-weights": without_evict_first_weights}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("network", choices=["resnet50", "vgg16"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--without", action="append", default=[],
                    help=f"a rule to switch off (repeatable; empty: none): {', '.join(RULES)}")
    ap.add_argument("--out", required=True, help="network_profile.py's JSON")
    args = ap.parse_args()
    off = [name for name in args.without if name]
    unknown = [name for name in off if name not in RULES]
    if unknown:
        ap.error(f"unknown rule {unknown[0]!r}; known: {', '.join(RULES)}")
    if args.batch < 1:
        ap.error(f"--batch must be 1 or more, got {args.batch}")
    if not Path(args.out).resolve().parent.is_dir():  # refused now, not after minutes of compiling
        ap.error(f"--out {args.out}: folder {Path(args.out).resolve().parent} does not exist")
    for name in off:
        RULES[name]()
    sys.argv = ["network_profile.py", args.network, "--batch", str(args.batch), "--out", args.out]
    runpy.run_path(str(Path(__file__).with_name("network_profile.py")), run_name="__main__")
    prof = json.loads(Path(args.out).read_text())[f"batch{args.batch}"]
    per_conv = {k: round(v, 1) for k, v in prof["in_network_us"].items()}
    print(f"without {'+'.join(off) or 'nothing'}: replay {prof['graph_replay_us']:.1f} us, kernel sum "
          f"{prof['kernel_sum_us']:.1f} us, per conv {json.dumps(per_conv)}")


if __name__ == "__main__":
    main()
