"""Data sets and client partitioners.

``load_dataset(name, data_dir, rng=..., limit_train=..., limit_test=..., **options)`` returns a
:class:`DataBundle`; ``partition(labels, num_clients, scheme, rng, **params)`` splits train
indices among clients. Every loader in ``DATASETS`` is called as
``loader(data_dir, rng, **options)``; its keyword parameters after ``rng`` are its options.
Names are matched case-insensitively, with ``-`` read as ``_`` (``fashion-mnist`` works).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from splitfed.configtools import typed_options
from splitfed.data.cifar import load_cifar10, load_cifar100
from splitfed.data.datasets import ArrayDataset, DataBundle, limit_bundle
from splitfed.data.digits import load_digits
from splitfed.data.idx import load_fashion_mnist, load_mnist, read_idx
from splitfed.data.partition import PARTITIONERS, partition, partition_stats, partition_summary
from splitfed.data.synthetic import load_synthetic
from splitfed.data.text import load_sst2, load_synthetic_text
from splitfed.errors import ConfigError, DataError, out_of_memory_as
from splitfed.origins import call_plugin, component, origin

DEFAULT_DATASET = "fashion_mnist"
DATASETS = {
    "fashion_mnist": load_fashion_mnist,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "digits": load_digits,
    "synthetic": load_synthetic,
    "sst2": load_sst2,
    "synthetic_text": load_synthetic_text,
}

__all__ = [
    "DATASETS",
    "DEFAULT_DATASET",
    "PARTITIONERS",
    "ArrayDataset",
    "DataBundle",
    "dataset_key",
    "dataset_names",
    "dataset_options",
    "load_dataset",
    "partition",
    "partition_stats",
    "partition_summary",
    "read_idx",
]


def dataset_names() -> list[str]:
    """The registered data set names, sorted."""
    return sorted(DATASETS)


def dataset_options(name: str) -> dict[str, object]:
    """The options a loader accepts, with their defaults."""
    params = list(inspect.signature(_loader(name)).parameters.values())[2:]
    return {p.name: p.default for p in params}


def check_dataset_options(name: str, options) -> None:
    """ConfigError naming the keys of ``options`` that data set ``name``'s loader does not
    take (``rng`` among them: :func:`load_dataset` passes it)."""
    allowed = dataset_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"data: unknown option(s) {', '.join(unknown)} for dataset {name!r}; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )


def dataset_key(name: str) -> str:
    """A data set's registry key: ``name`` lower-cased, ``-`` read as ``_``."""
    return str(name).lower().replace("-", "_")


def _loader(name: str):
    key = dataset_key(name)
    if key not in DATASETS:
        raise ConfigError(f"data.name: unknown dataset {name!r}; "
                          f"known: {', '.join(dataset_names())}")
    return DATASETS[key]


def load_dataset(name: str, data_dir: str | None = None, *,
                 rng: np.random.Generator | None = None, limit_train: int | None = None,
                 limit_test: int | None = None, **options) -> DataBundle:
    """Load data set ``name``, optionally keeping random subsets of ``limit_*`` samples.

    ``rng`` drives the synthetic generator and the ``limit_*`` subsets; when None a fixed
    ``np.random.default_rng(0)`` is used, so results stay reproducible. Unknown options,
    options of the wrong type (checked against the loader's annotations, as
    :func:`splitfed.configtools.typed_options` does: ``data.iid=maybe`` on a boolean
    option, ``data.alpha=abc`` or ``1e300`` on a float one) or out-of-range limits raise
    ConfigError naming ``data.<option>``; missing or corrupt files raise DataError.
    """
    loader = _loader(name)
    check_dataset_options(name, options)
    options = typed_options(loader, options, "data")
    rng = np.random.default_rng(0) if rng is None else rng
    key = dataset_key(name)
    with out_of_memory_as(lambda e: DataError(
            f"data.name: this machine has not the memory to load "
            f"{component('dataset', key)} (from {data_dir or 'its default'}); its files "
            "declare more than fits")):
        bundle = call_plugin("dataset", key, "data.name", loader, data_dir, rng, **options)
    if origin("dataset", key) is not None:
        check_bundle(bundle, key)
    for split in ("train", "test"):      # an empty test set would report accuracy 0
        if len(getattr(bundle, split)) == 0:
            raise DataError(f"data.name: the {split} split of {component('dataset', key)} "
                            "holds no samples")
    return limit_bundle(bundle, rng, limit_train, limit_test)


def check_bundle(bundle, name: str) -> None:
    """What the loader of a plugin's data set ``name`` returned, checked: a
    :class:`DataBundle` whose splits are :class:`ArrayDataset` s of ``input_shape``-shaped
    rows and 1-D integer labels in ``[0, num_classes)``; anything else raises
    :class:`~splitfed.errors.PluginError` naming the data set and its plugin."""
    from splitfed.errors import PluginError

    def bad(what: str) -> PluginError:
        return PluginError(f"data.name: {component('dataset', name)} {what}; its loader must "
                           "return a DataBundle (docs/extending.md, A custom data set)")

    if not isinstance(bundle, DataBundle):
        raise bad(f"returned {type(bundle).__name__}")
    k = bundle.num_classes
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise bad(f"has num_classes {k!r}, not a positive integer")
    shape = bundle.input_shape
    if (not isinstance(shape, (tuple, list)) or not shape
            or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d > 0
                       for d in shape)):
        raise bad(f"has input_shape {shape!r}, not a tuple of positive integers")
    for split in ("train", "test"):
        data = getattr(bundle, split)
        if not isinstance(data, ArrayDataset):
            raise bad(f"has a {split} split of type {type(data).__name__}, not an ArrayDataset")
        x, y = data.x, data.y
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            raise bad(f"has {split}.x or {split}.y that is not a torch tensor")
        if tuple(x.shape[1:]) != tuple(int(d) for d in shape):
            raise bad(f"has {split} samples of shape {tuple(x.shape[1:])}, but input_shape "
                      f"{tuple(shape)}")
        if y.dim() != 1 or y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise bad(f"has {split} labels of dtype {y.dtype} and shape {tuple(y.shape)}; "
                      "labels are a 1-D integer tensor")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= int(k)):
            raise bad(f"has {split} labels from {int(y.min())} to {int(y.max())}, outside "
                      f"0..{int(k) - 1} (num_classes {int(k)})")
