"""In-memory data containers and the helpers every loader shares.

A data set is held as two tensors (inputs and labels) per split, never as per-sample Python
objects. Image loaders turn raw pixels into float32 in [0, 1] and then standardise each channel
with the mean and (population) standard deviation of the *train* split:

    x' = (x / scale - mean_c) / std_c,   mean_c, std_c computed on train, applied to train and test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from splitfed import files
from splitfed.errors import ConfigError, DataError, preview


@dataclass
class ArrayDataset:
    """Inputs ``x`` (float32 [N, *input_shape], already normalised) and labels ``y`` (int64 [N])."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise DataError(f"x has {len(self.x)} rows but y has {len(self.y)}")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, idx) -> ArrayDataset:
        """The rows ``idx`` (array-like of ints or a tensor), in that order."""
        index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ArrayDataset(self.x[index], self.y[index])


@dataclass
class DataBundle:
    """A train/test pair plus what models and partitioners need to know about it.

    ``natural_partition`` holds per-client index arrays into ``train`` when the data set is
    federated by nature (``synthetic``); it is None otherwise.
    """

    name: str
    train: ArrayDataset
    test: ArrayDataset
    num_classes: int
    input_shape: tuple[int, ...]
    classes: list[str] | None = None
    natural_partition: list[np.ndarray] | None = None


def find_file(name: str, dirs: Sequence[Path], how_to: str, gz: bool = False) -> Path:
    """The first existing ``dir/name`` (or ``dir/name.gz`` when ``gz``), in the order of ``dirs``.

    Raises DataError (one line) listing every path looked at, followed by ``how_to``, or
    naming the first existing path if it is not a regular file (:func:`check_regular`).
    """
    tried = []
    for d in dirs:
        for candidate in (name, name + ".gz") if gz else (name,):
            path = Path(d) / candidate
            tried.append(str(path))
            if path.exists():
                check_regular(path)
                return path
    looked = ", ".join(tried)
    raise DataError(f"data file {name!r} not found; looked at: {looked}. {how_to}")


def check_regular(path: Path) -> None:
    """DataError naming ``path`` if it is not a regular file (a symbolic link to one is
    fine): a directory, a pipe, a socket or a device is refused before it is opened (a
    pipe with no writer would block the process, a device never ends)."""
    try:
        files.check_regular(path, str(path), error=DataError)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from e


def open_regular(path: Path, mode: str = "rb", **kwargs):
    """``path`` opened for reading (:func:`splitfed.files.open_regular`): DataError naming
    it if what was opened is not a regular file, as :func:`check_regular` words it."""
    return files.open_regular(path, str(path), mode, error=DataError, **kwargs)


def int_option(where: str, name: str, value, low: int, high: int) -> int:
    """``value`` as an int in [low, high]; ConfigError naming the key ``data.name``
    (and the data set ``where``, unless it is ``"data"``) otherwise."""
    ok = not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))
    if not ok or not low <= value <= high:
        of = "" if where == "data" else f" ({where})"
        raise ConfigError(f"data.{name}: must be an integer in [{low}, {high}]{of}, "
                          f"got {value!r}")
    return int(value)


def check_file_size(path: Path, limit: int, what: str) -> None:
    """DataError naming ``path`` if it is not a regular file (:func:`check_regular`) or
    is larger than ``limit`` bytes."""
    check_regular(path)
    size = os.stat(path).st_size
    if size > limit:
        raise DataError(f"{path}: {size} bytes, more than the {limit} a {what} may have")


def to_unit_float(raw: np.ndarray, scale: float) -> torch.Tensor:
    """Raw integer pixels -> float32 tensor in [0, 1] (divided by ``scale``)."""
    raw = np.ascontiguousarray(raw)
    if not raw.flags.writeable:  # e.g. np.frombuffer over bytes; torch wants writable memory
        raw = raw.copy()
    return torch.from_numpy(raw).to(torch.float32).div_(scale)


def standardise(train_x: torch.Tensor, test_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardise channel 1 of [N, C, ...] tensors in place with the train mean/std.

    A channel whose train std is 0 is only centred (its std is taken as 1).
    """
    dims = [0] + list(range(2, train_x.dim()))
    var, mean = torch.var_mean(train_x, dim=dims, correction=0)
    std = var.sqrt()
    std[std == 0] = 1.0
    shape = [1, -1] + [1] * (train_x.dim() - 2)
    mean, std = mean.view(shape), std.view(shape)
    train_x.sub_(mean).div_(std)
    test_x.sub_(mean).div_(std)
    return train_x, test_x


def labels_tensor(labels: np.ndarray, num_classes: int, source: str) -> torch.Tensor:
    """Int64 label tensor; DataError naming ``source`` if the labels are not a 1-D array of
    whole numbers or any label is outside [0, num_classes)."""
    try:
        y = np.asarray(labels)
    except (TypeError, ValueError) as e:  # ragged lists
        raise DataError(f"{source}: labels are not a flat list of integers ({e})") from e
    if y.ndim != 1:
        raise DataError(f"{source}: labels must be one integer per sample, got shape {y.shape}")
    whole = np.issubdtype(y.dtype, np.integer) or (
        np.issubdtype(y.dtype, np.floating) and bool(np.all(np.isfinite(y)))
        and bool(np.all(y == np.round(y))))
    if y.size and not whole:
        raise DataError(f"{source}: labels must be integers, got dtype {y.dtype} "
                        f"(e.g. {preview(y.ravel()[0])})")
    if y.size and (y.min() < 0 or y.max() >= num_classes):   # the file's values, uncast
        lo, hi = (v.item() if np.issubdtype(y.dtype, np.integer) else v
                  for v in (y.min(), y.max()))
        raise DataError(
            f"{source}: labels out of range [0, {num_classes}): found min {lo}, max {hi}"
        )
    return torch.from_numpy(np.ascontiguousarray(y.astype(np.int64, copy=False)))


def limit_bundle(
    bundle: DataBundle, rng: np.random.Generator, limit_train: int | None, limit_test: int | None
) -> DataBundle:
    """Keep a random subset (drawn with ``rng``, original order kept) of each split.

    A natural partition is remapped to the kept train rows (dropped rows leave their client).
    """
    picks = {}
    for field, limit, split in (("limit_train", limit_train, bundle.train),
                                ("limit_test", limit_test, bundle.test)):
        if limit is None:
            continue
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
            raise ConfigError(f"data.{field}: must be a positive integer or null, got {limit!r}")
        if limit > len(split):
            raise ConfigError(
                f"data.{field}: {limit} exceeds the {len(split)} samples of {bundle.name!r}"
            )
        picks[field] = np.sort(rng.choice(len(split), size=int(limit), replace=False))
    if "limit_train" in picks:
        keep = picks["limit_train"]
        if bundle.natural_partition is not None:
            pos = np.full(len(bundle.train), -1, dtype=np.int64)
            pos[keep] = np.arange(len(keep))
            bundle.natural_partition = [pos[p][pos[p] >= 0] for p in bundle.natural_partition]
        bundle.train = bundle.train.subset(keep)
    if "limit_test" in picks:
        bundle.test = bundle.test.subset(picks["limit_test"])
    return bundle
