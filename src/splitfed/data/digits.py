"""scikit-learn's bundled 8x8 digits (1797 images, 16 gray levels; no download).

Split: a fixed stratified 80/20 split, independent of the run's seed. With an internal
``np.random.default_rng(0)`` permutation, each class's samples (in permuted order) go to test
for the first ``round(0.2 * class_count)`` and to train for the rest: 1438 train / 359 test.
Pixels are divided by 16, then standardised with the train mean/std. Shape [N, 1, 8, 8].
"""

from __future__ import annotations

import numpy as np
import torch

from splitfed.data.datasets import ArrayDataset, DataBundle, labels_tensor, standardise
from splitfed.errors import DataError

TEST_FRACTION = 0.2
SPLIT_SEED = 0


def split_mask(y: np.ndarray, test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED):
    """Boolean test mask of a deterministic stratified split of labels ``y``."""
    perm = np.random.default_rng(seed).permutation(len(y))
    order = perm[np.argsort(y[perm], kind="stable")]
    _, starts, counts = np.unique(y[order], return_index=True, return_counts=True)
    rank = np.arange(len(y)) - np.repeat(starts, counts)
    n_test = np.rint(test_fraction * counts).astype(np.int64)
    mask = np.zeros(len(y), dtype=bool)
    mask[order] = rank < np.repeat(n_test, counts)
    return mask


def load_digits(data_dir: str | None, rng: np.random.Generator) -> DataBundle:
    """The 8x8 digits as a DataBundle (``data_dir`` and ``rng`` are not used)."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise DataError("the digits data set needs scikit-learn: pip install scikit-learn") from e
    raw = sk_load_digits()
    x = raw.images.astype(np.float32) / 16.0
    y = np.asarray(raw.target, dtype=np.int64)
    test = split_mask(y)
    train_x = torch.from_numpy(x[~test]).unsqueeze(1)
    test_x = torch.from_numpy(x[test]).unsqueeze(1)
    standardise(train_x, test_x)
    train = ArrayDataset(train_x, labels_tensor(y[~test], 10, "digits"))
    test_set = ArrayDataset(test_x, labels_tensor(y[test], 10, "digits"))
    return DataBundle("digits", train, test_set, 10, (1, 8, 8), [str(d) for d in range(10)])
