"""The synthetic(alpha, beta) federated benchmark of FedProx (Li et al., 2020, Sec. 5.1).

For device k (N(m, s) below has mean m and *standard deviation* s, as numpy's ``normal``):

    u_k ~ N(0, alpha),  B_k ~ N(0, beta)
    W_k ~ N(u_k, 1)  [num_classes x dim],   b_k ~ N(u_k, 1)  [num_classes]
    v_k ~ N(B_k, 1)  [dim]   (each entry drawn around B_k)
    x ~ N(v_k, Sigma),  Sigma diagonal with Sigma_jj = j^(-1.2), j = 1..dim
    y = argmax softmax(W_k x + b_k) = argmax(W_k x + b_k)

Device sizes follow their code: ``lognormal(4, 2, num_devices).astype(int) + 50``.
``iid=True`` is their synthetic_iid: one shared W, b ~ N(0, 1) and v_k = 0 for every device.

Each device's samples are split in order: the first ``max(1, int((1 - test_fraction) * n_k))``
go to train, the rest to test. ``train`` concatenates the devices' train samples in device
order; ``natural_partition[k]`` are device k's (contiguous) rows of ``train``. Features are
float32 and are not standardised; a ``beta`` so large that a feature would exceed float32's
range is refused (ConfigError naming ``data.beta``). Everything is drawn from ``rng``: same
seed, same data.
"""

from __future__ import annotations

import numpy as np
import torch

from splitfed.configtools import FLOAT32_MAX
from splitfed.data.datasets import ArrayDataset, DataBundle
from splitfed.errors import ConfigError


#: upper bounds of the generator's sizes, and of the values it may draw in all
MAX_DEVICES = 10**5
MAX_DIM = 10**5
MAX_CLASSES = 10**4
MAX_VALUES = 10**8


def _check(alpha, beta, num_devices, dim, num_classes, test_fraction, iid) -> None:
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not _is_number(value) or not np.isfinite(value) or value < 0:
            raise ConfigError(f"data.{name}: must be a finite number >= 0 (synthetic), got "
                              f"{value!r}")
    for name, value, low, high in (("num_devices", num_devices, 1, MAX_DEVICES),
                                   ("dim", dim, 1, MAX_DIM),
                                   ("num_classes", num_classes, 2, MAX_CLASSES)):
        if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                or not low <= value <= high):
            raise ConfigError(f"data.{name}: must be an integer in [{low}, {high}] (synthetic), "
                              f"got {value!r}")
    if num_classes * dim * num_devices > MAX_VALUES:
        raise ConfigError(f"data.num_devices: {num_devices} x num_classes={num_classes} "
                          f"x dim={dim} weights exceed {MAX_VALUES} values; lower one of "
                          "data.num_devices, data.num_classes, data.dim")
    if not _is_number(test_fraction) or not 0 < test_fraction < 1:
        raise ConfigError(f"data.test_fraction: must be in (0, 1) (synthetic), got "
                          f"{test_fraction!r}")
    if not isinstance(iid, (bool, np.bool_)):
        raise ConfigError(f"data.iid: must be true or false (synthetic), got {iid!r}")


def _check_features(xtr: np.ndarray, xte: np.ndarray, beta) -> None:
    """The features must fit float32, the type the models train in: a huge ``beta``
    (the spread of the devices' means v_k) draws features beyond it, which would become
    infinite."""
    largest = max((float(np.abs(x).max()) for x in (xtr, xte) if x.size), default=0.0)
    if not largest <= FLOAT32_MAX:
        raise ConfigError(f"data.beta: {beta!r} draws features of magnitude {largest:.3g}, "
                          f"beyond float32's largest {FLOAT32_MAX:.3g}; lower data.beta "
                          "(the spread of the devices' feature means)")


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_))


def _device(rng, n, W, b, v, sd):
    """n samples x ~ N(v, diag(sd^2)) with labels argmax(W x + b)."""
    x = v + sd * rng.standard_normal((n, len(v)))
    return x, np.argmax(x @ W.T + b, axis=1).astype(np.int64)


def generate(rng: np.random.Generator, alpha=1.0, beta=1.0, num_devices=30, dim=60,
             num_classes=10, iid=False) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per device (x [n_k, dim] float64, y [n_k] int64), drawn as in the module docstring."""
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    if int(sizes.sum()) * dim > MAX_VALUES:
        raise ConfigError(f"synthetic: {num_devices} devices draw {int(sizes.sum())} samples "
                          f"of dim={dim}, more than {MAX_VALUES} values; lower "
                          "data.num_devices or data.dim")
    u = rng.normal(0, alpha, num_devices)
    B = rng.normal(0, beta, num_devices)
    sd = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)
    if iid:
        v = np.zeros((num_devices, dim))
        W_shared = rng.normal(0, 1, (num_classes, dim))
        b_shared = rng.normal(0, 1, num_classes)
    else:
        v = rng.normal(B[:, None], 1, (num_devices, dim))
    out = []
    for k in range(num_devices):
        if iid:
            W, b = W_shared, b_shared
        else:
            W = rng.normal(u[k], 1, (num_classes, dim))
            b = rng.normal(u[k], 1, num_classes)
        out.append(_device(rng, int(sizes[k]), W, b, v[k], sd))
    return out


def load_synthetic(data_dir: str | None, rng: np.random.Generator, alpha: float = 1.0,
                   beta: float = 1.0, num_devices: int = 30, dim: int = 60,
                   num_classes: int = 10, test_fraction: float = 0.2,
                   iid: bool = False) -> DataBundle:
    """synthetic(alpha, beta) as a DataBundle with ``natural_partition`` (``data_dir`` unused)."""
    _check(alpha, beta, num_devices, dim, num_classes, test_fraction, iid)
    devices = generate(rng, alpha, beta, num_devices, dim, num_classes, bool(iid))
    n_train = [max(1, int((1 - test_fraction) * len(y))) for _, y in devices]
    xtr = np.concatenate([x[:m] for (x, _), m in zip(devices, n_train)])
    ytr = np.concatenate([y[:m] for (_, y), m in zip(devices, n_train)])
    xte = np.concatenate([x[m:] for (x, _), m in zip(devices, n_train)])
    yte = np.concatenate([y[m:] for (_, y), m in zip(devices, n_train)])
    if len(yte) == 0:
        raise ConfigError(f"data.test_fraction: {test_fraction!r} leaves no test samples "
                          f"of the {len(ytr)}; give a larger fraction")
    _check_features(xtr, xte, beta)
    bounds = np.cumsum([0, *n_train])
    parts = [np.arange(bounds[k], bounds[k + 1], dtype=np.int64) for k in range(num_devices)]
    train = ArrayDataset(torch.from_numpy(xtr.astype(np.float32)), torch.from_numpy(ytr))
    test = ArrayDataset(torch.from_numpy(xte.astype(np.float32)), torch.from_numpy(yte))
    return DataBundle("synthetic", train, test, num_classes, (dim,), None, parts)


#: the options' help (``splitfed config explain NAME``, docs/config.md)
load_synthetic.option_help = {
    "alpha": "standard deviation of u_k ~ N(0, alpha), the mean of device k's W_k and b_k: "
             "how much the devices' labelling models differ (a finite number >= 0)",
    "beta": "standard deviation of B_k ~ N(0, beta), the mean of device k's feature means "
            "v_k: how much the devices' features differ (a finite number >= 0)",
    "num_devices": "devices, the natural partition's clients, each with lognormal(4, 2) + 50 "
                   "samples (an integer from 1 to 100000)",
    "dim": "features per sample (an integer from 1 to 100000)",
    "num_classes": "classes (an integer from 2 to 10000)",
    "test_fraction": "the share of each device's samples that goes to the test set "
                     "(0 < test_fraction < 1)",
    "iid": "FedProx's synthetic_iid: one shared W, b ~ N(0, 1) and v_k = 0 for every device",
}
