"""Export a built-in pruned network (the weights `sparseconv bench --network
NAME` uses: sparsity 0.9, seed 0) to ONNX, as users bring models: the
TorchScript exporter, opset 17, a dynamic batch axis named N.

    python bench/export_network.py resnet50 resnet50.onnx
    sparseconv bench --network resnet50.onnx --batch 1 --batch 64

The exporter folds each BatchNorm into its conv, so the file's convs carry
the folded weights (zeros stay zeros)."""
from __future__ import annotations

import warnings
from pathlib import Path

import click
import torch

from sparseconv.cli_options import check_output_file
from sparseconv.zoo_torch import NETWORKS, build_network


@click.command()
@click.argument("network", type=click.Choice(sorted(NETWORKS)))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--sparsity", type=click.FloatRange(0, 1, max_open=True), default=0.9, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--prune-linears", is_flag=True, help="Prune the classifier too (as bench --network --prune-linears).")
def main(network: str, out: Path, sparsity: float, seed: int, prune_linears: bool) -> None:
    check_output_file(out, "OUT", ".onnx")  # before the network is built
    model = build_network(network, sparsity=sparsity, seed=seed, prune_linears=prune_linears)
    partial = out.with_name(out.name + ".partial")  # written whole, then renamed: a failed export leaves nothing
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notices
            torch.onnx.export(model, torch.randn(1, 3, 224, 224), str(partial), dynamo=False, opset_version=17,
                              input_names=["x"], output_names=["logits"],
                              dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    click.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
