"""``csv_images``: a data set read from two CSV files in a directory the user names.

``data.data_dir`` holds ``train.csv`` and ``test.csv``, one sample per line: the label
(an integer from 0), then the pixel values in row-major order, comma-separated, e.g. for
8x8 grey images (``shape: [1, 8, 8]``)::

    2,0.0,0.13,...,0.98

Inputs are standardised per channel with the train split's mean and standard deviation,
as the built-in image loaders do. ``python -m splitfed_lab.stripes DIR`` writes a toy
data set in this format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from splitfed import register_dataset
from splitfed.data.datasets import ArrayDataset, DataBundle, labels_tensor, standardise
from splitfed.errors import ConfigError, DataError


def _read(path: Path, shape) -> tuple[np.ndarray, np.ndarray]:
    if not path.is_file():
        raise DataError(f"data file {path} not found (csv_images reads train.csv and "
                        "test.csv from data.data_dir)")
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2)
        return table[:, 0], table[:, 1:].reshape(len(table), *shape)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a CSV of label,{'x'.join(map(str, shape))} values "
                        f"per line ({e})") from None


@register_dataset("csv_images")
def load_csv_images(data_dir, rng, shape=(1, 8, 8), num_classes=None):
    """The loader: ``data_dir`` is the config's ``data.data_dir``; the parameters after
    ``rng`` are the options (``data.shape``, ``data.num_classes``: null, the largest
    train label + 1). Nothing here is random, so ``rng`` is not used."""
    if data_dir is None:
        raise ConfigError("data.data_dir: csv_images reads train.csv and test.csv from "
                          "a directory; set data.data_dir")
    (y_train, x_train), (y_test, x_test) = (_read(Path(data_dir) / f, shape)
                                            for f in ("train.csv", "test.csv"))
    classes = int(num_classes or y_train.max() + 1)
    x_train, x_test = standardise(torch.from_numpy(x_train), torch.from_numpy(x_test))
    train = ArrayDataset(x_train, labels_tensor(y_train, classes, "train.csv"))
    test = ArrayDataset(x_test, labels_tensor(y_test, classes, "test.csv"))
    return DataBundle("csv_images", train, test, classes, tuple(shape))
