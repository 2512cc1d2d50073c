"""``stripes``: a synthetic image data set that needs no files.

Class k of ``num_classes`` is an 8x8 image with a bright horizontal stripe at row k
(mod 8) plus Gaussian noise; a fixed split, so that every run sees the same data."""

from __future__ import annotations

import numpy as np
import torch

from splitfed import register_dataset
from splitfed.data.datasets import ArrayDataset, DataBundle


def _images(labels: np.ndarray, noise: float, rng: np.random.Generator) -> torch.Tensor:
    x = rng.normal(0.0, noise, size=(len(labels), 1, 8, 8)).astype(np.float32)
    x[np.arange(len(labels)), 0, labels % 8, :] += 1.0
    return torch.from_numpy(x)


@register_dataset("stripes")
def load_stripes(data_dir, rng, num_classes=4, train_size=800, test_size=200, noise=0.5):
    """The loader: ``data_dir`` is not used; the parameters after ``rng`` are the
    options (``data.num_classes``, ...). The data come from their own seeded generator,
    independent of the run's seed."""
    gen = np.random.default_rng(1234)
    y_train = gen.integers(0, num_classes, train_size)
    y_test = gen.integers(0, num_classes, test_size)
    train = ArrayDataset(_images(y_train, noise, gen), torch.from_numpy(y_train))
    test = ArrayDataset(_images(y_test, noise, gen), torch.from_numpy(y_test))
    return DataBundle("stripes", train, test, int(num_classes), (1, 8, 8))
