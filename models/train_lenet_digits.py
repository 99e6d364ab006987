"""Train, prune and export the shipped model: a LeNet-5-style CNN on scikit-learn's
bundled 8x8 digits (no download), CPU only.

    python models/train_lenet_digits.py            # writes models/lenet_digits_pruned.onnx
                                                   # and models/lenet_digits.json (accuracies)

1. Train the dense network (Adam, fixed seed) on a stratified 75/25 split.
2. Magnitude-prune the conv weights, globally across both conv layers, in steps
   of 50%, 75% and `--sparsity` (default 90%) of all conv weights.
3. Fine-tune after each step with the masks held fixed (pruned weights stay
   exactly 0).
4. Export to ONNX (opset 17) with a dynamic batch dimension, and record the
   dense and pruned test accuracies.
"""
import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

HERE = Path(__file__).resolve().parent


class LeNetDigits(nn.Module):
    """conv(1->20, 3x3) -> relu -> maxpool -> conv(20->50, 3x3) -> relu -> maxpool -> fc 200->500->10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 3, padding=1)
        self.conv2 = nn.Conv2d(20, 50, 3, padding=1)
        self.fc1 = nn.Linear(50 * 2 * 2, 500)
        self.fc2 = nn.Linear(500, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def data(seed: int):
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]  # (n, 1, 8, 8) in [0, 1]
    xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=seed,
                                          stratify=digits.target)
    return (torch.from_numpy(xtr), torch.from_numpy(ytr).long(), torch.from_numpy(xte), torch.from_numpy(yte).long())


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(model: nn.Module, x, y, epochs: int, lr: float, masks=None, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(x), generator=g).split(64):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            if masks:  # keep pruned weights exactly zero
                with torch.no_grad():
                    for p, m in masks:
                        p.mul_(m)


def magnitude_masks(model: LeNetDigits, sparsity: float):
    """Zero the smallest `sparsity` fraction of all conv weights (one global
    threshold, so the tiny first layer keeps what it needs)."""
    convs = (model.conv1, model.conv2)
    all_w = torch.cat([c.weight.detach().abs().flatten() for c in convs])
    threshold = all_w.kthvalue(int(round(sparsity * all_w.numel()))).values
    masks = [(c.weight, (c.weight.detach().abs() > threshold).float()) for c in convs]
    with torch.no_grad():
        for p, m in masks:
            p.mul_(m)
    return masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "lenet_digits_pruned.onnx")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    t0 = time.perf_counter()
    xtr, ytr, xte, yte = data(a.seed)
    model = LeNetDigits()
    train(model, xtr, ytr, epochs=30, lr=1e-3, seed=a.seed)
    dense = accuracy(model, xte, yte)
    steps = []
    for i, step in enumerate((0.5, 0.75, a.sparsity)):
        masks = magnitude_masks(model, step)
        before = accuracy(model, xte, yte)
        train(model, xtr, ytr, epochs=15, lr=3e-4, masks=masks, seed=a.seed + 1 + i)
        steps.append({"conv_sparsity": step, "test_accuracy_pruned": before,
                      "test_accuracy_finetuned": accuracy(model, xte, yte)})
    pruned = steps[-1]["test_accuracy_finetuned"]
    total = sum(getattr(model, n).weight.numel() for n in ("conv1", "conv2"))
    zeros = sum(int((getattr(model, n).weight == 0).sum()) for n in ("conv1", "conv2"))
    conv_sparsity = {name: float((getattr(model, name).weight == 0).float().mean()) for name in ("conv1", "conv2")}
    model.eval()
    torch.onnx.export(model, (xte[:1],), str(a.out), input_names=["image"], output_names=["logits"],
                      dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    record = {
        "model": a.out.name, "dataset": "sklearn.datasets.load_digits (8x8, 1797 images)",
        "split": f"stratified 75/25, random_state={a.seed}", "train_images": len(xtr), "test_images": len(xte),
        "dense_test_accuracy": dense, "pruned_test_accuracy": pruned, "pruning_steps": steps,
        "conv_weight_sparsity_total": zeros / total, "conv_weight_sparsity": conv_sparsity,
        "command": "python models/train_lenet_digits.py", "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0, 1),
    }
    (HERE / "lenet_digits.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
