"""Write models/digits_test.npz: the test split the shipped LeNet was scored on.

    python models/make_digits_test_set.py

scikit-learn's bundled 8x8 digits (no download), scaled to [0, 1], stratified
75/25 split with random_state=0, exactly as models/train_lenet_digits.py does.
Keys: `image` (450, 1, 8, 8) float32 (named after the ONNX graph input) and
`label` (450,) int64. Used by `sparseconv run ... --data` and the tests."""
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

OUT = Path(__file__).resolve().parent / "digits_test.npz"


def digits_test_split(seed: int = 0):
    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[:, None]
    _, x_test, _, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=seed,
                                            stratify=digits.target)
    return x_test, y_test.astype(np.int64)


if __name__ == "__main__":
    x, y = digits_test_split()
    np.savez_compressed(OUT, image=x, label=y)
    print(f"wrote {OUT}: {x.shape[0]} images")
