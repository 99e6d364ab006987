"""The files under models/ that the tests read: the shipped pruned LeNet
(ONNX) and its digits test split."""
from pathlib import Path

MODELS = Path(__file__).resolve().parent.parent / "models"
LENET = MODELS / "lenet_digits_pruned.onnx"
DIGITS = MODELS / "digits_test.npz"
