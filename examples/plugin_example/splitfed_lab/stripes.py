"""Write a toy data set for ``csv_images``: ``python -m splitfed_lab.stripes DIR``.

Class k of ``num_classes`` is an 8x8 image with a bright horizontal stripe at row k
(mod 8) plus Gaussian noise; a fixed seed, so the files are the same every time.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def write_stripes(directory, num_classes=4, train_size=400, test_size=100, noise=0.5,
                  seed=1234) -> None:
    """``directory``/train.csv and test.csv (the directory is created)."""
    gen = np.random.default_rng(seed)
    Path(directory).mkdir(parents=True, exist_ok=True)
    for name, size in (("train.csv", train_size), ("test.csv", test_size)):
        y = gen.integers(0, num_classes, size)
        x = gen.normal(0.0, noise, size=(size, 8, 8))
        x[np.arange(size), y % 8, :] += 1.0
        rows = np.column_stack([y, x.reshape(size, -1)])
        np.savetxt(Path(directory) / name, rows, delimiter=",",
                   fmt=["%d"] + ["%.4f"] * 64)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m splitfed_lab.stripes DIR")
    write_stripes(sys.argv[1])
    print(f"wrote {sys.argv[1]}/train.csv and test.csv")
